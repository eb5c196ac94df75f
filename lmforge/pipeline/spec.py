"""A pipeline file: read, substituted and validated as a whole before anything runs.

A pipeline is one YAML file (``configs/pipelines/*.yaml`` or any path) with ``name``, ``out_dir``,
optional ``vars`` and an ordered ``stages`` list. Every check that needs no compute happens here, in
``load_pipeline``: unknown keys (with "did you mean"), duplicate or unknown stage names, references
to later stages, unknown kinds, generators and tasks, missing input files, and the fully resolved
config of every training stage (``lmforge.config.load_config``), built with the paths that earlier
stages will write.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lmforge.errors import LMForgeError

PIPELINE_DIR = Path(__file__).resolve().parent.parent / "configs" / "pipelines"

TOP_KEYS = ("name", "out_dir", "description", "vars", "stages")
COMMON_KEYS = ("name", "kind", "description")
TRAINING_KEYS = ("recipe", "init", "tokenizer", "data", "overrides", "processes")
# The stage kinds the pipeline runs itself; every other kind is a training kind (lmforge.recipes).
STAGE_KEYS: dict[str, tuple[str, ...]] = {
    "tokenizer": ("sources", "vocab_size", "include", "max_bytes", "text_field", "exclude_tests", "min_frequency",
                  "heldout_fraction", "seed"),
    "data": ("generator", "args"),
    "eval": ("task", "checkpoint", "baseline", "data", "split", "metric", "limit", "include", "max_new_tokens",
             "batch_size", "device"),
    "export": ("checkpoint", "formats", "gguf_dtype"),
    "serve": ("checkpoint", "host", "port", "model_name", "max_batch_size"),
}
GGUF_DTYPES = ("f32", "f16", "q8_0")
EXPORT_FORMATS = ("hf", "gguf")


@dataclass(frozen=True)
class Generator:
    """A `data` stage's generator: ``module.function(out_dir, **args)``."""

    module: str
    function: str
    fills: tuple[str, ...] = ("out_dir",)  # arguments the pipeline passes itself

    def load(self):
        import importlib

        try:
            module = importlib.import_module(self.module)
        except ImportError as e:
            raise LMForgeError(f"needs {self.module}, which this lmforge installation does not have ({e})") from e
        fn = getattr(module, self.function, None)
        if fn is None:
            raise LMForgeError(f"{self.module} has no function {self.function}()")
        return fn


GENERATORS = {
    "tool-calls": Generator("lmforge.posttrain.toolcalls", "write_tool_call_dataset", ("out_dir", "overwrite")),
    "preferences": Generator("lmforge.posttrain.preferences", "write_preference_dataset", ("out_dir", "overwrite")),
    "stories": Generator("lmforge.data.stories", "write_stories", ("out_dir", "overwrite")),
}
EVAL_TASKS = {
    # task -> (its own keys besides task/checkpoint/baseline/data/metric, default headline metric,
    #          the module and name of what lists its figures)
    "lm": (("split", "limit", "include", "batch_size", "device"), "bpb", ("lmforge.eval.lm", "FIGURES")),
    "tool-calls": (("split", "limit", "max_new_tokens", "batch_size", "device"), "",
                   (GENERATORS["tool-calls"].module, "METRIC_DOC")),  # the evaluator lives beside the generator
}


@dataclass
class Stage:
    index: int  # 0-based position in the file
    name: str
    kind: str
    values: dict[str, Any]  # the stage's mapping, placeholders substituted
    training: bool
    deps: list[str] = field(default_factory=list)  # stages whose outputs this one reads, in file order

    def where(self) -> str:
        return f"stage {self.name!r} ({self.kind})"


@dataclass
class Pipeline:
    path: Path
    name: str
    out_dir: Path
    stages: list[Stage]
    vars: dict[str, Any]
    description: str = ""
    configs: dict[str, Any] = field(default_factory=dict)  # training stage -> RunConfig resolved at validation

    def stage(self, name: str, what: str = "stage") -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise LMForgeError(f"{self.path}: unknown {what} {name!r}.{_hint(name, [s.name for s in self.stages])} "
                           f"Stages: {', '.join(s.name for s in self.stages)}")

    def stage_dir(self, name: str) -> Path:
        return self.out_dir / name

    @property
    def state_path(self) -> Path:
        return self.out_dir / "pipeline_state.json"


def _hint(word: str, choices) -> str:
    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else ""


def _check_keys(values: dict, allowed, where: str) -> None:
    for key in values:
        if key not in allowed:
            raise LMForgeError(f"{where}: unknown key {key!r}.{_hint(key, allowed)} Valid keys: {', '.join(allowed)}")


def list_pipelines() -> list[str]:
    return sorted(p.stem for p in PIPELINE_DIR.glob("*.yaml")) if PIPELINE_DIR.is_dir() else []


def find_pipeline_file(name_or_path: str | os.PathLike) -> Path:
    """A path, or the name of a pipeline shipped in ``configs/pipelines/`` (``code_assistant_tiny``)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = PIPELINE_DIR / f"{name_or_path}.yaml"
    if path.suffix not in (".yaml", ".yml") and shipped.is_file():
        return shipped
    known = list_pipelines()
    hint = _hint(path.stem, known)
    raise LMForgeError(f"pipeline file {path} does not exist.{hint} Pipelines shipped with lmforge: "
                       f"{', '.join(known) or 'none'} (pass a name or the path of a YAML file)")


# ---- placeholders ------------------------------------------------------------------------------
PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")
FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


class _Substituter:
    """``${vars.NAME}``, ``${env:NAME}`` / ``${env:NAME:-default}``, ``${goroot}`` (the local Go toolchain's
    GOROOT) and ``${stages.NAME.out}`` (OUT_DIR/NAME, an earlier stage's output)."""

    def __init__(self, raw_vars: dict[str, Any], out_dir: Path | None, file: Path):
        self.raw_vars, self.vars, self.out_dir, self.file = raw_vars, {}, out_dir, file
        self.resolving: list[str] = []
        self.stage_names: list[str] = []  # earlier stages (for ${stages...}); set per stage
        self.all_stages: list[str] = []
        self.refs: list[str] = []

    def var(self, name: str, where: str) -> Any:
        if name in self.vars:
            return self.vars[name]
        if name not in self.raw_vars:
            raise LMForgeError(f"{where}: ${{vars.{name}}} is not defined.{_hint(name, self.raw_vars)} Defined vars: "
                               f"{', '.join(self.raw_vars) or 'none'} (add it under vars:, or pass --var {name}=VALUE)")
        if name in self.resolving:
            raise LMForgeError(f"vars.{name} refers to itself (through {' -> '.join(self.resolving)})")
        self.resolving.append(name)
        try:
            self.vars[name] = self.value(self.raw_vars[name], f"vars.{name}", str(self.file))
        finally:
            self.resolving.pop()
        return self.vars[name]

    def expression(self, expr: str, where: str) -> Any:
        expr = expr.strip()
        if expr.startswith("vars."):
            return self.var(expr[5:], where)
        if expr.startswith("env:"):
            name, _, default = expr[4:].partition(":-")
            if name in os.environ:
                return os.environ[name]
            if ":-" in expr:
                return default
            given = f", pass --var {self.resolving[-1]}=VALUE" if self.resolving else ""
            raise LMForgeError(f"{where}: the environment variable {name} is not set (${{env:{name}}}); set it{given}, "
                               f"or write ${{env:{name}:-DEFAULT}} for a fallback")
        if expr == "goroot":
            return _goroot(where)
        if expr.startswith("stages."):
            if self.out_dir is None:
                raise LMForgeError(f"{where}: ${{{expr}}}: vars cannot name stage outputs; use it in the stage")
            name, _, attr = expr[7:].rpartition(".")
            if attr != "out" or not name:
                raise LMForgeError(f"{where}: ${{{expr}}}: write ${{stages.NAME.out}} (the directory a stage writes)")
            if name not in self.stage_names:
                if name in self.all_stages:
                    raise LMForgeError(f"{where}: ${{{expr}}} names stage {name!r}, which comes later in the file; "
                                       "a stage can only read what earlier stages wrote")
                raise LMForgeError(f"{where}: ${{{expr}}} names no stage.{_hint(name, self.all_stages)}")
            self.refs.append(name)
            return str(self.out_dir / name)
        raise LMForgeError(f"{where}: unknown placeholder ${{{expr}}}; use ${{vars.NAME}}, ${{env:NAME}}, "
                           "${env:NAME:-DEFAULT}, ${goroot} or ${stages.NAME.out}")

    def value(self, value: Any, path: str, context: str) -> Any:
        """``value`` with its placeholders replaced; ``context: path`` names it in errors."""
        if isinstance(value, dict):
            return {k: self.value(v, f"{path}.{k}" if path else str(k), context) for k, v in value.items()}
        if isinstance(value, list):
            return [self.value(v, f"{path}[{i}]", context) for i, v in enumerate(value)]
        if not isinstance(value, str) or "${" not in value:
            return value
        where = f"{context}: {path}"
        whole = PLACEHOLDER.fullmatch(value.strip())
        if whole:  # a value that is one placeholder keeps the type of what it names (numbers stay numbers)
            return self.expression(whole.group(1), where)
        return PLACEHOLDER.sub(lambda m: str(self.expression(m.group(1), where)), value)


def _goroot(where: str) -> str:
    root = _go_env_goroot()
    if not root:
        raise LMForgeError(f"{where}: ${{goroot}} needs a Go toolchain (`go env GOROOT`), and none was found: install "
                           "Go (e.g. apt-get install golang-go) or set the path yourself (--var NAME=PATH)")
    return root


@functools.lru_cache(maxsize=1)
def _go_env_goroot() -> str:
    go = shutil.which("go")
    root = ""
    if go:
        try:
            root = subprocess.run([go, "env", "GOROOT"], capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            root = ""
    return root


# ---- reading and validating --------------------------------------------------------------------
def read_pipeline_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise LMForgeError(f"{path} is not valid YAML: {e}") from e
    except (OSError, UnicodeDecodeError) as e:
        raise LMForgeError(f"cannot read pipeline file {path}: {e}") from e
    if not isinstance(data, dict):
        raise LMForgeError(f"{path} must hold a mapping (name, out_dir, vars, stages), not "
                           f"{type(data).__name__}")
    return data


def parse_var_overrides(items: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        name, sep, raw = item.partition("=")
        if not sep or not name.strip():
            raise LMForgeError(f"--var {item!r}: write NAME=VALUE")
        out[name.strip()] = yaml.safe_load(raw) if raw.strip() else ""
    return out


def load_pipeline(file: str | os.PathLike, vars: dict[str, Any] | None = None,
                  out_dir: str | os.PathLike | None = None) -> Pipeline:
    """Read and validate a pipeline file (nothing runs). ``vars`` override the file's ``vars``;
    ``out_dir`` its ``out_dir``. Raises ``LMForgeError`` naming the stage and key of any problem."""
    path = find_pipeline_file(file)
    data = read_pipeline_yaml(path)
    _check_keys(data, TOP_KEYS, str(path))
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        raise LMForgeError(f"{path}: 'name' is required (a string naming the pipeline)")
    raw_vars = data.get("vars") or {}
    if not isinstance(raw_vars, dict):
        raise LMForgeError(f"{path}: 'vars' must be a mapping of NAME: VALUE, got {raw_vars!r}")
    unknown = [k for k in (vars or {}) if k not in raw_vars]
    if unknown:
        raise LMForgeError(f"--var {unknown[0]}: {path} has no such var.{_hint(unknown[0], raw_vars)} Its vars: "
                           f"{', '.join(raw_vars) or 'none'}")
    raw_vars = {**raw_vars, **(vars or {})}
    sub = _Substituter(raw_vars, None, path)
    for var in raw_vars:
        sub.var(var, f"{path}: vars.{var}")
    resolved_out = str(out_dir) if out_dir is not None else sub.value(data.get("out_dir") or f"runs/{name}", "out_dir",
                                                                 str(path))
    if not isinstance(resolved_out, str) or not resolved_out:
        raise LMForgeError(f"{path}: 'out_dir' must be a directory path, got {resolved_out!r}")
    sub.out_dir = Path(resolved_out)
    stages_raw = data.get("stages")
    if not isinstance(stages_raw, list) or not stages_raw:
        raise LMForgeError(f"{path}: 'stages' must be a non-empty list of stages (each with name and kind)")
    names = [s.get("name") if isinstance(s, dict) else None for s in stages_raw]
    sub.all_stages = [n for n in names if isinstance(n, str)]
    pipe = Pipeline(path=path, name=name, out_dir=Path(resolved_out), stages=[], vars=dict(sub.vars),
                    description=str(data.get("description") or ""))
    for i, raw in enumerate(stages_raw):
        pipe.stages.append(_parse_stage(i, raw, pipe, sub))
    serves = [s.name for s in pipe.stages if s.kind == "serve"]
    if len(serves) > 1:
        raise LMForgeError(f"{path}: more than one serve stage ({', '.join(serves)}); a pipeline deploys one model")
    for stage in pipe.stages:
        _validate_stage(stage, pipe)
    return pipe


def _parse_stage(i: int, raw: Any, pipe: Pipeline, sub: _Substituter) -> Stage:
    where = f"{pipe.path}: stages[{i}]"
    if not isinstance(raw, dict):
        raise LMForgeError(f"{where} must be a mapping with name and kind, got {raw!r}")
    name = raw.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", name):
        raise LMForgeError(f"{where}: 'name' is required: letters, digits, '_' and '-' (it names the stage's "
                           f"directory OUT_DIR/NAME), got {name!r}")
    if name in [s.name for s in pipe.stages]:
        raise LMForgeError(f"{pipe.path}: two stages are named {name!r}; stage names must be unique")
    where = f"{pipe.path}: stage {name!r}"
    kind = raw.get("kind")
    if not isinstance(kind, str) or not kind:
        raise LMForgeError(f"{where}: 'kind' is required: a training kind ({', '.join(_training_kinds())}) or "
                           f"one of {', '.join(STAGE_KEYS)}")
    training = kind not in STAGE_KEYS
    if training and kind not in _training_kinds():
        choices = [*_training_kinds(), *STAGE_KEYS]
        raise LMForgeError(f"{where}: unknown kind {kind!r}.{_hint(kind, choices)} Kinds: training kinds "
                           f"{', '.join(_training_kinds())}; pipeline stages {', '.join(STAGE_KEYS)}")
    allowed = COMMON_KEYS + (TRAINING_KEYS if training else STAGE_KEYS[kind])
    _check_keys(raw, allowed, f"{where} ({kind})")
    sub.stage_names = [s.name for s in pipe.stages]
    sub.refs = []
    values = sub.value({k: v for k, v in raw.items() if k not in COMMON_KEYS}, "", where)
    stage = Stage(index=i, name=name, kind=kind, values=values, training=training)
    deps = list(sub.refs)
    for key in ("init", "tokenizer", "checkpoint", "baseline"):
        if key in values:
            deps.append(_stage_ref(stage, key, values[key], pipe, sub.all_stages))
    if kind == "eval" and isinstance(values.get("data"), str) and values["data"] in sub.all_stages:
        deps.append(_stage_ref(stage, "data", values["data"], pipe, sub.all_stages))
    stage.deps = sorted(set(deps), key=lambda n: [s.name for s in pipe.stages].index(n))
    return stage


def _training_kinds() -> list[str]:
    from lmforge.recipes import kinds

    return [spec.name for spec in kinds()]


def _stage_ref(stage: Stage, key: str, value: Any, pipe: Pipeline, all_names: list[str]) -> str:
    where = f"{pipe.path}: {stage.where()}: {key}"
    earlier = [s.name for s in pipe.stages]
    if not isinstance(value, str) or not value:
        raise LMForgeError(f"{where} must name an earlier stage, got {value!r}")
    if value == stage.name:
        raise LMForgeError(f"{where}: names the stage itself; name an earlier stage")
    if value not in earlier:
        if value in all_names:
            raise LMForgeError(f"{where}: {value!r} comes later in the file; a stage can only use stages above it")
        raise LMForgeError(f"{where}: {value!r} is not an earlier stage.{_hint(value, earlier)} A stage can only "
                           f"use stages above it: {', '.join(earlier) or 'none'}")
    return value


def _validate_stage(stage: Stage, pipe: Pipeline) -> None:
    where = f"{pipe.path}: {stage.where()}"
    v = stage.values
    try:
        if stage.training:
            _validate_training(stage, pipe)
        elif stage.kind == "tokenizer":
            _validate_tokenizer(stage, pipe)
        elif stage.kind == "data":
            gen = v.get("generator")
            if gen not in GENERATORS:
                raise LMForgeError(f"'generator' must be one of {', '.join(GENERATORS)}, got {gen!r}."
                                   f"{_hint(gen, GENERATORS)}")
            args = v.get("args") or {}
            if not isinstance(args, dict):
                raise LMForgeError(f"'args' must be a mapping of the {gen} generator's arguments, got {args!r}")
            check_call_args(GENERATORS[gen].load(), args, GENERATORS[gen].fills, "args")
        elif stage.kind == "eval":
            _validate_eval(stage, pipe)
        elif stage.kind == "export":
            _need_training_stage(stage, "checkpoint", pipe)
            formats = v.get("formats", ["hf"])
            formats = [formats] if isinstance(formats, str) else formats
            if not isinstance(formats, list) or not formats or any(f not in EXPORT_FORMATS for f in formats):
                raise LMForgeError(f"'formats' must be a list of {', '.join(EXPORT_FORMATS)}, got {v.get('formats')!r}")
            if v.get("gguf_dtype", "f16") not in GGUF_DTYPES:
                raise LMForgeError(f"'gguf_dtype' must be one of {', '.join(GGUF_DTYPES)}, got {v['gguf_dtype']!r}")
        elif stage.kind == "serve":
            _need_training_stage(stage, "checkpoint", pipe)
            port = v.get("port", 8000)
            if not isinstance(port, int) or not 0 <= port < 65536:
                raise LMForgeError(f"'port' must be a TCP port number, got {port!r}")
    except LMForgeError as e:
        if str(e).startswith(str(pipe.path)):
            raise
        raise LMForgeError(f"{where}: {e}") from e


def check_call_args(fn, args: dict[str, Any], fills: tuple[str, ...], what: str) -> None:
    """Every key of ``args`` is a parameter of ``fn`` (and not one the pipeline fills itself)."""
    params = [p for p in inspect.signature(fn).parameters if p not in fills]
    for key in args:
        if key not in params:
            raise LMForgeError(f"unknown key {what}.{key} for {fn.__module__}.{fn.__name__}().{_hint(key, params)} "
                               f"Valid: {', '.join(params)}")


def _need_training_stage(stage: Stage, key: str, pipe: Pipeline, required: bool = True) -> Stage | None:
    name = stage.values.get(key)
    if name is None:
        if required:
            raise LMForgeError(f"'{key}' is required: the name of the training stage whose model it takes")
        return None
    other = pipe.stage(name)
    if not other.training:
        raise LMForgeError(f"'{key}: {name}' names a {other.kind} stage; it must name a training stage (its "
                           "checkpoint)")
    return other


def _validate_tokenizer(stage: Stage, pipe: Pipeline) -> None:
    from lmforge.data import train_tokenizer_from_sources

    v = stage.values
    sources = v.get("sources")
    if isinstance(sources, str):
        sources = [sources]
    if not isinstance(sources, list) or not sources or not all(isinstance(s, str) and s for s in sources):
        raise LMForgeError(f"'sources' must be a list of paths (files or directories), got {v.get('sources')!r}")
    v["sources"] = sources
    if "include" in v and isinstance(v["include"], str):
        v["include"] = [v["include"]]
    _check_values(v)
    vocab = v.get("vocab_size")
    if not isinstance(vocab, int) or vocab <= 0:
        raise LMForgeError(f"'vocab_size' is required: a positive number of tokens, got {vocab!r}")
    check_call_args(train_tokenizer_from_sources, {k: x for k, x in v.items() if k != "sources"},
                    ("sources", "out_dir", "show_progress", "overwrite"), "")
    for src in sources:
        check_input_path(src, pipe, "sources")


def _whole(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _strings(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(s, str) and s for s in x)


# A stage key's form, checked before anything runs: (test, what it must be).
VALUE_RULES: dict[str, tuple[Any, str]] = {
    "include": (_strings, "a list of glob patterns (strings)"),
    "max_bytes": (lambda x: _whole(x) and x > 0, "a whole number of bytes > 0"),
    "text_field": (lambda x: isinstance(x, str) and bool(x), "a field name (a string)"),
    "exclude_tests": (lambda x: isinstance(x, bool), "true or false"),
    "min_frequency": (lambda x: _whole(x) and x >= 1, "a whole number >= 1"),
    "heldout_fraction": (lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < 1,
                         "a fraction in [0, 1) (0.01 is typical)"),
    "seed": (_whole, "a whole number"),
    "split": (lambda x: isinstance(x, str) and bool(x), "a split's name (a string)"),
    "limit": (lambda x: _whole(x) and x >= 0, "a whole number >= 0 (0: all)"),
    "batch_size": (lambda x: _whole(x) and x >= 1, "a whole number >= 1"),
    "max_new_tokens": (lambda x: _whole(x) and x >= 1, "a whole number >= 1"),
    "metric": (lambda x: x is None or isinstance(x, str), "a figure's name (a string)"),
}


def _check_values(values: dict[str, Any]) -> None:
    for key, value in values.items():
        rule = VALUE_RULES.get(key)
        if rule is not None and not rule[0](value):
            raise LMForgeError(f"'{key}' must be {rule[1]}, got {value!r}")
    if "device" in values:
        _check_device(values["device"])


def _check_device(value: Any) -> None:
    """A stage's ``device`` names a device (whether this machine has it is ``check_devices``'s, at run time:
    a pipeline with ``device: cuda`` can be inspected on a machine without one)."""
    import torch

    if not isinstance(value, str) or not value:
        raise LMForgeError(f"'device' must be auto, cpu, cuda, cuda:N or mps, got {value!r}")
    if value == "auto":
        return
    try:
        torch.device(value)
    except RuntimeError:
        raise LMForgeError(f"'device' must be auto, cpu, cuda, cuda:N or mps, got {value!r}") from None


def check_devices(pipe: Pipeline, stages: list[Stage]) -> None:
    """Before a run: each of ``stages`` that names a ``device`` names one this machine has (the error now, not
    after the stages above it)."""
    import torch

    for stage in stages:
        value = stage.values.get("device", "auto")
        if stage.training or value == "auto":
            continue
        kind = torch.device(value).type
        missing = {"cuda": not torch.cuda.is_available(), "mps": not torch.backends.mps.is_available()}
        if missing.get(kind, False):
            raise LMForgeError(f"{pipe.path}: {stage.where()}: 'device: {value}', but this machine has no such device "
                               "(PyTorch sees none); use device: auto or cpu")


def check_input_path(path: str, pipe: Pipeline, key: str) -> None:
    """An input that no stage writes must exist now: a missing corpus is found before any compute."""
    p = Path(path)
    for s in pipe.stages:
        if _is_within(p, pipe.stage_dir(s.name)):
            return
    if not p.exists():
        raise LMForgeError(f"{key}: {path} does not exist")


def _is_within(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def _validate_eval(stage: Stage, pipe: Pipeline) -> None:
    v = stage.values
    task = v.get("task")
    if task not in EVAL_TASKS:
        raise LMForgeError(f"'task' must be one of {', '.join(EVAL_TASKS)}, got {task!r}.{_hint(task, EVAL_TASKS)}")
    own = EVAL_TASKS[task][0]
    _check_keys(v, ("task", "checkpoint", "baseline", "data", "metric", *own), f"task {task}")
    if "include" in v and isinstance(v["include"], str):
        v["include"] = [v["include"]]
    _check_values(v)
    _need_training_stage(stage, "checkpoint", pipe)
    _need_training_stage(stage, "baseline", pipe, required=False)
    data = v.get("data")
    if not isinstance(data, str) or not data:
        raise LMForgeError("'data' is required: a data stage's name or a path")
    names = [s.name for s in pipe.stages]
    if data in names:
        if pipe.stage(data).kind != "data":
            raise LMForgeError(f"'data: {data}' names a {pipe.stage(data).kind} stage; name a data stage or a path")
    else:
        check_input_path(data, pipe, "data")
    metric, figures = v.get("metric"), _eval_figures(task)  # the evaluator can be imported
    if metric:  # a misspelt name would otherwise stop the stage only after its evaluation ran
        if metric not in figures:
            raise LMForgeError(f"'metric: {metric}' is not a {task} figure.{_hint(metric, figures)} The figures: "
                               f"{', '.join(figures)}")


def _eval_figures(task: str) -> tuple[str, ...]:
    """The figures an eval task reports, by name (``metric:`` picks the headline among them)."""
    import importlib

    module, name = EVAL_TASKS[task][2]
    try:
        return tuple(getattr(importlib.import_module(module), name))
    except ImportError as e:
        raise LMForgeError(f"task {task} needs {module}, which this lmforge installation does not have ({e})") from e


# ---- training stages -----------------------------------------------------------------------------
def nested(values: dict[str, Any], where: str) -> dict[str, Any]:
    """``{"training.max_steps": 3, "model": {"n_layer": 2}}`` -> nested dicts (dotted keys split)."""
    from lmforge.config import deep_merge

    if not isinstance(values, dict):
        raise LMForgeError(f"{where} must be a mapping of keys (nested or dotted), got {values!r}")
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            value = nested(value, f"{where}.{key}")
        elif isinstance(value, str) and FLOAT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-4 and 1.0e12 as strings; a config means the number
        parts = str(key).split(".")
        for part in reversed(parts[1:]):
            value = {part: value}
        out = deep_merge(out, {parts[0]: value})
    return out


def training_values(stage: Stage, pipe: Pipeline, init_model: dict[str, Any] | None, init_path: str | None,
                    tokenizer_path: str | None) -> dict[str, Any]:
    """The stage's config layer (above its recipe): the pipeline's name/out_dir, the init weights and
    their model config, the tokenizer, then the stage's ``data`` and ``overrides``."""
    from lmforge.config import deep_merge

    v = stage.values
    data = nested(v.get("data") or {}, "data")
    overrides = nested(v.get("overrides") or {}, "overrides")
    for key in ("name", "out_dir"):
        if key in overrides:
            raise LMForgeError(f"overrides.{key}: the pipeline sets it (the run directory is OUT_DIR/STAGE); remove it")
    if v.get("init") and "init_from" in (overrides.get("training") or {}):
        raise LMForgeError("overrides.training.init_from and init are both given; keep init")
    if v.get("tokenizer") and "tokenizer" in data:
        raise LMForgeError("data.tokenizer and tokenizer are both given; keep one")
    layer: dict[str, Any] = {"name": stage.name, "out_dir": str(pipe.out_dir), "kind": stage.kind}
    if init_path is not None:
        layer["training"] = {"init_from": init_path}
        if init_model is not None:
            layer["model"] = dict(init_model)
    if tokenizer_path is not None and "tokenizer" not in data:
        layer["data"] = {"tokenizer": tokenizer_path}
    layer = deep_merge(layer, {"data": data} if data else {})
    return deep_merge(layer, overrides)


def stage_processes(stage: Stage) -> int:
    """A training stage's ``processes``: how many processes train it on this machine (``torchrun
    --standalone --nproc_per_node N``; 1, the default, trains in the pipeline's own process unless the
    stage shards its model: ``training.parallel`` fsdp / hsdp runs under torchrun on one process too)."""
    value = stage.values.get("processes", 1)
    if isinstance(value, str) and value.strip().isdigit():  # from a ${vars.NAME} inside a string
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LMForgeError(f"'processes' must be a whole number >= 1 (processes on this machine, one per GPU), "
                           f"got {value!r}")
    if value > 1 and sys.platform == "win32":
        raise LMForgeError("'processes' > 1 runs the stage under torchrun and stops it by passing signals on, "
                           "which needs Linux or macOS; on Windows train such a stage with `lmforge train`")
    return value


def _validate_training(stage: Stage, pipe: Pipeline) -> None:
    from lmforge.config import read_recipe

    v = stage.values
    recipe = v.get("recipe")
    if recipe is not None:
        if not isinstance(recipe, str) or not recipe:
            raise LMForgeError(f"'recipe' must be a recipe name or a YAML path, got {recipe!r}")
        v["recipe"] = recipe = _recipe_path(recipe, pipe)
        given = read_recipe(recipe).get("kind")
        if given and given != stage.kind:
            raise LMForgeError(f"recipe {recipe} is a {given!r} recipe but the stage's kind is {stage.kind!r}")
    if v.get("init"):
        _need_training_stage(stage, "init", pipe)
    if v.get("tokenizer"):
        other = pipe.stage(v["tokenizer"])
        if other.kind != "tokenizer" and not other.training:
            raise LMForgeError(f"'tokenizer: {other.name}' names a {other.kind} stage; name a tokenizer stage (or a "
                               "training stage, whose tokenizer is taken)")
    cfg = resolve_training_config(stage, pipe, runtime=False)
    processes = stage_processes(stage)
    from lmforge.train.fsdp import check_kind

    check_kind(cfg.training.parallel, cfg.spec)
    if cfg.training.parallel != "ddp" and processes == 1 and sys.platform == "win32":
        raise LMForgeError(f"training.parallel={cfg.training.parallel} runs the stage under torchrun, which the "
                           "pipeline stops by passing signals on: that needs Linux or macOS")
    for key in ("path", "train_path", "val_path", "tokenizer"):
        value = getattr(cfg.data, key, "")
        if value:
            check_input_path(value, pipe, f"data.{key}")
    pipe.configs[stage.name] = cfg


def _recipe_path(recipe: str, pipe: Pipeline) -> str:
    """A recipe name, a path, or a path relative to the pipeline file."""
    p = Path(recipe)
    if p.suffix in (".yaml", ".yml") and not p.is_absolute() and not p.is_file():
        beside = pipe.path.parent / p
        if beside.is_file():
            return str(beside)
    return recipe


def init_model_config(stage: Stage, pipe: Pipeline, runtime: bool) -> dict[str, Any] | None:
    """The model section a stage with ``init`` starts from: the init checkpoint's own config.yaml (at run
    time), or the earlier stage's resolved model config (when validating, before it exists). None when
    the stage's kind does not train that model family (then its own config must match)."""
    from lmforge.checkpoint import resolve_model_dir
    from lmforge.recipes import get_kind

    source = pipe.stage(stage.values["init"])
    model: dict[str, Any] | None = None
    if runtime:
        cfg_file = resolve_model_dir(pipe.stage_dir(source.name)) / "config.yaml"
        loaded = yaml.safe_load(cfg_file.read_text())
        model = loaded if isinstance(loaded, dict) else None
    if model is None:
        cfg = pipe.configs.get(source.name)
        model = cfg.to_dict().get("model") if cfg is not None else None
    if not model or model.get("family") not in get_kind(stage.kind).family_names():
        return None
    return model


def resolve_training_config(stage: Stage, pipe: Pipeline, runtime: bool):
    """The stage's ``RunConfig``: its recipe, then ``training_values``. With ``runtime`` the earlier stages'
    outputs exist and their real paths (best checkpoint, model config) are used."""
    from lmforge.checkpoint import resolve_model_dir
    from lmforge.config import load_config

    v = stage.values
    init_path = init_model = tok = None
    if v.get("init"):
        run_dir = pipe.stage_dir(v["init"])
        init_path = str(resolve_model_dir(run_dir) if runtime else run_dir)
        init_model = init_model_config(stage, pipe, runtime)
    tok_stage = v.get("tokenizer") or v.get("init")
    if tok_stage:
        source = pipe.stage(tok_stage)
        if source.training:
            tok = str(resolve_model_dir(pipe.stage_dir(source.name)) if runtime else pipe.stage_dir(source.name))
        else:
            tok = str(pipe.stage_dir(source.name))
        if not v.get("tokenizer") and init_model is None:
            tok = None  # a kind that takes its model from init_from takes its tokenizer from there too
    values = training_values(stage, pipe, init_model, init_path, tok)
    return load_config(v.get("recipe"), values=values)
