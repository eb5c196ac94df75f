"""Where metrics go: ``metrics.jsonl`` always, TensorBoard and Weights & Biases when enabled."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from lmforge.errors import LMForgeError
from lmforge.files import atomic_file


class MetricsLogger:
    def __init__(self, run_dir: Path, tensorboard: bool, wandb_project: str = "", wandb_run_name: str = "",
                 config: dict[str, Any] | None = None, start_step: int = 0, wandb_entity: str = ""):
        self.path = run_dir / "metrics.jsonl"
        _truncate_after(self.path, start_step)  # a resumed run re-logs the steps after its checkpoint
        self._file = open(self.path, "a", buffering=1)
        self._tb = None
        self._wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard drops events after the checkpoint that an earlier attempt wrote,
            # as metrics.jsonl is cut back above
            self._tb = SummaryWriter(log_dir=str(run_dir / "tb"), purge_step=start_step + 1)
        if wandb_project:
            try:
                import wandb
            except ImportError as e:
                raise LMForgeError("logging.wandb_project is set but wandb is not installed: "
                                   "pip install wandb (or unset logging.wandb_project)") from e
            try:
                self._wandb = wandb.init(project=wandb_project, entity=wandb_entity or None,
                                         name=wandb_run_name or run_dir.name,
                                         dir=str(run_dir), config=config, resume="allow", id=_wandb_id(run_dir))
            except Exception as e:  # wandb raises its own types for login/network problems
                self.close()
                raise LMForgeError(f"Weights & Biases could not start ({e}); run `wandb login`, or set "
                                   "WANDB_MODE=offline, or unset logging.wandb_project") from e

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items()}
        record = {"step": step, "time": round(time.time(), 3)}
        record.update({k: (v if math.isfinite(v) else str(v)) for k, v in clean.items()})
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def close(self) -> None:
        self._file.close()
        if getattr(self, "_tb", None) is not None:
            self._tb.close()
        if getattr(self, "_wandb", None) is not None:
            self._wandb.finish()


def _truncate_after(path: Path, step: int) -> None:
    """Keep only the rows up to ``step`` (all of them gone for a fresh run), rewriting atomically."""
    if not path.is_file():
        return
    kept = []
    lines = path.read_text(errors="replace").splitlines()
    for i, line in enumerate(lines, 1):
        if step <= 0:
            break  # a fresh run: nothing is kept
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            row_step = row.get("step", 0) if isinstance(row, dict) else None
        except json.JSONDecodeError:
            row_step = None
        if not isinstance(row_step, (int, float)):
            if i == len(lines):
                continue  # a partial last line: a write cut off by a crash
            raise LMForgeError(
                f"{path}:{i} is damaged (not a JSON record with a step; line {i} of {len(lines)}), so resuming "
                f"cannot tell which metrics to keep. Fix or delete that line (or move {path} away to start its "
                "metrics afresh), then resume again.")
        if row_step <= step:
            kept.append(line)
    with atomic_file(path) as tmp:
        tmp.write_text("".join(line + "\n" for line in kept))


def _wandb_id(run_dir: Path) -> str:
    """A stable W&B run id per run directory, so a resumed run continues the same W&B run."""
    id_file = run_dir / "wandb_id.txt"
    if id_file.is_file():
        return id_file.read_text().strip()
    import uuid

    run_id = uuid.uuid4().hex[:12]
    id_file.write_text(run_id)
    return run_id


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise LMForgeError(f"{path} does not exist: is {run_dir} a run directory written by `lmforge train`?")
    rows = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines):
                continue  # a run killed mid-write leaves a partial last line: ignore it
            raise LMForgeError(f"{path}:{i} is not valid JSON; the metrics file is damaged") from None
    return rows
