"""Where metrics go: ``metrics.jsonl`` always, TensorBoard and Weights & Biases when enabled."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from lmforge.errors import LMForgeError


class MetricsLogger:
    def __init__(self, run_dir: Path, tensorboard: bool, wandb_project: str = "", wandb_run_name: str = "",
                 config: dict[str, Any] | None = None, resume: bool = False):
        self.path = run_dir / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1)
        self._tb = None
        self._wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tb"))
        if wandb_project:
            try:
                import wandb
            except ImportError as e:
                raise LMForgeError("logging.wandb_project is set but wandb is not installed: "
                                   "pip install wandb (or unset logging.wandb_project)") from e
            self._wandb = wandb.init(project=wandb_project, name=wandb_run_name or run_dir.name,
                                     dir=str(run_dir), config=config, resume="allow" if resume else None,
                                     id=_wandb_id(run_dir))

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
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


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
