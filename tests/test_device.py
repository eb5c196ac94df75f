"""Device, precision and allocator choices made from the hardware."""

import platform

import pytest
import torch

from lmforge.errors import LMForgeError
from lmforge.device import cpu_has_fast_bf16, keep_freed_memory_for_reuse, pick_device, pick_precision


def test_auto_device_and_precision_follow_the_hardware():
    device = pick_device("auto")
    expected = "cuda" if torch.cuda.is_available() else ("mps" if torch.backends.mps.is_available() else "cpu")
    assert device.type == expected
    cpu = torch.device("cpu")
    # bf16 only where the CPU has bf16 matrix units; elsewhere it is emulated and far slower than fp32
    assert pick_precision("auto", cpu) == ("bf16" if cpu_has_fast_bf16() else "fp32")
    assert pick_precision("fp32", cpu) == "fp32"


@pytest.mark.parametrize("requested, message", [
    ("gpu0", "is not a device"),
    ("cuda", "PyTorch sees no CUDA/ROCm GPU") if not torch.cuda.is_available() else ("nonsense", "is not a device"),
])
def test_bad_device_names_are_clear_errors(requested, message):
    with pytest.raises(LMForgeError, match=message):
        pick_device(requested)


def test_more_processes_on_a_machine_than_gpus_are_refused(monkeypatch):
    """Before a pipeline stage starts torchrun: more processes than the machine's GPUs fail inside
    NCCL's first collective; lmforge says so before. (Two visible GPUs are simulated: the check is on
    the count.) Inference and a single process are never refused, whatever the environment says."""
    from lmforge.device import check_gpu_count

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for requested in ("auto", "cuda", "cuda:1"):
        with pytest.raises(LMForgeError, match=r"3 training processes on this machine, but PyTorch sees 2 GPU\(s\): "
                                               r"start at most 2 \(torchrun --nproc_per_node 2"):
            check_gpu_count(3, requested)
    check_gpu_count(3, "cpu")  # gloo on the CPU: as many processes as one likes
    check_gpu_count(2, "auto")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # a launcher's environment does not concern pick_device
    assert pick_device("auto", local_rank=1) == torch.device("cuda", 1)


def test_processes_sharing_a_gpu_are_found_by_machine_and_uuid():
    """Under torchrun each process reports (machine, GPU UUID); a launcher that shows every process
    only its own GPU (each sees cuda:0) gives distinct UUIDs and passes."""
    from lmforge.train.distributed import shared_gpus

    assert shared_gpus([("a", "GPU-1"), ("a", "GPU-2"), ("b", "GPU-1"), ("b", "GPU-2")]) == []
    assert shared_gpus([("a", "GPU-1"), ("a", "GPU-1"), ("a", "GPU-2"), ("b", "GPU-2")]) == [("a", "GPU-1")]


def test_fp16_on_cpu_is_refused():
    with pytest.raises(LMForgeError, match="fp16 is for GPUs"):
        pick_precision("fp16", torch.device("cpu"))


def test_allocator_tuning_applies_on_glibc_and_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("LMFORGE_MALLOC_TUNING", "0")
    assert keep_freed_memory_for_reuse() is False
    monkeypatch.delenv("LMFORGE_MALLOC_TUNING")
    assert keep_freed_memory_for_reuse() is (platform.libc_ver()[0] == "glibc")


def test_peak_memory_is_the_process_high_water_mark_in_mib():
    """On a CPU ``peak_memory_mb`` is the process's peak resident set, in MiB: after touching 800 MiB more than
    it holds now (read from /proc, in pages), it reports about the resident size then: not KiB, not bytes."""
    import subprocess
    import sys

    code = ("import numpy as np, resource, torch; from lmforge.device import peak_memory_mb\n"
            "resident = lambda: int(open('/proc/self/statm').read().split()[1]) * resource.getpagesize() / 2**20\n"
            "cpu = torch.device('cpu'); now = resident()\n"
            "x = np.ones(800 * 2**20 // 8); print(now, resident(), peak_memory_mb(cpu), peak_memory_mb(cpu, reset=True))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    before, after, peak, again = map(float, done.stdout.split())
    assert after - before > 0.95 * 800, (before, after)  # the array is resident
    # its peak: at least the resident size now, in MiB (the kernel's two counts differ by a few pages), and not
    # KiB or bytes; it may be above it where the kernel dropped some of the process's file pages (its libraries'
    # code, read again when needed) since their peak, as on a machine busy with other jobs
    assert after - 0.05 * 800 < peak < 1.5 * after, (after, peak)
    assert again >= peak  # a process's peak cannot be reset on a CPU
