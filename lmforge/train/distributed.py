"""Process-group setup under ``torchrun`` (gloo on CPU, nccl on GPUs) and small collectives."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type_hint: str = "auto") -> DistInfo:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1); no-op otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and device_type_hint in ("auto", "cuda") or device_type_hint.startswith("cuda")
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo",
                                timeout=datetime.timedelta(minutes=30))
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world)


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
