"""Writing outputs so that a reader never sees half of one, and a failed write says why in one line.

Every writer fills a hidden temporary sibling (``.NAME.tmp-PID``) and renames it into place when it is
complete. A crash (even ``kill -9``) leaves at most that hidden sibling, or, if it struck between the
two renames that replace an earlier output, the earlier output moved aside as ``.NAME.old-PID``; the
next writer of the same output removes the first and puts the second back (``remove_stale``).
A full disk or a permission error while writing becomes an ``LMForgeError`` that names the output
path and the problem (``reporting_write_faults``).
"""

from __future__ import annotations

import errno
import glob
import hashlib
import os
import re
import shutil
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from lmforge.errors import LMForgeError

# errno -> (what happened, what the user can do about it)
_FAULTS = {
    errno.ENOSPC: ("no space left on device", "free space"),
    errno.EDQUOT: ("disk quota exceeded", "free space"),
    errno.EFBIG: ("file too large", "raise the file size limit (ulimit -f)"),
    errno.EACCES: ("permission denied", "make it writable"),
    errno.EPERM: ("operation not permitted", "make it writable"),
    errno.EROFS: ("read-only file system", "make it writable"),
}
_RUST_IO_ERROR = re.compile(r"\(os error (\d+)\)")  # how safetensors and tokenizers report an errno
_TEMPORARY = re.compile(r"^\.(.+)\.(tmp|old)-(\d+)$")
OUT_FIX = "or choose another --out"


def temporary_sibling(path: Path) -> Path:
    """The hidden name this process builds ``path`` under before renaming it into place."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _fault_errno(e: BaseException) -> int | None:
    while e is not None:
        if isinstance(e, OSError) and e.errno in _FAULTS:
            return e.errno
        m = _RUST_IO_ERROR.search(str(e))
        if m and int(m.group(1)) in _FAULTS:
            return int(m.group(1))
        e = e.__cause__ or e.__context__
    return None


def _public_path(where: Path, out: Path, tmp: Path | None) -> Path:
    """The path the user knows for ``where``: inside ``tmp`` -> inside ``out``; hidden temporaries -> their name."""
    if tmp is not None and where.is_relative_to(tmp):
        where = out / where.relative_to(tmp)
    return Path(*(m.group(1) if (m := _TEMPORARY.match(part)) else part for part in where.parts))


def write_fault(e: BaseException, out: Path, fix: str = OUT_FIX, tmp: Path | None = None) -> LMForgeError | None:
    """The one-line error for a full disk or a permission problem while writing ``out`` (built in ``tmp``),
    or None when ``e`` is something else. ``fix`` completes "free space ..." / "make it writable ..."."""
    code = _fault_errno(e)
    if code is None:
        return None
    filename = getattr(e, "filename", None)
    where = _public_path(Path(filename) if filename else out, out, tmp)
    problem, action = _FAULTS[code]
    return LMForgeError(f"{problem} while writing {where}: {action} {fix}")


@contextmanager
def reporting_write_faults(out: Path, fix: str = OUT_FIX, tmp: Path | None = None) -> Iterator[None]:
    """Turn a full disk or a permission error inside the block into ``write_fault``'s LMForgeError."""
    try:
        yield
    except Exception as e:
        fault = write_fault(e, out, fix, tmp)
        if fault is None:
            raise
        raise fault from e


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own leftovers are stale by definition: we are about to write anew
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_stale(out: Path) -> None:
    """Clean what killed writers of ``out`` left: unfinished ``.NAME.tmp-PID`` siblings are removed, and an
    earlier output moved aside as ``.NAME.old-PID`` is put back if its replacement never arrived.
    Siblings of a writer that is still running are left alone."""
    if not out.parent.is_dir():
        return
    for sibling in sorted(out.parent.glob(f".{glob.escape(out.name)}.*-*")):
        m = _TEMPORARY.match(sibling.name)
        if not m or m.group(1) != out.name or _alive(int(m.group(3))):
            continue
        if m.group(2) == "old" and not out.exists():
            os.rename(sibling, out)
        else:
            _remove(sibling)


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
    _remove(old)


@contextmanager
def atomic_directory(out: Path, fix: str = OUT_FIX) -> Iterator[Path]:
    """Yield a hidden sibling of ``out`` to fill; when the block succeeds it replaces ``out``
    (``move_into_place``), when it fails it is removed and ``out`` is left as it was. A full disk or a
    permission error is reported as ``write_fault``'s one-line LMForgeError."""
    tmp = temporary_sibling(out)
    with reporting_write_faults(out, fix, tmp):
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(out)
        tmp.mkdir()
        try:
            yield tmp
            move_into_place(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


@contextmanager
def atomic_file(out: Path) -> Iterator[Path]:
    """Like ``atomic_directory`` for one file: yield the hidden path to write, then rename it to ``out``.
    Failures are left to the caller to report: the file may be one part of a larger output."""
    tmp = temporary_sibling(out)
    remove_stale(out)
    try:
        yield tmp
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class FileLock:
    """An exclusive advisory lock on ``path`` (``flock``: the OS releases it when its holder exits or dies,
    kill -9 too), whose file says who holds it ("pid N on HOST"). Where there are no file locks (Windows'
    Python has no fcntl; Lustre mounted noflock or NFS without lockd refuse them) a live PID of this host in
    the file is the lock, as a best effort. ``refuse(holder)`` is the error when another process holds it."""

    def __init__(self, path: Path, refuse: Callable[[str], LMForgeError]):
        self.path = Path(path)
        self.refuse = refuse
        self.fd: int | None = None

    def acquire(self) -> FileLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise LMForgeError(f"cannot create the lock file {self.path} ({e.strerror}): make {self.path.parent} "
                               "writable, or choose another directory") from e
        holder = _holder(fd)
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:
            if _live_holder(holder):
                os.close(fd)
                raise self.refuse(holder) from None
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) or _live_holder(holder):
                os.close(fd)
                raise self.refuse(holder) from None
            print(f"note: {self.path.parent} does not take file locks ({e.strerror}): lmforge cannot stop a "
                  "process on another machine from working here at the same time", file=sys.stderr)
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_UN)
        except (ImportError, OSError):  # no file locks here: the PID in the file was the lock
            os.ftruncate(self.fd, 0)
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> FileLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def lock_held(path: Path) -> bool:
    """Whether a live process holds the ``FileLock`` of ``path`` now (False where that cannot be told)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except ImportError:
        return _live_holder(_holder(fd))
    except OSError as e:
        return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) or _live_holder(_holder(fd))
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _holder(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 200).decode(errors="replace").strip() or "pid ?"


def _live_holder(holder: str) -> bool:
    m = re.match(r"pid (\d+) on (.+)$", holder)
    return bool(m and m.group(2) == socket.gethostname() and _alive(int(m.group(1))))


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read in 8 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            h.update(chunk)
    return h.hexdigest()
