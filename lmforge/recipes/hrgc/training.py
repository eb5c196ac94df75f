"""The hrgc kind's training glue: its settings (the seed's loss weights, per-module learning rates,
refinement curriculum and probe), its data for the loop, its optimizer and what a batch counts for."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmforge.config import RunConfig
from lmforge.errors import LMForgeError
from lmforge.go_syntax import go_parser
from lmforge.recipes import Counts, Probe, TrainData, flops_per_token
from lmforge.recipes.hrgc.functions import read_go_functions
from lmforge.recipes.hrgc.model import DEFAULT_LOSS_WEIGHTS
from lmforge.recipes.hrgc.probe import WritingProbe
from lmforge.recipes.hrgc.sequences import EncodedFunctions, HRGCEvalLoader, HRGCTrainLoader, SequenceFormat
from lmforge.tokenizer import DEFAULT_TRAINED_VOCAB, Tokenizer, train_tokenizer
from lmforge.train.distributed import DistInfo, barrier
from lmforge.train.optim import make_adamw


@dataclass
class HRGCSettings:
    """Training settings of the hrgc kind (config section ``recipe``; the seed's names, which lmforge
    0.1 read under ``model.*``, still work there)."""

    plan_loss_weight: float = DEFAULT_LOSS_WEIGHTS["plan"]
    code_loss_weight: float = DEFAULT_LOSS_WEIGHTS["code"]
    refinement_loss_weight: float = DEFAULT_LOSS_WEIGHTS["refinement"]  # x (head CE + LM loss of corrected attempts)
    planner_lr: float = 0.0  # 0 = training.lr
    generator_lr: float = 0.0  # the generator and the bridge; 0 = training.lr
    refinement_lr: float = 0.0  # the continue/refine/done head; 0 = training.lr
    refinement_warmup: int = 5000  # optimizer steps before refinement examples join the batches
    validation_frequency: int = 100  # steps between sampling-and-parsing probes; 0 = off
    validation_samples: int = 4  # functions written per probe, per process
    own_failure_share: float = 0.25  # of refinement rows, at most this share from the model's own failures

    def __post_init__(self) -> None:
        for key in ("plan_loss_weight", "code_loss_weight", "refinement_loss_weight", "planner_lr", "generator_lr",
                    "refinement_lr", "own_failure_share", "refinement_warmup", "validation_frequency"):
            if getattr(self, key) < 0:
                raise LMForgeError(f"recipe.{key} must be >= 0, got {getattr(self, key)}")
        if self.own_failure_share > 1:
            raise LMForgeError(f"recipe.own_failure_share must be in [0, 1], got {self.own_failure_share}")
        if self.validation_samples < 1:
            raise LMForgeError("recipe.validation_samples must be >= 1")


def prepare_model(model, cfg: RunConfig) -> None:
    s = cfg.recipe
    model.loss_weights = {"plan": s.plan_loss_weight, "code": s.code_loss_weight,
                          "refinement": s.refinement_loss_weight}


def make_optimizer(model, cfg: RunConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW with one learning rate per module (the seed's planner_lr / generator_lr / refinement_lr;
    0 = training.lr), each split into decayed matrices and undecayed vectors."""
    t, s = cfg.training, cfg.recipe
    modules = {"planner": ([model.planner], s.planner_lr), "generator": ([model.generator, model.bridge], s.generator_lr),
               "refinement": ([model.head], s.refinement_lr)}
    groups = []
    for name, (parts, module_lr) in modules.items():
        decay, no_decay = [], []
        for part in parts:
            if part is None:
                continue
            for pname, p in part.named_parameters():
                if p.requires_grad:
                    (decay if model.decays(pname, p) else no_decay).append(p)
        for suffix, params, wd in (("decay", decay, t.weight_decay), ("no_decay", no_decay, 0.0)):
            if params:
                groups.append({"params": params, "weight_decay": wd, "lr": module_lr or t.lr,
                               "name": f"{name}/{suffix}"})
    return make_adamw(groups, cfg, device)


def count(model, batch: dict[str, Any]) -> Counts:
    """The tokens each decoder really read (right padding left out), and the functions (rows)."""
    pad = model.config.pad_token_id
    tokens, flops = 0, 0.0
    for key, decoder in (("plan_ids", model.planner), ("code_ids", model.generator), ("refine_ids", model.generator)):
        ids = batch.get(key)
        if ids is None or decoder is None:
            continue
        real = int((ids != pad).sum())
        tokens += real
        flops += real * flops_per_token(decoder, ids.shape[1])
    return Counts(tokens=tokens, examples=int(batch["code_ids"].shape[0]), flops=flops)


def eval_weight(batch: dict[str, Any]) -> float:
    """Evaluation means are per function."""
    return float(batch["code_ids"].shape[0])


def build_go_function_data(cfg: RunConfig, distinfo: DistInfo) -> TrainData:
    """HRGC's data: ``lmforge data go-functions`` records (train + val splits) tokenized with
    data.tokenizer, or with a byte-level BPE trained on the train split into RUN_DIR/data (reused on
    resume). Fills model.vocab_size (when 0) and the special-token ids from the tokenizer."""
    path, m, t, s = Path(cfg.data.path), cfg.model, cfg.training, cfg.recipe
    if not cfg.data.path:
        raise LMForgeError("data.path is not set: point it at a directory made by `lmforge data go-functions "
                           "SRC_DIR --out DIR` (e.g. data.path=data/go-functions)")
    if not (path / "train.jsonl").is_file():
        raise LMForgeError(f"{path} has no train.jsonl: build it with `lmforge data go-functions SRC_DIR --out {path}`")
    train_functions = list(read_go_functions(path / "train.jsonl"))
    if cfg.data.tokenizer:
        tokenizer_path = Path(cfg.data.tokenizer)
        tokenizer_path = tokenizer_path / "tokenizer.json" if tokenizer_path.is_dir() else tokenizer_path
        if not tokenizer_path.is_file():
            raise LMForgeError(f"data.tokenizer={cfg.data.tokenizer}: no tokenizer.json there")
    else:
        tokenizer_path = cfg.run_dir / "data" / "tokenizer.json"
        if distinfo.is_main and not tokenizer_path.is_file():
            vocab = m.vocab_size or DEFAULT_TRAINED_VOCAB
            print(f"data: no data.tokenizer given: training a {vocab}-token byte-level BPE on {path}/train.jsonl")
            texts = (f"{f.spec}\n{f.plan}\n{f.code}" for f in train_functions)
            train_tokenizer(texts, vocab, tokenizer_path.parent, show_progress=cfg.logging.progress_bar, overwrite=True)
        barrier(distinfo)
    tok = Tokenizer.load(tokenizer_path)
    if m.vocab_size == 0:
        m.vocab_size = tok.vocab_size
    elif m.vocab_size < tok.vocab_size:
        raise LMForgeError(f"model.vocab_size={m.vocab_size} but the tokenizer {tokenizer_path} has {tok.vocab_size} "
                           f"tokens: set model.vocab_size={tok.vocab_size} (or 0 to take it from the tokenizer)")
    m.eos_token_id, m.pad_token_id = tok.eos_id, tok.pad_id
    m.bos_token_id = tok.eos_id if tok.bos_id is None else tok.bos_id

    fmt = SequenceFormat(tok, m.hierarchical)
    parser = go_parser()
    planner_n, generator_n = m.planner_config.n_positions, m.generator_config.n_positions
    train_data = EncodedFunctions(train_functions, fmt, planner_n, generator_n)
    mb = t.micro_batch_size
    train = HRGCTrainLoader(train_data, parser, mb, cfg.seed, distinfo.rank, distinfo.world_size,
                            s.refinement_warmup, s.own_failure_share)
    val, val_data = None, None
    if (path / "val.jsonl").is_file():
        val_data = EncodedFunctions(list(read_go_functions(path / "val.jsonl")), fmt, planner_n, generator_n)
        if len(val_data) >= 1:
            val = HRGCEvalLoader(val_data, parser, mb, cfg.seed, distinfo.rank, distinfo.world_size)
    if val is None and distinfo.is_main:
        print(f"note: {path} has no val.jsonl with functions that fit; evaluation is off")
    probe = None
    if s.validation_frequency > 0:
        writing = WritingProbe(train, tok, parser, s.validation_samples, cfg.seed, distinfo.rank)
        probe = Probe(interval=s.validation_frequency, run=writing)
    skipped = train_data.too_long + (val_data.too_long if val_data is not None else 0)
    description = (f"{path}: {len(train_data):,} train functions"
                   + (f", {len(val_data):,} val" if val_data is not None else "")
                   + (f" ({skipped:,} longer than the contexts left out)" if skipped else ""))
    return TrainData(train=train, val=val, description=description, examples_per_epoch=len(train_data),
                     tokenizer_path=tokenizer_path, probe=probe, on_step=train.set_step)
