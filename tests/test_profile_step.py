"""The profiler's GPU breakdown read from a Chrome trace (benchmarks/profile_step.py), on a trace written
here in the format ``torch.profiler`` exports: each kernel counted once, in the group of the ranges around
the launch that queued it; idle is the wall time no kernel covers, streams side by side counted once."""

import gzip
import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def profile_step():
    sys.path.insert(0, str(BENCH))  # profile_step imports its sibling `common` when it runs a model
    try:
        spec = importlib.util.spec_from_file_location("profile_step", BENCH / "profile_step.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))


def host(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": {}}


def launch(ts, correlation, tid=1):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": tid, "ts": ts, "dur": 1,
            "args": {"correlation": correlation}}


def kernel(name, ts, dur, correlation, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"correlation": correlation, "stream": stream}}


def a_trace():
    return {"traceEvents": [
        # forward: a matmul, then the loss (its kernel's name says nothing of the loss: the range does)
        host("aten::mm", 0, 10), launch(2, 1),
        host("_LinearCrossEntropy", 20, 30), host("triton_red_fused_0", 22, 5), launch(23, 2),
        # the backward on the autograd thread: attention's gradient
        host("aten::_scaled_dot_product_cudnn_attention_backward", 60, 10, tid=2), launch(61, 3, tid=2),
        # the optimizer: two kernels, the second on another stream while the first runs
        host("Optimizer.step#AdamW.step", 100, 40, cat="user_annotation"), host("aten::_fused_adamw_", 101, 30),
        launch(102, 4), launch(110, 5),
        host("aten::add", 150, 4), launch(151, 6),
        kernel("nvjet_sm90_gemm", 10, 100, 1),
        kernel("triton_red_fused_0", 110, 20, 2),
        kernel("cudnn_generated_sdpa_bprop", 130, 30, 3),
        kernel("multi_tensor_apply_kernel", 200, 50, 4),
        kernel("multi_tensor_apply_kernel", 220, 50, 5, stream=9),  # overlaps the one above by 30
        kernel("vectorized_elementwise_kernel", 300, 10, 6),
    ]}


def test_each_kernel_is_counted_once_in_the_group_of_its_launch(profile_step):
    times, ranked, overlap = profile_step.trace_breakdown(a_trace(), wall_us=400)
    assert times["GEMM"] == 100
    assert times["loss"] == 20  # by the range around its launch, not by its name
    assert times["attention"] == 30  # launched from the autograd thread
    assert times["optimizer"] == 100  # both streams' kernels
    assert times["elementwise"] == 10
    # busy = the union: 10-110, 110-130, 130-160, 200-270, 300-310 = 100 + 20 + 30 + 70 + 10 = 230
    assert times["idle"] == 400 - 230
    assert overlap == 30
    assert ranked[0][:2] == ("nvjet_sm90_gemm", "GEMM") and ranked[0][3] == 1
    assert ("multi_tensor_apply_kernel", "optimizer", 100, 2) in ranked


def test_read_reports_a_gzipped_trace_and_the_host_ranges(profile_step, tmp_path, capsys):
    path = tmp_path / "step.trace.json.gz"
    trace = a_trace()
    trace["traceEvents"] += [host("FSDP::pre_forward (model.blocks.0)", 0, 8, cat="user_annotation"),
                             host("FSDP::pre_forward (model.blocks.1)", 12, 6, cat="user_annotation")]
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    profile_step.read(str(path), steps=None, top=5)  # one step: the trace holds one optimizer step
    out = capsys.readouterr().out
    assert "| GEMM | 0.10 |" in out and "| loss | 0.02 |" in out
    assert "| `FSDP::pre_forward` | 0.01 | 2 |" in out  # both blocks' ranges as one row
    assert "side by side on several streams" in out
