"""`lmforge quickstart`: the whole job, end to end, on real code found on this machine.

corpus -> tokenizer -> token shards -> train go_coder_tiny -> evaluate (vs a unigram baseline) ->
plot -> sample. Everything lands in one working directory; a second run reuses its tokenizer and data.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from lmforge.errors import LMForgeError

PROMPTS = {
    "go": "// readLines reads a whole file and returns its lines.\nfunc readLines(path string) ([]string, error) {\n",
    "python": "def read_lines(path):\n    \"\"\"Return the lines of a text file.\"\"\"\n",
    "text": "The ",
}


@dataclass
class Corpus:
    path: Path
    include: tuple[str, ...]
    language: str
    origin: str


def find_corpus(data: str | None = None, include: tuple[str, ...] = ()) -> Corpus:
    """The Go standard library of a local Go toolchain, else the running Python's standard library."""
    if data:
        path = Path(data)
        if not path.exists():
            raise LMForgeError(f"--data {path} does not exist")
        lang = "go" if (not include or any(g.endswith(".go") for g in include)) else "text"
        if include and any(g.endswith(".py") for g in include):
            lang = "python"
        return Corpus(path, include or ("**/*.go",), lang, "--data")
    go = shutil.which("go")
    if go:
        try:
            root = subprocess.run([go, "env", "GOROOT"], capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            root = ""
        if root and (Path(root) / "src").is_dir():
            return Corpus(Path(root) / "src", ("**/*.go",), "go", "the Go standard library (`go env GOROOT`)")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return Corpus(stdlib, python_stdlib_globs(stdlib), "python", "the Python standard library (no Go toolchain found)")


# Installed third-party packages live inside the stdlib directory of a non-venv Python (often GBs):
# they are not the standard library and would swamp the corpus.
_NOT_STDLIB = {"site-packages", "dist-packages", "__pycache__"}


def python_stdlib_globs(stdlib: Path) -> tuple[str, ...]:
    """Globs for the standard library's own modules: top-level files and each package, but no
    ``**`` over the whole directory, which would descend into site-packages."""
    packages = sorted(d.name for d in stdlib.iterdir() if d.is_dir() and d.name not in _NOT_STDLIB)
    return ("*.py", *(f"{name}/**/*.py" for name in packages))


def _stage(i: int, text: str) -> None:
    print(f"\n[{i}/6] {text}", flush=True)


def quickstart(data: str | None = None, include: tuple[str, ...] = (), out: str = "lmforge_quickstart",
               minutes: float = 6.0, max_bytes: int = 24_000_000, vocab_size: int = 4096,
               overrides: list[str] | None = None) -> dict:
    from lmforge.config import load_config
    from lmforge.data import prepare_data, train_tokenizer_from_sources
    from lmforge.data.loader import TokenDataset
    from lmforge.eval.lm import metrics_from_nll, nll_of_tokens, scored_bytes_per_token, unigram_bpb
    from lmforge.infer.generate import generate_text
    from lmforge.infer.loading import load_for_inference
    from lmforge.plot import plot_run
    from lmforge.tokenizer import Tokenizer
    from lmforge.train import train

    if not (math.isfinite(minutes) and minutes > 0):
        raise LMForgeError(f"--minutes must be a finite number > 0, got {minutes}: pass a time budget such as 6")
    t_start = time.perf_counter()
    work = Path(out)
    work.mkdir(parents=True, exist_ok=True)

    corpus = find_corpus(data, include)
    _stage(1, f"corpus: {corpus.path} — {corpus.origin}, files {', '.join(corpus.include)}")

    # Reuse the tokenizer and data of an earlier quickstart in the same --out, but only if they were
    # made from the same corpus with the same settings (recorded in quickstart.json).
    stamp_path = work / "quickstart.json"
    stamp = {"corpus": str(corpus.path.resolve()), "include": list(corpus.include), "vocab_size": vocab_size,
             "max_bytes": max_bytes}
    tok_dir, data_dir = work / "tokenizer", work / "data"
    previous = json.loads(stamp_path.read_text()) if stamp_path.is_file() else None
    reuse = previous == stamp and (tok_dir / "tokenizer.json").is_file() and (data_dir / "meta.json").is_file()
    if previous is None and (tok_dir.exists() or data_dir.exists()):
        raise LMForgeError(f"{work} already holds tokenizer/ or data/ that lmforge quickstart did not make; "
                           "pass another --out directory")
    if reuse:
        print(f"reusing the tokenizer and data in {work} (same corpus and settings)")
    else:
        _stage(2, f"training a byte-level BPE tokenizer (vocab {vocab_size}) on up to {max_bytes / 1e6:.0f} MB")
        report = train_tokenizer_from_sources([corpus.path], tok_dir, vocab_size=vocab_size,
                                              include=corpus.include, max_bytes=max_bytes, overwrite=True)
        bpt = report["heldout_bytes_per_token"]
        print(f"tokenizer: trained on {report['train_bytes'] / 1e6:.1f} MB ({report['train_documents']} files)"
              + (f"; {bpt:.2f} bytes/token on {report['heldout_documents']} held-out files" if bpt else ""))
        _stage(3, "preparing token shards (filters, dedup, split by file, packing)")
        prepare_data([str(corpus.path)], data_dir, Tokenizer.load(tok_dir), include=list(corpus.include),
                     overwrite=True)
        stamp_path.write_text(json.dumps(stamp, indent=2))
    tokenizer = Tokenizer.load(tok_dir)
    train_ds, val_ds = TokenDataset(data_dir, "train"), TokenDataset(data_dir, "val")
    print(f"data: {train_ds.num_tokens:,} train tokens, {val_ds.num_tokens:,} val tokens "
          f"({val_ds.bytes / max(val_ds.num_tokens, 1):.2f} bytes/token on val)")
    if val_ds.num_tokens < 1000:
        raise LMForgeError(f"the held-out split of {corpus.path} has only {val_ds.num_tokens} tokens: give the "
                           "quickstart a larger corpus (many files) so it can measure bits per byte")

    _stage(4, f"training go_coder_tiny for {minutes:g} minutes (evaluations and checkpoints not counted)")
    run_name = time.strftime("quickstart-%Y%m%d-%H%M%S")
    values = {"name": run_name, "out_dir": str(work / "runs"), "data": {"path": str(data_dir)}}
    cfg = load_config("go_coder_tiny", overrides, values=values)
    given = {o.split("=", 1)[0].strip() for o in overrides or []}
    # The schedule runs on time, not on a step count sized from a first timing: a minute in which
    # another program was busy once shrank that count to 56 steps (issue 14). Now a slow spell costs
    # only the steps it slows, and the learning rate still warms up and decays over the whole budget.
    if "training.schedule_over" not in given:  # a step count the user set is kept as it is
        cfg.training.schedule_over = "steps" if "training.max_steps" in given else "time"
    if "training.max_time_minutes" not in given:
        by_time = cfg.training.schedule_over == "time"
        cfg.training.max_time_minutes = minutes if by_time else minutes * 1.1  # the budget, or a guard
    result = train(cfg)
    if result.stopped == "signal":  # Ctrl-C or SIGTERM: the checkpoint is saved; the rest was not asked for
        name = signal.Signals(result.signal).name if result.signal else "a signal"
        print(f"stopped by {name} at step {result.step}: the held-out evaluation, plot and sample are skipped. "
              f"Continue the training with: lmforge train {result.run_dir / 'config.yaml'} --resume")
        return {"signal": result.signal, "run_dir": str(result.run_dir), "checkpoint": str(result.last_checkpoint)}

    _stage(5, "held-out evaluation")
    ckpt = result.best_checkpoint or result.last_checkpoint
    model, _, device = load_for_inference(ckpt, cfg.training.device)
    eval_tokens = val_ds.read(0, min(val_ds.num_tokens, 200_000))
    bytes_per_token = scored_bytes_per_token(tokenizer, eval_tokens)
    if bytes_per_token <= 0:
        raise LMForgeError(f"the held-out tokens of {data_dir} stand for no text: re-prepare the data from "
                           f"{corpus.path} (lmforge quickstart --out NEW)")
    nll, count = nll_of_tokens(model, eval_tokens, cfg.data.seq_len, 16, device)
    model_metrics = metrics_from_nll(nll, count, bytes_per_token)
    train_sample = train_ds.read(0, min(train_ds.num_tokens, 20_000_000))
    base = unigram_bpb(train_sample, eval_tokens, tokenizer.vocab_size, bytes_per_token)
    gain = 1 - model_metrics["bpb"] / base
    print(f"held-out bits per byte: model {model_metrics['bpb']:.3f}  vs  unigram baseline {base:.3f} "
          f"({100 * abs(gain):.0f}% {'lower' if gain >= 0 else 'higher'}); perplexity {model_metrics['ppl']:.2f} "
          f"on {count:,} tokens")
    if gain <= 0:
        print("note: the model is no better than counting token frequencies yet: train longer (--minutes) or "
              "on more data")

    _stage(6, "plot and sample")
    png = plot_run(result.run_dir)
    print(f"loss curve: {png}")
    prompt = PROMPTS.get(corpus.language, PROMPTS["text"])
    print("sample (temperature 0.7):\n" + "-" * 60)
    print(prompt, end="", flush=True)
    generate_text(model, tokenizer, prompt, max_new_tokens=120, temperature=0.7, top_p=0.95, seed=0,
                  stream=lambda s: print(s, end="", flush=True))
    print("\n" + "-" * 60)
    elapsed = time.perf_counter() - t_start
    print(f"done in {elapsed / 60:.1f} min. Next: lmforge generate {ckpt} --prompt '...'  |  "
          f"lmforge eval {ckpt} --data {data_dir}")
    return {"bpb": model_metrics["bpb"], "unigram_bpb": base, "run_dir": str(result.run_dir),
            "checkpoint": str(ckpt), "seconds": elapsed, "png": str(png)}
