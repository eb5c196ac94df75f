"""PPO's arithmetic: per-token rewards, generalised advantage estimation, the clipped losses, and the
kind's ``loss``.

Positions follow the training layout: position ``t`` holds the state (the tokens up to and including
``t``) and its label is the action (token ``t + 1``). The rollout functions (``token_rewards``,
``gae``, ``whiten``) work on one rollout's ``[N, L]`` tensors: ``N`` completions, column ``j`` the
``j``-th completion token, ``mask`` 1 on real tokens. The update (``ppo_loss``) works on packed
micro-batches, whose per-token values sit at the label positions (``lmforge.posttrain.rollout``).
"""

from __future__ import annotations

from typing import Any

import torch

from lmforge.models.losses import IGNORE_INDEX
from lmforge.posttrain.logprobs import token_logprobs
from lmforge.posttrain.rollout import clipped_surrogate, held_out_figures


def token_rewards(scores: torch.Tensor, logp_old: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor,
                  kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards ``-kl_coef * (log pi_old - log pi_ref)`` on every action, plus the sequence's
    score (``[N]``) on its last action; and the per-token KL estimate itself (``[N, L]``, masked)."""
    kl = (logp_old - logp_ref) * mask
    rewards = -kl_coef * kl
    last = mask.sum(1).long().clamp(min=1) - 1  # completions start at column 0
    rewards = rewards.scatter_add(1, last[:, None], scores[:, None].to(rewards.dtype))
    return rewards * mask, kl


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each row's actions (columns ``0 .. length - 1``; the state
    after the last action is terminal, worth 0): advantages and returns (``advantages + values``)."""
    N, L = rewards.shape
    advantages = torch.zeros_like(rewards)
    running = torch.zeros(N, dtype=rewards.dtype, device=rewards.device)
    next_value = torch.zeros(N, dtype=rewards.dtype, device=rewards.device)
    for t in range(L - 1, -1, -1):  # L is the reply length (tens of tokens), each step vectorised over N
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(m > 0, delta + gamma * lam * running, torch.zeros_like(running))
        advantages[:, t] = running
        next_value = torch.where(m > 0, values[:, t], torch.zeros_like(next_value))
    return advantages * mask, (advantages + values) * mask


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``x`` normalised to unit variance over the masked entries (and zero mean with ``shift_mean``)."""
    n = mask.sum().clamp(min=1)
    mean = (x * mask).sum() / n
    var = (((x - mean) * mask) ** 2).sum() / n
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return out * mask


def value_loss(values: torch.Tensor, values_old: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``0.5 * max((V - R)^2, (clip(V, V_old +- e) - R)^2)``, mean over actions, and the share clipped."""
    n = mask.sum().clamp(min=1)
    clipped_values = values_old + (values - values_old).clamp(-clip, clip)
    a, b = (values - returns) ** 2, (clipped_values - returns) ** 2
    loss = 0.5 * (torch.maximum(a, b) * mask).sum() / n
    with torch.no_grad():
        vf_clipfrac = ((b > a).float() * mask).sum() / n
    return loss, {"value_clipfrac": vf_clipfrac}


def ppo_loss(model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
    """``RecipeSpec.loss`` of the ppo kind (``model`` an ``ActorCritic``): the clipped policy loss plus
    ``vf_coef`` x the clipped value loss of a rollout micro-batch, with TRL's PPO figures (the
    rollout's own figures — reward, KL, reply length, eos rate — ride along); or a held-out batch's
    figures."""
    if "eval_total" in batch:
        return held_out_figures(batch)
    o = batch["objective"]
    mask = (batch["labels"] != IGNORE_INDEX).float()
    n = mask.sum().clamp(min=1.0)
    logp, entropy = token_logprobs(model.policy, batch, with_entropy=True, temperature=o["temperature"])
    per_token, clipped = clipped_surrogate(logp, batch["old_logprobs"], batch["advantages"], o["clip"], o["clip"])
    pg_loss = (per_token * mask).sum() / n
    on_cpu = mask.device.type == "cpu"  # where picking positions costs no device synchronisation
    values = model.value.scores(batch["input_ids"], position_ids=batch.get("position_ids"),
                                document_ids=batch.get("document_ids"), keep=mask.bool() if on_cpu else None)
    vf_loss, vf_metrics = value_loss(values, batch["old_values"], batch["returns"], mask, o["clip_value"])
    with torch.no_grad():
        log_ratio = (logp - batch["old_logprobs"]) * mask
        metrics = {"policy_loss": pg_loss.detach(), "value_loss": vf_loss.detach(),
                   "clip_frac": (clipped.float() * mask).sum() / n,
                   "approx_kl": ((log_ratio.exp() - 1 - log_ratio) * mask).sum() / n,
                   "entropy": (entropy * mask).sum() / n, **vf_metrics}
    metrics.update(batch["rollout_stats"])
    return pg_loss + o["vf_coef"] * vf_loss, metrics
