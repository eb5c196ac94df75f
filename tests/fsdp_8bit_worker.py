"""Run by tests/test_optim.py under torchrun (gloo, CPU): AdamW8bit over FSDP2-sharded weights against one
process's AdamW8bit over the same weights and gradients, bit for bit (codes, scales, weights) after steps, after
loading a full state and after a torch.distributed.checkpoint save and load; and, where the mesh is CUDA's but
the shards stay in CPU memory (training.fsdp_offload), the moments stay there too. Exits non-zero on a
mismatch. argv: a directory for the checkpoint."""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from lmforge.train.optim import AdamW8bit, _local

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))


def make() -> nn.Module:
    # 8-bit matrices of 1024 x 64 and 640 x 7 rows split unevenly over 3 processes, one of 4 x 1024 rows that
    # leaves a process without rows; fp32-moment vectors and small matrices between them
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64), nn.Linear(64, 1024, bias=False), nn.Linear(1024, 4),
                         nn.Linear(4, 7, bias=False), nn.Linear(7, 640, bias=False), nn.Linear(640, 7))


def groups(model: nn.Module) -> list[dict]:  # two groups that interleave the parameters: keys follow the groups
    ps = list(model.parameters())
    return [{"params": ps[::2], "weight_decay": 0.1}, {"params": ps[1::2], "weight_decay": 0.0}]


ref, sharded = make(), make()
for m in sharded:
    fully_shard(m, mesh=mesh)
fully_shard(sharded, mesh=mesh)
names = [n for n, _ in ref.named_parameters()]
names = names[::2] + names[1::2]  # in the groups' order
one = AdamW8bit(groups(ref), lr=1e-2, seed=3)


def fresh() -> AdamW8bit:
    """A new optimizer over the sharded weights, without gradients (as a resume builds it: torch.distributed.
    checkpoint sets the state up by a step of zero gradients only where no weight has one)."""
    for p in sharded.parameters():
        p.grad = None
    return AdamW8bit(groups(sharded), lr=1e-2, seed=3)


def steps(opt: AdamW8bit, first: int, last: int) -> None:
    for s in range(first, last):
        g = torch.Generator().manual_seed(100 + s)
        for pr, ps in zip(ref.parameters(), sharded.parameters()):
            full = torch.randn(pr.shape, generator=g) * (1 + s)
            pr.grad, ps.grad = full.clone(), distribute_tensor(full.clone(), ps.device_mesh, ps.placements)
        one.step()
        opt.step()


def same(opt: AdamW8bit, when: str) -> None:
    """The 8-bit weights and their codes and scales equal one process's bit for bit; the fp32-moment ones within
    float rounding (PyTorch's fused AdamW over shorter stretches of memory rounds a few values otherwise)."""
    eight = 0
    for (name, pr), ps in zip(ref.named_parameters(), sharded.parameters()):
        mine, theirs = opt.state[ps], one.state[pr]
        assert set(mine) == set(theirs), (when, name)
        exact = "exp_avg_scale" in mine
        eight += exact
        for key, a, b in [("weight", ps.full_tensor(), pr.detach())] + [
                (key, mine[key], value) for key, value in theirs.items() if key != "step"]:
            if key != "weight":
                assert isinstance(a, DTensor), (when, name, key)
                a = a.full_tensor()
            if exact:
                assert torch.equal(a, b), (when, name, key)
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8, msg=f"{when}: {name}.{key}")
    assert eight == 5, eight  # 96x64, 64x96, 1024x64, 4x1024 and 7x640


opt = AdamW8bit(groups(sharded), lr=1e-2, seed=3)
steps(opt, 0, 3)
same(opt, "after 3 steps")
# a single process's state, loaded by names (as fsdp.load_optimizer_state does), then 2 more steps
saved = one.state_dict()
by_name = {"state": {names[i]: {k: v.clone() for k, v in e.items()} for i, e in saved["state"].items()},
           "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]}
opt = fresh()
set_optimizer_state_dict(sharded, opt, by_name, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
steps(opt, 3, 5)
same(opt, "a full state loaded, 2 steps")
# saved through torch.distributed.checkpoint, loaded into a fresh optimizer, 2 more steps
options = StateDictOptions(full_state_dict=False)
dcp.save({"optim": get_optimizer_state_dict(sharded, opt, options=options)}, checkpoint_id=sys.argv[1])
opt = fresh()
target = {"optim": get_optimizer_state_dict(sharded, opt, options=options)}
dcp.load(target, checkpoint_id=sys.argv[1])
set_optimizer_state_dict(sharded, opt, target["optim"], options=options)
steps(opt, 5, 7)
same(opt, "a DCP checkpoint loaded, 2 steps")

# training.fsdp_offload: a CUDA mesh (no CUDA needed to describe one) over shards in CPU memory
cuda_mesh = DeviceMesh("cuda", torch.arange(world), _init_backend=False)
rows = -(-64 // world)
local = torch.randn(max(0, min(rows, 64 - rank * rows)), 128)
spec = DTensorSpec(cuda_mesh, (Shard(0),), tensor_meta=TensorMeta(torch.Size((64, 128)), (128, 1), local.dtype))
p = nn.Parameter(DTensor(local, spec, requires_grad=False))
state = AdamW8bit([p], lr=1e-2)._init_state(p)
assert {k: _local(v).device.type for k, v in state.items()} == dict.fromkeys(state, "cpu"), state
print(f"rank {rank}: the same codes, scales and weights as one process; offloaded moments in CPU memory", flush=True)
dist.destroy_process_group()
