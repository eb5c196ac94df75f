import math

import pytest

from lmforge.train.schedule import lr_multiplier, lr_multiplier_at


def sched(step, schedule, **kw):
    args = dict(schedule=schedule, max_steps=100, warmup_steps=10, min_lr_ratio=0.1, decay_ratio=0.2)
    args.update(kw)
    return lr_multiplier(step, **args)


def test_warmup_is_linear_then_cosine_reaches_floor():
    assert sched(0, "cosine") == pytest.approx(0.1)
    assert sched(9, "cosine") == pytest.approx(1.0)
    assert sched(10, "cosine") == pytest.approx(1.0)
    assert sched(55, "cosine") == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert sched(100, "cosine") == pytest.approx(0.1)
    values = [sched(s, "cosine") for s in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_constant_and_wsd():
    assert [sched(s, "constant") for s in (10, 50, 99)] == [1.0, 1.0, 1.0]
    assert sched(79, "wsd") == 1.0  # stable until the last 20% of steps
    assert sched(90, "wsd") == pytest.approx(1 - 0.9 * 0.5)
    assert sched(100, "wsd") == pytest.approx(0.1)


def at(progress, schedule, **kw):
    args = dict(schedule=schedule, warmup_share=0.1, min_lr_ratio=0.1, decay_ratio=0.2)
    args.update(kw)
    return lr_multiplier_at(progress, **args)


def test_schedules_over_a_budget_share_the_step_shapes():
    assert at(0.05, "cosine") == pytest.approx(0.5)  # warming up over the first 10%
    assert at(0.1, "cosine") == pytest.approx(1.0)
    assert at(0.55, "cosine") == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert at(1.0, "cosine") == at(1.7, "cosine") == pytest.approx(0.1)  # spent: at the floor
    assert at(0.5, "constant") == 1.0
    assert at(0.79, "wsd") == 1.0 and at(0.9, "wsd") == pytest.approx(1 - 0.9 * 0.5) and at(1.0, "wsd") == 0.1
    assert at(1.0, "cosine", warmup_share=1.0) == pytest.approx(0.1)  # all warmup: still ends at the floor
    values = [at(p / 100, "cosine") for p in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:]))
