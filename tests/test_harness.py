"""`lmforge eval CKPT --tasks ...`: lm-evaluation-harness in-process on an lmforge model (lmforge.eval.harness),
checked against the harness's own `hf` backend on the model's HF export, on local tasks (tests/lm_eval_tasks.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lm_eval  # noqa: E402,F401  (the test extra has it: a missing one fails here)

from lmforge.cli import main  # noqa: E402
from lmforge.eval.harness import LMForgeLM  # noqa: E402

from .lm_eval_tasks import (  # noqa: E402
    MISSING_DATASET,
    TASKS,
    export,
    hf_model_args,
    per_sample,
    run_lm_eval,
    train_facts_model,
    write_missing_task,
    write_tasks,
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The facts model in a run directory's layout (runs/facts/checkpoints/best), its HF export, the tasks."""
    root = tmp_path_factory.mktemp("harness")
    trained = train_facts_model(root / "train")
    best = root / "runs" / "facts" / "checkpoints" / "best"
    shutil.copytree(trained, best)
    return best, export(best, root / "hf"), write_tasks(root / "tasks")


@pytest.fixture(scope="module")
def hf_lm(setup):
    """lm_eval's own hf backend on the export, scoring as lmforge does (tests/lm_eval_tasks.hf_model_args)."""
    import accelerate  # noqa: F401  (lm_eval[hf], in the test extra)
    from lm_eval.models.huggingface import HFLM

    _, hf_dir, _ = setup
    return HFLM(**hf_model_args(hf_dir), device="cpu", batch_size=8)


@pytest.fixture(scope="module")
def hf_results(setup, hf_lm):
    return run_lm_eval(hf_lm, None, TASKS, setup[2])


def test_requests_become_the_same_tokens_as_in_the_hf_backend(setup, hf_lm):
    checkpoint, _, _ = setup
    ours = LMForgeLM(checkpoint=checkpoint, device="cpu")
    assert ours.prefix_token_id == hf_lm.prefix_token_id == ours.tokenizer.eos_id  # the document separator
    assert ours.max_length == hf_lm.max_length == 64
    pairs = [("Anna lives in ", "Paris"), ("Anna lives in", " Paris"), ("Q: Ben likes\n\n", "  tea."),
             ("Ünïcödé 🙂 text", " and more"), ("a </s> b <s>", " c</s>"), ("x", "")]
    for context, continuation in pairs:
        assert ours._encode_pair(context, continuation) == hf_lm._encode_pair(context, continuation)
    for text in ["Anna likes tea.", "  leading spaces", "Ünïcödé 🙂", "</s>Vera"]:
        assert ours.tok_encode(text) == hf_lm.tok_encode(text)  # no special token added by either
        assert ours.tok_decode(ours.tok_encode(text)) == hf_lm.tok_decode(hf_lm.tok_encode(text))


@pytest.mark.parametrize("masked", [False, True], ids=["cpu-split-attention", "gpu-masked-attention"])
def test_answers_equal_the_hf_backend_on_the_export(setup, hf_results, monkeypatch, masked):
    from lmforge.models.gpt import PackedDocuments

    checkpoint, _, tasks = setup
    if masked:  # the form packed rows take on GPUs (one masked attention call), here on the CPU
        monkeypatch.setattr(PackedDocuments, "from_ids", classmethod(lambda cls, d, p=None: cls.masked(d, p)))
        monkeypatch.setattr("lmforge.eval.harness.HEAD_SLICE_BYTES", 4 * 320 * 7)  # the LM head 7 positions at a time
    # 2 rows of 64 tokens per forward: several batches, several questions (and their choices) per row
    ours = run_lm_eval(LMForgeLM(checkpoint=checkpoint, device="cpu", batch_size=2), None, TASKS, tasks)
    for g, w in zip(per_sample(ours, "local_mc"), per_sample(hf_results, "local_mc"), strict=True):
        assert [x[0] for x in g] == pytest.approx([x[0] for x in w], abs=1e-4)  # each choice's log-likelihood
        assert [x[1] for x in g] == [x[1] for x in w]  # is greedy
    assert per_sample(ours, "local_gen") == per_sample(hf_results, "local_gen")  # the generated text
    # rolling windows: the long document spans several 64-token windows
    assert per_sample(ours, "local_ppl") == pytest.approx(per_sample(hf_results, "local_ppl"), abs=1e-4)
    for task, metric in (("local_mc", "acc,none"), ("local_mc", "acc_norm,none"), ("local_gen", "exact_match,none")):
        assert ours["results"][task][metric] == hf_results["results"][task][metric]
    # The model learnt 16 of the 24 people: well above chance (1/6), not perfect.
    assert 0.4 < ours["results"]["local_mc"]["acc,none"] < 1
    assert 0.3 < ours["results"]["local_gen"]["exact_match,none"] < 1


def test_gpt2_flavor_long_inputs_and_empty_contexts_score_as_in_the_hf_backend(setup, tmp_path):
    """Requests the local tasks do not make: contexts longer than the model's 64 positions (cut from the
    left), an empty context (the separator), a text over several rolling windows; a gpt2-flavor model."""
    import accelerate  # noqa: F401  (lm_eval[hf], in the test extra)
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from lmforge.models.gpt import GPT, GPTConfig
    from lmforge.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(setup[0])
    torch.manual_seed(1)
    model = GPT(GPTConfig(flavor="gpt2", vocab_size=tokenizer.vocab_size, n_positions=64, n_embd=32, n_layer=2,
                          n_head=2))
    checkpoint = model.save_pretrained(tmp_path / "gpt2")
    tokenizer.save(checkpoint)
    hf = HFLM(**hf_model_args(export(checkpoint, tmp_path / "hf")), device="cpu", batch_size=3)
    ours = LMForgeLM(checkpoint=checkpoint, device="cpu", batch_size=3)
    long = " ".join(f"Anna lives in Paris and likes tea number {i}." for i in range(12))  # ~300 tokens
    pairs = [(long, " Rome"), (long + " Ben likes", " bread and cheese."), ("", "Anna likes tea."),
             ("Anna lives in", " Paris"), ("Anna lives in", " Vienna, by the river."), ("Ben", long[:100])]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    for got, want in zip(ours.loglikelihood(requests), hf.loglikelihood(requests), strict=True):
        assert got[0] == pytest.approx(want[0], abs=1e-4) and got[1] == want[1]
    texts = [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate([long, "Vera likes soup."])]
    assert ours.loglikelihood_rolling(texts) == pytest.approx(hf.loglikelihood_rolling(texts), abs=1e-4)


def test_cli_prints_the_table_writes_the_json_and_caches_the_answers(setup, capsys):
    checkpoint, _, tasks = setup
    def args(limit: int, *more: str) -> list[str]:
        return ["eval", str(checkpoint), "--tasks", "local_mc,local_gen", "--include-path", str(tasks), "--limit",
                str(limit), "--device", "cpu", *more]

    assert main(args(6)) == 0
    out = capsys.readouterr().out
    assert "|local_mc " in out and "|acc " in out and "|local_gen|" in out and "exact_match" in out
    assert "model answers computed: 36 loglikelihood, 6 generate_until" in out
    written = sorted((checkpoint.parent.parent / "eval").glob("harness-best-*.json"))  # runs/facts/eval/
    assert len(written) == 1
    first = json.loads(written[0].read_text())
    assert first["results"]["local_mc"]["sample_len"] == 6 and "acc,none" in first["results"]["local_mc"]
    assert first["lmforge"]["checkpoint"] == str(checkpoint) and first["lmforge"]["limit"] == 6
    assert Path(first["lmforge"]["cache"]).is_file()

    assert main(args(6, "--json")) == 0  # the same requests again: every answer from lm_eval's cache
    again = json.loads(capsys.readouterr().out)
    assert again["lmforge"]["computed_requests"] == {"loglikelihood": 0, "loglikelihood_rolling": 0,
                                                     "generate_until": 0}
    assert again["results"]["local_mc"]["acc,none"] == first["results"]["local_mc"]["acc,none"]
    assert again["results"]["local_gen"] == first["results"]["local_gen"]

    assert main(args(8, "--json")) == 0  # 2 more examples: only they are computed
    more = json.loads(capsys.readouterr().out)
    assert more["lmforge"]["computed_requests"] == {"loglikelihood": 12, "loglikelihood_rolling": 0,
                                                    "generate_until": 2}


def test_unknown_task_names_suggest_close_ones(setup, capsys):
    checkpoint, _, tasks = setup
    assert main(["eval", str(checkpoint), "--tasks", "local_mcq,hellaswg", "--include-path", str(tasks)]) == 2
    err = capsys.readouterr().err
    assert "unknown lm-evaluation-harness task 'local_mcq' (did you mean: local_mc" in err
    assert "'hellaswg' (did you mean: hellaswag" in err and "lm-eval ls tasks" in err


def test_missing_data_offline_names_the_dataset_and_how_to_fetch_it(setup, tmp_path):
    checkpoint, _, _ = setup
    write_missing_task(tmp_path / "tasks")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "lmforge", "eval", str(checkpoint), "--tasks", "local_missing",
                           "--include-path", str(tmp_path / "tasks"), "--device", "cpu"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 2, done.stderr
    err = done.stderr
    assert f"dataset '{MISSING_DATASET}' (subset 'facts')" in err and "offline (HF_DATASETS_OFFLINE=1" in err
    assert f"datasets.load_dataset('{MISSING_DATASET}', 'facts')" in err and "Traceback" not in err


def test_refusals(setup, tmp_path, capsys, monkeypatch):
    from lmforge.recipes.puzzles.trm import TRM, TRMConfig

    checkpoint, _, tasks = setup
    trm = TRM(TRMConfig(seq_len=4, vocab_size=5, num_puzzle_identifiers=1, hidden_size=16, num_heads=2))
    trm_dir = trm.save_pretrained(tmp_path / "trm")
    assert main(["eval", str(trm_dir), "--tasks", "local_mc", "--include-path", str(tasks)]) == 2
    assert "holds a 'trm' model (kind puzzles), which does not model text" in capsys.readouterr().err
    assert main(["eval", str(checkpoint), "--tasks", "local_mc", "--data", str(tasks)]) == 2
    assert "--data cannot be combined with --tasks" in capsys.readouterr().err
    assert main(["eval", str(checkpoint), "--data", str(tasks), "--num-fewshot", "2"]) == 2
    assert "--num-fewshot go with --tasks" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if it were not installed
    assert main(["eval", str(checkpoint), "--tasks", "local_mc"]) == 2
    assert "pip install 'lmforge[eval]'" in capsys.readouterr().err


def test_the_refusal_names_the_kinds_whose_model_the_harness_scores(tmp_path, monkeypatch):
    """Which checkpoints `--tasks` takes, and the kinds its refusal names, come from the registry: every kind
    that trains a GPT (the class LMForgeLM drives), a kind of another package included."""
    import dataclasses

    import yaml

    from lmforge import recipes
    from lmforge.errors import LMForgeError
    from lmforge.eval.harness import check_language_model
    from lmforge.models.gpt import GPT
    from lmforge.recipes.puzzles.trm import TRM, TRMConfig

    trm_dir = TRM(TRMConfig(seq_len=4, vocab_size=5, num_puzzle_identifiers=1, hidden_size=16,
                            num_heads=2)).save_pretrained(tmp_path / "trm")
    with pytest.raises(LMForgeError, match=r"\(the gpt family: kinds dpo, grpo, lm, sft\); .* holds a 'trm' model"):
        check_language_model(trm_dir)

    class PluginGPT(GPT):
        family = "plugin_gpt"

    plugin = dataclasses.replace(recipes.get_kind("sft"), name="plugin_chat", families=(PluginGPT,))
    recipes.kinds()  # the built-in kinds loaded before the registry is patched
    monkeypatch.setitem(recipes._KINDS, plugin.name, plugin)
    monkeypatch.setitem(recipes._FAMILIES, PluginGPT.family, (plugin.families[0], plugin))
    with pytest.raises(LMForgeError, match=r"\(the gpt, plugin_gpt families: kinds dpo, grpo, lm, plugin_chat, sft\)"):
        check_language_model(trm_dir)
    (tmp_path / "plugin").mkdir()
    (tmp_path / "plugin" / "config.yaml").write_text(yaml.safe_dump({"family": PluginGPT.family}))
    (tmp_path / "plugin" / "model.safetensors").write_bytes(b"")  # only config.yaml is read
    check_language_model(tmp_path / "plugin")  # a GPT of another family is a language model too
