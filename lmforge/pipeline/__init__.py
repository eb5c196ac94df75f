"""Staged pipelines: tokenizer -> language model -> code -> tools -> ... -> export and deploy, from one
YAML file (``configs/pipelines/*.yaml``; the format is in ``docs/pipeline.md``).

``run_pipeline(file)`` runs the stages in order. A stage whose fingerprint (the sha256 of its resolved
config and of the contents of everything it reads: init weights, data, tokenizer) matches the one
recorded when it last finished is skipped; a changed stage runs again, its earlier output moved aside
to OUT_DIR/STAGE.old-N (never deleted), and the stages after it see new inputs and run again too. A
training stage that was interrupted (a signal, a crash) resumes from its last checkpoint; one that
stopped before its first checkpoint trains again from step 0 on the data it had prepared. A SIGTERM
outside a training loop stops the run as Ctrl-C does (``Terminated``), the stage recorded as interrupted.
``pipeline_status(file)`` says where each stage stands without running anything.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lmforge.errors import LMForgeError
from lmforge.pipeline.signals import Terminated, signals_deferred, sigterm_interrupts
from lmforge.pipeline.spec import Pipeline, Stage, check_devices, load_pipeline
from lmforge.pipeline.stages import (
    describe,
    latest_step,
    output_exists,
    reusable_outputs,
    run_stage,
    serve_command,
    stage_inputs,
    training_headline,
)
from lmforge.pipeline.state import (
    MissingInput,
    PipelineState,
    RunLock,
    digest,
    now,
    run_in_progress,
)

__all__ = [
    "RunSummary",
    "StageStatus",
    "Terminated",
    "format_status",
    "load_pipeline",
    "pipeline_status",
    "run_pipeline",
    "serve_pipeline",
]


@dataclass
class StageRun:
    stage: str
    kind: str
    result: str  # ran | resumed | skipped | interrupted | failed | serve
    seconds: float = 0.0
    headline: str = ""
    signal: int | None = None  # what stopped an interrupted stage


@dataclass
class RunSummary:
    pipeline: str
    out_dir: str
    stages: list[StageRun] = field(default_factory=list)
    interrupted: str | None = None  # the stage a signal stopped (resumable)
    signal: int | None = None  # and which signal (SIGTERM 15, SIGINT 2)
    serve_command: list[str] | None = None


def _select(pipe: Pipeline, until: str | None, only: str | None) -> list[Stage]:
    if until and only:
        raise LMForgeError("--until and --only are alternatives; give one")
    if only:
        return [pipe.stage(only, "--only stage")]
    if until:
        last = pipe.stage(until, "--until stage")
        return pipe.stages[: last.index + 1]
    return list(pipe.stages)


def _move_aside(out: Path, state: PipelineState, stage: str, reason: str, log: Callable[[str], None]) -> Path:
    n = 1
    while (aside := out.with_name(f"{out.name}.old-{n}")).exists():
        n += 1
    os.rename(out, aside)
    state.data.setdefault("moved_aside", []).append({"stage": stage, "path": str(aside), "at": now(), "reason": reason})
    log(f"  {reason}: moved the earlier output aside to {aside} (delete it yourself when no longer needed)")
    return aside


def _header(stage: Stage, pipe: Pipeline) -> str:
    frm = f" from {stage.values['init']}" if stage.values.get("init") else ""
    return f"stage {stage.index + 1}/{len(pipe.stages)} {stage.name} ({stage.kind}){frm}: {describe(stage, pipe)}"


def run_pipeline(file: str | os.PathLike, force: list[str] | tuple[str, ...] = (), until: str | None = None,
                 only: str | None = None, vars: dict[str, Any] | None = None, out_dir: str | os.PathLike | None = None,
                 serve: bool = False, log: Callable[[str], None] = print) -> RunSummary:
    """Run a pipeline file's stages in order, skipping those that are up to date (``lmforge pipeline run``).

    ``force``: stage names to run again even if unchanged. ``until``: stop after this stage; ``only``:
    run this one stage (its inputs must be there). ``vars`` override the file's vars, ``out_dir`` its
    out_dir. ``serve``: afterwards start the serve stage's API server (blocks). The whole file is
    validated before anything runs. Returns a ``RunSummary``; a training stage stopped by a signal ends
    the run with ``summary.interrupted`` set (the next run resumes it). Ctrl-C elsewhere raises
    KeyboardInterrupt, and a SIGTERM ``Terminated`` (one), once the stage is recorded as interrupted."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise LMForgeError("lmforge pipeline runs as one process, not under torchrun: give a training stage "
                           "`processes: N` and the pipeline starts torchrun with N processes for that stage")
    pipe = load_pipeline(file, vars=vars, out_dir=out_dir)
    selected = _select(pipe, until, only)
    for name in force:
        if name not in [s.name for s in selected]:
            pipe.stage(name, "--force stage")  # an unknown name: did you mean
            raise LMForgeError(f"--force {name}: that stage is not among the stages this run covers "
                               f"({', '.join(s.name for s in selected)})")
    check_devices(pipe, selected)
    summary = RunSummary(pipeline=pipe.name, out_dir=str(pipe.out_dir))
    log(f"pipeline {pipe.name} ({pipe.path}): {len(selected)} of {len(pipe.stages)} stages -> {pipe.out_dir}")
    with sigterm_interrupts(), RunLock(pipe.out_dir):
        state = PipelineState.load(pipe.state_path, pipe.name)
        try:
            for stage in selected:
                log("")
                log(_header(stage, pipe))
                run = _run_one(stage, pipe, state, force=stage.name in force, log=log)
                summary.stages.append(run)
                if run.result == "interrupted":
                    summary.interrupted, summary.signal = stage.name, run.signal
                    break
                if run.result == "serve":
                    summary.serve_command = serve_command(stage, pipe)
        finally:
            _print_summary(summary, state, log)
    again = " ".join([str(file), *(f"--var {k}={v}" for k, v in (vars or {}).items()),
                      *([f"--out-dir {out_dir}"] if out_dir is not None else []),
                      *([f"--until {until}"] if until else []), *([f"--only {only}"] if only else [])])
    if summary.interrupted:
        log(f"\nstage {summary.interrupted} was interrupted at step {state.record(summary.interrupted).get('step')}; "
            f"`lmforge pipeline run {again}` resumes it from its last checkpoint")
    elif summary.serve_command:
        log(f"\nserve the final model: {' '.join(summary.serve_command)}\n  (or: lmforge pipeline serve {again})")
        if serve:
            serve_pipeline(file, vars=vars, out_dir=out_dir)
    return summary


def _run_one(stage: Stage, pipe: Pipeline, state: PipelineState, force: bool, log: Callable[[str], None]) -> StageRun:
    if stage.kind == "serve":
        log(f"  to serve: {' '.join(serve_command(stage, pipe))}")
        return StageRun(stage.name, stage.kind, "serve")
    out = pipe.stage_dir(stage.name)
    rec = state.record(stage.name)
    try:
        inputs = stage_inputs(stage, pipe, state.cache)
    except MissingInput as e:
        raise LMForgeError(f"stage {stage.name!r} cannot run: {e}. Run the stages before it first (without --only)") from e
    fp = digest(inputs)
    if rec and not force and rec.get("status") == "done" and rec.get("fingerprint") == fp and output_exists(stage, pipe):
        log(f"  up to date (finished {rec.get('finished_at')}): skipped")
        state.save()  # keeps the hashes just computed
        return StageRun(stage.name, stage.kind, "skipped", 0.0, (rec.get("headline") or {}).get("text", ""))
    # an earlier attempt with these inputs and settings that did not finish (a signal, a crash, kill -9)
    unfinished = bool(stage.training and rec and not force and rec.get("fingerprint") == fp
                      and rec.get("status") in ("running", "interrupted", "failed"))
    resume = unfinished and latest_step(out) is not None
    # Stopped before its first checkpoint: the run directory is not resumed from (nothing in it is known to
    # be whole but what reusable_outputs vouches for); it is moved aside, that data taken back, and
    # training starts again from step 0.
    keep, refused = [], ""
    if unfinished and not resume and out.exists():
        keep, refused = reusable_outputs(stage, pipe, failure=_failure(rec))
    earlier = float(rec.get("seconds", 0.0)) if (resume or keep) and rec else 0.0
    if resume:
        log(f"  resuming from its last checkpoint (step {latest_step(out)})")
    elif out.exists():
        attempt = {"interrupted": "interrupted", "failed": "failed"}.get((rec or {}).get("status"), "unfinished")
        reason = ("--force" if force else "inputs or settings changed" if rec and rec.get("fingerprint") != fp
                  else f"the {attempt} attempt stopped before its first checkpoint" if unfinished
                  else "no finished record" if not rec or rec.get("status") != "done" else "output incomplete")
        # The move, the data taken back and their record are one step: a signal that comes meanwhile is
        # handled once the record is saved (else what lies in STAGE.old-N would be known to no record).
        with signals_deferred():
            aside = _move_aside(out, state, stage.name, reason, log)
            if keep:
                out.mkdir()
                for path, what in keep:
                    os.rename(aside / path.name, path)
                    log(f"  reusing its {what} from the {attempt} attempt ({path}); training starts again from "
                        f"step 0 (`--force {stage.name}` prepares it again)")
                state.data["moved_aside"][-1]["kept"] = [path.name for path, _ in keep]
            elif refused:
                log(f"  its data {out / 'data'} is not reused ({refused}): prepared again")
            state.save()
    state.stages[stage.name] = {"kind": stage.kind, "status": "running", "fingerprint": fp, "inputs": inputs,
                                "started_at": now(), "output": str(out), "pid": os.getpid(), "seconds": earlier,
                                "attempts": (rec.get("attempts", 0) if (resume or keep) and rec else 0) + 1}
    state.save()
    start = time.perf_counter()

    def finish(status: str, **fields: Any) -> None:
        state.update(stage.name, status=status, seconds=earlier + time.perf_counter() - start, **fields)

    try:
        outcome = run_stage(stage, pipe, resume)
    except KeyboardInterrupt:
        finish("interrupted", step=latest_step(out) if stage.training else None)
        raise
    except BaseException as e:
        finish("failed", error=f"{type(e).__name__}: {e}" if not isinstance(e, LMForgeError) else str(e),
               step=latest_step(out) if stage.training else None)
        raise
    if outcome.interrupted:
        finish("interrupted", step=outcome.step, headline=outcome.headline)
        return StageRun(stage.name, stage.kind, "interrupted", time.perf_counter() - start, signal=outcome.signal)
    finish("done", finished_at=now(), step=outcome.step, headline=outcome.headline, **outcome.details)
    headline = (outcome.headline or {}).get("text", "")
    elapsed = time.perf_counter() - start
    log(f"  done in {_duration(elapsed)}" + (f": {headline}" if headline else ""))
    return StageRun(stage.name, stage.kind, "resumed" if resume else "ran", elapsed, headline)


def _failure(rec: dict[str, Any] | None) -> str:
    """The error a failed attempt recorded ("" for any other)."""
    return str((rec or {}).get("error") or "") if (rec or {}).get("status") == "failed" else ""


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    seconds = float(seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(round(seconds), 60)
    return f"{m}m{s:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m"


def _print_summary(summary: RunSummary, state: PipelineState, log: Callable[[str], None]) -> None:
    if not summary.stages:
        return
    rows = [("stage", "kind", "this run", "wall", "total", "headline")]
    for r in summary.stages:
        total = (state.record(r.stage) or {}).get("seconds")
        rows.append((r.stage, r.kind, r.result, _duration(r.seconds) if r.result not in ("skipped", "serve") else "-",
                     _duration(total) if total is not None else "-", r.headline))
    log("\nsummary (wall time of this run; total = the stage's time over all its attempts):")
    log(_table(rows))


def _table(rows: list[tuple]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


# ---- status ----------------------------------------------------------------------------------------
@dataclass
class StageStatus:
    stage: str
    kind: str
    state: str  # done | stale | pending | partial | running | failed | ready (serve)
    detail: str = ""
    headline: str = ""
    metric: str | None = None
    value: float | None = None
    seconds: float | None = None
    step: int | None = None
    output: str = ""


def pipeline_status(file: str | os.PathLike | Pipeline, vars: dict[str, Any] | None = None,
                    out_dir: str | os.PathLike | None = None) -> list[StageStatus]:
    """Where each stage stands (``lmforge pipeline status``); runs nothing and writes nothing. ``file``
    may also be a ``Pipeline`` that ``load_pipeline`` returned."""
    pipe = file if isinstance(file, Pipeline) else load_pipeline(file, vars=vars, out_dir=out_dir)
    state = PipelineState.load(pipe.state_path, pipe.name)
    running = run_in_progress(pipe.out_dir)
    rows: dict[str, StageStatus] = {}
    for stage in pipe.stages:
        rows[stage.name] = _stage_status(stage, pipe, state, rows, running)
    return list(rows.values())


def _stage_status(stage: Stage, pipe: Pipeline, state: PipelineState, before: dict[str, StageStatus],
                  running: bool) -> StageStatus:
    out = pipe.stage_dir(stage.name)
    row = StageStatus(stage.name, stage.kind, "pending", output=str(out))
    waiting = [d for d in stage.deps if before[d].state != "done"]
    if stage.kind == "serve":
        row.state = "pending" if waiting else "ready"
        row.output = serve_command(stage, pipe)[2]
        row.detail = f"waits for {', '.join(waiting)}" if waiting else " ".join(serve_command(stage, pipe))
        return row
    rec = state.record(stage.name)
    if rec is None:
        if out.exists():
            row.detail = f"{out} exists without a record: moved aside when the stage runs"
        elif waiting:
            row.detail = f"waits for {', '.join(waiting)}"
        return row
    row.seconds = rec.get("seconds")
    headline = rec.get("headline") or {}
    step = latest_step(out) if stage.training else None
    row.step = rec.get("step") if rec.get("status") == "done" else step
    if stage.training and rec.get("status") != "done" and out.is_dir():
        cfg = pipe.configs.get(stage.name)
        headline = (training_headline(out, cfg.spec) if cfg is not None else None) or headline
    row.headline, row.metric, row.value = headline.get("text", ""), headline.get("metric"), headline.get("value")
    if stage.training and rec.get("status") == "done":
        try:
            from lmforge.checkpoint import resolve_model_dir

            row.output = str(resolve_model_dir(out))
        except LMForgeError:
            pass
    status = rec.get("status")
    if status == "running" and running:
        row.state, row.detail = "running", (f"at step {step}" if step is not None else "started " + rec.get("started_at", ""))
        return row
    changed = _changes(stage, pipe, state, rec, waiting)
    if status == "done":
        if changed:
            row.state, row.detail = "stale", changed
        elif not output_exists(stage, pipe):
            row.state, row.detail = "stale", f"its output {out} is missing"
        else:
            row.state = "done"
        return row
    # interrupted, failed, or a run that died without a word (status still "running")
    what = "failed" if status == "failed" else "partial"
    error = (rec.get("error") or "").splitlines()[0][:160] if status == "failed" else ""
    if changed:
        row.state = "stale"
        row.detail = (f"{what} at step {step}; " if step is not None else f"{what}; ") + changed + ": reruns from scratch"
    elif stage.training and step is not None:
        row.state, row.detail = what, f"resumable, at step {step}" + (f"; {error}" if error else "")
    else:
        kept = reusable_outputs(stage, pipe, failure=_failure(rec))[0] if stage.training and out.is_dir() else []
        again = (f"reruns from step 0 on its {kept[0][1]}; --force {stage.name} prepares it again" if kept
                 else "reruns")
        row.state = what if status == "failed" else "pending"
        row.detail = f"{error}; {again}" if error and kept else error or again
    return row


def _changes(stage: Stage, pipe: Pipeline, state: PipelineState, rec: dict[str, Any], waiting: list[str]) -> str:
    """Why a recorded stage is out of date ("" if it is not): an earlier stage that is not done, or
    inputs whose hashes differ from the recorded ones."""
    if waiting:
        return f"after {', '.join(waiting)}, which {'is' if len(waiting) == 1 else 'are'} not done"
    try:
        inputs = stage_inputs(stage, pipe, state.cache)
    except MissingInput as e:
        return str(e)
    if digest(inputs) == rec.get("fingerprint"):
        return ""
    old = rec.get("inputs") or {}
    keys = [k for k in sorted(set(inputs) | set(old)) if inputs.get(k) != old.get(k)]
    return f"{', '.join(keys) or 'inputs'} changed"


def format_status(rows: list[StageStatus], pipe_name: str = "", out_dir: str = "") -> str:
    table = [("stage", "kind", "state", "headline", "wall", "output")]
    for r in rows:
        state = r.state + (f" ({r.detail})" if r.detail and r.kind != "serve" else "")
        table.append((r.stage, r.kind, state, r.headline, _duration(r.seconds) or "-", r.output))
    text = _table(table)
    serve = [r for r in rows if r.kind == "serve"]
    if serve and serve[0].state == "ready":
        text += f"\n\nserve: {serve[0].detail}"
    if pipe_name:
        text = f"pipeline {pipe_name} -> {out_dir}\n" + text
    return text


def status_json(rows: list[StageStatus], pipe: Pipeline) -> dict[str, Any]:
    return {"pipeline": pipe.name, "file": str(pipe.path), "out_dir": str(pipe.out_dir),
            "stages": [asdict(r) for r in rows]}


# ---- serving ---------------------------------------------------------------------------------------
def serve_pipeline(file: str | os.PathLike, vars: dict[str, Any] | None = None, out_dir: str | os.PathLike | None = None,
                   host: str | None = None, port: int | None = None, api_key: str | None = None) -> None:
    """Start the serve stage's OpenAI-compatible API on its model (``lmforge pipeline serve``; blocks)."""
    from lmforge.serve.server import serve

    pipe = load_pipeline(file, vars=vars, out_dir=out_dir)
    stages = [s for s in pipe.stages if s.kind == "serve"]
    if not stages:
        raise LMForgeError(f"{pipe.path} has no serve stage; add one (kind: serve, checkpoint: STAGE) or run "
                           "`lmforge serve` on a stage's run directory")
    stage = stages[0]
    rows = {r.stage: r for r in pipeline_status(pipe)}
    source = rows[stage.values["checkpoint"]]
    if source.state != "done":
        raise LMForgeError(f"stage {source.stage!r}, whose model the serve stage deploys, is {source.state}"
                           f"{' (' + source.detail + ')' if source.detail else ''}: run `lmforge pipeline run "
                           f"{pipe.path}` first")
    v = stage.values
    serve(source.output, host=host or v.get("host", "127.0.0.1"), port=v.get("port", 8000) if port is None else port,
          api_key=api_key or os.environ.get("LMFORGE_API_KEY"), model_id=v.get("model_name") or pipe.name,
          max_batch_size=v.get("max_batch_size", 16))
