"""Log-probabilities that the serving engine reports: of each sampled token and of a prompt's tokens.

They are the model's own distribution, ``log_softmax`` of the logits in fp32 at temperature 1, before
temperature, top-k, top-p or a grammar's mask shape what is sampled (what OpenAI's API reports, and
what a benchmark scoring a continuation needs). Each comes with the ``n`` most likely tokens at its
position (``n`` from 0 to ``MAX_TOP_LOGPROBS``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's limit, for both endpoints
_CHUNK = 256  # prompt positions whose vocabulary-wide log-softmax is held at once


class TokenLogprob(NamedTuple):
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the n most likely tokens at this position, most likely first


def _rows(logprobs: torch.Tensor, tokens: torch.Tensor, n: int) -> list[TokenLogprob]:
    """``[R, V]`` fp32 log-probabilities, ``[R]`` chosen tokens -> one ``TokenLogprob`` per row."""
    chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1).tolist()
    if n:
        values, ids = logprobs.topk(n, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [[] for _ in chosen]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(tokens.tolist(), chosen, tops)]


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor, n: int) -> list[TokenLogprob]:
    """Each row's sampled token (``[B]``) under its ``[B, V]`` logits, with the ``n`` most likely."""
    return _rows(logits.float().log_softmax(-1), tokens.to(logits.device), min(n, logits.size(-1)))


@torch.inference_mode()
def prompt_logprobs(model: Any, hidden: torch.Tensor, next_ids: list[int], n: int) -> list[TokenLogprob]:
    """The log-probability of each of ``next_ids``, the prompt tokens after the positions whose final
    hidden states ``hidden`` (``[T, C]``, from the prefill that also fills the KV cache) holds: one per
    position that has a next token (the prompt's last position has none). The LM head runs over
    ``_CHUNK`` positions at a time, so a long prompt never holds a ``T x vocab`` tensor."""
    targets = torch.tensor(next_ids, dtype=torch.long, device=hidden.device)
    out: list[TokenLogprob] = []
    for start in range(0, len(next_ids), _CHUNK):
        logits = model.lm_head(hidden[start:min(start + _CHUNK, len(next_ids))])
        out.extend(sampled_logprobs(logits, targets[start:start + logits.size(0)], n))
    return out
