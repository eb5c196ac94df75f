"""What a pipeline remembers between runs: ``OUT_DIR/pipeline_state.json``, content hashes, and a lock.

The state file holds one record per stage (its status, the fingerprint of what it was run with and
the hashes that fingerprint was made of, wall time, headline metric) and a cache of content hashes
keyed by path, size and modification time, so a large corpus is read once, not on every run. It is
written atomically (a temporary sibling renamed over it): a crash leaves the previous version.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from lmforge.errors import LMForgeError
from lmforge.files import FileLock, atomic_file, lock_held, sha256_file

STATE_FORMAT = "lmforge-pipeline-state"
STATE_VERSION = 1
LOCK_FILE = ".pipeline.lock"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def digest(value: Any) -> str:
    """sha256 of a JSON-able value, in a canonical form (sorted keys)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


class HashCache:
    """Content hashes of files and directory trees, reused while nothing in them changed.

    A file's entry is keyed by its absolute path and valid while its size and mtime_ns are unchanged; a
    tree's entry holds a digest of its listing (relative path, size, mtime_ns of every file) and is valid
    while that listing is the same. A tree's hash covers its sorted relative paths and their contents."""

    def __init__(self, entries: dict[str, Any] | None = None):
        self.entries: dict[str, Any] = dict(entries or {})

    def file(self, path: Path) -> str:
        path = Path(path)
        st = path.stat()
        key = f"file:{path.resolve()}"
        entry = self.entries.get(key)
        if entry and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns:
            return entry["sha256"]
        value = sha256_file(path)
        self.entries[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": value}
        return value

    def tree(self, root: Path) -> str:
        root = Path(root)
        files: list[tuple[str, Path, os.stat_result]] = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in filenames:
                p = Path(dirpath) / name
                try:
                    st = p.stat()
                except OSError:
                    continue  # a dangling link: not part of the data
                files.append((p.relative_to(root).as_posix(), p, st))
        files.sort(key=lambda f: f[0])
        listing = digest([(rel, st.st_size, st.st_mtime_ns) for rel, _, st in files])
        key = f"tree:{root.resolve()}"
        entry = self.entries.get(key)
        if entry and entry.get("listing") == listing:
            return entry["sha256"]
        h = hashlib.sha256()
        for rel, p, _ in files:
            h.update(rel.encode() + b"\0" + sha256_file(p).encode() + b"\n")
        value = h.hexdigest()
        self.entries[key] = {"listing": listing, "files": len(files), "sha256": value}
        return value

    def path(self, path: str | os.PathLike) -> str:
        """A file's or a directory tree's content hash; a missing path is ``MissingInput``."""
        p = Path(path)
        if p.is_dir():
            return self.tree(p)
        if p.is_file():
            return self.file(p)
        raise MissingInput(f"{p} does not exist")

    def tokenizer(self, path: str | os.PathLike) -> str:
        """A tokenizer (tokenizer.json or its directory): its tokenizer files only, not what lies beside."""
        p = Path(path)
        folder = p if p.is_dir() else p.parent
        main = p if p.is_file() else p / "tokenizer.json"
        if not main.is_file():
            if p.is_dir():
                return self.tree(p)  # a Hugging Face tokenizer directory of another layout
            raise MissingInput(f"tokenizer {p} does not exist")
        parts = {main.name: self.file(main)}
        for name in TOKENIZER_FILES:
            if name != main.name and (folder / name).is_file():
                parts[name] = self.file(folder / name)
        return digest(parts)

    def model(self, model_dir: Path) -> str:
        """A model directory's weights: the sha256 of its model.safetensors (of a sharded checkpoint's
        manifest and shards)."""
        from lmforge.checkpoint import weight_files

        files = weight_files(model_dir)
        missing = [w for w in files if not w.is_file()]
        if missing:
            raise MissingInput(f"{missing[0]} does not exist")
        return self.file(files[0]) if len(files) == 1 else digest({w.name: self.file(w) for w in files})

    def pruned(self) -> dict[str, Any]:
        """The entries whose paths still exist (moved-aside and deleted outputs drop out)."""
        return {k: v for k, v in self.entries.items() if Path(k.split(":", 1)[1]).exists()}


class MissingInput(LMForgeError):
    """An input of a stage is not there (yet): the stage cannot be fingerprinted now."""


class PipelineState:
    def __init__(self, path: Path, pipeline: str, data: dict[str, Any] | None = None):
        self.path = path
        self.data = data or {"format": STATE_FORMAT, "version": STATE_VERSION, "pipeline": pipeline,
                             "stages": {}, "hash_cache": {}}
        self.cache = HashCache(self.data.get("hash_cache"))

    @classmethod
    def load(cls, path: Path, pipeline: str) -> PipelineState:
        if not path.is_file():
            return cls(path, pipeline)
        try:
            data = json.loads(path.read_text())
        except (ValueError, OSError) as e:
            raise LMForgeError(f"{path} is corrupt ({e}). Move it away to start the pipeline's record afresh: "
                               "every stage then runs again and each earlier output is moved aside, not lost") from e
        if not isinstance(data, dict) or data.get("format") != STATE_FORMAT or not isinstance(data.get("stages"), dict):
            raise LMForgeError(f"{path} is not an lmforge pipeline state file; move it away or choose another out_dir")
        if data.get("pipeline") != pipeline:
            raise LMForgeError(f"{path.parent} holds the outputs of pipeline {data.get('pipeline')!r}, not {pipeline!r}; "
                               "give this pipeline its own out_dir")
        return cls(path, pipeline, data)

    @property
    def stages(self) -> dict[str, dict[str, Any]]:
        return self.data["stages"]

    def record(self, stage: str) -> dict[str, Any] | None:
        return self.stages.get(stage)

    def update(self, stage: str, **fields: Any) -> dict[str, Any]:
        rec = self.stages.setdefault(stage, {})
        rec.update(fields)
        self.save()
        return rec

    def save(self) -> None:
        self.data["hash_cache"] = self.cache.entries = self.cache.pruned()
        self.data["updated_at"] = now()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(self.path) as tmp:
            tmp.write_text(json.dumps(self.data, indent=1, sort_keys=False) + "\n")


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def RunLock(out_dir: Path) -> FileLock:  # noqa: N802 (a lock's constructor, named as one)
    """One ``pipeline run`` per out_dir at a time (``lmforge.files.FileLock``)."""
    directory = Path(out_dir)
    return FileLock(directory / LOCK_FILE, lambda holder: LMForgeError(
        f"another `lmforge pipeline run` ({holder}) is working in {directory}; wait for it to finish "
        "(`lmforge pipeline status` shows its progress)"))


def run_in_progress(out_dir: Path) -> bool:
    """Whether a `pipeline run` holds the lock of ``out_dir`` now."""
    return lock_held(Path(out_dir) / LOCK_FILE)
