"""The CLI verbs end to end on a small real run: help, eval, generate, plot, bench, quickstart."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lmforge.cli import build_parser, main
from tests.train_helpers import write_go_corpus


@pytest.fixture
def trained(go_data, trained_run):
    """The session's shared corpus dir, data and trained run (read-only)."""
    return go_data.parent, go_data, trained_run


def _leaf_parsers(parser):
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            for sub in action.choices.values():
                yield from _leaf_parsers(sub)
            return
    yield parser


def test_every_verb_documents_every_option():
    leaves = list(_leaf_parsers(build_parser()))
    names = {p.prog.split(" ", 1)[1] for p in leaves}
    assert {"quickstart", "tokenizer train", "data prepare", "train", "eval", "generate", "plot", "bench"} <= names
    for p in leaves:
        for action in p._actions:
            if action.dest != "help":
                assert action.help, f"{p.prog}: option {action.dest} has no help text"


# Runs before a test's script in a fresh process (this one has imported torch): keeps the lmforge lines of
# the stack that first imports torch, for the failure message. The script leaves its results in `out`.
TORCH_SPY = """
import json, sys, traceback

first = []


class Spy:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not first:
            first.extend(f"{frame.filename}:{frame.lineno} {frame.line}" for frame in traceback.extract_stack()
                         if "lmforge" in frame.filename)
        return None


sys.meta_path.insert(0, Spy())
"""
TORCH_REPORT = """
print(json.dumps({"torch": "torch" in sys.modules, "first": first, "out": out}))
"""


def _run_without_torch(script: str, cwd: Path | None = None) -> dict:
    """``script``'s ``out``, after checking that running it imported no torch."""
    done = subprocess.run([sys.executable, "-c", TORCH_SPY + textwrap.dedent(script) + TORCH_REPORT],
                          capture_output=True, text=True, timeout=300, cwd=cwd)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert not result["torch"], "torch was imported, first by:\n" + "\n".join(result["first"])
    return result["out"]


def test_help_of_every_verb_imports_no_torch():
    """Every command builds its parser from every kind's spec: building it and printing each verb's help
    import no torch (~2 s of CPU on each command); the kinds name what needs it by reference."""
    shown = _run_without_torch("""
        import argparse, contextlib, io
        from lmforge.cli import build_parser, main

        def verbs(parser, path):
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    for name, sub in action.choices.items():
                        yield [*path, name]
                        yield from verbs(sub, [*path, name])

        out = []
        for path in [[], *verbs(build_parser(), [])]:
            with contextlib.redirect_stdout(io.StringIO()) as text, contextlib.suppress(SystemExit):
                main([*path, "--help"])
            out.append([" ".join(path), text.getvalue().startswith("usage: lmforge")])
    """)
    shown = dict(shown)
    assert all(shown.values()), shown
    assert {"", "train", "eval", "generate", "solve", "data sudoku", "data sft", "checkpoint verify",
            "pipeline status", "serve"} <= set(shown)


def test_verbs_that_need_no_torch_run_without_importing_it(tmp_path):
    """A verb that only reads, tokenizes or writes files (checkpoint verify, data stories, tokenizer train,
    data prepare, data sft --tokenizer, --version) runs end to end without importing torch."""
    from lmforge.checkpoint import write_checksums

    for name in ("good", "damaged"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"weights of " + name.encode())
        write_checksums(tmp_path / name)
    (tmp_path / "damaged" / "model.safetensors").write_bytes(b"weights changed")
    codes = _run_without_torch("""
        import contextlib
        from lmforge.cli import main

        out = [main(["checkpoint", "verify", "good"]), main(["checkpoint", "verify", "damaged"]),
               main(["data", "stories", "--out", "stories", "--n", "40", "--no-progress"]),
               main(["tokenizer", "train", "stories/train.txt", "--out", "tok", "--vocab-size", "300", "--no-progress"]),
               main(["data", "prepare", "stories/train.txt", "--tokenizer", "tok", "--out", "shards", "--no-progress"]),
               main(["data", "tool-calls", "--out", "chats", "--n-train", "8", "--n-val", "2", "--n-test", "2"]),
               main(["data", "sft", "chats", "--tokenizer", "tok", "--show", "0"])]
        with contextlib.suppress(SystemExit):
            main(["--version"])
    """, cwd=tmp_path)
    assert codes == [0, 1, 0, 0, 0, 0, 0]
    assert (tmp_path / "tok" / "tokenizer.json").is_file() and (tmp_path / "shards" / "meta.json").is_file()


def test_eval_on_shards_and_on_raw_files(trained, tmp_path, capsys):
    base, data_dir, result = trained
    assert main(["eval", str(result.run_dir), "--data", str(data_dir), "--json"]) == 0
    shards = json.loads(capsys.readouterr().out)
    assert shards["bpb"] > 0 and shards["ppl"] == pytest.approx(2.718281828 ** shards["loss"], rel=1e-6)
    raw = write_go_corpus(tmp_path / "raw", n_files=3)
    assert main(["eval", str(result.run_dir), "--data", str(raw), "--json"]) == 0
    files = json.loads(capsys.readouterr().out)
    assert files["tokens"] > 0 and files["bpb"] > 0 and "3 documents" in files["data"]


def test_eval_bits_per_byte_counts_the_bytes_of_exactly_the_tokens_scored(trained, tmp_path, capsys):
    """--limit scores a prefix: its bits per byte divide by that prefix's bytes, not by the data set's average
    bytes per token (5% off on a Go package; here far more: the second document is mostly multi-byte text)."""
    import math

    from lmforge.tokenizer import Tokenizer

    _, _, result = trained
    first = "func add(a int, b int) int {\n\treturn a + b\n}\n" * 6
    rows = [{"text": first}, {"text": "é ü ß € 𝄞 ✓ → ∑ " * 40}]
    data = tmp_path / "two.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    tok = Tokenizer.load(result.run_dir / "tokenizer" / "tokenizer.json")
    ids = tok.encode(first)
    limit = len(ids)  # targets: the first document's tokens after its first, and its end
    assert main(["eval", str(result.run_dir), "--data", str(data), "--limit", str(limit), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    scored_bytes = len(tok.decode(ids[1:]).encode("utf-8"))  # ASCII: decoding from any token is exact
    assert got["tokens"] == limit
    assert got["bpb"] == pytest.approx(got["loss"] * limit / math.log(2) / scored_bytes, rel=1e-9)
    everything = len(ids) + 1 + len(tok.encode(rows[1]["text"])) + 1
    set_average = sum(len(r["text"].encode("utf-8")) for r in rows) / everything
    assert abs(got["loss"] / math.log(2) / set_average / got["bpb"] - 1) > 0.2  # what it printed before


def test_generate_streams_a_seeded_completion(trained, capsys):
    _, _, result = trained
    args = ["generate", str(result.best_checkpoint), "--prompt", "func read", "--max-new-tokens", "20",
            "--seed", "3", "--temperature", "0.9"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first and first.startswith("func read") and len(first) > len("func read\n")
    assert main(["generate", str(result.best_checkpoint), "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens" in capsys.readouterr().err


def test_plot_writes_png(trained, tmp_path, capsys):
    import shutil

    run_dir = shutil.copytree(trained[2].run_dir, tmp_path / "run")  # the plot goes into the run dir
    assert main(["plot", str(run_dir)]) == 0
    png = run_dir / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert main(["plot", str(run_dir / "nowhere")]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


def test_bench_prints_throughput_and_mfu(capsys):
    assert main(["bench", "go_coder_tiny", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
                 "data.seq_len=16", "training.micro_batch_size=2", "--steps", "2", "--warmup", "1",
                 "--vocab-size", "300", "--compare-transformers", "--json",
                 "training.peak_flops=1e12"]) == 0  # a given peak: no matmul timing that a busy machine skews
    out = capsys.readouterr().out
    results = json.loads(out[out.index("{"):])
    systems = [r["system"] for r in results["runs"]]
    assert systems == ["lmforge", "transformers"]
    assert all(r["tokens_per_s"] > 0 for r in results["runs"]) and results["speedup"] > 0
    assert 0 < results["runs"][0]["mfu"] < 1
    assert results["lm_loss"] == "chunked" and "lm_loss=chunked" in out  # what auto resolved to on a CPU
    lm = results["runs"][0]  # llm.c's convention, 6 N + 6 L C T (1 layer, 32 wide, 16 tokens)
    assert lm["flops_per_token_llmc"] == 6 * lm["params"] + 6 * 1 * 32 * 16
    assert lm["mfu_llmc"] / lm["mfu"] == pytest.approx(lm["flops_per_token_llmc"] / lm["flops_per_token"])


def test_bench_times_the_rows_the_kind_trains_on_not_data_seq_len(monkeypatch, capsys):
    """A kind whose rows are not data.seq_len long (here: the model's whole context, as HRGC's are up to the
    generator's) is timed, printed and counted at the length its spec says (RecipeSpec.seq_len)."""
    from lmforge import recipes
    from lmforge.models.gpt import GPT
    from lmforge.recipes.lm import count
    from lmforge.recipes.lm.bench import RandomTokens

    recipes.kinds()  # the built-in kinds first; the registry is restored after the test
    monkeypatch.setattr(recipes, "_KINDS", dict(recipes._KINDS))
    monkeypatch.setattr(recipes, "_FAMILIES", dict(recipes._FAMILIES))
    recipes.register(recipes.RecipeSpec(
        name="context_rows", summary="gpt on rows of its whole context", families=(GPT,), build_data=None, count=count,
        bench_data=lambda cfg: RandomTokens(cfg.model.vocab_size, cfg.training.micro_batch_size,
                                            cfg.model.n_positions, cfg.seed),
        seq_len=lambda cfg: cfg.model.n_positions))
    assert main(["bench", "go_coder_tiny", "kind=context_rows", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
                 "model.n_positions=24", "data.seq_len=16", "training.micro_batch_size=2",
                 "training.grad_accum_steps=2", "--steps", "2", "--warmup", "0", "--vocab-size", "300", "--json",
                 "training.peak_flops=1e12"]) == 0
    out = capsys.readouterr().out
    results = json.loads(out[out.index("{"):])
    assert "micro-batch 2 x accum 2 x seq 24," in out and results["seq_len"] == 24
    (run,) = results["runs"]
    assert run["flops_per_token_llmc"] == 6 * run["params"] + 6 * 1 * 32 * 24  # attention over 24 positions
    assert run["tokens_per_step"] == 2 * 24 * 2  # 2 rows x 24 tokens x 2 micro-batches


def test_quickstart_on_a_given_tree_beats_the_unigram_baseline(tmp_path, capsys):
    corpus = write_go_corpus(tmp_path / "src", n_files=60)
    # A step count, not a time budget, so a busy machine trains the same model (--minutes is then a guard)
    argv = ["quickstart", "--data", str(corpus), "--out", str(tmp_path / "qs"), "--minutes", "10", "--vocab-size",
            "400", "training.micro_batch_size=8", "data.seq_len=64", "model.n_positions=64", "model.n_layer=2",
            "model.n_embd=64", "model.n_head=2"]
    assert main([*argv, "training.max_steps=1"]) == 0  # one step: still worse than counting tokens
    out = capsys.readouterr().out
    m = re.search(r"held-out bits per byte: model ([\d.]+)\s+vs\s+unigram baseline ([\d.]+) \(\d+% higher\)", out)
    assert m and float(m.group(1)) > float(m.group(2)), out
    assert "no better than counting token frequencies yet" in out
    assert main([*argv, "training.max_steps=60"]) == 0  # the tokenizer and data reused
    out = capsys.readouterr().out
    m = re.search(r"held-out bits per byte: model ([\d.]+)\s+vs\s+unigram baseline ([\d.]+)", out)
    assert m, out
    assert float(m.group(1)) < 0.8 * float(m.group(2))
    assert (tmp_path / "qs" / "tokenizer" / "tokenizer.json").is_file()
    assert list((tmp_path / "qs" / "runs").glob("quickstart-*/loss.png"))
    sample = out.split("sample (temperature 0.7):")[1].split("-" * 60)[1]
    prompt = "func readLines(path string) ([]string, error) {\n"
    assert prompt in sample and sample.split(prompt, 1)[1].strip()  # the prompt was continued


def test_quickstart_stopped_by_a_signal_skips_the_rest_and_says_how_to_continue(tmp_path, capsys, monkeypatch):
    """SIGTERM (or Ctrl-C) while the quickstart trains: the loop saves a checkpoint; the evaluation, plot and
    sample that would follow are skipped, the exit status is the signal's, and the printed command resumes."""
    import os
    import signal

    from lmforge.train.loop import Trainer

    real, calls = Trainer._train_step, [0]

    def step_fn(self):
        calls[0] += 1
        if calls[0] == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self)

    monkeypatch.setattr(Trainer, "_train_step", step_fn)
    corpus = write_go_corpus(tmp_path / "src", n_files=20)
    argv = ["quickstart", "--data", str(corpus), "--out", str(tmp_path / "qs"), "--minutes", "10", "--vocab-size",
            "300", "training.micro_batch_size=4", "data.seq_len=32", "model.n_positions=32", "model.n_layer=1",
            "model.n_embd=32", "model.n_head=2", "training.max_steps=4"]
    assert main(argv) == 128 + signal.SIGTERM
    out = capsys.readouterr().out
    assert "stopped by SIGTERM at step 2" in out and "held-out bits per byte" not in out
    (run,) = (tmp_path / "qs" / "runs").glob("quickstart-*")
    assert not (run / "loss.png").exists()
    command = out.split("Continue the training with: ")[1].split()
    assert command[:2] == ["lmforge", "train"] and command[-1] == "--resume"
    monkeypatch.undo()
    assert main(command[1:]) == 0
    assert f"resuming from {run / 'checkpoints' / 'step-000002'} (step 2)" in capsys.readouterr().out
    assert (run / "checkpoints" / "step-000004").is_dir()


def test_quickstart_finds_goroot_else_the_python_standard_library_without_site_packages(monkeypatch):
    import shutil
    import sysconfig

    from lmforge import quickstart as qs

    if shutil.which("go"):  # CI installs Go: the Go standard library is found through `go env GOROOT`
        corpus = qs.find_corpus()
        assert corpus.language == "go" and (corpus.path / "fmt" / "print.go").is_file()
    monkeypatch.setattr(qs.shutil, "which", lambda name: None)
    corpus = qs.find_corpus()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert corpus.language == "python" and corpus.path == stdlib
    assert not any(g.startswith("**") or g.split("/")[0] in ("site-packages", "dist-packages")
                   for g in corpus.include)
    matched = {p for g in corpus.include if g.startswith("json/") for p in stdlib.glob(g)}
    assert stdlib / "json" / "decoder.py" in matched


def test_bad_arguments_give_clear_errors_not_tracebacks(trained, tmp_path, capsys):
    base, data_dir, result = trained
    cases = [
        (["train", "go_coder_tiny", "model=5"], "config section 'model' must be a mapping"),
        (["train", "go_coder_tiny", "training.beta1=2"], "training.beta1 and training.beta2 must be in [0, 1)"),
        (["train", "go_coder_tiny", "data.seq_len=512", f"data.path={data_dir}"], "longer than the model's context"),
        (["eval", str(result.run_dir), "--data", str(data_dir), "--batch-size", "0"], "--batch-size"),
        (["eval", str(result.run_dir), "--data", str(data_dir), "--limit", "-1"], "--limit must be >= 0 (0 = all), got -1"),
        (["train", "go_coder_tiny", "recipe=5"], "config section 'recipe' must be a mapping"),
        (["eval", str(result.run_dir), "--data", str(base / "corpus"), "--include", "/abs/*.go"],
         "globs must be non-empty and relative"),
        (["plot", str(result.run_dir), "--out", str(tmp_path / "x.txt")], "must end in .png, .svg or .pdf"),
        (["tokenizer", "train", str(base / "corpus"), "--out", str(base / "tokenizer"), "--vocab-size", "300"],
         "already exists; pass --overwrite"),
        (["bench", "go_coder_tiny", "model.flavor=llama", "--compare-transformers"],
         "--compare-transformers compares the gpt2 flavor only"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert (base / "tokenizer" / "tokenizer.json").is_file()  # the refused overwrite left it alone


def test_data_prepare_on_a_malformed_jsonl_line_names_it_and_keeps_earlier_output(trained, tmp_path, capsys):
    base, data_dir, _ = trained
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": f"func f{i}() int {{ return {i} }}\n"}) + "\n" for i in range(200)))
    out = tmp_path / "shards"
    assert main(["data", "prepare", str(good), "--tokenizer", str(base / "tokenizer"), "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "package a"}\n{"text": "package b"}\n{"text": oops}\n')
    argv = ["data", "prepare", str(bad), "--tokenizer", str(base / "tokenizer"), "--out", str(out), "--overwrite"]
    assert main(argv) == 2
    assert f"{bad}:3: not valid JSON" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the earlier shards are intact


def test_generate_refuses_a_tokenizer_larger_than_the_model_vocab(trained, tmp_path, capsys):
    import shutil

    from lmforge.tokenizer import train_tokenizer

    base, _, result = trained
    ckpt = tmp_path / "ckpt"
    shutil.copytree(result.last_checkpoint, ckpt)
    texts = [f"func g{i}(x int) int {{ return x * {i} }}\n" * 20 for i in range(300)]
    train_tokenizer(iter(texts), vocab_size=1000, out_dir=tmp_path / "bigtok", show_progress=False)
    shutil.copyfile(tmp_path / "bigtok" / "tokenizer.json", ckpt / "tokenizer.json")
    assert main(["generate", str(ckpt), "--prompt", "func"]) == 2
    err = capsys.readouterr().err
    assert "tokens but the model only" in err and "do not belong together" in err


def test_a_model_vocabulary_much_larger_than_its_tokenizer_is_named_in_training_and_generation(trained, tmp_path,
                                                                                             capsys):
    """384 tokens for 1,024 rows: the rows past 384 never train, and beside a checkpoint such a gap usually
    means the wrong tokenizer. Rounding up for the matmuls (here 384 -> 448) says nothing."""
    from lmforge.config import load_config
    from lmforge.train import train
    from tests.train_helpers import write_recipe

    _, data_dir, _ = trained
    runs = {}
    for vocab in (448, 1024):
        recipe = write_recipe(tmp_path / f"r{vocab}.yaml", data_dir, tmp_path / "runs", name=f"v{vocab}",
                              model={"vocab_size": vocab}, training={"max_steps": 1, "eval_interval": 0})
        runs[vocab] = train(load_config(str(recipe)))
        out = capsys.readouterr().out
        assert ("model.vocab_size=1024 but the tokenizer" in out) == (vocab == 1024)
        if vocab == 1024:
            assert "640 rows of the embedding and head will never be trained" in out
    for vocab, result in runs.items():
        assert main(["generate", str(result.last_checkpoint), "--prompt", "func", "--max-new-tokens", "2"]) == 0
        err = capsys.readouterr().err
        assert ("has a vocabulary of 1024 but its tokenizer only 384 tokens" in err) == (vocab == 1024)


def test_train_takes_a_kind_as_its_first_override_as_the_docs_write_it(capsys):
    """`lmforge train kind=dpo ...` (README, docs/ppo.md): no recipe, the kind's defaults and the overrides.
    It was refused as an unknown recipe 'kind=dpo'."""
    import yaml

    assert main(["train", "kind=dpo", "name=prefs", "recipe.beta=0.2", "--print-config"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert (cfg["kind"], cfg["name"], cfg["recipe"]["beta"]) == ("dpo", "prefs", 0.2)
    assert main(["train", "kind=dpoo", "--print-config"]) == 2
    assert "unknown training kind 'dpoo'" in capsys.readouterr().err


def test_ctrl_c_while_the_command_line_is_still_being_built_is_a_message_not_a_traceback(monkeypatch, capsys):
    import lmforge.cli as cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)  # the first seconds: every kind's modules import
    assert cli.main(["train", "go_coder_tiny"]) == 130
    assert capsys.readouterr().err == "lmforge: interrupted\n"


@pytest.mark.parametrize("is_main, stopped, signal_number, status", [
    (True, "signal", 15, 143), (True, "signal", 2, 130), (False, "signal", 15, 0), (True, "completed", None, 0)])
def test_train_exits_with_the_signal_status_on_process_0_only(monkeypatch, capsys, is_main, stopped, signal_number,
                                                              status):
    """A run a signal stopped (its checkpoint saved) exits 128 + the signal's number on process 0; under torchrun
    the others exit 0, since the first non-zero exit has torchrun stop the rest (which could cut process 0's
    last lines)."""
    import lmforge.train as training
    from lmforge.train.loop import TrainResult

    result = TrainResult(run_dir=Path("runs/x"), step=3, stopped=stopped, last_checkpoint=Path("runs/x/c"),
                         best_checkpoint=None, is_main=is_main, signal=signal_number)
    monkeypatch.setattr(training, "train", lambda cfg, resume=False: result)
    assert main(["train", "go_coder_tiny", "training.max_steps=3"]) == status
    out = capsys.readouterr().out
    assert ("--resume" in out) == (is_main and stopped == "signal")
