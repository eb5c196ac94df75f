"""Where a training step's time goes: ``torch.profiler`` over lmforge's loop (``Trainer.step_once``, as
``lmforge bench`` times it) on random tokens, in six groups: GEMM / attention / elementwise / loss /
optimizer / idle (issue 19, item 2). Usage:

    python benchmarks/profile_step.py go_coder_125m --vocab-size 50257 [training.compile=true] [--steps 5]
        [--trace step.json]
    torchrun --standalone --nproc_per_node=1 benchmarks/profile_step.py ... training.parallel=fsdp

On a GPU the kernels' time is grouped and idle is the wall time with no kernel running on it; on a
CPU the operators' own (self) time is grouped and idle is the wall time no operator accounts for
(Python, the loop's bookkeeping, waiting). An operator counts as **loss** when it runs inside the
fused LM head + cross-entropy (``_LinearCrossEntropy``, or the plain cross-entropy ops), as
**optimizer** inside ``Optimizer.step``; otherwise by name: matrix products are GEMM, the attention
kernels attention, everything else elementwise (norms, activations, adds, copies, reductions). Under
``training.compile=true`` the ranges vanish inside the compiled graph and kernels are named after the ops they
fuse: the logits path's cross-entropy (``log_softmax``, ``nll_loss``) still counts as loss, but the chunked
path's softmax (amax, exp, sum) counts as elementwise and its matmuls as GEMM.
``--top N`` (default 15) lists the N kernels (operators on a CPU) with the most time, with their group and
calls per step: what to fuse next. ``--trace`` writes the Chrome trace (gzip-compressed when the name
ends in .gz; open it in ``chrome://tracing`` or Perfetto).
"""

from __future__ import annotations

import argparse
import gzip
import re
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

GROUPS = ("GEMM", "attention", "elementwise", "loss", "optimizer", "idle")
_GEMM = re.compile(r"(^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm)$)|gemm|cutlass|xmma|cublas|sm\d+_", re.I)
_ATTENTION = re.compile(r"scaled_?dot_?product|flash|fmha|efficient_attention|cudnn.*attention|attention", re.I)
_LOSS_RANGE = re.compile(r"_LinearCrossEntropy|cross_entropy|nll_loss|log_softmax")
_OPTIMIZER_RANGE = re.compile(r"^Optimizer\.step|_fused_adamw|_foreach_")


def group_of(name: str, ancestors: list[str]) -> str:
    """The group of one operator or kernel, from the ranges it ran in (innermost last) and its name."""
    if any(_OPTIMIZER_RANGE.search(a) for a in ancestors) or _OPTIMIZER_RANGE.search(name):
        return "optimizer"
    if any(_LOSS_RANGE.search(a) for a in ancestors) or _LOSS_RANGE.search(name):
        return "loss"
    if _ATTENTION.search(name) or any(_ATTENTION.search(a) for a in ancestors[-2:]):
        return "attention"
    if _GEMM.search(name):
        return "GEMM"
    return "elementwise"


def breakdown(prof, wall_us: float, on_gpu: bool) -> tuple[dict[str, float], list[tuple[str, str, float, int]]]:
    """Microseconds per group over the profiled steps, and every kernel (operator on a CPU) as (name, group,
    microseconds, calls), the most time first."""
    times: dict[str, float] = defaultdict(float)
    kernels: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])

    def add(name: str, group: str, us: float) -> None:
        times[group] += us
        kernels[name, group][0] += us
        kernels[name, group][1] += 1

    for event in prof.events():
        chain, parent = [], event.cpu_parent
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        ancestors = [*reversed(chain), event.name]
        if on_gpu:
            for kernel in event.kernels:  # the device work this operator launched itself
                add(kernel.name, group_of(kernel.name, ancestors), kernel.duration)
        elif event.device_type == torch.autograd.DeviceType.CPU:
            add(event.name, group_of(event.name, ancestors[:-1]), event.self_cpu_time_total)
    times["idle"] = max(0.0, wall_us - sum(times.values()))
    ranked = sorted(((name, group, us, calls) for (name, group), (us, calls) in kernels.items()),
                    key=lambda k: -k[2])
    return {g: times.get(g, 0.0) for g in GROUPS}, ranked


def export_trace(prof, path: str) -> None:
    """The Chrome trace at ``path``, gzip-compressed where it ends in .gz (Perfetto opens both)."""
    if not path.endswith(".gz"):
        prof.export_chrome_trace(path)
        return
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(plain))
        with plain.open("rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="a preset name or recipe file, as lmforge bench takes")
    parser.add_argument("overrides", nargs="*", help="key=value settings")
    parser.add_argument("--vocab-size", type=int, default=8192, help="for recipes whose vocabulary comes from data")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=15, help="list this many kernels with the most time (0: none)")
    parser.add_argument("--trace", default=None, help="write the Chrome trace here")
    args = parser.parse_intermixed_args()

    sys.path.insert(0, str(Path(__file__).parent))
    from lmforge.bench import _join_for_fsdp
    from lmforge.config import load_config
    from lmforge.train.distributed import shutdown

    cfg = load_config(args.recipe, args.overrides)
    if getattr(cfg.model, "vocab_size", 1) == 0:
        cfg.model.vocab_size = args.vocab_size
    # training.parallel=fsdp: FSDP over one process, launched as `torchrun --standalone --nproc_per_node=1
    # benchmarks/profile_step.py ...` (as lmforge bench times it)
    distinfo = _join_for_fsdp(cfg, compare_transformers=False)
    try:
        profile_steps(args, cfg)
    finally:
        shutdown(distinfo)


def profile_steps(args: argparse.Namespace, cfg) -> None:
    from common import cpu_name

    from lmforge.bench import _lmforge_stepper
    from lmforge.device import _sync, setup_device

    devinfo = setup_device(cfg.training.device, cfg.training.precision, cfg.training.peak_flops)
    on_gpu = devinfo.device.type == "cuda"
    where = torch.cuda.get_device_name(devinfo.device) if on_gpu else cpu_name()
    sharded = f", {cfg.training.parallel} over one process" if cfg.training.parallel != "ddp" else ""
    print(f"{cfg.name} on {where}, {devinfo.precision}, compile={cfg.training.compile}{sharded}, micro-batch "
          f"{cfg.training.micro_batch_size} x {cfg.data.seq_len}; {args.steps} profiled steps after {args.warmup}")
    with tempfile.TemporaryDirectory() as tmp:
        step, _ = _lmforge_stepper(cfg, devinfo, Path(tmp))
        for _ in range(args.warmup):
            step()
        _sync(devinfo.device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            _sync(devinfo.device)
            wall_us = (time.perf_counter() - start) * 1e6
    if args.trace:
        export_trace(prof, args.trace)
    times, ranked = breakdown(prof, wall_us, on_gpu)
    print(f"\n{'per step' if args.steps == 1 else f'per step (mean of {args.steps})'}: "
          f"{wall_us / args.steps / 1e3:.1f} ms wall ({'GPU kernels' if on_gpu else 'CPU operators, self time'})")
    print("| group | ms per step | share |")
    print("| --- | --- | --- |")
    for group in GROUPS:
        print(f"| {group} | {times[group] / args.steps / 1e3:.2f} | {100 * times[group] / wall_us:.1f}% |")
    busy = sum(times[g] for g in GROUPS if g != "idle")
    if busy > 1.02 * wall_us:
        # seen once, at 1.3B on an H200: the optimizer's kernels at 184% of the wall time, others summing past it
        print(f"warning: the {'kernels' if on_gpu else 'operators'} add up to {100 * busy / wall_us:.0f}% of the "
              "wall time: they overlapped (several streams or threads) or the profiler attributed some twice, so "
              "the shares above are not reliable; read the trace (--trace) instead")
    if args.top > 0:
        print(f"\nthe {min(args.top, len(ranked))} {'kernels' if on_gpu else 'operators'} with the most time")
        print("| name | group | ms per step | share | calls per step |")
        print("| --- | --- | --- | --- | --- |")
        for name, group, us, calls in ranked[:args.top]:
            short = name if len(name) <= 90 else name[:87] + "..."
            print(f"| `{short}` | {group} | {us / args.steps / 1e3:.2f} | {100 * us / wall_us:.1f}% | "
                  f"{calls / args.steps:g} |")


if __name__ == "__main__":
    main()
