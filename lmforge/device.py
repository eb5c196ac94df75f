"""Device, precision and peak-FLOP/s selection: pick what the hardware does well."""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lmforge.errors import LMForgeError

# Dense (no sparsity) peak tensor-core FLOP/s for bf16/fp16, by substring of the device name.
# Order matters: more specific names first.
_GPU_PEAK_BF16 = [
    ("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("GH200", 989e12),
    ("B200", 2250e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12), ("L40", 181e12),
    ("L4", 121e12), ("A10G", 125e12), ("A10", 125e12), ("RTX 4090", 165e12), ("RTX 4080", 97e12),
    ("RTX 3090", 71e12), ("RTX 3080", 59e12), ("V100", 125e12), ("T4", 65e12),
    ("MI300X", 1307e12), ("MI250", 362e12), ("RX 7900", 123e12), ("RX 6700", 26e12),
]


@dataclass
class DeviceInfo:
    device: torch.device
    precision: str  # fp32 | bf16 | fp16
    peak_flops: float  # FLOP/s the MFU is measured against
    peak_source: str  # where peak_flops came from (table, measured, config)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)

    def autocast(self):
        dtype = self.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)


def check_gpu_count(processes: int, requested: str = "auto") -> None:
    """About to start ``processes`` training processes on this machine (a pipeline stage's torchrun),
    for a run that would train on its GPUs: more than it has is refused, since two processes on one
    GPU otherwise fail deep inside NCCL's first collective. (Processes torchrun already started are
    checked by ``lmforge.train.distributed.check_one_gpu_per_process``: a launcher may show each
    process only its own GPU.)"""
    on_gpu = requested == "auto" or requested.startswith("cuda")
    if processes > 1 and on_gpu and torch.cuda.is_available() and torch.cuda.device_count() < processes:
        n = torch.cuda.device_count()
        raise LMForgeError(f"{processes} training processes on this machine, but PyTorch sees {n} GPU(s): start at most "
                           f"{n} (torchrun --nproc_per_node {n}, or a pipeline stage's processes: {n}), or train on "
                           "the CPU with training.device=cpu")


def pick_device(requested: str = "auto", local_rank: int = 0) -> torch.device:
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(requested)
    except RuntimeError as e:
        raise LMForgeError(f"training.device={requested!r} is not a device ({e}); use auto, cpu, cuda, cuda:N or mps") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LMForgeError("training.device=cuda but PyTorch sees no CUDA/ROCm GPU; use training.device=auto or cpu")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise LMForgeError("training.device=mps but MPS is not available; use training.device=auto or cpu")
    if device.type == "cuda" and (device.index is None or int(os.environ.get("WORLD_SIZE", "1")) > 1):
        device = torch.device("cuda", local_rank)  # under torchrun each process takes its own GPU
    return device


def cpu_has_fast_bf16() -> bool:
    """True on CPUs with bf16 matrix units (AMX / AVX512-BF16); elsewhere bf16 is emulated and slow."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def pick_precision(requested: str, device: torch.device) -> str:
    if requested != "auto":
        if requested == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise LMForgeError("this GPU has no bf16 support; use training.precision=fp16 (with loss scaling) or fp32")
        if requested == "fp16" and device.type == "cpu":
            raise LMForgeError("training.precision=fp16 is for GPUs; on a CPU use fp32 (or bf16 on CPUs with AMX)")
        return requested
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if device.type == "cpu" and cpu_has_fast_bf16():
        return "bf16"
    return "fp32"  # MPS and plain CPUs: fp32 is the fast and safe choice


def peak_flops(device: torch.device, precision: str, override: float = 0.0) -> tuple[float, str]:
    if override > 0:
        return override, "training.peak_flops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in _GPU_PEAK_BF16:
            if key in name:
                if precision == "fp32":
                    if key in ("V100", "T4"):  # no TF32 on these: plain fp32 peaks
                        return {"V100": 15.7e12, "T4": 8.1e12}[key], f"{name} fp32 peak (table)"
                    return flops / 2, f"{name} TF32 peak (table)"
                return flops, f"{name} {precision} peak (table)"
    measured = measure_matmul_flops(device, precision)
    best = remember_peak(_machine_key(device, precision), measured)
    return best, "measured matmul peak" + (", the best seen on this machine" if best > measured else "")


def measure_matmul_flops(device: torch.device, precision: str, seconds: float = 0.5, min_timings: int = 3,
                         n: int = 0, clock=time.perf_counter) -> float:
    """Best FLOP/s of a square matmul on this device: the honest ceiling where no spec table applies.

    The best of several timings, so one interrupted by another program does not lower it."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    # Large enough that the matmul runs at its best rate (LM-head-sized matmuls would otherwise
    # beat it and MFU could read above 100%); small slow-dtype case so it stays quick.
    n = n or ((256 if dtype != torch.float32 else 2048) if device.type == "cpu" else 8192)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best, timings = 0.0, 0
    a @ b  # warm-up
    deadline = clock() + seconds
    while timings < min_timings or clock() < deadline:
        _sync(device)
        t0 = clock()
        a @ b
        _sync(device)
        best = max(best, 2 * n**3 / max(clock() - t0, 1e-12))
        timings += 1
    return best


def _machine_key(device: torch.device, precision: str) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
        with contextlib.suppress(OSError):
            with open("/proc/cpuinfo") as f:
                name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    return f"{device.type}|{name}|{torch.get_num_threads()} threads|{precision}|torch {torch.__version__}"


def peak_cache_path() -> Path:
    """Where measured peaks are kept: $LMFORGE_CACHE_DIR, else $XDG_CACHE_HOME/lmforge or ~/.cache/lmforge."""
    root = os.environ.get("LMFORGE_CACHE_DIR")
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lmforge"
    return Path(root) / "peak_flops.json"


def remember_peak(key: str, measured: float) -> float:
    """The best peak measured for ``key`` on this machine, this measurement included.

    A matmul timed while another program is busy reads low, and MFU against it reads high (issue 14 saw
    1,113%); the best figure seen so far, kept in a small JSON file, is the better ceiling. The cache is
    only a hint: an unreadable or unwritable one is ignored."""
    path = peak_cache_path()
    try:
        cache = json.loads(path.read_text())
        if not isinstance(cache, dict):
            cache = {}
    except (OSError, ValueError):
        cache = {}
    cached = cache.get(key)
    cached = float(cached) if isinstance(cached, (int, float)) and math.isfinite(cached) else 0.0
    if measured <= cached:
        return cached
    cache[key] = measured
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        os.replace(tmp, path)
    return measured


def model_flops_utilization(tokens_per_s: float, flops_per_token: float, peak: float,
                            processes: int = 1) -> float | None:
    """Achieved FLOP/s over the peak, or None where that figure would be nonsense: no peak known, or
    above 100% (the peak was measured low, e.g. while another program was busy)."""
    if peak <= 0:
        return None
    mfu = tokens_per_s * flops_per_token / (peak * processes)
    return mfu if mfu <= 1.0 else None


def adamw_kernels(device: torch.device) -> dict[str, bool]:
    """AdamW's fastest implementation on ``device``: the fused kernel wherever PyTorch has one (CUDA,
    CPU, MPS, ...; on this project's 2-core CPU it steps 21M parameters in 22 ms against foreach's
    122 ms), foreach elsewhere. The fused kernel also takes ``found_inf``: the training loop skips a
    non-finite update on the device with it, without reading the gradient norm on the host."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return {"fused": True} if device.type in _get_fused_kernels_supported_devices() else {"foreach": True}


def peak_memory_mb(device: torch.device, reset: bool = False) -> float | None:
    """The most memory this process has held, in MiB: on CUDA the GPU memory allocated by PyTorch (since the
    start, or the last ``reset``); elsewhere the process's peak resident set (Linux, macOS: it includes the
    Python and PyTorch baseline of a few hundred MiB and cannot be reset). None where it cannot be read.
    Reading it does not wait for the device."""
    if device.type == "cuda":
        mb = torch.cuda.max_memory_allocated(device) / 2**20
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return mb
    try:
        import resource
    except ImportError:  # Windows
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def keep_freed_memory_for_reuse() -> bool:
    """On glibc, stop returning freed blocks to the OS. Returns whether the setting was applied.

    A training step allocates and frees the same large activation buffers every step. By default
    glibc serves large blocks with fresh ``mmap`` pages and unmaps them on free, so each step pays
    page faults on every such buffer again (measured in benchmarks/RESULTS.md: ~20% of a CPU step).
    Keeping freed memory in the heap lets the next step reuse it; the process's memory stays at its
    peak, as it would with a caching allocator. ``LMFORGE_MALLOC_TUNING=0`` turns this off.
    """
    if os.environ.get("LMFORGE_MALLOC_TUNING", "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # from glibc's malloc.h
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))


def setup_device(requested: str, precision: str, peak_override: float, local_rank: int = 0) -> DeviceInfo:
    device = pick_device(requested, local_rank)
    if device.type == "cpu":
        keep_freed_memory_for_reuse()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    prec = pick_precision(precision, device)
    flops, source = peak_flops(device, prec, peak_override)
    return DeviceInfo(device=device, precision=prec, peak_flops=flops, peak_source=source)
