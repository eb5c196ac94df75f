"""Every GPU figure issue 19 asks for, in one run that fits a short lease on a lent GPU.

Runs the steps below in order of priority, each in its own process with a time limit, under one overall
deadline (``--budget`` seconds): a step that would not fit the time left is skipped, not cut short, and
``--from NAME`` resumes at a step (e.g. in a second call on the same machine, whose compile cache is
warm). Each step's output goes to ``<out>/log.txt``; the JSON figures of every step that prints them
go to ``<out>/results.json``; a short table is printed last. Usage (on the GPU machine, repo root):

    python3 benchmarks/gpu_session.py --out $OUT --budget 515 [--from NAME] [--only NAME,NAME (in this order)]
    python3 benchmarks/gpu_session.py --list

The machine's image has PyTorch, transformers and the training dependencies, but not the server's
(fastapi, uvicorn) nor the openai client that ``serve_load`` needs: ``benchmarks/gpu_wheels.sh`` downloads
them here into ``.whl``; the device call then carries ``.whl`` and begins with ``python3 -m pip install -q
--no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site`` (then ``python3 -c
"import fastapi, uvicorn, openai"`` shows at once whether the set is whole).

The steps are in the order of what is still open (``benchmarks/RESULTS.md``, "What issue 19 still needs"):
the 124M baseline at micro-batch 64, AdamW's 8-bit moments under FSDP, the 1.3B profile with a trace, TRM at the
paper's size (rerun after a fix), the real sharded run, mHC at 1.3B (never finished: it needs a first call of its
own); then the figures already measured, to rerun after changes. Seconds each took on an H200 (sixth lease,
2026-11-27): env 7, trm_paper_speed 210, bench_124m 40, bench_124m_mb32_cdt 201, bench_124m_mb32_autotune 286.
Fifth lease: bench_124m_8bit 99, profile_fsdp_one_124m 31, fsdp_one_124m 37, fsdp_one_1b 57, offload_1b 69,
bench_1b 92, bench_1b_8bit 198, profile_mhc_125m_off 49, bench_124m_mb32 37. Fourth lease: profile_mhc_125m 99,
mhc_on_125m 30, mhc_off_125m 39, bench_124m_mb32_cdt 150, bench_124m_graphs 40, fsdp_train_check 70. Third
lease: micro 45, mhc_on_125m_triton 62, profile_124m 23, bench_124m_chunked 37, vs_transformers 60, profile_1b
37; mhc_on_1b had not printed its first step after 200 s (compiling), hence its 420 s. Second lease:
bench_124m_cdt 127, generation 130, serve_load 31, bench_124m_dropout 36. The machine's start took under a
minute. A 15-minute lease fits about 515 s of steps in a first call (``--budget 515``, timeout_s 570) and ~280 s
in a second (``--from NAME`` or ``--only NAME,NAME``, which runs the steps in the order given).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PY = sys.executable
GPT2_124M = ["go_coder_125m", "training.micro_batch_size=16", "training.grad_accum_steps=1", "training.compile=true"]
GPT2_VOCAB = ["--vocab-size", "50257"]  # after the overrides: argparse takes no option between two positionals
NO_DROPOUT = ["model.embd_pdrop=0", "model.resid_pdrop=0", "model.attn_pdrop=0"]
# The 1.3B preset (seed 002's size: 2048 wide, 24 layers, 16 heads x 128) as a plain Llama-style model.
LLAMA_1B = ["rlm_mhc_1b", "model.mhc_enabled=false", "model.gradient_checkpointing=false",
            "training.micro_batch_size=8", "training.grad_accum_steps=1", "training.compile=true"]
MHC_125M = ["rlm_mhc_125m", "training.compile=true", "model.mhc_stream_dtype=autocast"]
# seed 002's 1.3B with mHC on, as bench_1b runs it with mHC off (a 4x wider stream: ~15 GB more activations)
MHC_1B = [*LLAMA_1B[:1], *LLAMA_1B[2:], "model.mhc_stream_dtype=autocast", "model.mhc_enabled=true"]

TORCHRUN_ONE = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "lmforge"]

# name, command, the most seconds it may take, the fewest worth starting it with
STEPS: list[tuple[str, list[str], int, int]] = [
    ("env", ["bash", "-c", "nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version "
             "--format=csv; python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, "
             "torch.cuda.get_device_name())'; nproc"], 30, 5),
    # micro-batch 64 (llm.c's batch for GPT-2 124M) with coordinate-descent tuning: micro-batch 32 gave 44.2%
    # alone and 44.5% with the tuning on the sixth lease; max-autotune nothing more (44.3%)
    ("bench_124m_mb64_cdt", ["env", "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1", PY, "-m", "lmforge", "bench",
                             *GPT2_124M, *NO_DROPOUT, "training.micro_batch_size=64", *GPT2_VOCAB, "--steps", "20",
                             "--json"], 240, 120),
    # AdamW's 8-bit moments under FSDP (sharded with the rows since the fifth lease; its compiled step on local
    # rows): against fsdp_one_1b (56,657 tokens/s, 44,764 MiB on the fifth lease), and with offload, where the
    # 8-bit step runs on the CPU: against offload_1b (11,491 tokens/s, 30,173 MiB)
    ("fsdp_one_1b_8bit", [*TORCHRUN_ONE, "bench", *LLAMA_1B, "training.parallel=fsdp",
                          "training.optimizer_states=8bit", "--steps", "10", "--json"], 260, 120),
    # the 1.3B profile's groups added up to 294% of its wall time on the third lease: the trace, read here, says why
    ("profile_1b", [PY, "benchmarks/profile_step.py", *LLAMA_1B, "--steps", "3", "--warmup", "2",
                    "--trace", "{out}/profile_1b.trace.json.gz"], 200, 100),
    # Item 4 at the paper's scale, for what a lease can show: TRM-MLP (trm_sudoku: hidden 512, batch 768,
    # 1,000 puzzles x 1,000 augmentations) for 3 minutes of training, compiled: examples/s, peak memory and
    # the step count (the paper's 50,000 epochs' wall time follows from them). Rerun: on the sixth lease the
    # metrics' window recompiled the loss 8 times, then left it eager, reading the device every step. The
    # dataset (~160 MB) and the run are in /tmp on the machine, not in the results folder; the run is removed
    # first (a rerun is fresh).
    ("trm_paper_speed", ["bash", "-c", f"{PY} -m lmforge data sudoku --out /tmp/sudoku-1k-aug-1000 --generate 1000 "
                         "--num-aug 1000 --test-generate 1000 --no-progress --overwrite && "
                         f"rm -rf /tmp/trm/paper && {PY} -m lmforge train trm_sudoku "
                         "data.path=/tmp/sudoku-1k-aug-1000 out_dir=/tmp/trm "
                         "name=paper training.compile=true training.max_time_minutes=3 training.log_interval=20 && "
                         "tail -n 3 /tmp/trm/paper/metrics.jsonl"], 330, 240),
    # a real run, plain / FSDP over one process / offloaded, with evaluation (the sharded model block by block)
    # on a GPU: the held-out losses side by side and the memory each held (printed to the log; its working
    # files stay in /tmp, leaving $OUT's few returned files to the others)
    ("fsdp_train_check", [PY, "benchmarks/fsdp_train_check.py", "--out", "/tmp/fsdp_train", "--offload"], 240, 120),
    ("offload_1b_8bit", [*TORCHRUN_ONE, "bench", *LLAMA_1B, "training.parallel=fsdp", "training.fsdp_offload=true",
                         "training.optimizer_states=8bit", "--steps", "5", "--json"], 240, 120),
    ("bench_1b", [PY, "-m", "lmforge", "bench", *LLAMA_1B, "--steps", "10", "--json"], 200, 100),
    # mHC's cost where the model is wider: its bytes grow with the width, the matmuls' work with its square
    ("mhc_on_1b", [PY, "-m", "lmforge", "bench", *MHC_1B, "--steps", "10", "--json"], 420, 300),
    ("bench_124m", [PY, "-m", "lmforge", "bench", *GPT2_124M, *NO_DROPOUT, *GPT2_VOCAB, "--steps", "20", "--json"],
     180, 90),
    # both together (each alone: +3.8% and +2% on the second lease)
    ("bench_124m_mb32_cdt", ["env", "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1", PY, "-m", "lmforge", "bench",
                             *GPT2_124M, *NO_DROPOUT, "training.micro_batch_size=32", *GPT2_VOCAB, "--steps", "20",
                             "--json"], 240, 120),
    # Inductor's autotuning of the matmuls (Triton templates against cuBLAS) and its kernels' launch settings,
    # without CUDA graphs (which gave nothing): the last lever on 124M's MFU not yet measured (long compile)
    ("bench_124m_mb32_autotune", [PY, "-m", "lmforge", "bench", *GPT2_124M, *NO_DROPOUT, "training.micro_batch_size=32",
                                  "training.compile_mode=max-autotune-no-cudagraphs", *GPT2_VOCAB, "--steps", "20",
                                  "--json"], 300, 150),
    ("micro", [PY, "benchmarks/gpu_micro.py", "--json", "{out}/micro.json"], 240, 40),
    ("profile_mhc_125m", [PY, "benchmarks/profile_step.py", *MHC_125M, "model.mhc_enabled=true"], 150, 60),
    ("mhc_on_125m", [PY, "-m", "lmforge", "bench", *MHC_125M, "model.mhc_enabled=true", "--steps", "10", "--json"],
     200, 100),
    ("mhc_off_125m", [PY, "-m", "lmforge", "bench", *MHC_125M, "model.mhc_enabled=false", "--steps", "10",
                      "--json"], 150, 60),
    ("profile_mhc_125m_off", [PY, "benchmarks/profile_step.py", *MHC_125M, "model.mhc_enabled=false"], 120, 60),
    # AdamW's moments in 8 bits (training.optimizer_states=8bit; its step compiled with the model since the
    # fourth lease, which measured the eager one): its speed against bench_124m's, and at 1.3B the peak memory
    # against bench_1b's
    ("bench_124m_8bit", [PY, "-m", "lmforge", "bench", *GPT2_124M, *NO_DROPOUT, *GPT2_VOCAB,
                         "training.optimizer_states=8bit", "--steps", "20", "--json"], 150, 60),
    ("bench_1b_8bit", [PY, "-m", "lmforge", "bench", *LLAMA_1B, "training.optimizer_states=8bit", "--steps", "10",
                       "--json"], 200, 100),
    # where FSDP's step over one process goes (fsdp_one_124m ran at 42% of bench_124m's tokens/s on the fourth
    # lease; each block compiled alone, the loss eager, the hooks on the host): groups, kernels and a trace
    ("profile_fsdp_one_124m", [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                               "benchmarks/profile_step.py", *GPT2_124M, *NO_DROPOUT, "training.parallel=fsdp",
                               *GPT2_VOCAB, "--steps", "3", "--trace", "{out}/fsdp_one_124m.trace.json.gz"], 150, 60),
    # FSDP over one process (torchrun --nproc_per_node=1): its overhead against bench_124m, and the sharding
    # that moves the CPU-built model block by block (first GPU run of that path)
    ("fsdp_one_124m", [*TORCHRUN_ONE, "bench", *GPT2_124M, *NO_DROPOUT, "training.parallel=fsdp", *GPT2_VOCAB,
                       "--steps", "20", "--json"], 180, 90),
    # FSDP over one process at 1.3B, where a block's GPU work (~12 ms) can hide the hooks' host time that
    # fsdp_one_124m's 2.5-ms blocks cannot: against bench_1b
    ("fsdp_one_1b", [*TORCHRUN_ONE, "bench", *LLAMA_1B, "training.parallel=fsdp", "--steps", "10", "--json"],
     200, 100),
    # training.fsdp_offload on one GPU: the 1.3B preset's peak GPU memory against bench_1b's 50.0 GB, and its speed
    ("offload_1b", [*TORCHRUN_ONE, "bench", *LLAMA_1B, "training.parallel=fsdp", "training.fsdp_offload=true",
                    "--steps", "5", "--json"], 240, 120),
    ("bench_124m_mb32", [PY, "-m", "lmforge", "bench", *GPT2_124M, *NO_DROPOUT, "training.micro_batch_size=32",
                         *GPT2_VOCAB, "--steps", "20", "--json"], 120, 60),
    # CUDA graphs for the idle time between kernels (training.compile_mode=reduce-overhead; micro-batch 16)
    ("bench_124m_graphs", [PY, "-m", "lmforge", "bench", *GPT2_124M, *NO_DROPOUT,
                           "training.compile_mode=reduce-overhead", *GPT2_VOCAB, "--steps", "20", "--json"], 180, 90),
    # the same on a rotary (Llama-flavor) model, whose cos/sin table must not be a graph output
    ("mhc_off_125m_graphs", [PY, "-m", "lmforge", "bench", *MHC_125M, "model.mhc_enabled=false",
                             "training.compile_mode=reduce-overhead", "--steps", "10", "--json"], 150, 60),
    # Inductor's coordinate-descent tuning of its kernels' launch settings (longer compile)
    ("bench_124m_cdt", ["env", "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1", PY, "-m", "lmforge", "bench", *GPT2_124M,
                        *NO_DROPOUT, *GPT2_VOCAB, "--steps", "20", "--json"], 240, 120),
    ("generation", [PY, "benchmarks/generation_speed.py", "--device", "cuda", "--no-quality", "--sizes", "small",
                    "--flavors", "gpt2", "--precisions", "fp32,bf16", "--rounds", "2"], 150, 60),
    # the mixing as the Triton operators (mhc_on_125m runs auto: PyTorch ops fused by Inductor): the side-by-side
    ("mhc_on_125m_triton", [PY, "-m", "lmforge", "bench", *MHC_125M, "model.mhc_enabled=true",
                            "model.mhc_kernels=triton", "--steps", "10", "--json"], 200, 100),
    ("profile_124m", [PY, "benchmarks/profile_step.py", *GPT2_124M, *NO_DROPOUT, *GPT2_VOCAB], 120, 60),
    ("bench_124m_chunked", [PY, "-m", "lmforge", "bench", *GPT2_124M, *NO_DROPOUT, "model.lm_loss=chunked",
                            *GPT2_VOCAB, "--steps", "20", "--json"], 150, 60),
    ("vs_transformers", [PY, "-m", "lmforge", "bench", *GPT2_124M, *NO_DROPOUT, *GPT2_VOCAB, "--steps", "20",
                         "--compare-transformers", "--json"], 200, 120),
    ("serve_load", [PY, "benchmarks/serve_load.py", "--device", "cuda", "--precision", "bf16"], 120, 50),
    ("bench_124m_dropout", [PY, "-m", "lmforge", "bench", *GPT2_124M, *GPT2_VOCAB, "--steps", "20", "--json"], 120, 60),
]


def trailing_json(text: str):
    """The JSON document a command printed last (``--json`` prints it after its table), or None."""
    start = text.rfind("\n{")
    for i in ([start + 1] if start >= 0 else []) + ([0] if text.startswith("{") else []):
        try:
            return json.loads(text[i:])
        except ValueError:
            continue
    return None


def summary(name: str, result) -> str:
    if not isinstance(result, dict) or not result.get("runs"):
        return ""
    parts = []
    for r in result["runs"]:
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
        llmc = f"{100 * r['mfu_llmc']:.1f}%" if "mfu_llmc" in r else "-"
        parts.append(f"{r['system']}: {r['tokens_per_s']:,.0f} tok/s, step {r['step_ms']:.1f} ms, MFU {mfu} "
                     f"(llm.c {llmc}), peak {r['peak_memory_mb']:.0f} MiB")
    return "; ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("gpu_session_out"))
    ap.add_argument("--budget", type=float, default=520, help="seconds for all steps together")
    ap.add_argument("--from", dest="start", default=None, help="start at this step")
    ap.add_argument("--only", default=None, help="comma-separated steps to run, in this order")
    ap.add_argument("--list", action="store_true", help="list the steps and exit")
    args = ap.parse_args()
    if args.list:
        for name, cmd, most, _ in STEPS:
            print(f"{name:<20}{most:>5} s  {' '.join(cmd)}")
        return 0
    names = [s[0] for s in STEPS]
    wanted = names[names.index(args.start):] if args.start else names
    if args.only and args.start:
        raise SystemExit("--from and --only do not combine: --only runs exactly the steps it names, in its order")
    if args.only:
        unknown = set(args.only.split(",")) - set(names)
        if unknown:
            raise SystemExit(f"unknown steps {sorted(unknown)}; the steps are {names}")
        wanted = args.only.split(",")  # in the order given: a lease's priorities
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / "log.txt").open("a")
    results_path = args.out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(Path.cwd())) if p)
    deadline = time.monotonic() + args.budget
    table = []
    by_name = {s[0]: s for s in STEPS}
    for name, cmd, most, fewest in (by_name[n] for n in wanted):
        left = deadline - time.monotonic()
        if left < fewest:
            table.append(f"{name:<20} skipped ({left:.0f} s left, needs {fewest})")
            continue
        cmd = [c.replace("{out}", str(args.out)) for c in cmd]
        limit = min(most, left)
        print(f"== {name} (at most {limit:.0f} s): {' '.join(cmd)}", file=log, flush=True)
        print(f"== {name} (at most {limit:.0f} s)", flush=True)
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            stdout, stderr = proc.communicate(timeout=limit)
            out, rc = stdout + stderr, proc.returncode
        except subprocess.TimeoutExpired:
            # SIGTERM first: torchrun passes it on to its workers (each in a session of its own, which a
            # kill of torchrun alone would leave running on the GPU beside the next step)
            proc.terminate()
            try:
                stdout, stderr = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
            out, stdout, rc = stdout + stderr, "", "timeout"
        took = time.monotonic() - t0
        print(out, file=log, flush=True)
        parsed = trailing_json(stdout) if rc == 0 else None
        results[name] = {"rc": rc, "seconds": round(took), "cmd": cmd, "result": parsed,
                         "tail": out[-3000:] if parsed is None else None}
        results_path.write_text(json.dumps(results, indent=1))
        line = f"{name:<20} rc={rc} {took:5.0f} s  {summary(name, parsed)}"
        table.append(line)
        # scripts without JSON: their own last lines (their table), so the reply shows their figures too
        tail = [] if parsed else [x for x in out.strip().splitlines() if x.strip()][-24:]
        print("\n    ".join([line, *tail]), flush=True)
    print("\n".join(["", "summary:", *table]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
