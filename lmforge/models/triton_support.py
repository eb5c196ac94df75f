"""Whether lmforge's Triton kernels (the cross-entropy of ``losses``, mHC's of ``mhc``) can be built here."""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil

import torch


@functools.lru_cache(maxsize=None)
def _toolchain_present() -> bool:
    has_cc = bool(os.environ.get("CC")) or any(shutil.which(c) for c in ("cc", "gcc", "clang"))
    return has_cc and importlib.util.find_spec("triton") is not None


@torch.compiler.assume_constant_result
def can_build_triton_kernels() -> bool:
    """Triton, and the C compiler it builds its launchers with (``$CC``, or ``cc``/``gcc``/``clang`` on the
    PATH). Asked inside compiled models' forwards: Dynamo takes the answer as a constant, where tracing the
    file-system lookups would break the graph in two (it did on an H200, at the loss: a second graph and its
    launch gap every step)."""
    return _toolchain_present()
