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

A sharded step checkpoint (``training.fsdp_checkpoint: sharded`` under FSDP) holds, instead of
``model.safetensors`` and ``optimizer.safetensors``::

    shards/shard-00001-model-00001-of-00001.safetensors ...   one per process (torch.distributed.checkpoint)
    shards.json                                               what the shards hold, and the non-tensor rest

Each shard is a safetensors file written by torch's ``HuggingFaceStorageWriter``: that process's pieces
of the weights (``model.NAME``) and optimizer state (``optim.NAME.ENTRY``), with each piece's offset in
its full tensor as JSON in the header. Nothing is pickled (DCP's usual ``.metadata`` file is a pickle;
this layout has none). ``read_shards`` puts the full tensors together on one process, with no process
group: so every verb reads such a checkpoint as it is, and ``consolidate`` rewrites it as an ordinary
one.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lmforge.errors import LMForgeError
from lmforge.files import FileLock, atomic_file, lock_held, reporting_write_faults, sha256_file

STEP_DIR = re.compile(r"^step-(\d+)$")
DAMAGED_PREFIX = "damaged-"  # a damaged step checkpoint set aside by a resume from an earlier one
RUN_LOCK_FILE = ".train.lock"
STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng_state.safetensors"
LEGACY_FILES = {OPTIMIZER_FILE: "optimizer.pt", RNG_FILE: "rng_state.pt"}  # pickles of lmforge <= 0.1
WEIGHTS_FILE = "model.safetensors"
SHARDS_DIR = "shards"
SHARDS_FILE = "shards.json"
SHARDS_FORMAT = "lmforge-shards"
SHARDS_VERSION = 1
_DCP_OFFSETS = "DCP_SHARDING_INFO"  # the header entry in which torch's HuggingFaceStorageWriter puts the offsets
# The sha256 of every safetensors file of a checkpoint (weights, optimizer state, shards), written with it: a file
# whose bytes changed since (a bad disk, a copy cut short, an edit) is named when the checkpoint is resumed from
# or verified (`lmforge checkpoint verify`), instead of training on from damaged numbers.
CHECKSUMS_FILE = "checksums.json"
CHECKSUMS_FORMAT = "lmforge-checksums"


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
    checkpoint that was moved aside (``.old-NAME``) if its replacement never arrived. Called under the run's
    ``RunDirLock``: no other run writes here, so every temporary directory is a dead writer's (its PID may
    have been given to another process since: a container's restart)."""
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


def file_in_the_way(path: Path) -> Path | None:
    """The first of ``path`` and its parents that exists but is not a directory (so no directory can be
    made at ``path``), or None."""
    for p in [path, *path.parents]:
        if p.exists() or p.is_symlink():
            return None if p.is_dir() else p
    return None


# ---- the run-directory lock ------------------------------------------------------------------------
def RunDirLock(run_dir: Path) -> FileLock:  # noqa: N802 (a lock's constructor, named as one)
    """One `lmforge train` per run directory at a time: ``RUN_DIR/.train.lock`` (``lmforge.files.FileLock``)."""
    directory = Path(run_dir)
    return FileLock(directory / RUN_LOCK_FILE, lambda holder: LMForgeError(
        f"another `lmforge train` ({holder}) is writing to {directory}; two runs in one run directory "
        "would overwrite each other's checkpoints and metrics. Wait for it to finish (or stop it), or choose "
        "another run name (name=NEW) — nothing was written."))


def run_in_progress(run_dir: Path) -> bool:
    """Whether a live `lmforge train` holds the lock of ``run_dir`` now (False where that cannot be told)."""
    return lock_held(Path(run_dir) / RUN_LOCK_FILE)


# Completes write_fault's "free space ..." / "make it writable ...": the earlier checkpoints are intact.
RESUME_FIX = "then continue the run from its last complete checkpoint with `lmforge train RECIPE --resume`"


def staging_dir(ckpt_root: Path, step: int) -> Path:
    """The temporary directory a sharded checkpoint is written into: the same on every process (which
    all write into it), hidden until published, and removed by clean_partial if never published."""
    return ckpt_root / f".tmp-{step_dir_name(step)}-shards"


def start_staging(tmp: Path) -> None:
    """An empty ``tmp`` (what an earlier failed write left is dropped)."""
    with reporting_write_faults(tmp, RESUME_FIX):
        discard(tmp)
        tmp.mkdir(parents=True)


def discard(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


def _publish(ckpt_root: Path, name: str, write_files, staged: Path | None = None) -> Path:
    """Write ``name`` via a hidden temporary directory (``staged``: one that holds some files already);
    an existing ``name`` is replaced only once the new one is complete, by two renames (a crash in between
    leaves ``.old-NAME``, restored by clean_partial). A write that fails removes its temporary directory;
    a full disk or a permission error becomes a one-line LMForgeError naming the checkpoint
    (``lmforge.files.write_fault``)."""
    final = ckpt_root / name
    tmp = staged or ckpt_root / f".tmp-{name}-{os.getpid()}"
    with reporting_write_faults(final, RESUME_FIX, tmp):
        ckpt_root.mkdir(parents=True, exist_ok=True)
        if staged is None:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        try:
            write_files(tmp)
            write_checksums(tmp)
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


def write_checkpoint(ckpt_root: Path, step: int, write_files, keep_last: int, staged: Path | None = None) -> Path:
    """Call ``write_files(tmp_dir)`` then atomically publish it as ``step-NNNNNN``; prune old ones.
    ``staged``: the tmp_dir to use, which the shards of every process are in already (``staging_dir``)."""
    final = _publish(ckpt_root, step_dir_name(step), write_files, staged)
    for _, old in list_checkpoints(ckpt_root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def write_best(ckpt_root: Path, write_files) -> Path:
    """Replace ``best/`` with new weights; the old one survives until the new one is complete."""
    return _publish(ckpt_root, "best", write_files)


def write_checksums(directory: Path) -> None:
    """Record the sha256 of each safetensors file in ``directory`` (its shards/ included) in ``CHECKSUMS_FILE``."""
    files = sorted(p for p in Path(directory).rglob("*.safetensors") if p.is_file())
    save_json(Path(directory) / CHECKSUMS_FILE, {
        "format": CHECKSUMS_FORMAT, "version": 1, "algorithm": "sha256",
        "files": {p.relative_to(directory).as_posix(): digest for p, digest in zip(files, _digests(files))}})


def refresh_checksums(directory: Path, names: list[str]) -> None:
    """Record the new sha256 of the files ``names`` (relative to ``directory``) in its checksums, if it has
    some: weights saved into a checkpoint on purpose (``save_pretrained`` over it) would otherwise read as
    damage. The other files' entries stay as they were, so damage to them is still found."""
    path = Path(directory) / CHECKSUMS_FILE
    try:
        record = _read_checksums(path)
    except (OSError, ValueError):
        return  # none (a fresh directory), or unreadable: checking reports that
    record["files"].update(zip(names, _digests([Path(directory) / n for n in names])))
    save_json(path, record)


def _read_checksums(path: Path) -> dict[str, Any]:
    """The record of ``CHECKSUMS_FILE`` ``path``; ValueError (or OSError) when it is not one."""
    try:
        record = json.loads(path.read_text())
        files = record["files"] if record.get("format") == CHECKSUMS_FORMAT else None
    except (KeyError, AttributeError, TypeError) as e:
        raise ValueError(f"not an lmforge checksums file ({e})") from e
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise ValueError("not an lmforge checksums file")
    return record


def _digests(paths: list[Path]) -> list[str]:
    """``_hashes`` of files just written: a read error is raised (the caller reports it as a write fault)."""
    digests = _hashes(paths)
    failed = next((d for d in digests if isinstance(d, OSError)), None)
    if failed is not None:
        raise failed
    return digests


def _hashes(paths: list[Path]) -> list[str | OSError]:
    """The sha256 of each file (or the error reading it raised), several files at a time: hashlib and file
    reads release the GIL, so each thread keeps a core busy (a checkpoint's weights and optimizer state hash
    in the time of the larger)."""
    def one(path: Path) -> str | OSError:
        try:
            return sha256_file(path)
        except OSError as e:
            return e

    if len(paths) <= 1:
        return [one(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(len(paths), os.cpu_count() or 1, 8)) as pool:
        return list(pool.map(one, paths))


def checksum_mismatch(directory: Path, share: tuple[int, int] = (0, 1), weights_only: bool = False) -> str | None:
    """What in ``directory`` does not match the checksums written with it (a file changed or missing), or None.
    ``share``: (i, n) checks only the i-th of n parts of the files, split by size (each of n processes
    hashes its part of a checkpoint: together they read it once). ``weights_only``: skip the optimizer and
    RNG state (what loading a model reads). A checkpoint of an lmforge before checksums has none to compare:
    None; one whose trainer state says they were written, and whose checksums file is gone, is damaged."""
    path = Path(directory) / CHECKSUMS_FILE
    if not path.is_file():
        if has_checksums(directory):
            return f"{path} is missing (the checkpoint was written with it: its files cannot be checked)"
        return None
    try:
        files = _read_checksums(path)["files"]
    except (OSError, ValueError) as e:
        return f"{path} is unreadable ({e})"
    names = sorted(n for n in files if not (weights_only and n in (OPTIMIZER_FILE, RNG_FILE)))
    mine = [Path(directory) / name for name in _size_share(Path(directory), names, *share)]
    missing = next((f for f in mine if not f.is_file()), None)
    if missing is not None:
        return f"{missing} is missing (its checksum was written with the checkpoint)"
    for f, digest in zip(mine, _hashes(mine)):
        if isinstance(digest, OSError):  # a failing disk's read error, or removed meanwhile
            return f"{f} cannot be read ({digest.strerror or digest})"
        if digest != files[f.relative_to(directory).as_posix()]:
            return f"{f} does not match the sha256 written with it: its bytes changed after it was saved"
    return None


REPLACED = "replaced"  # settled_checksum_mismatch: the directory was replaced (or removed) each time it was read


def settled_checksum_mismatch(directory: Path, weights_only: bool = False) -> str | None:
    """``checksum_mismatch`` of ``directory``, read again once when a run replaced it (a new ``best/``) or
    pruned it while it was read: a run's writes are whole directories renamed into place, so a mismatch seen
    across one is no damage. ``REPLACED`` when it changed both times."""
    for _ in range(2):
        try:
            before = os.stat(directory).st_ino
        except FileNotFoundError:
            return REPLACED
        bad = checksum_mismatch(directory, weights_only=weights_only)
        try:
            same = os.stat(directory).st_ino == before
        except FileNotFoundError:
            same = False
        if bad is None or same:
            return bad
    return REPLACED


def has_checksums(directory: Path) -> bool:
    """Whether ``directory`` was written with checksums: it holds them, or it is a step checkpoint whose
    trainer state records them (an lmforge before checksums wrote neither)."""
    if (Path(directory) / CHECKSUMS_FILE).is_file():
        return True
    try:
        return json.loads((Path(directory) / STATE_FILE).read_text()).get("checksums") == CHECKSUMS_FILE
    except (OSError, ValueError, AttributeError):  # no state (best/), or one a resume reports itself
        return False


def _size_share(directory: Path, names: list[str], index: int, parts: int) -> list[str]:
    """The ``index``-th of ``parts`` lists of ``names`` (files in ``directory``) of about equal bytes: largest
    first, each to the lightest list so far. The same on every process for the same files; a missing file
    weighs nothing (and is reported by whichever process gets it)."""
    if parts <= 1:
        return names

    def size(name: str) -> int:
        try:
            return (directory / name).stat().st_size
        except OSError:
            return 0

    loads = [0] * parts
    mine = []
    for name in sorted(names, key=lambda n: (-size(n), n)):
        lightest = loads.index(min(loads))
        loads[lightest] += size(name)
        if lightest == index:
            mine.append(name)
    return sorted(mine)


def verify_checksums(ckpt: Path) -> None:
    """Refuse to resume from a step checkpoint whose files changed after they were written."""
    bad = checksum_mismatch(ckpt)
    if bad:
        raise LMForgeError(f"{bad}; the checkpoint is damaged: {_resume_earlier(ckpt)}")


def save_json(path: Path, data: dict[str, Any]) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2))


def _resume_earlier(ckpt: Path) -> str:
    """What to do about a damaged step checkpoint ``ckpt`` when resuming: resume from the one before it
    (``--resume`` of an earlier checkpoint sets newer damaged ones aside), named exactly."""
    m = STEP_DIR.match(ckpt.name)
    earlier = [p for s, p in list_checkpoints(ckpt.parent) if m and s < int(m.group(1))]
    if not earlier:
        return (f"no earlier checkpoint is in {ckpt.parent}: start a new run (name=NEW), or from its weights "
                "with training.init_from if they load")
    return (f"resume from an earlier checkpoint: `lmforge train RECIPE --resume {earlier[-1]}` "
            f"(it sets {ckpt.name} aside as {DAMAGED_PREFIX}{ckpt.name})")


def read_trainer_state(ckpt: Path) -> dict[str, Any]:
    path = ckpt / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise LMForgeError(f"{ckpt} is not a training checkpoint: {STATE_FILE} is missing") from e
    except ValueError as e:  # not JSON, or not even UTF-8 text
        raise LMForgeError(f"{path} is corrupt ({e}); the checkpoint is damaged: {_resume_earlier(ckpt)}") from e
    if not isinstance(state, dict):
        raise LMForgeError(f"{path} is corrupt (not a JSON object); the checkpoint is damaged: "
                           f"{_resume_earlier(ckpt)}")
    return state


def checkpoint_damage(ckpt: Path) -> str | None:
    """Why the step checkpoint ``ckpt`` cannot be resumed from (its JSON and YAML files parse, its safetensors
    files' headers read and cover each file, and their bytes match the checksums written with them); None when
    nothing is found. A checkpoint without checksums (an older lmforge's) may still be damaged inside."""
    import yaml
    from safetensors import safe_open

    try:
        state = json.loads((ckpt / STATE_FILE).read_text())
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            return f"{ckpt / STATE_FILE} holds no step number"
    except (OSError, ValueError) as e:
        return f"{ckpt / STATE_FILE}: {e}"
    for name in ("config.yaml", "run_config.yaml"):
        if (ckpt / name).is_file():
            try:
                yaml.safe_load((ckpt / name).read_text())
            except (OSError, ValueError, yaml.YAMLError) as e:
                return f"{ckpt / name}: {type(e).__name__}"
    if (ckpt / "tokenizer.json").is_file():
        try:
            json.loads((ckpt / "tokenizer.json").read_bytes())
        except (OSError, ValueError) as e:
            return f"{ckpt / 'tokenizer.json'}: {e}"
    for f in [*ckpt.glob("*.safetensors"), *(ckpt / SHARDS_DIR).glob("*.safetensors")]:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as opened:
                opened.keys()
        except Exception as e:  # noqa: BLE001 - safetensors raises several types for a damaged file
            return f"{f}: {e}"
    return checksum_mismatch(ckpt)  # (reads every file: only where a resume asks about a newer checkpoint)


def load_training_file(ckpt: Path, name: str, what: str) -> Any:
    """``OPTIMIZER_FILE`` or ``RNG_FILE`` of a checkpoint, in the current format or an older lmforge's;
    of a sharded checkpoint, the optimizer state is put together from its shards."""
    from lmforge.safe_state import load_legacy_torch_file, load_state

    path, legacy = ckpt / name, ckpt / LEGACY_FILES[name]
    if name == OPTIMIZER_FILE and is_sharded(ckpt):
        return read_sharded_training_state(ckpt)
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
    if done:
        write_checksums(ckpt)  # the new files with the rest
    return done


def _best_dir(root: Path) -> Path | None:
    """``root/best`` if it holds weights. A run stopped between the two renames that replace ``best/`` leaves
    the previous best whole as ``.old-best`` and no ``best/``: it is put back (what a resume does), or, where
    it cannot be renamed (a read-only directory), used where it is."""
    best, old = root / "best", root / ".old-best"
    if (best / WEIGHTS_FILE).is_file():
        return best
    if best.exists() or not (old / WEIGHTS_FILE).is_file():
        return None
    if run_in_progress(root.parent):
        raise LMForgeError(f"{best} is being replaced by the `lmforge train` running in {root.parent} (its previous "
                           f"version is in {old} for a moment): run the command again in a few seconds")
    try:
        os.rename(old, best)
    except OSError:
        return old
    import sys

    print(f"note: {best} was missing after an interrupted replacement: put back from {old}", file=sys.stderr)
    return best


def resolve_model_dir(path: str | os.PathLike) -> Path:
    """A checkpoint, `best`, a run directory or its `checkpoints/` folder -> a directory with weights.

    For a run directory: `best` if it exists, else the latest step checkpoint.
    """
    p = Path(path)
    if not p.exists() and p.name == "best" and _best_dir(p.parent) is not None:
        return _best_dir(p.parent)
    if not p.exists():
        raise LMForgeError(f"checkpoint path {p} does not exist")
    if (p / WEIGHTS_FILE).is_file() or is_sharded(p):
        return p
    for root in (p / "checkpoints", p):
        best = _best_dir(root)
        if best is not None:
            return best
        latest = latest_checkpoint(root)
        if latest is not None:
            return latest
    raise LMForgeError(
        f"{p} holds no model: expected model.safetensors (or a sharded checkpoint's {SHARDS_FILE}), or a run "
        "directory with checkpoints/. Train one with `lmforge train RECIPE` or pass "
        "runs/NAME/checkpoints/step-NNNNNN."
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


def _use_an_earlier_one(model_dir: Path) -> str:
    parent = Path(model_dir).resolve().parent
    if parent.name == "checkpoints":
        return f"use an earlier one in {parent}"
    return "use an earlier checkpoint of the run (runs/NAME/checkpoints/) or retrain"


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
            raise LMForgeError(f"{config_path} is not valid YAML ({e}); the checkpoint is corrupt: "
                               f"{_use_an_earlier_one(model_dir)}") from e
        family = config.get("family") if isinstance(config, dict) else None
        if not isinstance(family, str) or not family:
            raise LMForgeError(f"{config_path} names no model family (a 'family:' key); the checkpoint is corrupt: "
                               f"{_use_an_earlier_one(model_dir)}")
        return family
    except (LMForgeError, OSError):
        if strict:
            raise
        return None


# ---- sharded checkpoints --------------------------------------------------------------------------
def is_sharded(directory: str | os.PathLike) -> bool:
    return (Path(directory) / SHARDS_FILE).is_file()


def weight_files(model_dir: str | os.PathLike) -> list[Path]:
    """The files a model directory's weights are in: ``model.safetensors``, or a sharded checkpoint's
    manifest and shard files (what a fingerprint of the weights hashes)."""
    model_dir = Path(model_dir)
    if not is_sharded(model_dir):
        return [model_dir / WEIGHTS_FILE]
    return [model_dir / SHARDS_FILE, *sorted((model_dir / SHARDS_DIR).glob("*.safetensors"))]


def first_non_finite(tensors) -> tuple[str, int, int] | None:
    """The first of ``tensors`` (``(name, tensor)`` pairs; a DTensor counts its local shard) holding a NaN or
    an inf, as (name, how many, of how many values); None when all are finite. Training never writes a NaN
    update (the loop stops before it), so such a value in a checkpoint is damage."""
    import torch

    for name, tensor in tensors:
        if not torch.is_tensor(tensor):
            continue
        if hasattr(tensor, "to_local"):
            tensor = tensor.to_local()
        if not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        if tensor.element_size() == 1:  # float8: no sum or isfinite of its own
            tensor = tensor.float()
        # Any NaN or inf reaches the sum (a sum of huge finite values may too: then count exactly); the sum
        # reads each value once, ~25x faster than isfinite(tensor).all() on a CPU.
        if bool(torch.isfinite(tensor.sum(dtype=torch.float32))):
            continue
        bad = int((~torch.isfinite(tensor)).sum())
        if bad:
            return name, bad, tensor.numel()
    return None


def non_finite_message(where: Path, found: tuple[str, int, int], what: str) -> str:
    name, bad, total = found
    return (f"{where} holds non-finite {what} (NaN or inf): {bad:,} of {total:,} values of {name!r}. The file is "
            "damaged or was edited; use an earlier checkpoint (runs/NAME/checkpoints/) or retrain")


def write_shards_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    save_json(directory / SHARDS_FILE, {"format": SHARDS_FORMAT, "version": SHARDS_VERSION, **manifest})


def _earlier(ckpt: Path) -> str:
    return f"use an earlier checkpoint in {ckpt.parent}"


def read_shards_manifest(ckpt: Path) -> dict[str, Any]:
    """A sharded checkpoint's ``shards.json``, checked against its shard files: each one is there and
    readable, and the pieces of every tensor it lists cover that tensor exactly once. Returns the
    manifest with ``"chunks"``: tensor key -> [(file, offsets, shape)]."""
    from safetensors import safe_open

    path = ckpt / SHARDS_FILE
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise LMForgeError(f"{ckpt} is not a sharded checkpoint: {SHARDS_FILE} is missing") from e
    except ValueError as e:
        raise LMForgeError(f"{path} is corrupt ({e}); {_earlier(ckpt)}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != SHARDS_FORMAT:
        raise LMForgeError(f"{path} is not an lmforge shard manifest (no format {SHARDS_FORMAT!r}); {_earlier(ckpt)}")
    if manifest.get("version") != SHARDS_VERSION:
        raise LMForgeError(f"{path} has version {manifest.get('version')!r}; this lmforge reads version "
                           f"{SHARDS_VERSION}: upgrade lmforge to read it")
    chunks: dict[str, list[tuple[Path, list[int], list[int]]]] = {}
    try:
        tensors = {k: [int(n) for n in shape] for k, shape in manifest["tensors"].items()}
        for name in manifest["files"]:
            shard = ckpt / SHARDS_DIR / Path(name).name
            try:
                with safe_open(str(shard), framework="pt", device="cpu") as f:
                    offsets = json.loads((f.metadata() or {}).get(_DCP_OFFSETS, "{}"))
                    for key in f.keys():
                        chunks.setdefault(key, []).append(
                            (shard, [int(o) for o in offsets[key]["saved_offsets"]], f.get_slice(key).get_shape()))
            except Exception as e:  # missing, truncated, or not safetensors: several error types
                raise LMForgeError(f"cannot read the shard {shard}: {e}. The checkpoint is damaged or incomplete; "
                                   f"{_earlier(ckpt)}") from e
    except LMForgeError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise LMForgeError(f"{path} is corrupt ({type(e).__name__}: {e}); {_earlier(ckpt)}") from e
    for key, shape in tensors.items():
        pieces = chunks.get(key, [])
        inside = all(len(o) == len(s) == len(shape) and all(0 <= a and a + b <= n for a, b, n in zip(o, s, shape))
                     for _, o, s in pieces)
        covered = sum(math.prod(s) for _, _, s in pieces)
        # Inside, no two overlapping and as many values as the tensor: each value exactly once.
        overlap = inside and any(math.prod(s1) and math.prod(s2) and all(
            a1 < a2 + b2 and a2 < a1 + b1 for a1, b1, a2, b2 in zip(o1, s1, o2, s2))
            for i, (_, o1, s1) in enumerate(pieces) for _, o2, s2 in pieces[i + 1:])
        if not inside or overlap or covered != math.prod(shape):
            raise LMForgeError(f"the shards in {ckpt / SHARDS_DIR} hold {covered} of the {math.prod(shape)} values of "
                               f"{key}: a shard file is missing or damaged; {_earlier(ckpt)}")
    unlisted = sorted(set(chunks) - set(tensors))
    if unlisted:
        raise LMForgeError(f"the shards in {ckpt / SHARDS_DIR} hold tensors {path} does not list ({unlisted[:3]}); "
                           f"the checkpoint is damaged: {_earlier(ckpt)}")
    return {**manifest, "tensors": tensors, "chunks": chunks}


def read_shards(manifest: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The full tensors whose keys start with ``prefix``, put together on this process from the pieces in
    the shard files (``manifest`` from read_shards_manifest)."""
    from safetensors import safe_open

    by_file: dict[Path, list[tuple[str, list[int]]]] = {}
    for key, pieces in manifest["chunks"].items():
        if key.startswith(prefix):
            for shard, offsets, _ in pieces:
                by_file.setdefault(shard, []).append((key, offsets))
    full: dict[str, Any] = {}
    for shard, items in by_file.items():
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            for key, offsets in items:
                piece = f.get_tensor(key)
                if key not in full:
                    full[key] = piece.new_empty(manifest["tensors"][key])
                full[key][tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))] = piece
    return full


def read_sharded_weights(ckpt: Path) -> dict[str, Any]:
    """The full weights of a sharded checkpoint, keyed as the model's state_dict (tied copies stored once)."""
    return {k[len("model."):]: v for k, v in read_shards(read_shards_manifest(ckpt), "model.").items()}


def sharded_training_state(ckpt: Path, manifest: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state, scaler and model training state of a sharded checkpoint in the form
    ``optimizer.safetensors`` holds (parameters numbered in the order of the groups), from its manifest
    and its optimizer tensors (keyed as in the shards: full tensors, or this process's shards)."""
    try:
        groups = manifest["optimizer"]["param_groups"]
        index = {name: i for i, name in enumerate(n for g in groups for n in g["params"])}
        state = {index[name]: {entry: tensors[v["shard"]] if "shard" in v else v["value"]
                               for entry, v in entries.items()}
                 for name, entries in manifest["optimizer"]["state"].items()}
        # JSON has no tuples: a group's list values (Adam's betas) were tuples, "params" aside
        optimizer = {"state": state, "param_groups": [
            {**{k: tuple(v) if isinstance(v, list) else v for k, v in g.items()},
             "params": [index[n] for n in g["params"]]} for g in groups]}
        return {"optimizer": optimizer, "scaler": manifest["scaler"], "model_state": manifest["model_state"]}
    except (KeyError, TypeError, AttributeError) as e:
        raise LMForgeError(f"{ckpt / SHARDS_FILE} is corrupt ({type(e).__name__}: {e}); {_earlier(ckpt)}") from e


def read_sharded_training_state(ckpt: Path) -> dict[str, Any]:
    """``sharded_training_state`` with the full optimizer tensors, put together on this process."""
    manifest = read_shards_manifest(ckpt)
    return sharded_training_state(ckpt, manifest, read_shards(manifest, "optim."))


def consolidate(ckpt: Path, out: Path | None = None) -> Path:
    """Rewrite a sharded checkpoint as an ordinary one (``model.safetensors`` + ``optimizer.safetensors``,
    the rest copied): in place when ``out`` is None, else into the new directory ``out``. The result
    resumes on any number of processes, and is what other tools (a plain safetensors reader) expect."""
    from safetensors.torch import save_file

    from lmforge.safe_state import save_state

    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        what = "is a file, not a checkpoint directory" if ckpt.exists() else "does not exist"
        raise LMForgeError(f"{ckpt} {what}: pass a step checkpoint, runs/NAME/checkpoints/step-NNNNNN")
    if not is_sharded(ckpt):
        if (ckpt / WEIGHTS_FILE).is_file():
            raise LMForgeError(f"{ckpt} is an ordinary checkpoint already ({WEIGHTS_FILE}): nothing to consolidate")
        raise LMForgeError(f"{ckpt} is not a sharded checkpoint (it has no {SHARDS_FILE}): pass a step checkpoint of "
                           "a run trained with training.fsdp_checkpoint=sharded, runs/NAME/checkpoints/step-NNNNNN")
    if out is not None and Path(out).exists():
        raise LMForgeError(f"{out} exists: name a new directory, or leave OUT out to consolidate {ckpt} in place")
    if out is not None and Path(out).resolve().is_relative_to(ckpt.resolve()):
        raise LMForgeError(f"{out} lies inside {ckpt}: name a directory outside it, or leave OUT out to consolidate "
                           f"{ckpt} in place")
    bad = checksum_mismatch(ckpt)  # the consolidated files get checksums of their own: not over damaged shards
    if bad:
        raise LMForgeError(f"{bad}; the checkpoint is damaged: consolidate an earlier one")
    weights = read_sharded_weights(ckpt)
    training = read_sharded_training_state(ckpt) if (ckpt / STATE_FILE).is_file() else None

    def write(tmp: Path) -> None:
        for p in ckpt.iterdir():
            if p.name in (SHARDS_DIR, SHARDS_FILE):
                continue
            (shutil.copytree if p.is_dir() else shutil.copy2)(p, tmp / p.name)
        save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        if training is not None:
            save_state(tmp / OPTIMIZER_FILE, training)

    target = Path(out) if out is not None else ckpt
    return _publish(target.parent, target.name, write)
