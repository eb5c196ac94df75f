"""Preference pairs rendered and packed (lmforge.posttrain.pairs), and per-token log-probabilities
(lmforge.posttrain.logprobs): what the reward and dpo kinds are fed."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lmforge.errors import LMForgeError
from lmforge.models.gpt import GPT, GPTConfig
from lmforge.models.losses import IGNORE_INDEX
from lmforge.posttrain.logprobs import sequence_sums, token_logprobs
from lmforge.posttrain.pairs import TOO_LONG, PackedPairs, PairStats, render_pairs
from lmforge.posttrain.preferences import PreferencePair
from lmforge.tokenizer import Tokenizer, train_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def pair(i: int) -> PreferencePair:
    city = f"City{i}"
    call = {"type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello."}, {"role": "user", "content": f"Weather in {city}?"}]
    return PreferencePair(prompt=prompt, chosen={"role": "assistant", "content": "", "tool_calls": [call]},
                          rejected={"role": "assistant", "content": "I cannot know" + " really" * (i % 4)},
                          tools=TOOLS, margin=0.25 * (i % 3) or None, kind=("missed_call", "other")[i % 2],
                          source=f"pairs.jsonl:{i + 1}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    texts = [json.dumps([*pair(i).prompt, pair(i).chosen, pair(i).rejected]) + json.dumps(TOOLS) for i in range(40)]
    return Tokenizer.load(train_tokenizer(texts, vocab_size=400, out_dir=tmp_path_factory.mktemp("tok"),
                                          show_progress=False))


def server_ids(tokenizer, messages, tools) -> list[int]:
    return [tokenizer.eos_id, *tokenizer.encode(tokenizer.apply_chat_template(messages, tools=tools))]


def test_each_side_is_the_server_prompt_then_the_reply_and_its_eos(tokenizer):
    p = pair(3)
    store = render_pairs(tokenizer, [p], seq_len=1024)
    prompt = server_ids(tokenizer, p.prompt, p.tools)
    for side, reply in enumerate((p.chosen, p.rejected)):
        start, n = int(store.offsets[side]), int(store.lengths[side])
        ids, targets = store.inputs[start:start + n], store.targets[start:start + n]
        assert ids[:len(prompt)].tolist() == prompt  # what `lmforge serve` feeds the model
        assert ids[-1] == tokenizer.eos_id  # the closing eos is an input: a reward model reads after it
        scored = np.nonzero(targets != IGNORE_INDEX)[0]
        # targets: the reply's tokens and its eos, each at the position before it; none at the end
        assert scored[0] == len(prompt) - 1 and scored[-1] == n - 2 and targets[-1] == IGNORE_INDEX
        assert (targets[scored] == ids[scored + 1]).all()
        reply_text = tokenizer.decode(ids[len(prompt):].tolist())
        assert ("get_weather" in reply_text) == (side == 0)


def test_packed_batches_keep_pairs_together_and_find_each_end_by_length(tokenizer):
    pairs = [pair(i) for i in range(24)]
    store = render_pairs(tokenizer, pairs, seq_len=1024)
    loader = PackedPairs(store, seq_len=1024, micro_batch_size=2, seed=0)
    batch = loader.next_batch()
    P = batch["num_examples"]
    assert P >= 3 and batch["last_index"].shape == (2 * P,) and batch["margin"].shape == (P,)
    seq, docs, flat = batch["sequence_ids"], batch["document_ids"], batch["input_ids"].view(-1)
    for k in range(2 * P):
        where = (seq.view(-1) == k).nonzero().view(-1)
        p = int(batch["pair_index"][k // 2])
        side = 2 * p + k % 2
        expected = store.inputs[store.offsets[side]:store.offsets[side + 1]]
        assert flat[where].tolist() == expected.tolist()  # the sequence, whole and in order
        assert int(batch["last_index"][k]) == int(where[-1])  # its last token, found by length
        # eos opens and closes every turn: the first eos after the prompt is not the end
        assert int((flat[where] == tokenizer.eos_id).sum()) > 2
        rows = {int(i) // seq.shape[1] for i in where}
        partner = (seq.view(-1) == (k ^ 1)).nonzero().view(-1)
        assert rows == {int(i) // seq.shape[1] for i in partner}  # both sides of a pair in one row
        assert len({int(d) for d in docs.view(-1)[where]}) == 1
    assert batch["margin"].tolist() == [pairs[int(p)].margin or 0.0 for p in batch["pair_index"]]
    assert ((seq < 0) == (docs < 0)).all()  # padding belongs to no sequence


def test_packed_log_probs_equal_each_sequence_alone_on_both_paths(tokenizer):
    torch.manual_seed(0)
    model = GPT(GPTConfig(flavor="llama", vocab_size=tokenizer.vocab_size, n_layer=2, n_embd=32, n_head=2,
                          n_positions=512)).eval()
    store = render_pairs(tokenizer, [pair(i) for i in range(8)], seq_len=512)
    batch = next(PackedPairs(store, 512, micro_batch_size=4, shuffle=False).iter_eval_batches())
    n = 2 * batch["num_examples"]
    selected = sequence_sums(token_logprobs(model, batch, select=True), batch["sequence_ids"], n)
    masked = sequence_sums(token_logprobs(model, batch, select=False), batch["sequence_ids"], n)
    torch.testing.assert_close(selected, masked, rtol=1e-5, atol=1e-4)
    for k in range(n):
        side = 2 * int(batch["pair_index"][k // 2]) + k % 2
        span = slice(store.offsets[side], store.offsets[side + 1])
        ids, targets = torch.from_numpy(store.inputs[span])[None], torch.from_numpy(store.targets[span])[None]
        logits = model.logits(ids).float().log_softmax(-1)
        scored = targets != IGNORE_INDEX
        alone = logits.gather(-1, targets.clamp(min=0)[..., None])[..., 0][scored].sum()
        torch.testing.assert_close(selected[k], alone, rtol=1e-5, atol=1e-4)


def test_entropy_and_temperature(tokenizer):
    torch.manual_seed(1)
    model = GPT(GPTConfig(flavor="gpt2", vocab_size=tokenizer.vocab_size, n_layer=1, n_embd=32, n_head=2,
                          n_positions=64))
    ids = torch.randint(0, tokenizer.vocab_size, (2, 12))
    labels = ids.roll(-1, 1)
    labels[:, :5] = IGNORE_INDEX
    logp, entropy = token_logprobs(model, {"input_ids": ids, "labels": labels}, with_entropy=True, temperature=0.7)
    dist = torch.distributions.Categorical(logits=model.logits(ids).float() / 0.7)
    scored = labels != IGNORE_INDEX
    torch.testing.assert_close(logp[scored], dist.log_prob(labels.clamp(min=0))[scored], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy[scored], dist.entropy()[scored], rtol=1e-5, atol=1e-5)
    assert (logp[~scored] == 0).all() and (entropy[~scored] == 0).all()
    logp.sum().backward()  # differentiable
    assert model.lm_head.weight.grad is not None


def test_too_long_pairs_are_counted_reference_log_probs_ride_along_and_resume_is_exact(tokenizer):
    pairs = [pair(i) for i in range(20)]
    stats = PairStats()
    full = render_pairs(tokenizer, pairs, seq_len=1024)
    limit = int(np.sort(full.pair_lengths)[10])  # about half the pairs fit
    store = render_pairs(tokenizer, pairs, seq_len=limit, stats=stats)
    assert stats.kept == len(store) == int((full.pair_lengths <= limit).sum()) < 20
    assert stats.skipped[TOO_LONG] == 20 - stats.kept and "raise data.seq_len" in stats.summary(limit)
    store.ref_logps = np.arange(2 * len(store), dtype=np.float32).reshape(-1, 2)
    a = PackedPairs(store, limit, micro_batch_size=1, seed=4)
    for _ in range(3):
        a.next_batch()
    b = PackedPairs(store, limit, micro_batch_size=1, seed=4)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for _ in range(2 * a.rows_per_epoch):  # across epoch boundaries
        x, y = a.next_batch(), b.next_batch()
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["pair_index"], y["pair_index"])
        assert x["ref_logps"].tolist() == [store.ref_logps[int(p)].tolist() for p in x["pair_index"]]
    other = render_pairs(tokenizer, pairs, seq_len=1024)
    with pytest.raises(LMForgeError, match="rows per epoch"):
        PackedPairs(other, 1024, micro_batch_size=1, seed=4).load_state_dict(a.state_dict())
    with pytest.raises(LMForgeError, match="micro_batch_size"):
        PackedPairs(render_pairs(tokenizer, pairs[:2], seq_len=1024), 1024, micro_batch_size=8)


def test_a_row_may_be_longer_than_the_context_when_each_sequence_fits(tokenizer):
    """Both sides of a pair share a row: with rows of twice the context a pair whose sides each fit
    the model is kept, and scores as each side alone would; a side longer than the context is not."""
    pairs = [pair(i) for i in range(6)]
    full = render_pairs(tokenizer, pairs, seq_len=4096)
    n_ctx = int(full.lengths.max())  # every side fits, no pair does: rows must be longer than the context
    assert int(full.pair_lengths.min()) > n_ctx
    stats = PairStats()
    store = render_pairs(tokenizer, pairs, seq_len=2 * n_ctx, stats=stats, max_sequence=n_ctx)
    assert len(store) == 6
    shorter = PairStats()
    assert len(render_pairs(tokenizer, pairs, 2 * n_ctx, shorter, max_sequence=n_ctx - 1)) < 6
    assert "model's context" in shorter.summary(2 * n_ctx)
    torch.manual_seed(2)
    model = GPT(GPTConfig(flavor="llama", vocab_size=tokenizer.vocab_size, n_layer=1, n_embd=32, n_head=2,
                          n_positions=n_ctx)).eval()
    batch = next(PackedPairs(store, 2 * n_ctx, micro_batch_size=1, shuffle=False).iter_eval_batches())
    assert batch["input_ids"].shape[1] > n_ctx
    sums = sequence_sums(token_logprobs(model, batch), batch["sequence_ids"], 2 * batch["num_examples"])
    side = 2 * int(batch["pair_index"][0]) + 1
    span = slice(store.offsets[side], store.offsets[side + 1])
    alone = {"input_ids": torch.from_numpy(store.inputs[span])[None], "labels": torch.from_numpy(store.targets[span])[None]}
    torch.testing.assert_close(sums[1], token_logprobs(model, alone).sum(), rtol=1e-5, atol=1e-4)
    with pytest.raises(LMForgeError, match="n_positions"):
        model.logits(batch["input_ids"])  # without per-document positions a long row is still refused


def test_a_pair_too_long_for_seq_len_is_left_out_without_tokenizing_it(tokenizer):
    """A pair whose text is longer than seq_len tokens can hold (``Tokenizer.max_chars``) is counted as too long
    without being tokenized: a 20 MB reply took 88 s and 4.4 GB to tokenize, only to be skipped."""
    huge = pair(1)
    huge.rejected = {"role": "assistant", "content": "no " * tokenizer.max_chars(1024)}
    seen = []  # the characters the tokenizer is asked to encode, per text

    class Counting:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def encode_batch(self, texts):
            seen.extend(map(len, texts))
            return tokenizer.encode_batch(texts)

        def encode_markup_batch(self, texts):  # what rendering encodes with (chat text as text)
            seen.extend(map(len, texts))
            return tokenizer.encode_markup_batch(texts)

    stats = PairStats()
    store = render_pairs(Counting(), [pair(0), huge, pair(2)], seq_len=1024, stats=stats)
    assert [p.source for p in store.pairs] == ["pairs.jsonl:1", "pairs.jsonl:3"] and seen
    assert max(seen) < 1024
    assert stats.skipped == {TOO_LONG: 1} and stats.untokenized == 1
    assert "1 of them not tokenized: more characters than 1024 tokens can hold" in stats.summary(1024)
