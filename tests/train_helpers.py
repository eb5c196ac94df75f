"""Shared helpers for the training tests: a small real corpus, tokenizer and prepared data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]

# The MFU denominator for test runs: a given peak spares each run its ~1 s matmul measurement (what
# MFU is, and the measured peak, are the bench test's subject).
PEAK_FLOPS = 1e12

_NOUNS = ["file", "buffer", "request", "config", "token", "record", "entry", "client", "server", "cache"]
_VERBS = ["read", "write", "parse", "open", "close", "flush", "load", "store", "check", "build"]


def write_go_corpus(root: Path, n_files: int = 40) -> Path:
    """Go-like source files with real structure (package, imports, funcs), varied per file."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        pkg = f"pkg{i % 6}"
        (root / pkg).mkdir(exist_ok=True)
        funcs = []
        for j in range(6):
            verb, noun = _VERBS[(i + j) % len(_VERBS)], _NOUNS[(i * 3 + j) % len(_NOUNS)]
            name = f"{verb}{noun.capitalize()}{j}"
            funcs.append(
                f"// {name} will {verb} the {noun} number {i * 10 + j}.\n"
                f"func {name}(path string, n int) (int, error) {{\n"
                f"\tif n < {j} {{\n\t\treturn 0, fmt.Errorf(\"{noun}: bad size %d\", n)\n\t}}\n"
                f"\tf, err := os.Open(path)\n\tif err != nil {{\n\t\treturn 0, err\n\t}}\n"
                f"\tdefer f.Close()\n\ttotal := 0\n\tfor k := 0; k < n; k++ {{\n\t\ttotal += k * {j + 1}\n\t}}\n"
                f"\treturn total, nil\n}}\n"
            )
        text = f"package {pkg}\n\nimport (\n\t\"fmt\"\n\t\"os\"\n)\n\n" + "\n".join(funcs)
        (root / pkg / f"file{i}.go").write_text(text)
    return root


def make_prepared_data(base: Path, vocab_size: int = 384) -> Path:
    from lmforge.data import prepare_data
    from lmforge.data.sources import iter_documents
    from lmforge.tokenizer import Tokenizer, train_tokenizer

    corpus = write_go_corpus(base / "corpus")
    tok_dir = base / "tokenizer"
    train_tokenizer((d.text for d in iter_documents([corpus], include=["**/*.go"])), vocab_size=vocab_size,
                    out_dir=tok_dir, show_progress=False)
    data_dir = base / "data"
    prepare_data([str(corpus)], data_dir, Tokenizer.load(tok_dir), include=["**/*.go"], val_fraction=0.2,
                 show_progress=False)
    return data_dir


class FakeClock:
    """A clock for the training loop that only moves when the test charges time to a method, so what the
    loop derives from time (tokens/s, schedules, budgets) can be asserted exactly on any machine."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def charge(self, monkeypatch, cls, name: str, seconds) -> None:
        """Each call of ``cls.name`` advances the clock by ``seconds`` (a number, or a function of the
        call's 0-based index)."""
        original, calls = getattr(cls, name), [0]

        def timed(*args, **kwargs):
            self.now += seconds(calls[0]) if callable(seconds) else seconds
            calls[0] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(cls, name, timed)


def write_recipe(path: Path, data_dir: Path, out_dir: Path, **sections) -> Path:
    recipe = {
        "name": "t",
        "out_dir": str(out_dir),
        "seed": 7,
        "model": {"family": "gpt", "flavor": "gpt2", "vocab_size": 0, "n_positions": 32, "n_embd": 32,
                  "n_layer": 2, "n_head": 2, "embd_pdrop": 0.1, "resid_pdrop": 0.1, "attn_pdrop": 0.1},
        "data": {"path": str(data_dir), "seq_len": 32},
        "training": {"max_steps": 20, "micro_batch_size": 4, "lr": 3e-3, "warmup_steps": 2, "eval_interval": 10,
                     "eval_batches": 2, "save_interval": 10, "keep_last": 2, "log_interval": 1, "device": "cpu",
                     "precision": "fp32", "peak_flops": PEAK_FLOPS},
        "logging": {"tensorboard": False, "progress_bar": False},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            recipe[section] = {**recipe.get(section, {}), **values}
        else:
            recipe[section] = values
    path.write_text(yaml.safe_dump(recipe))
    return path


def lmforge_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "lmforge", *args]


def subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)})
    env.update(extra)
    return env


def run(cmd: list[str], timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=kw.pop("env", subprocess_env()),
                          **kw)


def check_under_triton_interpreter(tmp_path: Path, code: str) -> None:
    """Run ``code`` (a script that asserts and prints "kernels match" last) in a fresh process with
    ``TRITON_INTERPRET=1``, where Triton kernels run on CPU tensors; fail with its stderr otherwise."""
    script = tmp_path / "check_kernels.py"
    script.write_text(code)
    out = run([sys.executable, str(script)], cwd=REPO, env=subprocess_env(TRITON_INTERPRET="1"))
    assert out.returncode == 0 and "kernels match" in out.stdout, out.stderr[-3000:]


# What a rank of a 2-process gloo run sometimes dies of on an oversubscribed 2-core machine before any
# step (SIGABRT from the C++ runtime, no Python traceback; seen in test_mhc and test_hrgc, ~1 run in 20
# under pytest-xdist, never alone). Not lmforge's error to test: such a run is started once more.
GLOO_ABORT = "terminate called without an active exception"


def torchrun(args: list[str], run_dir: Path, timeout: float = 600, nproc: int = 2, **kw) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=NPROC -m lmforge ARGS`` from the repository root; retried once,
    from a removed ``run_dir``, when a rank died of ``GLOO_ABORT`` (any other failure is returned)."""
    import shutil

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "lmforge", *args]
    done = run(cmd, timeout=timeout, cwd=REPO, **kw)
    if done.returncode != 0 and GLOO_ABORT in done.stderr:
        shutil.rmtree(run_dir, ignore_errors=True)
        done = run(cmd, timeout=timeout, cwd=REPO, **kw)
    return done


def sharded_against_replicated(recipe: Path, runs: Path, *overrides: str, timeout: float = 600,
                               sharded_steps: bool = True, model_dirs: tuple[str, ...] = ("",),
                               frozen: bool = False) -> dict[str, Any]:
    """Train ``recipe`` (its ``out_dir`` is ``runs``) on two processes twice: ``training.parallel=ddp``
    (run ``ddp``) and ``fsdp`` (run ``fsdp``), with ``overrides``; assert that the sharded run logs the same
    training and held-out metrics at the same steps, holds about half the weights + optimizer state per
    process, writes step checkpoints (sharded, or the ordinary files where ``sharded_steps`` is false) of
    the same weights and an ordinary ``best/`` (each of ``model_dirs`` in a checkpoint: "" is the
    checkpoint itself). ``frozen``: the kind keeps frozen models (a reference, a reward model), and the
    sharded run holds about half of their weights per process too. Returns the two runs' metric rows, by
    name, for the kind's own checks."""
    import json

    import pytest
    import torch
    from safetensors.torch import load_file

    from lmforge.checkpoint import is_sharded, read_sharded_weights

    rows = {}
    for parallel in ("ddp", "fsdp"):
        done = torchrun(["train", str(recipe), f"name={parallel}", f"training.parallel={parallel}", *overrides],
                        runs / parallel, timeout=timeout)
        assert done.returncode == 0, f"{parallel}: " + done.stderr[-4000:]
        rows[parallel] = [json.loads(line) for line in (runs / parallel / "metrics.jsonl").read_text().splitlines()]
    ddp, fsdp = ({(r["step"], k): v for r in rows[n] for k, v in r.items()
                  if k.startswith(("train/loss", "eval/")) and isinstance(v, float)} for n in ("ddp", "fsdp"))
    assert ddp and ddp.keys() == fsdp.keys(), (sorted(ddp), sorted(fsdp))
    for key in ddp:
        assert fsdp[key] == pytest.approx(ddp[key], rel=1e-4, abs=1e-6), (key, ddp[key], fsdp[key])
    state = [next(r["train/state_mb"] for r in rows[n] if "train/state_mb" in r) for n in ("ddp", "fsdp")]
    assert 0.4 < state[1] / state[0] < 0.6, state  # half, plus the padding of rows that do not split evenly
    kept = [[r["train/frozen_mb"] for r in rows[n] if "train/frozen_mb" in r] for n in ("ddp", "fsdp")]
    assert bool(kept[0]) == bool(kept[1]) == frozen, kept
    if frozen:
        assert 0.4 < kept[1][0] / kept[0][0] < 0.6, kept
    steps = sorted((runs / "fsdp" / "checkpoints").glob("step-*"))
    assert steps and all(is_sharded(s) == sharded_steps != (s / "model.safetensors").exists() for s in steps), steps
    best = runs / "fsdp" / "checkpoints" / "best"
    assert not is_sharded(best)
    for name in (steps[-1].name, "best"):
        for part in model_dirs:
            mine = runs / "fsdp" / "checkpoints" / name / part
            mine = read_sharded_weights(mine) if is_sharded(mine) else load_file(str(mine / "model.safetensors"))
            want = load_file(str(runs / "ddp" / "checkpoints" / name / part / "model.safetensors"))
            assert mine.keys() == want.keys()
            for k in want:
                torch.testing.assert_close(mine[k], want[k], rtol=1e-4, atol=1e-5, msg=f"{name}/{part}: {k}")
    return rows


def weight_mb(directory: Path, blocks: bool | None = None) -> float:
    """MB (2**20 bytes) of the fp32 weights in ``directory/model.safetensors``: all of them, or only the
    repeated blocks' (``blocks=True``) or only the rest (embeddings, norms, heads: ``blocks=False``)."""
    import json
    import struct

    raw = (Path(directory) / "model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    total = 0
    for name, entry in header.items():
        if name == "__metadata__" or (blocks is not None and ("blocks." in name) != blocks):
            continue
        assert entry["dtype"] == "F32", (name, entry["dtype"])
        count = 1
        for n in entry["shape"]:
            count *= n
        total += 4 * count
    return total / 2**20


def rows(run_dir: Path) -> list[dict]:
    """A run's metrics.jsonl, row by row."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    """A run's logged training loss by step."""
    return {r["step"]: r["train/loss"] for r in rows(run_dir) if "train/loss" in r}
