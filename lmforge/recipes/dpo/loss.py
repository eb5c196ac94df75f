"""The DPO objective (Rafailov et al. 2023, "Direct Preference Optimization"), sigmoid form, with the
label smoothing of conservative DPO (cDPO).

For a pair with prompt x, chosen reply c and rejected reply r, the implicit reward of a reply is
``β · (log π(y|x) − log π_ref(y|x))``, each log-probability the sum over the reply's tokens (its closing
eos included). With ``h = reward(c) − reward(r)`` the loss is
``−(1 − ε) · log σ(h) − ε · log σ(−h)``: ε = 0 is plain DPO, ε > 0 treats each label as wrong with
probability ε, so the margin is pulled towards a finite value instead of infinity. With
``rpo_alpha`` > 0 the loss adds that weight times the policy's mean negative log-likelihood per chosen
token (TRL's ``rpo_alpha``, after Pang et al. 2024): a pull that keeps the chosen replies likely, where
plain DPO lowers their log-probs along with the rejected ones'.

Both replies of a pair sit in the same packed row (``lmforge.posttrain.pairs``), so one forward of the
policy scores the whole batch, with logits only at reply tokens on CPUs. The reference log-probs come
with the batch (``ref_logps``, precomputed once before training) or from a frozen reference model that
``bind`` attached to the policy (live): it is held here, not inside the policy, so it is neither saved
with the checkpoints nor seen by the optimizer or DDP.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lmforge.errors import LMForgeError
from lmforge.models.losses import IGNORE_INDEX
from lmforge.posttrain.logprobs import sequence_sums, token_logprobs


@dataclass
class Binding:
    """What the loss of one policy needs beyond its batch."""

    beta: float
    label_smoothing: float
    reference: Any = None  # the frozen reference model (live mode); None when batches carry ref_logps
    rpo_alpha: float = 0.0  # weight of the chosen replies' NLL per token, added to the loss


# policy model -> its Binding. Weak: a finished run's models (and a live reference) are freed with it.
_BOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def bind(model: Any, beta: float, label_smoothing: float, reference: Any = None, rpo_alpha: float = 0.0) -> None:
    """Make ``dpo_loss`` usable on ``model``: its settings, and the live reference if there is one."""
    if reference is not None:
        reference.eval().requires_grad_(False)
    _BOUND[model] = Binding(beta, label_smoothing, reference, rpo_alpha)


def pair_logps(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """``[P, 2]`` summed reply log-probs (chosen, rejected) of every pair in the batch under ``model``."""
    n_pairs = int(batch["num_examples"])
    per_token = token_logprobs(model, batch)
    return sequence_sums(per_token, batch["sequence_ids"], 2 * n_pairs).view(n_pairs, 2)


@torch.no_grad()
def reference_logps(reference: Any, batch: dict[str, Any]) -> torch.Tensor:
    return pair_logps(reference, batch)


def preference_loss(policy: torch.Tensor, reference: torch.Tensor, beta: float,
                    label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair DPO losses ``[P]`` and implicit rewards ``[P, 2]`` (chosen, rejected; detached) from
    summed log-probs ``[P, 2]`` of the policy and the reference."""
    ratios = policy - reference.to(policy.dtype)
    h = beta * (ratios[:, 0] - ratios[:, 1])
    losses = -(1.0 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)
    return losses, beta * ratios.detach()


def dpo_loss(model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``RecipeSpec.loss`` of the dpo kind: the mean DPO loss of the batch's pairs, and TRL's metrics."""
    binding = _BOUND.get(getattr(model, "_orig_mod", model))  # torch.compile wraps the policy
    if binding is None:
        raise LMForgeError("the dpo loss needs its settings and reference: it runs inside `lmforge train` (the "
                           "kind's TrainData binds them to the model before the first step)")
    policy = pair_logps(model, batch)
    reference = batch.get("ref_logps")
    if reference is None:
        if binding.reference is None:
            raise LMForgeError("this batch carries no reference log-probs (ref_logps) and no live reference is "
                               "bound: set recipe.reference=precompute or live")
        reference = reference_logps(binding.reference, batch)
    losses, rewards = preference_loss(policy, reference, binding.beta, binding.label_smoothing)
    loss = losses.mean()
    if binding.rpo_alpha:
        scored = (batch["labels"] != IGNORE_INDEX).float()
        tokens = sequence_sums(scored, batch["sequence_ids"], 2 * policy.shape[0]).view(-1, 2)
        loss = loss - binding.rpo_alpha * policy[:, 0].sum() / tokens[:, 0].sum()
    margin = rewards[:, 0] - rewards[:, 1]
    logps = policy.detach()
    # A tie (the policy still equals its reference) counts half: the chance level, not a miss.
    accuracy = (margin > 0).float() + 0.5 * (margin == 0).float()
    metrics = {"rewards/chosen": rewards[:, 0].mean(), "rewards/rejected": rewards[:, 1].mean(),
               "rewards/margin": margin.mean(), "rewards/accuracy": accuracy.mean(),
               "logps/chosen": logps[:, 0].mean(), "logps/rejected": logps[:, 1].mean()}
    return loss, metrics


__all__ = ["Binding", "bind", "dpo_loss", "pair_logps", "preference_loss", "reference_logps"]
