"""Build the loop's data bundle from a run config (token shards for language models)."""

from __future__ import annotations

from pathlib import Path

from lmforge.config import RunConfig
from lmforge.errors import LMForgeError
from lmforge.eval.lm import lm_metrics
from lmforge.train.distributed import DistInfo
from lmforge.train.loop import DataBundle


def build_token_data(cfg: RunConfig, distinfo: DistInfo) -> DataBundle:
    from lmforge.data.loader import PackedLoader, TokenDataset, read_meta

    path = Path(cfg.data.path)
    if not cfg.data.path:
        raise LMForgeError("data.path is not set: point it at a directory made by `lmforge data prepare` "
                           "(e.g. data.path=data/go)")
    if not path.exists():
        raise LMForgeError(f"data.path={path} does not exist; run `lmforge data prepare SRC --tokenizer TOK "
                           f"--out {path}` first")
    train_ds = TokenDataset(path, "train")
    mb, seq = cfg.training.micro_batch_size, cfg.data.seq_len
    train = PackedLoader(train_ds, seq_len=seq, micro_batch_size=mb, rank=distinfo.rank,
                         world_size=distinfo.world_size, seed=cfg.seed, shuffle=True)
    val, val_ds = None, None
    if "val" in read_meta(path)["splits"]:  # a val split that is there but corrupt raises, never hides
        val_ds = TokenDataset(path, "val")
        if val_ds.num_tokens > seq:
            val = PackedLoader(val_ds, seq_len=seq, micro_batch_size=mb, rank=distinfo.rank,
                               world_size=distinfo.world_size, seed=cfg.seed, shuffle=False)
    if val is None and distinfo.is_main:
        print(f"note: {path} has no validation split longer than data.seq_len={seq}; evaluation is off")

    bytes_per_token = val_ds.bytes / val_ds.num_tokens if val is not None and val_ds.num_tokens else 0.0

    def derive(metrics: dict[str, float]) -> dict[str, float]:
        return {**metrics, **lm_metrics(metrics["loss"], bytes_per_token)}

    return DataBundle(train=train, val=val, tokens_per_micro_batch=mb * seq, seq_len=seq,
                      derive_eval_metrics=derive,
                      description=f"{path}: {train_ds.num_tokens:,} train tokens"
                                  + (f", {val_ds.num_tokens:,} val tokens" if val is not None else ""))
