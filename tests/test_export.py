"""`lmforge export --format hf`: transformers loads the export and computes the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmforge.cli import main
from lmforge.errors import LMForgeError
from lmforge.models.gpt import GPT, GPTConfig
from lmforge.tokenizer import Tokenizer, train_tokenizer

TEXTS = ["package main\n\nimport \"fmt\"\n\nfunc main() {\n\tfmt.Println(\"hello, world\")\n}\n",
         "The quick brown fox jumps over the lazy dog. Ünïcödé and emoji 🙂 too.",
         "func add(a, b int) int {\n\treturn a + b // sum\n}\n"] * 20


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(TEXTS, vocab_size=300, out_dir=out, show_progress=False)
    return out


def checkpoint(tmp_path, tokenizer_dir, **config):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=4, **config))
    with torch.no_grad():  # non-trivial norms and biases, so a mislaid tensor shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    ckpt = model.save_pretrained(tmp_path / "ckpt")
    Tokenizer.load(tokenizer_dir).save(ckpt)
    return model.eval(), ckpt


@pytest.mark.parametrize("config", [
    {"flavor": "gpt2"},
    {"flavor": "gpt2", "activation_function": "gelu_new", "tie_word_embeddings": False},
    {"flavor": "llama"},
    {"flavor": "llama", "n_kv_head": 2, "tie_word_embeddings": False, "rope_theta": 500.0},
], ids=["gpt2", "gpt2-untied", "llama", "llama-gqa-untied"])
def test_transformers_loads_the_export_with_equal_logits(tmp_path, tokenizer_dir, config):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, ckpt = checkpoint(tmp_path, tokenizer_dir, **config)
    assert main(["export", str(ckpt), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == ("GPT2LMHeadModel" if config["flavor"] == "gpt2" else "LlamaForCausalLM")
    ids = torch.randint(0, 300, (3, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model.logits(ids), rtol=0, atol=1e-4)
    hf_tok, ours = AutoTokenizer.from_pretrained(tmp_path / "hf"), Tokenizer.load(tokenizer_dir)
    for text in TEXTS[:3]:
        assert hf_tok(text)["input_ids"] == ours.encode(text)
        assert hf_tok.decode(ours.encode(text)) == text
    assert hf.config.eos_token_id == ours.eos_id


def test_export_refuses_what_transformers_cannot_express_and_keeps_existing_output(tmp_path, tokenizer_dir):
    _, ckpt = checkpoint(tmp_path, tokenizer_dir, flavor="llama", mhc_enabled=True)
    from lmforge.export import export_hf

    with pytest.raises(LMForgeError, match="mHC.*transformers cannot run.*own checkpoint format.*always works"):
        export_hf(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.tmp-*"))
    _, ckpt = checkpoint(tmp_path / "plain", tokenizer_dir, flavor="llama")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(LMForgeError, match="not an earlier lmforge export") as refused:
        export_hf(ckpt, tmp_path / "mine")
    assert "pass --overwrite" not in str(refused.value)  # it would be refused too: not suggested (a probe followed it)
    with pytest.raises(LMForgeError, match="not an earlier lmforge export"):
        export_hf(ckpt, tmp_path / "mine", overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    export_hf(ckpt, tmp_path / "hf")
    with pytest.raises(LMForgeError, match="holds an earlier export; pass --overwrite"):
        export_hf(ckpt, tmp_path / "hf")
    (tmp_path / "hf" / "README.md").write_text("my model card")  # the user's own file survives a re-export
    (tmp_path / "hf" / "eval").symlink_to(tmp_path)  # and a link to a directory stays a link
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"stale")
    export_hf(ckpt, tmp_path / "hf", overwrite=True)
    assert (tmp_path / "hf" / "README.md").read_text() == "my model card"
    assert (tmp_path / "hf" / "eval").is_symlink() and (tmp_path / "hf" / "eval").resolve() == tmp_path.resolve()
    assert (tmp_path / "hf" / "model.safetensors").stat().st_size > 5  # the export's own files are the new ones
    # a Hugging Face model directory lmforge did not write (no lmforge_source) is never replaced
    theirs = tmp_path / "downloaded"
    theirs.mkdir()
    (theirs / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(LMForgeError, match="not an earlier lmforge export.*even with --overwrite"):
        export_hf(ckpt, theirs, overwrite=True)
    assert sorted(p.name for p in theirs.iterdir()) == ["config.json"]


def test_export_records_the_source_as_an_absolute_path_with_links_resolved(tmp_path, tokenizer_dir, monkeypatch):
    """``lmforge_source`` names the weights from any directory: not the relative path (or link) as typed."""
    import json

    _, ckpt = checkpoint(tmp_path, tokenizer_dir, flavor="gpt2")
    (tmp_path / "current").symlink_to(ckpt.name)  # a relative link, as `ln -s ckpt current` makes
    monkeypatch.chdir(tmp_path)
    assert main(["export", "current", "--format", "hf", "--out", "hf"]) == 0
    source = json.loads((tmp_path / "hf" / "config.json").read_text())["lmforge_source"]
    assert source == str(ckpt.resolve()) and Path(source).is_absolute()
    monkeypatch.chdir(tmp_path.parent)  # read from elsewhere, it still names the checkpoint
    assert (Path(source) / "model.safetensors").is_file()


def test_cli_export_names_the_formats_a_puzzle_model_does_have(tmp_path, capsys):
    from lmforge.models import build_model
    from lmforge.recipes.puzzles.trm import TRMConfig

    trm = build_model(TRMConfig(seq_len=81, vocab_size=11, num_puzzle_identifiers=4, hidden_size=32, num_heads=2,
                                L_layers=1, H_cycles=1, L_cycles=1, puzzle_emb_len=2)).save_pretrained(tmp_path / "trm")
    for fmt in ("hf", "gguf"):
        assert main(["export", str(trm), "--format", fmt, "--out", str(tmp_path / f"out-{fmt}")]) == 2
        err = capsys.readouterr().err
        assert "'trm' model" in err and "own checkpoint format" in err and "--format hf and --format gguf" in err
    assert not list(tmp_path.glob("*out-*"))
