"""Learning-rate schedules as a multiplier of the base lr: warmup then cosine / constant / WSD."""

from __future__ import annotations

import math


def lr_multiplier(step: int, *, schedule: str, max_steps: int, warmup_steps: int,
                  min_lr_ratio: float, decay_ratio: float = 0.2) -> float:
    """Multiplier for optimizer step ``step`` (0-based: the lr used to take step ``step``+1)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        span = max(1, max_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "wsd":
        decay_steps = max(1, int(round(decay_ratio * max_steps)))
        decay_start = max(warmup_steps, max_steps - decay_steps)
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / max(1, max_steps - decay_start))
        return 1.0 - (1.0 - min_lr_ratio) * progress
    raise ValueError(f"unknown schedule {schedule!r}")
