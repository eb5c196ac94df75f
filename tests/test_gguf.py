"""`lmforge export --format gguf`: llama.cpp (llama-cpp-python) loads the export, tokenizes exactly as
lmforge does and computes the same logits and greedy tokens."""

from __future__ import annotations

import json
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from gguf import GGUFReader

from lmforge.errors import LMForgeError
from lmforge.export import GGUF_DTYPES, export_gguf
from lmforge.infer.generate import generate_tokens
from lmforge.models.gpt import GPT, GPTConfig
from lmforge.tokenizer import Tokenizer, train_tokenizer

CORPUS = ["package main\n\nimport \"fmt\"\n\nfunc main() {\n\tfmt.Println(\"hello, world\")\n}\n",
          "The quick brown fox jumps over the lazy dog. Ünïcödé and emoji 🙂 too.\n",
          "func add(a, b int) int {\n\treturn a + b // sum\n}\n"]
SAMPLES = [
    "package main\n\nimport \"fmt\"\n\nfunc main() {\n\tfmt.Println(\"héllo\\tworld\")\n}\n",
    "func (s *store) list(w http.ResponseWriter) {\n\t\tif err != nil {\r\n\t\t\treturn  // done\n\t}\n}",
    "I don't know, we'll see: it's 12345 or 3.14159 — they're    spaced\tout\n\n\n  ",
    "Ünïcödé 日本語のテキスト, emoji 🙂🚀👍🏽 and Ω≈ç√∫ x²; café crème ☕",
    "   leading spaces and trailing ones   ",
    "",
]
PROMPTS = ["func main() {\n\t", "The quick brown", "package main\n\n"]
CONFIGS = {
    "gpt2": {"flavor": "gpt2"},  # exact-erf gelu, tied head
    "gpt2-gelu_new-untied": {"flavor": "gpt2", "activation_function": "gelu_new", "tie_word_embeddings": False},
    "llama": {"flavor": "llama"},
    # head_dim 12 and rows of 48: the q8_0 export mixes Q8_0 and F16 matrices
    "llama-gqa-untied": {"flavor": "llama", "n_embd": 48, "n_kv_head": 2, "tie_word_embeddings": False,
                         "rope_theta": 500.0},
}
# Largest f32 logit difference allowed (logits reach ~15). llama.cpp's gpt2 GELU is the tanh approximation
# read from an fp16 table on CPU: ~3e-3 off for gelu_new models, ~1e-2 for exact-erf gelu ones.
F32_ATOL = {"gpt2": 2e-2, "gpt2-gelu_new-untied": 5e-3, "llama": 1e-4, "llama-gqa-untied": 1e-4}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(CORPUS * 20, vocab_size=300, out_dir=out, show_progress=False)
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tokenizer_dir):
    """``config id -> (model, checkpoint dir)``, each trained once per module."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = _train(tmp_path_factory.mktemp(name), tokenizer_dir, CONFIGS[name])
        return cache[name]

    return get


def _train(root, tokenizer_dir, config):
    """A tiny model trained briefly on the repeating corpus: its predictions are confident (top-2 logit gaps
    of several units, so greedy tokens cannot flip on rounding), its attention is position dependent (a
    wrong rotary row order changes the logits) and its norms and biases are far from 1 and 0."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{"vocab_size": 300, "n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 4,
                             **config}))
    data = torch.tensor(Tokenizer.load(tokenizer_dir).encode("".join(CORPUS) * 8))
    batch = torch.stack([data[s:s + 65] for s in range(0, len(data) - 65, 64)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(100):
        loss, _ = model({"input_ids": batch[:, :-1], "labels": batch[:, 1:]})
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    ckpt = model.save_pretrained(root / "ckpt")
    Tokenizer.load(tokenizer_dir).save(ckpt)
    return model.eval(), ckpt


@contextmanager
def _llama(path):
    from llama_cpp import GGML_TYPE_F32, Llama

    # f32 KV cache (the default is f16) and logits for every position, for an exact comparison; one
    # thread, as llama.cpp's spinning worker threads crawl on a busy machine and the models are tiny.
    llm = Llama(model_path=str(path), n_ctx=64, n_batch=64, logits_all=True, type_k=GGML_TYPE_F32,
                type_v=GGML_TYPE_F32, n_threads=1, n_threads_batch=1, verbose=False)
    try:
        yield llm
    finally:
        llm.close()  # now, not in __del__ at interpreter exit (which llama-cpp-python gets wrong)


def _llama_logits(llm, ids):
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)])


def _llama_greedy(llm, prompt, n):
    """Greedy decoding by argmax of the raw logits: no sampler, no penalties."""
    llm.reset()
    llm.eval(prompt)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out


def _ours_greedy(model, prompt, n):
    return list(generate_tokens(model, prompt, n, temperature=0, stop_at_eos=False))


def _check_ids(tokenizer):
    return tokenizer.encode("".join(CORPUS))[:64]


@pytest.mark.parametrize("name", CONFIGS)
def test_llama_cpp_tokenizes_and_computes_like_lmforge(tmp_path, trained, tokenizer_dir, name):
    model, ckpt = trained(name)
    tokenizer = Tokenizer.load(tokenizer_dir)
    path = export_gguf(ckpt, tmp_path / "model.gguf")
    assert path == tmp_path / "model.gguf" and not list(tmp_path.glob(".*tmp*"))
    with _llama(path) as llm:
        for text in SAMPLES:
            ids = tokenizer.encode(text)
            assert llm.tokenize(text.encode(), add_bos=False, special=False) == ids, text
            assert llm.detokenize(ids).decode() == text
        special = "<s><PR_TITLE>fix: don't panic</s>"
        assert llm.tokenize(special.encode(), add_bos=False, special=True) == tokenizer.encode(special)
        assert (llm.token_bos(), llm.token_eos()) == (tokenizer.bos_id, tokenizer.eos_id)

        # Every position of a full context: any mislaid tensor or wrong rotary row order shows here.
        ids = _check_ids(tokenizer)
        with torch.no_grad():
            ours = model.logits(torch.tensor([ids]))[0].numpy()
        np.testing.assert_allclose(_llama_logits(llm, ids), ours, rtol=0, atol=F32_ATOL[name])

        for prompt in PROMPTS:
            prompt_ids = tokenizer.encode(prompt)
            assert _llama_greedy(llm, prompt_ids, 20) == _ours_greedy(model, prompt_ids, 20), prompt


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa-untied"])
def test_f16_and_q8_0_exports_shrink_and_stay_close(tmp_path, trained, tokenizer_dir, name):
    model, ckpt = trained(name)
    tokenizer = Tokenizer.load(tokenizer_dir)
    ids = _check_ids(tokenizer)
    with torch.no_grad():
        ours = model.logits(torch.tensor([ids]))[0].numpy()
    sizes = {}
    for dtype, atol in (("f32", F32_ATOL[name]), ("f16", 3e-2), ("q8_0", 0.5)):
        path = export_gguf(ckpt, tmp_path / f"{dtype}.gguf", dtype=dtype)
        sizes[dtype] = path.stat().st_size
        types = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}
        with _llama(path) as llm:
            np.testing.assert_allclose(_llama_logits(llm, ids), ours, rtol=0, atol=atol)
            agree = [a == b for p in PROMPTS for a, b in zip(_llama_greedy(llm, tokenizer.encode(p), 20),
                                                             _ours_greedy(model, tokenizer.encode(p), 20))]
        assert sum(agree) >= 0.9 * len(agree), (dtype, agree)
        assert all(types[n] == "F32" for n in types if "norm" in n or n.endswith(".bias"))
        if dtype == "f16":
            assert types["token_embd.weight"] == "F16" and types["blk.0.ffn_down.weight"] == "F16"
        if dtype == "q8_0":
            assert types["blk.0.ffn_down.weight"] == "Q8_0"  # rows of 128
            if model.config.n_embd % 32:
                assert types["blk.0.attn_q.weight"] == "F16"  # rows of 48: no whole Q8_0 blocks
    assert sizes["f16"] < 0.6 * sizes["f32"] and sizes["q8_0"] < sizes["f16"]
    if model.config.n_embd % 32 == 0:  # every matrix in Q8_0: 34 bytes per 32 values against 64
        assert sizes["q8_0"] < 0.7 * sizes["f16"]


def test_metadata_carries_the_chat_template_and_the_model_sizes(tmp_path, trained, tokenizer_dir):
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    _, ckpt = trained("llama-gqa-untied")
    path = export_gguf(ckpt, tmp_path / "m.gguf", dtype="q8_0")
    fields = GGUFReader(path).fields
    tokenizer = Tokenizer.load(tokenizer_dir)
    assert fields["tokenizer.chat_template"].contents() == tokenizer.chat_template
    assert "{%" in tokenizer.chat_template
    # llama-cpp-python picks the template up as its default chat format and renders what lmforge renders.
    with _llama(path) as llm:
        assert llm.chat_format == "chat_template.default"
        template = llm.metadata["tokenizer.chat_template"]
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Open main.go"}]
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    rendered = Jinja2ChatFormatter(template, eos_token="</s>", bos_token="<s>")(messages=messages, tools=tools)
    assert rendered.prompt == tokenizer.apply_chat_template(messages, tools=tools)
    expected = {"general.architecture": "llama", "general.file_type": 7, "llama.context_length": 64,
                "llama.embedding_length": 48, "llama.block_count": 2, "llama.attention.head_count": 4,
                "llama.attention.head_count_kv": 2, "llama.rope.dimension_count": 12, "llama.rope.freq_base": 500.0,
                "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.bos_token_id": 1,
                "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.padding_token_id": 3,
                "tokenizer.ggml.add_bos_token": False}
    assert {key: fields[key].contents() for key in expected} == expected
    assert fields["tokenizer.ggml.token_type"].contents()[:7] == [3, 3, 3, 3, 3, 3, 1]


def test_a_model_vocabulary_larger_than_the_tokenizer_is_padded(tmp_path, tokenizer_dir):
    torch.manual_seed(0)
    model = GPT(GPTConfig(flavor="llama", vocab_size=320, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                          initializer_range=0.2)).eval()
    ckpt = model.save_pretrained(tmp_path / "ckpt")
    tokenizer = Tokenizer.load(tokenizer_dir)
    tokenizer.save(ckpt)
    assert tokenizer.vocab_size == 300
    path = export_gguf(ckpt, tmp_path / "m.gguf")
    with _llama(path) as llm:
        assert llm.n_vocab() == 320
        ids = tokenizer.encode(CORPUS[0])
        assert llm.tokenize(CORPUS[0].encode(), add_bos=False) == ids
        with torch.no_grad():
            ours = model.logits(torch.tensor([ids]))[0].numpy()
        np.testing.assert_allclose(_llama_logits(llm, ids), ours, rtol=0, atol=1e-4)
    fields = GGUFReader(path).fields
    assert fields["tokenizer.ggml.tokens"].contents()[300:302] == ["[PAD300]", "[PAD301]"]
    assert fields["tokenizer.ggml.token_type"].contents()[299:] == [1] + [5] * 20  # 5: unused


def test_export_refuses_what_llama_cpp_cannot_run_and_keeps_other_files(tmp_path, trained, tokenizer_dir):
    from lmforge.models import build_model
    from lmforge.recipes.puzzles.trm import TRMConfig

    mhc = GPT(GPTConfig(flavor="llama", vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                        mhc_enabled=True)).save_pretrained(tmp_path / "mhc")
    Tokenizer.load(tokenizer_dir).save(mhc)
    trm = build_model(TRMConfig(seq_len=81, vocab_size=11, num_puzzle_identifiers=4, hidden_size=32, num_heads=2,
                                expansion=2, L_layers=1, H_cycles=2, L_cycles=2, puzzle_emb_len=2))
    for ckpt, what in ((mhc, "mHC"), (trm.save_pretrained(tmp_path / "trm"), "'trm' model")):
        with pytest.raises(LMForgeError, match=f"{what}.*always works; --format hf and --format gguf export plain"):
            export_gguf(ckpt, tmp_path / "out.gguf")
        assert not (tmp_path / "out.gguf").exists() and not list(tmp_path.glob(".out.gguf.tmp-*"))

    _, ckpt = trained("llama")
    with pytest.raises(LMForgeError, match="use one of: f32, f16, q8_0"):
        export_gguf(ckpt, tmp_path / "out.gguf", dtype="q4_0")
    assert GGUF_DTYPES == ("f32", "f16", "q8_0")
    mine = tmp_path / "notes.gguf"
    mine.write_text("keep me")
    for overwrite in (False, True):  # said at once: --overwrite would not replace it either
        with pytest.raises(LMForgeError, match="is not a GGUF file .another file., so lmforge does not replace it, "
                                               "even with --overwrite") as refused:
            export_gguf(ckpt, mine, overwrite=overwrite)
        assert "pass --overwrite" not in str(refused.value)
    (tmp_path / "adir").mkdir()
    with pytest.raises(LMForgeError, match="not a GGUF file .a directory."):
        export_gguf(ckpt, tmp_path / "adir")
    (tmp_path / "adir").rmdir()
    assert mine.read_text() == "keep me"
    # An earlier export is replaced in place with --overwrite.
    first = export_gguf(ckpt, tmp_path / "model.gguf")
    size = first.stat().st_size
    with pytest.raises(LMForgeError, match="holds a GGUF file; pass --overwrite"):
        export_gguf(ckpt, first)
    assert export_gguf(ckpt, first, dtype="f16", overwrite=True) == first and first.stat().st_size < size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mhc", "model.gguf", "notes.gguf", "trm"]


def test_export_refuses_a_tokenizer_llama_cpp_would_split_differently(tmp_path, trained):
    _, ckpt = trained("gpt2")
    tokenizer_json = json.loads((ckpt / "tokenizer.json").read_text())
    tokenizer_json["pre_tokenizer"]["add_prefix_space"] = True
    other = tmp_path / "ckpt"
    other.mkdir()
    for f in ckpt.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    (other / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    with pytest.raises(LMForgeError, match="not a plain byte-level BPE tokenizer"):
        export_gguf(other, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()
