"""Process-group setup under ``torchrun`` (gloo on CPU, nccl on GPUs) and small collectives."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lmforge.errors import LMForgeError


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    owns_group: bool = False  # init_distributed started the process group (shutdown ends it)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type_hint: str = "auto", alone: bool = False, cpu_collectives: bool = False) -> DistInfo:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1); no-op otherwise. ``alone``: also
    for a torchrun job of one process (FSDP shards over a group, even of one: training.fsdp_offload on one GPU).
    ``cpu_collectives``: on GPUs, CPU tensors get collectives too (gloo beside nccl), which
    training.fsdp_offload's gradient norm over CPU-held shards needs."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 and not (alone and "WORLD_SIZE" in os.environ):
        return DistInfo()
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise LMForgeError(f"WORLD_SIZE is set but not {', '.join(missing)}: launch the job with torchrun "
                           "(e.g. `torchrun --standalone --nproc_per_node 2 -m lmforge train ...`), which sets them")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and device_type_hint in ("auto", "cuda") or device_type_hint.startswith("cuda")
    owns = not dist.is_initialized()
    if owns:
        backend = ("cpu:gloo,cuda:nccl" if cpu_collectives else "nccl") if use_cuda else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world, owns_group=owns)


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    """End the process group ``init_distributed`` started (of one process, too); a caller's own is left."""
    if info.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def shared_gpus(placements: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (machine, GPU) pairs that more than one process's ``placements`` entry names."""
    return sorted({p for p in placements if placements.count(p) > 1})


def check_one_gpu_per_process(device: torch.device, info: DistInfo) -> None:
    """Two processes of a job on one GPU (more processes on a machine than it has GPUs) fail inside
    NCCL's first collective with little to go on; refused here, on every process, naming the fix.
    GPUs are told apart by their UUID, so a launcher that shows each process only its own GPU (where
    every process sees one device, cuda:0) is fine. The placements travel over gloo: NCCL's own
    collective is what would fail."""
    if not info.enabled or device.type != "cuda":
        return
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if uuid is None:  # a build that does not report it: nothing to compare
        return
    import socket

    placements: list = [None] * info.world_size
    dist.all_gather_object(placements, (socket.gethostname(), str(uuid)), group=dist.new_group(backend="gloo"))
    shared = shared_gpus([tuple(p) for p in placements])
    if shared:
        machines = ", ".join(sorted({host for host, _ in shared}))
        raise LMForgeError(f"several processes of this job share a GPU on {machines}: start at most one process per "
                           "GPU (torchrun --nproc_per_node = the machine's GPUs, or a pipeline stage's processes), "
                           "or train on the CPU with training.device=cpu")
