"""The small interface every model family implements, and its on-disk format.

A model is an ``nn.Module`` built from a config dataclass. In training it takes a batch dict and
returns ``(loss, metrics)``; ``metrics`` is a flat dict of scalars (floats or 0-d tensors) that the
loop logs as they are. It saves itself as a directory with ``config.yaml`` + ``model.safetensors``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any, ClassVar

import torch
import yaml
from safetensors.torch import load_file, save_file
from torch import nn

from lmforge.checkpoint import (CHECKSUMS_FILE, REPLACED, SHARDS_FILE, WEIGHTS_FILE, first_non_finite, is_sharded, non_finite_message,
                                read_sharded_weights, refresh_checksums, resolve_model_dir, settled_checksum_mismatch)
from lmforge.errors import LMForgeError
from lmforge.files import atomic_file
from lmforge.recipes import model_class
from lmforge.typed import dataclass_from_dict

CONFIG_FILE = "config.yaml"


class _NoFillsOnMeta(torch.overrides.TorchFunctionMode):
    """Skips the random (and constant) fills of ``torch.nn.init`` and ``Tensor.normal_`` ... on meta tensors."""

    FILLS = frozenset({nn.init.normal_, nn.init.trunc_normal_, nn.init.uniform_, nn.init.constant_, nn.init.zeros_,
                       nn.init.ones_, nn.init.xavier_normal_, nn.init.xavier_uniform_, nn.init.kaiming_normal_,
                       nn.init.kaiming_uniform_, nn.init.orthogonal_, torch.Tensor.normal_, torch.Tensor.uniform_,
                       torch.Tensor.zero_, torch.Tensor.fill_})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FILLS:
            target = args[0] if args else kwargs.get("tensor")  # nn.init passes it by keyword
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta_device():
    """Build modules on PyTorch's meta device: shapes without memory, for a model whose weights are loaded
    (or only counted) next. Their initialisers are skipped: a meta tensor holds no values, and filling one runs
    a Python decomposition whose first call imports torch._dynamo, ~2 s of CPU every verb that loads a model
    paid before it did any work."""
    with torch.device("meta"), _NoFillsOnMeta():
        yield


class LMForgeModel(nn.Module):
    """Base class: subclasses set ``family`` and ``config_class`` and implement ``forward``."""

    family: ClassVar[str] = ""
    config_class: ClassVar[type] = object
    # Metric-name prefixes the loop logs as they are (`mhc/amax_pre`); other metrics go under train/.
    metric_sections: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        # Whether training forwards compute the model's diagnostic metrics (its ``metric_sections``,
        # e.g. mHC's Amax gains): the loop sets it for the steps whose metrics are logged only.
        self.step_metrics = True

    # ---- training interface -------------------------------------------------------------
    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        raise NotImplementedError  # every family overrides this

    def param_groups(self, weight_decay: float, lr: float) -> list[dict[str, Any]]:
        """Optimizer groups. Default: decay matrices (dim >= 2), not biases/norms/scalars.

        A group may carry its own ``lr`` (the loop scales every group's lr by the schedule multiplier,
        keeping each group's base lr); a kind with another optimizer names it in its RecipeSpec.
        """
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            (decay if self.decays(name, p) else no_decay).append(p)
        return [
            {"params": decay, "weight_decay": weight_decay, "lr": lr, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "lr": lr, "name": "no_decay"},
        ]

    def decays(self, name: str, param: torch.Tensor) -> bool:
        """Whether weight decay applies to this parameter (default: matrices do, vectors do not)."""
        return param.dim() >= 2

    def logged_metrics(self, values: dict[str, float]) -> dict[str, float]:
        """The training metrics of a logged step, read from the device: the model's last word on them (e.g.
        dropping a ratio over no rows), on the host, so that its steps never read the device to decide."""
        return values

    # ---- hooks for families with extra training state (e.g. an EMA of the weights) -----------
    def on_optimizer_step(self) -> None:
        """Called by the loop after every optimizer update."""

    def before_compile(self, device: torch.device) -> None:
        """Called before the loop compiles the model: build, eagerly, what the model caches on first use (a
        table kept outside its buffers), so that the compiled step neither stores it, which would make it a
        graph output (overwritten by the next replay under CUDA graphs), nor recompiles once it exists."""

    def averaged_weights(self) -> contextlib.AbstractContextManager:
        """Context in which the model holds the weights to evaluate and save (e.g. an EMA)."""
        return contextlib.nullcontext()

    def training_state(self) -> dict[str, Any]:
        """Extra state a resume needs beyond model.safetensors; saved in optimizer.safetensors
        (tensors, numpy arrays and plain values in dicts/lists/tuples: ``lmforge.safe_state``)."""
        return {}

    def load_training_state(self, state: dict[str, Any]) -> None:
        """Restore what ``training_state`` returned (after the checkpoint's weights are loaded)."""

    def metric_warnings(self, row: dict[str, float]) -> dict[str, str]:
        """Warnings about a logged row of training metrics (e.g. an unhealthy stability metric), by
        the metric's name."""
        return {}

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token, for MFU. Default: 6 x parameters."""
        return 6.0 * self.num_parameters()

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Recompute activations in backward to save memory. Families override where supported."""
        if enabled:
            raise LMForgeError(f"model family {self.family!r} does not support activation checkpointing")

    def repeated_blocks(self) -> list[nn.Module]:
        """The model's stack of same-shaped blocks, in the order they run. ``training.parallel: fsdp``
        shards each one as a unit (its weights gathered just before it runs, freed after), and the
        rest of the model with the root. Empty: the family cannot be sharded."""
        return []

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        seen: set[int] = set()
        total = 0
        for name, p in self.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if exclude_embeddings and "embed" in name:
                continue
            total += p.numel()
        return total

    # ---- on-disk format -----------------------------------------------------------------
    def save_pretrained(self, directory: str | os.PathLike, state_dict: dict[str, torch.Tensor] | None = None,
                        weights: bool = True) -> Path:
        """Write ``config.yaml`` and ``model.safetensors`` into ``directory`` (created if needed);
        ``state_dict``: the weights to write instead of the model's own (gathered from FSDP's shards);
        ``weights=False``: the config only (a sharded checkpoint, whose shards hold the weights)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = {"family": self.family, **dataclasses.asdict(self.config)}
        # Each file is written beside its place and renamed there: a model loaded from this directory reads its
        # weights from a memory map of the old file, which must not change under it.
        with atomic_file(directory / CONFIG_FILE) as tmp, open(tmp, "w") as f:
            yaml.safe_dump(config, f, sort_keys=False)
        if not weights:
            return directory
        # safetensors refuses tensors that share storage (tied weights): store each once. Dedupe
        # before .cpu(), which copies each tensor of a GPU model separately and hides the sharing.
        state = {k: v.detach().contiguous().cpu()
                 for k, v in _dedupe_shared(self.state_dict() if state_dict is None else state_dict).items()}
        with atomic_file(directory / WEIGHTS_FILE) as tmp:
            save_file(state, str(tmp), metadata={"format": "pt"})
        refresh_checksums(directory, [WEIGHTS_FILE])  # saved over a checkpoint: its checksums follow
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, map_location: str | torch.device = "cpu"):
        """Load a model saved by ``save_pretrained`` (or a run directory's ``best``, else its latest checkpoint);
        works on the base class for any family."""
        directory = resolve_model_dir(directory)
        weights_path = directory / WEIGHTS_FILE
        klass, config = read_model_config(directory)
        if cls is not LMForgeModel and not issubclass(klass, cls):
            raise LMForgeError(f"{directory} holds a {klass.family!r} model, not a {cls.family!r} model")
        damage = settled_checksum_mismatch(directory, weights_only=True)  # safetensors itself checks no bytes
        if damage == REPLACED:  # a run replaced it twice meanwhile (a new best/ each time)
            raise LMForgeError(f"{directory} was replaced while it was read, twice: load it again")
        if damage:
            raise LMForgeError(f"{damage}; the model is damaged: use another checkpoint (runs/NAME/checkpoints/; "
                               "`lmforge checkpoint verify runs/NAME` lists the sound ones) or retrain (weights "
                               "changed on purpose: save them with `save_pretrained`, which rewrites "
                               f"{CHECKSUMS_FILE})")
        # Built on the meta device and given the file's tensors (assign=True): no random initialisation and
        # no second copy of the weights (a 1.3B model loaded in ~30 s and twice its size before).
        with on_meta_device():
            model = klass(config)
        try:
            state = _read_weights(directory, map_location)
        except LMForgeError:
            raise
        except Exception as e:  # safetensors raises several types for truncated/corrupt files
            raise LMForgeError(
                f"cannot read {weights_path}: {e}. The file is corrupt or truncated; "
                "use an earlier checkpoint (runs/NAME/checkpoints/) or retrain."
            ) from e
        expected = model.state_dict()
        state = {k: v.to(expected[k].dtype) if k in expected else v for k, v in state.items()}
        try:
            missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        except RuntimeError as e:  # tensors whose shapes differ from the config's
            raise LMForgeError(
                f"{weights_path} does not match its {CONFIG_FILE}: {e}. The checkpoint is corrupt or was edited."
            ) from e
        missing = [k for k in missing if not model.is_tied_key(k)]
        if missing or unexpected:
            raise LMForgeError(
                f"{weights_path} does not match its {CONFIG_FILE}: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}. The checkpoint is corrupt or was edited."
            )
        model.tie_weights()
        rebuild_unsaved_buffers(model, map_location)
        return model.to(map_location)

    # Whether save_pretrained writes one model directory (a sharded checkpoint's shards can stand in for it).
    one_weights_file: ClassVar[bool] = True

    def checkpoint_state(self, directory: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The weights this model's ``save_pretrained`` wrote into ``directory`` (a training checkpoint),
        keyed as ``state_dict()`` (tied copies stored once). Families that save more than one file
        override this, ``save_pretrained`` and ``load_checkpoint_weights``."""
        weights_path = Path(directory) / WEIGHTS_FILE
        try:
            return _read_weights(Path(directory), device)
        except LMForgeError:
            raise
        except Exception as e:
            # a model inside a checkpoint (ppo's value/) names the run's checkpoints, not its step
            earlier = next((p for p in Path(directory).parents if p.name == "checkpoints"), Path(directory).parent)
            raise LMForgeError(f"cannot read {weights_path}: {e}. The checkpoint is corrupt; "
                               f"resume from an earlier one in {earlier}") from e

    def load_checkpoint_weights(self, directory: Path, device: torch.device | str) -> None:
        """Resume: load the weights this model's ``save_pretrained`` wrote into ``directory``."""
        weights = self.checkpoint_state(directory, device)
        try:
            missing, unexpected = self.load_state_dict(weights, strict=False)
        except RuntimeError as e:  # shapes differ
            raise LMForgeError(f"{directory} does not fit this model ({e}): was the model config changed since "
                               "it was written?") from e
        missing = [k for k in missing if not self.is_tied_key(k)]
        if missing or unexpected:
            raise LMForgeError(f"{directory} does not fit this model (missing {missing[:3]}, unexpected "
                               f"{unexpected[:3]}): was the model config changed since it was written?")
        self.tie_weights()

    def load_initial_weights(self, source: LMForgeModel, where: str) -> None:
        """``training.init_from``: take the weights of a trained model (``source``, read from ``where``).
        Default: the same family and shapes, every tensor. A family built on another one's weights (a
        reward model on a chat model's trunk) overrides this."""
        theirs, ours = source.state_dict(), self.state_dict()
        mismatch = [k for k in ours if k not in theirs or theirs[k].shape != ours[k].shape]
        extra = [k for k in theirs if k not in ours]
        if type(source) is not type(self) or mismatch or extra:
            first = (mismatch or extra or ["(model family)"])[0]
            raise LMForgeError(f"training.init_from={where} holds a different architecture than this run's model "
                               f"(first difference: {first}); use the model settings it was trained with (see "
                               f"its {CONFIG_FILE})")
        self.load_state_dict(theirs)

    # Families with tied weights override these two.
    def is_tied_key(self, key: str) -> bool:
        return False

    def tie_weights(self) -> None:
        return None


def _read_weights(directory: Path, device: str | torch.device) -> dict[str, torch.Tensor]:
    """A model directory's weights: ``model.safetensors``, or the full tensors put together from a sharded
    checkpoint's shards (on this process; no process group needed)."""
    if is_sharded(directory):
        state = {k: v.to(device) for k, v in read_sharded_weights(directory).items()}
    else:
        state = load_file(str(directory / WEIGHTS_FILE), device=str(device))
    # Non-finite weights are damage: a model made of them would serve, export or resume into NaN without saying why.
    found = first_non_finite(state.items())
    if found is not None:
        raise LMForgeError(non_finite_message(directory, found, "weights"))
    return state


def rebuild_unsaved_buffers(model: nn.Module, device: str | torch.device) -> None:
    """The buffers a model does not save (``persistent=False``: tables computed from its config) hold nothing
    after a load into a model built on the meta device (``from_pretrained``, ``build_empty_model``): each module
    that has them rebuilds them with its ``reset_buffers(device)``."""
    for name, module in model.named_modules():
        if not module._non_persistent_buffers_set:
            continue
        if not hasattr(module, "reset_buffers"):
            # A fresh run builds the model on its device, so a family without it trains and checkpoints, and
            # only what loads one (eval, generate, --resume) finds out: say whose it is and what to write.
            family = getattr(model, "family", None)
            whose = f"model family {family!r} ({type(model).__name__})" if family else type(model).__name__
            buffers = ", ".join(sorted(module._non_persistent_buffers_set))
            raise LMForgeError(f"{whose} cannot be loaded: its module {type(module).__name__} "
                               f"({name or 'the model itself'}) has buffers it does not save ({buffers}; "
                               "persistent=False), and a loaded model is built on the meta device, where they hold "
                               f"nothing. Give {type(module).__name__} a reset_buffers(self, device) method that "
                               "computes them on `device` from the config, or register them persistent "
                               "(see docs/adding-a-recipe.md)")
        module.reset_buffers(device)


def _dedupe_shared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, seen = {}, set()
    for k, v in state.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if key in seen:
            continue
        seen.add(key)
        out[k] = v
    return out


def read_model_config(directory: str | os.PathLike) -> tuple[type, Any]:
    """The model class and config dataclass a model directory (``save_pretrained``) holds, from its
    ``config.yaml``, without loading weights."""
    directory = Path(directory)
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_path.is_file() or not (weights_path.is_file() or is_sharded(directory)):
        raise LMForgeError(
            f"{directory} is not a model directory: it needs {CONFIG_FILE} and {WEIGHTS_FILE} (or a sharded "
            f"checkpoint's {SHARDS_FILE}). Pass a checkpoint directory (runs/NAME/checkpoints/step-NNNNNN) or a "
            "run directory."
        )
    try:
        raw = yaml.safe_load(config_path.read_text()) or {}
    except yaml.YAMLError as e:
        raise LMForgeError(f"{config_path} is not valid YAML ({e}); the checkpoint is corrupt.") from e
    if not isinstance(raw, dict):
        raise LMForgeError(f"{config_path} must hold a mapping of model settings; the checkpoint is corrupt.")
    family = raw.pop("family", None)
    klass = model_class(family)
    try:
        return klass, dataclass_from_dict(klass.config_class, raw)
    except LMForgeError as e:
        raise LMForgeError(f"{config_path} does not describe a valid {klass.family} model ({e}): the checkpoint was "
                           "edited, is corrupt or was written by another lmforge version; use an earlier checkpoint "
                           "(runs/NAME/checkpoints/), the lmforge version that wrote it, or retrain") from e
