"""Whether lmforge's Triton kernels (the cross-entropy of ``losses``, mHC's of ``mhc``) can be built here, and what
a user reads when they fail to build on a GPU."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
from collections.abc import Iterator

from lmforge.errors import LMForgeError


@functools.lru_cache(maxsize=None)
def _toolchain_present() -> bool:
    has_cc = bool(os.environ.get("CC")) or any(shutil.which(c) for c in ("cc", "gcc", "clang"))
    return has_cc and importlib.util.find_spec("triton") is not None


def can_build_triton_kernels() -> bool:
    """Triton, and the C compiler it builds its launchers with (``$CC``, or ``cc``/``gcc``/``clang`` on the
    PATH). Asked inside compiled models' forwards: Dynamo takes the answer as a constant, where tracing the
    file-system lookups would break the graph in two (it did on an H200, at the loss: a second graph and its
    launch gap every step)."""
    return _toolchain_present()


# What @torch.compiler.assume_constant_result does (torch/_dynamo/decorators.py sets this flag and nothing else),
# without the import of torch._dynamo it makes: ~2 s of CPU for every verb, compiled or not. A test compiles a
# caller with fullgraph=True, so a torch that renames the flag fails it.
can_build_triton_kernels._dynamo_marked_constant = True  # type: ignore[attr-defined]


@contextlib.contextmanager
def naming_triton_failures(what: str, fix: str) -> Iterator[None]:
    """Inside it, an error of Triton's own (its compiler, ptxas, a kernel needing more shared memory than the GPU
    has: exceptions from the ``triton`` package) becomes an LMForgeError naming ``what`` failed and the setting
    that avoids the kernels (``fix``). Other errors (CUDA out of memory, wrong inputs) pass through unchanged."""
    try:
        yield
    except Exception as e:
        if not type(e).__module__.startswith("triton"):
            raise
        detail = " ".join(str(e).split())[:500]  # compiler messages span lines; the whole one stays chained below
        raise LMForgeError(f"{what}'s Triton kernels failed on this GPU ({type(e).__name__}: {detail}). {fix}, or "
                           "try another Triton version.") from e
