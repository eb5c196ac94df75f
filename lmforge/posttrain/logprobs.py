"""Per-token log-probabilities of given tokens under a gpt-family model: what DPO, PPO and GRPO
compare between the policy, its reference and the policy that sampled.

``token_logprobs(model, batch)`` takes a batch laid out as for training — ``input_ids``, ``labels``
(the next token at each position, ``-100`` where nothing is scored) and, for packed rows,
``position_ids`` / ``document_ids`` (and ``prefix_ids`` where completions share their prompt) — and
returns ``[B, T]`` fp32 log-probabilities of the labels (0 where unscored), differentiable. Only
scored positions get logits on CPUs (the others cost nothing); accelerators compute every position
and mask, which needs no host synchronisation.
``sequence_sums`` adds them up per sequence.
"""

from __future__ import annotations

from typing import Any

import torch

from lmforge.models.losses import IGNORE_INDEX


def token_logprobs(model: Any, batch: dict[str, torch.Tensor], with_entropy: bool = False,
                   temperature: float = 1.0, select: bool | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` log p(labels) (fp32, 0 where ``labels == -100``); with ``with_entropy`` also the
    entropy of each scored position's distribution. ``temperature`` divides the logits first (the
    distribution a sampler at that temperature drew from). ``select``: compute logits at scored
    positions only (default: on CPUs, where finding them costs no device synchronisation)."""
    labels = batch["labels"]
    scored = labels != IGNORE_INDEX
    if select is None:
        select = labels.device.type == "cpu"
    # Selecting on CPUs: the trunk returns the scored positions' outputs only (and its last block
    # computes only those where they end each packed sequence: GPT.hidden_states' keep).
    hidden = model.hidden_states(batch["input_ids"], position_ids=batch.get("position_ids"),
                                 document_ids=batch.get("document_ids"), prefix_ids=batch.get("prefix_ids"),
                                 keep=scored if select else None)
    weight = model.lm_head.weight
    flat_h, flat_y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if select:
        keep = scored.reshape(-1)
        flat_y = flat_y[keep]
    logits = (flat_h @ weight.to(flat_h.dtype).t()).float()
    if temperature != 1.0:
        logits = logits / temperature
    norm = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, flat_y.clamp(min=0)[:, None]).squeeze(-1) - norm
    entropy = None
    if with_entropy:
        entropy = norm - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    if select:
        out = torch.zeros(labels.numel(), dtype=torch.float32, device=labels.device)
        out[keep] = picked
        logp = out.view_as(labels)
        if with_entropy:
            ent = torch.zeros(labels.numel(), dtype=torch.float32, device=labels.device)
            ent[keep] = entropy
            return logp, ent.view_as(labels)
        return logp
    logp = picked.view_as(labels) * scored
    return (logp, entropy.view_as(labels) * scored) if with_entropy else logp


def sequence_sums(values: torch.Tensor, sequence_ids: torch.Tensor, n_sequences: int) -> torch.Tensor:
    """Sum ``values`` (``[B, T]``) per sequence: ``sequence_ids`` (``[B, T]``, ``-1`` = none) numbers the
    sequence each position belongs to, ``0 .. n_sequences - 1`` across the whole batch."""
    flat = values.reshape(-1)
    ids = sequence_ids.reshape(-1)
    owned = ids >= 0
    out = torch.zeros(n_sequences, dtype=values.dtype, device=values.device)
    return out.index_add(0, ids.clamp(min=0), flat * owned)
