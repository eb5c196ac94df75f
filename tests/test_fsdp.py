"""training.parallel: fsdp / hsdp (FSDP2 on CPU with gloo, under torchrun): the same losses as one
process at the same global batch, about half the weights + optimizer state per process, sharded
checkpoints (torch.distributed.checkpoint, no pickle) that resume exactly on two, three and one processes,
and clear errors for what it cannot run."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmforge.checkpoint import (CHECKSUMS_FILE, SHARDS_FILE, checksum_mismatch, is_sharded, read_sharded_weights,
                                write_checksums)
from lmforge.config import load_config
from lmforge.errors import LMForgeError
from lmforge.train import train

from .train_helpers import REPO, lmforge_cmd, losses, rows, run, torchrun, write_recipe


NO_DROPOUT = {"embd_pdrop": 0.0, "resid_pdrop": 0.0, "attn_pdrop": 0.0}


@pytest.fixture(scope="module")
def data_dir(go_data):
    return go_data


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's full weights: its model.safetensors, or put together from its shards."""
    return read_sharded_weights(ckpt) if is_sharded(ckpt) else load_file(str(ckpt / "model.safetensors"))


def assert_no_pickle(ckpt: Path) -> None:
    """No file of the checkpoint is a pickle (protocol 2+ starts with 0x80) or a torch.save zip."""
    for f in ckpt.rglob("*"):
        if f.is_file():
            head = f.read_bytes()[:4]
            assert not head.startswith(b"\x80") and head != b"PK\x03\x04", f


def poison(shard: Path, prefix: str) -> str:
    """Write a NaN over the first value of the first float32 tensor of ``shard`` whose name starts with
    ``prefix``, in place (the header and the offsets DCP reads stay as they were); returns its name."""
    data = bytearray(shard.read_bytes())
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    name = next(k for k, v in header.items() if k.startswith(prefix) and v["dtype"] == "F32")
    start = 8 + size + header[name]["data_offsets"][0]
    data[start:start + 4] = struct.pack("<f", float("nan"))
    shard.write_bytes(bytes(data))
    write_checksums(shard.parent.parent)  # as a run whose weights went NaN writes it: the NaN check is tested
    return name


def recipe(tmp_path: Path, data_dir: Path, name: str, **training) -> Path:
    return write_recipe(tmp_path / f"{name}.yaml", data_dir, tmp_path / "runs", name=name,
                        model={**NO_DROPOUT, "n_layer": 3}, training={"max_steps": 6, "save_interval": 3,
                                                                      "eval_interval": 3, **training})


@pytest.mark.parametrize("parallel", ["fsdp", "hsdp"])
def test_two_sharded_processes_match_one_and_hold_half_the_state(tmp_path, data_dir, parallel):
    one = recipe(tmp_path, data_dir, "one", micro_batch_size=4)
    # fsdp: 2 micro-batches of 1 per process, gradients reduced after the second only
    # hsdp: activation checkpointing composed with the sharding (recomputed blocks gather their weights again)
    split = ({"micro_batch_size": 1, "grad_accum_steps": 2} if parallel == "fsdp"
             else {"micro_batch_size": 2, "activation_checkpointing": True})
    two = recipe(tmp_path, data_dir, "two", parallel=parallel, **split)
    r1 = run(lmforge_cmd("train", str(one)), cwd=REPO)
    assert r1.returncode == 0, r1.stderr
    r2 = torchrun(["train", str(two)], tmp_path / "runs" / "two")
    assert r2.returncode == 0, r2.stderr + r2.stdout
    a, b = losses(tmp_path / "runs" / "one"), losses(tmp_path / "runs" / "two")
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for s in a:
        assert a[s] == pytest.approx(b[s], rel=1e-5, abs=1e-6), s
    # Evaluation runs the sharded model block by block: the held-out losses of DDP on two processes (each
    # process scores its own share of the validation rows, as here) at steps 3 and 6.
    ddp = recipe(tmp_path, data_dir, "ddp", **split)
    assert torchrun(["train", str(ddp)], tmp_path / "runs" / "ddp").returncode == 0
    evals = [{r["step"]: r["eval/loss"] for r in rows(tmp_path / "runs" / n) if "eval/loss" in r} for n in ("ddp", "two")]
    assert sorted(evals[0]) == [3, 6] and evals[1] == pytest.approx(evals[0], rel=1e-5)
    # The step checkpoints are sharded (best/ is the ordinary files), with the same weights (tied head and
    # embedding stored once).
    for step in ("step-000003", "step-000006", "best"):
        sharded = tmp_path / "runs" / "two" / "checkpoints" / step
        assert is_sharded(sharded) == (step != "best") != (sharded / "model.safetensors").is_file()
        # the checksums written with it cover both processes' shards
        listed = json.loads((sharded / CHECKSUMS_FILE).read_text())["files"]
        assert (len([f for f in listed if f.startswith("shards/")]) == 2) == (step != "best")
        assert checksum_mismatch(sharded) is None
        wa, wb = weights(tmp_path / "runs" / "one" / "checkpoints" / step), weights(sharded)
        assert wa.keys() == wb.keys()
        for k in wa:
            torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)
    state_one = rows(tmp_path / "runs" / "one")[0]["train/state_mb"]
    state_two = rows(tmp_path / "runs" / "two")[0]["train/state_mb"]
    if parallel == "fsdp":  # process 0's shards: half, plus the padding of rows that do not split evenly
        assert 0.45 < state_two / state_one < 0.56, (state_one, state_two)
    else:  # one machine: hsdp shards within it as fsdp does
        assert state_two < 0.56 * state_one


def test_a_two_process_checkpoint_resumes_on_two_three_and_one_exactly(tmp_path, data_dir):
    """Stopped at step 3, a sharded run resumed on two processes (each reads its shards), on three (the
    shards re-split, unevenly: 3 does not divide the width of 32), and on one (fsdp is a no-op
    there: the full tensors are put together from the shards), reaches the same step-6 weights as the run
    that went straight through writing gathered checkpoints."""
    full = recipe(tmp_path, data_dir, "full", micro_batch_size=3, parallel="fsdp", fsdp_checkpoint="gathered")
    assert torchrun(["train", str(full)], tmp_path / "runs" / "full").returncode == 0
    assert not is_sharded(tmp_path / "runs" / "full" / "checkpoints" / "step-000006")
    want = load_file(str(tmp_path / "runs" / "full" / "checkpoints" / "step-000006" / "model.safetensors"))
    cut = recipe(tmp_path, data_dir, "cut", micro_batch_size=3, parallel="fsdp", max_steps=3)
    r = torchrun(["train", str(cut)], tmp_path / "runs" / "cut")
    assert r.returncode == 0, r.stderr
    written = tmp_path / "runs" / "cut" / "checkpoints" / "step-000003"
    assert sorted(p.name for p in (written / "shards").iterdir()) == [
        "shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]
    assert {p.name for p in written.iterdir()} >= {SHARDS_FILE, "rng_state.safetensors", "config.yaml"}
    assert not (written / "model.safetensors").exists() and not (written / "optimizer.safetensors").exists()
    assert_no_pickle(written)
    import shutil

    shutil.copytree(tmp_path / "runs" / "cut", tmp_path / "runs" / "cut1")
    shutil.copytree(tmp_path / "runs" / "cut", tmp_path / "runs" / "cut3")
    shutil.copytree(tmp_path / "runs" / "cut", tmp_path / "runs" / "cutnan")
    on_two = torchrun(["train", str(cut), "training.max_steps=6", "--resume"], tmp_path / "runs" / "cut")
    assert on_two.returncode == 0, on_two.stderr + on_two.stdout
    got = weights(tmp_path / "runs" / "cut" / "checkpoints" / "step-000006")
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6, msg=k)
    assert losses(tmp_path / "runs" / "cut") == pytest.approx(losses(tmp_path / "runs" / "full"), rel=1e-6)
    wider = torchrun(["train", str(cut), "name=cut1", "model.n_embd=64", "training.max_steps=6", "--resume"],
                     tmp_path / "unused")  # a GLOO_ABORT retry must not delete cut1
    assert wider.returncode != 0 and wider.stderr.count("does not fit this model") == 2, wider.stderr
    # A NaN in process 1's shard of a weight: both processes stop before training, the one that read it
    # naming the tensor (each process checks only its own shards).
    poisoned = poison(tmp_path / "runs" / "cutnan" / "checkpoints" / "step-000003" / "shards" /
                      "shard-00002-model-00001-of-00001.safetensors", "model.")
    nan = torchrun(["train", str(cut), "name=cutnan", "training.max_steps=6", "--resume"], tmp_path / "unused")
    assert nan.returncode != 0 and "non-finite weights or optimizer state (NaN or inf): 1 of" in nan.stderr and repr(poisoned) in nan.stderr, nan.stderr
    assert "another process found non-finite values" in nan.stderr, nan.stderr
    assert not (tmp_path / "runs" / "cutnan" / "checkpoints" / "step-000006").exists()
    # The same global batch of 6: micro-batch 2 on three processes, 6 on one.
    on_three = torchrun(["train", str(cut), "name=cut3", "training.max_steps=6", "training.micro_batch_size=2",
                         "--resume"], tmp_path / "unused", nproc=3)
    assert on_three.returncode == 0 and "written by 2 process(es), resuming on 3" in on_three.stdout, on_three.stderr
    resharded = tmp_path / "runs" / "cut3" / "checkpoints" / "step-000006"
    assert len(list((resharded / "shards").iterdir())) == 3
    got = weights(resharded)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=k)
    on_one = run(lmforge_cmd("train", str(cut), "name=cut1", "training.max_steps=6", "training.micro_batch_size=6",
                             "training.parallel=ddp", "--resume"), cwd=REPO)
    assert on_one.returncode == 0 and "written by 2 process(es), resuming on 1" in on_one.stdout, on_one.stderr
    one = load_file(str(tmp_path / "runs" / "cut1" / "checkpoints" / "step-000006" / "model.safetensors"))
    assert one.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(one[k], want[k], rtol=1e-4, atol=1e-5, msg=k)


def header(shard: Path) -> dict:
    """A safetensors file's header: each tensor's dtype, shape and offsets."""
    data = shard.read_bytes()
    return json.loads(data[8:8 + int.from_bytes(data[:8], "little")])


def test_8bit_moments_shard_with_the_rows_and_resume_on_two_and_one_process(tmp_path, data_dir):
    """training.optimizer_states=8bit under fsdp / hsdp: each process keeps the 8-bit codes and scales of its
    rows of each weight (DTensors, sharded as the weight is), rounded with the random bits of their places in the
    whole weight, so two processes train as one does at the same global batch with half the state each; the
    checkpoint gathered from the shards is a one-process run's optimizer state, and a sharded one (uint8 codes
    in the shards) resumes on two processes exactly and on one (the shards put together)."""
    eight = {"optimizer_states": "8bit", "micro_batch_size": 3}
    one = recipe(tmp_path, data_dir, "one", **{**eight, "micro_batch_size": 6})
    assert run(lmforge_cmd("train", str(one)), cwd=REPO).returncode == 0
    full = recipe(tmp_path, data_dir, "full", parallel="fsdp", fsdp_checkpoint="gathered", **eight)
    done = torchrun(["train", str(full)], tmp_path / "runs" / "full")
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = losses(tmp_path / "runs" / "one"), losses(tmp_path / "runs" / "full")
    assert sorted(a) == sorted(b) == list(range(1, 7))
    # The gradients differ by the order of float sums only, and the rounding bits are the same: a code can land
    # on the other side of a rounding point where a moment sits right at one, a 2^-3 step of that one value.
    for s in a:
        assert b[s] == pytest.approx(a[s], rel=1e-5), s
    state = [rows(tmp_path / "runs" / n)[0]["train/state_mb"] for n in ("one", "full")]
    assert 0.45 < state[1] / state[0] < 0.56, state  # process 0's rows: half, and the padding of uneven splits
    # Gathered on process 0, the state is a one-process run's: the same entries, dtypes and shapes, and the same
    # codes but for those few near a rounding point (the bits of process 1's rows follow their place in the
    # weight: hashing its own rows' indices instead, 52-70% of its codes differed, and the step-6 loss by 4e-5).
    mine = load_file(str(tmp_path / "runs" / "full" / "checkpoints" / "step-000006" / "optimizer.safetensors"))
    want = load_file(str(tmp_path / "runs" / "one" / "checkpoints" / "step-000006" / "optimizer.safetensors"))
    assert {k: (v.dtype, v.shape) for k, v in mine.items()} == {k: (v.dtype, v.shape) for k, v in want.items()}
    codes = [k for k, v in want.items() if v.dtype == torch.uint8]
    assert codes
    for k in codes:
        assert (mine[k] != want[k]).float().mean() < 0.01, k
    final = load_file(str(tmp_path / "runs" / "full" / "checkpoints" / "step-000006" / "model.safetensors"))
    # Stopped at step 3, sharded: the shards hold the codes as uint8 (an 8-bit weight's moments: no fp32 copy).
    cut = recipe(tmp_path, data_dir, "cut", parallel="fsdp", max_steps=3, **eight)
    done = torchrun(["train", str(cut)], tmp_path / "runs" / "cut")
    assert done.returncode == 0, done.stderr[-3000:]
    written = tmp_path / "runs" / "cut" / "checkpoints" / "step-000003"
    saved = {}
    for shard in sorted((written / "shards").iterdir()):
        for k, v in header(shard).items():
            saved.setdefault(k, set()).add(v["dtype"] if k != "__metadata__" else "")
    wte = "optim.tok_embed.weight."  # (384, 32): 192 rows a process
    assert {k[len(wte):]: v for k, v in saved.items() if k.startswith(wte)} == {
        "exp_avg": {"U8"}, "exp_avg_sq_sqrt": {"U8"}, "exp_avg_scale": {"F32"}, "exp_avg_sq_sqrt_scale": {"F32"},
        "step": {"I64"}}
    import shutil

    shutil.copytree(tmp_path / "runs" / "cut", tmp_path / "runs" / "cut1")
    on_two = torchrun(["train", str(cut), "training.max_steps=6", "--resume"], tmp_path / "runs" / "cut")
    assert on_two.returncode == 0, on_two.stderr[-3000:]
    assert losses(tmp_path / "runs" / "cut") == losses(tmp_path / "runs" / "full")
    got = weights(tmp_path / "runs" / "cut" / "checkpoints" / "step-000006")
    assert got.keys() == final.keys() and all(torch.equal(got[k], final[k]) for k in final)
    on_one = run(lmforge_cmd("train", str(cut), "name=cut1", "training.max_steps=6", "training.micro_batch_size=6",
                             "training.parallel=ddp", "--resume"), cwd=REPO)
    assert on_one.returncode == 0 and "written by 2 process(es), resuming on 1" in on_one.stdout, on_one.stderr
    got = load_file(str(tmp_path / "runs" / "cut1" / "checkpoints" / "step-000006" / "model.safetensors"))
    for k in final:
        torch.testing.assert_close(got[k], final[k], rtol=1e-4, atol=1e-5, msg=k)
    # The other way: the one-process run's step-3 checkpoint (the full state, every process reads it and keeps
    # its rows) resumed on two processes under hsdp (one machine: the mesh (replicate 1, shard 2)) goes on as the
    # one-process run did.
    shutil.copytree(tmp_path / "runs" / "one", tmp_path / "runs" / "hsdp")
    shutil.rmtree(tmp_path / "runs" / "hsdp" / "checkpoints" / "step-000006")
    hsdp = torchrun(["train", str(one), "name=hsdp", "training.parallel=hsdp", "training.micro_batch_size=3",
                     "--resume"], tmp_path / "unused")
    assert hsdp.returncode == 0 and "written by 1 process(es), resuming on 2" in hsdp.stdout, hsdp.stderr[-3000:]
    resumed = next(r for r in rows(tmp_path / "runs" / "hsdp") if r["step"] == 4 and "train/state_mb" in r)
    assert resumed["train/state_mb"] == pytest.approx(state[1])
    c = losses(tmp_path / "runs" / "hsdp")
    for s in (4, 5, 6):
        assert c[s] == pytest.approx(a[s], rel=1e-5), s


def test_bf16_shards_compute_in_bf16_and_keep_fp32_weights(tmp_path, data_dir):
    """With precision bf16 the (compiled) blocks compute on bf16 copies of the weights (the losses differ
    from the fp32 run's by rounding, not more) while the stored weights, and so the checkpoint, stay fp32."""
    fp32 = recipe(tmp_path, data_dir, "fp32", micro_batch_size=2, parallel="fsdp", max_steps=3)
    bf16 = recipe(tmp_path, data_dir, "bf16", micro_batch_size=2, parallel="fsdp", max_steps=3, precision="bf16",
                  compile=True)  # and each block compiled
    for r in (fp32, bf16):
        done = torchrun(["train", str(r)], tmp_path / "runs" / r.stem)
        assert done.returncode == 0, done.stderr
    a, b = losses(tmp_path / "runs" / "fp32"), losses(tmp_path / "runs" / "bf16")
    assert all(a[s] != b[s] and b[s] == pytest.approx(a[s], rel=0.02) for s in a)
    stored = weights(tmp_path / "runs" / "bf16" / "checkpoints" / "step-000003")
    assert {t.dtype for t in stored.values()} == {torch.float32}


def test_bad_parallel_settings_are_refused(tmp_path, data_dir):
    with pytest.raises(LMForgeError, match="training.parallel must be ddp, fsdp or hsdp"):
        train(load_config(str(recipe(tmp_path, data_dir, "bad", parallel="zero3"))))
    with pytest.raises(LMForgeError, match="launch with torchrun"):
        train(load_config(str(recipe(tmp_path, data_dir, "alone", parallel="fsdp"))))
    assert not (tmp_path / "runs" / "alone" / "checkpoints").exists()
    offload = recipe(tmp_path, data_dir, "offload", parallel="fsdp", fsdp_offload=True)
    r = torchrun(["train", str(offload)], tmp_path / "runs" / "offload", timeout=300)
    assert r.returncode != 0 and r.stderr.count("this run is on the CPU already: drop training.fsdp_offload") == 2


def test_one_process_under_torchrun_shards_over_a_group_of_one(tmp_path, data_dir):
    """``torchrun --nproc_per_node=1`` with training.parallel=fsdp runs FSDP over one process (what
    training.fsdp_offload on one GPU needs) instead of quietly training unsharded: its step checkpoints are
    one process's shards, evaluation runs block by block (nothing gathered whole: no ``train/gathered_mb``),
    and the training and held-out losses are the plain run's."""
    plain = recipe(tmp_path, data_dir, "plain", micro_batch_size=2)
    assert run(lmforge_cmd("train", str(plain)), cwd=REPO).returncode == 0
    alone = recipe(tmp_path, data_dir, "alone", micro_batch_size=2, parallel="fsdp")
    done = torchrun(["train", str(alone)], tmp_path / "runs" / "alone", nproc=1)
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = losses(tmp_path / "runs" / "plain"), losses(tmp_path / "runs" / "alone")
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), step
    written = tmp_path / "runs" / "alone" / "checkpoints" / "step-000006"
    assert is_sharded(written) and len(list((written / "shards").iterdir())) == 1
    assert not any("train/gathered_mb" in r for n in ("alone", "plain") for r in rows(tmp_path / "runs" / n))
    evals = [{r["step"]: r["eval/loss"] for r in rows(tmp_path / "runs" / n) if "eval/loss" in r} for n in ("plain", "alone")]
    assert sorted(evals[0]) == [3, 6] and evals[1] == pytest.approx(evals[0], rel=1e-5)


def test_bench_times_fsdp_over_one_process_under_torchrun(tmp_path, capsys):
    """``lmforge bench ... training.parallel=fsdp`` under ``torchrun --nproc_per_node=1`` times the sharded step
    (FSDP's overhead, and offload's on one GPU) and says so; started any other way it says how to launch it."""
    from lmforge.cli import main

    small = ["go_coder_tiny", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.seq_len=16",
             "training.micro_batch_size=2", "training.peak_flops=1e12", "--steps", "2", "--warmup", "1",
             "--vocab-size", "300"]
    done = torchrun(["bench", *small, "training.parallel=fsdp", "--json"], tmp_path / "unused", nproc=1)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout[done.stdout.index("{"):])
    assert results["runs"][0]["sharded"] is True and "fsdp over one process" in done.stdout
    plain = torchrun(["bench", *small, "--json"], tmp_path / "unused", nproc=1)
    unsharded = json.loads(plain.stdout[plain.stdout.index("{"):])["runs"][0]
    assert unsharded["sharded"] is False and unsharded["params"] == results["runs"][0]["params"]  # the same model
    assert main(["bench", *small, "training.parallel=fsdp"]) != 0
    assert "launch it as `torchrun --standalone --nproc_per_node=1 -m lmforge bench" in capsys.readouterr().err
    assert main(["bench", *small, "training.parallel=fsdp", "--compare-transformers"]) != 0
    assert "--compare-transformers times unsharded models" in capsys.readouterr().err
    two = torchrun(["bench", *small, "training.parallel=fsdp"], tmp_path / "unused")
    assert two.returncode != 0 and two.stderr.count("lmforge bench was started on 2 processes") == 2, two.stderr


def test_a_global_batch_two_processes_cannot_split_stops_every_rank(tmp_path, data_dir):
    bad = recipe(tmp_path, data_dir, "odd", parallel="fsdp", global_batch_size=5)
    r = torchrun(["train", str(bad)], tmp_path / "runs" / "odd", timeout=300)
    assert r.returncode != 0
    # every rank says why (and torchrun returned: no rank was left waiting for the other)
    assert r.stderr.count("global_batch_size=5 is not divisible by 2 process(es)") == 2, r.stderr


def test_models_fsdp_cannot_shard_are_refused_with_the_way_out(monkeypatch):
    from lmforge.models.gpt import GPT, GPTConfig
    from lmforge.models.reward import RewardModel
    from lmforge.recipes.ppo.model import ActorCritic, actor_critic_config
    from lmforge.train.fsdp import check_parallel

    from lmforge.recipes import get_kind

    config = GPTConfig(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    for kind in ("lm", "sft", "dpo", "grpo"):  # accepted
        check_parallel("fsdp", 2, GPT(config), get_kind(kind))
    check_parallel("fsdp", 2, RewardModel(config), get_kind("reward"))
    actor_critic = ActorCritic(actor_critic_config(config, None))
    assert len(actor_critic.repeated_blocks()) == 2  # the policy's block and the value model's
    check_parallel("hsdp", 2, actor_critic, get_kind("ppo"))
    # the recursive and HRGC kinds (small models) are not sharded
    with pytest.raises(LMForgeError, match=r"built for the kinds: dpo, grpo, lm, ppo, reward, sft; the 'hrgc' kind"):
        check_parallel("fsdp", 2, GPT(config), get_kind("hrgc"))
    # nor is a model without a stack of blocks, whatever the kind
    with pytest.raises(LMForgeError, match=r"this Linear names no blocks \(repeated_blocks\(\)\): use training.parallel=ddp"):
        check_parallel("fsdp", 2, torch.nn.Linear(2, 2), get_kind("lm"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(LMForgeError, match="torchrun --nproc_per_node 2 -m lmforge train"):
        check_parallel("hsdp", 1, GPT(config), get_kind("lm"))
    check_parallel("ddp", 1, GPT(config), get_kind("ppo"))
