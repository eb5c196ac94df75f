"""Fully sharded data parallelism (``training.parallel: fsdp | hsdp``) with PyTorch's FSDP2.

DDP keeps a full copy of the weights, gradients and optimizer state on every process. FSDP2
(``torch.distributed.fsdp.fully_shard``) splits each of them into ``world_size`` shards, one per
process, so that with Adam, whose state is twice the weights, a process holds about
``1 / world_size`` of the model's training memory. It gathers a block's weights just before the
block runs and frees them after it. ``hsdp`` shards within a machine and replicates across machines
(``torchrun --nnodes``): the weight gathers stay on the fast links inside a machine, and only the
gradients cross between machines.

Layout: one ``fully_shard`` per block of the model's ``repeated_blocks()`` (a reward model's trunk,
ppo's policy and value model), and one for the root. The root is the loop's objective module, whose
forward is what each micro-batch calls, so it holds the rest (embeddings, final norm, heads). Weights are stored in fp32. With ``precision: bf16`` the blocks compute in bf16
and gradients are reduced in fp32 (``MixedPrecisionPolicy``). ``training.fsdp_offload`` keeps the
shards of weights, gradients and optimizer state in CPU memory, for GPUs that cannot hold even those.
A kind's frozen models (dpo's live reference, grpo's and ppo's reference, a reward model that scores
rollouts) are sharded the same way (``shard_frozen``).

What runs outside a training step:

- ``gathered`` puts the full weights (in the compute dtype) of some of a model's sharded modules on every
  process. Code inside it calls the plain model, a different number of times on each process if it likes,
  with no collective. The loop (``Trainer.gathered``) picks the modules a call needs: a probe gathers the
  trained model; a rollout (grpo, ppo) gathers one model at a time (the policy while it samples, then each
  scorer: ``ModelHost.gathered``), so beside the shards it holds one model's blocks at a time (and the
  root's weights: embeddings and heads).
- Evaluation of a loss on held-out batches gathers nothing whole: it runs the sharded model as a training
  step's forward does, block by block, with the processes in step (``lockstep``: one that has run out of
  batches runs a spare one that does not count).
- ``full_model_state`` / ``full_optimizer_state`` gather the fp32 weights and the optimizer state on
  process 0, in exactly the form a single-process run saves: ``best/`` (weights only) and, with
  ``training.fsdp_checkpoint: gathered``, the step checkpoints are the ordinary files.

Step checkpoints (``training.fsdp_checkpoint: sharded``, the default) are written by every process:
``save_sharded`` hands this process's shards of the weights and the optimizer state to
``torch.distributed.checkpoint`` with torch's ``HuggingFaceStorageWriter``, which writes one safetensors
file per process with each piece's offset as JSON in its header; process 0 adds ``shards.json`` (the
tensors' full shapes, the parameter groups and the other non-tensor state). No process ever holds the
whole state. DCP's default ``FileSystemWriter`` is not used: its ``.metadata`` file is a pickle, and
nothing lmforge reads may run code; ``HuggingFaceStorageReader`` reads the layout from the safetensors
headers alone. ``load_sharded`` reads such a checkpoint into the shards of any number of processes
(DCP reshards); on one process, or under DDP, ``lmforge.checkpoint.read_shards`` puts the full tensors
together without a process group.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmforge import checkpoint as ckpt
from lmforge.errors import LMForgeError

PARALLEL = ("ddp", "fsdp", "hsdp")


def active(parallel: str) -> bool:
    """Whether ``training.parallel`` shards this run: fsdp / hsdp in a torchrun job (of one process, too:
    ``training.fsdp_offload`` on one GPU), whose process group ``lmforge.train`` has joined."""
    import torch.distributed as dist

    return parallel != "ddp" and dist.is_available() and dist.is_initialized()


def check_parallel(parallel: str, world_size: int, model: nn.Module, spec: Any) -> None:
    """Errors of ``training.parallel`` that need no process group, the same on every rank."""
    if parallel not in PARALLEL:
        raise LMForgeError(f"training.parallel must be one of {', '.join(PARALLEL)}, got {parallel!r}")
    if parallel == "ddp":
        return
    if world_size <= 1 and "WORLD_SIZE" not in os.environ:
        raise LMForgeError(f"training.parallel={parallel} shards the model across processes: launch with torchrun, "
                           f"e.g. `torchrun --nproc_per_node 2 -m lmforge train ...` (on one process use "
                           "training.parallel=ddp, the default, or torchrun --nproc_per_node 1 for "
                           "training.fsdp_offload on one GPU)")
    check_kind(parallel, spec, f" ({type(model).__name__})")
    if not (model.repeated_blocks() if hasattr(model, "repeated_blocks") else []):
        raise LMForgeError(f"training.parallel={parallel} shards a model block by block, and this "
                           f"{type(model).__name__} names no blocks (repeated_blocks()): use training.parallel=ddp")


def check_kind(parallel: str, spec: Any, model_name: str = "") -> None:
    """``training.parallel`` fsdp / hsdp for a kind that is not built for it: the error, before any work."""
    if parallel != "ddp" and not spec.supports_fsdp:
        from lmforge.recipes import kinds

        supported = ", ".join(k.name for k in kinds() if k.supports_fsdp)
        raise LMForgeError(f"training.parallel={parallel} is built for the kinds: {supported}; the {spec.name!r} kind"
                           f"{model_name} is not one of them yet: use training.parallel=ddp")


def _mesh(parallel: str, device_type: str, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    if parallel == "fsdp":
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % per_node:
        raise LMForgeError(f"training.parallel=hsdp needs the same number of processes on every machine: "
                           f"{world_size} processes, {per_node} on this one")
    return init_device_mesh(device_type, (world_size // per_node, per_node), mesh_dim_names=("replicate", "shard"))


def layout(parallel: str, device: torch.device, world_size: int, param_dtype: torch.dtype | None,
           offload: bool) -> dict[str, Any]:
    """How a run shards its models (``fully_shard``'s mesh, mixed precision and offload), for ``shard`` and
    ``shard_frozen``. ``param_dtype``: the compute dtype (None: as stored); gradients are reduced in fp32."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    # The batch is not cast: float inputs (a reference model's log-probabilities) keep their precision,
    # and autocast sets the compute dtype inside as it does under DDP.
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    return {"mesh": _mesh(parallel, device.type, world_size), "mp_policy": policy,
            "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy()}


def shard(root: nn.Module, model: nn.Module, how: dict[str, Any], compile_mode: str | None) -> list[nn.Module]:
    """Apply ``fully_shard`` (``how``: ``layout``) to each of ``model.repeated_blocks()`` and to ``root``
    (which holds ``model``); returns the sharded modules, root last. ``compile_mode``: torch.compile each
    block in this mode (None: not compiled)."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    modules = []
    for block in model.repeated_blocks():
        if compile_mode is not None:
            block.compile(mode=compile_mode)  # one compiled graph per block: the gathers and frees stay outside it
        modules.append(fully_shard(block, **how))
        for name in getattr(block, "forward_methods", ()):  # e.g. the last block scoring kept positions only
            register_fsdp_forward_method(block, name)
    modules.append(fully_shard(root, **how))
    return modules


def shard_frozen(model: nn.Module, how: dict[str, Any]) -> list[nn.Module]:
    """Shard a frozen model (a reference, a reward model scoring rollouts) as the trained one is sharded,
    block by block and its root; returns its sharded modules, root last. Each process then holds
    1 / world_size of its weights at rest, and gathers them whole inside ``gathered``. Outside it only
    ``forward`` and ``hidden_states`` (which dpo's live reference calls in the loss) gather the weights,
    block by block as a training step does, and every process must call them alike; the loop then
    ``release``s the model after each step. Its other methods (a reward model's ``rewards``)
    run inside ``gathered`` only."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    modules = shard(model, model, how, compile_mode=None)
    if hasattr(model, "hidden_states"):
        register_fsdp_forward_method(model, "hidden_states")
    return modules


@contextlib.contextmanager
def gathered(modules: list[nn.Module], root: nn.Module | None = None) -> Iterator[None]:
    """Full weights (in the compute dtype) of ``modules`` (sharded modules of one model: ``shard``'s list, or
    part of it) on every process while inside; no collective runs inside, so each process may call the model
    as often as it likes. ``root``: the root of their model (default: ``modules[-1]``). Every process must
    enter it together."""
    root = modules[-1] if root is None else root
    # FSDP sets itself up (which module is the root, the shared communication state) in the root's
    # first forward; a rollout drawn before the first step gathers the weights before that forward.
    root._get_fsdp_state()._lazy_init()
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        # The blocks are compiled in place (training.compile): calls in here (a rollout's decoding at
        # every cache length, grpo's and ppo's held-out replies, a probe) run them eagerly, as they run
        # the plain model under DDP, and do not use up the recompiles the training step needs.
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        for m in modules:
            m.reshard()
        for m in modules:
            if m is not root:  # the blocks free their weights after forward; the root keeps its own until
                m.set_reshard_after_forward(True, recurse=False)  # the backward (FSDP's default for a root)
        _forget_forwards(modules)


def gathered_bytes(modules: list[nn.Module], dtype: torch.dtype | None) -> dict[int, int]:
    """Bytes each of ``shard``'s modules holds while gathered, by ``id``: the full size of the parameters it
    manages (its own, not its sharded sub-modules'), in ``dtype`` (None: as stored)."""
    owned = {id(m): {id(p): p for p in m.parameters()} for m in modules}
    out = {}
    for m in modules:
        mine = dict(owned[id(m)])
        for other in modules:
            if other is not m and any(x is other for x in m.modules()):
                for key in owned[id(other)]:
                    mine.pop(key, None)
        # a sharded parameter (a DTensor) reports its full shape
        out[id(m)] = sum(p.numel() * (dtype or p.dtype).itemsize for p in mine.values())
    return out


class Gatherer:
    """Gathers the full weights of the models a call outside the training step runs (``ModelHost.gathered``),
    and counts what that holds. ``add`` each sharded model (``shard``'s or ``shard_frozen``'s list, root
    last). ``peak``: the most bytes of full weights held at once so far (the loop logs it as
    ``train/gathered_mb``)."""

    def __init__(self, dtype: torch.dtype | None):
        self.dtype = dtype  # the compute dtype of the gathered weights (None: as stored)
        self.trees: list[list[nn.Module]] = []
        self.size: dict[int, int] = {}  # bytes each sharded module holds gathered, by id
        self.held: set[int] = set()  # the sharded modules gathered now, by id
        self.now = self.peak = 0

    def add(self, modules: list[nn.Module]) -> None:
        self.trees.append(modules)
        self.size.update(gathered_bytes(modules, self.dtype))

    @contextlib.contextmanager
    def __call__(self, *modules: nn.Module) -> Iterator[None]:
        """Full weights of ``modules`` (a model ``add``ed, or a part of one: ppo's policy inside its
        actor-critic) while inside. Of each model's sharded modules it gathers the blocks that hold or lie
        inside one of ``modules``, and the root (which holds the rest: embeddings, heads), skipping those
        an enclosing call gathered already. Every process must enter it alike."""
        trees = [(tree, {id(x) for x in tree[-1].modules()}) for tree in self.trees]
        stray = [type(m).__name__ for m in modules if not any(id(m) in members for _, members in trees)]
        if stray:
            raise ValueError(f"gathered() was given {stray}, which is neither a sharded model nor a part of one "
                             "(the trained model, or a frozen model kept through ModelHost.frozen)")
        with contextlib.ExitStack() as stack:
            for tree, members in trees:
                root = tree[-1]
                wanted = [m for m in modules if id(m) in members]
                inside = {id(x) for m in wanted for x in m.modules()}
                picked = [s for s in tree if wanted and id(s) not in self.held and
                          (s is root or id(s) in inside or any(id(m) in {id(x) for x in s.modules()} for m in wanted))]
                if not picked:
                    continue
                stack.enter_context(gathered(picked, root))
                ids = [id(s) for s in picked]
                size = sum(self.size[i] for i in ids)
                self.held.update(ids)
                self.now += size
                self.peak = max(self.peak, self.now)
                stack.callback(self._let_go, ids, size)
            yield

    @contextlib.contextmanager
    def holding(self, size: int) -> Iterator[None]:
        """Count ``size`` bytes of full weights held while inside (a model whole on the device for a while:
        ``Trainer.scoring``)."""
        self.now += size
        self.peak = max(self.peak, self.now)
        try:
            yield
        finally:
            self.now -= size

    def _let_go(self, ids: list[int], size: int) -> None:
        self.held.difference_update(ids)
        self.now -= size


def lockstep(batches: Any, device: torch.device) -> Iterator[tuple[Any, bool]]:
    """``(batch, counts)`` pairs from this process's held-out ``batches`` (CPU batches, as loaders give them), as
    many on every process, so that a sharded model's forward (whose collectives every process must run alike)
    can score them block by block. A process whose share has run out gets a spare batch to run while the others
    finish (``counts`` False: its figures are dropped): its last one, or, if its share was empty, the first of
    the lowest process with one. Ends when every process has run out.

    One small all-reduce per batch says whether any process has another. It is queued before the caller runs
    the batch it is handed, and read after; on a GPU its result comes back by a copy and an event recorded
    before that batch's forward, so the host waits for the forward before, not for this one, and the device
    keeps a batch queued (unless the forward itself reads a value back)."""
    import torch.distributed as dist

    it = iter(batches)
    if dist.get_world_size() == 1:  # nobody to keep in step with
        yield from ((b, True) for b in it)
        return
    batch = next(it, None)
    has = [torch.zeros(1, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(has, torch.tensor([float(batch is not None)], device=device))
    holders = [rank for rank, flag in enumerate(torch.cat(has).tolist()) if flag]
    if not holders:
        return
    spare = batch
    if len(holders) < len(has):  # some share is empty: they borrow a batch (pickled CPU tensors) to run
        box = [batch]
        dist.broadcast_object_list(box, src=holders[0], device=device if device.type == "cuda" else None)
        spare = batch if batch is not None else box[0]
    while True:
        following = next(it, None)
        more = torch.full((1,), float(following is not None), device=device)  # a fill: no copy from the host
        dist.all_reduce(more)  # queued before this batch's forward
        ready = None
        if device.type == "cuda":
            more = more.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        if batch is not None:
            spare = batch
        yield (batch if batch is not None else spare), batch is not None
        if ready is not None:
            ready.synchronize()  # the all-reduce and its copy, not the forward queued after them
        if not more.item():
            return
        batch = following


def whole_on(model: nn.Module, device: torch.device, dtype: torch.dtype | None) -> nn.Module:
    """Put a frozen model (on the CPU) whole on ``device`` with the weights ``gathered`` would give it: its
    parameters in ``dtype`` (None: as stored), its buffers as they are (rotary tables stay fp32, as under
    FSDP's mixed precision). The cast comes first, on the CPU, so the fp32 model is never whole on the
    device. Returns ``model``, changed in place."""
    if dtype is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.to(dtype)
    return model.to(device)


def release(modules: list[nn.Module]) -> None:
    """After forwards outside ``gathered`` that no backward follows (dpo's live reference in a training step,
    evaluation): free the root's gathered weights (a root keeps them after its forward, for its backward) and
    FSDP's record of the forwards (which only a backward would clear). Safe before any forward too."""
    modules[-1]._get_fsdp_state()._lazy_init()  # sets up the record (a no-op once the first forward did)
    modules[-1].reshard()
    _forget_forwards(modules)


def _forget_forwards(modules: list[nn.Module]) -> None:
    """Drop FSDP's record of the forwards run inside ``gathered``: the next backward prefetches the
    weights of the module that ran before in its record, and calls made there (a different number
    on each process, for a probe) must not steer the training step's gathers. (FSDP clears the
    record itself only at the end of a backward.)"""
    for m in modules:
        group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)
        if group is not None:
            group._post_forward_indices.clear()
            group.comm_ctx.post_forward_order.clear()


def _options(full: bool = True, offload: bool = True, **kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=offload, **kw)


def _shared_names(model: nn.Module) -> dict[str, str]:
    """Each name of a tied parameter -> the first name of that tensor (GPT-2's head is its embedding)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The fp32 weights on process 0 (empty elsewhere), keyed as ``model.state_dict()``, tied weights
    one tensor again; every process must call it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model, options=_options())
    if state:
        for name, first in _shared_names(model).items():
            if name != first and name in state:
                state[name] = state[first]
    return state


def _names_in_order(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's full state on process 0 (empty elsewhere) in ``optimizer.state_dict()``'s own
    form (parameters numbered in the order of its groups), as a single process would save it; every
    process must call it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer, options=_options())
    if not state:
        return {}  # not process 0
    index = {name: i for i, name in enumerate(_names_in_order(model, optimizer))}
    groups = []
    for g in state["param_groups"]:
        groups.append({**g, "params": [index[n] for n in g["params"]]})
    return {"state": {index[n]: v for n, v in state.get("state", {}).items()}, "param_groups": groups}


def load_model_state(model: nn.Module, directory: Path) -> None:
    """Load a checkpoint's full weights (every process reads the files) into the sharded model."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    path = Path(directory)
    state = model.checkpoint_state(path)
    try:
        missing, unexpected = set_model_state_dict(model, state, options=_options(strict=False))
    except (RuntimeError, ValueError) as e:  # a tensor of another shape
        raise LMForgeError(f"{path} does not fit this model ({e}): resume with the config it was written with (see "
                           "its run_config.yaml)") from e
    tied = {n for n, first in _shared_names(model).items() if n != first}
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise LMForgeError(f"the checkpoint's weights do not fit this model (missing {missing[:5]}, unexpected "
                           f"{list(unexpected)[:5]}): resume with the config it was written with")


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load an optimizer state in ``optimizer.state_dict()``'s form into the sharded optimizer: the full
    state (every process read it), or this process's shards of it (``load_sharded``)."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    names = _names_in_order(model, optimizer)
    if len(state.get("param_groups", [])) != len(optimizer.param_groups):
        raise LMForgeError(f"the checkpoint's optimizer has {len(state.get('param_groups', []))} parameter groups, "
                           f"this run's {len(optimizer.param_groups)}: resume with the config it was written with")
    by_name = {"state": {names[int(i)]: v for i, v in state["state"].items()},
               "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]]}
    full = not any(isinstance(v, DTensor) for entries in state["state"].values() for v in entries.values())
    set_optimizer_state_dict(model, optimizer, by_name, options=_options(full=full))


def _sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """This process's shards of the weights (``model.NAME``, tied copies once) and of the optimizer's
    tensors (``optim.NAME.ENTRY``), for DCP; and the manifest: every tensor's full shape, the parameter
    groups and the optimizer's non-tensor entries, by parameter name."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    options = _options(full=False, offload=False)  # DCP copies each shard to the CPU as it writes it
    shared = _shared_names(model)
    tensors = {f"model.{k}": v for k, v in get_model_state_dict(model, options=options).items()
               if shared.get(k, k) == k}
    optim = get_optimizer_state_dict(model, optimizer, options=options)  # sets the state up before the first step
    state: dict[str, dict[str, Any]] = {}
    for name, entries in optim["state"].items():
        state[name] = {}
        for entry, value in entries.items():
            if torch.is_tensor(value):
                tensors[f"optim.{name}.{entry}"] = value
                state[name][entry] = {"shard": f"optim.{name}.{entry}"}
            else:
                state[name][entry] = {"value": value}
    manifest = {"tensors": {k: list(v.shape) for k, v in tensors.items()},
                "optimizer": {"state": state, "param_groups": optim["param_groups"]}}
    return tensors, manifest


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, rest: dict[str, Any],
                 world_size: int, is_main: bool) -> None:
    """Write a sharded checkpoint's tensors into ``directory/shards`` (every process its own shards;
    every process must call this), then, on process 0, ``shards.json`` with ``rest`` (JSON data: the
    scaler's and the model's training state). A failure on any process raises on every process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    tensors, manifest = _sharded_state(model, optimizer)
    shards = Path(directory) / ckpt.SHARDS_DIR
    try:
        dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(shards), save_distributed=True))
    except dcp.api.CheckpointException as e:  # what any process's failure becomes on every process
        raise LMForgeError(f"could not write the shards of a checkpoint into {shards}: {e}; "
                           f"{ckpt.RESUME_FIX}") from e
    if not is_main:
        return
    manifest.update(world_size=world_size, files=sorted(p.name for p in shards.iterdir()), **rest)
    try:
        ckpt.write_shards_manifest(Path(directory), manifest)
    except TypeError as e:
        raise LMForgeError(f"this run's training state is not plain data ({e}), which a sharded checkpoint keeps "
                           "as JSON: use training.fsdp_checkpoint=gathered") from e
    try:
        ckpt.read_shards_manifest(Path(directory))
    except LMForgeError as e:
        raise LMForgeError(f"process 0 does not see the shards every process wrote ({e}): a sharded checkpoint "
                           "needs a directory all processes share (on several machines, a shared filesystem); "
                           "otherwise use training.fsdp_checkpoint=gathered") from e


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> dict[str, Any]:
    """Read a sharded checkpoint into this process's shards (written by any number of processes; every
    process must call this): the weights are loaded; the optimizer state is returned, in the form
    ``optimizer.safetensors`` holds (``load_optimizer_state`` takes it), with the rest of the training
    state. A checkpoint that does not fit the model stops every process with the same error before any
    collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    directory = Path(directory)
    error: LMForgeError | None = None
    try:
        saved = ckpt.read_shards_manifest(directory)
        tensors, mine = _sharded_state(model, optimizer)
        fix = f"resume with the config {directory} was written with (see its run_config.yaml)"
        for part, what in (("model.", "this model"), ("optim.", "this run's optimizer")):
            ours = {k: v for k, v in mine["tensors"].items() if k.startswith(part)}
            theirs = {k: v for k, v in saved["tensors"].items() if k.startswith(part)}
            missing, unexpected = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
            shapes = [f"{k} {theirs[k]} (here {ours[k]})" for k in sorted(set(ours) & set(theirs))
                      if ours[k] != theirs[k]]
            if missing or unexpected or shapes:
                raise LMForgeError(f"the checkpoint {directory} does not fit {what} (missing {missing[:3]}, "
                                   f"unexpected {unexpected[:3]}, other shapes {shapes[:3]}): {fix}")
    except LMForgeError as e:
        error = e
    # A process that cannot read the checkpoint (another machine without the shared directory) must not
    # leave the others waiting inside DCP's collectives: every process learns of it first.
    if _any_process(error is not None) and error is None:
        raise LMForgeError(f"another process could not read the checkpoint {directory} (its message says why); "
                           "stopping")
    if error is not None:
        raise error
    try:
        dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(directory / ckpt.SHARDS_DIR)))
    except dcp.api.CheckpointException as e:
        raise LMForgeError(f"cannot read the shards of {directory}: {e}; use an earlier checkpoint in "
                           f"{directory.parent}") from e
    # Each process checks its own shards; all stop together when any holds a NaN or an inf.
    found = ckpt.first_non_finite(tensors.items())
    if _any_process(found is not None):
        raise LMForgeError(ckpt.non_finite_message(directory, found, "weights or optimizer state") if found else
                           f"another process found non-finite values (NaN or inf) in the shards of {directory} "
                           "(its message names them); use an earlier checkpoint (runs/NAME/checkpoints/) or retrain")
    set_model_state_dict(model, {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")},
                         options=_options(full=False, strict=False))
    return ckpt.sharded_training_state(directory, saved, tensors)


def _any_process(flag: bool) -> bool:
    """``flag`` on any process of the job (itself on a single process); every process must call this."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() > 0


def local_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes of this process's share of the weights and the optimizer state (its shards under FSDP)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            t = local(p.data if not hasattr(p, "to_local") else p)
            total += t.numel() * t.element_size()
    for entries in (optimizer.state.values() if optimizer is not None else ()):
        for v in entries.values():
            if torch.is_tensor(v) and v.dim() > 0:
                t = local(v)
                total += t.numel() * t.element_size()
    return total
