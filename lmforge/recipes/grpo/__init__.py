"""The ``grpo`` kind: Group Relative Policy Optimization of a gpt-family chat model with reward functions.

It starts from a chat model (``training.init_from``, typically an sft run). Each rollout samples a
group of completions for each of a few prompts with the model being trained (the server's KV-cached,
continuously batched engine), scores them with reward functions named in the config
(``lmforge.posttrain.rewards``: tool calls, exact answers, Go that parses or builds, a reward model,
or the user's own ``module:function``), and pushes up the completions that beat their group's mean,
with PPO's clipped ratio and an optional KL penalty to the frozen starting model. The rollout happens
in the train loader (bound to the live model), so checkpoints, exact resume, SIGTERM, logging and DDP
all come from the one training loop. Held-out prompts answered greedily and scored by the same
rewards pick ``checkpoints/best``. See ``docs/grpo.md``.
"""

from __future__ import annotations

from typing import Any

from lmforge.recipes import CLIOptions, Counts, Family, Lazy, RecipeSpec, flops_per_token, register
from lmforge.recipes.grpo import cli


def count(model, batch: dict[str, Any]) -> Counts:
    """Tokens: the completion tokens learnt from; examples: completions. FLOPs: the forward and
    backward over every real position, prompts included (generation is not counted)."""
    from lmforge.models.losses import IGNORE_INDEX  # imports torch, which the batch's tensors have imported

    positions = int((batch["document_ids"] >= 0).sum())
    return Counts(tokens=int((batch["labels"] != IGNORE_INDEX).sum()), examples=int(batch["num_examples"]),
                  flops=positions * flops_per_token(model, batch["input_ids"].shape[1]))


SPEC = register(RecipeSpec(
    name="grpo",
    summary="group relative policy optimization (gpt family): sampled completions scored by reward functions",
    families=(Family("gpt", "lmforge.models.gpt:GPT"),),
    build_data=Lazy("lmforge.recipes.grpo.data:build_grpo_data"),
    count=count,
    settings=Lazy("lmforge.recipes.grpo.data:GRPOSettings"),
    loss=Lazy("lmforge.recipes.grpo.loss:grpo_loss"),
    best_metric="eval/reward",
    best_higher_is_better=True,
    eval_weight=lambda batch: float(len(batch["eval_total"])),  # held-out figures are means over prompts
    eval=CLIOptions(run=cli.run_eval, add=cli.add_eval_args, uses=("baseline", "batch-size"),
                    help="held-out reward of a checkpoint's greedy replies, by reward function"),
    supports_fsdp=True,  # rollouts gather one model at a time (ModelHost.gathered)
))
