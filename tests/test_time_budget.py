"""`training.schedule_over=time`: the learning rate warms up and decays over a time budget whatever the
machine's speed. Every test runs the real loop on a fake clock that only moves when a step, an
evaluation or a checkpoint is charged to it, so the assertions are exact on any machine."""

from __future__ import annotations

import json
import shutil

import pytest

from lmforge.config import load_config
from lmforge.errors import LMForgeError
from lmforge.train import train
from lmforge.train.loop import Trainer
from lmforge.train.schedule import lr_multiplier_at
from tests.train_helpers import FakeClock, make_prepared_data, write_recipe

LR, FLOOR = 3e-3, 0.1  # write_recipe's training.lr, and the floor set below


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_prepared_data(tmp_path_factory.mktemp("corpus"))


def timed_run(tmp_path, data_dir, monkeypatch, step_seconds, name="t", resume=False, **training):
    """Train under a fake clock: step i (0-based, this session) costs step_seconds(i); an evaluation costs
    30 s and a checkpoint 20 s, which the budget must not count. Returns (result, {step: lr})."""
    clock = FakeClock()
    monkeypatch.undo()  # a second run in one test charges a fresh clock
    clock.charge(monkeypatch, Trainer, "_train_step", step_seconds)
    clock.charge(monkeypatch, Trainer, "evaluate", 30.0)
    clock.charge(monkeypatch, Trainer, "save_checkpoint", 20.0)
    settings = {"schedule_over": "time", "max_time_minutes": 1.0, "max_steps": 20, "warmup_steps": 4,
                "peak_flops": 1e12, "min_lr_ratio": FLOOR, "eval_interval": 0, "save_interval": 0, **training}
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs", name=name, training=settings,
                          model={"embd_pdrop": 0.0, "resid_pdrop": 0.0, "attn_pdrop": 0.0})
    result = train(load_config(str(recipe)), resume=resume, clock=clock)
    rows = [json.loads(x) for x in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    return result, {r["step"]: r["train/lr"] for r in rows if "train/lr" in r}


def test_six_seconds_a_step_ends_at_the_one_minute_budget_with_the_lr_at_its_floor(tmp_path, data_dir,
                                                                                   monkeypatch):
    result, lrs = timed_run(tmp_path, data_dir, monkeypatch, lambda i: 6.0, eval_interval=3, save_interval=4)
    # 60 s of steps, whatever max_steps says (20) and however long evaluations and checkpoints took
    assert result.stopped == "completed" and result.step == 10 and sorted(lrs) == list(range(1, 11))
    assert lrs[10] == pytest.approx(FLOOR * LR)
    # Step k's lr is the schedule at the time its gradient is ready: k x 6 s of the 60 s budget.
    # Warmup keeps its share of the step schedule (4 of 20 steps = the first 12 s).
    assert lrs[1] == pytest.approx(0.5 * LR) and lrs[2] == pytest.approx(LR)
    assert [lrs[k] for k in range(2, 11)] == sorted((lrs[k] for k in range(2, 11)), reverse=True)
    state = json.loads((result.last_checkpoint / "trainer_state.json").read_text())
    assert state["train_seconds"] == 60.0 and result.last_checkpoint.name == "step-000010"


def test_the_lr_follows_time_not_steps(tmp_path, data_dir, monkeypatch):
    slow, slow_lrs = timed_run(tmp_path, data_dir, monkeypatch, lambda i: 6.0, name="slow")
    fast, fast_lrs = timed_run(tmp_path, data_dir, monkeypatch, lambda i: 2.0, name="fast", max_steps=100,
                               warmup_steps=20)
    assert (slow.step, fast.step) == (10, 30)  # a step schedule would end both at max_steps
    # at the same moment of the budget both runs use the same lr, 3x as many steps apart
    assert all(fast_lrs[3 * k] == pytest.approx(slow_lrs[k]) for k in range(1, 11))
    assert fast_lrs[1] == pytest.approx(LR * (2 / 60) / 0.2)  # warming up over the first 12 s
    assert fast_lrs[8] == pytest.approx(LR * lr_multiplier_at(16 / 60, schedule="cosine", warmup_share=0.2,
                                                              min_lr_ratio=FLOOR))


def test_a_clock_slow_only_in_the_first_steps_still_gets_the_whole_decay(tmp_path, data_dir, monkeypatch):
    """The issue's busy first minute: the first two steps take 20 s each (40 of the 60 s), then 2 s."""
    result, lrs = timed_run(tmp_path, data_dir, monkeypatch, lambda i: 20.0 if i < 2 else 2.0)
    assert result.step == 12 and result.stopped == "completed"
    # the slow steps spent the warmup share (12 s) and more: the first step already decays
    assert lrs[1] == pytest.approx(LR * lr_multiplier_at(20 / 60, schedule="cosine", warmup_share=0.2,
                                                         min_lr_ratio=FLOOR))
    assert lrs[12] == pytest.approx(FLOOR * LR)
    assert [lrs[k] for k in range(1, 13)] == sorted(lrs.values(), reverse=True)  # past warmup: decaying


def test_resume_continues_the_time_schedule(tmp_path, data_dir, monkeypatch):
    straight, straight_lrs = timed_run(tmp_path, data_dir, monkeypatch, lambda i: 6.0, name="straight",
                                       save_interval=5)
    resumed_dir = tmp_path / "runs" / "resumed" / "checkpoints"
    resumed_dir.mkdir(parents=True)
    shutil.copytree(tmp_path / "runs" / "straight" / "checkpoints" / "step-000005", resumed_dir / "step-000005")
    result, lrs = timed_run(tmp_path, data_dir, monkeypatch, lambda i: 6.0, name="resumed", resume=True,
                            save_interval=5)
    # the resumed session starts its clock at 0 but knows 30 s of the budget were spent
    assert result.step == 10 and sorted(lrs) == list(range(6, 11))
    assert all(lrs[k] == pytest.approx(straight_lrs[k]) for k in range(6, 11))


def test_time_schedule_needs_a_time_budget(tmp_path, data_dir):
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs", training={"schedule_over": "time"})
    with pytest.raises(LMForgeError, match="schedule_over=time .* set training.max_time_minutes"):
        load_config(str(recipe))
    with pytest.raises(LMForgeError, match="schedule_over must be steps or time"):
        load_config(str(recipe), ["training.schedule_over=minutes", "training.max_time_minutes=1"])


def test_the_step_schedules_time_limit_reads_the_same_clock(tmp_path, data_dir, monkeypatch):
    """schedule_over=steps: max_time_minutes only stops the run (here 6 s, at 1 s a step: after step 7,
    the first to end past the limit), then evaluates and saves; the lr follows the 20-step schedule."""
    result, lrs = timed_run(tmp_path, data_dir, monkeypatch, lambda i: 1.0, schedule_over="steps",
                            max_time_minutes=0.1)
    assert result.stopped == "time" and result.step == 7 and result.last_checkpoint.name == "step-000007"
    assert "eval/loss" in result.eval_metrics
    assert lrs[1] == pytest.approx(LR / 4) and lrs[7] < lrs[6] < lrs[5] == pytest.approx(LR)  # 4 warm up, cosine
