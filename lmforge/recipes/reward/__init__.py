"""The ``reward`` kind: a reward model trained on preference pairs (prompt, chosen reply, rejected reply).

The model (``lmforge.models.reward.RewardModel``) is a chat model's transformer trunk with a scalar
head, started from an sft checkpoint (``training.init_from``); its loss is Bradley-Terry on each pair's
rewards, read at each reply's last token, with an optional margin column and reward centering.
Held-out pair accuracy picks ``checkpoints/best``. ``cli`` adds `lmforge eval CKPT --preferences`,
``cli_data`` `lmforge data preferences` (generated tool-calling pairs).
"""

from __future__ import annotations

from typing import Any

from lmforge.recipes import CLIOptions, Counts, Family, Lazy, RecipeSpec, flops_per_token, register
from lmforge.recipes.reward import cli, cli_data


def count(model, batch: dict[str, Any]) -> Counts:
    """Real tokens (padding not counted) and pairs."""
    tokens = int((batch["sequence_ids"] >= 0).sum())
    return Counts(tokens=tokens, examples=int(batch["num_examples"]),
                  flops=tokens * flops_per_token(model, batch["input_ids"].shape[1]))


SPEC = register(RecipeSpec(
    name="reward",
    summary="a reward model (a chat model's trunk + a scalar head) trained on preference pairs, Bradley-Terry loss",
    families=(Family("reward", "lmforge.models.reward:RewardModel"),),
    build_data=Lazy("lmforge.recipes.reward.data:build_reward_data"),
    count=count,
    settings=Lazy("lmforge.recipes.reward.data:RewardSettings"),
    prepare_model=Lazy("lmforge.recipes.reward.data:prepare_model"),
    best_metric="eval/accuracy",
    best_higher_is_better=True,
    eval_weight=lambda batch: float(batch["num_examples"]),  # means over pairs, not tokens
    eval=CLIOptions(run=cli.run_eval, add=cli.add_eval_args, uses=("batch-size",),
                    help="held-out pair accuracy and margin, per kind of rejected reply"),
    add_data_verbs=cli_data.add_data_verbs,
    supports_fsdp=True,
))
