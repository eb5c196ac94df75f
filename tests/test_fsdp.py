"""training.parallel: fsdp / hsdp (FSDP2 on CPU with gloo, under torchrun): the same losses as one
process at the same global batch, about half the weights + optimizer state per process, sharded
checkpoints (torch.distributed.checkpoint, no pickle) that resume exactly on two, three and one processes,
and clear errors for what it cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmforge.checkpoint import SHARDS_FILE, is_sharded, read_sharded_weights
from lmforge.config import load_config
from lmforge.errors import LMForgeError
from lmforge.train import train

from .train_helpers import REPO, lmforge_cmd, run, torchrun, write_recipe


def script_on_two(tmp_path: Path, code: str, *args: str, timeout: float = 300):
    """Run ``code`` as a script under ``torchrun --standalone --nproc_per_node=2`` from the repository root."""
    import sys

    script = tmp_path / "on_two.py"
    script.write_text(code)
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
                *args], timeout=timeout, cwd=REPO)


def passes_on_two(tmp_path: Path, code: str, mark: str, *args: str) -> None:
    """Run ``code`` on two processes (``script_on_two``): it must exit cleanly, each process printing ``mark``
    once its asserts have passed."""
    done = script_on_two(tmp_path, code, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count(mark) == 2, done.stdout


NO_DROPOUT = {"embd_pdrop": 0.0, "resid_pdrop": 0.0, "attn_pdrop": 0.0}


@pytest.fixture(scope="module")
def data_dir(go_data):
    return go_data


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in rows(run_dir) if "train/loss" in r}


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's full weights: its model.safetensors, or put together from its shards."""
    return read_sharded_weights(ckpt) if is_sharded(ckpt) else load_file(str(ckpt / "model.safetensors"))


def assert_no_pickle(ckpt: Path) -> None:
    """No file of the checkpoint is a pickle (protocol 2+ starts with 0x80) or a torch.save zip."""
    for f in ckpt.rglob("*"):
        if f.is_file():
            head = f.read_bytes()[:4]
            assert not head.startswith(b"\x80") and head != b"PK\x03\x04", f


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
    on_two = torchrun(["train", str(cut), "training.max_steps=6", "--resume"], tmp_path / "runs" / "cut")
    assert on_two.returncode == 0, on_two.stderr + on_two.stdout
    got = weights(tmp_path / "runs" / "cut" / "checkpoints" / "step-000006")
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6, msg=k)
    assert losses(tmp_path / "runs" / "cut") == pytest.approx(losses(tmp_path / "runs" / "full"), rel=1e-6)
    wider = torchrun(["train", str(cut), "name=cut1", "model.n_embd=64", "training.max_steps=6", "--resume"],
                     tmp_path / "unused")  # a GLOO_ABORT retry must not delete cut1
    assert wider.returncode != 0 and wider.stderr.count("does not fit this model") == 2, wider.stderr
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


_LOAD_ON_TWO = '''
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lmforge.errors import LMForgeError
from lmforge.models.base import LMForgeModel
from lmforge.train import fsdp

dist.init_process_group("gloo")
good = Path(sys.argv[1])
model = LMForgeModel.from_pretrained(good)
where = good if dist.get_rank() == 0 else good.parent / "not-there"  # process 1 cannot read it
try:
    fsdp.load_sharded(model, torch.optim.AdamW(model.param_groups(0.1, 1e-3)), where)
except LMForgeError as e:
    print(f"rank {dist.get_rank()}: {e}", flush=True)
    sys.exit(3)
'''


def test_a_checkpoint_one_process_cannot_read_stops_both_instead_of_hanging(tmp_path):
    """Process 1 cannot read the checkpoint (another machine without the shared directory); process 0
    can, and would otherwise wait for it inside DCP's collectives."""
    from lmforge.models.gpt import GPT, GPTConfig
    from lmforge.train import fsdp

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    good = tmp_path / "step-000001"
    model.save_pretrained(good, weights=False)
    fsdp.save_sharded(model, torch.optim.AdamW(model.param_groups(0.1, 1e-3)), good, {"scaler": {}, "model_state": {}},
                      world_size=1, is_main=True)
    done = script_on_two(tmp_path, _LOAD_ON_TWO, str(good), timeout=180)
    assert done.returncode != 0
    assert "rank 1: " in done.stdout and "is not a sharded checkpoint" in done.stdout, done.stdout + done.stderr
    assert f"rank 0: another process could not read the checkpoint {good}" in done.stdout, done.stdout


_COMPILED_BLOCKS = '''
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from lmforge.models.gpt import GPT, GPTConfig
from lmforge.train import fsdp

dist.init_process_group("gloo")
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=64, n_positions=64, n_embd=16, n_layer=2, n_head=2))


class Root(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, batch):
        return self.model(batch)


modules = fsdp.shard(Root(model), model, fsdp.layout("fsdp", torch.device("cpu"), 2, None, False), "default")
graphs = lambda: counters["stats"]["unique_graphs"]
with fsdp.gathered(modules), torch.no_grad():  # a rollout before the first step: many shapes
    for n in range(1, 13):
        model({"input_ids": torch.randint(0, 64, (1, n)), "labels": torch.randint(0, 64, (1, n))})
assert graphs() == 0, graphs()
batch = {"input_ids": torch.randint(0, 64, (2, 32)), "labels": torch.randint(0, 64, (2, 32))}
for _ in range(2):
    modules[-1](batch)[0].backward()
trained = graphs()
assert trained > 0
with fsdp.gathered(modules), torch.no_grad():
    for n in range(1, 13):
        model({"input_ids": torch.randint(0, 64, (2, n)), "labels": torch.randint(0, 64, (2, n))})
modules[-1](batch)[0].backward()
assert graphs() == trained, (graphs(), trained)
print(f"rank {dist.get_rank()}: compiled graphs {trained}", flush=True)
dist.destroy_process_group()
'''


_FROZEN = '''
import torch
import torch.distributed as dist

from lmforge.models.gpt import GPT, GPTConfig
from lmforge.train import fsdp

dist.init_process_group("gloo")
torch.manual_seed(0)
trained = GPT(GPTConfig(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2))
how = fsdp.layout("fsdp", torch.device("cpu"), 2, None, False)
fsdp.shard(trained, trained, how, None)
frozen = GPT(GPTConfig(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)).requires_grad_(False)
whole = sum(p.numel() for p in frozen.parameters())
modules = fsdp.shard_frozen(frozen, how)
local = lambda: sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in frozen.parameters())
fsdp.release(modules)  # before any call: a run resumed in mid-rollout trains a step first
at_rest = local()
order = modules[-1]._get_fsdp_state()._fsdp_param_group.comm_ctx.post_forward_order
for step in range(3):  # dpo's live reference: called in each step's loss, outside gathered
    with torch.no_grad():
        frozen.hidden_states(torch.randint(0, 64, (2, 8)))
    called = local()
    remembered = len(order)
    fsdp.release(modules)
    assert remembered > 0 and not order, (remembered, order)
    assert called > at_rest == local(), (called, at_rest, local())
assert at_rest <= whole // 2 + 64, (at_rest, whole)
print(f"rank {dist.get_rank()}: frozen {at_rest} of {whole}", flush=True)
'''


_GATHERER = '''
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lmforge.models.gpt import GPTConfig
from lmforge.recipes.ppo.model import ActorCritic, actor_critic_config
from lmforge.train import fsdp

dist.init_process_group("gloo")
torch.manual_seed(0)
config = actor_critic_config(GPTConfig(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2), None)
trained, twin = ActorCritic(config), ActorCritic(config)
twin.load_state_dict(trained.state_dict())  # stays whole: what the gathered policy must compute
frozen = ActorCritic(config).policy.requires_grad_(False)
how = fsdp.layout("fsdp", torch.device("cpu"), 2, None, False)
gather = fsdp.Gatherer(None)
gather.add(fsdp.shard(trained, trained, how, None))
gather.add(fsdp.shard_frozen(frozen, how))
whole = lambda m: not any(isinstance(p, DTensor) for p in m.parameters())
sharded = lambda m: all(isinstance(p, DTensor) for p in m.parameters())
nbytes = lambda *ms: 4 * sum(p.numel() for m in ms for p in m.parameters())
roots = nbytes(trained) - nbytes(*trained.repeated_blocks())  # embeddings, norms, heads of both parts
ids = torch.randint(0, 64, (2, 8))
with gather(trained.policy), torch.no_grad():  # the policy's blocks and the root, nothing else
    assert whole(trained.policy) and sharded(trained.value.trunk.blocks) and sharded(frozen)
    assert gather.now == nbytes(trained.policy.blocks) + roots, (gather.now, nbytes(trained.policy.blocks), roots)
    torch.testing.assert_close(trained.policy.hidden_states(ids), twin.policy.hidden_states(ids))
    with gather(trained.policy, frozen):  # nested: only what the outer call did not gather
        assert whole(frozen) and gather.now == nbytes(trained.policy.blocks) + roots + nbytes(frozen)
    assert whole(trained.policy) and sharded(frozen)  # the outer call's weights are still there
assert sharded(trained) and sharded(frozen) and gather.now == 0
assert gather.peak == nbytes(trained.policy.blocks) + roots + nbytes(frozen)
with pytest.raises(ValueError, match="neither a sharded model"):
    with gather(twin.policy):
        pass
print(f"rank {dist.get_rank()}: gathered one part at a time", flush=True)
dist.destroy_process_group()
'''


def test_a_call_outside_the_step_gathers_only_the_models_it_names(tmp_path):
    """``fsdp.Gatherer`` (``ModelHost.gathered``): ppo's policy alone is gathered with its model's root (the
    value model's blocks and a frozen model stay sharded), computes what the whole model computes, and a
    nested call gathers only what the outer one did not (leaving the outer's weights in place). The bytes
    it reports are the full weights it holds; a model it does not hold is refused before any gathering."""
    passes_on_two(tmp_path, _GATHERER, "one part at a time")


_EMPTY_SHARE = '''
import torch
import torch.distributed as dist

from lmforge.train.distributed import DistInfo
from lmforge.train.loop import weighted_means

dist.init_process_group("gloo")
rank = dist.get_rank()
info = DistInfo(rank=rank, local_rank=rank, world_size=2)
# process 0 scored two held-out batches (weights 3 and 1); process 1's share was empty
sums = {"loss": torch.tensor(2.0 * 3 + 4.0 * 1), "reward": 0.5 * 3 + 1.5 * 1} if rank == 0 else {}
means = weighted_means(sums, 4.0 if rank == 0 else 0.0, info, torch.device("cpu"))
assert means == {"loss": 2.5, "reward": 0.75}, means
assert weighted_means({}, 0.0, info, torch.device("cpu")) == {}  # nobody evaluated anything
print(f"rank {rank}: {means}", flush=True)
dist.destroy_process_group()
'''


def test_an_evaluation_share_left_empty_on_one_process_is_averaged_over_the_others(tmp_path):
    """A held-out set smaller than the processes leaves one with nothing to score: it still reduces the
    same metrics as the others (a mismatched all-reduce hangs under NCCL) and the means are the others'."""
    passes_on_two(tmp_path, _EMPTY_SHARE, "'loss': 2.5")


def test_a_frozen_model_is_sharded_at_rest_and_released_after_each_step(tmp_path):
    """A frozen model (a reference) keeps 1 / world_size of its weights; called outside ``gathered`` it
    gathers them, and ``release`` after the step frees its root's weights and FSDP's record of its
    forwards (which only a backward would clear), even before its first call."""
    passes_on_two(tmp_path, _FROZEN, "frozen")


def test_calls_on_gathered_weights_leave_the_compiled_blocks_to_training(tmp_path):
    """With training.compile the blocks are compiled in place; a rollout or a probe on the gathered
    weights (many shapes, no gradients) must run them eagerly, or it uses up torch.compile's recompile
    limit and the training step falls back to eager."""
    passes_on_two(tmp_path, _COMPILED_BLOCKS, "compiled graphs")


_WHOLE_ON = '''
import torch
import torch.distributed as dist

from lmforge.models.gpt import GPT, GPTConfig
from lmforge.train import fsdp

dist.init_process_group("gloo")
torch.manual_seed(0)
config = GPTConfig(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, flavor="llama")
sharded, whole = GPT(config).requires_grad_(False), GPT(config).requires_grad_(False)
whole.load_state_dict(sharded.state_dict())
whole.register_buffer("table", torch.randn(4))  # a buffer: FSDP's mixed precision leaves buffers alone
modules = fsdp.shard_frozen(sharded, fsdp.layout("fsdp", torch.device("cpu"), 2, torch.bfloat16, False))
assert fsdp.whole_on(whole, torch.device("cpu"), torch.bfloat16) is whole
assert {p.dtype for p in whole.parameters()} == {torch.bfloat16} and whole.table.dtype == torch.float32
ids = torch.randint(0, 64, (2, 8))
with fsdp.gathered(modules), torch.no_grad():
    gathered = dict(sharded.named_parameters())
    for name, p in whole.named_parameters():
        assert torch.equal(p, gathered[name]), name
    assert torch.equal(whole.hidden_states(ids), sharded.hidden_states(ids))
print(f"rank {dist.get_rank()}: whole as gathered", flush=True)
dist.destroy_process_group()
'''


def test_a_model_put_whole_on_the_device_holds_the_weights_fsdp_would_gather(tmp_path):
    """``fsdp.whole_on`` (``ModelHost.scoring``: dpo's reference filling its table under FSDP): the
    parameters in the compute dtype, equal to those a bf16 FSDP gathering holds, buffers left in fp32,
    and the same outputs."""
    passes_on_two(tmp_path, _WHOLE_ON, "whole as gathered")


_LOCKSTEP = '''
import sys

import torch
import torch.distributed as dist

from lmforge.models.gpt import GPT, GPTConfig
from lmforge.train import fsdp

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
config = GPTConfig(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
model, whole = GPT(config).eval(), GPT(config).eval()
whole.load_state_dict(model.state_dict())
modules = fsdp.shard(model, model, fsdp.layout("fsdp", torch.device("cpu"), 2, None, False), None)
gen = torch.Generator().manual_seed(1)
every = [{"input_ids": torch.randint(0, 64, (2, 8), generator=gen), "labels": torch.randint(0, 64, (2, 8), generator=gen)}
         for _ in range(4)]
# process 0 holds three batches; process 1 one, or none
shares = {"uneven": (every[:3], every[3:]), "empty": (every[:3], [])}[sys.argv[1]]
mine = shares[rank]
seen = []
with torch.no_grad():
    for batch, counts in fsdp.lockstep(mine, torch.device("cpu")):
        loss = model(batch)[0]  # the sharded forward: one all-gather per block, as many on both processes
        seen.append((counts, loss.item(), whole(batch)[0].item()))
fsdp.release(modules)
assert len(seen) == 3, seen
assert [c for c, _, _ in seen] == [True] * len(mine) + [False] * (3 - len(mine)), seen
assert all(abs(a - b) < 1e-5 for _, a, b in seen), seen
# a spare batch is a batch of this process (its last) or, with an empty share, process 0's first
spare = mine[-1] if mine else every[0]
assert all(abs(loss - whole(spare)[0].item()) < 1e-5 for c, loss, _ in seen if not c), seen
assert list(fsdp.lockstep([], torch.device("cpu"))) == []  # nobody has anything: no round at all
print(f"rank {rank}: in step over {len(seen)} batches", flush=True)
dist.destroy_process_group()
'''


@pytest.mark.parametrize("share", ["uneven", "empty"])
def test_held_out_batches_run_block_by_block_with_every_process_in_step(tmp_path, share):
    """``fsdp.lockstep`` (evaluation under FSDP): with three held-out batches on one process and one (or
    none) on the other, both run three sharded forwards (whose collectives would otherwise hang or fail),
    the figures of the batches that count are a whole model's, and the spare batches are flagged."""
    passes_on_two(tmp_path, _LOCKSTEP, "in step over 3 batches", share)


_EVALUATE = '''
import sys

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from lmforge.config import load_config
from lmforge.device import setup_device
from lmforge.models import build_model
from lmforge.recipes import TrainData
from lmforge.train.distributed import init_distributed
from lmforge.train.loop import Trainer

share, out = sys.argv[1], sys.argv[2]
distinfo = init_distributed("cpu", alone=True, cpu_collectives=False)
rank = distinfo.rank
model_values = {"family": "gpt", "vocab_size": 64, "n_positions": 16, "n_embd": 16, "n_layer": 2, "n_head": 2,
                "embd_pdrop": 0.0, "resid_pdrop": 0.0, "attn_pdrop": 0.0}
cfg = load_config(values={"name": "e", "out_dir": out, "model": model_values, "data": {"seq_len": 16},
                          "training": {"parallel": "fsdp", "compile": True, "device": "cpu", "precision": "fp32",
                                       "micro_batch_size": 2, "max_steps": 4}})
gen = torch.Generator().manual_seed(1)


def batch(n):
    labels = torch.randint(0, 64, (2, n), generator=gen)
    labels[1, n // 2:] = -100  # batches of different weights (predicted tokens)
    return {"input_ids": torch.randint(0, 64, (2, n), generator=gen), "labels": labels}


every = [batch(16) for _ in range(4)]
shares = {"uneven": (every[:3], every[3:]), "empty": (every, [])}[share]


class Train:
    def next_batch(self):
        return {"input_ids": torch.randint(0, 64, (2, 16)), "labels": torch.randint(0, 64, (2, 16))}


class Val:
    def iter_eval_batches(self, max_batches=None):
        return iter(shares[rank])


torch.manual_seed(0)
model = build_model(cfg.model)
whole = build_model(cfg.model).eval()
whole.load_state_dict(model.state_dict())
with torch.no_grad():
    sums = [(whole(b)[0].item() * int((b["labels"] != -100).sum()), int((b["labels"] != -100).sum())) for b in every]
expected = sum(s for s, _ in sums) / sum(w for _, w in sums)
devinfo = setup_device("cpu", "fp32", 1e12, 0)
trainer = Trainer(cfg, model, TrainData(train=Train(), val=Val()), devinfo, distinfo, cfg.run_dir)
root = trainer.sharded[-1]
graphs = lambda: counters["stats"]["unique_graphs"]


def check_evaluation():
    got = trainer.evaluate()["eval/loss"]  # the spare batches (process 1's) must not count
    assert abs(got - expected) < 1e-5, (got, expected)
    state = root._get_fsdp_state()._fsdp_param_group
    assert state.is_sharded and not state.comm_ctx.post_forward_order  # nothing left for the next backward
    assert trainer._gatherer.peak == 0  # block by block: no whole model gathered


check_evaluation()  # before any training step: the root gathered for the first time here
assert graphs() == 0, graphs()  # the compiled blocks ran eagerly
trainer._train_step()  # gradients only: the weights stay those evaluated
trainer._train_step()
compiled = graphs()
assert compiled > 0
check_evaluation()  # the compiled blocks run eagerly: no graph compiled for evaluation's no-grad forwards
trainer._train_step()
assert graphs() == compiled, (graphs(), compiled)
print(f"rank {rank}: evaluated {expected:.4f} with {len(shares[rank])} batches of its own", flush=True)
dist.destroy_process_group()
'''


@pytest.mark.parametrize("share", ["uneven", "empty"])
def test_evaluation_under_fsdp_counts_every_held_out_batch_once_and_leaves_training_as_it_was(tmp_path, share):
    """``Trainer.evaluate`` under FSDP on two processes whose held-out shares differ (3 + 1 batches, or 4 + 0):
    the held-out loss is a whole model's weighted mean over the four batches (the spare forwards that keep the
    processes in step do not count), the root is resharded afterwards with no record of the forwards for the
    next backward, and evaluating between training steps compiles nothing (the compiled blocks run eagerly)."""
    passes_on_two(tmp_path, _EVALUATE, "evaluated", share, str(tmp_path / "runs"))
