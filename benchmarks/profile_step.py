"""Where a training step's time goes: ``torch.profiler`` over lmforge's loop (``Trainer.step_once``, as
``lmforge bench`` times it) on random tokens, in six groups: GEMM / attention / elementwise / loss /
optimizer / idle (issue 19, item 2). Usage:

    python benchmarks/profile_step.py go_coder_125m --vocab-size 50257 [training.compile=true] [--steps 5]
        [--trace step.json]
    python benchmarks/profile_step.py --read step.json.gz   # the report of a GPU trace, here
    torchrun --standalone --nproc_per_node=1 benchmarks/profile_step.py ... training.parallel=fsdp

On a GPU the kernels' time is grouped, read from the exported Chrome trace (each kernel once, in the
group of the ranges around the launch that queued it), and idle is the wall time with no kernel running
on it; a table of the host's named ranges follows (FSDP's hooks, compiled graphs' calls, the optimizer
step), which says where a host-bound step's time goes. On a CPU the operators' own (self) time is grouped
and idle is the wall time no operator accounts for (Python, the loop's bookkeeping, waiting). An operator counts as **loss** when it runs inside the
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
import json
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


def breakdown(prof, wall_us: float) -> tuple[dict[str, float], list[tuple[str, str, float, int]]]:
    """On a CPU: microseconds per group over the profiled steps (operators' self time), and every operator as
    (name, group, microseconds, calls), the most time first. (On a GPU, ``trace_breakdown``.)"""
    times: dict[str, float] = defaultdict(float)
    operators: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue
        chain, parent = [], event.cpu_parent
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        group = group_of(event.name, list(reversed(chain)))
        times[group] += event.self_cpu_time_total
        operators[event.name, group][0] += event.self_cpu_time_total
        operators[event.name, group][1] += 1
    times["idle"] = max(0.0, wall_us - sum(times.values()))
    ranked = sorted(((name, group, us, calls) for (name, group), (us, calls) in operators.items()),
                    key=lambda k: -k[2])
    return {g: times.get(g, 0.0) for g in GROUPS}, ranked


def trace_breakdown(trace: dict, wall_us: float) -> tuple[dict[str, float], list[tuple[str, str, float, int]], float]:
    """``breakdown``'s groups and kernels for a GPU, read from a Chrome trace (``export_chrome_trace``'s JSON)
    instead of the profiler's event tree, which at 1.3B counted some kernels more than once: each kernel is
    counted once, in the group of the operators around the launch that queued it (matched by its
    correlation id, on the launching thread). Idle is the wall time no kernel covers (kernels on several
    streams at once count once), so the groups may add up to more than the busy time; the third value is that
    overlap in microseconds."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    ranges: dict[object, list[dict]] = defaultdict(list)  # the host's operators and launches, by thread
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver") and "dur" in e:
            ranges[e.get("tid")].append(e)
    launch_ancestors: dict[object, list[str]] = {}  # correlation id -> the ranges around the launch, outermost first
    for thread in ranges.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for e in thread:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
                launch_ancestors[e["args"]["correlation"]] = [r["name"] for r in stack]
            stack.append(e)
    times: dict[str, float] = defaultdict(float)
    per_kernel: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for k in kernels:
        group = group_of(k["name"], launch_ancestors.get(k.get("args", {}).get("correlation"), []))
        times[group] += k["dur"]
        per_kernel[k["name"], group][0] += k["dur"]
        per_kernel[k["name"], group][1] += 1
    busy, end = 0.0, float("-inf")  # the union of the kernels' intervals
    for start, stop in sorted((k["ts"], k["ts"] + k["dur"]) for k in kernels):
        if start >= end:
            busy += stop - start
        elif stop > end:
            busy += stop - end
        end = max(end, stop)
    overlap = max(0.0, sum(times.values()) - busy)
    times["idle"] = max(0.0, wall_us - busy)
    ranked = sorted(((name, group, us, calls) for (name, group), (us, calls) in per_kernel.items()),
                    key=lambda k: -k[2])
    return {g: times.get(g, 0.0) for g in GROUPS}, ranked, overlap


def host_ranges(trace: dict) -> list[tuple[str, float, int]]:
    """The host's named ranges (``record_function``: FSDP's hooks, the optimizer step, compiled graphs'
    calls) as (name, microseconds, count), the most time first; names that differ only in a module named in
    parentheses (``FSDP::pre_forward (model.blocks.3)``) are summed as one. Nested ranges count in each."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    total: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        name = e.get("name", "")
        if "dur" in e and (e.get("cat") == "user_annotation" or (e.get("cat") == "cpu_op" and (
                name.startswith("## Call CompiledFxGraph") or name in ("CompiledFunction", "CompiledFunctionBackward")))):
            key = re.sub(r" \(.*\)$| for \S+$", "", name)
            key = "## Call CompiledFxGraph" if key.startswith("## Call CompiledFxGraph") else key
            total[key][0] += e["dur"]
            total[key][1] += 1
    return sorted(((n, us, int(c)) for n, (us, c) in total.items()), key=lambda r: -r[1])


def load_trace(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            return json.load(f)
    except (OSError, ValueError) as e:  # missing, not gzip, not JSON
        raise SystemExit(f"{path}: not a readable Chrome trace ({e}); give a file written by --trace") from e


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
    parser.add_argument("recipe", nargs="?", help="a preset name or recipe file, as lmforge bench takes")
    parser.add_argument("overrides", nargs="*", help="key=value settings")
    parser.add_argument("--vocab-size", type=int, default=8192, help="for recipes whose vocabulary comes from data")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps to profile (default 5); with --read, the steps the trace holds (default: its "
                             "optimizer steps counted)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=15, help="list this many kernels with the most time (0: none)")
    parser.add_argument("--trace", default=None, help="write the Chrome trace here")
    parser.add_argument("--read", default=None, metavar="TRACE",
                        help="report on a trace written earlier by --trace on a GPU (give its --steps) and exit")
    args = parser.parse_intermixed_args()
    if args.read:
        read(args.read, args.steps, args.top)
        return
    if args.recipe is None:
        parser.error("give a recipe to profile, or --read TRACE")
    args.steps = args.steps or 5

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
          f"{cfg.training.micro_batch_size} x {cfg.spec.seq_len(cfg)}; {args.steps} profiled steps after {args.warmup}")
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
    if on_gpu:
        with tempfile.TemporaryDirectory() as tmp:
            path = args.trace or str(Path(tmp) / "trace.json.gz")
            export_trace(prof, path)
            trace = load_trace(path)
        times, ranked, overlap = trace_breakdown(trace, wall_us)
        report(times, ranked, wall_us, args.steps, args.top, "GPU kernels", overlap)
        report_host(trace, args.steps, args.top)
    else:
        if args.trace:
            export_trace(prof, args.trace)
        times, ranked = breakdown(prof, wall_us)
        report(times, ranked, wall_us, args.steps, args.top, "CPU operators, self time")


def report(times: dict[str, float], ranked: list, wall_us: float, steps: int, top: int, what: str,
           overlap: float = 0.0) -> None:
    print(f"\n{'per step' if steps == 1 else f'per step (mean of {steps})'}: {wall_us / steps / 1e3:.1f} ms wall ({what})")
    print("| group | ms per step | share |")
    print("| --- | --- | --- |")
    for group in GROUPS:
        print(f"| {group} | {times[group] / steps / 1e3:.2f} | {100 * times[group] / wall_us:.1f}% |")
    if overlap > 0.02 * wall_us:
        print(f"(kernels ran side by side on several streams for {overlap / steps / 1e3:.2f} ms a step: the groups "
              "add up to more than the busy time)")
    if top > 0:
        print(f"\nthe {min(top, len(ranked))} {'kernels' if 'GPU' in what else 'operators'} with the most time")
        print("| name | group | ms per step | share | calls per step |")
        print("| --- | --- | --- | --- | --- |")
        for name, group, us, calls in ranked[:top]:
            short = name if len(name) <= 90 else name[:87] + "..."
            print(f"| `{short}` | {group} | {us / steps / 1e3:.2f} | {100 * us / wall_us:.1f}% | {calls / steps:g} |")


def report_host(trace: dict, steps: int, top: int) -> None:
    rows = host_ranges(trace)[:max(top, 1)]
    print("\nthe host's named ranges with the most time (nested ranges count in each)")
    print("| range | ms per step | calls per step |")
    print("| --- | --- | --- |")
    for name, us, calls in rows:
        print(f"| `{name[:90]}` | {us / steps / 1e3:.2f} | {calls / steps:g} |")


def read(path: str, steps: int | None, top: int) -> None:
    """``--read``: the report of a trace written earlier by ``--trace`` (on a GPU); its wall time is the span
    of its kernels and host ranges; ``steps`` (None: the optimizer steps it holds) divides the figures."""
    trace = load_trace(path)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    if steps is None:
        steps = sum(1 for e in events if e.get("cat") == "user_annotation" and e.get("name", "").startswith(
            "Optimizer.step#"))
        if not steps:
            raise SystemExit(f"{path}: no optimizer step in this trace to count steps by: give --steps N")
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events
             if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset", "cpu_op", "user_annotation") and "dur" in e]
    if not spans:
        raise SystemExit(f"{path}: no operators or kernels in this trace")
    wall_us = max(b for _, b in spans) - min(a for a, _ in spans)
    times, ranked, overlap = trace_breakdown(trace, wall_us)
    report(times, ranked, wall_us, steps, top, "GPU kernels; wall = the trace's span", overlap)
    report_host(trace, steps, top)

if __name__ == "__main__":
    main()
