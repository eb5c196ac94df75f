"""`lmforge pipeline`: staged runs that skip what is up to date, rerun what changed (and what follows
it), resume what was interrupted, and refuse bad files before any compute. Real tiny runs: a
tokenizer stage and two lm stages (pretraining, then fine-tuning from it) on a small Go corpus."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import yaml

from lmforge.errors import LMForgeError
from lmforge.pipeline import pipeline_status, run_pipeline, serve_pipeline
from lmforge.pipeline.state import sha256_file
from tests.train_helpers import PEAK_FLOPS, write_go_corpus

TRAIN = {"micro_batch_size": 4, "log_interval": 1, "eval_batches": 2, "warmup_steps": 1, "peak_flops": PEAK_FLOPS, "device": "cpu"}
LOGGING = {"tensorboard": False, "progress_bar": False}


def pipeline_dict(corpus: Path, base_steps: int = 4) -> dict:
    return {
        "name": "tiny",
        "out_dir": "unused",  # every test passes out_dir
        "vars": {"corpus": str(corpus)},
        "stages": [
            {"name": "tok", "kind": "tokenizer", "sources": ["${vars.corpus}"], "vocab_size": 300},
            {"name": "base", "kind": "lm", "tokenizer": "tok",
             "data": {"train_path": "${vars.corpus}", "seq_len": 32, "val_fraction": 0.2},
             "overrides": {"model": {"flavor": "llama", "n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 1024},
                           "training": {**TRAIN, "max_steps": base_steps, "eval_interval": 2, "save_interval": 1,
                                        "keep_last": 10},
                           "logging": LOGGING}},
            {"name": "ft", "kind": "lm", "init": "base",
             "data": {"train_path": "${vars.corpus}", "seq_len": 32, "val_fraction": 0.2},
             "overrides": {"training.max_steps": 3, "training.lr": "1e-4", "training.eval_interval": 3,
                           "training": TRAIN, "logging": LOGGING}},
        ],
    }


def write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_go_corpus(tmp_path_factory.mktemp("corpus") / "go", n_files=30)


@pytest.fixture(scope="module")
def golden(tmp_path_factory, corpus):
    """The pipeline run once (read-only: tests copy it)."""
    base = tmp_path_factory.mktemp("golden")
    file = write(base / "p.yaml", pipeline_dict(corpus))
    summary = run_pipeline(file, out_dir=base / "out")
    assert [r.result for r in summary.stages] == ["ran", "ran", "ran"]
    return file, base / "out"


@pytest.fixture
def trains(monkeypatch):
    """Every call of lmforge.train.train as (run name, resume), and its result."""
    import lmforge.train as training

    calls, real = [], training.train

    def spy(cfg, resume=False, **kwargs):
        result = real(cfg, resume=resume, **kwargs)
        calls.append((cfg.name, resume, result))
        return result

    monkeypatch.setattr(training, "train", spy)
    return calls


def copy_of(golden, tmp_path: Path) -> tuple[Path, Path]:
    file, out = golden
    shutil.copytree(out, tmp_path / "out", copy_function=shutil.copy2)
    return shutil.copy(file, tmp_path / "p.yaml"), tmp_path / "out"


def states(file, out, **kwargs) -> dict[str, str]:
    return {r.stage: r.state for r in pipeline_status(file, out_dir=out, **kwargs)}


def record(out: Path, stage: str) -> dict:
    return json.loads((out / "pipeline_state.json").read_text())["stages"][stage]


def best_weights(out: Path, stage: str) -> str:
    return sha256_file(out / stage / "checkpoints" / "best" / "model.safetensors")


# ---- skip, rerun, force --------------------------------------------------------------------------------
def test_an_unchanged_pipeline_is_skipped_whole(golden, tmp_path, trains):
    file, out = copy_of(golden, tmp_path)  # another directory: nothing in the record depends on where it lies
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name not in ("pipeline_state.json", ".pipeline.lock")}
    summary = run_pipeline(file, out_dir=out)
    assert trains == []
    assert [r.result for r in summary.stages] == ["skipped"] * 3
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name not in ("pipeline_state.json", ".pipeline.lock")} == before
    assert not list(out.glob("*.old-*"))
    assert states(file, out) == {"tok": "done", "base": "done", "ft": "done"}


def test_a_changed_stage_reruns_and_the_stages_after_it_follow(golden, tmp_path, trains):
    file, out = copy_of(golden, tmp_path)
    old_base, old_ft = best_weights(out, "base"), best_weights(out, "ft")
    write(file, pipeline_dict(Path(yaml.safe_load(file.read_text())["vars"]["corpus"]), base_steps=5))

    rows = {r.stage: r for r in pipeline_status(file, out_dir=out)}
    assert (rows["tok"].state, rows["base"].state, rows["ft"].state) == ("done", "stale", "stale")
    assert rows["base"].detail == "config changed"
    assert "base" in rows["ft"].detail

    run_pipeline(file, out_dir=out)
    assert [(name, resume) for name, resume, _ in trains] == [("base", False), ("ft", False)]
    assert trains[0][2].step == 5
    # nothing trained is lost: the earlier runs were moved aside whole
    assert sha256_file(out / "base.old-1" / "checkpoints" / "best" / "model.safetensors") == old_base
    assert sha256_file(out / "ft.old-1" / "checkpoints" / "best" / "model.safetensors") == old_ft
    # ft started from the new base: its recorded init hash is the new base's weights
    assert record(out, "ft")["inputs"]["init"] == best_weights(out, "base") != old_base
    assert states(file, out) == {"tok": "done", "base": "done", "ft": "done"}


def test_changed_corpus_content_reruns_what_reads_it(golden, corpus, tmp_path, trains):
    file, out = copy_of(golden, tmp_path)
    mine = shutil.copytree(corpus, tmp_path / "corpus")
    run_pipeline(file, out_dir=out, vars={"corpus": str(mine)})  # same content elsewhere: still up to date
    assert trains == []
    with open(mine / "pkg0" / "file0.go", "a") as f:
        f.write("\n// one more line\n")
    assert states(file, out, vars={"corpus": str(mine)}) == {"tok": "stale", "base": "stale", "ft": "stale"}
    summary = run_pipeline(file, out_dir=out, vars={"corpus": str(mine)})
    assert [r.result for r in summary.stages] == ["ran", "ran", "ran"]
    assert [name for name, _, _ in trains] == ["base", "ft"]


def test_a_large_input_is_hashed_once(golden, tmp_path, monkeypatch, trains):
    from lmforge.pipeline import state

    file, out = copy_of(golden, tmp_path)
    run_pipeline(file, out_dir=out)  # records the hashes of the corpus under this copy's paths
    read = []
    real = state.sha256_file
    monkeypatch.setattr(state, "sha256_file", lambda p: read.append(Path(p)) or real(p))
    run_pipeline(file, out_dir=out)
    assert read == [] and trains == []


def test_force_reruns_a_stage_and_later_stages_follow_its_output(golden, tmp_path, trains):
    file, out = copy_of(golden, tmp_path)
    old_base = best_weights(out, "base")
    run_pipeline(file, out_dir=out, force=["ft"])
    assert [name for name, _, _ in trains] == ["ft"]
    assert (out / "ft.old-1").is_dir() and not (out / "base.old-1").exists()

    trains.clear()
    run_pipeline(file, out_dir=out, force=["base"])
    assert (out / "base.old-1").is_dir()
    # ft's input is base's weights by content: it reruns exactly when the forced rerun changed them
    changed = best_weights(out, "base") != old_base
    assert [name for name, _, _ in trains] == (["base", "ft"] if changed else ["base"])
    assert states(file, out)["ft"] == "done"

    with pytest.raises(LMForgeError, match="unknown --force stage 'bsae'. Did you mean 'base'"):
        run_pipeline(file, out_dir=out, force=["bsae"])


def test_until_and_only(golden, corpus, tmp_path, trains):
    file = write(tmp_path / "p.yaml", pipeline_dict(corpus))
    out = tmp_path / "out"
    run_pipeline(file, out_dir=out, until="tok")
    assert states(file, out) == {"tok": "done", "base": "pending", "ft": "pending"}
    with pytest.raises(LMForgeError, match="stage 'ft' cannot run: stage 'base' has no output yet"):
        run_pipeline(file, out_dir=out, only="ft")
    run_pipeline(file, out_dir=out, only="base")
    assert [name for name, _, _ in trains] == ["base"]
    assert states(file, out) == {"tok": "done", "base": "done", "ft": "pending"}


# ---- interrupted stages -------------------------------------------------------------------------------
def interrupt_base_at(monkeypatch, step: int, how: str) -> None:
    """Stop stage base's training as it starts step ``step``: a SIGTERM (what a cluster's preemption or
    Ctrl-C sends; the loop saves a checkpoint and returns), or a crash (an exception)."""
    from lmforge.train.loop import Trainer

    real, calls = Trainer._train_step, [0]

    def step_fn(self):
        if self.cfg.name == "base":
            calls[0] += 1
            if calls[0] == step:
                if how == "signal":
                    os.kill(os.getpid(), signal.SIGTERM)
                else:
                    raise RuntimeError("the machine went away")
        return real(self)

    monkeypatch.setattr(Trainer, "_train_step", step_fn)


def metric_rows(out: Path, stage: str) -> list[dict]:
    return [json.loads(line) for line in (out / stage / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("how", ["signal", "crash"])
def test_an_interrupted_stage_resumes_from_its_last_checkpoint(corpus, tmp_path, monkeypatch, trains, how):
    file = write(tmp_path / "p.yaml", pipeline_dict(corpus, base_steps=6))
    out = tmp_path / "out"
    interrupt_base_at(monkeypatch, 4, how)
    if how == "signal":
        from lmforge.cli import main

        # the exit status of a SIGTERM (143): the run did not complete, so a job controller restarts it
        assert main(["pipeline", "run", str(file), "--out-dir", str(out)]) == 128 + signal.SIGTERM
        saved = 4  # the loop finishes the step it is in, saves a checkpoint and returns
    else:
        with pytest.raises(RuntimeError, match="went away"):
            run_pipeline(file, out_dir=out)
        saved = 3  # the last checkpoint written before the crash (save_interval 1)
    assert not (out / "ft").exists()  # nothing runs after an unfinished stage
    rows = {r.stage: r for r in pipeline_status(file, out_dir=out)}
    assert rows["base"].state == ("partial" if how == "signal" else "failed")
    assert f"resumable, at step {saved}" in rows["base"].detail
    assert rows["ft"].state == "pending"
    first_attempt = [r for r in metric_rows(out, "base") if r["step"] <= saved]

    monkeypatch.undo()  # the machine is back
    import lmforge.train as training
    real, calls = training.train, []
    monkeypatch.setattr(training, "train", lambda cfg, resume=False, **kw: calls.append((cfg.name, resume)) or
                        real(cfg, resume=resume, **kw))
    run_pipeline(file, out_dir=out)
    assert calls == [("base", True), ("ft", False)]
    assert not list(out.glob("*.old-*"))  # continued in place, not started over
    rows_after = metric_rows(out, "base")
    # steps 1..saved were not trained again; a signal's stop left its step's due evaluation to the resume
    assert [r for r in rows_after if r["step"] <= saved and r not in first_attempt and "eval/loss" not in r] == []
    assert all(r in [x for x in rows_after if x["step"] <= saved] for r in first_attempt)
    assert sorted({r["step"] for r in rows_after if "train/loss" in r}) == list(range(1, 7))
    assert record(out, "base")["attempts"] == 2 and record(out, "base")["step"] == 6
    assert states(file, out) == {"tok": "done", "base": "done", "ft": "done"}


def test_a_stage_stopped_before_its_first_checkpoint_reruns_on_the_data_it_prepared(corpus, tmp_path, monkeypatch,
                                                                                     capsys):
    """A training stage that failed (or was interrupted, or killed) before its first checkpoint trains again
    from step 0, on the data.train_path it had tokenized: that directory is whole (renamed into place once
    complete), the rest of the attempt is moved aside. After a change of inputs or settings the attempt is
    moved aside whole, its data too."""
    data = pipeline_dict(corpus)
    data["stages"] = data["stages"][:2]  # tok, base
    file, out = write(tmp_path / "p.yaml", data), tmp_path / "out"
    interrupt_base_at(monkeypatch, 1, "crash")  # in step 1: before the first checkpoint
    with pytest.raises(RuntimeError, match="went away"):
        run_pipeline(file, out_dir=out)
    assert record(out, "base")["status"] == "failed" and (out / "base" / "data" / "meta.json").is_file()
    assert not (out / "base" / "checkpoints").exists() or not any((out / "base" / "checkpoints").iterdir())
    row = {r.stage: r for r in pipeline_status(file, out_dir=out)}["base"]
    assert (row.state, row.detail) == ("failed", "RuntimeError: the machine went away; reruns from step 0 on its "
                                                 "tokenized data; --force base prepares it again")

    # other settings: the data is not trusted (the same pipeline_dict with 5 steps), and it fails again
    data = pipeline_dict(corpus, base_steps=5)
    data["stages"] = data["stages"][:2]
    write(file, data)
    monkeypatch.undo()
    interrupt_base_at(monkeypatch, 1, "crash")
    capsys.readouterr()
    with pytest.raises(RuntimeError, match="went away"):
        run_pipeline(file, out_dir=out)
    printed = capsys.readouterr().out
    assert f"inputs or settings changed: moved the earlier output aside to {out / 'base.old-1'}" in printed
    assert (out / "base.old-1" / "data" / "meta.json").is_file() and "data: tokenizing" in printed
    prepared = (out / "base" / "data" / "meta.json").stat()

    monkeypatch.undo()  # the machine is back
    summary = run_pipeline(file, out_dir=out)
    printed = capsys.readouterr().out
    assert [r.result for r in summary.stages] == ["skipped", "ran"]
    assert (f"the failed attempt stopped before its first checkpoint: moved the earlier output aside to "
            f"{out / 'base.old-2'}") in printed
    assert (f"reusing its tokenized data from the failed attempt ({out / 'base' / 'data'}); training starts again "
            "from step 0 (`--force base` prepares it again)") in printed
    assert "data: tokenizing" not in printed and "data: reusing" in printed  # the recipe took it as it was
    again = (out / "base" / "data" / "meta.json").stat()
    assert (again.st_ino, again.st_mtime_ns) == (prepared.st_ino, prepared.st_mtime_ns)
    # the rest of the failed attempt is aside (its run config, its empty metrics), not in the new run
    assert (out / "base.old-2" / "config.yaml").is_file() and not (out / "base.old-2" / "data").exists()
    assert sorted(r["step"] for r in metric_rows(out, "base") if "train/loss" in r) == [1, 2, 3, 4, 5]
    rec = record(out, "base")
    assert (rec["status"], rec["step"], rec["attempts"]) == ("done", 5, 2)
    moved = json.loads((out / "pipeline_state.json").read_text())["moved_aside"]
    assert [(m["path"], m.get("kept")) for m in moved] == [(str(out / "base.old-1"), None),
                                                          (str(out / "base.old-2"), ["data"])]
    assert states(file, out) == {"tok": "done", "base": "done"}


def sigterm_after(monkeypatch, name: str) -> None:
    """``lmforge.data.NAME`` does its work, then the process gets a SIGTERM (as from `kill`)."""
    import lmforge.data

    real = getattr(lmforge.data, name)

    @functools.wraps(real)  # its signature: the pipeline file's keys are checked against it
    def then_terminated(*args, **kwargs):
        result = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return result

    monkeypatch.setattr(lmforge.data, name, then_terminated)


def test_a_sigterm_outside_training_stops_the_run_as_ctrl_c_does(corpus, tmp_path, monkeypatch, capsys):
    """SIGTERM (a scheduler's, `kill`) while the pipeline is not in a training loop (which stops at a
    checkpoint of its own): in a tokenizer stage, or in a training stage tokenizing its data. The stage is
    recorded as interrupted, what it was writing is dropped whole or kept whole, `pipeline run` exits with
    143, the SIGTERM handler the program had is back, and the next run goes on from there."""
    from lmforge.cli import main

    data = pipeline_dict(corpus)
    data["stages"] = data["stages"][:2]  # tok, base
    file, out = write(tmp_path / "p.yaml", data), tmp_path / "out"
    run = ["pipeline", "run", str(file), "--out-dir", str(out)]
    # the program's own handler, there before the run: it must get no signal the pipeline handled (and, were
    # SIGTERM not handled, it keeps this test process alive: the run then goes on to the end)
    got: list[int] = []

    def mine(signum, _frame):
        got.append(signum)

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        with monkeypatch.context() as m:
            sigterm_after(m, "train_tokenizer_from_sources")  # in the tokenizer stage, its files written
            assert main(run) == 143
        assert "lmforge: terminated (SIGTERM)" in capsys.readouterr().err
        assert record(out, "tok")["status"] == "interrupted" and "base" not in json.loads(
            (out / "pipeline_state.json").read_text())["stages"]
        assert not (out / "tok").exists() and not list(out.glob(".tok*"))  # its unfinished output is gone
        assert states(file, out) == {"tok": "pending", "base": "pending"}
        assert signal.getsignal(signal.SIGTERM) is mine

        with monkeypatch.context() as m:
            sigterm_after(m, "prepare_data")  # in stage base, its data.train_path just tokenized
            assert main(run) == 143
        rec = record(out, "base")
        assert (rec["status"], rec["step"]) == ("interrupted", None)
        assert record(out, "tok")["status"] == "done"
        assert (out / "base" / "data" / "meta.json").is_file()
        row = {r.stage: r for r in pipeline_status(file, out_dir=out)}["base"]
        assert (row.state, row.detail) == ("pending", "reruns from step 0 on its tokenized data; --force base "
                                                      "prepares it again")
        assert signal.getsignal(signal.SIGTERM) is mine
        capsys.readouterr()

        assert main(run) == 0
        printed = capsys.readouterr().out
        assert "reusing its tokenized data from the interrupted attempt" in printed and "data: reusing" in printed
        assert states(file, out) == {"tok": "done", "base": "done"}
        assert got == [] and signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_data_a_stage_failed_on_is_prepared_again(corpus, tmp_path, monkeypatch, capsys):
    """The data a stage that stopped before its first checkpoint had prepared is reused only when it is
    whole: a shard that is cut short (the loader's size check) is found before the rerun, and one whose
    token ids are damaged (refused when a batch reads them: no cheap check sees it) makes that attempt
    fail with an error naming the data, and the next run prepares it again rather than failing on it on
    every run."""
    data = pipeline_dict(corpus)
    data["stages"] = data["stages"][:2]  # tok, base
    file, out = write(tmp_path / "p.yaml", data), tmp_path / "out"
    shard = out / "base" / "data" / "train_000000.bin"

    def failed_before_its_first_checkpoint(*args: str) -> None:
        with monkeypatch.context() as m:
            interrupt_base_at(m, 1, "crash")
            with pytest.raises(RuntimeError, match="went away"):
                run_pipeline(file, out_dir=out, force=list(args))
        assert record(out, "base")["status"] == "failed" and shard.is_file()
        capsys.readouterr()

    # token ids outside the vocabulary, the shard's size unchanged
    failed_before_its_first_checkpoint()
    shard.write_bytes(b"\xff" * shard.stat().st_size)
    with pytest.raises(LMForgeError, match="the shard is damaged"):
        run_pipeline(file, out_dir=out)
    assert "reusing its tokenized data" in capsys.readouterr().out  # nothing but reading it could tell
    rec = record(out, "base")
    assert rec["status"] == "failed" and str(out / "base" / "data") in rec["error"]
    row = {r.stage: r for r in pipeline_status(file, out_dir=out)}["base"]
    assert row.state == "failed" and "reruns from step 0" not in row.detail
    summary = run_pipeline(file, out_dir=out)
    printed = capsys.readouterr().out
    assert [r.result for r in summary.stages] == ["skipped", "ran"]
    assert (f"its data {out / 'base' / 'data'} is not reused (the failed attempt's error is about that data): "
            "prepared again") in printed
    assert "data: tokenizing" in printed and "data: reusing" not in printed
    assert (out / "base.old-2" / "data" / "meta.json").is_file()  # the damaged data, aside with the rest

    # a shard cut short: found before the rerun, which prepares the data again
    failed_before_its_first_checkpoint("base")  # (forced: a fresh attempt, its data prepared anew)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 2)
    row = {r.stage: r for r in pipeline_status(file, out_dir=out)}["base"]
    assert (row.state, row.detail) == ("failed", "RuntimeError: the machine went away")
    summary = run_pipeline(file, out_dir=out)
    printed = capsys.readouterr().out
    assert [r.result for r in summary.stages] == ["skipped", "ran"]
    assert f"its data {out / 'base' / 'data'} is not reused (shard {shard} has " in printed
    assert "data: tokenizing" in printed and "data: reusing" not in printed

    # data the recipe would refuse (here: tokenized with another tokenizer than the stage's), by the recipe's
    # own test: prepared again, not refused on every run
    failed_before_its_first_checkpoint("base")
    meta_file = out / "base" / "data" / "meta.json"
    meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "tokenizer_sha256": "0" * 64}))
    summary = run_pipeline(file, out_dir=out)
    printed = capsys.readouterr().out
    assert [r.result for r in summary.stages] == ["skipped", "ran"]
    assert f"its data {out / 'base' / 'data'} is not reused ({out / 'base' / 'data'} was tokenized with another" in printed
    assert "data: tokenizing" in printed and "data: reusing" not in printed
    assert states(file, out) == {"tok": "done", "base": "done"}


def test_a_signal_while_an_output_is_moved_aside_waits_until_the_move_is_recorded(corpus, tmp_path, monkeypatch):
    """A SIGTERM (or Ctrl-C) that comes between moving a stage's output aside and saving the record of the
    move is handled once the record is saved: what lies in STAGE.old-N is always in moved_aside."""
    from lmforge.pipeline import Terminated

    data = pipeline_dict(corpus)
    data["stages"] = data["stages"][:1]  # tok
    file, out = write(tmp_path / "p.yaml", data), tmp_path / "out"
    run_pipeline(file, out_dir=out)
    real = os.rename

    def rename(src, dst, *args, **kwargs):
        real(src, dst, *args, **kwargs)
        if Path(dst) == out / "tok.old-1":
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(Terminated):
        run_pipeline(file, out_dir=out, force=["tok"])
    monkeypatch.undo()
    moved = json.loads((out / "pipeline_state.json").read_text()).get("moved_aside")
    assert [(m["path"], m["reason"]) for m in moved or []] == [(str(out / "tok.old-1"), "--force")]
    assert (out / "tok.old-1" / "tokenizer.json").is_file() and not (out / "tok").exists()


def test_a_sigterm_the_run_was_started_ignoring_stays_ignored(corpus, tmp_path, monkeypatch):
    """A pipeline started with SIGTERM ignored (SIG_IGN, as a launcher may leave it) goes on through one."""
    data = pipeline_dict(corpus)
    data["stages"] = data["stages"][:1]  # tok
    file, out = write(tmp_path / "p.yaml", data), tmp_path / "out"
    sigterm_after(monkeypatch, "train_tokenizer_from_sources")
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        summary = run_pipeline(file, out_dir=out)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    except KeyboardInterrupt as e:  # (Terminated is one: uncaught, pytest would take it for a Ctrl-C and stop)
        pytest.fail(f"the SIGTERM the run was started ignoring stopped it: {e!r}")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert [r.result for r in summary.stages] == ["ran"] and record(out, "tok")["status"] == "done"


@pytest.mark.parametrize("when", ["preparing", "starting"])
def test_a_sigterm_before_a_stage_on_two_processes_trains_stops_the_run_with_143(corpus, tmp_path, monkeypatch,
                                                                                  capsys, when):
    """A SIGTERM while the processes of a `processes: N` stage prepare their data (torchrun passes it on, and
    they stop before any checkpoint), or while torchrun is being started, stops the run as it does in one
    process: the stage is recorded as interrupted, `pipeline run` exits with 143, and torchrun is stopped,
    never left running. (A stand-in for torchrun: a process that sleeps, and in `preparing` sends the
    pipeline the SIGTERM itself, as a scheduler would while it ran.)"""
    import subprocess
    import sys

    from lmforge.cli import main

    data = pipeline_dict(corpus)
    data["stages"] = data["stages"][:2]  # tok, base
    _stage(data, "base").update(processes=2)
    file, out = write(tmp_path / "p.yaml", data), tmp_path / "out"
    script = ("import os, signal, time\n" + ("os.kill(os.getppid(), signal.SIGTERM)\n" if when == "preparing" else "")
              + "time.sleep(60)\n")
    real, started = subprocess.Popen, []

    def popen(cmd, *args, **kwargs):
        if "torch.distributed.run" not in cmd:
            return real(cmd, *args, **kwargs)
        started.append(real([sys.executable, "-c", script], *args, **kwargs))
        if when == "starting":  # the moment torchrun has started, before anything knows of it
            os.kill(os.getpid(), signal.SIGTERM)
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", popen)
    try:
        assert main(["pipeline", "run", str(file), "--out-dir", str(out)]) == 143
        assert len(started) == 1 and started[0].poll() == -signal.SIGTERM  # passed on, and it stopped
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert "lmforge: terminated (SIGTERM)" in capsys.readouterr().err
    assert record(out, "base")["status"] == "interrupted" and record(out, "tok")["status"] == "done"
    assert not list(out.glob(".*.torchrun.yaml"))


# ---- status ---------------------------------------------------------------------------------------------
def test_status_table_and_json_of_every_stage_kind(corpus, tmp_path, capsys):
    from lmforge.cli import main

    data = pipeline_dict(corpus)
    data["stages"][:0] = [{"name": "stories", "kind": "data", "generator": "stories", "args": {"n_stories": 40}},
                          {"name": "calls", "kind": "data", "generator": "tool-calls",
                           "args": {"n_train": 8, "n_val": 4, "n_test": 4}}]
    data["stages"] += [
        {"name": "bpb", "kind": "eval", "task": "lm", "checkpoint": "ft", "baseline": "base",
         "data": "${stages.stories.out}/val.txt", "limit": 0},  # 0: every token
        {"name": "calls_eval", "kind": "eval", "task": "tool-calls", "checkpoint": "ft", "data": "calls",
         "limit": 2, "max_new_tokens": 4, "metric": "parse_rate"},
        {"name": "export", "kind": "export", "checkpoint": "ft", "formats": ["hf", "gguf"]},
        {"name": "deploy", "kind": "serve", "checkpoint": "ft", "port": 8123},
    ]
    file, out = write(tmp_path / "p.yaml", data), tmp_path / "out"
    assert main(["pipeline", "status", str(file), "--out-dir", str(out), "--json"]) == 0
    assert {r["state"] for r in json.loads(capsys.readouterr().out)["stages"]} == {"pending"}
    assert main(["pipeline", "run", str(file), "--out-dir", str(out), "--until", "base"]) == 0
    capsys.readouterr()
    with pytest.raises(LMForgeError, match="stage 'ft', whose model the serve stage deploys, is pending"):
        serve_pipeline(file, out_dir=out)
    # status reports the duration the state file recorded (a known value written in, not a clock reading)
    state_file = out / "pipeline_state.json"
    state = json.loads(state_file.read_text())
    state["stages"]["base"]["seconds"] = 123.5
    state_file.write_text(json.dumps(state))
    assert main(["pipeline", "status", str(file), "--out-dir", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    by_stage = {r["stage"]: r for r in report["stages"]}
    assert [r["state"] for r in report["stages"]] == ["done", "done", "done", "done", "pending", "pending", "pending",
                                                     "pending", "pending"]
    base = by_stage["base"]
    best = min(r["eval/loss"] for r in metric_rows(out, "base") if "eval/loss" in r)
    assert (base["kind"], base["metric"], base["value"], base["step"]) == ("lm", "eval/loss", best, 4)
    assert base["output"] == str(out / "base" / "checkpoints" / "best")
    assert base["seconds"] == 123.5

    assert main(["pipeline", "run", str(file), "--out-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"lmforge serve {out / 'ft' / 'checkpoints' / 'best'} --port 8123 --model-name tiny" in printed
    assert main(["pipeline", "status", str(file), "--out-dir", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].split() == ["stage", "kind", "state", "headline", "wall", "output"]
    lines = {line.split()[0]: line for line in table[2:] if line.strip() and not line.startswith("serve:")}
    assert all(" done " in lines[s] for s in ("stories", "calls", "tok", "base", "ft", "bpb", "calls_eval", "export"))
    assert " ready " in lines["deploy"]
    bpb = json.loads((out / "bpb" / "metrics.json").read_text())
    assert f"bpb {bpb['checkpoint']['metrics']['bpb']:.4f} (base: {bpb['baseline']['metrics']['bpb']:.4f})" in lines["bpb"]
    assert "parse_rate" in lines["calls_eval"] and "hf, gguf f16" in lines["export"]
    # the names a stage's metric: is checked against before it runs are the figures evaluation reports
    from lmforge.eval.lm import FIGURES, evaluate
    from lmforge.posttrain.toolcalls import METRIC_DOC

    calls = json.loads((out / "calls_eval" / "metrics.json").read_text())["checkpoint"]["metrics"]
    assert set(METRIC_DOC) == {k for k, v in calls.items() if k not in ("replies", "examples")}
    assert set(FIGURES) == {k for k, v in bpb["checkpoint"]["metrics"].items() if k != "data"}
    every = evaluate(out / "ft" / "checkpoints" / "best", out / "stories" / "val.txt", progress=False)
    assert bpb["checkpoint"]["metrics"]["tokens"] == every["tokens"] > 0
    assert (out / "export" / "hf" / "config.json").is_file() and (out / "export" / "tiny-f16.gguf").is_file()


def test_a_changed_validation_set_reruns_the_stage_that_reads_it(corpus, tmp_path):
    """data.val_path is an input like data.train_path: its content is part of the stage's fingerprint."""
    val = tmp_path / "val"
    val.mkdir()
    (val / "held.go").write_text("package held\n\nfunc Held(a, b int) int {\n\treturn a*b + a - b\n}\n")
    data = pipeline_dict(corpus)
    data["stages"] = data["stages"][:2]  # tok, base
    _stage(data, "base")["data"] = {"train_path": "${vars.corpus}", "seq_len": 32, "val_path": str(val)}
    file, out = write(tmp_path / "p.yaml", data), tmp_path / "out"
    run_pipeline(file, out_dir=out)
    assert states(file, out) == {"tok": "done", "base": "done"}
    with open(val / "held.go", "a") as f:
        f.write("\nfunc Other() int { return 7 }\n")
    rows = {r.stage: r for r in pipeline_status(file, out_dir=out)}
    assert (rows["base"].state, rows["base"].detail) == ("stale", "data.val_path changed")


# ---- several processes -----------------------------------------------------------------------------------
def test_a_stage_on_two_processes_runs_under_torchrun_sharded(corpus, tmp_path, capsys, monkeypatch):
    """`processes: 2` trains the stage with torchrun (here FSDP on two CPU processes, gloo): the same
    losses as one process at the same global batch; the stage is recorded and skipped like any other,
    and its process count is part of its fingerprint. A sharded stage on one process (the default) runs
    under torchrun too (FSDP needs its process group). The pipeline itself refuses to run under torchrun."""
    data = pipeline_dict(corpus)
    data["stages"] = data["stages"][:2]  # tok, base
    base = _stage(data, "base")
    base["overrides"]["model"].update({"embd_pdrop": 0.0, "resid_pdrop": 0.0, "attn_pdrop": 0.0})
    base["overrides"]["training"] = {**{k: v for k, v in base["overrides"]["training"].items() if k != "micro_batch_size"},
                                     "global_batch_size": 4, "parallel": "fsdp"}  # one of the two, in one place
    one = write(tmp_path / "one.yaml", data)
    base.update(processes=2)
    two = write(tmp_path / "two.yaml", data)
    run_pipeline(one, out_dir=tmp_path / "one")
    assert "1 process: -m torch.distributed.run --standalone --nproc_per_node=1 -m lmforge train" in capsys.readouterr().out
    # from a thread other than the main one (a notebook's or a server's), where no signal handler can be set
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        summary = pool.submit(run_pipeline, two, out_dir=tmp_path / "two").result()
    assert [r.result for r in summary.stages] == ["ran", "ran"]
    out = capsys.readouterr().out
    assert "2 processes: -m torch.distributed.run --standalone --nproc_per_node=2 -m lmforge train" in out
    assert "x2 |" in out  # the training run's own header: two processes
    losses = [{r["step"]: r["train/loss"] for r in metric_rows(tmp_path / n, "base") if "train/loss" in r}
              for n in ("one", "two")]
    assert sorted(losses[1]) == [1, 2, 3, 4]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    rec = record(tmp_path / "two", "base")
    assert rec["status"] == "done" and rec["step"] == 4 and rec["stopped"] == "completed"
    assert rec["inputs"]["processes"] == 2 and "processes" not in record(tmp_path / "one", "base")["inputs"]
    assert (tmp_path / "two" / "base" / "checkpoints" / "best" / "model.safetensors").is_file()
    assert not list((tmp_path / "two").glob(".*.torchrun.yaml"))  # the launch config is removed
    assert [r.result for r in run_pipeline(two, out_dir=tmp_path / "two").stages] == ["skipped", "skipped"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(LMForgeError, match="not under torchrun: give a training stage `processes: N`"):
        run_pipeline(two, out_dir=tmp_path / "two")


def test_a_failed_stage_on_two_processes_records_their_error(corpus, tmp_path):
    """What the training processes refuse (a global batch two processes cannot split) is the stage's
    recorded error and the pipeline's, not just an exit code."""
    data = pipeline_dict(corpus)
    data["stages"] = data["stages"][:2]
    base = _stage(data, "base")
    base.update(processes=2)
    base["overrides"]["training"] = {**{k: v for k, v in base["overrides"]["training"].items() if k != "micro_batch_size"},
                                     "global_batch_size": 5}
    file = write(tmp_path / "p.yaml", data)
    with pytest.raises(LMForgeError, match=r"2 training processes \(torchrun\) failed with exit code 1: "
                                           r"training.global_batch_size=5 is not divisible by 2 process"):
        run_pipeline(file, out_dir=tmp_path / "out")
    rec = record(tmp_path / "out", "base")
    assert rec["status"] == "failed" and "global_batch_size=5 is not divisible by 2 process" in rec["error"]
    assert not list((tmp_path / "out").glob(".*.torchrun.yaml"))


def test_a_stage_on_more_processes_than_gpus_is_refused_before_torchrun_starts(corpus, tmp_path, monkeypatch, capsys):
    """Checked against this machine's GPUs when the stage is about to start, not when the file is read
    (`pipeline status` on a machine with fewer GPUs still works)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # one GPU, as the machine would show it
    data = pipeline_dict(corpus)
    _stage(data, "base").update(processes=2)
    _stage(data, "base")["overrides"]["training"]["device"] = "auto"  # would train on the GPU
    file = write(tmp_path / "p.yaml", data)
    assert states(file, tmp_path / "out")["base"] == "pending"
    with pytest.raises(LMForgeError, match=r"2 training processes on this machine, but PyTorch sees 1 GPU\(s\)"):
        run_pipeline(file, out_dir=tmp_path / "out")
    assert "processes: -m torch.distributed.run" not in capsys.readouterr().out  # torchrun never started
    assert record(tmp_path / "out", "base")["status"] == "failed"


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_stage_on_two_processes_stops_at_a_checkpoint_on_a_signal_and_resumes(corpus, tmp_path, capsys, sig):
    """SIGTERM or Ctrl-C (SIGINT: KeyboardInterrupt here) to the pipeline while torchrun trains a stage:
    it is passed on, the processes save a checkpoint and stop, the stage is recorded as interrupted at
    that step, and the next run resumes it on two processes to the end."""
    import threading

    data = pipeline_dict(corpus, base_steps=60)
    data["stages"] = data["stages"][:2]
    base = _stage(data, "base")
    base.update(processes=2)
    file = write(tmp_path / "p.yaml", data)
    out = tmp_path / "out"

    def terminate_once_training() -> None:
        for _ in range(1200):
            if any((out / "base" / "checkpoints").glob("step-*")):  # any: keep_last may have removed the first
                os.kill(os.getpid(), getattr(signal, sig))
                return
            threading.Event().wait(0.05)

    # Ctrl-C as a terminal delivers it: a process started in the background by a shell (as CI may be) inherits
    # SIGINT ignored, and Python then raises no KeyboardInterrupt for it.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    watcher = threading.Thread(target=terminate_once_training, daemon=True)
    watcher.start()
    try:
        summary = run_pipeline(file, out_dir=out)
    finally:
        signal.signal(signal.SIGINT, previous)
    watcher.join()
    assert summary.interrupted == "base" and summary.signal == getattr(signal, sig)
    rec = record(out, "base")
    stopped_at = rec["step"]
    assert rec["status"] == "interrupted" and 1 <= stopped_at < 60
    assert (out / "base" / "checkpoints" / f"step-{stopped_at:06d}").is_dir()
    assert "was interrupted at step" in capsys.readouterr().out
    again = run_pipeline(file, out_dir=out)
    assert [r.result for r in again.stages] == ["skipped", "resumed"]
    assert record(out, "base")["step"] == 60
    assert f"resuming from {out / 'base' / 'checkpoints' / f'step-{stopped_at:06d}'}" in capsys.readouterr().out


# ---- bad input ------------------------------------------------------------------------------------------
def _stage(data, name):
    return next(s for s in data["stages"] if s["name"] == name)


BAD = {
    "top-level typo": (lambda d: d.update(stagess=d.pop("stages")),
                       ["p.yaml", "unknown key 'stagess'", "Did you mean 'stages'"]),
    "stage key typo": (lambda d: _stage(d, "base").update(tokeniser=_stage(d, "base").pop("tokenizer")),
                       ["stage 'base'", "unknown key 'tokeniser'", "Did you mean 'tokenizer'"]),
    "overrides typo": (lambda d: _stage(d, "ft")["overrides"].update({"training.max_step": 3}),
                       ["stage 'ft'", "'training.max_step'", "Did you mean 'training.max_steps'"]),
    "data typo": (lambda d: _stage(d, "base")["data"].update(train_pth="x"),
                  ["stage 'base'", "'data.train_pth'", "Did you mean 'data.train_path'"]),
    "unknown init": (lambda d: _stage(d, "ft").update(init="bsae"),
                     ["stage 'ft'", "init: 'bsae' is not an earlier stage", "Did you mean 'base'"]),
    "later stage": (lambda d: _stage(d, "base").update(init="ft"), ["stage 'base'", "'ft' comes later"]),
    "unknown tokenizer stage": (lambda d: _stage(d, "base").update(tokenizer="tk"),
                                ["stage 'base'", "tokenizer: 'tk'", "Did you mean 'tok'"]),
    "duplicate names": (lambda d: _stage(d, "ft").update(name="base"), ["two stages are named 'base'"]),
    "unknown kind": (lambda d: _stage(d, "ft").update(kind="lmm"), ["stage 'ft'", "unknown kind 'lmm'",
                                                                     "Did you mean 'lm'"]),
    "missing corpus": (lambda d: d["vars"].update(corpus="/nonexistent/corpus"),
                       ["stage 'tok'", "/nonexistent/corpus does not exist"]),
    "missing validation set": (lambda d: _stage(d, "base").update(data={"train_path": "${vars.corpus}", "seq_len": 32,
                                                                        "val_path": "/nonexistent/val.jsonl"}),
                               ["stage 'base'", "data.val_path: /nonexistent/val.jsonl does not exist"]),
    "unknown var": (lambda d: _stage(d, "tok").update(sources=["${vars.corpsu}"]),
                    ["stage 'tok'", "${vars.corpsu} is not defined", "Did you mean 'corpus'"]),
    "unknown stage output": (lambda d: _stage(d, "ft")["data"].update(train_path="${stages.bse.out}"),
                             ["stage 'ft'", "${stages.bse.out} names no stage", "Did you mean 'base'"]),
    "generator argument": (lambda d: d["stages"].insert(0, {"name": "st", "kind": "data", "generator": "stories",
                                                            "args": {"n_storis": 3}}),
                           ["stage 'st'", "args.n_storis", "Did you mean 'n_stories'"]),
    "export of a data stage": (lambda d: d["stages"].append({"name": "ex", "kind": "export", "checkpoint": "tok"}),
                               ["stage 'ex'", "'checkpoint: tok' names a tokenizer stage"]),
    "processes": (lambda d: _stage(d, "base").update(processes=0),
                  ["stage 'base'", "'processes' must be a whole number >= 1", "got 0"]),
    "unknown parallel": (lambda d: _stage(d, "ft")["overrides"].update({"training.parallel": "zero3"}),
                         ["stage 'ft'", "training.parallel must be ddp, fsdp or hsdp", "'zero3'"]),
    # found by a bad-input probe: these failed only when their stage ran, after the stages above it (some with
    # a raw TypeError, others naming a CLI flag or training.device instead of the stage's key)
    "tokenizer include": (lambda d: _stage(d, "tok").update(include=7),
                          ["stage 'tok'", "'include' must be a list of glob patterns (strings), got 7"]),
    "tokenizer max_bytes": (lambda d: _stage(d, "tok").update(max_bytes=-5),
                            ["stage 'tok'", "'max_bytes' must be a whole number of bytes > 0, got -5"]),
    "tokenizer heldout_fraction": (lambda d: _stage(d, "tok").update(heldout_fraction=1.5),
                                   ["stage 'tok'", "'heldout_fraction' must be a fraction in [0, 1)", "got 1.5"]),
    "eval limit": (lambda d: d["stages"].append({"name": "ev", "kind": "eval", "task": "lm", "checkpoint": "ft",
                                                 "data": "${vars.corpus}", "limit": "lots"}),
                   ["stage 'ev'", "'limit' must be a whole number >= 0 (0: all), got 'lots'"]),
    "eval batch_size": (lambda d: d["stages"].append({"name": "ev", "kind": "eval", "task": "lm", "checkpoint": "ft",
                                                      "data": "${vars.corpus}", "batch_size": 0}),
                        ["stage 'ev'", "'batch_size' must be a whole number >= 1, got 0"]),
    "eval metric": (lambda d: d["stages"].append({"name": "ev", "kind": "eval", "task": "lm", "checkpoint": "ft",
                                                  "data": "${vars.corpus}", "metric": "bbp"}),
                    ["stage 'ev'", "'metric: bbp' is not a lm figure. Did you mean 'bpb'?", "loss, ppl, bpb, tokens"]),
    "tool-call metric": (lambda d: d["stages"].append({"name": "ev", "kind": "eval", "task": "tool-calls",
                                                       "checkpoint": "ft", "data": "${vars.corpus}",
                                                       "metric": "exact_arg"}),
                         ["stage 'ev'", "'metric: exact_arg' is not a tool-calls figure. Did you mean 'exact_args'?"]),
    "eval device": (lambda d: d["stages"].append({"name": "ev", "kind": "eval", "task": "lm", "checkpoint": "ft",
                                                  "data": "${vars.corpus}", "device": "gpu please"}),
                    ["stage 'ev'", "'device' must be auto, cpu, cuda, cuda:N or mps, got 'gpu please'"]),
}


def test_a_device_this_machine_lacks_is_refused_at_run_not_at_status(golden, tmp_path, trains, monkeypatch):
    """A file with an eval stage on `device: cuda` can be inspected anywhere; running it where PyTorch sees no
    GPU stops before the first stage, naming the stage and its key."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    file, out = copy_of(golden, tmp_path)
    data = yaml.safe_load(file.read_text())
    data["stages"].append({"name": "ev", "kind": "eval", "task": "lm", "checkpoint": "ft", "data": "${vars.corpus}",
                           "device": "cuda"})
    write(file, data)
    assert [row.stage for row in pipeline_status(file, out_dir=out)][-1] == "ev"
    with pytest.raises(LMForgeError, match=r"stage 'ev' \(eval\): 'device: cuda', but this machine has no such"):
        run_pipeline(file, out_dir=out, force=["ft"])
    assert trains == []


@pytest.mark.parametrize("case", list(BAD))
def test_bad_pipeline_files_are_refused_before_anything_runs(golden, tmp_path, trains, case):
    file, out = copy_of(golden, tmp_path)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    data = yaml.safe_load(file.read_text())
    mutate, expected = BAD[case]
    mutate(data)
    write(file, data)
    with pytest.raises(LMForgeError) as e:
        run_pipeline(file, out_dir=out)
    for fragment in expected:
        assert fragment in str(e.value)
    with pytest.raises(LMForgeError):
        pipeline_status(file, out_dir=out)
    assert trains == []
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing touched


def test_missing_and_invalid_files(tmp_path, capsys):
    from lmforge.cli import main

    with pytest.raises(LMForgeError, match="pipeline file .*nope.yaml does not exist"):
        run_pipeline(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [x\nstages: []\n")
    with pytest.raises(LMForgeError, match="bad.yaml is not valid YAML"):
        run_pipeline(bad)
    bad.write_text("- name: x\n")
    assert main(["pipeline", "status", str(bad)]) == 2
    assert "must hold a mapping" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_shipped_pipelines_validate(monkeypatch, tmp_path):
    """Both pipelines of configs/pipelines load: every stage's config resolves against the recipes."""
    from lmforge.pipeline import load_pipeline

    corpus = write_go_corpus(tmp_path / "go", n_files=2)
    tiny = load_pipeline("code_assistant_tiny", vars={"go_src": str(corpus)})
    assert [s.name for s in tiny.stages][:5] == ["stories", "tool_data", "tokenizer", "language", "code"]
    code = tiny.configs["code"]
    assert code.training.init_from == str(tiny.out_dir / "language")
    assert code.model.n_layer == 4 and code.model.n_embd == 256  # the language stage's model, not the recipe's
    (tmp_path / "stories.txt").write_text("Once upon a time.\n<|endoftext|>\n")
    monkeypatch.setenv("TINYSTORIES", str(tmp_path / "stories.txt"))
    full = load_pipeline("code_assistant", vars={"code_corpus": str(corpus)})
    assert full.configs["language"].training.lr == 1e-4 and full.configs["code"].training.lr == 5e-6
    assert full.configs["tools"].training.lr == 3e-6


def test_quick_stages_follow_lmforge_code_and_later_stages_follow_their_output(tmp_path, monkeypatch):
    """A data stage whose generator's code changed runs again; a stage reading its output runs again only
    if that output differs."""
    from lmforge.pipeline import stages

    file = write(tmp_path / "p.yaml", {"name": "gen", "stages": [
        {"name": "stories", "kind": "data", "generator": "stories", "args": {"n_stories": 30}},
        {"name": "tok", "kind": "tokenizer", "sources": ["${stages.stories.out}/train.txt"], "vocab_size": 280,
         "heldout_fraction": 0.3}]})
    out = tmp_path / "out"
    run_pipeline(file, out_dir=out)
    report = json.loads((out / "tok" / "report.json").read_text())  # the stage's heldout_fraction, passed on
    assert 0.15 < report["heldout_documents"] / (report["heldout_documents"] + report["train_documents"]) < 0.45
    real = stages.code_hash
    monkeypatch.setattr(stages, "code_hash", lambda cache, *modules: real(cache, *modules) + "-edited"
                        if "lmforge.data.stories" in modules else real(cache, *modules))
    assert states(file, out) == {"stories": "stale", "tok": "stale"}  # tok: until stories has run again
    summary = run_pipeline(file, out_dir=out)
    assert [r.result for r in summary.stages] == ["ran", "skipped"]  # the same stories: the tokenizer stands
    assert states(file, out) == {"stories": "done", "tok": "done"}
    assert (out / "stories.old-1" / "train.txt").read_bytes() == (out / "stories" / "train.txt").read_bytes()


def test_a_second_pipeline_run_in_one_out_dir_is_refused_while_the_first_holds_it(tmp_path):
    from lmforge.pipeline.state import RunLock, run_in_progress

    with RunLock(tmp_path):
        assert run_in_progress(tmp_path)
        with pytest.raises(LMForgeError, match=r"another `lmforge pipeline run` \(pid \d+ on .+\) is working in"):
            RunLock(tmp_path).acquire()
    assert not run_in_progress(tmp_path)
    with RunLock(tmp_path):  # released: taken again
        pass
