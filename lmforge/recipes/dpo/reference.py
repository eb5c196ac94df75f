"""The frozen reference of a dpo run: loaded once the policy is on its device (``TrainData.bind_model``),
then either used up front to fill every pair's reference log-probs (``precompute``) or kept beside the
policy for the loss to run on each training batch (``live``; the held-out pairs' are filled up front)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from lmforge.errors import LMForgeError
from lmforge.posttrain.pairs import PackedPairs, PairStore
from lmforge.recipes import ModelHost
from lmforge.recipes.dpo.loss import bind, reference_logps
from lmforge.train.distributed import DistInfo


def score_share(reference: Any, store: PairStore, seq_len: int, micro_batch_size: int, devinfo: Any, rank: int,
                world_size: int, desc: str = "reference log-probs", progress: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One process's share of the reference log-probs: the ``[N, 2]`` table filled at the pairs of its
    rows (zeros elsewhere), and how many times each pair was scored (``[N]``: 1 or 0)."""
    device = devinfo.device
    # Unshuffled, process r takes rows r, r + world, ...: together the processes cover every pair once.
    loader = PackedPairs(store, seq_len, micro_batch_size, rank, world_size, shuffle=False)
    table = torch.zeros(len(store), 2, dtype=torch.float32, device=device)
    seen = torch.zeros(len(store), dtype=torch.float32, device=device)
    own_rows = len(range(rank, loader.rows_per_epoch, world_size))
    with tqdm(total=own_rows, desc=desc, unit=" rows", dynamic_ncols=True, disable=not progress) as bar:
        for batch in loader.iter_eval_batches():
            index = batch["pair_index"].to(device)
            batch = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}
            with devinfo.autocast():
                table[index] = reference_logps(reference, batch).float()
            seen[index] += 1
            bar.update(batch["input_ids"].shape[0])
    return table, seen


def precompute_reference_logps(reference: Any, store: PairStore, seq_len: int, micro_batch_size: int, devinfo: Any,
                               distinfo: DistInfo, desc: str, progress: bool) -> np.ndarray:
    """``[N, 2]`` float32 summed reply log-probs (chosen, rejected) of every pair of ``store`` under
    ``reference``. Under DDP each process scores its own share of the packed rows and the shares are
    summed across processes, so every process ends with the whole table."""
    table, seen = score_share(reference, store, seq_len, micro_batch_size, devinfo, distinfo.rank,
                              distinfo.world_size, desc, progress)
    if distinfo.enabled:
        import torch.distributed as dist

        dist.all_reduce(table)
        dist.all_reduce(seen)
    if not bool((seen == 1).all()):
        raise LMForgeError(f"{desc}: the processes did not score every pair exactly once; this is a bug in lmforge")
    return table.cpu().numpy()


def make_binder(settings: Any, reference_dir: Path, stores: list[tuple[str, PairStore]], seq_len: int,
                micro_batch_size: int, distinfo: DistInfo, progress: bool):
    """``TrainData.bind_model`` of a dpo run: loads the reference, fills the stores' ``ref_logps`` and binds
    the loss's settings to the policy.

    - precompute: the reference scores every pair, whole on the device (``ModelHost.scoring``), and is freed.
    - live: it is kept for the loss (``ModelHost.frozen``: sharded under FSDP) and runs on every training
      batch. It still fills the held-out pairs' table once (they never change, nor does it), so an
      evaluation runs the policy alone.
    """

    def bind_model(model: Any, devinfo: Any, host: ModelHost) -> None:
        from lmforge.models import load_model

        live = settings.reference == "live"
        # loaded on the CPU: the host puts it on the device (under FSDP never whole in fp32 there)
        reference = load_model(reference_dir, map_location="cpu")
        reference.eval().requires_grad_(False)

        def fill(scorer: Any, which: list[tuple[str, PairStore]]) -> None:
            # every process scores its own share (a different number of batches): the weights are whole here
            for name, store in which:
                store.ref_logps = precompute_reference_logps(
                    scorer, store, seq_len, micro_batch_size, devinfo, distinfo,
                    f"reference log-probs ({name})", progress)

        if live:
            reference = host.frozen(reference)  # called in every micro-batch's loss, alike on every process
            with host.gathered(reference):
                fill(reference, [(name, store) for name, store in stores if name != "train"])
        else:
            with host.scoring(reference) as whole:
                fill(whole, stores)
            reference = None  # every batch now carries its reference log-probs: the model is not needed
        bind(model, settings.beta, settings.label_smoothing, reference, settings.rpo_alpha)

    return bind_model


__all__ = ["make_binder", "precompute_reference_logps", "score_share"]
