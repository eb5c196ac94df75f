"""The ``dpo`` kind: Direct Preference Optimization of a gpt-family chat model on preference pairs.

It starts from a fine-tuned chat model (``training.init_from``, typically an sft run) and learns from
pairs of replies to the same prompt, one preferred (chosen) and one not (rejected), against a frozen
reference (the starting model unless ``recipe.reference_path`` names another). ``data`` reads, renders
and packs the pairs and checks the models; ``reference`` precomputes the reference's log-probs or keeps
it for the loss; ``loss`` is the objective and its metrics. See ``docs/dpo.md``.
"""

from __future__ import annotations

from typing import Any

from lmforge.recipes import Counts, Family, Lazy, RecipeSpec, flops_per_token, register


def count(model, batch: dict[str, Any]) -> Counts:
    """Real tokens (padding not counted) and pairs. FLOPs: the policy's forward and backward, plus a
    reference forward (a third of that) when the reference runs live instead of coming with the batch."""
    sequences = batch["sequence_ids"]
    tokens = int((sequences >= 0).sum())
    flops = tokens * flops_per_token(model, sequences.shape[1])
    if "ref_logps" not in batch:
        flops *= 4 / 3
    return Counts(tokens=tokens, examples=int(batch["num_examples"]), flops=flops)


SPEC = register(RecipeSpec(
    name="dpo",
    summary="direct preference optimization (gpt family): chosen vs rejected replies against a frozen reference",
    families=(Family("gpt", "lmforge.models.gpt:GPT"),),
    build_data=Lazy("lmforge.recipes.dpo.data:build_dpo_data"),
    count=count,
    settings=Lazy("lmforge.recipes.dpo.data:DPOSettings"),
    loss=Lazy("lmforge.recipes.dpo.loss:dpo_loss"),
    # The held-out DPO loss: it weighs how far each pair is ranked right, where accuracy only counts
    # signs, ties on small sets and saturates early (see docs/dpo.md).
    best_metric="eval/loss",
    eval_weight=lambda batch: float(batch["num_examples"]),  # evaluation means are per pair
    supports_fsdp=True,
))
