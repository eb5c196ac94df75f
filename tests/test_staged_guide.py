"""Seed 004 (the staged code-assistant guide): its model sizes as `pipeline-*` presets, its
`scripts/train.py` flags on `lmforge train`, TinyStories' <|endoftext|> files, and the stand-in corpus."""

from __future__ import annotations

import json
import re

import pytest
import torch
import yaml

from lmforge.cli import main
from lmforge.config import load_config, read_recipe
from lmforge.data.sources import FilterStats, iter_documents
from lmforge.data.stories import SEPARATOR, generate_stories, vocabulary, write_stories
from lmforge.errors import LMForgeError
from lmforge.models import build_model, count_parameters
from lmforge.models import gpt as gpt_module
from lmforge.models.gpt import PRESETS, GPTConfig
from lmforge.staged_guide import FLAGS, translate, translate_train_argv
from lmforge.typed import dataclass_from_dict

# The guide's table: size -> (d_model, n_layers, n_heads, d_ff); and what those shapes really hold at
# vocab 32000 with tied embeddings (llama flavor, SwiGLU of width d_ff).
GUIDE_SIZES = {"tiny": (256, 4, 4, 1024), "medium": (768, 12, 12, 3072), "large": (1600, 32, 25, 6400),
               "xlarge": (2048, 40, 32, 8192)}
REAL_COUNTS = {"tiny": 12_388_608, "medium": 137_841_408, "large": 1_362_024_000, "xlarge": 2_750_056_448}


def _gpt(values: dict) -> GPTConfig:
    return dataclass_from_dict(GPTConfig, values, prefix="model")


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _config_of(stdout: str) -> dict:
    """--print-config output: the guide's translation lines are YAML comments, so it parses whole."""
    return yaml.safe_load(stdout)


# ---- presets --------------------------------------------------------------------------------------
def test_pipeline_presets_have_the_guides_sizes_in_the_llama_flavor_and_their_real_counts():
    for size, (width, layers, heads, d_ff) in GUIDE_SIZES.items():
        c = _gpt({"preset": f"pipeline-{size}", "vocab_size": 32000})
        assert (c.flavor, c.n_embd, c.n_layer, c.n_head, c.inner_size) == ("llama", width, layers, heads, d_ff)
        # by formula: embeddings (tied) + per block attention 4C^2 + SwiGLU 3*C*d_ff + two RMSNorms, + final norm
        formula = 32000 * width + layers * (4 * width * width + 3 * width * d_ff + 2 * width) + width
        assert count_parameters(c) == formula == REAL_COUNTS[size]
        assert f"{REAL_COUNTS[size]:,}" in gpt_module.__doc__  # the documented table is the real one
    tiny = _gpt({"preset": "pipeline-tiny", "vocab_size": 32000})
    assert count_parameters(tiny) == build_model(tiny).num_parameters()  # a real model, allocated
    assert not any(p.is_meta for p in build_model(tiny).parameters())


def test_count_parameters_builds_on_the_meta_device(monkeypatch):
    seen = []
    real = gpt_module.GPT.__init__

    def spy(self, config):
        seen.append(torch.empty(0).device.type)  # the default device while the model is built
        real(self, config)

    monkeypatch.setattr(gpt_module.GPT, "__init__", spy)
    assert count_parameters(_gpt({"preset": "pipeline-xlarge", "vocab_size": 32000})) == REAL_COUNTS["xlarge"]
    assert seen == ["meta"]


def test_the_gpt2_presets_are_unchanged():
    assert {k: PRESETS[k] for k in ("tiny", "small", "medium", "large")} == {
        "tiny": {"n_layer": 6, "n_embd": 384, "n_head": 6},
        "small": {"n_layer": 12, "n_embd": 768, "n_head": 12},
        "medium": {"n_layer": 24, "n_embd": 1024, "n_head": 16},
        "large": {"n_layer": 24, "n_embd": 2048, "n_head": 16},
    }
    assert count_parameters(_gpt({"preset": "small", "vocab_size": 50257})) == 124_439_808  # GPT-2 124M
    assert _gpt({"preset": "small"}).flavor == "gpt2"  # they bring no flavor: either works
    assert _gpt({"preset": "small", "flavor": "llama"}).flavor == "llama"


def test_a_pipeline_preset_never_silently_replaces_an_explicit_flavor():
    with pytest.raises(LMForgeError, match=r"pipeline-large is a llama-flavor preset.*model.flavor='gpt2' is set"):
        _gpt({"preset": "pipeline-large", "flavor": "gpt2"})
    assert _gpt({"preset": "pipeline-large", "flavor": "llama"}).flavor == "llama"
    with pytest.raises(LMForgeError, match="llama-flavor preset"):
        load_config("code_assistant_language", ["model.flavor=gpt2"])
    with pytest.raises(LMForgeError, match="llama-flavor preset"):
        load_config("go_coder_tiny", ["model.preset=pipeline-tiny", "model.flavor=gpt2"])


# ---- the guide's flags ------------------------------------------------------------------------------
EVERY_FLAG = ["--stage", "code", "--model-size", "medium", "--batch-size", "3", "--num-epochs", "5",
              "--learning-rate", "5e-6", "--warmup-steps", "1000", "--weight-decay", "0.05", "--dropout", "0.1",
              "--grad-accumulation-steps", "4", "--gradient-checkpointing", "--use-compile", "--use-amp",
              "--use-rmsnorm", "--use-rope"]


def test_every_flag_becomes_its_config_key(tmp_path):
    run = tmp_path / "runs" / "code_assistant_language"
    (run / "tokenizer").mkdir(parents=True)
    code = tmp_path / "code.txt"
    t = translate(EVERY_FLAG + ["--checkpoint", str(run), "--data-file", str(code)])
    assert t.recipe == "code_assistant_code" and t.resume is None
    expected = ["model.preset=pipeline-medium", "training.micro_batch_size=3", "training.epochs=5", "training.lr=5e-6",
                "training.warmup_steps=1000", "training.weight_decay=0.05", "model.embd_pdrop=0.1",
                "model.resid_pdrop=0.1", "model.attn_pdrop=0.1", "training.grad_accum_steps=4",
                "training.activation_checkpointing=true", "training.compile=true", "training.precision=auto",
                "model.flavor=llama", f"training.init_from={run}", f"data.tokenizer={run / 'tokenizer'}",
                f"data.train_path={code}"]
    assert sorted(t.overrides) == sorted(expected)
    for flag in FLAGS:  # one line per flag says what it became
        assert sum(line.startswith(flag.name + " ") for line in t.lines) == 1, flag.name
    assert t.argv()[:2] == ["train", "code_assistant_code"]


def test_stage_code_print_config_shows_the_resolved_values(tmp_path, capsys):
    ckpt = tmp_path / "step-000100"
    ckpt.mkdir()
    (ckpt / "tokenizer.json").write_text("{}")
    data = tmp_path / "code.jsonl"
    rc, out, err = _run(capsys, ["train"] + EVERY_FLAG[:2] + ["--checkpoint", str(ckpt), "--data-file", str(data)]
                        + EVERY_FLAG[2:] + ["--print-config"])
    assert rc == 0, err
    cfg = _config_of(out)
    assert cfg["name"] == "code_assistant_code" and cfg["kind"] == "lm"
    m, t, d = cfg["model"], cfg["training"], cfg["data"]
    assert (m["flavor"], m["preset"], m["n_embd"], m["n_layer"], m["n_head"], m["n_inner"], m["vocab_size"]) == \
        ("llama", "pipeline-medium", 768, 12, 12, 3072, 32000)
    assert m["embd_pdrop"] == m["resid_pdrop"] == m["attn_pdrop"] == 0.1
    assert (t["lr"], t["epochs"], t["micro_batch_size"], t["warmup_steps"], t["weight_decay"], t["grad_accum_steps"]) \
        == (5e-6, 5, 3, 1000, 0.05, 4)
    assert t["activation_checkpointing"] is True and t["compile"] is True and t["precision"] == "auto"
    assert (t["init_from"], d["tokenizer"], d["train_path"], d["path"]) == (str(ckpt), str(ckpt), str(data), "")
    assert "137,841,408 parameters" in out and "the guide's table says 150M" in out


def test_the_guides_stage_1_command_as_written(capsys):
    rc, out, err = _run(capsys, ["train", "--stage", "language", "--model-size", "large", "--batch-size", "2",
                                 "--num-epochs", "3", "--learning-rate", "1e-4", "--warmup-steps", "2000",
                                 "--use-rmsnorm", "--use-rope", "--use-compile", "--use-amp", "--print-config"])
    assert rc == 0, err
    cfg = _config_of(out)
    t = cfg["training"]
    assert (cfg["kind"], cfg["model"]["preset"], cfg["model"]["n_layer"], cfg["model"]["n_embd"]) == \
        ("lm", "pipeline-large", 32, 1600)
    assert (t["lr"], t["warmup_steps"], t["epochs"], t["micro_batch_size"], t["init_from"]) == (1e-4, 2000, 3, 2, "")
    assert "1,362,024,000 parameters (1.36B)" in out and "the guide's table says 1.6B" in out


def test_stage_tools_is_the_sft_recipe(tmp_path, capsys):
    recipe = read_recipe("code_assistant_tools")
    assert recipe["kind"] == "sft" and recipe["training"]["lr"] == 3e-6 and recipe["training"]["epochs"] == 3
    assert recipe["model"]["preset"] == "pipeline-large" and recipe["training"]["micro_batch_size"] == 2
    code_run = tmp_path / "code_run"
    (code_run / "tokenizer").mkdir(parents=True)
    conversations = tmp_path / "tools"
    argv = ["train", "--stage", "tools", "--checkpoint", str(code_run), "--data-file", str(conversations),
            "--batch-size", "2", "--num-epochs", "3", "--learning-rate", "3e-6", "--use-rmsnorm", "--use-rope",
            "--print-config"]
    t = translate(argv[1:])
    assert t.recipe == "code_assistant_tools"
    assert {f"training.init_from={code_run}", f"data.train_path={conversations}", "training.lr=3e-6",
            "training.epochs=3", "model.flavor=llama"} <= set(t.overrides)
    assert f"data.tokenizer={code_run / 'tokenizer'}" in t.overrides  # the tokenizer the weights were trained with
    rc, out, err = _run(capsys, argv)
    assert rc == 0, err
    cfg = _config_of(out)
    assert (cfg["kind"], cfg["training"]["lr"], cfg["training"]["epochs"], cfg["training"]["init_from"]) == \
        ("sft", 3e-6, 3, str(code_run))
    assert (cfg["data"]["train_path"], cfg["data"]["tokenizer"], cfg["model"]["preset"]) == \
        (str(conversations), str(code_run / "tokenizer"), "pipeline-large")


def test_a_plain_recipe_command_is_left_exactly_as_it_was(capsys):
    for argv in (["train", "go_coder_tiny", "training.lr=1e-3"], ["train", "go_coder_tiny", "--resume"],
                 ["train", "go_coder_tiny", "--resume", "runs/x/checkpoints/step-000010", "training.max_steps=5"],
                 ["train", "go_coder_tiny", "--print-config"], ["train", "--stage", "code", "--help"]):
        assert translate_train_argv(list(argv)) == argv
    rc, out, _ = _run(capsys, ["train", "go_coder_tiny", "training.max_steps=7", "--print-config"])
    assert rc == 0 and not out.startswith("#") and yaml.safe_load(out)["training"]["max_steps"] == 7


def test_key_value_overrides_after_the_flags_win(capsys):
    rc, out, err = _run(capsys, ["train", "--stage", "language", "--num-epochs", "3", "--batch-size", "4",
                                 "training.max_steps=5", "training.micro_batch_size=8", "--print-config"])
    assert rc == 0, err
    t = _config_of(out)["training"]
    assert (t["max_steps"], t["epochs"], t["micro_batch_size"]) == (5, 0, 8)


def test_unknown_flags_name_the_close_match(capsys):
    rc, _, err = _run(capsys, ["train", "--stage", "code", "--learning_rate", "1e-4"])
    assert rc == 2 and "unknown option --learning_rate" in err and "Did you mean --learning-rate?" in err
    rc, _, err = _run(capsys, ["train", "--stage", "code", "--use-flash-attention"])
    assert rc == 2 and "unknown option --use-flash-attention" in err
    rc, _, err = _run(capsys, ["train", "--stage", "lang"])
    assert rc == 2 and "Did you mean language?" in err
    # without --stage, a Hugging Face Trainer argument or an lmforge key written as a flag says how lmforge takes it
    rc, _, err = _run(capsys, ["train", "go_coder_tiny", "--learning_rate", "1e-4"])
    assert rc == 2 and "--learning_rate is a Hugging Face Trainer argument" in err and "training.learning_rate=1e-4" in err
    rc, _, err = _run(capsys, ["train", "go_coder_tiny", "--resume_from_checkpoint", "runs/x"])
    assert rc == 2 and "give --resume runs/x" in err and "training.init_from=runs/x" in err
    rc, _, err = _run(capsys, ["train", "go_coder_tiny", "--max_steps=10"])
    assert rc == 2 and "training.max_steps=10" in err
    rc, _, err = _run(capsys, ["train", "go_coder_tiny", "--learning_rate", "--fp16"])  # no value given
    assert rc == 2 and "training.learning_rate=VALUE" in err
    rc, _, err = _run(capsys, ["train", "go_coder_tiny", "--lr_scheduler_type", "linear"])
    assert rc == 2 and "lmforge has no such schedule" in err
    rc, _, err = _run(capsys, ["train", "go_coder_tiny", "--warmup_ratio", "0.1"])
    assert rc == 2 and "has no lmforge setting: give the warmup as training.warmup_steps" in err
    rc, _, err = _run(capsys, ["train", "--stage", "rlhf"])
    assert rc == 2 and "lmforge train code_assistant_reward" in err and "lmforge train code_assistant_rlhf" in err
    for recipe in ("code_assistant_reward", "code_assistant_rlhf"):  # the recipes it names exist
        assert load_config(recipe).kind in ("reward", "ppo")


def test_data_file_is_raw_data_or_prepared_shards(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "meta.json").write_text("{}")
    assert f"data.path={shards}" in translate(["--stage", "code", "--data-file", str(shards)]).overrides
    assert f"data.train_path={tmp_path}" in translate(["--stage", "code", "--data-file", str(tmp_path)]).overrides
    # conversations for the sft stage are always its train_path
    assert f"data.train_path={shards}" in translate(["--stage", "tools", "--data-file", str(shards)]).overrides


def test_the_guides_npy_token_files_are_refused_with_what_to_pass(capsys):
    rc, _, err = _run(capsys, ["train", "--stage", "code", "--data-file", "code_train_large.npy", "--print-config"])
    assert rc == 2 and "code_train_large.npy" in err and "cannot read it" in err
    assert "TinyStoriesV2-GPT4-train.txt" in err and "lmforge data prepare" in err
    rc, _, err = _run(capsys, ["train", "--stage", "tools", "--data-file", "tool_train.npy", "--print-config"])
    assert rc == 2 and "train.jsonl and val.jsonl" in err


def test_rmsnorm_and_rope_come_together(capsys):
    for one, other in (("--use-rmsnorm", "--use-rope"), ("--use-rope", "--use-rmsnorm")):
        rc, _, err = _run(capsys, ["train", "--stage", "language", one, "--print-config"])
        assert rc == 2 and f"{one} without {other}" in err and "pair" in err


def test_the_guides_pth_checkpoints_and_resume(tmp_path, capsys):
    rc, _, err = _run(capsys, ["train", "--stage", "code", "--checkpoint", "models/language_model_best.pth"])
    assert rc == 2 and "--checkpoint runs/code_assistant_language" in err and "never unpickles" in err
    step = tmp_path / "runs" / "code_assistant_code" / "checkpoints" / "step-000200"
    step.mkdir(parents=True)
    (step / "run_config.yaml").write_text("name: code_assistant_code\n")
    t = translate(["--checkpoint", str(step), "--resume"])  # the guide's resume command: no --stage
    assert t.argv() == ["train", str(step / "run_config.yaml"), "training.init_from=", "--resume", str(step)]
    t = translate(["--stage", "code", "--resume"])
    assert t.argv() == ["train", "code_assistant_code", "training.init_from=", "--resume"]
    with pytest.raises(LMForgeError, match="not an lmforge training checkpoint"):
        translate(["--checkpoint", str(tmp_path), "--resume"])


def test_help_documents_the_guides_flags(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in FLAGS:
        assert flag.name in text


# ---- TinyStories as released ------------------------------------------------------------------------
def test_a_text_file_of_stories_is_one_document_per_story(tmp_path):
    stories = tmp_path / "TinyStoriesV2-GPT4-train.txt"
    stories.write_bytes(b"Once upon a time, Tom had a ball.\n\nHe was happy.\n<|endoftext|>\n\n<|endoftext|>\n"
                        b"Lily saw a cat.\r\n <|endoftext|> \nA story with <|endoftext|> inside a line.\n"
                        b"<|endoftext|>\n\xff\xfe bad bytes\n<|endoftext|>\nThe last one, no marker after it.\n")
    plain = tmp_path / "notes.txt"
    plain.write_text("A file without the marker.\n\nIt stays whole.\n")
    stats = FilterStats()
    docs = list(iter_documents([stories, plain], stats=stats))
    assert [d.text for d in docs] == ["Once upon a time, Tom had a ball.\n\nHe was happy.", "Lily saw a cat.",
                                      "A story with <|endoftext|> inside a line.", "The last one, no marker after it.",
                                      "A file without the marker.\n\nIt stays whole.\n"]
    assert [d.source_id for d in docs] == ["TinyStoriesV2-GPT4-train.txt#0", "TinyStoriesV2-GPT4-train.txt#1",
                                           "TinyStoriesV2-GPT4-train.txt#2", "TinyStoriesV2-GPT4-train.txt#3",
                                           "notes.txt"]
    assert stats.kept == 5 and stats.skipped == {"not_utf8": 1}


def test_a_datasets_directory_with_a_text_column_reads_one_document_per_row(tmp_path):
    import datasets

    rows = {"text": ["One day, Tom went to the park.", "Lily had a red ball."]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "plain"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows),
                          "validation": datasets.Dataset.from_dict({"text": ["held out"]})}
                         ).save_to_disk(str(tmp_path / "tinystories"))
    assert [d.text for d in iter_documents([tmp_path / "plain"])] == rows["text"]
    docs = list(iter_documents([tmp_path / "tinystories"]))  # the train split only, as TinyStories on the Hub
    assert [d.text for d in docs] == rows["text"] and docs[1].source_id == "tinystories#train/1"


# ---- the stand-in corpus ----------------------------------------------------------------------------
def test_generated_stories_are_deterministic_varied_childlike_and_three_part():
    a, b = generate_stories(400, seed=1), generate_stories(400, seed=1)
    assert a == b and a != generate_stories(400, seed=2)
    assert len(set(a)) == 400
    assert all(s.count("\n\n") == 2 for s in a)  # beginning, problem, resolution
    words = vocabulary(generate_stories(3000, seed=0))
    assert 200 <= len(words) <= 600  # a few hundred childlike words
    assert {"once", "friend", "happy", "sad", "together"} <= words


def test_write_stories_uses_the_released_layout(tmp_path):
    r = write_stories(tmp_path / "a", n_stories=200, seed=3, val_fraction=0.05)
    assert (r["train_stories"], r["val_stories"]) == (190, 10)
    train = (tmp_path / "a" / "train.txt").read_text()
    assert train.endswith(f"\n{SEPARATOR}\n") and train.count(f"\n{SEPARATOR}\n") == 190
    stories = generate_stories(200, seed=3)
    assert [d.text for d in iter_documents([tmp_path / "a" / "train.txt"])] == stories[:190]
    assert [d.text for d in iter_documents([tmp_path / "a" / "val.txt"])] == stories[190:]
    write_stories(tmp_path / "b", n_stories=200, seed=3, val_fraction=0.05)
    assert (tmp_path / "b" / "train.txt").read_bytes() == train.encode()
    assert json.loads((tmp_path / "a" / "stories.json").read_text())["vocabulary"] == r["vocabulary"]


def test_data_stories_verb(tmp_path, capsys):
    out = tmp_path / "stories"
    rc, text, err = _run(capsys, ["data", "stories", "--out", str(out), "--n", "50", "--seed", "1"])
    assert rc == 0, err
    assert re.search(r"train\.txt: 49 stories", text) and re.search(r"val\.txt: 1 stories", text)
    first = (out / "train.txt").read_bytes()
    rc, _, err = _run(capsys, ["data", "stories", "--out", str(out), "--n", "20"])
    assert rc == 2 and "not empty" in err and (out / "train.txt").read_bytes() == first
    rc, _, err = _run(capsys, ["data", "stories", "--out", str(out), "--n", "20", "--overwrite"])
    assert rc == 0 and (out / "train.txt").read_text().count(SEPARATOR) == 19  # 20, one in val.txt
    other = tmp_path / "mine"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    rc, _, err = _run(capsys, ["data", "stories", "--out", str(other), "--overwrite"])
    assert rc == 2 and "not written by `lmforge data stories`" in err and (other / "keep.txt").read_text() == "mine"
