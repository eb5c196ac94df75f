"""MFU is never above 100%: the peak is the best of several timings, the best seen on this machine is
kept, and where the figure would still be nonsense the loop says the peak is unknown instead."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.config import load_config
from lmforge.train import train
from lmforge.device import measure_matmul_flops, model_flops_utilization, peak_cache_path, remember_peak
from tests.train_helpers import make_prepared_data, write_recipe


class ScriptedClock:
    """Returns the given readings in order, then stays far past any deadline."""

    def __init__(self, readings):
        self.readings = list(readings)

    def __call__(self) -> float:
        return self.readings.pop(0) if self.readings else 1e9


def test_the_peak_is_the_best_of_several_timings():
    # deadline read at 0 (0.5 s budget), then three timed matmuls of 3 s (another program busy), 1 s, 2 s
    clock = ScriptedClock([0.0, 0.0, 3.0, 3.0, 4.0, 4.0, 6.0])
    n = 16
    assert measure_matmul_flops(torch.device("cpu"), "fp32", seconds=0.5, min_timings=3, n=n,
                                clock=clock) == 2 * n**3 / 1.0


def test_the_best_peak_seen_on_this_machine_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("LMFORGE_CACHE_DIR", str(tmp_path / "cache"))
    assert remember_peak("cpu|x|fp32", 10e9) == 10e9
    assert remember_peak("cpu|x|fp32", 4e9) == 10e9  # measured while busy: the idle figure stands
    assert remember_peak("cpu|x|bf16", 1e9) == 1e9  # each machine/dtype key has its own
    assert remember_peak("cpu|x|fp32", 12e9) == 12e9
    assert json.loads(peak_cache_path().read_text()) == {"cpu|x|fp32": 12e9, "cpu|x|bf16": 1e9}
    peak_cache_path().write_text("{not json")  # a damaged cache is only a lost hint
    assert remember_peak("cpu|x|fp32", 5e9) == 5e9
    assert json.loads(peak_cache_path().read_text()) == {"cpu|x|fp32": 5e9}


def test_mfu_is_a_fraction_or_unknown():
    assert model_flops_utilization(1000.0, 1e6, 4e9) == pytest.approx(0.25)
    assert model_flops_utilization(1000.0, 1e6, 4e9, processes=2) == pytest.approx(0.125)
    assert model_flops_utilization(1000.0, 1e6, 1e9) == 1.0
    assert model_flops_utilization(1000.0, 1e6, 0.5e9) is None  # 200%: the peak is wrong
    assert model_flops_utilization(1000.0, 1e6, 0.0) is None  # no peak known


def test_training_hides_mfu_when_the_peak_is_below_what_it_achieves(tmp_path, capsys):
    data_dir = make_prepared_data(tmp_path / "corpus")
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs",
                          training={"max_steps": 3, "eval_interval": 0, "save_interval": 0})
    for name, peak in (("low", 1.0), ("high", 1e30)):  # as if measured under load / an honest ceiling
        train(load_config(str(recipe), [f"name={name}", f"training.peak_flops={peak}"]))
    rows = {name: [json.loads(x) for x in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()
                   if "train/loss" in x] for name in ("low", "high")}
    assert len(rows["low"]) == 3 and not any("train/mfu" in r for r in rows["low"])
    assert len(rows["high"]) == 3 and all(0 < r["train/mfu"] < 1e-9 for r in rows["high"])
    out = capsys.readouterr().out
    assert out.count("note: MFU is not shown") == 1 and "above the 1e-12 TFLOP/s peak (training.peak_flops)" in out
