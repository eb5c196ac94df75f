"""FSDP outside the training step (FSDP2 on CPU with gloo, scripts run on two processes under torchrun):
gathering only the models a call names, frozen models sharded at rest, held-out batches run block by block
with the processes in step, a model put whole on the device as a gathering would give it, and a checkpoint
one process cannot read stopping both. The training runs themselves are in ``test_fsdp.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .train_helpers import REPO, run


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
