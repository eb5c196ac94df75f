"""Checkpoints: written atomically, kept to the last K plus the best, found again for resume.

Layout of ``RUN_DIR/checkpoints/``::

    step-000100/  model.safetensors config.yaml tokenizer.json ... optimizer.safetensors rng_state.safetensors
                  run_config.yaml trainer_state.json
    best/         model.safetensors config.yaml tokenizer.json ...   (weights only, lowest eval loss)

A checkpoint is first written into a hidden ``.tmp-*`` sibling and renamed into place when every file
is on disk, so a crash (even ``kill -9``) mid-write leaves the previous checkpoints untouched.
``trainer_state.json`` is written last inside the temporary directory.

Nothing here unpickles: the optimizer/scaler/model training state and the RNG states are safetensors
files with a JSON skeleton (``safe_state``); the data position and counters are JSON. Checkpoints of
older lmforge versions (``optimizer.pt`` / ``rng_state.pt``) are read through PyTorch's restricted
loader, and ``lmforge checkpoint convert`` rewrites them in the current format.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from lmforge.errors import LMForgeError
from lmforge.files import atomic_file, reporting_write_faults

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng_state.safetensors"
LEGACY_FILES = {OPTIMIZER_FILE: "optimizer.pt", RNG_FILE: "rng_state.pt"}  # pickles of lmforge <= 0.1


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def list_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    """Complete step checkpoints, oldest first."""
    if not ckpt_root.is_dir():
        return []
    found = []
    for p in ckpt_root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    found = list_checkpoints(ckpt_root)
    return found[-1][1] if found else None


def _fsync_dir_tree(directory: Path) -> None:
    for p in directory.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def clean_partial(ckpt_root: Path) -> None:
    """Undo what an interrupted write left: drop unfinished ``.tmp-*`` directories, and put back a
    checkpoint that was moved aside (``.old-NAME``) if its replacement never arrived."""
    if not ckpt_root.is_dir():
        return
    for p in ckpt_root.glob(".tmp-*"):
        shutil.rmtree(p, ignore_errors=True)
    for old in ckpt_root.glob(".old-*"):
        final = ckpt_root / old.name[len(".old-"):]
        if final.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.rename(final)


# Completes write_fault's "free space ..." / "make it writable ...": the earlier checkpoints are intact.
RESUME_FIX = "then continue the run from its last complete checkpoint with `lmforge train RECIPE --resume`"


def _publish(ckpt_root: Path, name: str, write_files) -> Path:
    """Write ``name`` via a hidden temporary directory; an existing ``name`` is replaced only once the new
    one is complete, by two renames (a crash in between leaves ``.old-NAME``, restored by clean_partial).
    A write that fails removes its temporary directory; a full disk or a permission error becomes a
    one-line LMForgeError naming the checkpoint (``lmforge.files.write_fault``)."""
    final = ckpt_root / name
    tmp = ckpt_root / f".tmp-{name}-{os.getpid()}"
    with reporting_write_faults(final, RESUME_FIX, tmp):
        ckpt_root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        try:
            write_files(tmp)
            _fsync_dir_tree(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # frees the space it took; earlier checkpoints are untouched
            raise
        old = ckpt_root / f".old-{name}"
        if final.exists():
            os.rename(final, old)
        os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def write_checkpoint(ckpt_root: Path, step: int, write_files, keep_last: int) -> Path:
    """Call ``write_files(tmp_dir)`` then atomically publish it as ``step-NNNNNN``; prune old ones."""
    final = _publish(ckpt_root, step_dir_name(step), write_files)
    for _, old in list_checkpoints(ckpt_root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def write_best(ckpt_root: Path, write_files) -> Path:
    """Replace ``best/`` with new weights; the old one survives until the new one is complete."""
    return _publish(ckpt_root, "best", write_files)


def save_json(path: Path, data: dict[str, Any]) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2))


def read_trainer_state(ckpt: Path) -> dict[str, Any]:
    path = ckpt / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise LMForgeError(f"{ckpt} is not a training checkpoint: {STATE_FILE} is missing") from e
    except ValueError as e:  # not JSON, or not even UTF-8 text
        raise LMForgeError(f"{path} is corrupt ({e}); resume from an earlier checkpoint in {ckpt.parent}") from e
    if not isinstance(state, dict):
        raise LMForgeError(f"{path} is corrupt (not a JSON object); resume from an earlier checkpoint in {ckpt.parent}")
    return state


def load_training_file(ckpt: Path, name: str, what: str) -> Any:
    """``OPTIMIZER_FILE`` or ``RNG_FILE`` of a checkpoint, in the current format or an older lmforge's."""
    from lmforge.safe_state import load_legacy_torch_file, load_state

    path, legacy = ckpt / name, ckpt / LEGACY_FILES[name]
    if path.is_file():
        return load_state(path, what)
    if legacy.is_file():
        return load_legacy_torch_file(legacy, what)
    raise LMForgeError(f"{path} is missing: the checkpoint {ckpt.name} is incomplete; "
                       f"resume from an earlier checkpoint in {ckpt.parent}")


def convert_legacy(ckpt: Path) -> list[str]:
    """Rewrite an older checkpoint's pickled files in the current format; returns what was converted.
    Each new file is complete on disk before its pickle is removed, so an interruption loses nothing."""
    from lmforge.safe_state import load_legacy_torch_file, save_state

    done = []
    for name, legacy_name in LEGACY_FILES.items():
        legacy = ckpt / legacy_name
        if not legacy.is_file():
            continue
        if (ckpt / name).is_file():  # converted before (the removal was interrupted): the new file is what loads
            legacy.unlink()
            done.append(f"{legacy_name} removed ({name} was already there)")
            continue
        state = load_legacy_torch_file(legacy, legacy_name)
        with reporting_write_faults(ckpt / name, "and convert again"), atomic_file(ckpt / name) as tmp:
            save_state(tmp, state)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        legacy.unlink()
        done.append(f"{legacy_name} -> {name}")
    return done


def resolve_model_dir(path: str | os.PathLike) -> Path:
    """A checkpoint, `best`, a run directory or its `checkpoints/` folder -> a directory with weights.

    For a run directory: `best` if it exists, else the latest step checkpoint.
    """
    p = Path(path)
    if not p.exists():
        raise LMForgeError(f"checkpoint path {p} does not exist")
    if (p / "model.safetensors").is_file():
        return p
    for root in (p / "checkpoints", p):
        if (root / "best" / "model.safetensors").is_file():
            return root / "best"
        latest = latest_checkpoint(root)
        if latest is not None:
            return latest
    raise LMForgeError(
        f"{p} holds no model: expected model.safetensors, or a run directory with checkpoints/. "
        "Train one with `lmforge train RECIPE` or pass runs/NAME/checkpoints/step-NNNNNN."
    )


def run_values(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """The config of the run a checkpoint belongs to (``runs/NAME/config.yaml``, two levels above a
    step checkpoint or ``best``), as written; ``{}`` when there is none or it cannot be read."""
    import yaml

    config = resolve_model_dir(checkpoint).parent.parent / "config.yaml"
    if not config.is_file():
        return {}
    try:
        values = yaml.safe_load(config.read_text())
    except (yaml.YAMLError, UnicodeDecodeError):
        return {}
    return values if isinstance(values, dict) else {}


def fine_tuned_from(checkpoint: str | os.PathLike) -> str | None:
    """The ``training.init_from`` of the run a checkpoint belongs to, if it still exists: the model
    before fine-tuning, which evaluations score beside it."""
    source = (run_values(checkpoint).get("training") or {}).get("init_from")
    return source if source and Path(source).exists() else None


def checkpoint_family(path: str | Path, strict: bool = False) -> str | None:
    """The model family a checkpoint (or run directory) holds, from its config.yaml alone. When that
    cannot be read: None, or with ``strict`` an error that says what is wrong and what to pass."""
    import yaml

    try:
        model_dir = resolve_model_dir(path)
        config_path = model_dir / "config.yaml"
        if not config_path.is_file():
            raise LMForgeError(f"{model_dir} is not a model directory: it has no config.yaml. Pass a checkpoint "
                               "directory (runs/NAME/checkpoints/step-NNNNNN) or a run directory.")
        try:
            config = yaml.safe_load(config_path.read_text()) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise LMForgeError(f"{config_path} is not valid YAML ({e}); the checkpoint is corrupt: use an earlier "
                               f"one in {model_dir.parent}") from e
        family = config.get("family") if isinstance(config, dict) else None
        if not isinstance(family, str) or not family:
            raise LMForgeError(f"{config_path} names no model family (a 'family:' key); the checkpoint is corrupt: "
                               f"use an earlier one in {model_dir.parent}")
        return family
    except (LMForgeError, OSError):
        if strict:
            raise
        return None
