"""The ``reward`` kind: a reward model trained on preference pairs (prompt, chosen reply, rejected reply).

The model (``lmforge.models.reward.RewardModel``) is a chat model's transformer trunk with a scalar
head, started from an sft checkpoint (``training.init_from``); its loss is Bradley-Terry on each pair's
rewards, read at each reply's last token, with an optional margin column and reward centering.
Held-out pair accuracy picks ``checkpoints/best``. ``cli`` adds `lmforge eval CKPT --preferences`,
``cli_data`` `lmforge data preferences` (generated tool-calling pairs).
"""

from __future__ import annotations

from typing import Any

from lmforge.models.reward import RewardModel
from lmforge.recipes import CLIOptions, Counts, RecipeSpec, flops_per_token, register
from lmforge.recipes.reward import cli, cli_data
from lmforge.recipes.reward.data import RewardSettings, build_reward_data, prepare_model


def count(model, batch: dict[str, Any]) -> Counts:
    """Real tokens (padding not counted) and pairs."""
    tokens = int((batch["sequence_ids"] >= 0).sum())
    return Counts(tokens=tokens, examples=int(batch["num_examples"]),
                  flops=tokens * flops_per_token(model, batch["input_ids"].shape[1]))


SPEC = register(RecipeSpec(
    name="reward",
    summary="a reward model (a chat model's trunk + a scalar head) trained on preference pairs, Bradley-Terry loss",
    families=(RewardModel,),
    build_data=build_reward_data,
    count=count,
    settings=RewardSettings,
    prepare_model=prepare_model,
    best_metric="eval/accuracy",
    best_higher_is_better=True,
    eval_weight=lambda batch: float(batch["num_examples"]),  # means over pairs, not tokens
    eval=CLIOptions(run=cli.run_eval, add=cli.add_eval_args, uses=("batch-size",),
                    help="held-out pair accuracy and margin, per kind of rejected reply"),
    add_data_verbs=cli_data.add_data_verbs,
    supports_fsdp=True,
))

__all__ = ["SPEC", "RewardSettings"]
