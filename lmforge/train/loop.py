"""The one training loop, for every training kind.

It knows nothing about what a kind computes: the kind's spec (``lmforge.recipes.RecipeSpec``) gives
the loss of a batch, what a batch counts for (tokens, examples, FLOPs), the optimizer, the metric
that picks ``best/`` and an optional probe; its ``TrainData`` hands out batches and can save/restore
its position. Everything else — precision, accumulation, clipping, schedules, evaluation,
checkpoints, resume, signals, NaN detection, logging, DDP — lives here once.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from lmforge import checkpoint as ckpt
from lmforge.config import GRAPH_MODES, RunConfig
from lmforge.device import DeviceInfo, model_flops_utilization, peak_memory_mb
from lmforge.errors import LMForgeError
from lmforge.models.base import LMForgeModel
from lmforge.recipes import ModelHost, TrainData
from lmforge.safe_state import save_state
from lmforge.train import fsdp
from lmforge.train.distributed import DistInfo
from lmforge.train.loggers import MetricsLogger
from lmforge.train.optim import AdamW8bit, default_optimizer
from lmforge.train.schedule import lr_multiplier, lr_multiplier_at


@dataclass
class _Window:
    """What the steps since the last log line did, on this process."""

    seconds: float = 0.0
    tokens: int = 0
    examples: int = 0
    flops: float = 0.0
    steps: int = 0
    loss_sum: torch.Tensor | float = 0.0  # on the device: read at the log line
    unseen: int = 0  # tokens not yet in Trainer.tokens_seen (added at log lines and checkpoints)


class _NonFinite:
    """Catches a non-finite loss or gradient norm before its update lands on the weights.

    On the device, where the optimizer takes ``found_inf`` (fused AdamW, lmforge's default, on CUDA and
    the CPU: MPS's fused kernel ignores it; ``AdamW8bit`` everywhere; not with FSDP's CPU offload, whose gradients and optimizer
    live on the CPU while the loss is on the GPU): each step folds its finiteness (any process's, under
    torchrun) into a sticky flag that the optimizer kernel reads, so the bad update and every one after
    it are skipped on the device; the host reads the flag only at the loop's check steps (log lines,
    evaluations, probes, checkpoints, the last step) and stops there, naming the first bad step. The
    weights then are those from before it, as if the loop had stopped at once.
    On the host otherwise (fp16 loss scaling, whose scaler checks every step anyway, or an optimizer
    without ``found_inf``): the loss and norm are read after every step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, scaled: bool, offload: bool = False,
                 distributed: bool = False):
        fused = (device.type in ("cuda", "cpu") and isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
                 and all(g.get("fused") for g in optimizer.param_groups))
        self.on_device = not scaled and not offload and (fused or getattr(optimizer, "takes_found_inf", False))
        self.grad_checked = not scaled  # with fp16 loss scaling Inf gradients are expected: the scaler skips them
        self.device = device
        self.distributed = distributed
        self.first: tuple[int, float, float] | None = None  # step, loss, grad norm of the first bad step (host)
        if self.on_device:
            self.flag = torch.zeros((), device=device)  # 1.0 from the first bad step on
            self.record = torch.zeros(3, device=device)  # step, loss, grad norm of that step
            optimizer.found_inf = self.flag  # read by the fused kernel at every step

    def observe(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        if self.on_device:
            norm = grad_norm.float()
            bad = (~torch.isfinite(loss) | ~torch.isfinite(norm)).float()
            if self.distributed:  # every process skips the same steps (one process's loss alone may be bad)
                dist.all_reduce(bad, op=dist.ReduceOp.MAX)  # queued on the device: no host wait
            bad = bad > 0
            newly = bad & (self.flag == 0)
            step_t = torch.full((), float(step), device=self.device)
            self.record = torch.where(newly, torch.stack([step_t, loss.float(), norm]), self.record)
            self.flag.copy_(torch.maximum(self.flag, bad.float()))  # in place: the optimizer holds this tensor
        elif self.first is None:
            loss_value, norm_value = float(loss), float(grad_norm)
            if not math.isfinite(loss_value) or (self.grad_checked and not math.isfinite(norm_value)):
                self.first = (step, loss_value, norm_value)

    def bad_step(self, info: DistInfo) -> tuple[int, float, float] | None:
        """The first bad step's (step, loss, grad norm) if any process had one, else None (all
        processes call this at the same step; a host read of one flag on the device)."""
        if self.on_device and self.first is None:
            record = [float(self.flag)] + self.record.tolist()
            if record[0] > 0:
                self.first = (int(record[1]), record[2], record[3])
        if info.enabled:
            anywhere = torch.tensor([float(self.first is not None)], device=self.device)
            dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
            if anywhere.item() > 0 and self.first is None:  # another process's loss: this one's is fine
                return (-1, float("nan"), float("nan"))
        return self.first


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    stopped: str  # completed | signal | time
    last_checkpoint: Path | None
    best_checkpoint: Path | None
    eval_metrics: dict[str, float] = field(default_factory=dict)
    train_loss: float = float("nan")
    tokens_per_s: float = 0.0
    is_main: bool = True  # False on the other ranks of a torchrun job
    signal: int | None = None  # the signal that stopped it (stopped == "signal"): SIGTERM's 15, SIGINT's 2


class _StopFlag:
    """SIGTERM/SIGINT set a flag; the loop saves at the next step boundary. A second SIGINT aborts."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. called from a worker): no handlers
                pass
        return self

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False


def capture_rng() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if torch.backends.mps.is_available():
        state["mps"] = torch.mps.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "mps" in state and torch.backends.mps.is_available():
        torch.mps.set_rng_state(state["mps"])


def _refuse_non_finite_optimizer_state(path, opt_state: Any) -> None:
    """A NaN or inf in the saved optimizer moments would turn the first update's weights into NaN."""
    optimizer = opt_state.get("optimizer") if isinstance(opt_state, dict) else None
    entries = optimizer.get("state") if isinstance(optimizer, dict) else None
    if not isinstance(entries, dict):
        return  # a malformed state is reported where it is restored
    found = ckpt.first_non_finite((f"parameter {i}'s {key}", value) for i, state in entries.items()
                                  if isinstance(state, dict) for key, value in state.items())
    if found is not None:
        raise LMForgeError(ckpt.non_finite_message(path, found, "optimizer state"))


class Trainer:
    def __init__(self, cfg: RunConfig, model: LMForgeModel, data: TrainData, devinfo: DeviceInfo,
                 distinfo: DistInfo, run_dir: Path, extra_files: Callable[[Path], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.cfg, self.t = cfg, cfg.training
        self.spec = cfg.spec  # the training kind: loss, counts, optimizer, best metric
        self.clock = clock  # every duration the loop measures (time limit, schedule, tokens/s) reads this
        self.model = model  # the raw module: saved, evaluated and checkpointed
        self.data, self.dev, self.dist = data, devinfo, distinfo
        self.run_dir = run_dir
        self.ckpt_root = run_dir / "checkpoints"
        self.extra_files = extra_files  # writes tokenizer files etc. into a model directory
        self.step = 0
        self.tokens_seen = 0
        self.train_seconds = 0.0  # time spent in training steps, all sessions (not eval, probes, checkpoints)
        self.best_score = math.inf  # the best metric, negated when higher is better
        self.last_checkpoint: Path | None = None
        self._warned: dict[str, int] = {}  # metric warning -> step it was last shown

        if self.spec.prepare_model is not None:
            self.spec.prepare_model(model, cfg)
        # FSDP's modules (root last) with training.parallel fsdp / hsdp on several processes; else None.
        self.sharded: list[torch.nn.Module] | None = None
        # The frozen models the kind keeps (a reference, a reward model), and under FSDP their sharded modules
        self.frozen: list[torch.nn.Module] = []
        self.frozen_sharded: list[list[torch.nn.Module]] = []
        self._gatherer: fsdp.Gatherer | None = None  # gathers them for calls outside the training step
        sharding = fsdp.active(self.t.parallel)
        # What each micro-batch runs: the kind's loss on the (compiled) model, as one module's forward,
        # so DDP sees every parameter the loss touches however the kind calls the model (and FSDP's
        # root gathers the weights outside the blocks).
        if self.t.compile:
            model.before_compile(devinfo.device)
        compiled = torch.compile(model, mode=self.t.compile_mode) if self.t.compile and not sharding else model
        # CUDA graphs (compile_mode reduce-overhead / max-autotune) are told where each micro-batch starts,
        # so that a replay may reuse the memory of the last one's outputs (read before it: the loss, metrics)
        # (the settings that make a replay unsafe are refused by lmforge.config.validate_run_config)
        self._graph_steps = (self.t.compile and self.t.compile_mode in GRAPH_MODES
                             and devinfo.device.type == "cuda")
        self.fwd_model: torch.nn.Module = _Objective(compiled, self.spec.loss)
        if sharding:
            if devinfo.precision == "fp16":
                raise LMForgeError(f"training.parallel={self.t.parallel} with fp16 is not supported (its loss "
                                   "scaler does not shard): use training.precision=bf16 or fp32")
            if self.t.fsdp_offload and devinfo.device.type == "cpu":
                raise LMForgeError("training.fsdp_offload moves the shards from accelerator memory to CPU memory; "
                                   "this run is on the CPU already: drop training.fsdp_offload")
            param_dtype = torch.bfloat16 if devinfo.precision == "bf16" else None
            self._layout = fsdp.layout(self.t.parallel, devinfo.device, distinfo.world_size, param_dtype,
                                       self.t.fsdp_offload)
            self.sharded = fsdp.shard(self.fwd_model, model, self._layout,
                                      self.t.compile_mode if self.t.compile else None)
            self._gatherer = fsdp.Gatherer(param_dtype)
            self._gatherer.add(self.sharded)
        # After sharding: FSDP's parameters are this process's shards, and the optimizer keeps state for those.
        self.optimizer = (self.spec.make_optimizer or default_optimizer)(model, cfg, devinfo.device)
        if self.t.optimizer_states == "8bit" and not isinstance(self.optimizer, AdamW8bit):
            raise LMForgeError(f"training.optimizer_states=8bit is AdamW's, and this kind trains with its own optimizer "
                               f"({type(self.optimizer).__name__}), whose states stay fp32: drop "
                               "training.optimizer_states")
        for g in self.optimizer.param_groups:
            g["base_lr"] = g["lr"]  # the schedule scales each group's own lr
        self.scaler = torch.amp.GradScaler(devinfo.device.type, enabled=devinfo.precision == "fp16")
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self._window = _Window()
        # What a run stopped by a signal at this step had still to do there (its evaluation, its probe): kept in
        # the checkpoint and done first on resume, so a stop never loses an evaluation (or best/'s candidate).
        self._pending: set[str] = set()
        self._state_mb: float | None = None  # this process's weights + optimizer state, logged once
        self._frozen_mb: float | None = None  # this process's share of the frozen models' weights

        if data.bind_model is not None:
            data.bind_model(model, devinfo, _TrainerHost(self))
        if distinfo.enabled and not sharding:
            ids = [devinfo.device.index] if devinfo.device.type == "cuda" else None
            self.fwd_model = torch.nn.parallel.DistributedDataParallel(
                self.fwd_model, device_ids=ids,
                find_unused_parameters=self.spec.ddp_find_unused_parameters)

    def keep_frozen(self, module: torch.nn.Module) -> torch.nn.Module:
        """``ModelHost.frozen``: a frozen model the kind keeps for training, put on the run's device: sharded
        like the trained one under FSDP (which moves each block's shard there, so a model loaded on the CPU
        is never whole on the GPU), else whole; returns it."""
        self.frozen.append(module)
        if self.sharded:
            self.frozen_sharded.append(fsdp.shard_frozen(module, self._layout))
            self._gatherer.add(self.frozen_sharded[-1])
        else:
            module.to(self.dev.device)
        return module

    def gathered(self, *modules: torch.nn.Module) -> contextlib.AbstractContextManager:
        """``ModelHost.gathered``: ``modules`` (the trained model or parts of it, frozen models) hold their
        full weights on this process while inside (a no-op unless sharded: ``fsdp.Gatherer``)."""
        return self._gatherer(*modules) if self._gatherer is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def scoring(self, module: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """``ModelHost.scoring``: ``module`` whole on the run's device while inside; under FSDP in the compute
        dtype, counted with the gathered weights (``train/gathered_mb``)."""
        if self._gatherer is None:
            yield module.to(self.dev.device)
            return
        module = fsdp.whole_on(module, self.dev.device, self._gatherer.dtype)
        with self._gatherer.holding(sum(p.numel() * p.element_size() for p in module.parameters())):
            yield module

    def full_weights(self) -> contextlib.AbstractContextManager:
        """Context in which the trained model holds its full weights on this process (a no-op unless
        sharded): a probe calls the plain model inside it, as often as it likes."""
        return self.gathered(self.model)

    # ---- resume ---------------------------------------------------------------------------
    def _verify_checksums(self, path: Path) -> None:
        """Refuse a checkpoint whose files changed since they were written. The processes of a machine hash a
        share of the files each (together they read its copy of the checkpoint once: a shared file system's,
        or the machine's own); when any found damage, every process checks all of them, so each stops with
        the same message and none waits on the others."""
        if not self.dist.enabled:
            ckpt.verify_checksums(path)
            return
        per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", self.dist.world_size))
        bad = ckpt.checksum_mismatch(path, share=(self.dist.local_rank % per_machine, per_machine))
        found = torch.tensor([float(bad is not None)], device=self.dev.device)
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        if found.item() > 0:
            ckpt.verify_checksums(path)
            first = f" ({bad})" if bad else " on another process"
            raise LMForgeError(f"a file of {path} did not match its checksum{first}, and did on a second reading: "
                               "check the disk (a failing read), then resume again")

    def load_checkpoint(self, path: Path) -> None:
        """Restore model, optimizer, scaler, schedule position, data position and RNG exactly."""
        state = ckpt.read_trainer_state(path)
        self._verify_checksums(path)
        if self.sharded and ckpt.is_sharded(path):  # each process reads its own shards
            opt_state = fsdp.load_sharded(self.model, self.optimizer, path)
        else:  # full tensors (a sharded checkpoint's put together) on every process
            if self.sharded:
                fsdp.load_model_state(self.model, path)
            else:
                self.model.load_checkpoint_weights(path, self.dev.device)
            opt_state = ckpt.load_training_file(path, ckpt.OPTIMIZER_FILE, "optimizer state")
            _refuse_non_finite_optimizer_state(path, opt_state)
        rng = ckpt.load_training_file(path, ckpt.RNG_FILE, "random-number state")
        # The files parse; what they hold is still checked before use: a damaged or crafted state stops
        # here with a message instead of failing later inside the optimizer or the RNG.
        try:
            self._restore_training_state(opt_state, rng, state, path)
        except LMForgeError:
            raise
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError) as e:
            raise LMForgeError(f"the training state in {path} does not fit this run ({type(e).__name__}: {e}): "
                               "resume with the config the checkpoint was written with (see its run_config.yaml), "
                               f"or from an earlier checkpoint in {path.parent}") from e
        self.last_checkpoint = path

    def _kind_restores(self, path: Path, owner: Any, method: str, saved: Any) -> None:
        """``owner.method(saved)``, a resume hook the kind wrote (its loader's ``load_state_dict``, its model's
        ``load_training_state``): what it raises is reported as the kind's, with its cause, not as a checkpoint
        that does not fit the run (the message for lmforge's own steps)."""
        try:
            getattr(owner, method)(saved)
        except LMForgeError:
            raise
        except Exception as e:  # noqa: BLE001 - any bug of the kind's code; re-raised with its cause
            keys = f" (keys {', '.join(map(str, saved))})" if isinstance(saved, dict) else ""
            raise LMForgeError(f"resuming from {path}: kind {self.spec.name!r}'s {type(owner).__name__}.{method} "
                               f"raised {type(e).__name__}: {e}, given the state{keys} it saved in the checkpoint. "
                               "This is the kind's own resume code: what its state_dict / training_state writes, "
                               f"its {method} must read back (a checkpoint written by another version of the "
                               "kind or another config may differ: resume with those)") from e

    def _restore_training_state(self, opt_state: dict[str, Any], rng: dict[str, Any], state: dict[str, Any],
                                path: Path) -> None:
        self._kind_restores(path, self.model, "load_training_state", opt_state.get("model_state") or {})
        saved = opt_state["optimizer"]
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        shapes = getattr(self.optimizer, "state_shapes", None)  # moments of another shape than the parameter's
        for idx, entries in saved["state"].items():  # load_state_dict would take moments of any shape
            expected = shapes(params[idx]) if shapes is not None else {}
            if shapes is not None and set(entries) - {"step"} != set(expected):
                raise ValueError(f"the optimizer state of parameter {idx} holds {sorted(entries)}, this run's "
                                 f"optimizer keeps {sorted(['step', *expected])}: was it written with another "
                                 "training.optimizer_states?")
            for name, value in entries.items():
                want = expected.get(name, tuple(params[idx].shape))
                if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) != want:
                    raise ValueError(f"{name} of parameter {idx} has shape {tuple(value.shape)}, not {want}")
        # The learning rates come from this run's config, so that `training.lr=...` on a resume takes effect.
        base_lrs = [g["base_lr"] for g in self.optimizer.param_groups]
        if self.sharded:
            fsdp.load_optimizer_state(self.model, self.optimizer, saved)
        else:
            self.optimizer.load_state_dict(saved)
        for g, base_lr in zip(self.optimizer.param_groups, base_lrs, strict=True):
            g["base_lr"] = base_lr
        if opt_state["scaler"] and self.scaler.is_enabled():
            self.scaler.load_state_dict(opt_state["scaler"])
        per_rank = state.get("data_per_rank")  # each process's own loader (e.g. HRGC's pool of its failures)
        own = per_rank[self.dist.rank] if per_rank and len(per_rank) == self.dist.world_size else state["data"]
        self._kind_restores(path, self.data.train, "load_state_dict", own)
        saved_world = len(rng["per_rank"])
        if saved_world == self.dist.world_size:
            restore_rng(rng["per_rank"][self.dist.rank])
        elif self.dist.is_main:
            tqdm.write(f"note: checkpoint was written by {saved_world} process(es), resuming on "
                       f"{self.dist.world_size}: data order is kept, dropout randomness is not")
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.train_seconds = float(state.get("train_seconds", 0.0))
        best = state.get("best_score", state.get("best_eval_loss"))
        self.best_score = math.inf if best is None else float(best)
        windows = state.get("log_window_per_rank")  # the steps since the last log line, to log them as if unbroken
        if isinstance(windows, list) and len(windows) == self.dist.world_size:
            w = windows[self.dist.rank]
            self._window = _Window(seconds=float(w["seconds"]), tokens=int(w["tokens"]), examples=int(w["examples"]),
                                   flops=float(w["flops"]), steps=int(w["steps"]), loss_sum=float(w["loss_sum"]))
        self._pending = {k for k in state.get("pending", ()) if k in ("eval", "probe")}

    # ---- saving ---------------------------------------------------------------------------
    def _write_model_dir(self, directory: Path, state: dict[str, torch.Tensor] | None = None) -> None:
        """The model's files (``state``: its full weights, gathered from the shards; None: its own; {}: none,
        the config only, for a sharded checkpoint whose shards hold the weights)."""
        with self.model.averaged_weights():
            if state is None:
                self.model.save_pretrained(directory)
            else:
                self.model.save_pretrained(directory, state_dict=state, weights=bool(state))
        if self.extra_files is not None:
            self.extra_files(directory)

    def _gather_for_saving(self) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any]]:
        """The weights (None: the model's own) and the optimizer state to write; sharded, they are
        gathered on process 0 (every process must call this)."""
        if self.sharded:
            return fsdp.full_model_state(self.model), fsdp.full_optimizer_state(self.model, self.optimizer)
        return None, self.optimizer.state_dict()

    def save_checkpoint(self) -> Path | None:
        self._count_window()  # tokens_seen is complete in the state written (the log window is kept)
        rng = capture_rng()
        w = self._window
        window = {"steps": w.steps, "loss_sum": float(w.loss_sum), "seconds": w.seconds, "tokens": w.tokens,
                  "examples": w.examples, "flops": w.flops}  # a checkpoint is a check step: the loss may be read
        if self.dist.enabled:
            gathered: list[Any] = [None] * self.dist.world_size
            dist.all_gather_object(gathered, rng)
            data_states: list[Any] = [None] * self.dist.world_size
            dist.all_gather_object(data_states, self.data.train.state_dict())
            windows: list[Any] = [None] * self.dist.world_size
            dist.all_gather_object(windows, window)
        else:
            gathered = [rng]
            data_states = [self.data.train.state_dict()]
            windows = [window]

        # Sharded: every process writes its own shards; nothing is gathered.
        sharded = self.sharded is not None and self.t.fsdp_checkpoint == "sharded"
        weights, optimizer_state = ({}, None) if sharded else self._gather_for_saving()
        rest = {"scaler": self.scaler.state_dict(), "model_state": self.model.training_state()}

        def write(tmp: Path) -> None:
            self._write_model_dir(tmp, weights)
            if not sharded:
                save_state(tmp / ckpt.OPTIMIZER_FILE, {"optimizer": optimizer_state, **rest})
            save_state(tmp / ckpt.RNG_FILE, {"per_rank": gathered})
            self.cfg.save(tmp / "run_config.yaml")
            ckpt.save_json(tmp / ckpt.STATE_FILE, {
                "step": self.step, "tokens_seen": self.tokens_seen, "train_seconds": self.train_seconds,
                "best_score": self.best_score if math.isfinite(self.best_score) else None,
                "best_metric": self.spec.best_metric,
                "data": data_states[0], "world_size": self.dist.world_size, "log_window_per_rank": windows,
                "pending": sorted(self._pending),
                **({"data_per_rank": data_states} if self.dist.enabled else {}),
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "checksums": ckpt.CHECKSUMS_FILE,  # written with it by write_checkpoint: its absence is damage
            })

        if not sharded:
            path = self._main_writes(lambda: ckpt.write_checkpoint(self.ckpt_root, self.step, write, self.t.keep_last)
                                     if self.dist.is_main else None)
        else:  # all processes write into one temporary directory, which process 0 publishes once all are done
            staging = ckpt.staging_dir(self.ckpt_root, self.step)
            self._main_writes(lambda: ckpt.start_staging(staging) if self.dist.is_main else None)

            def publish() -> Path | None:
                try:
                    fsdp.save_sharded(self.model, self.optimizer, staging, rest, self.dist.world_size,
                                      self.dist.is_main)
                except BaseException:
                    if self.dist.is_main:
                        ckpt.discard(staging)
                    raise
                return (ckpt.write_checkpoint(self.ckpt_root, self.step, write, self.t.keep_last, staged=staging)
                        if self.dist.is_main else None)

            path = self._main_writes(publish)
        self.last_checkpoint = path or self.ckpt_root / ckpt.step_dir_name(self.step)
        return path

    def _main_writes(self, write: Callable[[], Any]) -> Any:
        """Run rank 0's ``write`` (a no-op elsewhere), then hold every rank until it is done. A failure
        (a full disk) is shared: every rank stops, instead of waiting at a barrier for a rank that left."""
        error: BaseException | None = None
        result = None
        try:
            result = write()
        except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks know
            error = e
        if self.dist.enabled:
            failed = torch.tensor([float(error is not None)], device=self.dev.device)
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)  # also the barrier
            if error is None and failed.item() > 0:
                raise LMForgeError("rank 0 could not write a checkpoint (its message says why); stopping")
        if error is not None:
            raise error
        return result

    # ---- evaluation -----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        if self.data.val is None:
            return {}
        self.model.eval()
        self.model.step_metrics = True  # an evaluation reports the model's diagnostics at every step it runs
        sums: dict[str, torch.Tensor | float] = {}
        weight = 0.0
        batches = ((b, True) for b in self.data.val.iter_eval_batches(self.t.eval_batches or None))
        # Under FSDP the loss runs through the sharded root, block by block as in a training step, with the
        # processes in step; nothing is gathered whole. (A val loader that runs the models itself gathers
        # them itself: ModelHost.gathered.) The blocks run eagerly, as a plain model's do.
        by_block = self.sharded is not None and self.data.eval_loss_reads_model
        if by_block:
            batches = fsdp.lockstep((b for b, _ in batches), self.dev.device)
        stance = torch.compiler.set_stance("force_eager") if by_block else contextlib.nullcontext()
        with stance, self.model.averaged_weights():
            for batch, counts in batches:
                w = float(self.spec.eval_weight(batch))  # on the CPU batch
                batch = _to_device(batch, self.dev.device)
                with self.dev.autocast():
                    loss, metrics = self.fwd_model(batch) if by_block else self.spec.loss(self.model, batch)
                if not counts:  # a spare batch run to keep in step with the other processes
                    continue
                # Summed where they are (device tensors on the device): one read after the last batch.
                for k, v in {"loss": loss, **metrics}.items():
                    v = v.detach().to(_reduce_dtype(self.dev.device)) if torch.is_tensor(v) else float(v)
                    sums[k] = sums.get(k, 0.0) + v * w
                weight += w
        if by_block:  # a root keeps its gathered weights after a forward, for a backward that will not come
            for modules in (self.sharded, *self.frozen_sharded):
                fsdp.release(modules)
        self.model.train()
        means = weighted_means(sums, weight, self.dist, self.dev.device)
        return {f"eval/{k}": v for k, v in self.data.derive_eval_metrics(means).items()} if means else {}

    # ---- training -------------------------------------------------------------------------
    def _set_lr(self, time_progress: float = 0.0) -> float:
        """Set this step's lr: by step, or with ``training.schedule_over=time`` by the share of the time
        budget spent when the step's gradient is ready (so the budget's last step runs at the floor)."""
        t = self.t
        if t.schedule_over == "time":
            mult = lr_multiplier_at(time_progress, schedule=t.schedule, min_lr_ratio=t.min_lr_ratio,
                                    warmup_share=min(1.0, t.warmup_steps / t.max_steps), decay_ratio=t.decay_ratio)
        else:
            mult = lr_multiplier(self.step, schedule=t.schedule, max_steps=t.max_steps, warmup_steps=t.warmup_steps,
                                 min_lr_ratio=t.min_lr_ratio, decay_ratio=t.decay_ratio)
        for g in self.optimizer.param_groups:
            g["lr"] = g["base_lr"] * mult
        return self.t.lr * mult

    def _train_step(self) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor | float]]:
        accum = self.t.grad_accum_steps
        loss_sum = torch.zeros((), device=self.dev.device)
        metric_sums: dict[str, torch.Tensor] = {}
        window = self._window
        if self.data.on_step is not None:
            self.data.on_step(self.step)
        for micro in range(accum):
            batch = self.data.train.next_batch()  # a rollout gathers the weights it runs (ModelHost.gathered)
            counts = self.spec.count(self.model, batch)  # on the CPU batch: no device synchronisation
            window.tokens += counts.tokens
            window.unseen += counts.tokens
            window.examples += counts.examples
            window.flops += counts.flops
            batch = _to_device(batch, self.dev.device)
            # Under FSDP the gradients are reduce-scattered after every micro-batch: skipping that would
            # keep them unsharded (4 bytes per parameter) between micro-batches, the memory FSDP saves.
            sync = (self.fwd_model.no_sync() if self.dist.enabled and not self.sharded and micro < accum - 1
                    else contextlib.nullcontext())
            if self._graph_steps:
                torch.compiler.cudagraph_mark_step_begin()
            with sync:
                with self.dev.autocast():
                    loss, metrics = self.fwd_model(batch)
                self.scaler.scale(loss / accum).backward()
            loss_sum += loss.detach().float()
            for k, v in metrics.items():  # device tensors stay on the device (no copy to the host per step)
                metric_sums[k] = metric_sums.get(k, 0.0) + (v.detach().float() if torch.is_tensor(v) else float(v))
        # A frozen model called in the loss (dpo's live reference) keeps its root's weights (embeddings,
        # head) gathered after its forward, as a root does for its backward: free them until the next step.
        for modules in self.frozen_sharded:
            fsdp.release(modules)
        self.scaler.unscale_(self.optimizer)  # a no-op without fp16 loss scaling
        # The norm is computed even without clipping: it is logged and checked for NaN/Inf.
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.t.grad_clip if self.t.grad_clip > 0 else math.inf)
        if hasattr(grad_norm, "full_tensor"):  # sharded gradients: a DTensor norm, the same on every process
            # (on the CPU with training.fsdp_offload, whose gradients live there: joined to the loss on the device)
            grad_norm = grad_norm.full_tensor().to(self.dev.device)
        return loss_sum / accum, grad_norm, {k: v / accum for k, v in metric_sums.items()}

    def apply_update(self) -> None:
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.on_optimizer_step()

    def step_once(self) -> torch.Tensor:
        """One optimizer step without logging or checks (used by `lmforge bench`); returns the loss, a
        0-d tensor on the device (reading it waits for the step)."""
        self._set_lr()
        loss, _, _ = self._train_step()
        self.apply_update()
        self.step += 1
        return loss

    def _check_loader_state(self) -> None:
        """The train loader's ``state_dict()`` goes into every checkpoint's trainer_state.json: one that JSON
        cannot hold (a tensor, a torch.Generator's state) is refused before step 1, not at the first checkpoint
        after the steps before it ran."""
        loader = self.data.train
        state = loader.state_dict()
        try:
            json.dumps(state)
        except (TypeError, ValueError) as e:
            where = _first_non_json(state, "state_dict()") or "state_dict()"
            raise LMForgeError(f"kind {self.spec.name!r}: its train loader's state ({type(loader).__name__}."
                               f"{where}) cannot be written to a checkpoint's {ckpt.STATE_FILE} ({e}). The state "
                               "must hold JSON values only (dicts with string keys, lists, strings, numbers, "
                               "booleans, None): keep what puts the loader back where it was, such as a seed and "
                               "a count of batches drawn, not tensors or a torch.Generator's state (see "
                               "docs/adding-a-recipe.md)") from e

    def fit(self) -> TrainResult:
        self._check_loader_state()
        t, is_main = self.t, self.dist.is_main
        logger = None
        if is_main:
            log = self.cfg.logging
            logger = MetricsLogger(self.run_dir, log.tensorboard, log.wandb_project, log.wandb_run_name,
                                   config=self.cfg.to_dict(), start_step=self.step, wandb_entity=log.wandb_entity)
        by_time = t.schedule_over == "time"
        budget = 60 * t.max_time_minutes  # seconds: the run's length by_time, else a wall-time guard
        if by_time:  # the bar counts seconds of training time
            bar = tqdm(total=round(budget), initial=min(round(self.train_seconds), round(budget)), desc="train",
                       bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} s of training [{elapsed}{postfix}]",
                       dynamic_ncols=True, disable=not (is_main and self.cfg.logging.progress_bar))
        else:
            bar = tqdm(total=t.max_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                       disable=not (is_main and self.cfg.logging.progress_bar), smoothing=0.1)
        start = self.clock()
        # Tokens/s and MFU count the time of training steps only: evaluation, probes, checkpoints and
        # logging happen between steps and are left out.
        window = self._window  # a resume's: the steps since the last log line before the stop
        stopped, eval_metrics, train_loss, tok_s = "completed", {}, float("nan"), 0.0
        signum = 0  # the signal the processes stop for (0: none)
        mfu_trusted = True  # False once the peak proved wrong (MFU above 100%)
        finished = self.train_seconds >= budget if by_time else self.step >= t.max_steps
        self.model.train()
        nonfinite = _NonFinite(self.optimizer, self.dev.device, scaled=self.scaler.is_enabled(),
                               offload=bool(self.sharded) and self.t.fsdp_offload, distributed=self.dist.enabled)
        # Processes agree on stopping at check steps only, unless the lr depends on the time spent
        # (every process must set the same lr) or NaN is checked on the host: then after every step.
        agree_every_step = self.dist.enabled and (by_time or not nonfinite.on_device)
        try:
            with _StopFlag() as stop:
                if self._pending:
                    eval_metrics = self._do_pending(logger, bar) or eval_metrics
                while not finished:
                    step_start = self.clock()
                    step = self.step + 1  # the step this iteration makes
                    due = self._check_due(step, by_time)
                    self.model.step_metrics = step % t.log_interval == 0 or (not by_time and step == t.max_steps)
                    loss, grad_norm, metrics = self._train_step()
                    nonfinite.observe(step, loss, grad_norm)
                    now = self.clock()
                    out_of_time = not by_time and budget > 0 and now - start > budget
                    progress = (self.train_seconds + now - step_start) / budget if by_time else 0.0
                    signum = stop.signum or 0
                    if agree_every_step or (self.dist.enabled and due):
                        # Reduced across ranks: every process stops, and sets the same lr, at the same step.
                        # (the signal's number: a process that got none stops, and exits, as the others do)
                        flags = torch.tensor([float(signum), float(out_of_time), progress],
                                             dtype=_reduce_dtype(self.dev.device), device=self.dev.device)
                        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
                        reduced = flags.tolist()
                        signum, out_of_time, progress = int(reduced[0]), reduced[1] > 0, reduced[2]
                    elif self.dist.enabled:  # a signal or the time limit is acted on at the next check step
                        signum, out_of_time = 0, False
                    signalled = signum > 0
                    finished = progress >= 1.0 if by_time else step == t.max_steps
                    if due or finished or signalled or out_of_time or not nonfinite.on_device:
                        bad = nonfinite.bad_step(self.dist)
                        if bad is not None:
                            raise LMForgeError(self._nan_message(*bad))
                    lr = self._set_lr(progress)
                    self.apply_update()
                    self.step = step
                    step_seconds = self.clock() - step_start
                    self.train_seconds += step_seconds
                    window.seconds += step_seconds
                    window.steps += 1
                    window.loss_sum = window.loss_sum + loss
                    if by_time:
                        bar.update(max(0, min(round(self.train_seconds), bar.total) - bar.n))
                    else:
                        bar.update(1)

                    if self.step % t.log_interval == 0 or finished:
                        seconds = max(window.seconds, 1e-9)
                        # One read of the device for the whole log line.
                        on_device = [k for k, v in metrics.items() if torch.is_tensor(v)]
                        read = torch.stack([torch.as_tensor(window.loss_sum, dtype=torch.float32), grad_norm.float(),
                                            *(metrics[k] for k in on_device)]).tolist()
                        values = self.model.logged_metrics({**metrics, **dict(zip(on_device, read[2:]))})
                        tokens, examples, flops = self._count_window()  # all processes together
                        window.tokens, window.examples, window.flops = 0, 0, 0.0
                        tok_s = tokens / seconds
                        train_loss = _mean_across_ranks(read[0] / window.steps, self.dist, self.dev.device)
                        if self._state_mb is None:  # after the first update: the optimizer's state exists
                            self._state_mb = fsdp.local_bytes(self.model, self.optimizer) / 2**20
                            if self.frozen:
                                self._frozen_mb = sum(fsdp.local_bytes(m) for m in self.frozen) / 2**20
                        row = {"train/loss": train_loss, "train/lr": lr, "train/grad_norm": read[1],
                               "train/state_mb": self._state_mb, "train/tokens_per_s": tok_s,
                               "train/examples_per_s": examples / seconds, "train/tokens": self.tokens_seen}
                        if self._frozen_mb is not None:
                            row["train/frozen_mb"] = self._frozen_mb
                        if self._gatherer is not None and self._gatherer.peak:
                            row["train/gathered_mb"] = self._gatherer.peak / 2**20
                        peak = peak_memory_mb(self.dev.device)  # this process's (rank 0's in the logs)
                        if peak is not None:
                            row["train/peak_memory_mb"] = peak
                        mfu = model_flops_utilization(tok_s, flops / max(tokens, 1), self.dev.peak_flops,
                                                      self.dist.world_size) if mfu_trusted else None
                        if mfu is not None:
                            row["train/mfu"] = mfu
                        elif mfu_trusted:
                            mfu_trusted = False
                            if is_main:
                                self._mfu_unknown_note(flops / seconds / self.dist.world_size)
                        # A model's own sections (mhc/...) are logged under their names, the rest under train/.
                        row.update({(k if k.split("/")[0] in self.model.metric_sections else f"train/{k}"): float(v)
                                    for k, v in values.items()})
                        if logger:
                            logger.log(self.step, row)
                        if is_main:
                            self._warn(row)
                        shown = {"step": self.step} if by_time else {}
                        bar.set_postfix(**shown, loss=f"{train_loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}",
                                        mfu="?" if mfu is None else f"{100 * mfu:.1f}%", refresh=False)
                        window.seconds, window.steps, window.loss_sum = 0.0, 0, 0.0

                    eval_due = bool(t.eval_interval and self.step % t.eval_interval == 0) or finished
                    probe = self.data.probe
                    probe_due = probe is not None and bool(probe.interval) and (self.step % probe.interval == 0
                                                                                or finished)
                    if signalled or out_of_time:
                        stopped = "signal" if signalled else "time"
                        if signalled:  # left to the resume: a stop should be quick (a scheduler's grace period)
                            self._pending = {name for name, due in (("eval", eval_due), ("probe", probe_due)) if due}
                        break
                    if eval_due:
                        eval_metrics = self._eval_and_keep_best(logger, bar)
                    if probe_due:
                        self._probe(logger)
                    if (t.save_interval and self.step % t.save_interval == 0) or finished:
                        self.save_checkpoint()
                if stopped != "completed":
                    if is_main:
                        reason = (signal.Signals(signum).name if stopped == "signal"
                                  else f"the {t.max_time_minutes:g}-minute time limit")
                        tqdm.write(f"stopping at step {self.step} ({reason}): saving a checkpoint")
                    if stopped == "time":
                        eval_metrics = self._eval_and_keep_best(logger, bar)
                    self.save_checkpoint()
        finally:
            bar.close()
            if logger:
                logger.close()
        best = self.ckpt_root / "best"
        return TrainResult(run_dir=self.run_dir, step=self.step, stopped=stopped,
                           last_checkpoint=self.last_checkpoint, best_checkpoint=best if best.is_dir() else None,
                           eval_metrics=eval_metrics, train_loss=train_loss, tokens_per_s=tok_s,
                           is_main=self.dist.is_main, signal=signum if stopped == "signal" else None)

    def _do_pending(self, logger: MetricsLogger | None, bar) -> dict[str, float]:
        """The evaluation and probe due at the step the resumed checkpoint was written at (by a signal's stop),
        on its weights; then the checkpoint no longer asks for them (a second resume does not repeat them)."""
        metrics = self._eval_and_keep_best(logger, bar) if "eval" in self._pending else {}
        if "probe" in self._pending and self.data.probe is not None:
            self._probe(logger)
        self._pending = set()
        path = self.last_checkpoint
        # Only a checkpoint of this run is brought up to date (one of another run, resumed with name=NEW, is
        # left as it is): it no longer asks for this work, and holds the best score the work may have raised.
        own = path is not None and path.resolve().parent == self.ckpt_root.resolve()

        def done() -> None:
            if self.dist.is_main and own:
                best = self.best_score if math.isfinite(self.best_score) else None
                ckpt.save_json(path / ckpt.STATE_FILE, {**ckpt.read_trainer_state(path), "pending": [],
                                                        "best_score": best})

        self._main_writes(done)
        return metrics

    def _eval_and_keep_best(self, logger: MetricsLogger | None, bar) -> dict[str, float]:
        metrics = self.evaluate()
        if not metrics:
            return metrics
        if logger:
            logger.log(self.step, metrics)
        if self.dist.is_main:
            shown = ", ".join(f"{k.split('/')[-1]} {v:.4f}" for k, v in metrics.items())
            tqdm.write(f"step {self.step}: eval {shown}")
        value = metrics.get(self.spec.best_metric)
        score = math.inf if value is None else (-value if self.spec.best_higher_is_better else value)
        if score <= self.best_score:  # on a tie the newer weights win (plateaus of exact accuracy)
            self.best_score = score
            weights = fsdp.full_model_state(self.model) if self.sharded else None
            self._main_writes(lambda: ckpt.write_best(self.ckpt_root, lambda d: self._write_model_dir(d, weights))
                              if self.dist.is_main
                              else None)
        return metrics

    def _count_window(self) -> tuple[int, int, float]:
        """The tokens, examples and FLOPs of the log window, summed over processes (every process calls
        this at the same step); adds the tokens not yet counted to ``tokens_seen``."""
        w = self._window
        counts = [float(w.tokens), float(w.examples), float(w.flops), float(w.unseen)]
        if self.dist.enabled:
            reduced = torch.tensor(counts, dtype=_reduce_dtype(self.dev.device), device=self.dev.device)
            dist.all_reduce(reduced)
            counts = reduced.tolist()
        self.tokens_seen += int(counts[3])
        w.unseen = 0
        return int(counts[0]), int(counts[1]), counts[2]

    @torch.no_grad()
    def _probe(self, logger: MetricsLogger | None) -> None:
        """The kind's probe on the current weights, on every process (each on its own sample); the
        metrics logged are the means across processes."""
        self.model.eval()
        try:
            with self.full_weights(), self.model.averaged_weights(), self.dev.autocast():
                metrics = self.data.probe.run(self.model, self.step)
        finally:
            self.model.train()
        keys = sorted(metrics)
        if self.dist.enabled:
            values = torch.tensor([float(metrics[k]) for k in keys], dtype=_reduce_dtype(self.dev.device),
                                  device=self.dev.device)
            dist.all_reduce(values)
            metrics = {k: float(v) / self.dist.world_size for k, v in zip(keys, values.tolist())}
        if logger:
            logger.log(self.step, metrics)
        if self.dist.is_main:
            tqdm.write(f"step {self.step}: " + ", ".join(f"{k} {metrics[k]:.3f}" for k in keys))

    def _mfu_unknown_note(self, achieved_flops: float) -> None:
        if self.dev.peak_flops <= 0:
            why = "no peak FLOP/s is known for this device"
        else:
            why = (f"this process computes {achieved_flops / 1e12:.3g} TFLOP/s, above the "
                   f"{self.dev.peak_flops / 1e12:.3g} TFLOP/s peak ({self.dev.peak_source}), so that peak is wrong "
                   "(measured while another program was busy?)")
        tqdm.write(f"note: MFU is not shown: {why}. Set training.peak_flops=FLOP/s to the device's real peak.")

    def _warn(self, row: dict[str, float]) -> None:
        """The model's warnings about logged values, each at most once per 100 logging steps."""
        for key, message in self.model.metric_warnings(row).items():
            last = self._warned.get(key)
            if last is None or self.step - last >= 100 * self.t.log_interval:
                self._warned[key] = self.step
                tqdm.write(f"warning (step {self.step}): {message}")

    def _check_due(self, step: int, by_time: bool) -> bool:
        """Whether ``step`` is a check step: the host reads the device's NaN flag and the processes agree on
        stopping there (a log line, an evaluation, a probe, a checkpoint, or the last step by count)."""
        t, probe = self.t, self.data.probe
        return any(interval and step % interval == 0 for interval in (
            t.log_interval, t.eval_interval, t.save_interval, probe.interval if probe is not None else 0)) or (
            not by_time and step == t.max_steps)

    def _nan_message(self, step: int, loss_value: float, grad_norm: float) -> str:
        last = self.last_checkpoint or ckpt.latest_checkpoint(self.ckpt_root)
        where = (f"The last good checkpoint is {last}; resume from it with --resume"
                 if last else "No checkpoint was written before it")
        if step < 0:
            what, step = "another process's training loss is not finite", self.step + 1
        else:
            what = (f"training loss is {loss_value}" if not math.isfinite(loss_value)
                    else f"gradient norm is {grad_norm}")
        skipped = (f" (found at step {self.step + 1}: the updates of steps {step}-{self.step} were skipped on the "
                   "device)" if step <= self.step else "")
        return (f"{what} at step {step}: training stopped before applying "
                f"that update{skipped}. {where}. Try a lower training.lr, a longer training.warmup_steps, "
                f"training.grad_clip=1.0, or training.precision=fp32/bf16 instead of fp16.")


class _TrainerHost(ModelHost):
    """The ``ModelHost`` a Trainer hands ``TrainData.bind_model``."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def frozen(self, module: Any) -> Any:
        return self.trainer.keep_frozen(module)

    def gathered(self, *modules: Any) -> contextlib.AbstractContextManager:
        return self.trainer.gathered(*modules)

    def scoring(self, module: Any) -> contextlib.AbstractContextManager:
        return self.trainer.scoring(module)


class _Objective(torch.nn.Module):
    """``forward(batch)`` is the kind's ``loss(model, batch)``: the module the loop runs and DDP wraps."""

    def __init__(self, model: torch.nn.Module, loss: Callable[[Any, dict[str, Any]], tuple[torch.Tensor, dict]]):
        super().__init__()
        self.model = model
        self._loss = loss

    def forward(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        return self._loss(self.model, batch)


def _first_non_json(value: Any, where: str) -> str | None:
    """Where in ``value`` the first thing JSON cannot hold is (``state_dict()['gen']``), or None."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                return f"{where} key {key!r}"
            found = _first_non_json(item, f"{where}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(value, (list, tuple)):
        return next((f for i, item in enumerate(value) if (f := _first_non_json(item, f"{where}[{i}]"))), None)
    if value is None or isinstance(value, (str, int, float, bool)):
        return None
    return f"{where} (a {type(value).__name__})"


def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The batch's tensors on ``device``. To a GPU they go from pinned memory without the host waiting:
    with no host read between check steps the loop runs ahead of the GPU, so the next batch is read
    and its copy queued while the GPU still computes this step (prefetching without a thread)."""
    if device.type != "cuda":
        return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}
    return {k: (v.pin_memory().to(device, non_blocking=True) if torch.is_tensor(v) and v.device.type == "cpu"
                else v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}


def _reduce_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


def weighted_means(sums: dict[str, Any], weight: float, info: DistInfo, device: torch.device) -> dict[str, float]:
    """Means over all processes of an evaluation's weighted sums (``sums``: metric -> sum of value x weight,
    floats or device tensors; ``weight``: the sum of the weights); {} when no process had any weight. A
    process with nothing to evaluate (a held-out set smaller than the processes) has no sums: the processes
    first agree on the metrics' names, so every one reduces the same tensor."""
    keys = sorted(sums)
    if info.enabled:
        named: list[Any] = [None] * info.world_size
        dist.all_gather_object(named, keys)
        keys = sorted(set().union(*named))
    dtype = _reduce_dtype(device)
    totals = torch.stack([torch.as_tensor(sums.get(k, 0.0), dtype=dtype).to(device) for k in keys]
                         + [torch.tensor(weight, dtype=dtype, device=device)])
    if info.enabled:
        dist.all_reduce(totals)
    *values, total = totals.tolist()
    if total <= 0:
        return {}
    return {k: v / total for k, v in zip(keys, values, strict=True)}


def _mean_across_ranks(value: float, info: DistInfo, device: torch.device) -> float:
    if not info.enabled:
        return value
    t = torch.tensor([value], dtype=_reduce_dtype(device), device=device)
    dist.all_reduce(t)
    return float(t.item() / info.world_size)


__all__ = ["Trainer", "TrainResult"]
