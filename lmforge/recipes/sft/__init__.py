"""The ``sft`` kind: supervised fine-tuning of a gpt-family model on conversations, tool calls included.

Conversations come in the layouts people publish them in (``formats``), are rendered with the chat
template the model is served with and masked so the loss covers the assistant's replies only
(``render``), and are packed several to a row without attention between them (``packing``).
``toolcalls`` writes a synthetic tool-calling set and scores a model's calls through the server's own
parser; ``cli`` adds `lmforge data sft`, `lmforge data tool-calls` and `lmforge eval --tool-calls`.
"""

from __future__ import annotations

from typing import Any

from lmforge.recipes import CLIOptions, Counts, Family, Lazy, RecipeSpec, flops_per_token, register
from lmforge.recipes.sft import cli


def count(model, batch: dict[str, Any]) -> Counts:
    """Real tokens only: padding is not counted (packed rows have little or none)."""
    documents = batch["document_ids"]
    tokens = int((documents >= 0).sum())
    return Counts(tokens=tokens, examples=int(batch["num_examples"]),
                  flops=tokens * flops_per_token(model, documents.shape[1]))


SPEC = register(RecipeSpec(
    name="sft",
    summary="chat and tool-calling fine-tuning (gpt family): loss on the assistant's replies, packed conversations",
    families=(Family("gpt", "lmforge.models.gpt:GPT"),),
    build_data=Lazy("lmforge.recipes.sft.data:build_sft_data"),
    count=count,
    settings=Lazy("lmforge.recipes.sft.data:SFTSettings"),
    eval=CLIOptions(run=cli.run_eval, add=cli.add_eval_args, uses=("baseline", "batch-size"),
                    help="tool-call figures on held-out conversations, before and after fine-tuning"),
    add_data_verbs=cli.add_data_verbs,
    supports_fsdp=True,
))
