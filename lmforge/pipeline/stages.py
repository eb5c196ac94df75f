"""Each stage kind's three parts: what its fingerprint is made of (``stage_inputs``), how it runs
(``run_stage``), and whether its output is there (``output_exists``).

Training stages run ``lmforge.train.train`` into OUT_DIR/STAGE; the others write into a hidden
temporary sibling of OUT_DIR/STAGE that is renamed into place once complete, so an output that exists
is a whole one.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.errors import LMForgeError
from lmforge.files import remove_stale, temporary_sibling
from lmforge.pipeline.signals import Terminated, signals_deferred
from lmforge.pipeline.spec import (
    EVAL_TASKS,
    GENERATORS,
    Pipeline,
    Stage,
    resolve_training_config,
    stage_processes,
)
from lmforge.pipeline.state import HashCache, MissingInput, digest

# Config keys that do not change what a training stage produces: where it is written, how it is logged,
# how often it is checkpointed. Input paths are left out too: their contents are hashed instead.
NOT_FINGERPRINTED = {
    "": ("name", "out_dir", "resume_from_checkpoint", "logging"),
    "training": ("init_from", "log_interval", "peak_flops", "save_interval", "keep_last"),
    "data": ("path", "train_path", "val_path", "tokenizer"),
}
EVAL_FILE = "metrics.json"


@dataclass
class Outcome:
    headline: dict[str, Any] | None = None  # {"metric", "value", "text"} shown by `pipeline status`
    interrupted: bool = False  # a training run stopped by a signal: resumable
    signal: int | None = None  # which signal stopped it (SIGTERM 15, SIGINT 2)
    step: int | None = None
    details: dict[str, Any] = field(default_factory=dict)


# ---- outputs ---------------------------------------------------------------------------------------
def model_dir(pipe: Pipeline, name: str) -> Path:
    """A training stage's model: its best checkpoint, else its latest (``resolve_model_dir``)."""
    from lmforge.checkpoint import resolve_model_dir

    try:
        return resolve_model_dir(pipe.stage_dir(name))
    except LMForgeError as e:
        raise MissingInput(f"stage {name!r} has no checkpoint yet") from e


def latest_step(run_dir: Path) -> int | None:
    from lmforge.checkpoint import list_checkpoints

    found = list_checkpoints(run_dir / "checkpoints")
    return found[-1][0] if found else None


def output_exists(stage: Stage, pipe: Pipeline) -> bool:
    out = pipe.stage_dir(stage.name)
    if stage.training:
        return latest_step(out) is not None
    if stage.kind == "tokenizer":
        return (out / "tokenizer.json").is_file()
    if stage.kind == "eval":
        return (out / EVAL_FILE).is_file()
    if stage.kind == "export":
        return out.is_dir() and all(p.exists() for p in export_paths(stage, pipe, out).values())
    if stage.kind == "data":
        return out.is_dir() and any(out.iterdir())
    return True  # serve writes nothing


def reusable_outputs(stage: Stage, pipe: Pipeline, failure: str = "") -> tuple[list[tuple[Path, str]], str]:
    """What an earlier attempt at a training stage that stopped before its first checkpoint left that a rerun
    from step 0 can take over, as (path, what it is): the data the run prepared into RUN_DIR/data; and, when
    RUN_DIR/data is there but not taken over, why not ("" otherwise). Only what is whole and what the recipe
    would take counts. The lm kind's tokenized data.train_path is built under a hidden name and renamed into
    place with its meta.json inside; it counts when the recipe would reuse it (``prepared_data_mismatch``:
    prepared from these paths, with this tokenizer) and the loader opens each of its splits (their shards
    all there, of the sizes meta.json gives). hrgc's tokenizer trained on its data is written file by
    file, tokenizer.json renamed into place last; it counts when it loads. ``failure``: the error the
    attempt failed with; one that names RUN_DIR/data (a damaged shard the loader refused in training,
    which no cheap check finds) leaves the data to be prepared again. Anything else there (a half-written
    checkpoint, a temporary directory, the attempt's logs) is not reused."""
    data = pipe.stage_dir(stage.name) / "data"
    if not (data / "meta.json").is_file() and not (data / "tokenizer.json").is_file():
        return [], ""
    if failure and any(str(p) in failure for p in (data, data.resolve())):
        return [], "the failed attempt's error is about that data"
    try:
        if (data / "meta.json").is_file():
            why = _tokenized_data_mismatch(stage, pipe, data)
            return ([(data, "tokenized data")], "") if why is None else ([], why)
        from lmforge.tokenizer import Tokenizer

        Tokenizer.load(data / "tokenizer.json")
        return [(data, "trained tokenizer")], ""
    except (LMForgeError, OSError, KeyError, TypeError, ValueError) as e:  # (a meta.json of an odd shape)
        return [], str(e) if isinstance(e, LMForgeError) else f"{data} is unreadable ({type(e).__name__}: {e})"


def _tokenized_data_mismatch(stage: Stage, pipe: Pipeline, data: Path) -> str | None:
    """Why the tokenized data in RUN_DIR/data is not what a rerun of the stage would train on (None: it is):
    not where the recipe reads it, not what it would prepare (the recipe's own test), or a split the
    loader cannot open (a shard missing or cut short). LMForgeError when its meta.json cannot be read."""
    from lmforge.data.loader import TokenDataset, read_meta
    from lmforge.recipes.lm.data import prepared_data_mismatch, token_data_dir

    cfg = resolve_training_config(stage, pipe, runtime=True)
    if not cfg.data.train_path or token_data_dir(cfg).resolve() != data.resolve():
        return f"the stage does not prepare data.train_path into {data}"
    why = prepared_data_mismatch(cfg, data)
    if why is None:
        for split in read_meta(data)["splits"]:
            TokenDataset(data, split)  # checks each shard's size (what the loader refuses at once)
    return why


def export_paths(stage: Stage, pipe: Pipeline, root: Path) -> dict[str, Path]:
    formats = stage.values.get("formats", ["hf"])
    formats = [formats] if isinstance(formats, str) else formats
    dtype = stage.values.get("gguf_dtype", "f16")
    return {f: root / "hf" if f == "hf" else root / f"{pipe.name}-{dtype}.gguf" for f in formats}


def eval_data_path(stage: Stage, pipe: Pipeline) -> Path:
    data = stage.values["data"]
    return pipe.stage_dir(data) if data in [s.name for s in pipe.stages] else Path(data)


# ---- fingerprints ----------------------------------------------------------------------------------
def fingerprint_config(cfg) -> dict[str, Any]:
    d = cfg.to_dict()
    for section, keys in NOT_FINGERPRINTED.items():
        node = d.get(section, {}) if section else d
        for key in keys:
            node.pop(key, None)
    return d


def stage_inputs(stage: Stage, pipe: Pipeline, cache: HashCache) -> dict[str, Any]:
    """What a stage's result depends on, as hashes (file contents, weights, the resolved config). Raises
    ``MissingInput`` when an earlier stage's output is not there."""
    for dep in stage.deps:
        if not output_exists(pipe.stage(dep), pipe):
            raise MissingInput(f"stage {dep!r} has no output yet")
    v = stage.values
    if stage.training:
        cfg = resolve_training_config(stage, pipe, runtime=True)
        inputs: dict[str, Any] = {"config": digest(fingerprint_config(cfg))}
        if stage_processes(stage) > 1:  # the global batch (and so the result) depends on it
            inputs["processes"] = stage_processes(stage)
        if cfg.training.init_from:
            inputs["init"] = cache.model(model_dir_of(cfg.training.init_from))
        for key in ("path", "train_path", "val_path"):
            if getattr(cfg.data, key):
                inputs[f"data.{key}"] = cache.path(getattr(cfg.data, key))
        if cfg.data.tokenizer:
            inputs["tokenizer"] = cache.tokenizer(cfg.data.tokenizer)
        # Other stages' outputs the stage reads through ${stages.NAME.out} (a ppo stage's reward model, a
        # dpo stage's preferences ...): their contents, so that a rerun of one makes this stage stale.
        for dep in stage.deps:
            other = pipe.stage(dep)
            inputs[f"stage:{dep}"] = (cache.model(model_dir(pipe, dep)) if other.training
                                      else cache.path(pipe.stage_dir(dep)))
        return inputs
    # The quick stages also depend on the lmforge code that computes them (a generator that changed
    # writes other data): they run again after such a change, and the stages after them only if what
    # they wrote differs. Training stages do not: an lmforge upgrade would otherwise retrain everything.
    if stage.kind == "tokenizer":
        settings = {k: x for k, x in v.items() if k != "sources"}
        return {"settings": digest(settings), "sources": [cache.path(s) for s in v["sources"]],
                "code": code_hash(cache, *TOKENIZER_CODE)}
    if stage.kind == "data":
        return {"generator": v["generator"], "args": digest(v.get("args") or {}),
                "code": code_hash(cache, GENERATORS[v["generator"]].module)}
    if stage.kind == "eval":
        inputs = {"settings": digest({k: x for k, x in v.items() if k not in ("checkpoint", "baseline", "data")}),
                  "checkpoint": cache.model(model_dir(pipe, v["checkpoint"])),
                  "data": cache.path(eval_data_path(stage, pipe)), "code": code_hash(cache, *EVAL_CODE[v["task"]])}
        if v.get("baseline"):
            inputs["baseline"] = cache.model(model_dir(pipe, v["baseline"]))
        return inputs
    if stage.kind == "export":
        return {"settings": digest({k: x for k, x in v.items() if k != "checkpoint"}),
                "checkpoint": cache.model(model_dir(pipe, v["checkpoint"])), "code": code_hash(cache, *EXPORT_CODE)}
    return {}


TOKENIZER_CODE = ("lmforge.tokenizer", "lmforge.data.sources", "lmforge.data.prepare")
EVAL_CODE = {"lm": ("lmforge.eval.lm",), "tool-calls": (GENERATORS["tool-calls"].module,)}
EXPORT_CODE = ("lmforge.export.hf", "lmforge.export.gguf", "lmforge.models.hf_compat")


def code_hash(cache: HashCache, *modules: str) -> str:
    """The hash of the source files of lmforge modules (not imported: found by name)."""
    import importlib.util

    files = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin:
            raise MissingInput(f"module {name} is not installed")
        files.append(cache.file(Path(spec.origin)))
    return digest(files)


def model_dir_of(path: str) -> Path:
    from lmforge.checkpoint import resolve_model_dir

    try:
        return resolve_model_dir(path)
    except LMForgeError as e:
        raise MissingInput(str(e)) from e


# ---- running ---------------------------------------------------------------------------------------
def run_stage(stage: Stage, pipe: Pipeline, resume: bool) -> Outcome:
    if stage.training:
        return _run_training(stage, pipe, resume)
    out = pipe.stage_dir(stage.name)
    remove_stale(out)
    tmp = temporary_sibling(out)
    try:
        outcome = RUNNERS[stage.kind](stage, pipe, tmp)
        os.rename(tmp, out)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)  # our own unfinished output; the stage reruns whole
        raise
    return outcome


def _run_training(stage: Stage, pipe: Pipeline, resume: bool) -> Outcome:
    from lmforge.train import train

    cfg = resolve_training_config(stage, pipe, runtime=True)
    processes = stage_processes(stage)
    # FSDP needs a process group even on one process (training.fsdp_offload on one GPU): torchrun gives it
    if processes > 1 or cfg.training.parallel != "ddp":
        step, stopped, max_steps, signum = _torchrun(cfg, stage, pipe, processes, resume)
    else:
        result = train(cfg, resume=resume)
        step, stopped, max_steps, signum = result.step, result.stopped, cfg.training.max_steps, result.signal
    return Outcome(headline=training_headline(cfg.run_dir, cfg.spec), interrupted=stopped == "signal",
                   signal=signum if stopped == "signal" else None, step=step,
                   details={"stopped": stopped, "max_steps": max_steps})


DONE_LINE = re.compile(r"^done: step (\d+) \(([^)]*)\)")  # what `lmforge train` prints last (process 0)
ERROR_LINE = re.compile(r"lmforge: error: (.*)")  # what `lmforge train` prints on a bad config or input
# How long torchrun lets the processes take to checkpoint and stop after a signal (its default, 30 s,
# can be too short to write a large model's checkpoint); a value the user set wins.
SHUTDOWN_SECONDS = "600"


def _torchrun(cfg, stage: Stage, pipe: Pipeline, processes: int, resume: bool) -> tuple[int, str, int, int | None]:
    """Train ``cfg`` with ``torchrun --standalone --nproc_per_node PROCESSES -m lmforge train`` on its
    resolved config (written beside the run directory while it runs); its output passes through.
    Returns the step, why it stopped (from process 0's last line), the run's max_steps, and the signal
    that stopped it (the one passed on; SIGTERM for one the processes got from elsewhere, a scheduler's).

    torchrun runs in a session of its own, so the terminal's Ctrl-C reaches only this process, which
    sends it (or a SIGTERM it got) on to torchrun once: torchrun hands it to the processes, which
    checkpoint and stop, and the stage is recorded as interrupted and resumes. A second Ctrl-C is not
    passed on (the checkpoint being written would be cut). A signal that stops the processes before they
    can checkpoint (while they prepare their data) stops the run as it would in one process: a SIGTERM
    raises ``Terminated``, a Ctrl-C KeyboardInterrupt. If this process fails while they run, they are
    stopped before the error goes on."""
    import gc
    import signal
    import subprocess
    import sys
    import threading

    import torch
    import yaml

    import lmforge
    from lmforge.device import check_gpu_count

    # this machine's GPUs, checked now (not when the file is read: `pipeline status` may run elsewhere)
    check_gpu_count(processes, cfg.training.device)
    config = pipe.out_dir / f".{stage.name}.torchrun.yaml"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
           "-m", "lmforge", "train", str(config), *(["--resume"] if resume else [])]
    env = dict(os.environ)
    # the processes import this lmforge, and share this machine's cores (torchrun's default is 1 thread each)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(lmforge.__file__).resolve().parents[1]),
                                         *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // processes)))
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_SECONDS)
    gc.collect()
    if torch.cuda.is_available():  # an earlier stage's cached memory would crowd process 0's GPU
        torch.cuda.empty_cache()
    done, error, stopping = None, [], []
    proc: subprocess.Popen | None = None

    def stop(signum, _frame) -> None:
        if not stopping and proc is not None and proc.poll() is None:
            proc.send_signal(signum)
        stopping.append(signum)

    def pass_stderr() -> None:  # on a thread: both pipes are read, so neither fills up
        for line in proc.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()
            found = ERROR_LINE.search(line)
            if found:
                error[:] = [found.group(1).strip()]

    errors = threading.Thread(target=pass_stderr, daemon=True)
    # Signal handlers can only be set from the main thread (a pipeline run from another thread leaves
    # SIGTERM to whatever that program does with it, and so does one that was started ignoring it).
    handle = (threading.current_thread() is threading.main_thread()
              and signal.getsignal(signal.SIGTERM) != signal.SIG_IGN)
    previous, installed = None, False
    try:  # from here on, whatever stops this process stops torchrun too and removes the launch config
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        if handle:
            previous, installed = signal.signal(signal.SIGTERM, stop), True
        while True:
            try:
                if proc is None:
                    # Started with SIGINT and SIGTERM held back: one that comes meanwhile is passed on (or
                    # raised here, inside this try) once `proc` is set, never leaving torchrun running unseen.
                    with signals_deferred():
                        if stopping:  # stopped before torchrun started: it is not started
                            break
                        print(f"  {processes} process{'es' if processes > 1 else ''}: {' '.join(cmd[1:])}",
                              flush=True)
                        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                                errors="replace", bufsize=1, env=env, start_new_session=True)
                        errors.start()
                for line in proc.stdout:
                    if line.startswith(f"resume with: lmforge train {config}"):
                        continue  # that file is gone afterwards: the pipeline says how to resume
                    sys.stdout.write(line)
                    sys.stdout.flush()
                    done = DONE_LINE.match(line) or done
                proc.wait()
                break
            except KeyboardInterrupt:  # keep reading until the processes have saved and stopped
                stop(signal.SIGINT, None)
    finally:
        if installed:  # (None: a handler set outside Python; the default is the closest)
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        if proc is not None and proc.poll() is None:  # this process failed (a closed stdout, say): stop them
            proc.terminate()
            try:
                proc.wait(timeout=float(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) + 30)
            except (subprocess.TimeoutExpired, ValueError):
                proc.kill()
        if errors.is_alive():
            errors.join(timeout=10)
        config.unlink(missing_ok=True)
    if done is not None and (proc.returncode == 0 or done.group(2) == "signal"):
        saved = yaml.safe_load((cfg.run_dir / "config.yaml").read_text()) or {}  # epochs resolved to steps
        max_steps = int((saved.get("training") or {}).get("max_steps", cfg.training.max_steps))
        signum = (stopping[0] if stopping else signal.SIGTERM) if done.group(2) == "signal" else None
        return int(done.group(1)), done.group(2), max_steps, signum  # torchrun exits non-zero after a signal
    if stopping:  # stopped before the processes could checkpoint (while they prepared their data, say)
        raise Terminated("signal SIGTERM (passed on to torchrun)") if signal.SIGTERM in stopping else KeyboardInterrupt
    why = error[0] if error else "their errors are printed above"
    raise LMForgeError(f"{processes} training process{'es' if processes > 1 else ''} (torchrun) failed with exit code "
                       f"{proc.returncode}: {why}")


def training_headline(run_dir: Path, spec) -> dict[str, Any] | None:
    """The best value of the kind's best metric (what picked checkpoints/best) in metrics.jsonl."""
    metric, best = spec.best_metric, None
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        value = row.get(metric) if isinstance(row, dict) else None
        if isinstance(value, (int, float)) and math.isfinite(value):
            if best is None or (value > best if spec.best_higher_is_better else value < best):
                best = float(value)
    if best is None:
        return None
    return {"metric": metric, "value": best, "text": f"{metric} {best:.4f}"}


def _run_tokenizer(stage: Stage, pipe: Pipeline, tmp: Path) -> Outcome:
    from lmforge.data import train_tokenizer_from_sources

    v = stage.values
    kwargs = {k: x for k, x in v.items() if k not in ("sources", "include")}
    if "include" in v:
        kwargs["include"] = tuple(v["include"])
    report = train_tokenizer_from_sources(v["sources"], tmp, show_progress=False, overwrite=True, **kwargs)
    report["tokenizer"] = str(pipe.stage_dir(stage.name) / "tokenizer.json")
    (tmp / "report.json").write_text(json.dumps(report, indent=2))
    bpt = report.get("heldout_bytes_per_token")
    headline = {"metric": "heldout_bytes_per_token", "value": bpt,
                "text": f"vocab {report['vocab_size']}" + (f", {bpt:.2f} bytes/token held out" if bpt else "")}
    print(f"  tokenizer: vocab {report['vocab_size']}, trained on {report['train_documents']} documents "
          f"({report['train_bytes'] / 1e6:.1f} MB)" + (f"; {bpt:.3f} bytes/token held out" if bpt else ""))
    return Outcome(headline=headline)


def _run_data(stage: Stage, pipe: Pipeline, tmp: Path) -> Outcome:
    v = stage.values
    generator = GENERATORS[v["generator"]]
    fn = generator.load()
    args = dict(v.get("args") or {})
    fn(tmp, **args)
    if not tmp.is_dir():
        raise LMForgeError(f"the {v['generator']} generator wrote no directory {tmp}")
    files = [p for p in tmp.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    text = f"{len(files)} files, {size / 1e6:.1f} MB"
    print(f"  {v['generator']}: {text}")
    return Outcome(headline={"metric": "bytes", "value": size, "text": text})


def _run_eval(stage: Stage, pipe: Pipeline, tmp: Path) -> Outcome:
    v = stage.values
    task = v["task"]
    tmp.mkdir(parents=True)
    scored: dict[str, Any] = {"task": task, "data": str(eval_data_path(stage, pipe))}
    for role in ("checkpoint", "baseline"):
        if v.get(role):
            path = model_dir(pipe, v[role])
            print(f"  {task} eval of {v[role]} ({path})")
            metrics = EVALUATORS[task](stage, pipe, path)
            scored[role] = {"stage": v[role], "path": str(path), "metrics": metrics}
    metric = v.get("metric") or EVAL_TASKS[task][1]
    figures = scored["checkpoint"]["metrics"]
    numeric = [k for k, x in figures.items() if isinstance(x, (int, float)) and not isinstance(x, bool)]
    if not metric:
        metric = numeric[0] if numeric else ""
    if metric not in numeric:
        raise LMForgeError(f"stage {stage.name!r}: metric {metric!r} is not among the {task} figures: "
                           f"{', '.join(numeric) or 'none'}; set metric: to one of them")
    scored["metric"] = metric
    (tmp / EVAL_FILE).write_text(json.dumps(scored, indent=2, default=str))
    value = float(figures[metric])
    text = f"{metric} {value:.4f}"
    headline: dict[str, Any] = {"metric": metric, "value": value, "text": text}
    if "baseline" in scored:
        base = scored["baseline"]["metrics"].get(metric)
        if isinstance(base, (int, float)):
            headline["baseline"] = float(base)
            headline["text"] = f"{text} ({v['baseline']}: {base:.4f})"
    for role in ("checkpoint", "baseline"):
        if role in scored:
            shown = ", ".join(f"{k} {x:.4f}" if isinstance(x, float) else f"{k} {x}"
                              for k, x in scored[role]["metrics"].items()
                              if isinstance(x, (int, float)) and not isinstance(x, bool))
            print(f"  {scored[role]['stage']}: {shown}")
    return Outcome(headline=headline)


def _eval_lm(stage: Stage, pipe: Pipeline, path: Path) -> dict[str, Any]:
    from lmforge.eval.lm import evaluate

    v = stage.values
    return evaluate(path, eval_data_path(stage, pipe), split=v.get("split", "val"),
                    max_tokens=v.get("limit") or None, batch_size=v.get("batch_size", 8),
                    device=v.get("device", "auto"), include=tuple(v.get("include") or ()), progress=False)


def _eval_tool_calls(stage: Stage, pipe: Pipeline, path: Path) -> dict[str, Any]:
    import importlib

    from lmforge.infer.loading import load_for_inference

    toolcalls = importlib.import_module(GENERATORS["tool-calls"].module)  # the evaluator lives beside the data
    v = stage.values
    rows = toolcalls.load_rows(eval_data_path(stage, pipe), split=v.get("split", "test"))
    if v.get("limit"):
        rows = rows[: int(v["limit"])]
    model, tokenizer, _ = load_for_inference(path, v.get("device", "auto"))
    kwargs = {k: v[k] for k in ("max_new_tokens", "batch_size") if k in v}
    result = toolcalls.evaluate_tool_calls(model, tokenizer, rows, **kwargs)
    return dict(result) if not isinstance(result, dict) else result


def _run_export(stage: Stage, pipe: Pipeline, tmp: Path) -> Outcome:
    from lmforge.export import export_hf
    from lmforge.export.gguf import export_gguf

    v = stage.values
    source = model_dir(pipe, v["checkpoint"])
    tmp.mkdir(parents=True)
    parts = []
    for fmt, path in export_paths(stage, pipe, tmp).items():
        if fmt == "hf":
            export_hf(source, path)
            parts.append("hf")
        else:
            dtype = v.get("gguf_dtype", "f16")
            export_gguf(source, path, dtype=dtype)
            parts.append(f"gguf {dtype} {path.stat().st_size / 2**20:.1f} MiB")
        print(f"  {fmt}: {pipe.stage_dir(stage.name) / path.name} (from {source})")
    return Outcome(headline={"metric": "formats", "value": len(parts), "text": ", ".join(parts)})


RUNNERS = {"tokenizer": _run_tokenizer, "data": _run_data, "eval": _run_eval, "export": _run_export}
EVALUATORS = {"lm": _eval_lm, "tool-calls": _eval_tool_calls}


# ---- describing ------------------------------------------------------------------------------------
def describe(stage: Stage, pipe: Pipeline) -> str:
    """One line on what a stage does, for its header."""
    v = stage.values
    if stage.training:
        cfg = pipe.configs.get(stage.name)
        parts = [f"recipe {Path(v['recipe']).stem}" if v.get("recipe") else "no recipe"]
        if cfg is not None:
            data = cfg.data.train_path or cfg.data.path
            if data:
                parts.append(f"data {data}")
            t = cfg.training
            parts.append(f"{t.max_time_minutes:g} min" if t.schedule_over == "time" else f"{t.max_steps} steps")
            parts.append(f"lr {t.lr:g}")
        return ", ".join(parts)
    if stage.kind == "tokenizer":
        return f"vocab {v['vocab_size']} on {', '.join(v['sources'])}"
    if stage.kind == "data":
        args = ", ".join(f"{k}={x}" for k, x in (v.get("args") or {}).items())
        return f"generator {v['generator']}" + (f" ({args})" if args else "")
    if stage.kind == "eval":
        base = f" vs {v['baseline']}" if v.get("baseline") else ""
        return f"{v['task']} on {v['data']}: {v['checkpoint']}{base}"
    if stage.kind == "export":
        return f"{' + '.join(export_paths(stage, pipe, Path('.')))} of {v['checkpoint']}"
    return f"the model of {v['checkpoint']}"


def serve_command(stage: Stage, pipe: Pipeline) -> list[str]:
    v = stage.values
    try:
        path = str(model_dir(pipe, v["checkpoint"]))
    except MissingInput:
        path = str(pipe.stage_dir(v["checkpoint"]))
    cmd = ["lmforge", "serve", path, "--port", str(v.get("port", 8000))]
    if v.get("host"):
        cmd += ["--host", str(v["host"])]
    cmd += ["--model-name", str(v.get("model_name") or pipe.name)]
    if v.get("max_batch_size"):
        cmd += ["--max-batch-size", str(v["max_batch_size"])]
    return cmd
