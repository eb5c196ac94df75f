"""Where a post-training run starts, and what it is compared against: the checks every
post-training kind (sft, reward, dpo, grpo, ppo) makes before any model runs.

- ``rows_path``: ``data.train_path``, the kind's rows (conversations, pairs, prompts), which must exist.
- ``init_model_config``: with ``training.init_from`` the model is that checkpoint's (its shape; only
  regularisation comes from the run's own ``model`` section).
- ``init_tokenizer_path``: the tokenizer the model was trained with (the checkpoint's, or
  ``data.tokenizer`` when it is the same one).
- ``chat_tokenizer`` / ``fit_model_to_tokenizer``: the tokenizer loaded and checked for a chat template;
  the model's embeddings and special ids made to agree with it.
- ``check_reference``: a frozen model the policy is compared with (DPO's reference, a KL anchor) must
  read and write the same tokens as the policy; refused before any compute otherwise.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from lmforge.errors import LMForgeError
from lmforge.recipes import family_of_config

# What fine-tuning may change of the model it starts from: regularisation, not shape.
TUNABLE_MODEL_KEYS = ("embd_pdrop", "resid_pdrop", "attn_pdrop")


def rows_path(cfg: Any, kind: str, what: str, how: str) -> Path:
    """``data.train_path``, where the ``kind``'s ``what`` (e.g. "preference pairs") are: set, existing,
    and not mixed up with ``data.path`` (the lm kind's token shards). ``how``: what to point it at."""
    if cfg.data.path:
        raise LMForgeError(f"the {kind} kind reads {what} from data.train_path; data.path (token shards) is for the lm "
                           "kind: remove it")
    if not cfg.data.train_path:
        raise LMForgeError(f"no {what}: set data.train_path to {how}")
    path = Path(cfg.data.train_path)
    if not path.exists():
        raise LMForgeError(f"data.train_path={path} does not exist: point it at the {what}")
    return path


def chat_tokenizer(tokenizer_file: Path) -> Any:
    """The tokenizer at ``tokenizer_file``, refused unless it carries a chat template."""
    from lmforge.posttrain.render import check_chat_tokenizer
    from lmforge.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(tokenizer_file)
    check_chat_tokenizer(tokenizer, str(tokenizer_file))
    return tokenizer


def fit_model_to_tokenizer(model: Any, tokenizer: Any, tokenizer_file: Path) -> None:
    """Give ``model`` (a gpt-family config) the tokenizer's vocabulary size when it has none, refuse a
    tokenizer with more tokens than the model has embeddings, and copy its special ids (eos stands in
    for a missing bos / pad)."""
    if model.vocab_size == 0:
        model.vocab_size = tokenizer.vocab_size
    elif model.vocab_size < tokenizer.vocab_size:
        raise LMForgeError(f"the model has {model.vocab_size} token embeddings but the tokenizer {tokenizer_file} has "
                           f"{tokenizer.vocab_size} tokens: train with the tokenizer the model was trained with "
                           "(leave data.tokenizer empty to take the init_from checkpoint's)")
    for key, value in (("eos_token_id", tokenizer.eos_id), ("bos_token_id", tokenizer.bos_id),
                       ("pad_token_id", tokenizer.pad_id)):
        setattr(model, key, tokenizer.eos_id if value is None else value)


def check_pair_rows(seq_len: int, n_positions: int) -> None:
    """A row of preference pairs holds both sides of a pair, each at most the model's context."""
    if seq_len > 2 * n_positions:
        raise LMForgeError(f"data.seq_len={seq_len} is more than twice the model's context model.n_positions="
                           f"{n_positions}: a row holds the two sides of a pair, each at most n_positions "
                           "tokens; lower data.seq_len")


def init_model_config(cfg: Any, kind: str, *, fine_tune: bool = False, example: str = "") -> Path | None:
    """Fill ``cfg.model`` from ``training.init_from`` (its family must be the run's); dropout stays the
    run's. Returns the checkpoint's model directory, or None without ``init_from``. ``fine_tune``: the
    messages say the ``kind`` fine-tunes the checkpoint (sft) rather than starts from it; ``example``:
    a checkpoint to name in them (e.g. ``runs/code_assistant_code``)."""
    if not cfg.training.init_from:
        return None
    from lmforge.checkpoint import resolve_model_dir
    from lmforge.models.base import read_model_config

    if not Path(cfg.training.init_from).exists():
        start = "to fine-tune" if fine_tune else f"the {kind} kind starts from"
        raise LMForgeError(f"training.init_from={cfg.training.init_from} does not exist: point it at the checkpoint "
                           f"or run directory {start}" + (f" (e.g. {example})" if example else ""))
    source = resolve_model_dir(cfg.training.init_from)
    klass, config = read_model_config(source)
    if type(config) is not type(cfg.model):
        trains = "fine-tunes" if fine_tune else "trains"
        raise LMForgeError(f"training.init_from={cfg.training.init_from} holds a {klass.family!r} model; the {kind} "
                           f"kind {trains} the {family_of_config(cfg.model)!r} family's models")
    for key in TUNABLE_MODEL_KEYS:
        if hasattr(config, key):
            setattr(config, key, getattr(cfg.model, key))
    cfg.model = dataclasses.replace(config)
    return source


def init_tokenizer_path(cfg: Any, init_dir: Path | None, kind: str, *, fine_tune: bool = False) -> Path:
    """The tokenizer.json the run trains with: ``data.tokenizer`` (refused when it is not the init
    checkpoint's), else the init checkpoint's own. ``fine_tune`` as for ``init_model_config``."""
    from lmforge.infer.loading import find_tokenizer
    from lmforge.tokenizer import require_same_tokenizer

    if cfg.data.tokenizer:
        path = Path(cfg.data.tokenizer)
        path = path / "tokenizer.json" if path.is_dir() else path
        if init_dir is not None:
            require_same_tokenizer(path, find_tokenizer(init_dir), cfg.training.init_from)
        return path
    if init_dir is not None:
        return find_tokenizer(init_dir)
    start = "to fine-tune" if fine_tune else "to start from"
    raise LMForgeError(f"the {kind} kind needs the tokenizer the model is served with: set training.init_from to the "
                       f"checkpoint {start} (its tokenizer is used), or data.tokenizer=PATH")


def check_reference(path: str | Path, setting: str, policy_config: Any, tokenizer_file: Path,
                    seq_len: int) -> Path:
    """The model directory of a frozen reference, after checking it can score the policy's rows: the
    same family, vocabulary and tokenizer, and a context of at least ``seq_len``. ``setting`` names
    the config key it came from, for the messages."""
    from lmforge.checkpoint import resolve_model_dir
    from lmforge.infer.loading import find_tokenizer
    from lmforge.models.base import read_model_config
    from lmforge.tokenizer import Tokenizer

    if not Path(path).exists():
        dpo = (f" ({path} is one of dpo's recipe.reference modes; here {setting} is a checkpoint's path)"
               if str(path) in ("live", "precompute") else "")
        raise LMForgeError(f"{setting}={path} does not exist: point it at the checkpoint (or run directory) to "
                           f"compare the policy with{dpo}")
    model_dir = resolve_model_dir(path)
    klass, config = read_model_config(model_dir)
    if type(config) is not type(policy_config):
        raise LMForgeError(f"{setting}={path} holds a {klass.family!r} model, the policy is a "
                           f"{type(policy_config).__name__}: the reference must be a model of the same family")
    if config.vocab_size != policy_config.vocab_size:
        raise LMForgeError(f"{setting}={path} has a vocabulary of {config.vocab_size} tokens, the policy "
                           f"{policy_config.vocab_size}: their log-probabilities are not comparable. Use a "
                           "reference trained with the policy's tokenizer (e.g. the training.init_from checkpoint)")
    theirs = find_tokenizer(model_dir)
    if Tokenizer.load(theirs).sha256 != Tokenizer.load(tokenizer_file).sha256:
        raise LMForgeError(f"{setting}={path} was trained with another tokenizer ({theirs}) than the policy "
                           f"({tokenizer_file}): the same ids would mean other tokens. Use a reference trained "
                           "with the policy's tokenizer (e.g. the training.init_from checkpoint)")
    if getattr(config, "n_positions", seq_len) < seq_len:
        raise LMForgeError(f"{setting}={path} has a context of {config.n_positions} tokens, shorter than "
                           f"data.seq_len={seq_len}; lower data.seq_len or use a reference with a longer context")
    return model_dir


__all__ = ["TUNABLE_MODEL_KEYS", "chat_tokenizer", "check_pair_rows", "check_reference", "fit_model_to_tokenizer",
           "init_model_config", "init_tokenizer_path", "rows_path"]
