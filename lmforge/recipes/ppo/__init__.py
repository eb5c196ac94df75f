"""The ``ppo`` kind: proximal policy optimisation of a gpt-family chat model against a reward model
(seed 004's stage 4: "train a reward model on preferences, then PPO ``--ppo-epochs 4``, lr 1e-6, from
the tool model").

It trains a policy (from ``training.init_from``, typically the sft run) and a value model (from the
reward model, ``recipe.reward_model``). Each rollout samples replies with the live policy (the
server's KV-cached, continuously batched engine), scores them (the reward model and/or reward
functions, ``lmforge.posttrain.rewards``), adds a per-token KL penalty to the frozen starting model,
estimates advantages with GAE, and takes ``ppo_epochs`` passes of clipped policy and value updates over
it. The rollout happens in the train loader (bound to the live model), so checkpoints, exact resume,
SIGTERM, logging and DDP come from the one training loop; every checkpoint is the policy as an
ordinary gpt model directory (the value model in its ``value/``). See ``docs/ppo.md``.
"""

from __future__ import annotations

from typing import Any

from lmforge.recipes import Counts, Family, Lazy, RecipeSpec, flops_per_token, register


def count(model, batch: dict[str, Any]) -> Counts:
    """Tokens: the reply tokens learnt from; examples: replies. FLOPs: forward and backward of policy and
    value model over every real position, prompts included (generation is not counted)."""
    from lmforge.models.losses import IGNORE_INDEX  # imports torch, which the batch's tensors have imported

    positions = int((batch["document_ids"] >= 0).sum())
    return Counts(tokens=int((batch["labels"] != IGNORE_INDEX).sum()), examples=int(batch["num_examples"]),
                  flops=positions * flops_per_token(model, batch["input_ids"].shape[1]))


SPEC = register(RecipeSpec(
    name="ppo",
    summary="proximal policy optimization (policy + value model) against a reward model or reward functions",
    families=(Family("actor_critic", "lmforge.recipes.ppo.model:ActorCritic"),),
    build_data=Lazy("lmforge.recipes.ppo.data:build_ppo_data"),
    count=count,
    settings=Lazy("lmforge.recipes.ppo.data:PPOSettings"),
    prepare_model=Lazy("lmforge.recipes.ppo.data:prepare_model"),
    best_metric="eval/reward",
    best_higher_is_better=True,
    eval_weight=lambda batch: float(len(batch["eval_total"])),  # held-out figures are means over prompts
    supports_fsdp=True,  # rollouts gather one model at a time; step checkpoints are gathered (two models)
))
