"""Learning-rate schedules as a multiplier of the base lr: warmup then cosine / constant / WSD.

Two positions can drive a schedule (``training.schedule_over``): the optimizer step (``lr_multiplier``)
or the share of a time budget spent training (``lr_multiplier_at``). A time-driven schedule warms up
and decays on time whatever the machine's speed, so a slow minute costs steps, not the decay.
"""

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


def lr_multiplier_at(progress: float, *, schedule: str, warmup_share: float, min_lr_ratio: float,
                     decay_ratio: float = 0.2) -> float:
    """Multiplier at ``progress`` in [0, 1] of a budget: the same shapes as ``lr_multiplier`` with warmup
    and WSD decay as shares of the budget; at progress >= 1 a decaying schedule is at its floor."""
    progress = min(max(progress, 0.0), 1.0)
    if progress < warmup_share:
        return progress / warmup_share
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        done = (progress - warmup_share) / (1.0 - warmup_share) if warmup_share < 1.0 else 1.0
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * done))
    if schedule == "wsd":
        decay_start = max(warmup_share, 1.0 - decay_ratio)
        if progress < decay_start:
            return 1.0
        done = (progress - decay_start) / (1.0 - decay_start) if decay_start < 1.0 else 1.0
        return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - done)  # exactly the floor when done
    raise ValueError(f"unknown schedule {schedule!r}")
