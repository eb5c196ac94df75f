"""Writing a whole output directory so that a reader never sees half of it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def move_into_place(tmp: Path, out: Path) -> None:
    """Replace ``out`` by the complete ``tmp``; the old contents are deleted only after the swap."""
    if not out.exists():
        os.rename(tmp, out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)  # put the previous data back where the user left it
        raise
    shutil.rmtree(old)


@contextmanager
def atomic_directory(out: Path) -> Iterator[Path]:
    """Yield a hidden sibling of ``out`` to fill; when the block succeeds it replaces ``out``
    (``move_into_place``), when it fails it is removed and ``out`` is left as it was."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
