"""`lmforge bench`: training throughput of a recipe's model through the lmforge loop, on random tokens,
and optionally the same GPT-2 config as ``transformers.GPT2LMHeadModel`` with a plain AdamW loop."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from lmforge.config import GRAPH_MODES, load_config
from lmforge.device import (DeviceInfo, _sync, keep_freed_memory_for_reuse, model_flops_utilization,
                            peak_memory_mb, setup_device)
from lmforge.errors import LMForgeError
from lmforge.models import build_model
from lmforge.models.losses import lm_loss_path
from lmforge.recipes import TrainData
from lmforge.train import fsdp, seed_everything
from lmforge.train.optim import make_adamw
from lmforge.train.distributed import DistInfo, init_distributed, shutdown
from lmforge.train.fsdp import check_kind
from lmforge.train.loop import Trainer


def _time_steps(step_fn, steps: int, warmup: int, device: torch.device) -> float:
    for _ in range(warmup):
        step_fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step_fn()
    _sync(device)
    return time.perf_counter() - t0


def _lmforge_stepper(cfg, devinfo: DeviceInfo, tmp: Path):
    seed_everything(cfg.seed)
    model = build_model(cfg.model)
    if not fsdp.active(cfg.training.parallel):
        model.to(devinfo.device)  # under FSDP sharding moves it, as in training
    if cfg.training.activation_checkpointing:
        model.set_activation_checkpointing(True)
    seq = cfg.spec.seq_len(cfg)  # the kind's rows: data.seq_len for lm, not for every kind
    data = TrainData(train=cfg.spec.bench_data(cfg), val=None)
    trainer = Trainer(cfg, model, data, devinfo, DistInfo(), tmp)
    model.step_metrics = False  # as training's steps between log lines run
    info = {"system": "lmforge", "params": model.num_parameters(), "flops_per_token": model.flops_per_token(seq),
            "sharded": trainer.sharded is not None}
    c = model.config
    if hasattr(c, "n_layer") and hasattr(c, "n_embd"):
        info["flops_per_token_llmc"] = llmc_flops_per_token(info["params"], c.n_layer, c.n_embd, seq)
    return trainer.step_once, info


def llmc_flops_per_token(params: int, layers: int, width: int, seq_len: int) -> float:
    """llm.c's training FLOPs per token, ``6 N + 6 L C T``: every parameter (embeddings included, a tied
    head once) and causal attention counted at half of ``12 L C T``. Beside lmforge's own count, so that
    MFU figures compare with llm.c's and nanochat's."""
    return 6.0 * params + 6.0 * layers * width * seq_len


def _sharding(cfg) -> str:
    t = cfg.training
    return "" if t.parallel == "ddp" else f"; {t.parallel} over one process{' + CPU offload' if t.fsdp_offload else ''}"


def check_comparable_with_transformers(cfg) -> None:
    """Raise a clear error, before any process starts, when the comparison cannot run."""
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise LMForgeError("--compare-transformers needs transformers: pip install transformers") from e
    if getattr(cfg.model, "flavor", None) != "gpt2":
        raise LMForgeError("--compare-transformers compares the gpt2 flavor only (model.flavor=gpt2)")


def _transformers_stepper(cfg, devinfo: DeviceInfo):
    """The reference: GPT2LMHeadModel with the same sizes, plain AdamW, same batches, clip and precision."""
    check_comparable_with_transformers(cfg)
    from transformers import GPT2Config, GPT2LMHeadModel

    m = cfg.model
    seed_everything(cfg.seed)
    hf_cfg = GPT2Config(vocab_size=m.vocab_size, n_positions=m.n_positions, n_embd=m.n_embd, n_layer=m.n_layer,
                        n_head=m.n_head, n_inner=m.n_inner or None, activation_function=m.activation_function,
                        resid_pdrop=m.resid_pdrop, embd_pdrop=m.embd_pdrop, attn_pdrop=m.attn_pdrop,
                        layer_norm_epsilon=m.layer_norm_epsilon, bos_token_id=m.bos_token_id,
                        eos_token_id=m.eos_token_id, pad_token_id=m.pad_token_id)
    model = GPT2LMHeadModel(hf_cfg).to(devinfo.device)
    model.train()
    if cfg.training.compile:  # both compiled (in the same mode), or neither
        model = torch.compile(model, mode=cfg.training.compile_mode)
    t = cfg.training
    # The same AdamW implementation lmforge uses on this device (8-bit moments too, with
    # training.optimizer_states=8bit), so only the model and loop differ.
    opt = make_adamw([{"params": list(model.parameters()), "weight_decay": t.weight_decay}], cfg, devinfo.device)
    data = cfg.spec.bench_data(cfg)  # the same seeded batches lmforge times
    scaler = torch.amp.GradScaler(devinfo.device.type, enabled=devinfo.precision == "fp16")

    graphs = t.compile and devinfo.device.type == "cuda" and t.compile_mode in GRAPH_MODES

    def step() -> None:
        for _ in range(t.grad_accum_steps):
            x = data.next_batch()["input_ids"].to(devinfo.device)
            if graphs:  # as lmforge's loop does: a new micro-batch starts
                torch.compiler.cudagraph_mark_step_begin()
            with devinfo.autocast():
                loss = model(input_ids=x, labels=x).loss
            scaler.scale(loss / t.grad_accum_steps).backward()
        if t.grad_clip > 0:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return step, {"system": "transformers", "params": sum(p.numel() for p in model.parameters())}


def bench_lmforge(cfg, steps: int, warmup: int, devinfo: DeviceInfo) -> dict[str, Any]:
    """Time ``steps`` lmforge training steps (after ``warmup``) of ``cfg``'s model on random tokens."""
    with tempfile.TemporaryDirectory() as tmp:
        step, info = _lmforge_stepper(cfg, devinfo, Path(tmp))
        seconds = _time_steps(step, steps, warmup, devinfo.device)
    return _summary(info, cfg, steps, seconds, devinfo)


def _summary(info: dict[str, Any], cfg, steps: int, seconds: float, devinfo: DeviceInfo) -> dict[str, Any]:
    tokens = steps * cfg.training.micro_batch_size * cfg.spec.seq_len(cfg) * cfg.training.grad_accum_steps
    out = {"system": info["system"], "params": info["params"], "tokens_per_step": tokens // steps,
           "tokens_per_s": tokens / seconds,
           **{k: info[k] for k in ("flops_per_token", "flops_per_token_llmc", "sharded") if k in info},
           "step_ms": 1000 * seconds / steps, "peak_memory_mb": peak_memory_mb(devinfo.device, reset=True)}
    mfu = model_flops_utilization(out["tokens_per_s"], info.get("flops_per_token", 0.0), devinfo.peak_flops)
    if mfu is not None and "flops_per_token" in info:  # left out where it would be nonsense (above 100%)
        out["mfu"] = mfu
    mfu_llmc = model_flops_utilization(out["tokens_per_s"], info.get("flops_per_token_llmc", 0.0), devinfo.peak_flops)
    if mfu_llmc is not None and "flops_per_token_llmc" in info:
        out["mfu_llmc"] = mfu_llmc
    return out


def _system_worker(system: str, cfg, devinfo: DeviceInfo, tuned_allocator: bool, warmup: int, conn) -> None:
    """One system in its own process: build it, warm it up, then time steps whenever asked.

    Separate processes keep what is process-wide apart: the C allocator's settings above all. lmforge
    sets glibc's allocator to keep freed memory for reuse (``keep_freed_memory_for_reuse``); a plain
    transformers loop runs with the default allocator unless ``tuned_allocator`` gives it lmforge's.
    """
    try:
        if devinfo.device.type == "cpu" and (system == "lmforge" or tuned_allocator):
            keep_freed_memory_for_reuse()
        with tempfile.TemporaryDirectory() as tmp:
            step, info = (_lmforge_stepper(cfg, devinfo, Path(tmp)) if system == "lmforge"
                          else _transformers_stepper(cfg, devinfo))
            _time_steps(step, 0, warmup, devinfo.device)
            conn.send(("ready", info))
            while (n := conn.recv()) is not None:
                conn.send(("timed", _time_steps(step, n, 0, devinfo.device)))
            conn.send(("done", peak_memory_mb(devinfo.device, reset=True)))
    except Exception as e:  # reported by the parent as a clear error
        conn.send(("error", str(e) if isinstance(e, LMForgeError) else f"{type(e).__name__}: {e}"))


def compare_with_transformers(cfg, steps: int, warmup: int, devinfo: DeviceInfo, rounds: int = 4,
                              tuned_allocator: bool = False) -> list[dict]:
    """lmforge and transformers, each in its own process, timed in alternating rounds so that drift in
    the machine's speed (shared or throttled CPUs) falls on both alike; one process runs at a time."""
    import multiprocessing as mp

    check_comparable_with_transformers(cfg)
    ctx = mp.get_context("spawn")  # fresh interpreters: no allocator or thread state inherited
    workers = []
    for system in ("lmforge", "transformers"):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_system_worker, args=(system, cfg, devinfo, tuned_allocator, warmup, child),
                           daemon=True)
        proc.start()
        workers.append((system, proc, parent))
    try:
        infos = [_receive(w, "ready") for w in workers]  # started one after another, warmed up alike
        seconds = [0.0, 0.0]
        per_round = [steps // rounds + (1 if r < steps % rounds else 0) for r in range(rounds)]
        for n in per_round:
            for i, (_, _, conn) in enumerate(workers):
                conn.send(n)
                seconds[i] += _receive(workers[i], "timed")
        for _, _, conn in workers:
            conn.send(None)
        peaks = [_receive(w, "done") for w in workers]
    finally:
        for _, proc, _ in workers:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    runs = [_summary(info, cfg, steps, secs, devinfo) for info, secs in zip(infos, seconds)]
    for run, peak in zip(runs, peaks):
        run["peak_memory_mb"] = peak
    return runs


def _receive(worker, expected: str):
    system, proc, conn = worker
    while not conn.poll(5.0):
        if not proc.is_alive():
            raise LMForgeError(f"the {system} benchmark process died (exit code {proc.exitcode})")
    kind, value = conn.recv()
    if kind == "error":
        raise LMForgeError(f"the {system} benchmark failed: {value}")
    if kind != expected:
        raise LMForgeError(f"the {system} benchmark process answered {kind!r}, expected {expected!r}")
    return value


def run_bench(recipe: str, overrides: list[str], steps: int = 20, warmup: int = 3, vocab_size: int = 8192,
              compare_transformers: bool = False, same_allocator: bool = False, show: bool = True) -> dict[str, Any]:
    if steps < 1 or warmup < 0:
        raise LMForgeError("--steps must be >= 1 and --warmup >= 0")
    cfg = load_config(recipe, overrides)
    if cfg.spec.bench_data is None:
        raise LMForgeError(f"lmforge bench times kinds that can make random batches; {recipe!r} is of kind "
                           f"{cfg.spec.name!r}, which cannot. Its throughput is logged during training "
                           "(train/tokens_per_s, train/examples_per_s, train/mfu); benchmarks/ holds its own scripts "
                           "(sudoku_cpu.py, hrgc_vs_plain.py, sft_vs_trl.py)")
    if getattr(cfg.model, "vocab_size", 1) == 0:
        ids = [getattr(cfg.model, key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")
               if isinstance(getattr(cfg.model, key, None), int)]
        need = max(ids, default=0) + 1  # the model's special tokens must be in its vocabulary
        if vocab_size < need:
            raise LMForgeError(f"--vocab-size must be >= {need} (the model's bos/eos/pad token ids go up to "
                               f"{need - 1}), got {vocab_size}: pass e.g. --vocab-size 8192")
        cfg.model.vocab_size = vocab_size
    distinfo = _join_for_fsdp(cfg, compare_transformers)
    try:
        return _run_bench(cfg, steps, warmup, compare_transformers, same_allocator, show)
    finally:
        shutdown(distinfo)


def _join_for_fsdp(cfg, compare_transformers: bool) -> DistInfo:
    """With training.parallel fsdp / hsdp, bench times FSDP over one process (its overhead, and
    training.fsdp_offload's on one GPU): launched by ``torchrun --nproc_per_node=1``, it joins that group."""
    parallel = cfg.training.parallel
    if parallel == "ddp":
        return DistInfo()
    how = ("`torchrun --standalone --nproc_per_node=1 -m lmforge bench ...`: bench times one process, FSDP over "
           "a group of one (its overhead, and training.fsdp_offload's); multi-process throughput is logged by "
           "training (train/tokens_per_s, train/peak_memory_mb)")
    if compare_transformers:
        raise LMForgeError(f"--compare-transformers times unsharded models: drop training.parallel={parallel}")
    if "WORLD_SIZE" not in os.environ:
        raise LMForgeError(f"lmforge bench with training.parallel={parallel}: launch it as {how}")
    check_kind(parallel, cfg.spec)
    distinfo = init_distributed(cfg.training.device, alone=True, cpu_collectives=cfg.training.fsdp_offload)
    if distinfo.world_size > 1:
        shutdown(distinfo)
        raise LMForgeError(f"lmforge bench was started on {distinfo.world_size} processes; launch it as {how}")
    return distinfo


def _run_bench(cfg, steps: int, warmup: int, compare_transformers: bool, same_allocator: bool,
               show: bool) -> dict[str, Any]:
    devinfo = setup_device(cfg.training.device, cfg.training.precision, cfg.training.peak_flops)
    lm_loss = getattr(cfg.model, "lm_loss", None)
    if lm_loss is not None:  # the path ``auto`` resolves to here, so a figure says which loss it timed
        lm_loss = lm_loss_path(lm_loss, devinfo.device.type, devinfo.autocast_dtype or torch.float32)
    header = (f"bench {cfg.name}: {devinfo.device} {devinfo.precision}, micro-batch {cfg.training.micro_batch_size}"
              f" x accum {cfg.training.grad_accum_steps} x seq {cfg.spec.seq_len(cfg)}, {steps} timed steps after "
              f"{warmup} warm-up; compile={cfg.training.compile}"
              f"{f' ({cfg.training.compile_mode})' if cfg.training.compile else ''}; lm_loss={lm_loss or '-'}"
              f"{_sharding(cfg)}; MFU vs "
              f"{devinfo.peak_flops / 1e12:.2f} TFLOP/s ({devinfo.peak_source})")
    if show:
        print(header, flush=True)
    results = {"config": cfg.to_dict(), "seq_len": cfg.spec.seq_len(cfg), "device": str(devinfo.device),
               "precision": devinfo.precision,
               "torch": torch.__version__, "threads": torch.get_num_threads(), "lm_loss": lm_loss, "runs": []}
    if compare_transformers:
        runs = compare_with_transformers(cfg, steps, warmup, devinfo, tuned_allocator=same_allocator)
    else:
        runs = [bench_lmforge(cfg, steps, warmup, devinfo)]
    results["runs"] = runs
    if compare_transformers:
        results["speedup"] = runs[0]["tokens_per_s"] / runs[1]["tokens_per_s"]
        if devinfo.device.type == "cpu":
            results["transformers_allocator"] = "lmforge" if same_allocator else "default"
    if show:
        print(f"{'system':<14}{'params':>12}{'tokens/s':>12}{'step ms':>10}{'MFU':>8}{'MFU llm.c':>11}{'peak MiB':>10}")
        for r in runs:
            mfu, llmc = (f"{100 * r[k]:.1f}%" if k in r else "-" for k in ("mfu", "mfu_llmc"))
            mem = f"{r['peak_memory_mb']:.0f}" if r["peak_memory_mb"] is not None else "-"
            print(f"{r['system']:<14}{r['params'] / 1e6:>11.2f}M{r['tokens_per_s']:>12,.0f}{r['step_ms']:>10.1f}"
                  f"{mfu:>8}{llmc:>11}{mem:>10}")
        if compare_transformers:
            print(f"lmforge / transformers tokens/s: {results['speedup']:.2f}x")
            if devinfo.device.type == "cpu":
                print("(each in its own process; transformers with "
                      + ("lmforge's allocator setting, --same-allocator" if same_allocator else
                         "the C allocator's defaults, as a plain loop runs; --same-allocator gives it lmforge's")
                      + "; peak MiB = process peak RSS)")

    return results
