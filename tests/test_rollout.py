"""Rollouts (lmforge.posttrain.rollout): reading prompts, the seeded sampler, the packed layout of
prompt + completion sequences, log-probs read back per sequence, and the objective's pieces."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from lmforge.errors import LMForgeError
from lmforge.infer.loading import load_for_inference
from lmforge.models.losses import IGNORE_INDEX
from lmforge.posttrain.logprobs import token_logprobs
from lmforge.posttrain.rollout import (
    PromptOrder,
    clipped_surrogate,
    completion_seed,
    encode_prompt,
    group_advantages,
    k3_kl,
    loss_weights,
    pack_sequences,
    per_sequence,
    read_prompt_rows,
    read_prompt_splits,
    row_length,
    sample,
    sequence_logprobs,
)
from lmforge.posttrain.toolcalls import generate_greedy, prompt_ids


@pytest.fixture(scope="module")
def policy(tool_sft):
    model, tokenizer, _ = load_for_inference(tool_sft.checkpoint, device="cpu")
    rows = read_prompt_rows(tool_sft.data / "val.jsonl")
    return model, tokenizer, rows


def test_prompt_rows_are_the_conversation_before_the_reference(policy, tool_sft, tmp_path):
    _, tokenizer, rows = policy
    # a tool-calling row prompts exactly as the server does for its last turn (and as sft's eval does)
    assert all(encode_prompt(tokenizer, row) == prompt_ids(tokenizer, row) for row in rows[:10])
    # a row that does not end with an assistant turn is all prompt
    open_row = {"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}
    text = tokenizer.apply_chat_template(open_row["messages"])
    assert encode_prompt(tokenizer, open_row) == [tokenizer.eos_id, *tokenizer.encode(text)]
    # a file is split by val_fraction; a directory by its files
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({**open_row, "answer": str(i)}) + "\n" for i in range(50)))
    train, val = read_prompt_splits(path, 0.2, seed=0)
    assert len(train) + len(val) == 50 and 3 <= len(val) <= 20
    train, val = read_prompt_splits(tool_sft.data, 0.2, seed=0)
    assert (len(train), len(val)) == (400, 40)
    for bad, message in (('{"messages": "hi"}', "a 'messages' list"),
                         ('{"messages": [{"role": "assistant", "content": "x"}]}', "user or tool message"),
                         ("{not json", "not valid JSON")):
        path.write_text(json.dumps(open_row) + "\n" + bad + "\n")
        with pytest.raises(LMForgeError, match=f"rows.jsonl:2: .*{message}"):
            read_prompt_rows(path)


def test_prompt_rows_are_checked_as_the_sft_reader_checks_conversations(tmp_path):
    from lmforge.posttrain.toolcalls import load_rows

    good = {"messages": [{"role": "user", "content": "café?"}], "answer": "4"}
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(good).encode() + b"\n")  # a BOM is skipped, as in sft files
    assert read_prompt_rows(path) == [good]
    # tools come out as the sft reader writes them (a bare function definition is an OpenAI tool spec)
    path.write_text(json.dumps({**good, "tools": [{"name": "f", "parameters": {"type": "object"}}]}) + "\n")
    [row] = read_prompt_rows(path)
    assert row["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    user = {"role": "user", "content": "hi"}
    for bad, message in ((b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "not valid JSON"),  # Latin-1
                         (b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "not valid JSON"),
                         ({**good, "tools": [5]}, "tools[0] is a int, not a tool spec"),
                         ({**good, "tools": [{"type": "function", "function": {"description": "x"}}]},
                          "tools[0] has no function name"),
                         ({"messages": [user, {"role": "assistant", "content": "", "tool_calls": 5}, user]},
                          "messages[1].tool_calls must be a list of"),
                         ({"messages": [user, {"role": "assistant", "tool_calls": [
                             {"type": "function", "function": {"name": "f", "arguments": '{"a": NaN}'}}]}, user]},
                          "messages[1].tool_calls[0] (f): the arguments cannot be written as JSON")):
        line = bad if isinstance(bad, bytes) else json.dumps(bad).encode()
        path.write_bytes(json.dumps(good).encode() + b"\n" + line)
        with pytest.raises(LMForgeError, match=f"rows.jsonl:2: .*{re.escape(message)}"):
            read_prompt_rows(path)
    # a scored row's reference calls that are not a list are refused like any other bad reference call
    path.write_text(json.dumps({"messages": [user, {"role": "assistant", "content": "", "tool_calls": 5}]}) + "\n")
    with pytest.raises(LMForgeError, match=r"rows.jsonl:1: messages\[1\].tool_calls must be a list of"):
        load_rows(path)


def test_sampler_is_reproducible_by_seed_whatever_the_batch(policy):
    model, tokenizer, rows = policy
    prompts = [encode_prompt(tokenizer, row) for row in rows[:6] for _ in range(2)]  # two completions each
    seeds = [completion_seed(7, 0, 0, j) for j in range(len(prompts))]
    assert len(set(seeds)) == len(seeds)
    first = sample(model, prompts, tokenizer.eos_id, 24, temperature=1.0, seeds=seeds, batch_size=12)
    again = sample(model, prompts, tokenizer.eos_id, 24, temperature=1.0, seeds=seeds, batch_size=12)
    assert [c.tokens for c in first] == [c.tokens for c in again]
    # a completion's randomness is its own: alone, or beside other prompts in a smaller batch, the same
    part = sample(model, prompts[3:8], tokenizer.eos_id, 24, temperature=1.0, seeds=seeds[3:8], batch_size=2)
    assert [c.tokens for c in part] == [c.tokens for c in first[3:8]]
    # the two completions of one prompt differ (their seeds do), and other seeds give other completions
    assert any(first[2 * i].tokens != first[2 * i + 1].tokens for i in range(6))
    other = sample(model, prompts, tokenizer.eos_id, 24, temperature=1.0,
                   seeds=[completion_seed(8, 0, 0, j) for j in range(len(prompts))], batch_size=12)
    assert [c.tokens for c in other] != [c.tokens for c in first]
    # ended: stopped at eos (never delivered) with room left; else exactly max_new_tokens were written
    for c in first:
        assert tokenizer.eos_id not in c.tokens
        assert len(c.tokens) < 24 if c.ended else len(c.tokens) == 24
    assert any(c.ended for c in first)
    # temperature 0 is greedy decoding, as the evaluation runs it
    greedy = sample(model, prompts[:4], tokenizer.eos_id, 16, temperature=0)
    assert [c.tokens for c in greedy] == generate_greedy(model, prompts[:4], tokenizer.eos_id, 16)
    with pytest.raises(LMForgeError, match="one seed per prompt"):
        sample(model, prompts, tokenizer.eos_id, 4, seeds=seeds[:2])


def test_the_sampler_cache_holds_the_rollout_not_the_whole_context(policy, monkeypatch):
    """The KV cache a rollout decodes into is as long as its longest prompt + max_new_tokens (+ 2) and
    has a row per prompt when there are fewer than batch_size: what it samples, and the log-probs it
    keeps, are those of a cache as long as the model's context."""
    from lmforge.models.gpt import GPT

    model, tokenizer, rows = policy
    prompts = [encode_prompt(tokenizer, row) for row in rows[:3]]
    seeds = [completion_seed(3, 0, 0, j) for j in range(len(prompts))]
    made, real = [], GPT.new_batched_kv_cache

    def recording(self, capacity, max_len=None):
        cache = real(self, capacity, max_len)
        made.append(tuple(cache.k[0].shape))
        return cache

    monkeypatch.setattr(GPT, "new_batched_kv_cache", recording)
    small = sample(model, prompts, tokenizer.eos_id, 12, temperature=1.0, seeds=seeds, batch_size=64, logprobs=True)
    longest = max(len(p) for p in prompts)
    assert made[-1][0] == 3 and made[-1][2] == longest + 12 + 2 < model.config.n_positions
    monkeypatch.setattr(GPT, "new_batched_kv_cache", lambda self, capacity, max_len=None: real(self, 64))
    whole = sample(model, prompts, tokenizer.eos_id, 12, temperature=1.0, seeds=seeds, batch_size=64, logprobs=True)
    assert [c.tokens for c in small] == [c.tokens for c in whole]
    assert [c.ended for c in small] == [c.ended for c in whole]
    for a, b in zip(small, whole):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_pack_sequences_lays_out_completions_as_targets():
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    completions = [[10, 11], [12, 13, 14], [15]]
    values = {"v": [np.array([0.1, 0.2], np.float32), np.array([0.3, 0.4, 0.5], np.float32),
                    np.array([0.6], np.float32)]}
    batch = pack_sequences(prompts, completions, seq_len=8, values=values)
    ids, labels, seq = batch["input_ids"], batch["labels"], batch["sequence_ids"]
    assert batch["num_examples"] == 3 and ids.shape[1] == 8
    for i, (p, c) in enumerate(zip(prompts, completions)):
        where = (seq == i).nonzero()
        r, cols = int(where[0, 0]), where[:, 1]
        assert (where[:, 0] == r).all()
        assert ids[r, cols].tolist() == (p + c)[:-1]  # the last id is only a target
        assert batch["position_ids"][r, cols].tolist() == list(range(len(p) + len(c) - 1))
        assert labels[r, cols].tolist() == [IGNORE_INDEX] * (len(p) - 1) + c
        assert batch["v"][r, cols].tolist() == pytest.approx([0.0] * (len(p) - 1) + values["v"][i].tolist())
        assert int(batch["last_index"][i]) == r * ids.shape[1] + int(cols[-1])
        assert len(set(batch["document_ids"][r, cols].tolist())) == 1
    assert (labels[batch["document_ids"] < 0] == IGNORE_INDEX).all()
    # a reward model reads every id, the closing one included, at last_index
    whole = pack_sequences(prompts, completions, seq_len=8, with_last_token=True)
    flat = whole["input_ids"].reshape(-1)
    assert [int(flat[i]) for i in whole["last_index"]] == [11, 14, 15]
    with pytest.raises(LMForgeError, match="take 4 positions, more than the rows' 3"):
        pack_sequences(prompts, completions, seq_len=3)


def test_sequence_logprobs_equal_each_sequence_scored_alone(policy):
    model, tokenizer, rows = policy
    prompts = [encode_prompt(tokenizer, row) for row in rows[:5]]
    done = sample(model, prompts, tokenizer.eos_id, 12, temperature=1.0,
                  seeds=[completion_seed(1, j) for j in range(5)])
    completions = [c.tokens + [tokenizer.eos_id] if c.ended else c.tokens for c in done]
    batch = pack_sequences(prompts, completions, seq_len=512)
    assert batch["input_ids"].shape[0] < 5  # packed: several sequences share a row
    packed = sequence_logprobs(model, batch, temperature=0.7)
    for p, c, got in zip(prompts, completions, packed):
        ids = torch.tensor([p + c])
        alone = {"input_ids": ids[:, :-1], "labels": torch.tensor([[IGNORE_INDEX] * (len(p) - 1) + c])}
        with torch.no_grad():
            want = token_logprobs(model, alone, temperature=0.7)[0, len(p) - 1:]
        assert got.shape == (len(c),)
        assert got == pytest.approx(want.numpy(), abs=1e-5)
        assert (got < 0).all()


def test_sampler_keeps_the_logprobs_of_what_it_drew(policy):
    """sample(logprobs=True): each completion's ids (its closing eos included) with their log-probs under
    the sampling temperature, as a forward over prompt + completion gives them (the old log-probs PPO and
    GRPO compare with); at temperature 0 under the plain distribution."""
    model, tokenizer, rows = policy
    prompts = [encode_prompt(tokenizer, row) for row in rows[:6]]
    for temperature in (0.7, 0.0):
        done = sample(model, prompts, tokenizer.eos_id, 12, temperature=temperature, top_k=5 if temperature else 0,
                      seeds=[completion_seed(3, j) for j in range(6)], logprobs=True)
        completions = [c.tokens + [tokenizer.eos_id] if c.ended else c.tokens for c in done]
        assert any(c.ended for c in done) and not all(c.ended for c in done)  # both kinds of ending
        want = sequence_logprobs(model, pack_sequences(prompts, completions, 512), temperature=temperature or 1.0)
        for c, ids, w in zip(done, completions, want):
            assert len(c.logprobs) == len(ids)
            assert c.logprobs == pytest.approx(w.tolist(), abs=1e-4)
    assert all(c.logprobs is None for c in sample(model, prompts[:2], tokenizer.eos_id, 4, temperature=0.7))


def test_rows_on_cpus_hold_a_whole_micro_batch(policy):
    """row_length: on CPUs a micro-batch packs into one row (no padding between rows), with the same
    log-probs as rows of seq_len; elsewhere rows stay seq_len long."""
    model, tokenizer, rows = policy
    prompts = [encode_prompt(tokenizer, row) for row in rows[:4]]
    completions = [p[-3:] for p in prompts]
    seq_len = max(len(p) + 2 for p in prompts)  # one sequence per row
    assert row_length(seq_len, "cpu") > 100 * seq_len and row_length(seq_len, torch.device("cuda")) == seq_len
    short = pack_sequences(prompts, completions, seq_len)
    one = pack_sequences(prompts, completions, seq_len, row_len=row_length(seq_len, "cpu"))
    assert short["input_ids"].shape[0] == 4 and one["input_ids"].shape[0] == 1
    assert int((one["document_ids"] < 0).sum()) < 16  # padding only to round the row's width
    assert int(one["position_ids"].max()) < seq_len  # each sequence keeps its own positions
    for a, b in zip(sequence_logprobs(model, one), sequence_logprobs(model, short)):
        assert a == pytest.approx(b, abs=1e-5)


def test_completions_of_one_prompt_share_it_with_the_same_logprobs_and_gradients(policy):
    """share_prompts (GRPO's groups): one copy of each prompt per row; every completion's log-probs and
    the gradients equal the one-copy-per-completion layout, and a group too long for a row splits."""
    model, tokenizer, rows = policy
    heads = [encode_prompt(tokenizer, row) for row in rows[:2]]
    prompts = [heads[0]] * 4 + [heads[1]] * 3 + [heads[0]]  # the last one joins its group
    done = sample(model, prompts, tokenizer.eos_id, 10, temperature=1.0,
                  seeds=[completion_seed(2, j) for j in range(len(prompts))])
    completions = [c.tokens + [tokenizer.eos_id] if c.ended else c.tokens for c in done]
    values = {"v": [np.arange(len(c), dtype=np.float32) + i for i, c in enumerate(completions)]}
    seq_len = 512
    plain = pack_sequences(prompts, completions, seq_len, values=values)
    shared = pack_sequences(prompts, completions, seq_len, values=values, share_prompts=True)
    real = {name: int((b["document_ids"] >= 0).sum()) for name, b in (("plain", plain), ("shared", shared))}
    own = sum(1 + len(c) - 1 for c in completions)
    assert real["plain"] == sum(len(p) + len(c) - 1 for p, c in zip(prompts, completions))
    assert real["shared"] == len(heads[0]) - 1 + len(heads[1]) - 1 + own  # one copy of each prompt
    assert (shared["labels"] != IGNORE_INDEX).sum() == (plain["labels"] != IGNORE_INDEX).sum()
    flat_ids = shared["input_ids"].reshape(-1)
    for i, (p, c) in enumerate(zip(prompts, completions)):  # the last input of each sequence
        assert int(flat_ids[shared["last_index"][i]]) == (p + c)[-2]
    model.train()
    grads, logps = {}, {}
    for name, batch in (("plain", plain), ("shared", shared)):
        model.zero_grad(set_to_none=True)
        logp = token_logprobs(model, batch, temperature=0.7)
        (logp * batch["v"]).sum().backward()
        logps[name] = per_sequence(logp, batch)
        grads[name] = {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}
    model.eval()
    for a, b in zip(logps["plain"], logps["shared"]):
        assert b == pytest.approx(a, abs=1e-5)
    assert grads["plain"].keys() == grads["shared"].keys()
    for n, g in grads["plain"].items():
        # sums over hundreds of tokens in another order: equal to fp32 rounding of the largest entry
        torch.testing.assert_close(grads["shared"][n], g, rtol=1e-4, atol=2e-6 * float(g.abs().max()), msg=n)
    # rows too short for a whole group: it splits, each part with its own copy of the prompt
    tails = [heads[1][j:j + 6] for j in range(4)]
    tight = pack_sequences([heads[0]] * 4, tails, len(heads[0]) - 1 + 2 * 6, share_prompts=True)
    prefixed = tight["prefix_ids"] >= 0
    assert len({(r, int(tight["prefix_ids"][r, t])) for r, t in prefixed.nonzero().tolist()}) == 2
    loose = pack_sequences([heads[0]] * 4, tails, seq_len)
    for a, b in zip(sequence_logprobs(model, tight), sequence_logprobs(model, loose)):
        assert a == pytest.approx(b, abs=1e-5)


def test_prompt_order_resumes_exactly_and_shards_ranks():
    a = PromptOrder(10, seed=3)
    first = a.take(4) + a.take(4)
    state = json.loads(json.dumps(a.state_dict()))
    later = a.take(7)  # crosses into the second epoch
    assert sorted(first + later[:2]) == list(range(10))
    b = PromptOrder(10, seed=3)
    b.load_state_dict(state)
    assert b.take(7) == later
    ranks = [PromptOrder(11, seed=3, rank=r, world_size=2).take(5) for r in (0, 1)]
    assert not set(ranks[0]) & set(ranks[1])
    with pytest.raises(LMForgeError, match="drawing from 10 prompts"):
        PromptOrder(12, seed=3).load_state_dict(state)
    with pytest.raises(LMForgeError, match="1 prompts for 2 processes"):
        PromptOrder(1, seed=0, world_size=2)


def test_advantages_weights_and_objective_pieces_by_hand():
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 0.2, 0.2, 0.2, 0.2])
    adv = group_advantages(rewards, 4)
    assert adv[:4] == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-3)  # mean 0.5, population std 0.5
    assert adv[4:].tolist() == [0.0] * 4  # a group that agrees teaches nothing, whatever the other groups got
    assert group_advantages(rewards, 4, scale=False)[:4] == pytest.approx([0.5, -0.5, -0.5, 0.5])
    # per-token weights: the weighted sums are the means each aggregation names
    lengths = [2, 6]
    losses = [np.array([1.0, 3.0]), np.full(6, 2.0)]

    def weighted(aggregation):
        w = loss_weights(lengths, aggregation, max_new_tokens=8)
        return sum(float(wi * li.sum()) for wi, li in zip(w, losses))

    assert weighted("token") == pytest.approx((1 + 3 + 12) / 8)
    assert weighted("sequence") == pytest.approx((2.0 + 2.0) / 2)
    assert weighted("fixed") == pytest.approx(16 / (2 * 8))
    with pytest.raises(LMForgeError, match="loss aggregation"):
        loss_weights(lengths, "mean", 8)
    # clipping: A > 0 stops at 1 + eps_high, A < 0 at 1 - eps_low; inside, the plain ratio
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.5]))
    a = torch.tensor([1.0, -1.0, 2.0, 1.0])
    loss, clipped = clipped_surrogate(logp, old, a, eps_low=0.2, eps_high=0.3)
    assert loss.tolist() == pytest.approx([-1.3, 0.8, -2.2, -0.5])
    assert clipped.tolist() == [True, True, False, False]
    # k3: zero where the models agree, positive elsewhere, exp(r) - r - 1
    ref = torch.log(torch.tensor([1.0, 0.25]))
    mine = torch.log(torch.tensor([1.0, 0.5]))
    assert k3_kl(mine, ref).tolist() == pytest.approx([0.0, 0.5 - np.log(0.5) - 1])
