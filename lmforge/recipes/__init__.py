"""Training kinds as plug-ins: the ``RecipeSpec`` each kind fills in, and the registry that finds them.

A *kind* is one way of training: ``lm`` (next-token pretraining of the gpt family), ``puzzles`` (HRM,
TRM and the plain transformer on Sudoku-style grids), ``hrgc`` (the planner + generator Go coder), and
the post-training kinds of the gpt family: ``sft`` (chat and tool-call fine-tuning), ``reward`` (a
reward model on preference pairs), ``dpo``, ``grpo`` and ``ppo``. Each lives in its own package,
``lmforge/recipes/<kind>/``, whose ``__init__`` builds one ``RecipeSpec`` and calls ``register``. The
loop (``lmforge.train``), the command line (``train``, ``eval``, ``generate``, ``bench``, ``data``) and
checkpoint loading read the spec; none of them names a kind or a model family.

Adding a kind: a new folder with its spec, and one line in ``BUILTIN`` below (see
``docs/adding-a-recipe.md``); a kind in another package registers through the ``lmforge.recipes``
entry-point group instead. The registry imports those packages by name, on first use: it sits at
the bottom of lmforge's layers (``lmforge.models`` asks it for a family's class), while the kinds sit
near the top, so the one link from here up to them is this list of names, as with any plug-in.

Every lmforge command imports every kind to build its parser, so a kind's ``__init__`` imports no torch:
what needs it is named by reference and imported on first use (``RecipeSpec``'s docstring says how).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import importlib.metadata
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from lmforge.cli_common import SHARED_OPTIONS
from lmforge.errors import LMForgeError

# The built-in kinds, one package each. A new kind adds its line here.
BUILTIN = (
    "lmforge.recipes.lm",
    "lmforge.recipes.puzzles",
    "lmforge.recipes.hrgc",
    "lmforge.recipes.sft",
    "lmforge.recipes.reward",
    "lmforge.recipes.dpo",
    "lmforge.recipes.grpo",
    "lmforge.recipes.ppo",
)
DEFAULT_KIND = "lm"  # the kind of a recipe that names neither `kind` nor `model.family`
ENTRY_POINT_GROUP = "lmforge.recipes"  # kinds of other packages: `[project.entry-points."lmforge.recipes"]`
# The stage kinds a pipeline runs itself (lmforge.pipeline.spec.STAGE_KEYS): a pipeline stage's `kind` is
# one of these or a training kind, so no training kind may take these names.
RESERVED_KIND_NAMES = ("tokenizer", "data", "eval", "export", "serve")


@dataclass(frozen=True)
class Counts:
    """What one micro-batch held, for throughput and MFU: the tokens the model processed (padding not
    counted), the examples (rows, puzzles, functions), and the training FLOPs it cost."""

    tokens: int
    examples: int
    flops: float


@dataclass(frozen=True)
class Probe:
    """Something a kind runs on the current weights every ``interval`` steps, on every process (e.g.
    HRGC writes functions and parses them). ``run(model, step)`` returns metrics, averaged across
    processes by the loop."""

    interval: int
    run: Callable[[Any, int], dict[str, float]]


@dataclass
class TrainData:
    """What a kind's ``build_data`` hands the loop."""

    # .next_batch() -> dict of CPU tensors; .state_dict(); .load_state_dict(state). state_dict() is written into
    # each checkpoint's trainer_state.json, so it must hold JSON values only (dicts, lists, str, numbers, bool,
    # None; no tensors or torch.Generator states: keep a seed and a count, say): the loop checks it before
    # step 1. load_state_dict(state) of it must put the loader where it was, for an exact resume.
    train: Any
    val: Any | None  # .iter_eval_batches(max_batches) -> iterable of batch dicts; None = no evaluation
    description: str = ""
    derive_eval_metrics: Callable[[dict[str, float]], dict[str, float]] = lambda m: m
    examples_per_epoch: int = 0  # what one epoch of `training.epochs` counts (all processes together)
    tokenizer_path: Any = None  # a tokenizer.json copied into the run and every checkpoint; None = none
    probe: Probe | None = None
    on_step: Callable[[int], None] | None = None  # told each optimizer step before its batches are drawn (curricula)
    # Told the model being trained, on its device, before the first step: for kinds whose batches
    # come from the model itself (rollouts of ppo and grpo) or whose loss needs another model (dpo's live
    # reference). Args: (model, DeviceInfo, ModelHost): the host keeps the kind's frozen models and
    # gathers sharded weights for the calls the loop does not make itself (see ``ModelHost``).
    bind_model: Callable[[Any, Any, ModelHost], None] | None = None
    # False where the kind's loss on a held-out batch reads only the batch, because the val loader ran the
    # models itself (inside ``ModelHost.gathered``: grpo's and ppo's held-out replies, scored): evaluation
    # then gathers nothing. True: the loss calls the model; under FSDP evaluation runs it (and any frozen
    # model's forward the loss calls) block by block, as a training step does, every process in step.
    eval_loss_reads_model: bool = True


class ModelHost:
    """What ``TrainData.bind_model`` is handed beside the model: how a kind keeps other models and runs
    models outside the training step. This base is what a single process (or DDP) needs: ``frozen``
    returns the model as it is and ``gathered`` does nothing. Under ``training.parallel`` fsdp / hsdp the
    loop hands a host that shards and gathers (``lmforge.train.loop``)."""

    def frozen(self, module: Any) -> Any:
        """Keep a frozen model for the run (a reference, a reward model; load it on the CPU) and put it on
        the run's device; returns it. Under FSDP it is sharded like the trained model, and outside
        ``gathered`` only its ``forward`` (and ``hidden_states``) may be called, alike on every process (as
        dpo's loss calls its live reference, once per micro-batch). This base keeps it where it is."""
        return module

    def gathered(self, *modules: Any) -> contextlib.AbstractContextManager:
        """Context in which ``modules`` (the trained model or a part of it, such as ppo's policy; frozen
        models) hold their full weights on this process; of the rest, only what shares their FSDP root
        (ppo's value model's embeddings and head, with the policy) is gathered with them. Inside it
        the plain modules may be called any number of times, a different number on each process (a
        rollout, held-out replies). Every process must enter it alike, even with no work of its own."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def scoring(self, module: Any) -> Iterator[Any]:
        """Context in which a frozen model needed only for a while (dpo's reference filling its table of
        log-probs before training; load it on the CPU) is whole on the run's device; yields it. Under
        FSDP it is not sharded: its weights are cast to the compute dtype on the CPU (buffers keep
        theirs, as FSDP's mixed precision does) and then moved, so it holds what ``gathered`` would
        hold for it, without the shards beside. Drop it after the block to free it. This base keeps it
        where it is."""
        yield module


@dataclass(frozen=True)
class CLIOptions:
    """The options a kind adds to one verb (``eval`` or ``generate``) and the function that runs it.

    ``add(group)`` adds the kind's own options to an argparse group titled with the kind; ``uses``
    names the shared option sets it takes too (``lmforge.cli_common.SHARED_OPTIONS``): ``sampling``
    (--max-new-tokens, --temperature, --top-k, --top-p, --seed; --seed defaults to None, "no seed"),
    ``precision`` (--precision), ``baseline`` (--baseline, --no-baseline, --max-new-tokens, default None)
    and ``batch-size`` (--batch-size, default None); ``register`` refuses other names. Kinds may add an
    option string another kind adds only as the same option (same action, dest, type, default ...).
    ``run(args)`` does the work and returns the exit code. The command line refuses an option of
    another kind with a message naming the kind it belongs to."""

    run: Callable[[argparse.Namespace], int]
    add: Callable[[Any], None] = lambda group: None
    uses: tuple[str, ...] = ()
    help: str = ""  # what the verb does for this kind, one line


def import_ref(ref: str) -> Any:
    """The object a reference ``"package.module:name"`` names, imported now."""
    module, _, name = ref.partition(":")
    if not module or not name:
        raise LMForgeError(f"{ref!r} is not a reference \"package.module:name\"")
    try:
        target = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module and not module.startswith(f"{e.name}."):  # one that the named module imports is missing
            raise
        raise LMForgeError(f"{ref!r} names a module that does not exist: {e}") from e
    for part in name.split("."):
        if not hasattr(target, part):
            raise LMForgeError(f"{ref!r}: {module} has no {name!r}")
        target = getattr(target, part)
    return target


class Lazy:
    """A function (or class) named by reference, ``Lazy("package.module:name")``: calling it imports the object
    on the first call and calls it; ``load()`` returns the object. What a ``RecipeSpec`` holds in place of a
    function whose module imports torch (see its docstring)."""

    __slots__ = ("ref", "_target")

    def __init__(self, ref: str):
        if not isinstance(ref, str) or ref.count(":") != 1 or ref.startswith(":") or ref.endswith(":"):
            raise LMForgeError(f"Lazy({ref!r}): give a reference \"package.module:name\"")
        self.ref = ref
        self._target: Any = None

    def load(self) -> Any:
        if self._target is None:
            self._target = import_ref(self.ref)
        return self._target

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.load()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Lazy({self.ref!r})"


@dataclass(frozen=True)
class Family:
    """A model family a kind trains: its name (``model.family`` in a recipe, the class's ``family``) and its
    model class (an ``LMForgeModel`` subclass), given as the class or as a reference ``"package.module:Class"``
    imported on first use. A ``RecipeSpec`` holds its families in this form (a class given alone is wrapped)."""

    family: str
    model: type | str

    def load(self) -> type:
        cls = import_ref(self.model) if isinstance(self.model, str) else self.model
        if getattr(cls, "family", None) != self.family:
            raise LMForgeError(f"model family {self.family!r}: {self.model!r} is a class of the family "
                               f"{getattr(cls, 'family', None)!r}; the names must match")
        return cls

    def same_model(self, other: Family) -> bool:
        if isinstance(self.model, str) and self.model == other.model:
            return True  # one reference: the same class, and nothing imported to know it
        return self.load() is other.load()


def _call_model(model, batch):
    return model(batch)


def _data_seq_len(cfg) -> int:
    return cfg.data.seq_len


def _predicted_tokens_or_rows(batch: dict[str, Any]) -> float:
    """Evaluation means are weighted by predicted tokens where a batch has labels, else by rows."""
    import torch

    labels = batch.get("labels")
    if torch.is_tensor(labels):
        return float((labels != -100).sum())
    first = next(v for v in batch.values() if torch.is_tensor(v))
    return float(first.shape[0])


@dataclass(frozen=True)
class RecipeSpec:
    """Everything lmforge needs to know about one training kind.

    Every lmforge command, ``lmforge --help`` included, imports every kind and reads its spec to build the
    parser, so a kind's ``__init__`` must not import torch (about 2 s of CPU on each command). What needs torch
    is named by reference, ``"package.module:name"``, and imported on first use:

    - ``families``: ``Family("gpt", "lmforge.models.gpt:GPT")``, the family's name read at once, its class
      imported when a model is built, loaded or its config read;
    - functions (``build_data``, ``count``, ``loss``, ``make_optimizer`` ... ``CLIOptions.run``) and the
      ``settings`` dataclass: ``Lazy("lmforge.recipes.lm.data:build_lm_data")``, which imports the function
      when it is first called and calls it.

    What runs while the parser is built (``CLIOptions.add``, ``add_data_verbs``, ``add_verbs``) is given
    as it is, from a module that imports torch only inside the functions that do a verb's work. A model
    class or function given as it is works the same (kinds of other packages written that way keep working),
    but what its module imports is then paid by every command.
    """

    name: str  # the kind: `kind: NAME` in a recipe (default: the kind of model.family)
    summary: str  # one line, shown in --help
    # The model families it trains, each a Family (name + class or reference) or a model class (LMForgeModel subclass,
    # wrapped into a Family); the first is the default. family_names() reads no class; model_classes() imports them
    families: tuple[Family | type, ...]
    build_data: Callable[[Any, Any], TrainData]  # (RunConfig, DistInfo) -> TrainData; may fill model sizes
    count: Callable[[Any, dict[str, Any]], Counts]  # (model, CPU batch) -> what the micro-batch held
    # --- configuration ----------------------------------------------------------------------------
    # dataclass of the kind's training-only settings: config section `recipe` (settings_class() imports a Lazy one)
    settings: type | Lazy | None = None
    aliases: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # a guide's names -> lmforge's, per layer
    supersedes: dict[str, dict[str, list[tuple[str, Any]]]] = field(default_factory=dict)  # see config.py
    # --- the step ---------------------------------------------------------------------------------
    prepare_model: Callable[[Any, Any], None] | None = None  # (model, RunConfig): training settings onto it
    make_optimizer: Callable[[Any, Any, Any], Any] | None = None  # (model, RunConfig, device) -> optimizer
    # The name of the optimizer make_optimizer returns where it is not lmforge's AdamW (make_adamw): its states
    # stay fp32, so training.optimizer_states=8bit is refused when the config is validated, before any data
    # or model is built. "" = AdamW (the default optimizer, or make_adamw over the kind's own groups).
    own_optimizer: str = ""
    # (module, batch) -> (loss, metrics). In training ``module`` is the (torch.compile'd) model, and the loop
    # runs this loss as the forward of one module around it, which DDP / FSDP wrap: so it may call the
    # model (or its methods) as often as it needs. In evaluation ``module`` is the model itself.
    loss: Callable[[Any, dict[str, Any]], tuple[Any, dict[str, Any]]] = _call_model
    ddp_find_unused_parameters: bool = False  # some parameters get no gradient in some steps
    # training.parallel fsdp/hsdp (lmforge.train.fsdp) is tested with this kind: its model has repeated_blocks(),
    # and its data calls models outside the training step only inside ModelHost.gathered
    supports_fsdp: bool = False
    # training.compile_mode reduce-overhead / max-autotune (CUDA graphs) is safe with this kind: no output of
    # its compiled step (a carried state, a cache) is read after the next micro-batch's replay
    supports_cuda_graphs: bool = False
    reads_val_path: bool = False  # data.val_path (a validation set of the user's own beside data.train_path)
    # --- evaluation -------------------------------------------------------------------------------
    best_metric: str = "eval/loss"  # the metric that picks checkpoints/best
    best_higher_is_better: bool = False
    eval_weight: Callable[[dict[str, Any]], float] = _predicted_tokens_or_rows  # a batch's share of eval means
    # --- command line -----------------------------------------------------------------------------
    eval: CLIOptions | None = None  # `lmforge eval CKPT` for this kind's checkpoints
    generate: CLIOptions | None = None  # `lmforge generate CKPT` (its inference entry point)
    add_data_verbs: Callable[[Any], None] | None = None  # adds `lmforge data VERB` builders of its data
    add_verbs: Callable[[Any], None] | None = None  # adds top-level verbs of its own (puzzles: `solve`)
    bench_data: Callable[[Any], Any] | None = None  # (RunConfig) -> a train loader of random batches
    # (RunConfig) -> the length of the rows bench_data's batches hold, which `lmforge bench` prints and counts
    # its tokens and FLOPs by (only read with bench_data). Default: data.seq_len
    seq_len: Callable[[Any], int] = _data_seq_len

    def __post_init__(self) -> None:
        wrapped = []
        for entry in self.families:
            if not isinstance(entry, Family):
                if not isinstance(entry, type) or not isinstance(getattr(entry, "family", None), str):
                    raise LMForgeError(f"kind {self.name!r}: families holds {entry!r}; give model classes (with a "
                                       "`family` name) or Family(\"name\", \"package.module:Class\")")
                entry = Family(entry.family, entry)
            wrapped.append(entry)
        object.__setattr__(self, "families", tuple(wrapped))

    def family_names(self) -> tuple[str, ...]:
        return tuple(f.family for f in self.families)

    def model_classes(self) -> tuple[type, ...]:
        """The families' model classes (imports them)."""
        return tuple(f.load() for f in self.families)

    def settings_class(self) -> type | None:
        return self.settings.load() if isinstance(self.settings, Lazy) else self.settings


_KINDS: dict[str, RecipeSpec] = {}
_FAMILIES: dict[str, tuple[Family, RecipeSpec]] = {}  # family -> (its Family, the kind that owns it)
_state = {"loaded": False, "loading": False}


def register(spec: RecipeSpec) -> RecipeSpec:
    """Make a kind known (called by its package on import). A family belongs to the first kind that
    registers it, in ``BUILTIN`` order then entry points; later kinds may train it too (e.g. the sft kind
    fine-tunes the gpt family, which is the lm kind's). The built-in kinds are loaded first, so which
    kind owns a family never depends on which package a program happened to import first."""
    _load_builtin()
    if spec.name in RESERVED_KIND_NAMES:
        raise LMForgeError(f"a training kind cannot be named {spec.name!r}: pipelines run stages of the kinds "
                           f"{', '.join(RESERVED_KIND_NAMES)} themselves, so a pipeline stage could never train it. "
                           "Choose another name")
    if spec.name in _KINDS and _KINDS[spec.name] is not spec:
        raise LMForgeError(f"two training kinds are named {spec.name!r}")
    for verb in ("eval", "generate"):
        options = getattr(spec, verb)
        unknown = [u for u in (options.uses if options is not None else ()) if u not in SHARED_OPTIONS]
        if unknown:
            # a tuple of one name written ("sampling") is a string: its letters are the names
            hint = " (a tuple of one name needs a comma: uses=(\"sampling\",))" if isinstance(options.uses, str) else ""
            raise LMForgeError(f"kind {spec.name!r}: {verb}=CLIOptions(uses=...) names unknown shared option sets "
                               f"{', '.join(map(repr, unknown))}{hint}; the sets are "
                               f"{', '.join(map(repr, SHARED_OPTIONS))}")
    for entry in spec.families:
        owner = _FAMILIES.get(entry.family)
        if owner is not None and not owner[0].same_model(entry):
            cls = owner[0].load()
            raise LMForgeError(f"kind {spec.name!r} registers a model family {entry.family!r} that kind {owner[1].name!r} "
                               f"already defines with another class ({cls.__module__}.{cls.__name__}); "
                               "choose another family name")
    _KINDS[spec.name] = spec
    for entry in spec.families:
        _FAMILIES.setdefault(entry.family, (entry, spec))
    return spec


def _load_builtin() -> None:
    """Import the built-in kinds and those of installed packages (entry points), once."""
    if _state["loaded"] or _state["loading"]:  # loading: a kind's own import asked the registry
        return
    _state["loading"] = True
    try:
        for module in BUILTIN:
            importlib.import_module(module)
        for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                entry.load()
            except Exception as e:  # noqa: BLE001 - a broken third-party kind must not hide the others
                raise LMForgeError(f"the training kind {entry.name!r} of an installed package ({entry.value}) does not "
                                   f"import: {type(e).__name__}: {e}. Fix or uninstall that package.") from e
        _state["loaded"] = True
    finally:
        _state["loading"] = False


def kinds() -> list[RecipeSpec]:
    _load_builtin()
    return [_KINDS[k] for k in sorted(_KINDS)]


def get_kind(name: str) -> RecipeSpec:
    _load_builtin()
    if name not in _KINDS:
        close = difflib.get_close_matches(str(name), list(_KINDS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise LMForgeError(f"unknown training kind {name!r}; known: {', '.join(sorted(_KINDS))}.{hint} A kind of "
                           f"another package is found only through the {ENTRY_POINT_GROUP!r} entry point of an "
                           "installed package (importable is not enough): declare it in that package's "
                           "pyproject.toml and `pip install -e PATH` it (docs/adding-a-recipe.md)")
    return _KINDS[name]


def families() -> list[str]:
    _load_builtin()
    return sorted(_FAMILIES)


def _family(family: str | None) -> tuple[Family, RecipeSpec]:
    _load_builtin()
    if family not in _FAMILIES:
        close = difflib.get_close_matches(str(family), list(_FAMILIES), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise LMForgeError(f"unknown model family {family!r}; known: {', '.join(sorted(_FAMILIES))}.{hint}")
    return _FAMILIES[family]


def model_class(family: str | None) -> type:
    """The model class of a family name (``gpt``, ``trm`` ...); imports it."""
    return _family(family)[0].load()


def kind_of_family(family: str | None) -> RecipeSpec:
    """The kind a family's checkpoints belong to (what `lmforge eval` / `generate` run for them)."""
    return _family(family)[1]


def default_kind() -> RecipeSpec:
    return get_kind(DEFAULT_KIND)


_FLOPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {length: FLOPs per token}


def flops_per_token(model: Any, length: int) -> float:
    """``model.flops_per_token(length)``, remembered per model and length: ``count`` runs per micro-batch,
    and some families walk their modules to answer."""
    cache = _FLOPS.setdefault(model, {})
    if length not in cache:
        cache[length] = float(model.flops_per_token(length))
    return cache[length]


def family_of_config(config: Any) -> str:
    """The family whose config dataclass ``config`` is."""
    _load_builtin()
    for name, (entry, _) in _FAMILIES.items():
        if type(config) is entry.load().config_class:
            return name
    raise LMForgeError(f"no model family takes a config of type {type(config).__name__}")


__all__ = ["BUILTIN", "DEFAULT_KIND", "RESERVED_KIND_NAMES", "CLIOptions", "Counts", "Family", "Lazy", "ModelHost",
           "Probe", "RecipeSpec", "TrainData", "default_kind", "families", "family_of_config", "flops_per_token",
           "get_kind", "import_ref", "kind_of_family", "kinds", "model_class", "register"]
