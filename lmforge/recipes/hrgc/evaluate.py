"""``lmforge eval`` for HRGC (and its plain baseline) on a held-out split of ``data go-functions``.

For every function (or the first ``limit``) the model writes a body from the spec alone, with the
full inference loop (``lmforge.recipes.hrgc.writer``, greedy), and the answer is scored against the real body:

* plan_exact / plan_token_accuracy — the sampled plan against the reference plan (tokens compared
  position by position over the longer of the two);
* code_exact — the answer equals the real body (outer whitespace ignored);
* ast_similarity — difflib's ratio between the sequences of syntax-node kinds of the two bodies
  (tree-sitter-go, depth first): 1.0 for the same tree shape whatever the names;
* parse_rate / first_attempt_parse_rate — the answer / the first attempt parses; plan_follow_rate —
  the answer also follows the model's own plan (what the validator accepts);
* avg_iterations — attempts per function;
* compile_rate — where Go is installed and the data's source tree is there: the answer, put in place
  of the real body in its own file (``go build -overlay -o /dev/null``, the tree is not touched),
  compiles with its package; functions in files this platform does not build (build tags, _GOOS
  suffixes) are left out of this share;
* head_accuracy — the continue / refine / done head on the split's labelled states (teacher-forced).

Each sampled plan and body is capped at twice its reference's length in tokens plus 16: room for a
right answer, a bound on a rambling one (the same for both models).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from lmforge.errors import LMForgeError
from lmforge.go_syntax import ast_similarity, go_parser
from lmforge.recipes.hrgc.functions import GoFunction, read_go_functions


def token_accuracy(hyp: list[int], ref: list[int]) -> float:
    longest = max(len(hyp), len(ref))
    if longest == 0:
        return 1.0
    return sum(a == b for a, b in zip(hyp, ref)) / longest


class GoBuildCheck:
    """Compiles a function with a new body inside its own package, leaving the source tree as it is:
    the file is replaced through ``go build -overlay`` and the output goes to the null device."""

    def __init__(self, source_root: str | Path, go: str):
        self.go = go
        root = Path(source_root)
        goroot = subprocess.run([go, "env", "GOROOT"], capture_output=True, text=True).stdout.strip()
        # Go names GOROOT's files by GOROOT's own path: an overlay must use that spelling.
        if goroot and (Path(goroot) / "src").resolve() == root.resolve():
            root = Path(goroot) / "src"
        self.root = root
        self.tmp = Path(tempfile.mkdtemp(prefix="lmforge-gobuild-"))
        self.env = {**os.environ, "GOPROXY": "off", "GOFLAGS": "-mod=mod" if (root / "go.mod").is_file() else ""}
        self._built_files: dict[str, set[str]] = {}

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _package_files(self, package: str) -> set[str]:
        """The files `go build` compiles for this package on this platform (build tags and _GOOS/_GOARCH
        suffixes leave others out: a body there would "compile" whatever it holds)."""
        if package not in self._built_files:
            listed = subprocess.run([self.go, "list", "-f", "{{join .GoFiles \"\\n\"}}\n{{join .CgoFiles \"\\n\"}}",
                                     "./" + package], cwd=self.root, capture_output=True, text=True, env=self.env)
            self._built_files[package] = set(listed.stdout.split()) if listed.returncode == 0 else set()
        return self._built_files[package]

    def check(self, fn: GoFunction, code: str, parses: bool = True) -> bool | None:
        """True / False: it compiles or not; None: not checkable here (the function cannot be found in
        its file, or the file is not built on this platform)."""
        path = self.root / fn.file
        if Path(fn.file).name not in self._package_files(fn.package):
            return None
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None
        signature = [ln for ln in fn.spec.split("\n") if not ln.lstrip().startswith("//")]
        at = text.find(signature[0]) if signature else -1
        start = text.find(fn.code, max(at, 0))
        if at < 0 or start < 0:
            return None
        if not parses:
            return False
        replaced = self.tmp / "replaced.go"
        replaced.write_text(text[:start] + code + text[start + len(fn.code):], encoding="utf-8")
        overlay = self.tmp / "overlay.json"
        overlay.write_text(json.dumps({"Replace": {str(path): str(replaced)}}))
        try:
            done = subprocess.run([self.go, "build", "-o", os.devnull, "-overlay", str(overlay), "./" + fn.package],
                                  cwd=self.root, capture_output=True, text=True, timeout=300, env=self.env)
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0


def _source_root(data_dir: Path) -> Path | None:
    try:
        source = json.loads((data_dir / "meta.json").read_text()).get("source")
    except (OSError, ValueError):
        return None
    return Path(source) if source and Path(source).is_dir() else None


@torch.no_grad()
def head_accuracy(model, tokenizer, parser, functions: list[GoFunction], seed: int = 0,
                  batch_size: int = 16) -> tuple[float, int]:
    """Accuracy of the head on the functions' labelled refinement states, and how many were scored."""
    from lmforge.recipes.hrgc.sequences import EncodedFunctions, HRGCEvalLoader, SequenceFormat

    cfg = model.config
    data = EncodedFunctions(functions, SequenceFormat(tokenizer, True), cfg.planner_config.n_positions,
                            cfg.generator_config.n_positions)
    if not len(data):
        return float("nan"), 0
    device = next(model.parameters()).device
    correct = total = 0
    for batch in HRGCEvalLoader(data, parser, batch_size, seed, 0, 1).iter_eval_batches():
        batch = {k: v.to(device) for k, v in batch.items()}
        _, metrics = model(batch)
        n = int((batch["head_labels"] >= 0).sum())
        correct += float(metrics["head_accuracy"]) * n
        total += n
    return (correct / total if total else float("nan")), total


def evaluate_hrgc(checkpoint: str | Path, data_dir: str | Path, split: str = "test", limit: int = 0,
                  device: str = "auto", max_iterations: int | None = None, compile_check: bool = True,
                  progress: bool = True) -> dict[str, Any]:
    from lmforge.recipes.hrgc.writer import SpecDoesNotFit, Writer
    from lmforge.infer.loading import load_for_inference
    from lmforge.recipes.hrgc.model import HRGC

    data_dir = Path(data_dir)
    split_file = data_dir / f"{split}.jsonl"
    if not split_file.is_file():
        raise LMForgeError(f"{split_file} not found: pass --data a directory made by `lmforge data go-functions` "
                           f"and --split train, val or test")
    functions = list(read_go_functions(split_file))
    if limit:
        functions = functions[:limit]
    if not functions:
        raise LMForgeError(f"{split_file} holds no functions")
    model, tokenizer, _ = load_for_inference(checkpoint, device, "fp32", model_class=HRGC)
    parser = go_parser()
    writer = Writer(model, tokenizer, parser, max_iterations=max_iterations)
    hierarchical = model.config.hierarchical
    go = shutil.which("go")
    root = _source_root(data_dir)
    builder = GoBuildCheck(root, go) if compile_check and go and root else None
    sums: dict[str, float] = {}

    def add(key: str, value: float) -> None:
        sums[key] = sums.get(key, 0.0) + float(value)

    skipped = 0
    try:
        for fn in tqdm(functions, desc="eval", unit="function", disable=not progress):
            ref_code = tokenizer.encode(fn.code)
            try:
                written = writer.write(fn.spec, max_new_tokens=2 * max(len(ref_code), len(tokenizer.encode(fn.plan)))
                                       + 16)
            except SpecDoesNotFit:
                skipped += 1
                continue
            answer = written.answer
            if hierarchical:
                add("plan_exact", written.plan == fn.plan)
                add("plan_token_accuracy", token_accuracy(tokenizer.encode(written.plan), tokenizer.encode(fn.plan)))
                add("plan_follow_rate", not answer.verdict)
            add("code_exact", answer.code.strip() == fn.code.strip())
            add("ast_similarity", ast_similarity(parser, fn.spec, answer.code, fn.code))
            add("parse_rate", answer.parses)
            add("first_attempt_parse_rate", written.attempts[0].parses)
            add("avg_iterations", written.iterations)
            if builder is not None:
                compiled = builder.check(fn, answer.code, answer.parses)
                if compiled is not None:
                    add("compile_rate", compiled)
                    add("_compile_n", 1)
    finally:
        if builder is not None:
            builder.close()
    n = len(functions) - skipped
    if n == 0:
        raise LMForgeError("no function of the split fits the model's contexts")
    out: dict[str, Any] = {k: v / n for k, v in sums.items() if not k.startswith("_") and k != "compile_rate"}
    if "_compile_n" in sums:
        out["compile_rate"] = sums["compile_rate"] / sums["_compile_n"]
    if hierarchical:
        out["head_accuracy"], out["head_states"] = head_accuracy(model, tokenizer, parser, functions)
    out.update(functions=n, skipped=skipped, data=str(split_file), hierarchical=hierarchical)
    return out


__all__ = ["evaluate_hrgc", "token_accuracy", "GoBuildCheck", "head_accuracy"]
