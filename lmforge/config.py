"""Typed run configuration: dataclasses, YAML recipes and dotted command-line overrides.

A run config is built in three layers: the dataclass defaults, a recipe (``configs/NAME.yaml`` or
any YAML path), then ``key.sub=value`` overrides. Unknown or mistyped keys are errors that name the
closest valid key. ``model.family`` picks the model's config dataclass; ``kind`` (default: the kind
that owns the family) picks the training kind, whose settings dataclass is the ``recipe`` section and
whose aliases translate a guide's key names (``lmforge.recipes``).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lmforge.errors import LMForgeError
from lmforge.recipes import RecipeSpec, default_kind, family_of_config, get_kind, kind_of_family, kinds, model_class
from lmforge.typed import dataclass_from_dict, section_error, short_repr

RECIPE_DIR = Path(__file__).parent / "configs"


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
GRAPH_MODES = ("reduce-overhead", "max-autotune")  # the ones that replay CUDA graphs


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
    val_path: str = ""  # data.train_path: your own validation set instead (same kinds of input), all of it held
    #                     out; its copies of training documents are dropped and counted


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
    # How AdamW keeps its two moments: fp32 (8 bytes a weight) | 8bit (2 bytes: blocks of 8-bit floats,
    # stochastically rounded; the Trainer's optim="adamw_8bit"; see lmforge.train.optim)
    optimizer_states: str = "fp32"
    precision: str = "auto"  # auto | fp32 | bf16 | fp16 (fp16 uses a grad scaler)
    # torch.compile the model (slow start; helps on GPUs; per block under fsdp), and with optimizer_states=8bit
    # AdamW8bit's step too
    compile: bool = False
    # torch.compile's mode with compile=true: default | reduce-overhead (CUDA graphs: the step's kernels
    # replayed without a launch each; CUDA only, other devices compile as default) | max-autotune |
    # max-autotune-no-cudagraphs (Inductor tries kernel configurations: a much longer compile)
    compile_mode: str = "default"  # reduce-overhead / max-autotune: lm only, grad_accum_steps 1, ddp
    parallel: str = "ddp"  # ddp | fsdp | hsdp (under torchrun): replicate, or shard weights, gradients and optimizer
    #                        state across processes (hsdp: shard within a machine, replicate across machines)
    fsdp_offload: bool = False  # fsdp/hsdp: keep the shards (and the optimizer step) in CPU memory
    fsdp_checkpoint: str = "sharded"  # fsdp/hsdp: sharded (each process writes its shards; no process holds the
    #                                   whole state) | gathered (process 0 writes the ordinary files). ddp: ordinary
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
    kind: str = ""  # the training kind (lmforge.recipes); "" = the kind of model.family
    model: Any = None  # a model family's config dataclass, chosen by model.family
    recipe: Any = None  # the kind's own training settings (its RecipeSpec.settings dataclass), if it has any
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    built_separately = ("model", "recipe")  # their dataclasses depend on model.family and kind

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) / self.name

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.model is not None:
            out["model"] = {"family": family_of_config(self.model), **dataclasses.asdict(self.model)}
        if self.recipe is None:
            out.pop("recipe")
        return out

    @property
    def spec(self) -> RecipeSpec:
        """The training kind's spec."""
        return get_kind(self.kind)

    def save(self, path: str | Path) -> None:
        """Write the config as YAML to ``path`` atomically (a hidden sibling renamed into place); a full disk
        or a permission problem is an LMForgeError naming ``path``, and leaves nothing behind."""
        from lmforge.files import atomic_file, reporting_write_faults

        path = Path(path)
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        with reporting_write_faults(path, "and run the command again"):
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_file(path) as tmp:
                tmp.write_text(text)


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
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LMForgeError(f"{path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}): "
                           "save it as UTF-8") from e
    try:
        data = yaml.safe_load(text)
    except (yaml.YAMLError, ValueError) as e:  # ValueError: an integer of more than 4300 digits
        raise LMForgeError(f"{path} is not valid YAML: {e}") from e
    if data is None:  # else it would silently be the all-defaults config
        raise LMForgeError(f"{path} is empty (or only comments): write the run's sections (name, model, data, "
                           f"training) in it, e.g. copy {RECIPE_DIR / 'go_coder_tiny.yaml'}")
    if not isinstance(data, dict):
        raise LMForgeError(f"{path} must hold a mapping of config sections, not {type(data).__name__}")
    try:
        check_layer(data)
    except LMForgeError as e:
        raise LMForgeError(f"{path}: {e}") from e
    return data


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["training.lr=1e-3", "model.n_layer=4"]`` -> nested dict. Values are parsed as YAML."""
    if isinstance(overrides, str):  # else each character would be read as an override
        raise LMForgeError(f"overrides must be a list of \"KEY=VALUE\" strings, got the string "
                           f"{short_repr(overrides)}: pass [{short_repr(overrides)}]")
    if not isinstance(overrides, (list, tuple)):
        raise LMForgeError(f"overrides must be a list of \"KEY=VALUE\" strings, e.g. [\"training.max_steps=200\"], "
                           f"got {type(overrides).__name__} {short_repr(overrides)}")
    nested: dict[str, Any] = {}
    for item in overrides:
        if not isinstance(item, str):
            raise LMForgeError(f"override {short_repr(item)} ({type(item).__name__}) is not a \"KEY=VALUE\" string; "
                               "write it as e.g. \"training.max_steps=200\"")
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
        except (yaml.YAMLError, ValueError):  # ValueError: an integer of more than 4300 digits
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
    layers = ([read_recipe(recipe)] if recipe else []) + ([values] if values else []) + \
        ([parse_overrides(overrides)] if overrides else [])
    for layer in layers:
        check_layer(layer)  # before merging or walking any of it
    spec = kind_of_layers(layers)
    # A guide's names are resolved per layer, so a later layer's alias overrides an earlier key.
    merged: dict[str, Any] = {}
    for i, given in enumerate(layers):
        layer = apply_aliases(given, spec)
        if i > 0 or not recipe:  # not a recipe file: a run's resolved config.yaml holds every key, both of these too
            _refuse_both_in_one_layer(layer, given)
        merged = deep_merge(_drop_superseded(merged, layer, spec), layer)
    return config_from_dict(merged)


SECTIONS = ("model", "recipe", "data", "training", "logging")  # RunConfig's fields that hold a mapping
# A YAML "billion laughs" (an alias list of alias lists: a few hundred bytes) is billions of values once walked;
# it is refused before any code (a repr, dataclasses.asdict, a kind's checks) walks it.
MAX_VALUES = 100_000


def check_layer(values: Any) -> None:
    """Refuse a config layer that is too big to walk, or a section given as None, '', a scalar or a list
    (``model=`` on the command line would silently replace the recipe's section with the defaults)."""
    todo, count = [values], 0
    while todo:
        node = todo.pop()
        children = list(node.values()) if isinstance(node, dict) else node if isinstance(node, (list, tuple)) else ()
        count += len(children)
        if count > MAX_VALUES:
            raise LMForgeError(f"the config holds more than {MAX_VALUES:,} values (YAML aliases *NAME that repeat "
                               "lists of aliases?): write the values out, or load large data from a file")
        todo.extend(children)
    for name in SECTIONS:
        if isinstance(values, dict) and name in values and not isinstance(values[name], dict):
            raise section_error(name, values[name])


def kind_of_layers(layers: list[dict[str, Any]]) -> RecipeSpec:
    """The training kind config layers ask for: the last ``kind``, else the kind of the last
    ``model.family`` (also when a kind's aliases spell the model section otherwise), else gpt's."""
    kind, family = None, None
    for layer in layers:
        if not isinstance(layer, dict):
            continue
        kind = layer.get("kind") or kind
        if not isinstance(kind, (str, type(None))):
            raise LMForgeError(f"kind must be the name of a training kind, e.g. kind=lm, got {short_repr(kind)}")
        model = layer.get("model")
        if isinstance(model, dict) and model.get("family"):
            family = model["family"]
            if not isinstance(family, str):
                raise LMForgeError(f"model.family must be the name of a model family, e.g. model.family=gpt, "
                                   f"got {short_repr(family)}")
            continue
        for spec in kinds():  # e.g. HRM's `arch.family=trm`
            if spec.aliases is None:
                continue
            try:
                model = spec.aliases(layer).get("model")
            except LMForgeError:
                continue
            if isinstance(model, dict) and model.get("family"):
                family = model["family"]
                break
    if kind:
        return get_kind(kind)
    return kind_of_family(family) if family else default_kind()


def set_dotted(out: dict[str, Any], target: str, value: Any, alias: str) -> None:
    """Set ``section.key`` (or a top-level ``key``) of ``out`` to ``value``, given under the name
    ``alias``; both spellings with different values is an error. For kinds' alias functions."""
    if "." not in target:
        if target in out and out[target] != value:
            raise LMForgeError(f"'{alias}' and '{target}' are both given with different values; keep one")
        out[target] = value
        return
    section, key = target.split(".", 1)
    sec = out.get(section)
    sec = {} if sec is None else sec
    if not isinstance(sec, dict):
        raise section_error(section, sec)
    sec = dict(sec)  # a copy: the caller's dict is not changed
    if key in sec and sec[key] != value:
        raise LMForgeError(f"'{alias}' and '{target}' are both given with different values; keep one")
    sec[key] = value
    out[section] = sec


def move_keys(values: dict[str, Any], moves: dict[str, str]) -> dict[str, Any]:
    """Rename ``section.key`` (or top-level ``key``) entries to their targets: the common shape of a
    kind's aliases. Returns a new dict; ``values`` is not changed."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in values.items()}
    for alias, target in moves.items():
        if "." in alias:
            section, key = alias.split(".", 1)
            node = out.get(section)
            if isinstance(node, dict) and key in node:
                set_dotted(out, target, node.pop(key), alias)
        elif alias in out:
            set_dotted(out, target, out.pop(alias), alias)
    return out


# Hugging Face TrainingArguments' names (seeds 000 and 001 set them; so do most users coming from the Trainer),
# read under training.* by every kind. Seed 002 writes several of them too (batch_size, mixed_precision ...).
TRAINER_NAMES = {
    "learning_rate": "training.lr",
    "per_device_train_batch_size": "training.micro_batch_size",
    "batch_size": "training.micro_batch_size",
    "gradient_accumulation_steps": "training.grad_accum_steps",
    "num_train_epochs": "training.epochs",
    "lr_scheduler_type": "training.schedule",
    "logging_steps": "training.log_interval",
    "eval_steps": "training.eval_interval",
    "save_steps": "training.save_interval",
    "save_total_limit": "training.keep_last",
    "adam_beta1": "training.beta1",
    "adam_beta2": "training.beta2",
    "adam_epsilon": "training.eps",
    "max_grad_norm": "training.grad_clip",
    "gradient_checkpointing": "training.activation_checkpointing",
    "mixed_precision": "training.precision",
    "seed": "seed",
    "resume_from_checkpoint": "resume_from_checkpoint",
}
# AdamW's moments kept how (training.optimizer_states): the first is the default.
OPTIMIZER_STATES = ("fp32", "8bit")
# The Trainer's `optim` values that are AdamW with 8-bit moments (bitsandbytes' and torchao's).
TRAINER_8BIT_OPTIMS = ("adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit", "adamw_torch_8bit", "adamw_ao_8bit")
# The Trainer's schedules that lmforge has (its cosine ends at training.min_lr_ratio x lr; the Trainer's at 0).
TRAINER_SCHEDULES = {"cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant",
                     "warmup_stable_decay": "wsd"}
# Trainer settings whose Trainer default is what lmforge does anyway: dropped, so a guide's script that sets them
# loads (max_steps -1 is the Trainer's "not set": num_train_epochs decides; lmforge always keeps checkpoints/best).
TRAINER_DEFAULTS = {"optim": ("adamw_torch", "adamw_torch_fused", "adamw_hf"), "warmup_ratio": (0, 0.0),
                    "dataloader_num_workers": (0,), "max_steps": (-1,), "load_best_model_at_end": (True, False),
                    "report_to": ("tensorboard", ["tensorboard"])}
_EVAL_BATCH = ("evaluation runs training.micro_batch_size sequences a pass; training.eval_batches sets how many "
               "batches it scores (0 = the whole validation split)")
_EVAL_EVERY = "evaluation runs every training.eval_interval steps (or training.eval_interval_epochs epochs)"
# Trainer settings lmforge has no key for: what it does instead.
TRAINER_WITHOUT_KEY = {
    "per_device_eval_batch_size": _EVAL_BATCH,
    "eval_batch_size": _EVAL_BATCH,
    "warmup_ratio": "give the warmup as training.warmup_steps (e.g. 0.05 x training.max_steps)",
    "fp16_opt_level": "apex's optimisation levels do not apply: training.precision=fp16 is torch autocast with a "
                      "gradient scaler",
    "optim": "lmforge trains with AdamW (fused where the device has it), set by training.lr, training.beta1, "
             "training.beta2, training.eps and training.weight_decay; optim=adamw_8bit is "
             "training.optimizer_states=8bit",
    "output_dir": "a run is written to OUT_DIR/NAME: give out_dir=DIR and name=RUN",
    "logging_dir": "TensorBoard's files go to RUN_DIR/tb",
    "evaluation_strategy": _EVAL_EVERY,
    "eval_strategy": _EVAL_EVERY,
    "save_strategy": "checkpoints are written every training.save_interval steps",
    "report_to": "TensorBoard logs are on by default (logging.tensorboard); W&B with logging.wandb_project",
    "dataloader_num_workers": "batches come from memory-mapped token shards in the training process: no workers",
}


def trainer_names(values: dict[str, Any]) -> dict[str, Any]:
    """Move Hugging Face TrainingArguments' ``training.*`` names to lmforge's (``fp16``/``bf16`` flags to
    ``training.precision``); a Trainer setting lmforge has no key for is an error saying what it does instead.
    Returns a new dict."""
    if not isinstance(values.get("training"), dict):
        return values
    training = dict(values["training"])
    out = {**values, "training": training}
    for name, value in TRAINER_DEFAULTS.items():  # a pasted Trainer dump: its defaults are lmforge's behaviour
        if name in training and training[name] in value:
            del training[name]
    if "save_total_limit" in training and training["save_total_limit"] is None:
        raise LMForgeError("training.save_total_limit=null (the Trainer keeps every checkpoint) has no lmforge "
                           "equivalent: training.keep_last=N keeps the last N step checkpoints, besides best/")
    optim = training.pop("optim") if training.get("optim") in TRAINER_8BIT_OPTIMS else None
    for name, instead in TRAINER_WITHOUT_KEY.items():
        if name in training:
            raise LMForgeError(f"training.{name} (a Hugging Face Trainer setting) has no lmforge key: {instead}")
    moves: list[tuple[str, Any, str]] = []  # (lmforge's key, value, the name given); all popped before any is set
    if optim is not None:
        moves.append(("training.optimizer_states", "8bit", f"training.optim={optim}"))
    flags = {name: training.pop(name) for name in ("fp16", "bf16") if name in training}
    if flags.get("fp16") is True and flags.get("bf16") is True:
        raise LMForgeError("training.fp16 and training.bf16 are both true: keep one (lmforge's "
                           "training.precision=fp16 or bf16)")
    for name, on in flags.items():
        if not isinstance(on, bool):
            raise LMForgeError(f"training.{name} must be true or false, got {short_repr(on)}; or set "
                               "training.precision=auto|fp32|bf16|fp16")
        if on:
            moves.append(("training.precision", name, f"training.{name}"))
    if flags and not any(flags.values()) and "precision" not in training and "mixed_precision" not in training:
        moves.append(("training.precision", "fp32", " and ".join(f"training.{n}=false" for n in flags)))
    if "lr_scheduler_type" in training:
        kind = training["lr_scheduler_type"]
        if not isinstance(kind, str) or kind not in TRAINER_SCHEDULES:
            raise LMForgeError(f"training.lr_scheduler_type={short_repr(kind)} has no lmforge schedule; use one of "
                               f"{', '.join(TRAINER_SCHEDULES)} (or training.schedule=cosine|constant|wsd)")
        training["lr_scheduler_type"] = TRAINER_SCHEDULES[kind]
    if training.get("mixed_precision") is False or training.get("mixed_precision") == "no":
        training["mixed_precision"] = "fp32"  # accelerate's spelling of full precision (YAML reads `no` as false)
    moves += [(target, training.pop(name), f"training.{name}") for name, target in TRAINER_NAMES.items()
              if name in training]
    for target, value, alias in moves:
        set_dotted(out, target, value, alias)
    return out


def apply_aliases(values: dict[str, Any], spec: RecipeSpec | None = None) -> dict[str, Any]:
    """Rewrite a guide's key names into lmforge's sections: Hugging Face Trainer names for every kind, then
    the kind's aliases (the kind of ``values`` when ``spec`` is not given)."""
    if not isinstance(values, dict):
        raise LMForgeError(f"a config must be a mapping of sections, not {type(values).__name__}")
    spec = spec or kind_of_layers([values])
    values = trainer_names(dict(values))
    return spec.aliases(values) if spec.aliases is not None else values


# Pairs of keys where one sets or replaces the other: a later layer that gives the first (e.g. the
# user's training.max_steps) switches off the second where an earlier layer (the recipe) set it.
# Kinds add their own (RecipeSpec.supersedes).
DROP = object()  # remove the earlier key instead of resetting it
SUPERSEDES: dict[str, dict[str, list[tuple[str, Any]]]] = {
    "training": {"max_steps": [("epochs", 0)], "eval_interval": [("eval_interval_epochs", 0)],
                 "micro_batch_size": [("global_batch_size", 0)]},
    "data": {"train_path": [("path", "")], "path": [("train_path", "")],
             "val_path": [("val_fraction", DataConfig.val_fraction)]},
}


def _refuse_both_in_one_layer(layer: dict[str, Any], given: dict[str, Any]) -> None:
    """A key and the one it switches off (training.max_steps and epochs ...) given in one place (one command
    line, a pipeline stage's overrides) would leave one silently ignored: across layers the later wins
    (SUPERSEDES). ``given`` is the layer as written, whose Trainer spellings the message uses."""
    training = layer.get("training")
    if not isinstance(training, dict):
        return
    written = given.get("training") if isinstance(given.get("training"), dict) else {}

    def spelled(key: str) -> str:
        return next((f"training.{name}" for name, target in TRAINER_NAMES.items()
                     if target == f"training.{key}" and name in written), f"training.{key}")

    for plain, others in SUPERSEDES["training"].items():
        for other, off in others:
            if plain in training and other in training and training[other] != off:
                raise LMForgeError(
                    f"{spelled(plain)}={short_repr(training[plain])} and {spelled(other)}="
                    f"{short_repr(training[other])} are both given in one place, and {other} decides over "
                    f"{plain}: keep one (training.{other}={off} switches it off)")


def _drop_superseded(merged: dict[str, Any], layer: dict[str, Any], spec: RecipeSpec) -> dict[str, Any]:
    out = dict(merged)
    for section in set(SUPERSEDES) | set(spec.supersedes):
        rules: dict[str, list[tuple[str, Any]]] = {}
        for source in (SUPERSEDES.get(section, {}), spec.supersedes.get(section, {})):
            for plain, others in source.items():
                rules.setdefault(plain, []).extend(others)
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
    check_layer(values)
    spec = kind_of_layers([values])
    values = apply_aliases(dict(values), spec)
    check_layer(values)
    model_values = dict(values.pop("model", {}))
    family = model_values.pop("family", None) or spec.family_names()[0]
    recipe_values = values.pop("recipe", {})
    _refuse_other_kinds_names(values, spec)
    cfg = dataclass_from_dict(RunConfig, values, prefix="")
    cfg.kind = spec.name
    cls = model_class(family)
    if family not in spec.family_names():
        raise LMForgeError(f"kind {spec.name!r} trains the model families {', '.join(spec.family_names())}, not "
                           f"{family!r}; set model.family to one of them, or choose the kind that trains {family!r} "
                           f"(kind={kind_of_family(family).name})")
    cfg.model = dataclass_from_dict(cls.config_class, model_values, prefix="model")
    if spec.settings is not None:
        cfg.recipe = dataclass_from_dict(spec.settings_class(), recipe_values, prefix="recipe")
    elif recipe_values:
        raise LMForgeError(f"kind {spec.name!r} has no settings of its own: remove the 'recipe' section "
                           f"({', '.join(sorted(recipe_values))})")
    validate_run_config(cfg)
    return cfg


def _refuse_other_kinds_names(values: dict[str, Any], spec: RecipeSpec) -> None:
    """A key this kind does not know but another kind's guide does (HRM's `lr=`, seed 002's
    `training.optimizer.lr` on another kind's run): say which lmforge key it means, not only "unknown"."""
    sections = {f.name: f.type for f in dataclasses.fields(RunConfig)}
    unknown: list[tuple[str, dict[str, Any]]] = []  # (the dotted key as given, that key alone as a config)
    for key, value in values.items():
        if key not in sections:
            unknown.append((key, {key: value}))
        elif isinstance(value, dict) and dataclasses.is_dataclass(_SECTION_CLASSES.get(key)):
            fields = {f.name for f in dataclasses.fields(_SECTION_CLASSES[key])}
            unknown += [(_dotted_path(f"{key}.{sub}", v), {key: {sub: v}}) for sub, v in value.items()
                        if sub not in fields]
    for dotted, alone in unknown:
        for other in kinds():
            if other is spec or other.aliases is None:
                continue
            try:
                moved = other.aliases(alone)
            except LMForgeError:
                continue
            if moved == alone:
                continue
            path, node = [], moved
            while isinstance(node, dict) and len(node) == 1:
                name, node = next(iter(node.items()))
                path.append(name)
            target = ".".join(path)
            raise LMForgeError(f"unknown config key {dotted!r}: it is how the {other.name} kind's guide spells {target}; "
                               f"for this {spec.name} run write {target}={short_repr(node)}")


def _dotted_path(prefix: str, value: Any) -> str:
    """``training.optimizer`` given as ``{"lr": 1e-3}`` is the key ``training.optimizer.lr``."""
    while isinstance(value, dict) and len(value) == 1:
        key, value = next(iter(value.items()))
        prefix = f"{prefix}.{key}"
    return prefix


_SECTION_CLASSES = {"data": DataConfig, "training": TrainingConfig, "logging": LoggingConfig}


def validate_run_config(cfg: RunConfig) -> None:
    t = cfg.training
    checks = [
        # the run directory is out_dir/name: '', '.' or a path would write the run into out_dir itself or elsewhere
        (cfg.name.strip() not in ("", ".", "..") and not any(c in cfg.name for c in "/\\"),
         f"name={short_repr(cfg.name)} cannot name a run directory (out_dir/name): give a non-empty name without "
         "'/' or '\\' that is not '.' or '..', e.g. name=my_run"),
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
        (t.parallel in ("ddp", "fsdp", "hsdp"),
         f"training.parallel must be ddp, fsdp or hsdp, got {short_repr(t.parallel)}"),
        (t.optimizer_states in OPTIMIZER_STATES,
         f"training.optimizer_states must be {' or '.join(OPTIMIZER_STATES)}, got {short_repr(t.optimizer_states)}"),
        (t.optimizer_states != "8bit" or not cfg.spec.own_optimizer,
         f"training.optimizer_states=8bit is AdamW's, and the {cfg.kind} kind trains with its own optimizer "
         f"({cfg.spec.own_optimizer}), whose states stay fp32: drop training.optimizer_states"),
        (t.fsdp_checkpoint in ("sharded", "gathered"),
         f"training.fsdp_checkpoint must be sharded or gathered, got {short_repr(t.fsdp_checkpoint)}"),
        (not t.fsdp_offload or t.parallel != "ddp",
         "training.fsdp_offload keeps FSDP's shards in CPU memory, and this run is training.parallel=ddp (a whole "
         "copy on each GPU): set training.parallel=fsdp too, launched with torchrun (--nproc_per_node=1 on one "
         "GPU), or drop training.fsdp_offload"),
        (t.compile_mode in COMPILE_MODES,
         f"training.compile_mode must be one of {', '.join(COMPILE_MODES)}, got {short_repr(t.compile_mode)}"),
        (t.compile or t.compile_mode == "default",
         f"training.compile_mode={t.compile_mode} is torch.compile's mode: set training.compile=true too"),
        (t.compile_mode not in GRAPH_MODES or t.parallel == "ddp",
         f"training.compile_mode={t.compile_mode} (CUDA graphs) with training.parallel={t.parallel} is not supported: "
         "FSDP moves the gathered weights between uses; use compile_mode=default or max-autotune-no-cudagraphs"),
        (t.compile_mode not in GRAPH_MODES or cfg.spec.supports_cuda_graphs,
         f"training.compile_mode={t.compile_mode} (CUDA graphs) is built for the kinds: "
         f"{', '.join(k.name for k in kinds() if k.supports_cuda_graphs)}; the {cfg.kind!r} kind reads its compiled "
         "step's outputs later (or is untested with them): use compile_mode=default or max-autotune-no-cudagraphs"),
        (t.compile_mode not in GRAPH_MODES or t.grad_accum_steps == 1,
         f"training.compile_mode={t.compile_mode} (CUDA graphs) needs training.grad_accum_steps=1: a replay reuses "
         "the memory of the last micro-batch's gradients; raise micro_batch_size instead"),
        (t.schedule_over == "steps" or t.max_time_minutes > 0,
         "training.schedule_over=time lays the schedule over the time budget: set training.max_time_minutes too"),
        (t.log_interval >= 1, "training.log_interval must be >= 1"),
        (t.eval_interval >= 0 and t.save_interval >= 0, "training.eval_interval/save_interval must be >= 0"),
        (cfg.data.seq_len > 0, "data.seq_len must be > 0"),
        (0.0 < cfg.data.val_fraction < 1.0, "data.val_fraction must be in (0, 1), e.g. 0.01"),
        (not cfg.data.val_path or cfg.data.train_path,
         "data.val_path is the validation set for data.train_path (raw text prepared by training): set "
         "data.train_path too; data made by `lmforge data prepare` takes its own with --val"),
        (not cfg.data.val_path or cfg.data.val_fraction == DataConfig.val_fraction,
         f"data.val_path and data.val_fraction={cfg.data.val_fraction} are both set: data.val_path holds out "
         "exactly its documents; drop data.val_fraction"),
        (not cfg.data.val_path or cfg.spec.reads_val_path,
         f"data.val_path is not read by the {cfg.kind} kind (the lm kind reads it: raw text prepared into token "
         "shards); drop it"),
        (not (cfg.data.path and cfg.data.train_path),
         "data.path and data.train_path are both set: use data.path for data made by `lmforge data prepare`, "
         "or data.train_path for raw text/JSONL that training prepares itself, not both"),
    ]
    for ok, message in checks:
        if not ok:
            raise LMForgeError(message)
