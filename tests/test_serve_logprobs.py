"""Log-probabilities through `lmforge serve` (official `openai` client, real server on loopback): equal
to a direct fp32 forward of the same checkpoint, in OpenAI's completion and chat formats, streamed
and not, with echo and with max_tokens 0."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest
import torch

from lmforge.infer.loading import load_for_inference
from lmforge.serve.logprobs import token_string

from .serve_helpers import GREETING, HELLO, Server, train_chat_model

HANG = 120  # seconds: only a guard against a hang on a busy machine


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return train_chat_model(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def server(checkpoint):
    s = Server(checkpoint, "--max-batch-size", "4")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=HANG)


@pytest.fixture(scope="module")
def local(checkpoint):
    model, tokenizer, _ = load_for_inference(checkpoint, precision="fp32")

    def logprobs(ids: list[int]) -> torch.Tensor:
        """``[T, V]``: the log-probabilities of the token after each position of ``ids``."""
        with torch.no_grad():
            return model.logits(torch.tensor([ids]))[0].float().log_softmax(-1)

    return logprobs, tokenizer


def check_scores(lp: torch.Tensor, ids: list[int], token_logprobs: list, tops: list, n: int) -> None:
    """``token_logprobs[i]`` is ``ids[i]``'s log-probability after ``ids[:i]``; ``tops[i]`` its n best."""
    assert token_logprobs[0] is None and tops[0] is None
    for i in range(1, len(ids)):
        assert token_logprobs[i] == pytest.approx(float(lp[i - 1, ids[i]]), abs=1e-4)
        best = lp[i - 1].topk(n).values.tolist()
        values = sorted(tops[i].values(), reverse=True)
        assert len(tops[i]) in (n, n + 1)  # the sampled token is always there: n or n + 1 entries
        assert values[:n] == pytest.approx(best, abs=1e-4) or token_logprobs[i] in values


def test_echo_with_logprobs_scores_the_prompt_and_the_reply_like_a_direct_forward(client, local):
    """The request lm-evaluation-harness sends for log-likelihoods: token ids, echo, logprobs 1."""
    logprobs, tok = local
    prompt = [tok.eos_id, *tok.encode("package main\n\nfunc main() {")]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0.9, seed=1,
                                  echo=True, logprobs=3)
    choice = r.choices[0]
    got = choice.logprobs
    generated = len(got.tokens) - len(prompt)
    assert generated == r.usage.completion_tokens >= 1
    # The sampled tokens' ids, from their strings (re-encoding the text could merge them differently).
    by_string = {}
    for i in range(tok.vocab_size):
        by_string.setdefault(token_string(tok, i), []).append(i)
    assert all(len(by_string[t]) == 1 for t in got.tokens[len(prompt):])
    ids = [*prompt, *(by_string[t][0] for t in got.tokens[len(prompt):])]
    # Reported at temperature 1 whatever the request sampled at.
    check_scores(logprobs(ids), ids, got.token_logprobs, got.top_logprobs, 3)
    assert choice.text.startswith(tok.decode(prompt))
    for token, offset in zip(got.tokens, got.text_offset):
        assert choice.text[offset:offset + len(token)] == token


def test_max_tokens_0_scores_a_text_prompt_after_the_document_separator(client, local):
    logprobs, tok = local
    text = "Say hello, open main.go"
    r = client.completions.create(model="tiny", prompt=text, max_tokens=0, echo=True, logprobs=2)
    choice = r.choices[0]
    assert choice.text == text and choice.finish_reason == "length" and r.usage.completion_tokens == 0
    ids = [tok.eos_id, *tok.encode(text)]
    assert choice.logprobs.tokens[0] == "</s>" and choice.logprobs.text_offset[:2] == [0, 0]
    check_scores(logprobs(ids), ids, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs, 2)
    assert "".join(choice.logprobs.tokens[1:]) == text
    # Without logprobs, max_tokens 0 with echo is the prompt back and nothing else.
    plain = client.completions.create(model="tiny", prompt=text, max_tokens=0, echo=True)
    assert plain.choices[0].text == text and plain.choices[0].logprobs is None


def test_streamed_logprobs_equal_the_whole_reply(client):
    kwargs = {"model": "tiny", "prompt": "The quick brown", "max_tokens": 12, "temperature": 0, "logprobs": 2,
              "echo": True}
    whole = client.completions.create(**kwargs).choices[0]
    tokens, values, offsets, text = [], [], [], ""
    for chunk in client.completions.create(stream=True, **kwargs):
        c = chunk.choices[0]
        text += c.text
        if c.logprobs is not None:
            tokens += c.logprobs.tokens
            values += c.logprobs.token_logprobs
            offsets += c.logprobs.text_offset
    assert text == whole.text
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert values == pytest.approx(whole.logprobs.token_logprobs, abs=1e-6)


def test_a_stop_string_cuts_the_tokens_too(client):
    whole = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=20, temperature=0,
                                      logprobs=0).choices[0]
    assert len(whole.logprobs.tokens) == 20
    stop = whole.text[6:9]
    cut = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=20, temperature=0,
                                    logprobs=0, stop=stop).choices[0]
    assert cut.finish_reason == "stop" and not cut.text.endswith(stop)
    assert all(offset < len(cut.text) for offset in cut.logprobs.text_offset)
    assert cut.logprobs.tokens == whole.logprobs.tokens[:len(cut.logprobs.tokens)]
    assert all(top == {} or len(top) == 1 for top in cut.logprobs.top_logprobs)  # logprobs 0: only the sampled


def test_chat_logprobs_in_the_chat_format(client, local):
    logprobs, tok = local
    r = client.chat.completions.create(model="tiny", messages=GREETING, temperature=0, logprobs=True, top_logprobs=4)
    choice = r.choices[0]
    assert choice.message.content == HELLO
    content = choice.logprobs.content
    assert bytes(b for item in content for b in item.bytes).decode() == HELLO  # é spans tokens: bytes join up
    prompt = [tok.eos_id, *tok.encode(tok.apply_chat_template(GREETING))]
    reply = tok.encode(HELLO)
    lp = logprobs(prompt + reply)
    for i, item in enumerate(content):
        assert item.logprob == pytest.approx(float(lp[len(prompt) - 1 + i, reply[i]]), abs=1e-4)
        assert len(item.top_logprobs) == 4
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(
            lp[len(prompt) - 1 + i].topk(4).values.tolist(), abs=1e-4)
    streamed = [c.choices[0].logprobs for c in client.chat.completions.create(
        model="tiny", messages=GREETING, temperature=0, logprobs=True, stream=True) if c.choices[0].logprobs]
    items = [item for part in streamed for item in part.content]
    assert [i.token for i in items] == [i.token for i in content]
    assert all(i.top_logprobs == [] for i in items)  # top_logprobs defaults to 0
    plain = client.chat.completions.create(model="tiny", messages=GREETING, temperature=0)
    assert plain.choices[0].logprobs is None


def test_scoring_requests_batched_together_equal_each_alone(server, client, local):
    """lm-evaluation-harness sends many scoring requests at once: batched in the engine, each must get
    what it gets alone."""
    _, tok = local
    texts = ["package main", "The quick brown fox", "open main.go, read a file", "Say hello"] * 2

    def score(text: str) -> list[float]:
        r = client.completions.create(model="tiny", prompt=text, max_tokens=3, temperature=0, echo=True,
                                      logprobs=1)
        return r.choices[0].logprobs.token_logprobs

    alone = [score(t) for t in texts[:4]]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(score, texts))
    for a, b in zip(alone * 2, together):
        assert a[0] is None and b[0] is None
        assert b[1:] == pytest.approx(a[1:], abs=1e-4)
    assert httpx.get(server.base + "/health", timeout=HANG).json()["running"] == 0


def test_a_prompt_that_fills_the_context_can_be_scored_not_continued(client, local):
    _, tok = local
    n_ctx = client.models.retrieve("tiny").model_extra["context_length"]
    prompt = [5] * n_ctx
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert len(r.choices[0].logprobs.token_logprobs) == n_ctx
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=1, echo=True, logprobs=0)
