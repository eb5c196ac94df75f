"""Random token windows for `lmforge bench`: the same seeded batches for every system compared."""

from __future__ import annotations

from typing import Any

import torch


class RandomTokens:
    """Seeded random token windows (``lmforge bench``): the same batches for every system compared."""

    def __init__(self, vocab_size: int, micro_batch_size: int, seq_len: int, seed: int = 0):
        self.shape = (micro_batch_size, seq_len + 1)
        self.vocab_size = vocab_size
        self.gen = torch.Generator().manual_seed(seed)

    def next_batch(self) -> dict[str, torch.Tensor]:
        w = torch.randint(0, self.vocab_size, self.shape, generator=self.gen)
        return {"input_ids": w[:, :-1], "labels": w[:, 1:]}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


def bench_data(cfg) -> RandomTokens:
    return RandomTokens(cfg.model.vocab_size, cfg.training.micro_batch_size, cfg.data.seq_len, cfg.seed)
