"""The synthetic tool-calling dataset and the tool-call evaluation (lmforge.posttrain.toolcalls)."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch

from lmforge.chat import parse_tool_calls, render_chat
from lmforge.errors import LMForgeError
from lmforge.infer.generate import generate_tokens
from lmforge.models.gpt import GPT, GPTConfig
from lmforge.posttrain.toolcalls import (
    CASES,
    MAX_PROMPT_CHARS,
    SPLITS,
    TOOLS,
    aggregate_scores,
    call_message,
    case_counts,
    case_of,
    evaluate_tool_calls,
    format_tool_call_report,
    generate_greedy,
    json_equal,
    load_rows,
    prompt_ids,
    reference_call,
    reference_text,
    score_reply,
    value_split,
    write_tool_call_dataset,
)
from lmforge.tokenizer import Tokenizer, train_tokenizer

SIZES = {"n_train": 2000, "n_val": 200, "n_test": 300}  # the defaults


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("toolcalls") / "ds"
    write_tool_call_dataset(out, seed=0)
    return out


@pytest.fixture(scope="module")
def rows(dataset) -> dict[str, list[dict]]:
    return {split: load_rows(dataset, split) for split in SPLITS}


def argument_values(rows: list[dict]) -> set[str]:
    """Every split-governed argument value of the rows' calls, as canonical JSON (2 and 2.0 alike);
    enum and boolean arguments are part of the schema and shared."""
    out = set()
    for row in rows:
        for m in row["messages"]:
            for call in m.get("tool_calls") or []:
                name, args = reference_call(call)
                props = TOOLS[name]["function"]["parameters"]["properties"]
                for key, value in args.items():
                    if "enum" in props[key] or isinstance(value, bool):
                        continue
                    out.add(json.dumps(float(value) if isinstance(value, (int, float)) else value))
    return out


# ---- the generator ----------------------------------------------------------------------------------

def test_the_same_seed_writes_the_same_bytes_and_another_seed_other_rows(tmp_path):
    small = {"n_train": 120, "n_val": 30, "n_test": 30}
    write_tool_call_dataset(tmp_path / "a", seed=3, **small)
    write_tool_call_dataset(tmp_path / "b", seed=3, **small)
    write_tool_call_dataset(tmp_path / "c", seed=4, **small)
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == ["meta.json", "test.jsonl", "train.jsonl", "val.jsonl"]
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert (tmp_path / "a" / "train.jsonl").read_bytes() != (tmp_path / "c" / "train.jsonl").read_bytes()
    # The value split does not depend on the seed: a test set of one seed is held out from another's train.
    meta_a, meta_c = (json.loads((tmp_path / d / "meta.json").read_text()) for d in "ac")
    assert meta_a["value_split"] == meta_c["value_split"] == json.loads(json.dumps(value_split()))


def test_a_non_empty_directory_is_replaced_only_when_asked(tmp_path):
    small = {"n_train": 10, "n_val": 5, "n_test": 5}
    write_tool_call_dataset(tmp_path / "ds", seed=0, **small)
    with pytest.raises(LMForgeError, match="not empty.*overwrite=True"):
        write_tool_call_dataset(tmp_path / "ds", seed=1, **small)
    meta = write_tool_call_dataset(tmp_path / "ds", seed=1, overwrite=True, **small)
    assert json.loads((tmp_path / "ds" / "meta.json").read_text())["seed"] == meta["seed"] == 1
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(LMForgeError, match="no meta.json"):
        write_tool_call_dataset(other, overwrite=True, **small)
    assert (other / "notes.txt").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    write_tool_call_dataset(empty, **small)  # an empty directory is fine
    assert len(load_rows(empty, "val")) == 5


def test_each_split_holds_every_case_in_its_share_and_meta_counts_them(dataset, rows):
    meta = json.loads((dataset / "meta.json").read_text())
    assert meta["seed"] == 0 and meta["tools"] == list(TOOLS) and 6 <= len(TOOLS) <= 8
    for split in SPLITS:
        n = SIZES[f"n_{split}"]
        found = {case: 0 for case in CASES}
        for row in rows[split]:
            found[case_of(row)] += 1
        assert found == case_counts(n) == meta["cases"][split]
        assert all(found[case] > 0 for case in CASES)
        assert meta["counts"][split] == len(rows[split]) == n
        assert found["single_call"] == n - round(0.1 * n) - round(0.15 * n) - round(0.2 * n)


def test_rows_offer_two_to_four_tools_with_the_right_one_and_short_prompts(rows):
    seen_counts, optional_seen = set(), set()
    for split in SPLITS:
        for row in rows[split]:
            names = [t["function"]["name"] for t in row["tools"]]
            assert 2 <= len(names) <= 4 and len(set(names)) == len(names)
            assert all(t == TOOLS[t["function"]["name"]] for t in row["tools"])
            seen_counts.add(len(names))
            called = [c for m in row["messages"] for c in m.get("tool_calls") or []]
            if case_of(row) == "no_call":
                assert not called
            else:
                assert len(called) == 1 and reference_call(called[0])[0] in names
                name, args = reference_call(called[0])
                params = TOOLS[name]["function"]["parameters"]
                assert set(params["required"]) <= set(args) <= set(params["properties"])
                optional_seen.update(f"{name}.{k}" for k in set(args) - set(params["required"]))
            prompt = render_chat(row["messages"][:-1], "<s>", "</s>", tools=row["tools"])
            assert len(prompt) <= MAX_PROMPT_CHARS
            for m in row["messages"]:
                if m["role"] == "user":
                    assert len(m["content"].split()) <= 60
    assert seen_counts == {2, 3, 4}
    assert {"get_weather.unit", "search_files.max_results", "set_timer.label", "send_email.body",
            "run_tests.verbose"} <= optional_seen


def test_no_argument_value_of_val_or_test_occurs_in_train(dataset, rows):
    train = argument_values(rows["train"])
    train_text = (dataset / "train.jsonl").read_text(encoding="utf-8")
    for split in ("val", "test"):
        held_out = argument_values(rows[split])
        assert len(held_out) > 20 and any(v[0] != '"' for v in held_out)  # strings and numbers
        assert not held_out & train, sorted(held_out & train)
        # Strings not even inside other text of train rows (as a whole token: "*.c" is not in "*.css").
        strings = sorted(v[1:-1] for v in held_out if v.startswith('"'))
        found = re.findall(r"(?<!\w)(?:" + "|".join(map(re.escape, strings)) + r")(?!\w)", train_text)
        assert len(strings) > 15 and not found, sorted(set(found))
    assert not argument_values(rows["val"]) & argument_values(rows["test"])
    # Nor does a held-out conversation (scored turn aside) repeat a training one.
    train_prompts = {json.dumps(r["messages"][:-1]) for r in rows["train"]}
    assert not any(json.dumps(r["messages"][:-1]) in train_prompts for r in rows["test"] + rows["val"])


def test_rows_render_with_the_chat_template_and_reference_calls_parse_back(rows):
    for split in SPLITS:
        for row in rows[split]:
            reference = row["messages"][-1]
            whole = render_chat(row["messages"], "<s>", "</s>", tools=row["tools"], add_generation_prompt=False)
            prompt = render_chat(row["messages"][:-1], "<s>", "</s>", tools=row["tools"])
            # What training teaches after the prompt is exactly the reference text and eos.
            assert whole == prompt + reference_text(reference) + "</s>\n"
            content, calls = parse_tool_calls(reference_text(reference))
            if reference.get("tool_calls"):
                name, args = reference_call(reference["tool_calls"][0])
                assert [(c.name, json.loads(c.arguments)) for c in calls] == [(name, args)]
                assert content == ""
            else:
                assert calls == [] and content == reference["content"] != ""
            for m in row["messages"]:
                if m["role"] == "tool":
                    json.loads(m["content"])


def test_answers_after_a_tool_result_use_the_result(rows):
    for row in rows["test"]:
        if case_of(row) == "tool_result_answer":
            result, answer = row["messages"][-2]["content"], row["messages"][-1]["content"]
            score = score_reply(answer, row["messages"][-1], result)
            assert score["checked_values"] and score["mentions_result"]


# ---- loading ------------------------------------------------------------------------------------------

def test_load_rows_names_the_file_and_line_of_a_bad_row(tmp_path):
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}], "tools": []}
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(LMForgeError, match=re.escape(f"{path}:2: not valid JSON")):
        load_rows(path)
    path.write_text(json.dumps(good) + "\n\n" + json.dumps({"messages": good["messages"][:1]}) + "\n")
    with pytest.raises(LMForgeError, match=re.escape(f"{path}:3: the last message must be the assistant")):
        load_rows(path)
    bad_call = {"messages": [good["messages"][0], {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]}
    path.write_text(json.dumps(bad_call) + "\n")
    with pytest.raises(LMForgeError, match=re.escape(f"{path}:1: a reference tool call")):
        load_rows(path)
    path.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(LMForgeError, match=re.escape(f"{path}:1: messages[0].role")):
        load_rows(path)
    (tmp_path / "test.jsonl").write_text(json.dumps(good) + "\n")
    assert load_rows(tmp_path) == [good]
    with pytest.raises(LMForgeError, match="val.jsonl does not exist"):
        load_rows(tmp_path, "val")


# ---- scoring --------------------------------------------------------------------------------------------

WEATHER = call_message("get_weather", {"city": "Oslo", "unit": "celsius"})
TIMER = call_message("set_timer", {"minutes": 5})
CONVERT = call_message("convert_currency", {"amount": 2, "from": "USD", "to": "EUR"})
TESTS = call_message("run_tests", {"package": "auth", "verbose": True})
PLAIN = {"role": "assistant", "content": "Hello! How can I help?"}
ANSWER = {"role": "assistant", "content": "It is 14 degrees and cloudy in Oslo."}
RESULT = json.dumps({"temperature": 14, "condition": "cloudy"})


def call(name: str, args: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'


def test_a_right_call_scores_full_marks_whatever_its_key_order_and_number_form():
    s = score_reply(call("get_weather", '{"unit": "celsius", "city": "Oslo"}'), WEATHER)
    assert s["kind"] == "call" and s["name_ok"] and s["args_exact"] and (s["tp"], s["fp"], s["fn"]) == (2, 0, 0)
    assert score_reply(reference_text(WEATHER), WEATHER)["args_exact"]
    assert score_reply(call("convert_currency", '{"amount": 2.0, "from": "USD", "to": "EUR"}'), CONVERT)["args_exact"]
    assert score_reply("Sure. " + call("set_timer", '"{\\"minutes\\": 5}"'), TIMER)["args_exact"]  # args as JSON text


def test_wrong_values_names_and_types_are_counted_pair_by_pair():
    s = score_reply(call("get_weather", '{"city": "Osl", "unit": "celsius", "days": 3}'), WEATHER)
    assert s["name_ok"] and not s["args_exact"] and (s["tp"], s["fp"], s["fn"]) == (1, 2, 1)
    s = score_reply(call("lookup_stock", '{"city": "Oslo", "unit": "celsius"}'), WEATHER)
    assert not s["name_ok"] and not s["args_exact"] and (s["tp"], s["fp"], s["fn"]) == (2, 0, 0)
    s = score_reply(call("run_tests", '{"package": "auth", "verbose": 1}'), TESTS)  # 1 is not true
    assert not s["args_exact"] and (s["tp"], s["fp"], s["fn"]) == (1, 1, 1)
    s = score_reply(call("set_timer", '{"minutes": "5"}'), TIMER)  # "5" is not 5
    assert not s["args_exact"] and s["tp"] == 0
    assert json_equal({"a": [1, 2.0]}, {"a": [1.0, 2]}) and not json_equal(True, 1) and not json_equal(0, False)
    assert not json_equal({"a": 1}, {"a": 1, "b": 2}) and not json_equal([1], [1, 1])


def test_a_missing_or_broken_call_misses_every_reference_pair():
    for reply in ("The weather is nice.", "", '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
                  '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'):  # unclosed
        s = score_reply(reply, WEATHER)
        assert s["calls"] == 0 and not s["name_ok"] and not s["args_exact"]
        assert (s["tp"], s["fp"], s["fn"]) == (0, 0, 2)
        assert s["malformed"] == ("<tool_call>" in reply)
    # Only the first call is scored; a second, broken block makes the reply malformed.
    s = score_reply(call("get_weather", '{"city": "Oslo", "unit": "celsius"}') + "<tool_call>oops</tool_call>", WEATHER)
    assert s["args_exact"] and s["calls"] == 1 and s["markers"] == 2 and s["malformed"]


def test_plain_references_reward_abstaining_with_text():
    s = score_reply("Hi there!", PLAIN)
    assert s["kind"] == "plain" and s["abstained"] and not s["attempted_call"] and not s["malformed"]
    s = score_reply(call("get_weather", '{"city": "Oslo"}'), PLAIN)
    assert s["attempted_call"] and not s["abstained"]
    s = score_reply("<tool_call>{broken", PLAIN)
    assert s["attempted_call"] and not s["abstained"] and s["malformed"]
    s = score_reply("  \n", PLAIN)
    assert not s["attempted_call"] and not s["abstained"]


def test_an_answer_must_carry_the_values_of_the_result_its_reference_carries():
    assert score_reply("Oslo is cloudy at 14 degrees.", ANSWER, RESULT)["mentions_result"]
    assert score_reply("It is 14 degrees and cloudy in Oslo.", ANSWER, RESULT)["checked_values"] == [14, "cloudy"]
    for reply in ("It is 140 degrees and cloudy.", "Cloudy, 14 degrees.", "It is cloudy, 1.14.", "It is 14.5, cloudy",
                  "It is 14 degrees."):
        assert not score_reply(reply, ANSWER, RESULT)["mentions_result"], reply
    # A value the reference does not mention is not asked for; a result that is not JSON checks nothing.
    only_temp = {"role": "assistant", "content": "It is 14 degrees."}
    assert score_reply("14 it is", only_temp, RESULT)["checked_values"] == [14]
    assert score_reply("anything", only_temp, "not json")["mentions_result"] is False


def test_aggregate_scores_counts_each_group_by_its_definition():
    user = {"role": "user", "content": "q"}
    rows = [
        {"messages": [user, WEATHER], "tools": []},
        {"messages": [user, TIMER], "tools": []},
        {"messages": [user, CONVERT], "tools": []},
        {"messages": [user, PLAIN], "tools": []},
        {"messages": [user, PLAIN], "tools": []},
        {"messages": [user, PLAIN], "tools": []},
        {"messages": [user, WEATHER, {"role": "tool", "content": RESULT}, ANSWER], "tools": []},
    ]
    replies = [call("get_weather", '{"city": "Oslo", "unit": "celsius"}'),  # exact: 2 tp
               call("set_timer", '{"minutes": 6, "label": "tea"}'),  # right name, 0 tp, 2 fp, 1 fn
               "<tool_call>{nope</tool_call>",  # no call: 3 fn, malformed
               "Hi!",  # abstains
               call("get_weather", '{"city": "Oslo"}'),  # a false call
               " ",  # neither
               "It is 14 degrees and cloudy."]
    scores = [score_reply(r, row["messages"][-1], RESULT if i == 6 else None)
              for i, (r, row) in enumerate(zip(replies, rows))]
    m = aggregate_scores(rows, scores)
    assert (m["rows"], m["call_rows"], m["no_call_rows"], m["answer_rows"]) == (7, 3, 3, 1)
    assert m["parse_rate"] == pytest.approx(2 / 3) and m["tool_name_acc"] == pytest.approx(2 / 3)
    assert m["exact_args"] == pytest.approx(1 / 3)
    assert m["arg_f1"] == pytest.approx(2 * 2 / (2 * 2 + 2 + 4))  # tp 2, fp 2, fn 1 + 3
    assert m["abstention"] == pytest.approx(1 / 3) and m["false_call_rate"] == pytest.approx(1 / 3)
    assert m["answer_call_rate"] == 0.0 and m["answer_mentions_result"] == 1.0
    assert m["malformed_calls"] == 1
    empty = aggregate_scores(rows[3:4], scores[3:4])
    assert empty["parse_rate"] is None and empty["arg_f1"] is None and empty["abstention"] == 1.0


def test_the_report_has_one_column_per_model():
    a = {"rows": 10, "call_rows": 6, "parse_rate": 0.5, "abstention": None, "replies": ["x"]}
    b = {"rows": 10, "call_rows": 6, "parse_rate": 0.25, "abstention": 1.0}
    lines = format_tool_call_report({"fine-tuned": a, "before fine-tuning": b}).splitlines()
    assert lines[0].split() == ["metric", "fine-tuned", "before", "fine-tuning"]
    body = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    assert body == {"rows": ["10", "10"], "call_rows": ["6", "6"], "parse_rate": ["0.500", "0.250"],
                    "abstention": ["-", "1.000"]}


# ---- generation on a real (tiny, untrained) model ---------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory, rows):
    texts = [render_chat(r["messages"], "<s>", "</s>", tools=r["tools"], add_generation_prompt=False)
             for r in rows["train"][:300]]
    out = tmp_path_factory.mktemp("tok")
    tokenizer = Tokenizer.load(train_tokenizer(texts, vocab_size=512, out_dir=out, show_progress=False))
    torch.manual_seed(0)
    # A large init spreads the logits, so greedy choices are far from ties.
    model = GPT(GPTConfig(flavor="llama", vocab_size=tokenizer.vocab_size, n_layer=2, n_embd=64, n_head=2,
                          n_positions=512, initializer_range=0.3)).eval()
    return model, tokenizer


def test_prompts_are_built_as_the_server_builds_them(tiny, rows):
    from fastapi.testclient import TestClient

    from lmforge.infer.engine import Engine
    from lmforge.serve.app import create_app

    model, tokenizer = tiny
    picked = [next(r for r in rows["test"] if case_of(r) == case) for case in CASES]
    for row in picked:
        ids = prompt_ids(tokenizer, row)
        text = render_chat(row["messages"][:-1], "<s>", "</s>", tools=row["tools"])
        assert ids[0] == tokenizer.eos_id and tokenizer.decode(ids) == "</s>" + text
    engine = Engine(model, eos_id=tokenizer.eos_id, max_batch_size=4)
    try:
        with TestClient(create_app(engine, tokenizer, "tiny")) as client:
            for row in picked:
                body = {"model": "tiny", "messages": row["messages"][:-1], "tools": row["tools"], "max_tokens": 8,
                        "temperature": 0}
                got = client.post("/v1/chat/completions", json=body).json()
                assert got["usage"]["prompt_tokens"] == len(prompt_ids(tokenizer, row))
                reply = tokenizer.decode(generate_greedy(model, [prompt_ids(tokenizer, row)], tokenizer.eos_id, 8)[0])
                assert got["choices"][0]["message"]["content"] == reply
    finally:
        engine.close()


def test_batched_greedy_generation_equals_one_at_a_time_generation(tiny, rows):
    model, tokenizer = tiny
    prompts = [prompt_ids(tokenizer, r) for r in rows["test"][:7]]
    assert len({len(p) for p in prompts}) > 1  # rows of different lengths share the batch
    batched = generate_greedy(model, prompts, tokenizer.eos_id, max_new_tokens=12, batch_size=3)
    for prompt, tokens in zip(prompts, batched):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert tokens == list(generate_tokens(model, prompt, 12, temperature=0, eos_id=tokenizer.eos_id))
    # The model ends a reply at eos too: with eos = the first greedy token, nothing is generated.
    first = generate_greedy(model, prompts[:1], tokenizer.eos_id, 1)[0][0]
    assert generate_greedy(model, prompts[:1], first, 5) == [[]]
    long = [tokenizer.eos_id] * model.config.n_positions
    with pytest.raises(LMForgeError, match="do not fit the model's context of 512"):
        generate_greedy(model, [prompts[0], long], tokenizer.eos_id, 4)


def test_evaluate_scores_the_greedy_replies(tiny, rows):
    model, tokenizer = tiny
    picked = [r for case in CASES for r in [r for r in rows["test"] if case_of(r) == case][:2]]
    model.train()
    result = evaluate_tool_calls(model, tokenizer, picked, max_new_tokens=10, batch_size=3, progress=False)
    assert model.training  # the caller's mode is restored
    want = [tokenizer.decode(t) for t in generate_greedy(model, [prompt_ids(tokenizer, r) for r in picked],
                                                         tokenizer.eos_id, 10)]
    assert result["replies"] == want
    scores = [score_reply(reply, row["messages"][-1],
                          row["messages"][-2]["content"] if row["messages"][-2]["role"] == "tool" else None)
              for reply, row in zip(want, picked)]
    expected = aggregate_scores(picked, scores)
    assert {k: result[k] for k in expected} == expected
    assert (result["call_rows"], result["no_call_rows"], result["answer_rows"]) == (4, 2, 2)
    assert [e["case"] for e in result["examples"]] == list(CASES)
    for e in result["examples"]:
        row = next(r for r in picked if case_of(r) == e["case"])
        assert e["reference"] == reference_text(row["messages"][-1])
        assert e["reply"] == want[picked.index(row)] and e["prompt_tail"].endswith("<s>assistant\n")
