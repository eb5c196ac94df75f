"""Typed run configuration: dataclasses, YAML recipes and dotted command-line overrides.

A run config is built in three layers: the dataclass defaults, a recipe (``configs/NAME.yaml`` or
any YAML path), then ``key.sub=value`` overrides. Unknown or mistyped keys are errors that name the
closest valid key. ``model.family`` picks the model's config dataclass (see ``lmforge.models``).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lmforge.errors import LMForgeError

RECIPE_DIR = Path(__file__).parent / "configs"


@dataclass
class DataConfig:
    path: str = ""  # a directory written by `lmforge data prepare` (meta.json + shards)
    train_path: str = ""  # raw text instead (JSONL {"text": ...}, text, parquet, a directory): prepared
    #                       into RUN_DIR/data on first use, with data.tokenizer or one trained on it
    seq_len: int = 256  # tokens per training window
    tokenizer: str = ""  # tokenizer.json, or a directory holding one (any HF tokenizer); "" = the data's
    text_field: str = "text"  # the field of JSONL / parquet records that holds the text
    include: list[str] = field(default_factory=lambda: ["**/*.go"])  # data.train_path directories: files read
    val_fraction: float = 0.01  # data.train_path: documents held out for evaluation


@dataclass
class TrainingConfig:
    max_steps: int = 1000  # optimizer steps
    epochs: float = 0.0  # if > 0: max_steps = epochs x examples per epoch / global batch (HRM's `epochs`)
    global_batch_size: int = 0  # if > 0: micro_batch_size = this / (processes x grad_accum_steps)
    max_time_minutes: float = 0.0  # stop (and checkpoint) after this wall time; 0 = no limit
    schedule_over: str = "steps"  # steps | time: lay the lr schedule over max_steps, or over max_time_minutes
    #                               of training time (the run then ends when that time is spent)
    micro_batch_size: int = 8  # sequences per forward pass, per process
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    lr: float = 3e-4
    schedule: str = "cosine"  # cosine | constant | wsd (warmup-stable-decay)
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # floor of cosine / end of wsd decay, as a fraction of lr
    decay_ratio: float = 0.2  # wsd: share of max_steps spent decaying at the end
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm; 0 = off
    precision: str = "auto"  # auto | fp32 | bf16 | fp16 (fp16 uses a grad scaler)
    compile: bool = False  # torch.compile the model (slow start; helps on GPUs)
    activation_checkpointing: bool = False
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    eval_interval: int = 200  # steps between evaluations; 0 = only at the end
    eval_interval_epochs: float = 0.0  # if > 0: evaluate every this many epochs (HRM's `eval_interval`)
    eval_batches: int = 20  # micro-batches per evaluation; 0 = the whole validation split
    save_interval: int = 500  # steps between checkpoints; 0 = only at the end
    keep_last: int = 3  # checkpoints kept besides `best`
    log_interval: int = 10  # steps between metric log lines
    peak_flops: float = 0.0  # device peak FLOP/s for MFU; 0 = look up / measure
    init_from: str = ""  # start from these weights (a checkpoint or run dir), with a fresh optimizer: fine-tuning


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    wandb_project: str = ""  # set to log to Weights & Biases (WANDB_MODE=offline works)
    wandb_run_name: str = ""
    wandb_entity: str = ""  # team or user; "" = your wandb default
    progress_bar: bool = True


@dataclass
class RunConfig:
    name: str = "run"
    out_dir: str = "runs"  # the run directory is out_dir/name
    seed: int = 1337
    resume_from_checkpoint: str = ""  # the RLM-mHC guide's `+resume_from_checkpoint=PATH` (= --resume PATH)
    model: Any = None  # a model family's config dataclass, chosen by model.family
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) / self.name

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.model is not None:
            family = next(
                (cls.family for cls in _model_classes() if isinstance(self.model, cls.config_class)), None
            )
            out["model"] = {"family": family, **dataclasses.asdict(self.model)}
        return out

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        tmp.replace(path)


def _model_classes():
    from lmforge.models import _registry_items

    return [cls for _, cls in _registry_items()]


# ---------------------------------------------------------------------------------------------
# Recipes and overrides
# ---------------------------------------------------------------------------------------------
def list_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def read_recipe(name_or_path: str) -> dict[str, Any]:
    """Read a recipe by name (``go_coder_tiny``) or by path to a YAML file."""
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        candidate = RECIPE_DIR / f"{name_or_path}.yaml"
        if not candidate.is_file():
            if path.suffix in (".yaml", ".yml"):
                raise LMForgeError(f"recipe file {path} does not exist")
            close = difflib.get_close_matches(name_or_path, list_recipes(), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise LMForgeError(
                f"unknown recipe {name_or_path!r}.{hint} Known recipes: {', '.join(list_recipes())}; "
                "or pass the path of a YAML file."
            )
        path = candidate
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise LMForgeError(f"{path} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise LMForgeError(f"{path} must hold a mapping of config sections, not {type(data).__name__}")
    return data


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["training.lr=1e-3", "model.n_layer=4"]`` -> nested dict. Values are parsed as YAML."""
    nested: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise LMForgeError(
                f"override {item!r} has no '='; write overrides as key=value, e.g. training.max_steps=200"
            )
        key, raw = item.split("=", 1)
        key = key.strip().lstrip("+")
        if not key:
            raise LMForgeError(f"override {item!r} has an empty key")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        if isinstance(value, str) and _looks_like_float(value):
            value = float(value)  # YAML 1.1 reads "5e-4" as a string
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise LMForgeError(f"override {item!r} conflicts with an earlier override of {part!r}")
        node[parts[-1]] = value
    return nested


def _looks_like_float(s: str) -> bool:
    try:
        float(s)
        return any(c in s.lower() for c in "e.") and not s.lower().startswith(("n", "i", "+i", "-i"))
    except ValueError:
        return False


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def load_config(recipe: str | None = None, overrides: list[str] | None = None,
                values: dict[str, Any] | None = None) -> RunConfig:
    """Defaults <- recipe <- ``values`` <- ``overrides``; returns a validated ``RunConfig``."""
    # HRM-style names are resolved per layer, so a later layer's alias overrides an earlier key.
    merged: dict[str, Any] = apply_aliases(read_recipe(recipe)) if recipe else {}
    for layer in ([values] if values else []) + ([parse_overrides(overrides)] if overrides else []):
        layer = apply_aliases(layer)
        merged = deep_merge(_drop_superseded(merged, layer), layer)
    return config_from_dict(merged)


# The top-level names of HRM's `pretrain.py` (seed 003): `lmforge train hrm_sudoku data_path=... epochs=500
# eval_interval=100 global_batch_size=4 lr=1e-4 arch.hidden_size=32 ...` works as written. Each maps
# to one lmforge key; `arch.*` is `model.*`. (HRM counts `eval_interval` in epochs.)
HRM_ALIASES = {
    "data_path": "data.path",
    "epochs": "training.epochs",
    "eval_interval": "training.eval_interval_epochs",
    "global_batch_size": "training.global_batch_size",
    "lr": "training.lr",
    "lr_warmup_steps": "training.warmup_steps",
    "lr_min_ratio": "training.min_lr_ratio",
    "beta1": "training.beta1",
    "beta2": "training.beta2",
    "weight_decay": "training.weight_decay",
    "puzzle_emb_lr": "model.puzzle_emb_lr",
    "puzzle_emb_weight_decay": "model.puzzle_emb_weight_decay",
    "project_name": "logging.wandb_project",
    "run_name": "name",
    "arch": "model",
}


# The RLM-mHC guide's (seed 002) keys, Hydra-style: `lmforge train rlm_mhc_tiny training.optimizer.lr=5e-5
# training.batch_size=4 data.train_path=x.jsonl` works as written. Its model sizes (`model.hidden_dim`
# ...) are mapped by the gpt family's config (lmforge.models.gpt.SEED_NAMES).
SEED_ALIASES = {
    "model.gradient_checkpointing": "training.activation_checkpointing",
    "training.gradient_checkpointing": "training.activation_checkpointing",
    "training.optimizer.lr": "training.lr",
    "training.optimizer.weight_decay": "training.weight_decay",
    "training.optimizer.eps": "training.eps",
    "training.scheduler.type": "training.schedule",
    "training.scheduler.warmup_steps": "training.warmup_steps",
    "training.scheduler.min_lr_ratio": "training.min_lr_ratio",
    "training.batch_size": "training.micro_batch_size",
    "training.gradient_accumulation_steps": "training.grad_accum_steps",
    "training.mixed_precision": "training.precision",
    "training.save_steps": "training.save_interval",
    "training.logging_steps": "training.log_interval",
    "training.eval_steps": "training.eval_interval",
    "training.max_grad_norm": "training.grad_clip",
    "training.wandb.project": "logging.wandb_project",
    "training.wandb.entity": "logging.wandb_entity",
    "training.wandb.name": "logging.wandb_run_name",
    "data.max_length": "data.seq_len",
}
OPTIMIZER_TYPES = ("adamw",)


def _seed_aliases(out: dict[str, Any]) -> dict[str, Any]:
    """Move the guide's dotted keys to ours; `optimizer.betas` splits into beta1/beta2."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in out.items()}  # copies: keys are popped
    training = out.get("training") if isinstance(out.get("training"), dict) else {}
    for sub in ("optimizer", "scheduler", "wandb"):
        node = training.get(sub)
        if node is not None and not isinstance(node, dict):
            raise LMForgeError(f"training.{sub} must be a mapping (e.g. training.{sub}.lr=1e-4), got {node!r}")
        if node is not None:
            training[sub] = dict(node)
    optimizer = training.get("optimizer") or {}
    if "type" in optimizer:
        kind = str(optimizer.pop("type")).lower()
        if kind not in OPTIMIZER_TYPES:
            raise LMForgeError(f"training.optimizer.type={kind!r} is not available; use adamw (families with "
                               "their own optimizer choose it themselves)")
    if "betas" in optimizer:
        betas = optimizer.pop("betas")
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise LMForgeError(f"training.optimizer.betas must be a pair like [0.9, 0.95], got {betas!r}")
        _set_dotted(out, "training.beta1", betas[0], "training.optimizer.betas")
        _set_dotted(out, "training.beta2", betas[1], "training.optimizer.betas")
    for alias, target in SEED_ALIASES.items():
        section, *rest = alias.split(".")
        node = out.get(section)
        for part in rest[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and rest[-1] in node:
            _set_dotted(out, target, node.pop(rest[-1]), alias)
    training = out.get("training") if isinstance(out.get("training"), dict) else {}
    for sub in ("optimizer", "scheduler", "wandb"):
        leftover = training.pop(sub, None)
        if leftover:  # what no alias took: a typo
            bad = sorted(leftover)[0]
            valid = [a.split(".")[-1] for a in SEED_ALIASES if a.startswith(f"training.{sub}.")]
            valid += ["type", "betas"] if sub == "optimizer" else []
            close = difflib.get_close_matches(bad, valid, n=1, cutoff=0.5)
            hint = f" Did you mean 'training.{sub}.{close[0]}'?" if close else ""
            raise LMForgeError(f"unknown config key 'training.{sub}.{bad}'.{hint} Valid keys here: "
                               + ", ".join(f"training.{sub}.{v}" for v in sorted(valid)))
    return out


def _set_dotted(out: dict[str, Any], target: str, value: Any, alias: str) -> None:
    section, key = target.split(".")
    sec = out.setdefault(section, {})
    if not isinstance(sec, dict):
        raise LMForgeError(f"config section {section!r} must be a mapping, got {sec!r}")
    if key in sec and sec[key] != value:
        raise LMForgeError(f"'{alias}' and '{target}' are both given with different values; keep one")
    sec[key] = value


def apply_aliases(values: dict[str, Any]) -> dict[str, Any]:
    """Rewrite HRM-style top-level keys and the RLM-mHC guide's dotted keys into lmforge's sections
    (giving both spellings of one key with different values is an error)."""
    values = _seed_aliases(values)
    out = {k: v for k, v in values.items() if k not in HRM_ALIASES}
    for alias, target in HRM_ALIASES.items():
        if alias not in values:
            continue
        value = values[alias]
        if target == "model":
            if not isinstance(value, dict):
                raise LMForgeError(f"'arch' must be a mapping of model keys (arch.hidden_size=...), got {value!r}")
            clash = set(value) & set(out.get("model") or {})
            if clash:
                raise LMForgeError(f"arch.{sorted(clash)[0]} and model.{sorted(clash)[0]} are both given; keep one")
            out["model"] = {**(out.get("model") or {}), **value}
            continue
        if "." not in target:
            out[target] = value
            continue
        out[target.split(".")[0]] = dict(out.get(target.split(".")[0]) or {})  # a copy: values is not changed
        _set_dotted(out, target, value, alias)
    return out


# Pairs of keys where one sets or replaces the other: a later layer that gives the first (e.g. the
# user's training.max_steps) switches off the second where an earlier layer (the recipe) set it.
DROP = object()  # in SUPERSEDES: remove the earlier key instead of resetting it
_SEED_MODEL_SYNONYMS = {"hidden_dim": "n_embd", "num_layers": "n_layer", "num_heads": "n_head",
                        "ffn_dim": "n_inner", "max_seq_len": "n_positions", "num_kv_heads": "n_kv_head"}
SUPERSEDES: dict[str, dict[str, list[tuple[str, Any]]]] = {
    "training": {"max_steps": [("epochs", 0)], "eval_interval": [("eval_interval_epochs", 0)],
                 "micro_batch_size": [("global_batch_size", 0)]},
    "data": {"train_path": [("path", "")], "path": [("train_path", "")]},
    # The guide's model names and ours are synonyms; a new width or head count makes an earlier head_dim stale.
    "model": {
        **{seed: [(ours, DROP)] for seed, ours in _SEED_MODEL_SYNONYMS.items()},
        **{ours: [(seed, DROP)] for seed, ours in _SEED_MODEL_SYNONYMS.items()},
    },
}
for _width_key in ("hidden_dim", "num_heads", "n_embd", "n_head"):
    SUPERSEDES["model"][_width_key].append(("head_dim", DROP))


def _drop_superseded(merged: dict[str, Any], layer: dict[str, Any]) -> dict[str, Any]:
    out = dict(merged)
    for section, rules in SUPERSEDES.items():
        given, earlier = layer.get(section), merged.get(section)
        if not isinstance(given, dict) or not isinstance(earlier, dict):
            continue
        earlier = dict(earlier)
        for plain, others in rules.items():
            for other, off in others:
                if plain in given and other not in given and other in earlier:
                    if off is DROP:
                        del earlier[other]
                    else:
                        earlier[other] = off
        out[section] = earlier
    return out


def config_from_dict(values: dict[str, Any]) -> RunConfig:
    from lmforge.models import config_class

    values = apply_aliases(dict(values))
    model_values = values.pop("model", None) or {}
    if not isinstance(model_values, dict):
        raise LMForgeError(f"config section 'model' must be a mapping of model keys, got {model_values!r}")
    model_values = dict(model_values)
    family = model_values.pop("family", "gpt")
    cfg = dataclass_from_dict(RunConfig, values, prefix="")
    cfg.model = dataclass_from_dict(config_class(family), model_values, prefix="model")
    validate_run_config(cfg)
    return cfg


def validate_run_config(cfg: RunConfig) -> None:
    t = cfg.training
    checks = [
        (t.max_steps > 0, "training.max_steps must be > 0"),
        (t.micro_batch_size > 0, "training.micro_batch_size must be > 0"),
        (t.grad_accum_steps > 0, "training.grad_accum_steps must be > 0"),
        (t.lr > 0, "training.lr must be > 0"),
        (t.warmup_steps >= 0, "training.warmup_steps must be >= 0"),
        (0.0 <= t.min_lr_ratio <= 1.0, "training.min_lr_ratio must be in [0, 1]"),
        (0.0 < t.decay_ratio <= 1.0, "training.decay_ratio must be in (0, 1]"),
        (t.schedule in ("cosine", "constant", "wsd"), "training.schedule must be cosine, constant or wsd"),
        (t.precision in ("auto", "fp32", "bf16", "fp16"), "training.precision must be auto, fp32, bf16 or fp16"),
        (t.keep_last >= 1, "training.keep_last must be >= 1"),
        (0.0 <= t.beta1 < 1.0 and 0.0 <= t.beta2 < 1.0, "training.beta1 and training.beta2 must be in [0, 1)"),
        (t.eps > 0, "training.eps must be > 0"),
        (t.weight_decay >= 0, "training.weight_decay must be >= 0"),
        (t.grad_clip >= 0, "training.grad_clip must be >= 0 (0 = off)"),
        (t.eval_batches >= 0, "training.eval_batches must be >= 0 (0 = the whole validation split)"),
        (t.epochs >= 0 and t.eval_interval_epochs >= 0, "training.epochs and eval_interval_epochs must be >= 0"),
        (t.global_batch_size >= 0, "training.global_batch_size must be >= 0 (0 = micro_batch_size x processes)"),
        (t.max_time_minutes >= 0, "training.max_time_minutes must be >= 0 (0 = no limit)"),
        (t.schedule_over in ("steps", "time"), "training.schedule_over must be steps or time"),
        (t.schedule_over == "steps" or t.max_time_minutes > 0,
         "training.schedule_over=time lays the schedule over the time budget: set training.max_time_minutes too"),
        (t.log_interval >= 1, "training.log_interval must be >= 1"),
        (t.eval_interval >= 0 and t.save_interval >= 0, "training.eval_interval/save_interval must be >= 0"),
        (cfg.data.seq_len > 0, "data.seq_len must be > 0"),
        (0.0 < cfg.data.val_fraction < 1.0, "data.val_fraction must be in (0, 1), e.g. 0.01"),
        (not (cfg.data.path and cfg.data.train_path),
         "data.path and data.train_path are both set: use data.path for data made by `lmforge data prepare`, "
         "or data.train_path for raw text/JSONL that training prepares itself, not both"),
    ]
    for ok, message in checks:
        if not ok:
            raise LMForgeError(message)


# ---------------------------------------------------------------------------------------------
# Dataclass <- dict with type checks and "did you mean" for unknown keys
# ---------------------------------------------------------------------------------------------
def dataclass_from_dict(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise LMForgeError(f"config section {prefix or '<root>'!r} must be a mapping, got {values!r}")
    resolve = getattr(cls, "resolve_dict", None)
    if resolve is not None:
        values = resolve(dict(values))
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if key not in fields:
            raise LMForgeError(_unknown_key_message(dotted, key, cls, prefix))
        hint = hints[key]
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            kwargs[key] = dataclass_from_dict(hint, value, prefix=dotted)
        elif key == "model" and cls is RunConfig:
            continue  # built separately by family
        else:
            kwargs[key] = _coerce(value, hint, dotted)
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise LMForgeError(f"invalid config section {prefix or '<root>'!r}: {e}") from e
    return obj


def _unknown_key_message(dotted: str, key: str, cls: type, prefix: str) -> str:
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
    where = f"{prefix}." if prefix else ""
    hint = f" Did you mean '{where}{close[0]}'?" if close else ""
    return f"unknown config key '{dotted}'.{hint} Valid keys here: {', '.join(where + n for n in names)}"


def _coerce(value: Any, hint: Any, dotted: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, dotted)
            except LMForgeError as e:
                errors.append(str(e))
        raise LMForgeError(errors[0] if errors else f"bad value for {dotted}: {value!r}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise LMForgeError(f"config key '{dotted}' expects a list, got {value!r}")
        inner = args[0] if args else Any
        items = [_coerce(v, inner, f"{dotted}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise LMForgeError(f"config key '{dotted}' expects a mapping, got {value!r}")
        return dict(value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise LMForgeError(f"config key '{dotted}' expects true or false, got {value!r}")
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise LMForgeError(f"config key '{dotted}' expects an integer, got {value!r}")
        return int(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise LMForgeError(f"config key '{dotted}' expects a number, got {value!r}")
        return float(value)
    if hint is str:
        if isinstance(value, (dict, list)):
            raise LMForgeError(f"config key '{dotted}' expects a string, got {value!r}")
        return "" if value is None else str(value)
    return value
