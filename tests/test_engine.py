"""The continuous-batching engine: batched replies equal one-at-a-time generation; seeds, cancel, limits."""

from __future__ import annotations


import queue
import warnings

import pytest
import torch

from lmforge.errors import LMForgeError
from lmforge.infer.engine import Engine, SamplingParams
from lmforge.infer.generate import generate_tokens
from lmforge.models.gpt import GPT, GPTConfig


def make_model(flavor: str) -> GPT:
    torch.manual_seed(0)
    # A large init spreads the logits, so greedy choices are far from ties.
    return GPT(GPTConfig(flavor=flavor, vocab_size=300, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                         n_kv_head=2 if flavor == "llama" else 0, initializer_range=0.3)).eval()


def run_all(engine: Engine, jobs: list[tuple[list[int], SamplingParams]]) -> list[tuple[list[int], str]]:
    """Submit every job at once; returns each one's tokens and finish reason."""
    events: queue.Queue = queue.Queue()
    for i, (ids, params) in enumerate(jobs):
        engine.submit(ids, params, lambda e, i=i: events.put((i, e)))
    tokens: dict[int, list[int]] = {i: [] for i in range(len(jobs))}
    reasons: dict[int, str] = {}
    while len(reasons) < len(jobs):
        i, (kind, value) = events.get(timeout=60)
        if kind == "token":
            tokens[i].append(value)
        else:
            reasons[i] = value
    return [(tokens[i], reasons[i]) for i in range(len(jobs))]


@pytest.mark.parametrize("flavor", ["gpt2", "llama"])
def test_batched_greedy_replies_equal_one_at_a_time_generation(flavor):
    model = make_model(flavor)
    engine = Engine(model, eos_id=2, max_batch_size=3)  # 7 requests: some wait for a free row
    try:
        prompts = [[5, 6, 7], [9] * 10, [11, 12], [13, 14, 15, 16, 17], [20] * 40, [21], [2, 30, 31]]
        results = run_all(engine, [(p, SamplingParams(max_tokens=30, temperature=0)) for p in prompts])
    finally:
        engine.close()
    for prompt, (tokens, reason) in zip(prompts, results):
        with warnings.catch_warnings():  # generate_tokens warns where the context runs out
            warnings.simplefilter("ignore")
            want = list(generate_tokens(model, prompt, 30, temperature=0, eos_id=2))
        assert tokens == want
        full = len(prompt) + len(want) >= model.config.n_positions
        assert reason == ("length" if len(want) == 30 or full else "stop")
    assert any(len(t) < 30 for t, _ in results)  # the 40-token prompt ran into the context's end


def test_a_seeded_request_samples_the_same_alone_or_in_a_batch():
    model = make_model("llama")
    engine = Engine(model, eos_id=-1, max_batch_size=4)
    try:
        seeded = ([5, 6, 7], SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=11))
        alone = run_all(engine, [seeded])[0]
        crowd = run_all(engine, [([8] * 5, SamplingParams(20, temperature=1.0)), seeded,
                                 ([9, 10], SamplingParams(20, temperature=0.7, top_k=5))])[1]
        other_seed = run_all(engine, [([5, 6, 7], SamplingParams(20, temperature=1.0, top_p=0.9, seed=12))])[0]
    finally:
        engine.close()
    assert alone == crowd
    assert alone[0] != other_seed[0]


def test_cancel_ends_one_request_and_the_others_go_on():
    model = make_model("gpt2")
    engine = Engine(model, eos_id=-1, max_batch_size=2)
    events: queue.Queue = queue.Queue()
    try:
        doomed = engine.submit([5, 6], SamplingParams(max_tokens=50, temperature=0), lambda e: events.put(("a", e)))
        engine.submit([7, 8], SamplingParams(max_tokens=10, temperature=0), lambda e: events.put(("b", e)))
        doomed.cancel()
        ends = {}
        while len(ends) < 2:
            who, (kind, value) = events.get(timeout=60)
            if kind != "token":
                ends[who] = value
    finally:
        engine.close()
    assert ends == {"a": "cancelled", "b": "length"}


@pytest.mark.parametrize("call, words", [
    (lambda e: e.submit([], SamplingParams(5), print), "no tokens"),
    (lambda e: e.submit([1] * 64, SamplingParams(5), print), "context is 64"),
    (lambda e: SamplingParams(0), "max_tokens"),
    (lambda e: SamplingParams(5, temperature=-1), "temperature"),
    (lambda e: SamplingParams(5, top_p=0), "top_p"),
])
def test_bad_requests_are_refused_before_they_run(call, words):
    engine = Engine(make_model("gpt2"), eos_id=2, max_batch_size=1)
    try:
        with pytest.raises(LMForgeError, match=words):
            call(engine)
    finally:
        engine.close()


def test_the_loop_can_run_on_the_callers_thread_until_closed():
    model = make_model("llama")
    engine = Engine(model, eos_id=-1, max_batch_size=2, background=False)  # as `lmforge serve` runs it
    out, ends = {0: [], 1: []}, []

    def on_event(i):
        def f(event):
            if event[0] == "token":
                out[i].append(event[1])
            else:
                ends.append(event[1])
                if len(ends) == 2:
                    engine.close()
        return f

    engine.submit([5, 6, 7], SamplingParams(12, temperature=0), on_event(0))
    engine.submit([8], SamplingParams(7, temperature=0), on_event(1))
    engine.run()  # returns once close() is called
    assert out[0] == list(generate_tokens(model, [5, 6, 7], 12, temperature=0, eos_id=-1))
    assert out[1] == list(generate_tokens(model, [8], 7, temperature=0, eos_id=-1))
    assert ends == ["length", "length"]
    with pytest.raises(LMForgeError, match="shut down"):
        engine.submit([1], SamplingParams(1), print)


def test_close_cancels_running_and_waiting_requests_at_the_next_step():
    """close() during a decode step: that step is the last one (counted, not timed), and every request,
    running or waiting, ends as cancelled."""
    model = make_model("gpt2")
    engine = Engine(model, eos_id=-1, max_batch_size=1, background=False)
    real_logits, calls = model.logits, []

    def logits_then_close(*a, **k):
        calls.append(1)
        if len(calls) == 3:  # request 0's third decode step (its prefill is not a logits call); 1 and 2 wait
            engine.close()  # as from another thread: the loop is in the middle of a step
        return real_logits(*a, **k)

    model.logits = logits_then_close
    ends = {}
    for i in range(3):
        engine.submit([5, 6], SamplingParams(max_tokens=50, temperature=0),
                      lambda e, i=i: e[0] == "token" or ends.update({i: e[1]}))
    engine.run()  # returns at the step after close(), not after 150 decode steps
    assert len(calls) == 3
    assert ends == {0: "cancelled", 1: "cancelled", 2: "cancelled"}
    with pytest.raises(LMForgeError, match="shut down"):
        engine.submit([1], SamplingParams(1), print)


def test_samples_of_one_prompt_share_its_prefill_and_sample_as_alone():
    """Several samples of one prompt submitted back to back (GRPO's groups) are prefilled once; each
    still samples exactly what it would alone, with its own seed."""
    model = make_model("llama")
    prompt, other = [5, 6, 7, 8, 9], [9, 8, 7]
    jobs = [(prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=s)) for s in range(4)]
    jobs += [(other, SamplingParams(max_tokens=6, temperature=1.0, seed=9))]
    engine = Engine(model, eos_id=0, max_batch_size=8)
    try:
        together = run_all(engine, jobs)
    finally:
        engine.close()
    assert engine.prefills == 2  # one per distinct prompt
    for job, result in zip(jobs, together):
        alone = Engine(model, eos_id=0, max_batch_size=1)
        try:
            assert run_all(alone, [job]) == [result]
        finally:
            alone.close()
    assert len({tuple(tokens) for tokens, _ in together[:4]}) > 1  # the seeds still differ


def collect(engine: Engine, jobs: list[tuple[list[int], SamplingParams]]) -> list[dict]:
    """Every event of each job, by kind: tokens, logprob events, prompt log-probabilities, the end."""
    events: queue.Queue = queue.Queue()
    for i, (ids, params) in enumerate(jobs):
        engine.submit(ids, params, lambda e, i=i: events.put((i, e)))
    out = [{"token": [], "logprob": [], "prompt_logprobs": None, "done": None} for _ in jobs]
    while any(o["done"] is None for o in out):
        i, (kind, value) = events.get(timeout=60)
        if kind in ("token", "logprob"):
            out[i][kind].append(value)
        else:
            out[i][kind] = value
    return out


def direct_logprobs(model: GPT, ids: list[int]) -> torch.Tensor:
    """``[T, V]`` fp32 log-probabilities of one plain forward over ``ids``: what the engine must report."""
    with torch.no_grad():
        return model.logits(torch.tensor([ids]))[0].float().log_softmax(-1)


@pytest.mark.parametrize("flavor", ["gpt2", "llama"])
def test_reported_logprobs_equal_a_direct_forward_whatever_the_temperature(flavor):
    """Sampled tokens' log-probabilities (and their top n) are the model's own distribution at
    temperature 1, whatever the request samples with; batched with other requests."""
    model = make_model(flavor)
    engine = Engine(model, eos_id=-1, max_batch_size=4)
    try:
        jobs = [([5, 6, 7], SamplingParams(8, temperature=0.7, top_p=0.8, seed=3, top_logprobs=5)),
                ([9, 10], SamplingParams(8, temperature=0, top_logprobs=0)),
                ([11] * 4, SamplingParams(8, temperature=1.3, seed=4))]  # reports nothing
        results = collect(engine, jobs)
    finally:
        engine.close()
    for (prompt, params), got in zip(jobs, results):
        assert got["done"] == "length"
        if params.top_logprobs is None:
            assert got["logprob"] == []
            continue
        assert [r.token for r in got["logprob"]] == got["token"]
        want = direct_logprobs(model, prompt + got["token"])[len(prompt) - 1:-1]
        for step, report in enumerate(got["logprob"]):
            assert report.logprob == pytest.approx(float(want[step, report.token]), abs=1e-4)
            assert len(report.top) == params.top_logprobs
            values, ids = want[step].topk(params.top_logprobs)
            assert [t for t, _ in report.top] == ids.tolist()
            assert [lp for _, lp in report.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_prompt_logprobs_score_every_prompt_token_and_max_tokens_0_generates_nothing():
    model = make_model("llama")
    engine = Engine(model, eos_id=-1, max_batch_size=2)
    prompt = [7, 3, 250, 8, 8, 1, 40]
    try:
        scored, generated, again = collect(engine, [(prompt, SamplingParams(0, prompt_logprobs=3)),
                                                    (prompt, SamplingParams(2, temperature=0, prompt_logprobs=1)),
                                                    (prompt, SamplingParams(0, prompt_logprobs=4))])
    finally:
        engine.close()
    want = direct_logprobs(model, prompt)
    for got, n in ((scored, 3), (generated, 1), (again, 4)):
        first, *rest = got["prompt_logprobs"]
        assert first is None and len(rest) == len(prompt) - 1
        assert [r.token for r in rest] == prompt[1:]
        for pos, r in enumerate(rest):
            assert r.logprob == pytest.approx(float(want[pos, prompt[pos + 1]]), abs=1e-4)
            assert [t for t, _ in r.top] == want[pos].topk(n).indices.tolist()
    assert scored["token"] == [] and scored["done"] == "length"
    assert len(generated["token"]) == 2 and generated["done"] == "length"
    # The second request reused the first's prefill (same prompt, fewer alternatives); the third asks
    # for more alternatives than were kept, so its prompt is scored again.
    assert engine.prefills == 2


@pytest.mark.parametrize("flavor", ["gpt2", "llama"])
def test_prompts_starting_together_share_one_packed_forward_and_score_as_alone(flavor):
    """Six different prompts queued before the engine starts are prefilled in one forward (each
    attending to its own tokens, at its own positions); their prompt log-probabilities equal a
    direct forward and their greedy replies one-at-a-time generation."""
    model = make_model(flavor)
    prompts = [[5, 6, 7], [9] * 10, [11, 12], [13, 14, 15, 16, 17, 18, 19], [21], [40, 41, 42, 43]]
    engine = Engine(model, eos_id=-1, max_batch_size=8, background=False)
    got = {i: {"token": [], "prompt_logprobs": None} for i in range(len(prompts))}
    left = [len(prompts)]

    def on_event(i):
        def f(event):
            kind, value = event
            if kind in ("token", "prompt_logprobs"):
                got[i][kind] = got[i][kind] + [value] if kind == "token" else value
            elif kind == "done":
                left[0] -= 1
                if not left[0]:
                    engine.close()
        return f

    for i, prompt in enumerate(prompts):
        engine.submit(prompt, SamplingParams(6, temperature=0, prompt_logprobs=2), on_event(i))
    engine.run()
    assert engine.prefill_forwards == 1 and engine.prefilled_tokens == sum(map(len, prompts))
    for i, prompt in enumerate(prompts):
        assert got[i]["token"] == list(generate_tokens(model, prompt, 6, temperature=0, stop_at_eos=False))
        want = direct_logprobs(model, prompt)
        first, *rest = got[i]["prompt_logprobs"]
        assert first is None and [r.token for r in rest] == prompt[1:]
        for pos, r in enumerate(rest):
            assert r.logprob == pytest.approx(float(want[pos, prompt[pos + 1]]), abs=1e-4)
            assert [t for t, _ in r.top] == want[pos].topk(2).indices.tolist()


def test_scoring_settings_are_checked():
    with pytest.raises(LMForgeError, match="max_tokens must be >= 1"):
        SamplingParams(0, top_logprobs=2)
    with pytest.raises(LMForgeError, match="top_logprobs must be in 0..20"):
        SamplingParams(3, top_logprobs=21)
    with pytest.raises(LMForgeError, match="prompt_logprobs must be in 0..20"):
        SamplingParams(0, prompt_logprobs=-1)


def test_a_long_prompt_is_prefilled_in_chunks_between_the_decode_steps_of_running_requests():
    """While a 56-token prompt is prefilled 8 tokens a step, the running request keeps getting a token
    every step (counted in events, not timed); both replies equal one-at-a-time generation."""
    model = make_model("gpt2")
    steps, reads = [], []

    def counting_clock() -> float:  # no time at all: each read returns how many reads came before it
        reads.append(len(reads))
        return float(reads[-1])

    engine = Engine(model, eos_id=-1, max_batch_size=2, prefill_chunk=8, background=False, on_step=steps.append,
                    clock=counting_clock)
    order = []

    def on_event(name):
        def f(event):
            if event[0] == "token":
                order.append(name)
            elif name == "long":
                engine.close()
        return f

    engine.submit([5, 6, 7], SamplingParams(40, temperature=0), on_event("short"))
    engine.submit(list(range(10, 66)), SamplingParams(3, temperature=0), on_event("long"))
    engine.run()
    before_long = order.index("long")
    # Step 1 prefills the short prompt (its first token) and the long one's first 5 tokens (the budget
    # is 8), then decodes; steps 2-7 prefill 8 more each and decode; step 8 prefills the last 3 and
    # the long request's first token comes before that step's decode: 1 + 7 short tokens before it.
    assert before_long == 8
    assert engine.prefilled_tokens == 3 + 56
    # The step trace says the same: 8 prompt tokens a step at most, the short row decoded in every step.
    assert [s.prefilled for s in steps[:8]] == [8, 8, 8, 8, 8, 8, 8, 3]
    assert all(s.prefilled == 0 for s in steps[8:]) and sum(s.prefilled for s in steps) == 59
    assert [s.decoded for s in steps[:8]] == [1] * 7 + [2]
    # The clock is read before each step, after its prefill (only when it prefilled) and after its
    # decode: the step's parts are the differences of those reads.
    assert len(reads) == sum(3 if s.prefilled else 2 for s in steps)
    assert [s.start for s in steps[:3]] == [0, 3, 6]
    assert [(s.prefill_seconds, s.decode_seconds) for s in steps] == [(1, 1) if s.prefilled else (0, 1) for s in steps]


def test_prompts_sharing_a_beginning_compute_it_once_and_score_as_alone():
    model = make_model("llama")
    system = list(range(20, 50))  # a shared 30-token "system prompt"
    jobs = [(system + [7, 8], SamplingParams(5, temperature=0, prompt_logprobs=2)),
            (system + [9, 10, 11], SamplingParams(5, temperature=0, prompt_logprobs=2)),
            (system[:12], SamplingParams(0, prompt_logprobs=1))]  # a beginning of a kept prompt
    shared = Engine(model, eos_id=-1, max_batch_size=1)
    alone = Engine(model, eos_id=-1, max_batch_size=1, prefix_cache=0)
    try:
        got = collect(shared, jobs)
        want = collect(alone, jobs)
    finally:
        shared.close()
        alone.close()
    assert alone.prefilled_tokens == 32 + 33 + 12
    # The second recomputes the last shared position (its logits score token 31); the third only its last.
    assert shared.prefilled_tokens == 32 + 4 + 1
    for g, w, (prompt, _) in zip(got, want, jobs):
        assert g["token"] == w["token"] and g["done"] == w["done"]
        lp = direct_logprobs(model, prompt)
        assert g["prompt_logprobs"][0] is None and len(g["prompt_logprobs"]) == len(prompt)
        for pos, r in enumerate(g["prompt_logprobs"][1:]):
            assert r.token == prompt[pos + 1]
            assert r.logprob == pytest.approx(float(lp[pos, prompt[pos + 1]]), abs=1e-4)
