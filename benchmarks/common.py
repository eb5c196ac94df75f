"""What the side-by-side benchmarks against TRL share: the CPU's name for the record, and the seeded
llama checkpoint (with its own tokenizer and HF export) both systems start from.

The scripts import it as ``common`` (``python benchmarks/NAME.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch


def cpu_name() -> str:
    """The CPU's model name and whether it has bf16 units (which decide lmforge's precision=auto)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    for line in text.splitlines():
        if line.startswith("model name"):
            bf16 = "avx512_bf16" in text or "amx_bf16" in text
            return f"{line.split(':', 1)[1].strip()} ({'bf16 units' if bf16 else 'no bf16 units'})"
    return platform.processor() or "unknown CPU"


def seeded_checkpoint(work: Path, texts: list[str], args) -> tuple[Path, Path]:
    """A tokenizer trained on ``texts`` (``args.vocab`` entries) and a freshly seeded llama-flavor model
    of ``args.layers`` x ``args.width`` with context ``args.seq_len``: lmforge's checkpoint directory
    and its HF export, the same weights on both sides."""
    from lmforge.export.hf import export_hf
    from lmforge.models.gpt import GPT, GPTConfig
    from lmforge.tokenizer import Tokenizer, train_tokenizer

    tokenizer = Tokenizer.load(train_tokenizer(texts, vocab_size=args.vocab, out_dir=work / "tok", show_progress=False))
    torch.manual_seed(0)
    model = GPT(GPTConfig(flavor="llama", vocab_size=tokenizer.vocab_size, n_layer=args.layers, n_embd=args.width,
                          n_head=args.width // 64, n_inner=4 * args.width, n_positions=args.seq_len,
                          eos_token_id=tokenizer.eos_id, bos_token_id=tokenizer.bos_id, pad_token_id=tokenizer.pad_id))
    ckpt = model.save_pretrained(work / "ckpt")
    tokenizer.save(ckpt)
    return ckpt, export_hf(ckpt, work / "hf")


def cpu_run(cfg, init: Path):
    """What ``lmforge.train.train`` builds before its Trainer, on the CPU in fp32 for one process: the
    model (``init``'s weights), the kind's data, the device and process info. The benchmarks make the
    Trainer themselves (to time its construction or drive it step by step with ``step_once``)."""
    from lmforge.device import setup_device
    from lmforge.models import build_model
    from lmforge.train import _load_initial_weights, seed_everything
    from lmforge.train.distributed import DistInfo

    dist = DistInfo()
    devinfo = setup_device("cpu", "fp32", 1e12, 0)
    data = cfg.spec.build_data(cfg, dist)
    seed_everything(cfg.seed)
    model = build_model(cfg.model)
    _load_initial_weights(model, str(init), dist)
    return model, data, devinfo, dist


def add_model_args(p, seq_len: int, seq_help: str = "the model's context") -> None:
    """The seeded model's size options every side-by-side script takes (``seeded_checkpoint``)."""
    p.add_argument("--seq-len", type=int, default=seq_len, help=seq_help)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)


def trl_preference_rows(data: Path, hf: Path):
    """TRL's DPO inputs for a preference set written by ``lmforge data preferences``: its training pairs
    as conversational rows (message lists, the row's tools as a JSON string: ``datasets`` would
    null-fill ragged dicts; TRL renders them with the exported chat template, lmforge's), and the HF
    export's tokenizer and fp32 SDPA model."""
    import json

    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    ds = datasets.Dataset.from_list([{"prompt": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"],
                                      "tools": json.dumps(r["tools"])} for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="sdpa")
    return ds, tokenizer, model


def trl_step_window(marks: dict[str, float], warmup: int, steps: int):
    """A TRL ``TrainerCallback`` that times the window the lmforge side times: ``marks["t0"]`` at the
    end of the last warm-up step, ``marks["t1"]`` at the end of the last timed one."""
    import time

    from transformers import TrainerCallback

    class StepWindow(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            if state.global_step == warmup:
                marks["t0"] = time.perf_counter()
            if state.global_step == warmup + steps:
                marks["t1"] = time.perf_counter()

    return StepWindow()


def checkout_child_result(out, checkout: Path) -> dict:
    """The JSON last line of a child process (``subprocess.CompletedProcess``) run against another
    checkout's lmforge; stops the benchmark when it failed or imported some other lmforge (the child
    prints ``lmforge.__file__`` as ``"lmforge"``)."""
    import json

    if out.returncode != 0:
        raise SystemExit(f"run failed in {checkout}:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if Path(result["lmforge"]).resolve().parents[1] != Path(checkout).resolve():
        raise SystemExit(f"the child imported {result['lmforge']}, not {checkout}'s lmforge")
    return result
