"""Sampling, KV-cached generation and streaming detokenisation."""

from __future__ import annotations

import warnings

import pytest
import torch

from lmforge.errors import LMForgeError
from lmforge.infer import StreamingDecoder, generate_text, generate_tokens, sample_next
from lmforge.infer.generate import sample_rows
from lmforge.models.gpt import GPT, GPTConfig

VOCAB = 260  # ByteTokenizer: 4 special ids + 256 bytes
FLAVORS = {"gpt2": {"flavor": "gpt2"}, "llama_gqa": {"flavor": "llama", "n_kv_head": 2}}


def tiny(flavor: str = "gpt2", **overrides) -> GPT:
    values = {**FLAVORS[flavor], "vocab_size": VOCAB, "n_positions": 48, "n_embd": 32, "n_layer": 2, "n_head": 4}
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**values, **overrides})).eval()
    with torch.no_grad():  # larger weights than the init: peaked, position-dependent greedy choices
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


class ByteTokenizer:
    """Stand-in tokenizer: one token per UTF-8 byte, so every non-ASCII character spans tokens."""

    bos_id, eos_id = 1, 2

    def encode(self, text: str) -> list[int]:
        return [b + 4 for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - 4 for i in ids if i >= 4).decode("utf-8", errors="replace")


def greedy_by_full_recompute(model: GPT, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model.logits(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


# ---- sample_next ------------------------------------------------------------------------
def test_sample_next_greedy_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]])).repeat(2000, 1)
    gen = torch.Generator().manual_seed(0)
    assert sample_next(logits, temperature=0.0).tolist() == [1] * 2000
    assert set(sample_next(logits, 1.0, top_k=2, generator=gen).tolist()) == {1, 3}
    # Nucleus 0.5: 0.4 alone is short of 0.5, so 0.3 joins; 0.2 is not needed.
    assert set(sample_next(logits, 1.0, top_p=0.5, generator=gen).tolist()) == {1, 3}
    assert set(sample_next(logits, 1.0, top_p=0.4, generator=gen).tolist()) == {1}
    assert set(sample_next(logits, 1.0, generator=gen).tolist()) == {0, 1, 2, 3}


def test_sampling_without_top_k_or_top_p_skips_the_sort_and_keeps_the_distribution():
    """Without top-k / top-p the inverse CDF is taken in vocabulary order (no sort); top_k = the whole
    vocabulary takes the sorted path and cuts nothing: both draw each token with its softmax
    probability at the temperature (counted over 20,000 draws)."""
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    n = 20_000
    logits = torch.log(probs).repeat(n, 1)
    uniform = torch.rand(n, generator=torch.Generator().manual_seed(0))
    want = torch.softmax(torch.log(probs) / 0.7, -1)
    draws = {}
    for top_k in (0, 5):
        tokens = sample_rows(logits, torch.full((n,), 0.7), torch.full((n,), top_k), torch.ones(n), uniform)
        freq = torch.bincount(tokens, minlength=5).float() / n
        assert torch.allclose(freq, want, atol=0.015), (top_k, freq, want)
        draws[top_k] = tokens
    assert not torch.equal(draws[0], draws[5])  # the two paths map a draw to tokens differently
    rows = sample_rows(logits[:3], torch.tensor([0.0, 1.0, 1.0]), torch.zeros(3, dtype=torch.long), torch.ones(3),
                       torch.tensor([0.99, 0.99, 0.0]))
    assert rows.tolist() == [1, 4, 0]  # greedy stays greedy; u = 0.99 is the last token, u = 0 the first


def test_sample_next_is_vectorised_per_row():
    logits = torch.full((3, 5), -10.0)
    logits[0, 4] = logits[1, 0] = logits[2, 2] = 10.0
    assert sample_next(logits, 1.0, top_k=1).tolist() == [4, 0, 2]


@pytest.mark.parametrize("kwargs", [{"temperature": -1.0}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}])
def test_sample_next_rejects_bad_settings(kwargs):
    with pytest.raises(LMForgeError):
        sample_next(torch.zeros(1, 4), **{"temperature": 1.0, **kwargs})


# ---- generate_tokens --------------------------------------------------------------------
@pytest.mark.parametrize("flavor", FLAVORS)
def test_cached_greedy_generation_equals_full_recompute(flavor):
    model = tiny(flavor)
    prompt = [1, 40, 41, 42, 43, 44]  # multi-token prefill, then one cached token per step
    got = list(generate_tokens(model, prompt, 30, temperature=0.0, stop_at_eos=False))
    assert got == greedy_by_full_recompute(model, prompt, 30)
    assert len(set(got)) > 1  # a constant output would make this comparison weak


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy():
    model = tiny()
    run = lambda **kw: list(generate_tokens(model, [1, 50], 25, stop_at_eos=False, **kw))  # noqa: E731
    assert run(temperature=1.0, seed=7) == run(temperature=1.0, seed=7)
    assert run(temperature=1.0, seed=7) != run(temperature=1.0, seed=8)
    assert run(temperature=1.0, top_k=1, seed=3) == run(temperature=0.0)


def test_empty_prompt_starts_from_the_document_separator():
    model = tiny()
    assert list(generate_tokens(model, [], 10, temperature=0.0)) == list(
        generate_tokens(model, [model.config.eos_token_id], 10, temperature=0.0))


def test_stops_at_eos_without_yielding_it():
    model = tiny()
    first = next(generate_tokens(model, [1, 60], 5, temperature=0.0, stop_at_eos=False))
    assert list(generate_tokens(model, [1, 60], 5, temperature=0.0, eos_id=first)) == []
    assert list(generate_tokens(model, [1, 60], 5, temperature=0.0, eos_id=first, stop_at_eos=False))[0] == first


def test_generation_stops_at_n_positions_with_a_warning():
    model = tiny(n_positions=16)
    with pytest.warns(UserWarning, match="n_positions=16"):
        out = list(generate_tokens(model, list(range(10, 20)), 50, temperature=0.0, stop_at_eos=False))
    assert len(out) == 6  # prompt + output fill the context exactly
    assert out == greedy_by_full_recompute(model, list(range(10, 20)), 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        long_prompt = list(generate_tokens(model, list(range(10, 40)), 50, temperature=0.0, stop_at_eos=False))
    assert len(long_prompt) == 8  # the prompt keeps half the context, the reply fills the rest
    assert long_prompt == greedy_by_full_recompute(model, list(range(32, 40)), 8)
    messages = " | ".join(str(w.message) for w in caught)
    assert "keeping its last 8 tokens (half the context)" in messages and "context is full" in messages
    assert all(w.filename == __file__ for w in caught)  # pointing at the caller's line


@pytest.mark.parametrize("length, asked, kept", [
    (30, 5, 11),  # longer than the context: room for the 5 asked for
    (16, 5, 11),  # as long as the context: the same
    (15, 5, None),  # fits: whole, as the server keeps it; the reply ends where the context does
    (11, 5, None),  # fits with the reply: whole
    (30, 14, 8),  # a long reply: never less than half the context
    (7, 14, None),  # shorter than half the context: whole, the reply stops when the context is full
])
def test_a_prompt_that_does_not_fit_keeps_room_for_the_reply_but_at_least_half_the_context(length, asked, kept):
    model, notes = tiny(n_positions=16), []
    prompt = list(range(10, 10 + length))
    out = list(generate_tokens(model, prompt, asked, temperature=0.0, stop_at_eos=False, note=notes.append))
    used = prompt if kept is None else prompt[-kept:]
    assert out == greedy_by_full_recompute(model, used, min(asked, 16 - len(used)))
    assert (kept is not None) == any(f"keeping its last {kept} tokens" in n for n in notes), notes


@pytest.mark.parametrize("kwargs, words", [
    ({"max_new_tokens": -1}, "max_new_tokens must be an integer >= 0, got -1"),
    ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer >= 0, got 2.5"),
    ({"seed": 2**64}, r"seed must be in 0\.\.2\*\*64-1"),
    ({"seed": -1}, r"seed must be in 0\.\.2\*\*64-1"),
    ({"seed": "1"}, "seed must be an integer"),
    ({"prompt": None}, "prompt must be a str, got NoneType"),
])
def test_generate_text_refuses_bad_arguments_clearly(kwargs, words):
    args = {"prompt": "hi", "max_new_tokens": 4, **kwargs}
    with pytest.raises(LMForgeError, match=words):
        generate_text(tiny(), ByteTokenizer(), args.pop("prompt"), **args)


def test_generate_tokens_refuses_bad_arguments_when_called_not_at_the_first_token():
    with pytest.raises(LMForgeError, match="seed must be in"):
        generate_tokens(tiny(), [1, 2], 4, seed=2**64)


def test_generate_text_takes_the_largest_seed_and_max_new_tokens_0():
    model, tok = tiny(), ByteTokenizer()
    assert generate_text(model, tok, "hi", max_new_tokens=4, temperature=1.0, seed=2**64 - 1) is not None
    assert generate_text(model, tok, "hi", max_new_tokens=0) == ""


def test_generation_runs_in_eval_mode_but_leaves_callers_modes_alone():
    model = tiny(embd_pdrop=0.5, resid_pdrop=0.5).train()
    out = []
    for token in generate_tokens(model, [1, 70], 12, temperature=0.0, stop_at_eos=False):
        assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        assert model.training
        out.append(token)
    assert out == greedy_by_full_recompute(model.eval(), [1, 70], 12)  # no dropout while generating


# ---- streaming decode -------------------------------------------------------------------
TEXT = "naïve café — 世界 🎉 ok, Ωmega ∑ done"


def bpe_tokenizer():
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    # A vocabulary barely above the 256 bytes: multi-byte characters stay split across tokens.
    bpe.train_from_iterator(["hello world", "café naïve", "ok done done"], vocab_size=270, min_frequency=1,
                            special_tokens=["<pad>", "<bos>", "<eos>"], show_progress=False)

    class Wrapper:
        bos_id, eos_id = bpe.token_to_id("<bos>"), bpe.token_to_id("<eos>")
        encode = staticmethod(lambda text: bpe.encode(text).ids)
        decode = staticmethod(lambda ids: bpe.decode(list(ids)))

    return Wrapper()


@pytest.mark.parametrize("make_tokenizer", [ByteTokenizer, bpe_tokenizer])
def test_streaming_decoder_reassembles_multibyte_text(make_tokenizer):
    tok = make_tokenizer()
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some tokens hold part of a character
    decoder = StreamingDecoder(tok)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in p for p in pieces)
    # Text appears as soon as its characters are complete, not only at the end.
    assert sum(1 for p in pieces if p) > len(TEXT) // 2


def test_streaming_decoder_flush_emits_a_dangling_partial_character():
    decoder = StreamingDecoder(ByteTokenizer())
    assert decoder.push(ord("a") + 4) == "a"
    assert decoder.push(0xE4 + 4) == ""  # first byte of a three-byte character
    assert decoder.flush() == "\ufffd"


def test_generate_text_streams_what_it_returns():
    model, tok = tiny(), ByteTokenizer()
    chunks: list[str] = []
    text = generate_text(model, tok, "héllo", max_new_tokens=30, temperature=1.0, seed=5, stream=chunks.append)
    assert text == "".join(chunks) and chunks
    ids = list(generate_tokens(model, [tok.eos_id, *tok.encode("héllo")], 30, temperature=1.0, seed=5,
                               eos_id=tok.eos_id))
    assert text == tok.decode(ids)
