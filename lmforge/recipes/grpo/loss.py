"""The grpo kind's objective, and its evaluation figures.

Per completion token ``t`` of completion ``i`` (advantage ``A_i``, probability ratio
``ρ_t = π(y_t) / π_old(y_t)``, KL estimate ``k3_t`` to the frozen reference)::

    loss_t = -min(ρ_t A_i, clip(ρ_t, 1 - ε, 1 + ε_high) A_i) + β k3_t

summed with the per-token weights the loader put in the batch (``loss_weights``: a mean over the
tokens, the sequences, or a constant, per optimizer step). With one update per rollout ``π_old`` is
the policy itself (``ρ = 1``, the gradient of ``A log π``), as in TRL when ``num_iterations = 1``.
"""

from __future__ import annotations

from typing import Any

import torch

from lmforge.models.losses import IGNORE_INDEX
from lmforge.posttrain.logprobs import token_logprobs
from lmforge.posttrain.rollout import clipped_surrogate, held_out_figures, k3_kl


def policy_loss(logp: torch.Tensor, batch: dict[str, Any], objective: dict[str, float]
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO loss of a micro-batch given the policy's per-token log-probs ``logp`` (``[B, T]``,
    aligned with ``batch["labels"]``), and its metrics: ``clip_frac`` (completion tokens whose clipped
    branch was taken) and ``kl`` (mean k3 estimate) when ``beta > 0``."""
    scored = (batch["labels"] != IGNORE_INDEX).float()
    tokens = scored.sum().clamp(min=1.0)
    old = batch["old_logprobs"] if "old_logprobs" in batch else logp.detach()
    per_token, clipped = clipped_surrogate(logp, old, batch["advantages"], objective["epsilon"],
                                           objective["epsilon_high"])
    metrics = {"clip_frac": (clipped.float() * scored).sum() / tokens}
    if objective["beta"] > 0:
        kl = k3_kl(logp, batch["ref_logprobs"])
        per_token = per_token + objective["beta"] * kl
        metrics["kl"] = ((kl * scored).sum() / tokens).detach()
    loss = (per_token * batch["loss_weights"] * scored).sum()
    return loss, metrics


def grpo_loss(model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
    """``RecipeSpec.loss`` of the grpo kind: a rollout micro-batch's loss and metrics (the rollout's
    figures included), or a held-out batch's figures."""
    if "eval_total" in batch:
        return held_out_figures(batch)
    objective = batch["objective"]
    logp, entropy = token_logprobs(model, batch, with_entropy=True, temperature=objective["temperature"])
    loss, metrics = policy_loss(logp, batch, objective)
    scored = (batch["labels"] != IGNORE_INDEX).float()
    metrics["entropy"] = ((entropy.detach() * scored).sum() / scored.sum().clamp(min=1.0))
    metrics.update(batch["rollout_stats"])
    return loss, metrics
