"""The training loop: run directory, resume, signals, crash safety, NaN, DDP and bad input."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import yaml
from safetensors.torch import load_file

from lmforge.cli import main
from lmforge.config import load_config
from lmforge.errors import LMForgeError
from lmforge.train import train
from lmforge.data.loader import TokenDataset
from lmforge.tokenizer import Tokenizer
from lmforge.safe_state import load_state
from tests.train_helpers import REPO, FakeClock, lmforge_cmd, losses, run, subprocess_env, write_recipe


@pytest.fixture
def data_dir(go_data):
    return go_data  # the session's shared shards (read-only)


def test_train_writes_run_dir_and_tensorboard(tmp_path, data_dir):
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs", logging={"tensorboard": True})
    result = train(load_config(str(recipe)))
    run_dir = tmp_path / "runs" / "t"
    assert result.step == 20 and result.stopped == "completed"
    saved = load_config(str(run_dir / "config.yaml"))
    assert saved.model.vocab_size > 0  # resolved from the tokenizer and written down
    steps = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert steps == ["best", "step-000010", "step-000020"]
    ckpt = run_dir / "checkpoints" / "step-000020"
    for name in ("model.safetensors", "config.yaml", "optimizer.safetensors", "rng_state.safetensors", "trainer_state.json", "tokenizer.json"):
        assert (ckpt / name).is_file(), name
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in evals] == [10, 20]
    assert all(r["eval/bpb"] > 0 and r["eval/ppl"] > 1 for r in evals)
    # bits per byte of exactly the windows scored (eval_batches=2 of 4 rows), not of the split's average
    val = TokenDataset(data_dir, "val")
    targets = val.read(1, min((val.num_tokens - 1) // 32, 2 * 4) * 32 + 1)
    tok = Tokenizer.load(data_dir / "tokenizer.json")
    scored_bytes = len(tok.decode([t for t in targets.tolist() if t != tok.eos_id]).encode("utf-8"))
    for r in evals:
        assert r["eval/bpb"] == pytest.approx(r["eval/loss"] / math.log(2) * len(targets) / scored_bytes, rel=1e-6)
    assert losses(run_dir)[20] < losses(run_dir)[1]
    # the process's high-water memory (on a CPU its peak resident set): at least the weights + AdamW state, and
    # never falling
    peaks = [r["train/peak_memory_mb"] for r in rows if "train/loss" in r]
    assert len(peaks) == 20 and peaks[0] > rows[0]["train/state_mb"] and peaks == sorted(peaks), peaks[:3]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    assert {"train/loss", "train/lr", "eval/loss", "train/mfu"} <= set(acc.Tags()["scalars"])
    assert len(acc.Scalars("train/loss")) == 20


def test_keep_last_prunes_old_checkpoints(tmp_path, data_dir):
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs",
                          training={"max_steps": 8, "save_interval": 2, "keep_last": 2, "eval_interval": 4})
    train(load_config(str(recipe)))
    names = sorted(p.name for p in (tmp_path / "runs" / "t" / "checkpoints").iterdir())
    assert names == ["best", "step-000006", "step-000008"]


def test_resume_is_exact(tmp_path, data_dir, monkeypatch):
    """20 steps straight vs 10 + resume + 10: identical losses and weights (dropout on). The resume initialises
    no weight (each comes from the checkpoint; random ones cost ~30 s at 1.3B on a CPU)."""
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs")
    train(load_config(str(recipe), ["name=straight"]))
    straight = tmp_path / "runs" / "straight"
    resumed = tmp_path / "runs" / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step-000010", resumed / "checkpoints" / "step-000010")
    drawn = []
    normal = torch.nn.init.normal_

    def recorded(*args, **kwargs):
        drawn.append((args[0] if args else kwargs["tensor"]).device.type)
        return normal(*args, **kwargs)

    monkeypatch.setattr(torch.nn.init, "normal_", recorded)
    result = train(load_config(str(recipe), ["name=resumed"]), resume=True)
    assert drawn and set(drawn) == {"meta"}  # built on the meta device, then given the checkpoint's weights
    assert result.step == 20
    a, b = losses(straight), losses(resumed)
    assert sorted(b) == list(range(11, 21))
    assert [a[s] for s in range(11, 21)] == [b[s] for s in range(11, 21)]
    wa = load_file(str(straight / "checkpoints" / "step-000020" / "model.safetensors"))
    wb = load_file(str(resumed / "checkpoints" / "step-000020" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_refuses_to_clobber_existing_run_without_resume(tmp_path, data_dir):
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs", training={"max_steps": 2})
    train(load_config(str(recipe)))
    before = sorted(p.name for p in (tmp_path / "runs" / "t" / "checkpoints").iterdir())
    with pytest.raises(LMForgeError, match="already has checkpoints.*--resume"):
        train(load_config(str(recipe)))
    assert sorted(p.name for p in (tmp_path / "runs" / "t" / "checkpoints").iterdir()) == before

    # The step checkpoints deleted to save space (best/ kept), then one left incomplete: a new run, and a
    # --resume with nothing complete to resume from, are refused and change nothing.
    ckpts = tmp_path / "runs" / "t" / "checkpoints"
    best = (ckpts / "best" / "model.safetensors").read_bytes()
    metrics = (tmp_path / "runs" / "t" / "metrics.jsonl").read_text()
    for step in ckpts.glob("step-*"):
        shutil.rmtree(step)
    with pytest.raises(LMForgeError, match="already holds a trained model in .*best.*name=NEW"):
        train(load_config(str(recipe)))
    (ckpts / "step-000002").mkdir()
    with pytest.raises(LMForgeError, match=r"--resume: .* no complete checkpoint .*/best, step-000002 \(incomplete"):
        train(load_config(str(recipe)), resume=True)
    assert (ckpts / "best" / "model.safetensors").read_bytes() == best
    assert (tmp_path / "runs" / "t" / "metrics.jsonl").read_text() == metrics
    # best/ set aside by a write cut between its two renames (the run would put it back, then replace it)
    (ckpts / "step-000002").rmdir()
    (ckpts / "best").rename(ckpts / ".old-best")
    with pytest.raises(LMForgeError, match=r"already holds .old-best \(set aside by an interrupted write"):
        train(load_config(str(recipe)))
    assert (ckpts / ".old-best" / "model.safetensors").read_bytes() == best


def test_nan_loss_stops_naming_step_and_last_checkpoint(tmp_path, data_dir):
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs",
                          training={"lr": 1e25, "warmup_steps": 0, "grad_clip": 0.0, "save_interval": 1,
                                    "eval_interval": 0, "max_steps": 30})
    with pytest.raises(LMForgeError) as e:
        train(load_config(str(recipe)))
    msg = str(e.value)
    assert "at step" in msg and "last good checkpoint" in msg and "step-0000" in msg
    step = int(msg.split("at step ")[1].split(":")[0])
    ckpts = sorted((tmp_path / "runs" / "t" / "checkpoints").glob("step-*"))
    assert ckpts and int(ckpts[-1].name.split("-")[1]) == step - 1  # the bad update was never applied


def test_bad_inputs_give_clear_errors(tmp_path, data_dir, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs")
    assert main(["train", str(recipe), "data.path=/nonexistent/data"]) == 2
    assert "data.path=/nonexistent/data does not exist" in capsys.readouterr().err
    assert main(["train", str(recipe), "training.lr_max=3"]) == 2
    assert "unknown config key 'training.lr_max'" in capsys.readouterr().err
    assert main(["train", str(recipe), "model.vocab_size=100"]) == 2
    err = capsys.readouterr().err
    assert "model.vocab_size=100" in err and "tokens" in err
    assert main(["eval", str(tmp_path / "missing_ckpt"), "--data", str(data_dir)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_corrupt_checkpoint_is_reported_and_earlier_one_survives(tmp_path, data_dir, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs", training={"max_steps": 4,
                                                                                     "save_interval": 2})
    train(load_config(str(recipe)))
    ck = tmp_path / "runs" / "t" / "checkpoints"
    weights = ck / "step-000004" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert main(["eval", str(ck / "step-000004"), "--data", str(data_dir)]) == 2
    assert "corrupt" in capsys.readouterr().err
    assert main(["train", str(recipe), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "corrupt" in err
    # the newer checkpoint is damaged: resuming the run from the earlier one sets it aside (kept) and continues
    damaged = weights.read_bytes()
    assert main(["train", str(recipe), f"--resume={ck / 'step-000002'}"]) == 0
    assert "step-000004 is damaged" in capsys.readouterr().out
    assert (ck / "damaged-step-000004" / "model.safetensors").read_bytes() == damaged
    assert (ck / "step-000004" / "trainer_state.json").is_file() and weights.stat().st_size > 100
    # the earlier checkpoint still works, continued as a new run
    assert main(["train", str(recipe), "name=t2", f"--resume={ck / 'step-000002'}"]) == 0
    assert (tmp_path / "runs" / "t2" / "checkpoints" / "step-000004" / "trainer_state.json").is_file()


def test_sigterm_saves_a_resumable_checkpoint(tmp_path, data_dir):
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs",
                          training={"max_steps": 100000, "save_interval": 0, "eval_interval": 0})
    proc = subprocess.Popen(lmforge_cmd("train", str(recipe)), env=subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=REPO)
    metrics = tmp_path / "runs" / "t" / "metrics.jsonl"
    deadline = time.monotonic() + 300  # a guard against a hang; the wait is for 5 logged steps
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 5):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out  # saved, and not "completed": a job controller restarts it
    assert "SIGTERM" in out and "--resume" in out
    ckpts = sorted((tmp_path / "runs" / "t" / "checkpoints").glob("step-*"))
    assert len(ckpts) == 1
    step = json.loads((ckpts[0] / "trainer_state.json").read_text())["step"]
    assert step >= 5
    result = run(lmforge_cmd("train", str(recipe), f"training.max_steps={step + 3}", "--resume"), cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert f"resuming from {ckpts[0]} (step {step})" in result.stdout
    assert (tmp_path / "runs" / "t" / "checkpoints" / f"step-{step + 3:06d}").is_dir()


KILL_DURING_WRITE = textwrap.dedent("""
    import sys, time
    import lmforge.checkpoint as ck
    real = ck._fsync_dir_tree
    def slow(directory):
        real(directory)
        if "step-000004" in str(directory):
            print("WRITING", flush=True)
            time.sleep(600)
    ck._fsync_dir_tree = slow
    from lmforge.cli import main
    sys.exit(main(["train", sys.argv[1]]))
""")


def test_kill_9_during_checkpoint_write_keeps_previous_checkpoint(tmp_path, data_dir):
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs",
                          training={"max_steps": 6, "save_interval": 2, "eval_interval": 0})
    script = tmp_path / "kill_me.py"
    script.write_text(KILL_DURING_WRITE)
    proc = subprocess.Popen([sys.executable, str(script), str(recipe)], env=subprocess_env(), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if "WRITING" in line:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    ck = tmp_path / "runs" / "t" / "checkpoints"
    assert [p.name for p in sorted(ck.glob("step-*"))] == ["step-000002"]  # the half-written one is not visible
    assert any(p.name.startswith(".tmp-") for p in ck.iterdir())
    result = run(lmforge_cmd("train", str(recipe), "--resume"), cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "(step 2)" in result.stdout
    assert not any(p.name.startswith(".tmp-") for p in ck.iterdir())
    assert (ck / "step-000006" / "trainer_state.json").is_file()
    # the resumed run re-logged steps 3-4 after its checkpoint: each step appears once in the metrics
    steps = [json.loads(x)["step"] for x in (tmp_path / "runs" / "t" / "metrics.jsonl").read_text().splitlines()
             if "train/loss" in x]
    assert steps == list(range(1, 7))


def test_crash_between_the_renames_of_a_checkpoint_replacement_is_undone(tmp_path):
    from lmforge import checkpoint as ck

    root = tmp_path / "checkpoints"
    ck.write_checkpoint(root, 2, lambda d: (d / ck.STATE_FILE).write_text('{"step": 2}'), keep_last=3)
    os.rename(root / "step-000002", root / ".old-step-000002")  # the state right after the first rename
    writer = subprocess.Popen([sys.executable, "-c", "pass"])
    writer.wait()  # a writer that is gone (clean_partial leaves a live writer's directory alone)
    (root / f".tmp-step-000002-{writer.pid}").mkdir()  # and the unfinished replacement
    ck.clean_partial(root)
    assert [p.name for p in root.iterdir()] == ["step-000002"]
    assert ck.read_trainer_state(root / "step-000002")["step"] == 2


def test_ddp_two_processes_match_one_at_same_global_batch(tmp_path, data_dir):
    common = {"model": {"embd_pdrop": 0.0, "resid_pdrop": 0.0, "attn_pdrop": 0.0},
              "training": {"max_steps": 6, "save_interval": 0, "eval_interval": 3}}
    single = write_recipe(tmp_path / "one.yaml", data_dir, tmp_path / "runs", name="one",
                          model=common["model"], training={**common["training"], "micro_batch_size": 4})
    double = write_recipe(tmp_path / "two.yaml", data_dir, tmp_path / "runs", name="two",
                          model=common["model"], training={**common["training"], "micro_batch_size": 2})
    r1 = run(lmforge_cmd("train", str(single)), cwd=REPO)
    assert r1.returncode == 0, r1.stderr
    r2 = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "lmforge",
              "train", str(double)], cwd=REPO)
    assert r2.returncode == 0, r2.stderr + r2.stdout
    a, b = losses(tmp_path / "runs" / "one"), losses(tmp_path / "runs" / "two")
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for s in a:
        assert a[s] == pytest.approx(b[s], rel=1e-5, abs=1e-6)
    wa = load_file(str(tmp_path / "runs" / "one" / "checkpoints" / "step-000006" / "model.safetensors"))
    wb = load_file(str(tmp_path / "runs" / "two" / "checkpoints" / "step-000006" / "model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)
    # each rank's random state is in the checkpoint's safe RNG file, and a resume reads it back
    ckpt = tmp_path / "runs" / "two" / "checkpoints" / "step-000006"
    per_rank = load_state(ckpt / "rng_state.safetensors", "rng")["per_rank"]
    assert len(per_rank) == 2 and all(set(r) >= {"python", "numpy", "torch"} for r in per_rank)
    r3 = run(lmforge_cmd("train", str(double), "training.max_steps=7", "--resume"), cwd=REPO)
    assert r3.returncode == 0 and "written by 2 process(es), resuming on 1" in r3.stdout, r3.stderr
    assert sorted(losses(tmp_path / "runs" / "two")) == list(range(1, 8))


def test_wandb_offline_logging(tmp_path, data_dir, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs", training={"max_steps": 3},
                          logging={"wandb_project": "lmforge-test", "progress_bar": False, "tensorboard": False})
    train(load_config(str(recipe)))
    runs = list((tmp_path / "runs" / "t" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(p.suffix == ".wandb" for p in runs[0].iterdir())


def test_bf16_autocast_and_activation_checkpointing_train_on_cpu(tmp_path, data_dir):
    """bf16 autocast really runs (its losses differ from fp32 by rounding, not more) and training with
    activation checkpointing still learns."""
    common = {"max_steps": 4, "eval_interval": 2, "save_interval": 4}
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs",
                          model={"embd_pdrop": 0.0, "resid_pdrop": 0.0, "attn_pdrop": 0.0})
    train(load_config(str(recipe), ["name=fp32"] + [f"training.{k}={v}" for k, v in common.items()]))
    result = train(load_config(str(recipe), ["name=bf16", "training.precision=bf16",
                                             "training.activation_checkpointing=true"]
                               + [f"training.{k}={v}" for k, v in common.items()]))
    assert result.step == 4 and math.isfinite(result.eval_metrics["eval/loss"])
    fp32, bf16 = losses(tmp_path / "runs" / "fp32"), losses(tmp_path / "runs" / "bf16")
    assert bf16[4] < bf16[1]
    assert all(bf16[s] != fp32[s] and bf16[s] == pytest.approx(fp32[s], rel=0.02) for s in fp32)


def test_time_limit_stops_evaluates_and_saves(tmp_path, data_dir):
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs",
                          training={"max_steps": 100000, "max_time_minutes": 0.002, "save_interval": 0})
    result = train(load_config(str(recipe)))
    assert result.stopped == "time" and 0 < result.step < 100000
    assert result.last_checkpoint.name == f"step-{result.step:06d}" and result.last_checkpoint.is_dir()
    assert "eval/loss" in result.eval_metrics


def test_torch_compile_switch_gives_the_same_losses_as_eager(tmp_path, data_dir, monkeypatch):
    """training.compile (and its compile_mode, handed to torch.compile: reduce-overhead's CUDA graphs are
    CUDA's alone, so on the CPU it compiles as default) trains as eager mode does."""
    common = {"model": {"embd_pdrop": 0.0, "resid_pdrop": 0.0, "attn_pdrop": 0.0}}
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs", model=common["model"],
                          training={"max_steps": 3, "eval_interval": 0, "save_interval": 0})
    modes, real_compile = [], torch.compile

    def compile_spy(model, **kw):
        modes.append(kw.get("mode"))
        return real_compile(model, **kw)

    monkeypatch.setattr(torch, "compile", compile_spy)
    train(load_config(str(recipe), ["name=eager"]))
    train(load_config(str(recipe), ["name=compiled", "training.compile=true"]))
    train(load_config(str(recipe), ["name=graphs", "training.compile=true", "training.compile_mode=reduce-overhead"]))
    assert modes == ["default", "reduce-overhead"]
    # a rotary model's cos/sin table is built before compiling: one graph serves every step (stored by the
    # first compiled step, it was a graph output, read back by a second graph: an overwritten CUDA-graph
    # output under reduce-overhead)
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    train(load_config(str(recipe), ["name=rotary", "training.compile=true", "model.flavor=llama"]))
    assert counters["stats"]["unique_graphs"] - before == 1
    a = losses(tmp_path / "runs" / "eager")
    for name in ("compiled", "graphs"):
        b = losses(tmp_path / "runs" / name)
        for s in a:
            assert a[s] == pytest.approx(b[s], rel=1e-4), (name, s)
    with pytest.raises(LMForgeError, match="training.compile_mode must be one of default, reduce-overhead"):
        load_config(str(recipe), ["training.compile=true", "training.compile_mode=fast"])
    with pytest.raises(LMForgeError, match="compile_mode=max-autotune is torch.compile's mode: set training.compile"):
        load_config(str(recipe), ["training.compile_mode=max-autotune"])
    graphs = ["training.compile=true", "training.compile_mode=reduce-overhead"]
    with pytest.raises(LMForgeError, match=r"\(CUDA graphs\) needs training.grad_accum_steps=1"):
        load_config(str(recipe), [*graphs, "training.grad_accum_steps=2"])
    with pytest.raises(LMForgeError, match=r"\(CUDA graphs\) with training.parallel=fsdp is not supported"):
        load_config(str(recipe), [*graphs, "training.parallel=fsdp"])


def test_cuda_graph_steps_are_marked_before_each_micro_batch(tmp_path, monkeypatch):
    """With a CUDA-graph compile mode on CUDA, the loop tells CUDA graphs where each micro-batch starts, before
    its forward (so a replay may reuse the last one's outputs, all read by then). The mark is CUDA's alone: set
    here on a CPU trainer as a CUDA run sets it."""
    from lmforge.bench import _lmforge_stepper
    from lmforge.device import setup_device

    cfg = load_config("go_coder_tiny", ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.vocab_size=300",
                                        "data.seq_len=16", "training.micro_batch_size=2", "training.grad_accum_steps=3",
                                        "training.device=cpu", "training.precision=fp32", "training.peak_flops=1e12"])
    step, _ = _lmforge_stepper(cfg, setup_device("cpu", "fp32", 1e12), tmp_path)
    trainer = step.__self__
    assert trainer._graph_steps is False  # a CPU run, compile off
    trainer._graph_steps = True
    events, forward = [], trainer.fwd_model.forward
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: events.append("mark"))
    trainer.fwd_model.forward = lambda batch: (events.append("forward"), forward(batch))[1]
    step()
    assert events == ["mark", "forward"] * 3


def test_resume_after_a_lost_checkpoint_keeps_one_tensorboard_point_per_step(tmp_path, data_dir):
    """Steps logged after the checkpoint a run resumes from are logged again; TensorBoard must not
    show them twice (as metrics.jsonl does not)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs", logging={"tensorboard": True})
    train(load_config(str(recipe)))
    run_dir = tmp_path / "runs" / "t"
    shutil.rmtree(run_dir / "checkpoints" / "step-000020")  # as if the run died before saving step 20
    train(load_config(str(recipe)), resume=True)
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("train/loss")]
    assert sorted(steps) == list(range(1, 21))
    assert sorted(losses(run_dir)) == list(range(1, 21))


def test_corrupt_validation_shard_is_an_error_not_a_silent_skip(tmp_path, data_dir):
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    val_shard = sorted(data.glob("val_*.bin"))[0]
    val_shard.write_bytes(val_shard.read_bytes()[:-6])
    recipe = write_recipe(tmp_path / "r.yaml", data, tmp_path / "runs")
    with pytest.raises(LMForgeError, match=r"val_000000\.bin has .* bytes, expected"):
        train(load_config(str(recipe)))


def test_resume_flag_followed_by_an_override_resumes_with_the_override(tmp_path, data_dir, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs", training={"max_steps": 4,
                                                                                     "save_interval": 2})
    assert main(["train", str(recipe)]) == 0
    assert main(["train", str(recipe), "--resume", "training.max_steps=6"]) == 0
    out = capsys.readouterr().out
    assert "resuming from" in out and "step-000004" in out and "done: step 6" in out


def poison_backward(monkeypatch, at: int, value: float) -> dict:
    """Models the trainer builds get the ``at``-th backward's gradient of one bias multiplied by
    ``value`` (inf or nan): a non-finite gradient with a finite loss. Returns ``{"model", "n"}``: the
    model built and the backwards run so far."""
    import lmforge.train as train_module

    build = train_module.build_model
    seen = {"n": 0}

    def build_with_poisoned_backward(cfg):
        model = seen["model"] = build(cfg)

        def poison(grad):
            seen["n"] += 1
            return grad * value if seen["n"] == at else grad

        model.blocks[0].mlp.fc.bias.register_hook(poison)
        return model

    monkeypatch.setattr(train_module, "build_model", build_with_poisoned_backward)
    return seen


def test_non_finite_gradient_with_a_finite_loss_stops_before_the_update(tmp_path, data_dir, monkeypatch):
    poison_backward(monkeypatch, at=3, value=float("inf"))
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs",
                          training={"max_steps": 10, "save_interval": 1, "eval_interval": 0})
    with pytest.raises(LMForgeError, match=r"gradient norm is (inf|nan) at step 3: training stopped before "
                                           r"applying that update.*step-000002"):
        train(load_config(str(recipe)))
    ckpts = sorted(p.name for p in (tmp_path / "runs" / "t" / "checkpoints").glob("step-*"))
    assert ckpts[-1] == "step-000002"
    weights = load_file(str(tmp_path / "runs" / "t" / "checkpoints" / "step-000002" / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())


@pytest.mark.parametrize("states", ["fp32", "8bit"])
def test_a_non_finite_step_between_checks_is_skipped_on_the_device_and_stops_at_the_next_check(
        tmp_path, data_dir, monkeypatch, states):
    """The host reads the NaN flag only at check steps (here every 4th): the bad 5th update, and the
    finite 6th and 7th after it, are skipped by the optimizer on the device (fused AdamW's kernel, or
    AdamW8bit); step 8 stops with the weights of step 4, bit for bit."""
    seen = poison_backward(monkeypatch, at=5, value=float("nan"))
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs",
                          training={"max_steps": 12, "save_interval": 4, "log_interval": 4, "eval_interval": 0,
                                    "keep_last": 5, "optimizer_states": states})
    with pytest.raises(LMForgeError, match=r"gradient norm is nan at step 5: training stopped before applying that "
                                           r"update \(found at step 8: the updates of steps 5-7 were skipped on the "
                                           r"device\).*step-000004"):
        train(load_config(str(recipe)))
    assert seen["n"] == 8  # steps 6 and 7 ran with finite gradients: the flag is sticky
    run_dir = tmp_path / "runs" / "t"
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-000004"]
    saved = load_file(str(run_dir / "checkpoints" / "step-000004" / "model.safetensors"))
    now = seen["model"].state_dict()
    assert saved and all(torch.equal(now[k], v) for k, v in saved.items())


def test_the_device_side_skip_is_used_only_where_the_optimizer_kernel_honours_it():
    from lmforge.train.loop import _NonFinite

    params = [torch.nn.Parameter(torch.zeros(2))]
    fused, cpu = torch.optim.AdamW(params, fused=True), torch.device("cpu")
    assert _NonFinite(fused, cpu, scaled=False).on_device and fused.found_inf is not None
    assert not _NonFinite(fused, torch.device("mps"), scaled=False).on_device  # MPS's fused kernel ignores found_inf
    assert not _NonFinite(fused, cpu, scaled=False, offload=True).on_device  # FSDP offload: gradients on the CPU
    assert not _NonFinite(fused, cpu, scaled=True).on_device  # fp16: the grad scaler owns found_inf
    assert not _NonFinite(torch.optim.AdamW(params, foreach=True), cpu, scaled=False).on_device
    from lmforge.train.optim import AdamW8bit

    eight = AdamW8bit(params)
    assert _NonFinite(eight, cpu, scaled=False).on_device and eight.found_inf is not None
    assert not _NonFinite(AdamW8bit(params), cpu, scaled=True).on_device


# Reads of a tensor's value on the host: on an accelerator each waits for the device's queue.
_HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
               torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu}


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts host reads of tensors, leaving out the loss's CPU-only removal of unlabelled tokens
    (``_drop_unlabelled_on_cpu``: never called for tensors on an accelerator)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _HOST_READS:
            import traceback

            self.count += all(f.name != "_drop_unlabelled_on_cpu" for f in traceback.extract_stack())
        return func(*args, **(kwargs or {}))


def test_training_steps_read_nothing_from_the_device_between_check_steps(tmp_path, data_dir):
    """Loss, gradient norm, NaN flag and metrics stay on the device until a check step: 16 steps read
    exactly as often as 8 when both log (and evaluate and save) only at their end."""
    reads = {}
    for steps in (8, 16):
        recipe = write_recipe(tmp_path / f"r{steps}.yaml", data_dir, tmp_path / f"runs{steps}",
                              training={"max_steps": steps, "log_interval": steps, "eval_interval": 0,
                                        "save_interval": 0})
        cfg = load_config(str(recipe))
        with _HostReads() as mode:
            assert train(cfg).step == steps
        reads[steps] = mode.count
    assert reads[8] > 0  # the end's log line, evaluation and checkpoint do read
    assert reads[16] == reads[8]


def test_diagnostic_metrics_are_asked_for_on_logged_steps_only(tmp_path, data_dir, monkeypatch):
    import lmforge.train as train_module

    build = train_module.build_model
    asked = []

    def build_and_watch(cfg):
        model = build(cfg)
        model.register_forward_pre_hook(lambda m, args: asked.append(m.step_metrics) if m.training else None)
        return model

    monkeypatch.setattr(train_module, "build_model", build_and_watch)
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs",
                          training={"max_steps": 10, "log_interval": 4, "eval_interval": 0, "save_interval": 0})
    train(load_config(str(recipe)))
    assert [i + 1 for i, wanted in enumerate(asked) if wanted] == [4, 8, 10]
    assert len(asked) == 10


def test_logged_tokens_per_second_excludes_evaluation_time(tmp_path, data_dir, monkeypatch):
    """A fake clock: each training step takes 0.25 s, each evaluation 100 s and each checkpoint 50 s.
    Tokens/s counts the steps only, whatever this machine's speed."""
    from lmforge.train.loop import Trainer

    clock = FakeClock()
    for name, seconds in (("_train_step", 0.25), ("evaluate", 100.0), ("save_checkpoint", 50.0)):
        clock.charge(monkeypatch, Trainer, name, seconds)
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs",
                          training={"max_steps": 6, "eval_interval": 1, "save_interval": 3, "log_interval": 2})
    train(load_config(str(recipe)), clock=clock)
    rows = [json.loads(x) for x in (tmp_path / "runs" / "t" / "metrics.jsonl").read_text().splitlines()]
    speeds = {r["step"]: r["train/tokens_per_s"] for r in rows if "train/tokens_per_s" in r}
    tokens_per_step = 4 * 32
    assert speeds == {2: tokens_per_step / 0.25, 4: tokens_per_step / 0.25, 6: tokens_per_step / 0.25}
    assert clock.now == 6 * 0.25 + 6 * 100.0 + 2 * 50.0  # the evaluations and checkpoints did run


def test_resume_takes_the_learning_rate_from_the_new_config(tmp_path, data_dir):
    """`training.lr=...` given on a resume applies from the next step (the schedule position is kept)."""
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs",
                          training={"max_steps": 6, "save_interval": 3, "schedule": "constant", "warmup_steps": 0})
    train(load_config(str(recipe), ["training.max_steps=3"]))
    train(load_config(str(recipe), ["training.lr=1e-4"]), resume=True)
    ckpts = tmp_path / "runs" / "t" / "checkpoints"
    for step, lr in ((3, 3e-3), (6, 1e-4)):  # what the optimizer used, not only what was logged
        groups = load_state(ckpts / f"step-{step:06d}" / "optimizer.safetensors", "optimizer")["optimizer"]["param_groups"]
        assert [g["lr"] for g in groups] == pytest.approx([lr] * len(groups)), step


def test_data_of_another_tokenizer_is_refused_with_a_fix_that_works(tmp_path, data_dir, trained_run):
    """With training.init_from the tokenizer is the weights' (data.tokenizer pointing elsewhere is refused), so
    the message names only re-preparing the data; without it, data.tokenizer is a fix too."""
    from tests.train_helpers import make_prepared_data

    other = make_prepared_data(tmp_path / "other", vocab_size=300)
    recipe = write_recipe(tmp_path / "r.yaml", other, tmp_path / "runs", training={"max_steps": 1})
    with pytest.raises(LMForgeError, match="tokenized with a different tokenizer") as refused:
        train(load_config(str(recipe), [f"training.init_from={trained_run.best_checkpoint}"]))
    assert "re-run `lmforge data prepare` with this tokenizer" in str(refused.value)
    assert "data.tokenizer" not in str(refused.value)
    recipe = write_recipe(tmp_path / "r2.yaml", data_dir, tmp_path / "runs", training={"max_steps": 1})
    with pytest.raises(LMForgeError, match="point data.tokenizer at the one the data was made with"):
        train(load_config(str(recipe), [f"data.tokenizer={other.parent / 'tokenizer'}"]))


def test_a_refused_resume_leaves_the_runs_files_as_they_were(tmp_path, data_dir, capsys):
    """The run's config.yaml and tokenizer/ are rewritten only by a resume that was accepted: one refused
    (another model shape, another tokenizer's data) changes nothing, so the run still resumes as it was. An
    accepted resume with changed settings says which; a resume of a finished run prints no loss."""
    from tests.train_helpers import make_prepared_data

    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs", training={"max_steps": 2})
    assert main(["train", str(recipe)]) == 0
    run = tmp_path / "runs" / "t"
    files = {p: p.read_bytes() for p in [run / "config.yaml", *(run / "tokenizer").iterdir()]}
    with pytest.raises(LMForgeError, match="does not fit this model"):
        train(load_config(str(recipe), ["model.n_layer=3"]), resume=True)
    other = make_prepared_data(tmp_path / "other", vocab_size=300)
    with pytest.raises(LMForgeError, match="not with the tokenizer .*step-000002 was trained with"):
        train(load_config(str(recipe), [f"data.path={other}"]), resume=True)
    with pytest.raises(LMForgeError, match="not with the tokenizer .*step-000002 was trained with"):  # into a new run
        train(load_config(str(recipe), [f"data.path={other}", "name=t2"]), resume=str(run / "checkpoints" / "step-000002"))
    assert not (tmp_path / "runs" / "t2").exists()
    assert {p: p.read_bytes() for p in files} == files
    capsys.readouterr()
    assert main(["train", str(run / "config.yaml"), "--resume", "training.max_steps=3", "training.lr=1e-4"]) == 0
    out = capsys.readouterr().out
    assert "note: resuming with settings that differ from" in out and "training.lr 0.003 -> 0.0001" in out
    assert "training.max_steps 2 -> 3" in out and "done: step 3" in out
    assert yaml.safe_load((run / "config.yaml").read_text())["training"]["lr"] == 1e-4
    assert main(["train", str(run / "config.yaml"), "--resume"]) == 0
    out = capsys.readouterr().out
    assert "done: step 3 (completed)" in out and "nan" not in out and "differ" not in out


def test_data_val_path_is_the_val_split_of_a_train_path_run_and_a_resume_must_keep_it(tmp_path, capsys):
    """data.val_path: the whole file is the val split (less its copies of training documents), the tokenizer
    trained on the fly never sees it, and a resume with another data.val_path is refused."""
    records = [f"record {i}: the value {i * 7919 % 1009} of set {i % 7} is kept in the store\n" for i in range(40)]
    held_out = [f"quokkazebra {i} quokkazebra and quokkazebra again {i * 3}\n" for i in range(6)]
    train_file, val_file = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train_file.write_text("".join(json.dumps({"text": t}) + "\n" for t in records))
    val_file.write_text("".join(json.dumps({"text": t}) + "\n" for t in [*held_out[:3], records[5], *held_out[3:]]))
    recipe = write_recipe(tmp_path / "r.yaml", "", tmp_path / "runs",
                          data={"path": "", "train_path": str(train_file), "val_path": str(val_file)},
                          training={"max_steps": 2, "eval_interval": 2, "save_interval": 2})
    result = train(load_config(str(recipe)))
    assert result.step == 2
    assert "warning: 1 documents of data.val_path=" in capsys.readouterr().out
    data = tmp_path / "runs" / "t" / "data"
    meta = json.loads((data / "meta.json").read_text())
    assert [s["path"] for s in meta["val_sources"]] == [str(val_file.resolve())]
    assert meta["splits"]["val"]["documents"] == 6 and meta["splits"]["train"]["documents"] == 40
    tok = Tokenizer.load(data / "tokenizer.json")
    val = TokenDataset(data, "val")
    assert tok.decode(val.read(0, val.num_tokens).tolist()).replace("</s>", "") == "".join(held_out)
    # trained on data.train_path alone (on both it learns quokkazebra as a token)
    assert not [t for t in json.loads((data / "tokenizer.json").read_text())["model"]["vocab"] if "quokka" in t]
    evals = [json.loads(line) for line in (tmp_path / "runs" / "t" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals if "eval/loss" in r] == [2]

    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"text": "another held-out text"}) + "\n")
    with pytest.raises(LMForgeError, match=rf"was prepared with the validation set {val_file.resolve()}, but this "
                                           rf"run has data.val_path={other}; train into a new run"):
        train(load_config(str(recipe), [f"data.val_path={other}", "training.max_steps=3"]), resume=True)
    with pytest.raises(LMForgeError, match="but this run has no data.val_path"):
        train(load_config(str(recipe), ["data.val_path=", "training.max_steps=3"]), resume=True)
    with pytest.raises(LMForgeError, match="data.val_path and data.val_fraction=0.2 are both set"):
        load_config(str(recipe), ["data.val_fraction=0.2"])
    with pytest.raises(LMForgeError, match="data.val_path is the validation set for data.train_path.*set data.train_"):
        load_config(str(recipe), ["data.train_path=", f"data.path={data}"])
    with pytest.raises(LMForgeError, match="data.val_path is not read by the sft kind"):
        load_config(None, ["kind=sft", f"data.train_path={train_file}", f"data.val_path={val_file}"])
    # a val_path given over a recipe's val_fraction replaces it (the recipe's split is what the user's set replaces)
    split = load_config(None, values={"data": {"train_path": str(train_file), "val_fraction": 0.2}},
                        overrides=[f"data.val_path={val_file}"]).data
    assert (split.val_path, split.val_fraction) == (str(val_file), 0.01)


def test_a_stop_at_an_evaluation_step_leaves_it_to_the_resume(tmp_path, data_dir, monkeypatch):
    """Ctrl-C during step 4, where an evaluation is due, stops without it (a stop stays quick); the resume
    does it first, on step 4's weights, and logs the steps since the last log line as one window, as an
    unbroken run does: every logged figure and best/ equal the unbroken run's."""
    import lmforge.train as train_module

    build = train_module.build_model
    backwards = {"n": 0, "at": 0}

    def build_with_ctrl_c(cfg):
        model = build(cfg)

        def hook(grad):
            backwards["n"] += 1
            if backwards["n"] == backwards["at"]:
                os.kill(os.getpid(), signal.SIGINT)
            return grad

        model.blocks[0].mlp.fc.bias.register_hook(hook)
        return model

    monkeypatch.setattr(train_module, "build_model", build_with_ctrl_c)
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs",
                          training={"max_steps": 8, "eval_interval": 4, "save_interval": 0, "log_interval": 3})
    train(load_config(str(recipe), ["name=unbroken"]))
    backwards.update(n=0, at=4)
    cut = train(load_config(str(recipe), ["name=cut"]))
    assert (cut.step, cut.stopped, cut.signal) == (4, "signal", signal.SIGINT)
    run = tmp_path / "runs" / "cut"
    assert not [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "eval/loss" in r]
    assert json.loads((run / "checkpoints" / "step-000004" / "trainer_state.json").read_text())["pending"] == ["eval"]
    backwards.update(n=0, at=0)
    # resumed into another run (name=NEW --resume PATH): that run does the evaluation; cut's checkpoint is left as is
    other = train(load_config(str(recipe), ["name=other", "training.max_steps=4"]),
                  resume=str(run / "checkpoints" / "step-000004"))
    assert "eval/loss" in other.eval_metrics
    assert json.loads((run / "checkpoints" / "step-000004" / "trainer_state.json").read_text())["pending"] == ["eval"]
    assert train(load_config(str(recipe), ["name=cut"]), resume=True).step == 8
    state = json.loads((run / "checkpoints" / "step-000004" / "trainer_state.json").read_text())
    assert state["pending"] == [] and state["best_score"] == other.eval_metrics["eval/loss"]  # a second resume knows

    def logged(name: str) -> list[tuple]:
        rows = map(json.loads, (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines())
        return [(r["step"], r.get("train/loss"), r.get("eval/loss")) for r in rows]

    assert logged("cut") == logged("unbroken")
    assert [s for s, _, e in logged("cut") if e is not None] == [4, 8]
    a = load_file(str(tmp_path / "runs" / "unbroken" / "checkpoints" / "best" / "model.safetensors"))
    b = load_file(str(run / "checkpoints" / "best" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
