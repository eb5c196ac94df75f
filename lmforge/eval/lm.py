"""Loss, perplexity and bits per byte of a checkpoint on token shards or on raw files."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from lmforge.errors import LMForgeError


def iter_windows(tokens: np.ndarray, seq_len: int, batch_size: int) -> Iterator[torch.Tensor]:
    """Non-overlapping windows of ``seq_len + 1`` tokens (stride ``seq_len``) covering every token once
    as a prediction target; the shorter tail comes last as its own batch."""
    n = len(tokens)
    full = (n - 1) // seq_len
    if full > 0:
        view = np.lib.stride_tricks.sliding_window_view(tokens[: full * seq_len + 1], seq_len + 1)[::seq_len]
        for i in range(0, full, batch_size):
            yield torch.from_numpy(np.array(view[i:i + batch_size], dtype=np.int64))  # a writable copy
    tail = tokens[full * seq_len:]
    if len(tail) > 1:
        yield torch.from_numpy(np.asarray(tail, dtype=np.int64))[None, :]


@torch.no_grad()
def nll_of_tokens(model, tokens: np.ndarray, seq_len: int, batch_size: int, device: torch.device,
                  max_tokens: int | None = None, progress: bool = True) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) and the number of predicted tokens."""
    if max_tokens is not None:
        tokens = tokens[: max_tokens + 1]
    if len(tokens) < 2:
        raise LMForgeError("the evaluation data has fewer than 2 tokens; give it more text")
    model.eval()
    total_nll, total = 0.0, 0
    full = (len(tokens) - 1) // seq_len  # the batches iter_windows yields: full windows, then the tail
    n_batches = math.ceil(full / batch_size) + (1 if len(tokens) - full * seq_len > 1 else 0)
    for window in tqdm(iter_windows(tokens, seq_len, batch_size), total=n_batches, desc="eval",
                       unit="batch", disable=not progress):
        window = window.to(device)
        batch = {"input_ids": window[:, :-1], "labels": window[:, 1:]}
        loss, _ = model(batch)
        count = batch["labels"].numel()
        total_nll += float(loss) * count
        total += count
    return total_nll, total


FIGURES = ("loss", "ppl", "bpb", "tokens")  # what ``evaluate`` reports (bpb where the data's bytes are known)


def lm_metrics(loss: float, bytes_per_token: float) -> dict[str, float]:
    """Perplexity and bits per byte from a mean loss in nats per token (bpb needs the data's
    UTF-8 bytes per token; 0 leaves it out)."""
    out = {"loss": loss, "ppl": math.exp(min(loss, 50.0))}
    if bytes_per_token > 0:
        out["bpb"] = loss / math.log(2) / bytes_per_token
    return out


def scored_bytes_per_token(tokenizer, tokens: np.ndarray) -> float:
    """UTF-8 bytes per predicted token when ``tokens`` are scored as one stream (every token but the first is
    a target): the bytes of exactly those targets, so that bits per byte holds for a prefix of a data set as
    for the whole of it (a prefix's bytes per token differ from the set's: 5% in a file of Go)."""
    targets = np.asarray(tokens)[1:]
    return tokenizer.text_bytes(targets) / len(targets) if len(targets) else 0.0


def metrics_from_nll(nll: float, tokens: int, bytes_per_token: float) -> dict[str, float]:
    return {**lm_metrics(nll / tokens, bytes_per_token), "tokens": float(tokens)}


def load_eval_tokens(data: str | Path, tokenizer, split: str = "val", include: tuple[str, ...] = (),
                     text_field: str = "text", max_tokens: int | None = None) -> tuple[np.ndarray, str]:
    """Tokens to evaluate on (the first ``max_tokens + 1`` where given) and a description.

    ``data`` is a directory made by `lmforge data prepare` (its ``split`` is read from the shards),
    or raw sources (a tree of code files, JSONL, text, parquet ...) tokenized here with the model's
    tokenizer, each document followed by the end-of-document token as in training.
    """
    from lmforge.data.loader import TokenDataset
    from lmforge.data.sources import DEFAULT_INCLUDE, iter_documents

    path = Path(data)
    if not path.exists():
        raise LMForgeError(f"--data {path} does not exist")
    if (path / "meta.json").is_file():
        ds = TokenDataset(path, split)
        if ds.tokenizer_sha256 and ds.tokenizer_sha256 != tokenizer.sha256:
            raise LMForgeError(f"{path} was tokenized with a different tokenizer than the checkpoint's; "
                               "evaluate on raw files instead, or re-prepare the data with this tokenizer")
        tokens = ds.read(0, ds.num_tokens if max_tokens is None else min(ds.num_tokens, max_tokens + 1))
        return tokens, f"{path} [{split}]"
    docs = list(iter_documents([path], include=include or DEFAULT_INCLUDE, text_field=text_field))
    if not docs:
        raise LMForgeError(f"no documents found in {path} (include={list(include) or 'default'})")
    ids = tokenizer.encode_batch([d.text for d in docs])
    eos = tokenizer.eos_id
    tokens = np.concatenate([np.asarray([*seq, eos], dtype=np.int64) for seq in ids])
    return tokens[: None if max_tokens is None else max_tokens + 1], f"{path} ({len(docs)} documents)"


def evaluate(checkpoint: str | Path, data: str | Path, split: str = "val", seq_len: int = 0,
             batch_size: int = 8, max_tokens: int | None = None, device: str = "auto",
             include: tuple[str, ...] = (), text_field: str = "text", progress: bool = True) -> dict[str, float]:
    """`lmforge eval`: loss, perplexity and bits per byte of a checkpoint on ``data``."""
    from lmforge.infer.loading import load_for_inference

    if batch_size < 1 or seq_len < 0 or (max_tokens is not None and max_tokens < 1):
        raise LMForgeError("--batch-size must be >= 1, --limit >= 0 (0 = every token) and --seq-len >= 0 (0 = the "
                           "model's context)")
    model, tokenizer, device_ = load_for_inference(checkpoint, device)
    seq_len = seq_len or model.config.n_positions
    if seq_len > model.config.n_positions:
        raise LMForgeError(f"--seq-len {seq_len} exceeds the model's context of {model.config.n_positions}")
    tokens, description = load_eval_tokens(data, tokenizer, split, include, text_field, max_tokens)
    if tokens.max(initial=0) >= model.config.vocab_size:
        raise LMForgeError(f"{description} has token id {int(tokens.max())} but the model's vocabulary has "
                           f"{model.config.vocab_size} entries: the data was made with another tokenizer")
    nll, count = nll_of_tokens(model, tokens, seq_len, batch_size, device_, max_tokens, progress)
    out = metrics_from_nll(nll, count, scored_bytes_per_token(tokenizer, tokens))
    out["data"] = description  # type: ignore[assignment]
    return out


def unigram_bpb(train_tokens: np.ndarray, eval_tokens: np.ndarray, vocab_size: int, bytes_per_token: float) -> float:
    """Bits per byte of an add-one-smoothed unigram model fitted on the training tokens: the floor any
    trained language model must clearly beat."""
    counts = np.bincount(np.asarray(train_tokens, dtype=np.int64), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    targets = np.asarray(eval_tokens[1:], dtype=np.int64)
    nll = -logp[targets].mean()
    return float(nll / math.log(2) * (1.0 / bytes_per_token))
