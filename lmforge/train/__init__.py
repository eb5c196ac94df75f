"""``train(config)``: everything `lmforge train` does, as one function call."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import yaml

from lmforge import checkpoint as ckpt
from lmforge.config import RunConfig
from lmforge.device import setup_device
from lmforge.errors import LMForgeError
from lmforge.files import FileLock
from lmforge.models import build_empty_model, build_model
from lmforge.recipes import TrainData
from lmforge.tokenizer import CONFIG_FILE, SPECIAL_MAP_FILE, TOKENIZER_FILE
from lmforge.train import fsdp
from lmforge.train.distributed import DistInfo, barrier, check_one_gpu_per_process, init_distributed, shutdown
from lmforge.train.fsdp import check_parallel
from lmforge.train.loop import Trainer, TrainResult

TOKENIZER_FILES = (TOKENIZER_FILE, CONFIG_FILE, SPECIAL_MAP_FILE)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def train(cfg: RunConfig, resume: bool | str = False, clock: Callable[[], float] = time.perf_counter) -> TrainResult:
    """Train ``cfg``. ``resume=True`` continues from the run's latest checkpoint (or starts fresh when the
    run holds nothing yet; a best/ model or an incomplete checkpoint and nothing complete is refused); a
    path resumes from that checkpoint. ``clock`` is what the loop times itself with
    (tests pass a fake one). Returns a ``TrainResult``."""
    sharded = cfg.training.parallel != "ddp"
    distinfo = init_distributed(cfg.training.device, alone=sharded,
                                cpu_collectives=sharded and cfg.training.fsdp_offload)
    try:
        result = _train(cfg, resume, distinfo, clock)
    except BaseException:
        shutdown(distinfo)  # no barrier: another rank may be gone
        raise
    # Every rank reaches this point before any tears its connections down: a rank whose peer had already
    # exited could see the closed socket in gloo's threads and abort (SIGABRT) after a finished run.
    barrier(distinfo)
    shutdown(distinfo)
    return result


def _train(cfg: RunConfig, resume: bool | str, distinfo: DistInfo, clock: Callable[[], float]) -> TrainResult:
    devinfo = setup_device(cfg.training.device, cfg.training.precision, cfg.training.peak_flops,
                           distinfo.local_rank)
    check_one_gpu_per_process(devinfo.device, distinfo)
    # the directories this run makes (the run's, and out_dir's where it is new): a start refused before
    # writing anything leaves none of them behind
    made = [d for d in (cfg.run_dir, *cfg.run_dir.parents) if not d.exists()]
    lock = _lock_run_dir(cfg.run_dir, devinfo.device, distinfo)
    try:
        return _train_locked(cfg, resume, devinfo, distinfo, clock)
    except BaseException:
        if lock is not None and made and [p.name for p in cfg.run_dir.iterdir()] == [ckpt.RUN_LOCK_FILE]:
            try:
                lock.release()
                lock.path.unlink()
                for d in made:  # innermost first; each empty once its child is gone
                    d.rmdir()
            except OSError:
                pass
        raise
    finally:
        if lock is not None:
            lock.release()


def _lock_run_dir(run_dir: Path, device: torch.device, distinfo: DistInfo) -> FileLock | None:
    """One job per run directory: the job's rank 0 takes ``RunDirLock`` (its other processes are the same
    job, so they take none), and every process learns whether it got it, so that all stop together when
    another job holds it (none waits at a barrier for a rank 0 that left)."""
    lock, error = None, None
    if distinfo.is_main:
        try:
            in_the_way = ckpt.file_in_the_way(run_dir)
            if in_the_way is not None:
                raise LMForgeError(
                    f"the run directory {run_dir} cannot be made: {in_the_way} is a file, not a directory. "
                    "Choose another run name (name=NEW) or out_dir, or move the file away.")
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise LMForgeError(f"cannot create the run directory {run_dir} ({e.strerror}): choose another "
                                   "out_dir, or make it writable") from e
            lock = ckpt.RunDirLock(run_dir).acquire()
        except LMForgeError as e:
            error = e
    if distinfo.enabled:
        import torch.distributed as dist

        failed = torch.tensor([float(error is not None)], device=device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if error is None and failed.item() > 0:
            raise LMForgeError(f"rank 0 could not lock the run directory {run_dir} (its message says why); stopping")
    if error is not None:
        raise error
    return lock


def _train_locked(cfg: RunConfig, resume: bool | str, devinfo, distinfo: DistInfo,
                  clock: Callable[[], float]) -> TrainResult:
    run_dir = cfg.run_dir
    if not resume and cfg.resume_from_checkpoint:
        resume = cfg.resume_from_checkpoint  # the RLM-mHC guide's +resume_from_checkpoint=PATH
    resume_from = _resume_point(run_dir, resume, distinfo.is_main)
    # A run started from other weights (training.init_from) and interrupted resumes from its own
    # checkpoint: the weights come from there; init_from still names the model it was fine-tuned from.
    load_init = bool(cfg.training.init_from) and resume_from is None
    if os.environ.get("DISABLE_COMPILE", "").strip().lower() in ("1", "true", "yes") and cfg.training.compile:
        cfg.training.compile = False  # HRM's switch (seed 003), honoured for every kind as its users expect
        cfg.training.compile_mode = "default"  # the saved run config must load again
        if distinfo.is_main:
            print("note: DISABLE_COMPILE is set: training.compile=false")
    spec = cfg.spec
    _resolve_batch(cfg, distinfo)
    data = spec.build_data(cfg, distinfo)  # may fill data-dependent model sizes (vocabulary, grid size)
    tokenizer_path = data.tokenizer_path
    _resolve_epochs(cfg, data, distinfo)

    seed_everything(cfg.seed)  # same initial weights on every rank
    if resume_from is None:
        model = build_model(cfg.model)
    else:  # every weight comes from the checkpoint (its load checks that): none is initialised first
        model = build_empty_model(cfg.model, "cpu" if fsdp.active(cfg.training.parallel) else devinfo.device)
    check_parallel(cfg.training.parallel, distinfo.world_size, model, spec)
    if cfg.training.parallel != "ddp" and cfg.training.fsdp_checkpoint == "sharded" and not model.one_weights_file:
        # one set of shards cannot stand in for several model directories (ppo's policy and value/)
        cfg.training.fsdp_checkpoint = "gathered"
        if distinfo.is_main:
            print(f"note: a {spec.name} checkpoint holds more than one model directory: step checkpoints are "
                  "written gathered (training.fsdp_checkpoint=gathered)")
    if load_init:
        _load_initial_weights(model, cfg.training.init_from, distinfo)
    if cfg.training.activation_checkpointing:
        model.set_activation_checkpointing(True)
    if not fsdp.active(cfg.training.parallel):
        model.to(devinfo.device)  # under FSDP, sharding moves each block's shard there: never the whole model
    seed_everything(cfg.seed + distinfo.rank)  # dropout differs per rank

    if resume_from is not None:
        _check_same_tokenizer(tokenizer_path, Path(resume_from))
    if distinfo.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt.clean_partial(run_dir / "checkpoints")
        if resume_from is None:
            _write_run_files(cfg, tokenizer_path)
    barrier(distinfo)

    extra = (lambda d: _copy_tokenizer(tokenizer_path, d)) if tokenizer_path is not None else None
    trainer = Trainer(cfg, model, data, devinfo, distinfo, run_dir, extra_files=extra, clock=clock)
    if resume_from is not None:
        trainer.load_checkpoint(resume_from)
        if distinfo.is_main:  # only a resume that was accepted rewrites the run's config
            changed = _changed_settings(run_dir / "config.yaml", cfg)
            if changed:
                print(f"note: resuming with settings that differ from {run_dir / 'config.yaml'} (now saved there): "
                      + ", ".join(changed))
            _write_run_files(cfg, tokenizer_path)
    if distinfo.is_main:
        n = model.num_parameters()
        where = (f"resuming from {resume_from} (step {trainer.step})" if resume_from
                 else f"from the weights of {cfg.training.init_from}" if load_init else "from scratch")
        print(f"lmforge train: {cfg.name} | kind {spec.name} | {type(model).__name__} {n / 1e6:.2f}M params | "
              f"{devinfo.device} {devinfo.precision} x{distinfo.world_size} | {data.description}")
        print(f"run dir {run_dir} | {where} | MFU against {devinfo.peak_flops / 1e12:.2f} TFLOP/s "
              f"({devinfo.peak_source})")
    return trainer.fit()


def _resolve_batch(cfg: RunConfig, distinfo: DistInfo) -> None:
    """``training.global_batch_size`` (rows per optimizer step, all processes) -> micro_batch_size."""
    t = cfg.training
    if t.global_batch_size <= 0:
        return
    per_step = distinfo.world_size * t.grad_accum_steps
    if t.global_batch_size % per_step:
        raise LMForgeError(f"training.global_batch_size={t.global_batch_size} is not divisible by "
                           f"{distinfo.world_size} process(es) x grad_accum_steps={t.grad_accum_steps}; "
                           "choose a multiple")
    t.micro_batch_size = t.global_batch_size // per_step


def _resolve_epochs(cfg: RunConfig, data: TrainData, distinfo: DistInfo) -> None:
    """HRM counts training length and evaluation interval in epochs: turn them into steps."""
    t = cfg.training
    if t.epochs <= 0 and t.eval_interval_epochs <= 0:
        return
    if data.examples_per_epoch <= 0:
        raise LMForgeError("training.epochs / eval_interval_epochs need data that knows its epoch size; "
                           "use training.max_steps and training.eval_interval instead")
    global_batch = t.micro_batch_size * t.grad_accum_steps * distinfo.world_size
    steps_per_epoch = data.examples_per_epoch / global_batch
    if t.epochs > 0:
        t.max_steps = max(1, math.ceil(t.epochs * steps_per_epoch))
    if t.eval_interval_epochs > 0:
        t.eval_interval = max(1, round(t.eval_interval_epochs * steps_per_epoch))
    if distinfo.is_main:
        print(f"epochs: {data.examples_per_epoch:,} examples per epoch / global batch {global_batch} = "
              f"{steps_per_epoch:.2f} steps; max_steps={t.max_steps}, eval_interval={t.eval_interval}")


def _resume_point(run_dir: Path, resume: bool | str, is_main: bool = True) -> Path | None:
    ckpt_root = run_dir / "checkpoints"
    existing = ckpt.latest_checkpoint(ckpt_root)
    if isinstance(resume, str) and resume not in ("", "latest"):
        path = Path(resume)
        if not (path / ckpt.STATE_FILE).is_file():
            raise LMForgeError(f"--resume {path}: not a training checkpoint (no {ckpt.STATE_FILE}); "
                               f"pass a runs/NAME/checkpoints/step-NNNNNN directory or plain --resume")
        step = int(ckpt.read_trainer_state(path)["step"])
        newer = [p for s, p in ckpt.list_checkpoints(ckpt_root) if s > step]
        damage = {p: ckpt.checkpoint_damage(p) for p in newer}
        if newer and all(damage.values()):
            # Every newer checkpoint is damaged (nothing could resume from it): set them aside, never delete.
            for p in newer:
                aside, n = p.with_name(ckpt.DAMAGED_PREFIX + p.name), 1
                while aside.exists():  # the same step damaged again: keep both
                    n += 1
                    aside = p.with_name(f"{ckpt.DAMAGED_PREFIX}{p.name}.{n}")
                if is_main:
                    try:
                        os.rename(p, aside)
                    except OSError as e:
                        raise LMForgeError(f"cannot set the damaged {p} aside as {aside} ({e.strerror}): move it "
                                           f"away yourself, then resume from {path.name} again") from e
                    print(f"note: {p.name} is damaged ({damage[p]}); set aside as {aside} (delete it when done) "
                          f"and resuming from {path.name}")
            newer = []
        if newer:
            good = [p for p in newer if not damage[p]]
            move = "; ".join(f"mv {p} {p.with_name(ckpt.DAMAGED_PREFIX + p.name)}" for p in good)
            raise LMForgeError(f"{ckpt_root} has checkpoints newer than {path.name} whose files read "
                               f"({', '.join(p.name for p in good)}); resuming would mix two histories in one run. "
                               "Resume from the latest (plain --resume), or into a new run (name=NEW --resume "
                               f"PATH); if they are damaged all the same, set them aside first (`{move}`).")
        return path
    # What a run from scratch would replace: a model in best/ (kept even where the step checkpoints were
    # deleted to save space) and step directories, complete or not.
    # (.old-NAME: a checkpoint an interrupted write set aside, which the run would put back afterwards)
    dirs = sorted(p for p in ckpt_root.iterdir() if p.is_dir()) if ckpt_root.is_dir() else []
    held = ([f"a trained model in {ckpt_root / 'best'}"] if (ckpt_root / "best").is_dir() else []) + \
        [f"{p.name} (incomplete: no {ckpt.STATE_FILE})" for p in dirs
         if ckpt.STEP_DIR.match(p.name) and not (p / ckpt.STATE_FILE).is_file()] + \
        [f"{p.name} (set aside by an interrupted write: rename it back to {p.name[len('.old-'):]})" for p in dirs
         if p.name.startswith(".old-")]
    if resume:
        if existing is None:
            if held:
                raise LMForgeError(
                    f"--resume: {ckpt_root} has no complete checkpoint to resume from, and it holds "
                    f"{', '.join(held)}, which starting over would replace. Resume from a complete checkpoint "
                    f"(--resume PATH), choose another run name (name=NEW), or move {run_dir} away to start "
                    "over — nothing was overwritten.")
            print(f"note: --resume given but {ckpt_root} has no checkpoint yet; starting from scratch")
        return existing
    if existing is not None:
        raise LMForgeError(
            f"{run_dir} already has checkpoints (latest {existing.name}). Pass --resume to continue it, "
            f"or choose another run name (name=NEW) — nothing was overwritten."
        )
    if held:
        raise LMForgeError(
            f"{run_dir} already holds {', '.join(held)}; a new run there would replace it. Choose another run "
            f"name (name=NEW), or move {run_dir} away to start over — nothing was overwritten.")
    return None


def _load_initial_weights(model, path: str, distinfo: DistInfo) -> None:
    """training.init_from: copy a trained model's weights into ``model`` (``LMForgeModel.load_initial_weights``)."""
    from lmforge.models import load_model
    from lmforge.checkpoint import resolve_model_dir

    source_dir = resolve_model_dir(path)
    model.load_initial_weights(load_model(source_dir), str(source_dir))
    if distinfo.is_main:
        print(f"initial weights from {source_dir}")


def _write_run_files(cfg: RunConfig, tokenizer_path: Path | None) -> None:
    cfg.save(cfg.run_dir / "config.yaml")
    if tokenizer_path is not None:
        _copy_tokenizer(tokenizer_path, cfg.run_dir / "tokenizer")


def _check_same_tokenizer(tokenizer_path: Path | None, checkpoint: Path) -> None:
    """A resume reads its data with the tokenizer the checkpoint was trained with (a copy is in every
    checkpoint): another one's ids mean other text."""
    mine = checkpoint / TOKENIZER_FILE
    if tokenizer_path is None or not mine.is_file():
        return
    theirs = tokenizer_path.parent / TOKENIZER_FILE
    parsed = []
    for path in (theirs, mine):
        try:  # as JSON: the same tokenizer written with other spacing is the same
            parsed.append(json.loads(path.read_bytes()))
        except (OSError, ValueError) as e:
            run_copy = checkpoint.parent.parent / "tokenizer" / TOKENIZER_FILE
            sources = [str(p) for p in (run_copy, theirs, mine) if p != path]
            raise LMForgeError(
                f"{path} is damaged (it cannot be read as JSON: {e}). Copy the same tokenizer over it from "
                f"{' or '.join(sources)} (or another checkpoint of the run), then resume again; a newly trained "
                "tokenizer would not match the weights or the data.") from e
    if parsed[0] != parsed[1]:
        raise LMForgeError(f"the data of this resume is tokenized with {tokenizer_path.parent}, not with the "
                           f"tokenizer {checkpoint} was trained with: resume with the run's data settings (see "
                           f"{checkpoint / 'run_config.yaml'}), or start a new run from its weights with "
                           "training.init_from")


def _changed_settings(saved: Path, cfg: RunConfig, limit: int = 8) -> list[str]:
    """``key old -> new`` for each setting of ``cfg`` that differs from the run config saved at ``saved``."""
    try:
        old = yaml.safe_load(saved.read_text())
    except (OSError, yaml.YAMLError):
        return []

    def flat(d: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(d, dict):
            return {prefix[:-1]: d}
        return {k: v for key, value in d.items() for k, v in flat(value, f"{prefix}{key}.").items()}

    before, after = flat(old), flat(cfg.to_dict())
    changed = [f"{k} {before.get(k)!r} -> {after.get(k)!r}" for k in after
               if k in before and before[k] != after[k] and k != "resume_from_checkpoint"]
    return changed[:limit] + ([f"... ({len(changed) - limit} more)"] if len(changed) > limit else [])


def _copy_tokenizer(tokenizer_path: Path, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        src = tokenizer_path.parent / name
        if src.is_file():
            shutil.copyfile(src, directory / name)


__all__ = ["train", "TrainResult", "seed_everything"]
