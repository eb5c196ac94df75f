"""Preference pairs (``lmforge.posttrain.preferences``): rows written by hand in each published layout
(plain strings, UltraFeedback-binarized and TRL's conversational message lists, Anthropic hh-rlhf)
in every container (.jsonl, .json, .parquet, ``datasets`` directories) become the same pairs, with
tool calls normalised exactly as the sft reader normalises them; bad rows name their file and line.
The generated tool-calling pairs (``lmforge data preferences``) hold every kind of rejected reply,
each what its kind says, read through the server's parser and the tool-call scorer."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.chat import parse_tool_calls, render_chat
from lmforge.errors import LMForgeError
from lmforge.posttrain.formats import ReadStats, RowError, conversation_from_row
from lmforge.posttrain.preferences import (
    CASE_KINDS,
    KINDS,
    PreferencePair,
    make_preference_pairs,
    preference_from_row,
    read_preference_splits,
    read_preferences,
    write_preference_dataset,
)
from lmforge.posttrain.toolcalls import (
    TOOLS,
    make_rows,
    reference_call,
    reference_text,
    score_reply,
    value_split,
)

# ----- rows in each layout, and the pairs they must become

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                                 "parameters": {"type": "object", "properties": {
                                                     "city": {"type": "string"},
                                                     "unit": {"type": "string", "enum": ["c", "f"]}},
                                                     "required": ["city"]}}}
# A Hermes call block with a Python dict literal, as real tool-calling data writes them.
HERMES_CALL = "<tool_call>\n{'name': 'get_weather', 'arguments': {'city': 'Zürich', 'unit': 'c'}}\n</tool_call>"
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich", "unit": "c"}'}}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str, calls: list | None = None) -> dict:
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


PLAIN_ROW = {"prompt": "Weather in Zürich, in celsius?", "chosen": HERMES_CALL, "rejected": "It is sunny in Zürich.",
             "tools": [WEATHER_TOOL], "margin": 2, "kind": "missed_call"}
PLAIN_WANT = PreferencePair([user("Weather in Zürich, in celsius?")], assistant("", [CALL]),
                            assistant("It is sunny in Zürich."), [WEATHER_TOOL], 2.0, "missed_call")

# HuggingFaceH4/ultrafeedback_binarized: the prompt as text, each side the whole conversation.
ULTRAFEEDBACK_ROW = {
    "prompt": "Name a prime number.", "prompt_id": "9f2c",
    "chosen": [user("Name a prime number."), assistant("7 is prime.")],
    "rejected": [user("Name a prime number."), assistant("9 is prime.")],
    "messages": [user("Name a prime number."), assistant("7 is prime.")],
    "score_chosen": 9.0, "score_rejected": 2.5,
}
ULTRAFEEDBACK_WANT = PreferencePair([user("Name a prime number.")], assistant("7 is prime."), assistant("9 is prime."))

# TRL's conversational layout: the prompt as messages, each side only the reply; an OpenAI call with
# compact, escaped JSON arguments and tools as a JSON string.
TRL_ROW = {
    "prompt": [{"role": "system", "content": "You are terse."}, user("Weather in Zürich?")],
    "chosen": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Z\\u00fcrich",  "unit":"c"}'}}]}],
    "rejected": [assistant("Which city do you mean?")],
    "tools": json.dumps([WEATHER_TOOL]),
}
TRL_WANT = PreferencePair([{"role": "system", "content": "You are terse."}, user("Weather in Zürich?")],
                          assistant("", [{**CALL, "id": "call_1"}]), assistant("Which city do you mean?"),
                          [WEATHER_TOOL])

# No prompt: the sides share everything before their last message (here a call and its result).
SHARED = [user("Weather in Zürich?"), assistant("", [CALL]),
          {"role": "tool", "name": "get_weather", "content": '{"temp_c": 21}'}]
NO_PROMPT_ROW = {"chosen": SHARED + [assistant("21 °C in Zürich.")],
                 "rejected": SHARED + [assistant("It is warm somewhere.")], "margin": 0.5}
NO_PROMPT_WANT = PreferencePair(SHARED, assistant("21 °C in Zürich."), assistant("It is warm somewhere."), margin=0.5)

# Anthropic/hh-rlhf: two transcripts that differ only in their final Assistant turn.
HH_PREFIX = ("\n\nHuman: What is a good name for a cat?\n\nAssistant: How about Miso?\n\n"
             "Human: Another one,\nplease.")
HH_ROW = {"chosen": HH_PREFIX + "\n\nAssistant: Pepper is a nice one.",
          "rejected": HH_PREFIX + "\n\nAssistant: Cats do not need names."}
HH_WANT = PreferencePair([user("What is a good name for a cat?"), assistant("How about Miso?"),
                          user("Another one,\nplease.")], assistant("Pepper is a nice one."),
                         assistant("Cats do not need names."))

LAYOUTS = {"plain": (PLAIN_ROW, PLAIN_WANT), "ultrafeedback": (ULTRAFEEDBACK_ROW, ULTRAFEEDBACK_WANT),
           "trl_conversational": (TRL_ROW, TRL_WANT), "no_prompt": (NO_PROMPT_ROW, NO_PROMPT_WANT),
           "hh_rlhf": (HH_ROW, HH_WANT)}
LAYOUT_FORMAT = {"plain": "plain", "ultrafeedback": "ultrafeedback", "trl_conversational": "ultrafeedback",
                 "no_prompt": "ultrafeedback", "hh_rlhf": "hh_rlhf"}


def want(name: str, source: str) -> PreferencePair:
    pair = LAYOUTS[name][1]
    return PreferencePair(pair.prompt, pair.chosen, pair.rejected, pair.tools, pair.margin, pair.kind, source)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows),
                    encoding="utf-8")
    return path


def assert_renders(pair: PreferencePair) -> None:
    """Both replies render after the prompt with the chat template, and their calls parse back."""
    prompt = render_chat(pair.prompt, "<s>", "</s>", tools=pair.tools)
    for reply in (pair.chosen, pair.rejected):
        whole = render_chat(pair.prompt + [reply], "<s>", "</s>", tools=pair.tools, add_generation_prompt=False)
        assert whole == prompt + reference_text(reply) + "</s>\n"
        _, calls = parse_tool_calls(reference_text(reply))
        assert [(c.name, c.arguments) for c in calls] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in reply.get("tool_calls", [])]


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_layout_becomes_its_pair(name):
    row, _ = LAYOUTS[name]
    pair = preference_from_row(row, "rows.jsonl:7")
    assert pair == want(name, "rows.jsonl:7")
    assert preference_from_row(row, "x", format=LAYOUT_FORMAT[name]) == want(name, "x")  # forced, same result
    assert_renders(pair)


def test_tool_calls_come_out_exactly_as_the_sft_reader_writes_them():
    text = "Let me check.\n" + HERMES_CALL
    sft_hermes = conversation_from_row({"conversations": [{"from": "human", "value": "q"},
                                                          {"from": "gpt", "value": text}]}, "s").messages[-1]
    assert sft_hermes["tool_calls"] == [CALL] and sft_hermes["content"] == "Let me check."
    as_text = preference_from_row({"prompt": "q", "chosen": text, "rejected": "no"}, "p")
    in_list = preference_from_row({"prompt": "q", "chosen": [user("q"), assistant(text)],
                                   "rejected": [user("q"), assistant("no")]}, "p")
    assert as_text.chosen == in_list.chosen == sft_hermes

    openai = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c9", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}},
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Bern"}'}}]}
    sft_openai = conversation_from_row({"messages": [user("q"), openai]}, "s").messages[-1]
    pair = preference_from_row({"prompt": [user("q")], "chosen": [openai], "rejected": [assistant("no")]}, "p")
    assert pair.chosen == sft_openai
    assert [c["function"]["arguments"] for c in pair.chosen["tool_calls"]] == ['{"city": "Zürich", "unit": "c"}',
                                                                                '{"city": "Bern"}']


def test_hh_rlhf_transcripts_split_into_turns():
    # No leading newlines, trailing spaces, single newlines inside a turn: kept inside the turn.
    prefix = "Human: Plan a trip.\nTwo days.  \n\nAssistant: Where to?\n\nHuman: Oslo "
    pair = preference_from_row({"chosen": prefix + "\n\nAssistant: Day 1: the fjord.\nDay 2: museums.",
                                "rejected": prefix + "\n\nAssistant:  No."}, "hh")
    assert pair.prompt == [user("Plan a trip.\nTwo days."), assistant("Where to?"), user("Oslo")]
    assert pair.chosen == assistant("Day 1: the fjord.\nDay 2: museums.")
    assert pair.rejected == assistant("No.")


def test_every_container_gives_the_same_pairs(tmp_path):
    names = list(LAYOUTS)
    rows = [LAYOUTS[n][0] for n in names]
    jsonl = write_jsonl(tmp_path / "pairs.jsonl", rows)
    stats = ReadStats()
    assert read_preferences(jsonl, stats=stats) == [want(n, f"{jsonl}:{i}") for i, n in enumerate(names, start=1)]
    assert stats.by_format == {"plain": 1, "ultrafeedback": 3, "hh_rlhf": 1}
    as_json = tmp_path / "pairs.json"
    as_json.write_text(json.dumps(rows), encoding="utf-8")
    assert read_preferences(as_json) == [want(n, f"{as_json}#row {i}") for i, n in enumerate(names)]

    # Parquet: a column holds one type, so the layouts go into files by their columns' types; a
    # directory of them is read in name order.
    folder = tmp_path / "parquet"
    folder.mkdir()
    groups = {"a.parquet": ["ultrafeedback"], "b.parquet": ["trl_conversational", "no_prompt"],
              "c.parquet": ["plain", "hh_rlhf"]}
    for file, group in groups.items():
        # pa.array, not Table.from_pylist: its columns are those of every row, not only the first.
        pq.write_table(pa.Table.from_struct_array(pa.array([LAYOUTS[n][0] for n in group])), folder / file)
    assert read_preferences(folder) == [want(n, f"{folder / file}#row {i}")
                                        for file, group in groups.items() for i, n in enumerate(group)]

    single = tmp_path / "ds"
    datasets.Dataset.from_list([PLAIN_ROW, HH_ROW]).save_to_disk(str(single))
    assert read_preferences(single) == [want("plain", f"{single}#row 0"), want("hh_rlhf", f"{single}#row 1")]

    # UltraFeedback-binarized's own DatasetDict splits: train_prefs for training, test_prefs held out.
    other = dict(ULTRAFEEDBACK_ROW, chosen=[user("Name a prime number."), assistant("2 is prime.")])
    dd = tmp_path / "dd"
    datasets.DatasetDict({"train_prefs": datasets.Dataset.from_list([ULTRAFEEDBACK_ROW]),
                          "test_prefs": datasets.Dataset.from_list([other])}).save_to_disk(str(dd))
    train, val = read_preference_splits(dd)
    assert train == [want("ultrafeedback", f"{dd}#train_prefs/row 0")]
    assert [(p.source, p.chosen) for p in val] == [(f"{dd}#test_prefs/row 0", assistant("2 is prime."))]
    assert read_preferences(dd, split="test_prefs") == val


def test_splits_from_a_directory_or_held_out_from_one_file(tmp_path):
    folder = tmp_path / "set"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [PLAIN_ROW, HH_ROW])
    write_jsonl(folder / "val.jsonl", [TRL_ROW])
    train, val = read_preference_splits(folder)
    assert [p.source for p in train] == [f"{folder / 'train.jsonl'}:1", f"{folder / 'train.jsonl'}:2"]
    assert val == [want("trl_conversational", f"{folder / 'val.jsonl'}:1")]

    one = write_jsonl(tmp_path / "one.jsonl", [PLAIN_ROW] * 10)
    train, val = read_preference_splits(one, val_fraction=0.3, seed=1)
    assert len(train) + len(val) == 10 and 1 <= len(val) < 10
    assert read_preference_splits(one, val_fraction=0.3, seed=1) == (train, val)
    assert read_preference_splits(one) == (read_preferences(one), [])
    with pytest.raises(LMForgeError, match="val_fraction must be >= 0 and < 1"):
        read_preference_splits(one, val_fraction=1.0)
    # a directory with held-out files but no train file is refused (it was read whole: test pairs trained on)
    (folder / "train.jsonl").rename(folder / "trian.jsonl")
    write_jsonl(folder / "test.jsonl", [PLAIN_ROW])
    with pytest.raises(LMForgeError, match=r"set has no train.jsonl .*only held-out files \(test.jsonl, val.jsonl\)"):
        read_preference_splits(folder, val_fraction=0.3)


# ----- bad rows

BAD_ROWS = {
    "not_json": ('{"prompt": "hi", "chosen"', "not valid JSON"),
    "not_an_object": ('["hi", "a", "b"]', "expected a JSON object (one preference pair), got list"),
    "no_rejected": ({"prompt": "hi", "chosen": "a"}, "no 'rejected' field (keys: ['chosen', 'prompt'])"),
    "mixed_sides": ({"prompt": "hi", "chosen": "a", "rejected": [assistant("b")]},
                    "chosen is a str and rejected a list: give both replies as text, or both as message lists"),
    "side_without_the_prompt": ({"prompt": "Name a prime.", "chosen": [user("Name a color."), assistant("Red.")],
                                 "rejected": [user("Name a prime."), assistant("9.")]},
                                "chosen does not begin with the prompt's messages"),
    "side_ends_with_user": ({"prompt": "hi", "chosen": [user("hi"), assistant("hello"), user("bye")],
                             "rejected": [user("hi"), assistant("go away")]},
                            "chosen ends with a user message; its last message must be the assistant's reply"),
    "sides_differ_before_reply": ({"chosen": [user("2+2?"), assistant("4")], "rejected": [user("3+3?"), assistant("5")]},
                                  "chosen and rejected differ before their final reply (at message 0"),
    "hh_prefixes_differ": ({"chosen": "\n\nHuman: Hi\n\nAssistant: Hello", "rejected": "\n\nHuman: Yo\n\nAssistant: Go"},
                           "differ before their final Assistant turn (at turn 0)"),
    "hh_ends_with_human": ({"chosen": "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: And?",
                            "rejected": "\n\nHuman: Hi\n\nAssistant: Go"},
                           "chosen ends with a Human turn"),
    "hh_no_turns": ({"chosen": "Hello there", "rejected": "\n\nHuman: Hi\n\nAssistant: Go"},
                    "chosen does not start with a '\\n\\nHuman:' turn"),
    "same_reply": ({"prompt": "hi", "chosen": "hello", "rejected": "hello"}, "chosen and rejected are the same reply"),
    "empty_reply": ({"prompt": "hi", "chosen": "hello", "rejected": "  "}, "the rejected reply is empty"),
    "prompt_ends_with_assistant": ({"prompt": [user("hi"), assistant("hello")], "chosen": [assistant("a")],
                                    "rejected": [assistant("b")]}, "the prompt ends with a assistant message"),
    "margin_not_a_number": ({**PLAIN_ROW, "margin": "high"}, "margin is 'high'; it must be a finite number"),
    "margin_a_boolean": ({**PLAIN_ROW, "margin": True}, "margin is True"),
    "kind_not_a_string": ({**PLAIN_ROW, "kind": 3}, "kind is a int, not a string"),
    "call_not_json": ({"prompt": "hi", "chosen": "<tool_call>{'name': 'f', 'arguments': {oops}}</tool_call>",
                       "rejected": "no"}, "chosen tool call 0: the tool call is not valid JSON"),
    "call_unclosed": ({"prompt": "hi", "chosen": '<tool_call>{"name": "f"}', "rejected": "no"},
                      "without its </tool_call>"),
    "openai_arguments_not_json": ({"prompt": "hi", "chosen": [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{city: Paris}"}}]}], "rejected": [assistant("no")]},
        "chosen[0].tool_calls[0] (f): the arguments are not valid JSON"),
    "unknown_role": ({"prompt": [{"role": "bot", "content": "hi"}], "chosen": [assistant("a")],
                      "rejected": [assistant("b")]}, "prompt[0].role is 'bot', not a known role"),
    "bad_tools": ({**PLAIN_ROW, "tools": "[{not json"}, "tools is a string that is not JSON"),
    "nested_too_deep": ('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + ', "chosen": "a", "rejected": "b"}',
                        "not valid JSON (maximum recursion depth exceeded"),
}


@pytest.mark.parametrize("case", BAD_ROWS)
def test_a_bad_row_names_its_file_and_line(tmp_path, case):
    row, fragment = BAD_ROWS[case]
    path = write_jsonl(tmp_path / "bad.jsonl", [PLAIN_ROW, row])
    with pytest.raises(RowError) as e:
        read_preferences(path)
    assert str(e.value).startswith(f"{path}:2") and e.value.source == f"{path}:2"
    assert fragment in str(e.value), str(e.value)


def test_skip_bad_rows_counts_them_and_keeps_the_good_ones(tmp_path):
    bad = [row for row, _ in BAD_ROWS.values()]
    path = write_jsonl(tmp_path / "some_bad.jsonl", [PLAIN_ROW, *bad, HH_ROW])
    stats = ReadStats()
    pairs = read_preferences(path, skip_bad_rows=True, stats=stats)
    assert pairs == [want("plain", f"{path}:1"), want("hh_rlhf", f"{path}:{len(bad) + 2}")]
    assert (stats.rows, stats.kept, stats.bad) == (len(bad) + 2, 2, len(bad))
    assert stats.by_format == {"plain": 1, "hh_rlhf": 1}
    assert len(stats.bad_examples) == 5
    for lineno, (message, (_, fragment)) in enumerate(zip(stats.bad_examples, BAD_ROWS.values()), start=2):
        assert message.startswith(f"{path}:{lineno}") and fragment in message


def test_forced_and_unknown_formats():
    with pytest.raises(RowError, match=r"^x \(plain\): no 'prompt' field"):
        preference_from_row(HH_ROW, "x", format="plain")
    with pytest.raises(RowError, match=r"^x \(hh_rlhf\): chosen does not start with a"):
        preference_from_row(PLAIN_ROW, "x", format="hh_rlhf")
    with pytest.raises(LMForgeError, match="unknown preference format 'dpo'"):
        read_preferences("anything.jsonl", format="dpo")  # refused before the path is looked at


# ----- the generated tool-calling pairs

@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    out = tmp_path_factory.mktemp("prefs") / "set"
    meta = write_preference_dataset(out, n_train=600, n_val=100, n_test=300, seed=3)
    rows = {split: [json.loads(line) for line in (out / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()]
            for split in ("train", "val", "test")}
    return out, meta, rows


def test_every_kind_is_present_and_meta_counts_them(generated):
    _, meta, rows = generated
    assert meta["counts"] == {"train": 600, "val": 100, "test": 300}
    for split, pairs in rows.items():
        kinds = {k: sum(p["kind"] == k for p in pairs) for k in KINDS}
        assert {k: n for k, n in kinds.items() if n} == meta["kinds"][split]
        if split != "val":
            assert all(kinds.values()), kinds
        for p in pairs:
            assert p["kind"] in CASE_KINDS[p["case"]]


def test_chosen_is_the_reference_turn_and_the_file_reads_back(generated):
    out, _, rows = generated
    train, val = read_preference_splits(out)
    for split, pairs in (("train", train), ("test", read_preferences(out / "test.jsonl"))):
        reference = make_rows(split, len(pairs), seed=3)
        assert len(pairs) == len(reference)
        for pair, row, raw in zip(pairs, reference, rows[split]):
            assert pair.prompt == row["messages"][:-1] and pair.chosen == row["messages"][-1]
            assert pair.tools == row["tools"] and pair.kind == raw["kind"]
            assert pair.rejected == raw["rejected"][0] != pair.chosen
    assert len(val) == 100


def test_each_rejected_reply_is_what_its_kind_says(generated):
    _, _, rows = generated
    seen = set()
    for pair in rows["train"] + rows["test"]:
        chosen, rejected, prompt = pair["chosen"][0], pair["rejected"][0], pair["prompt"]
        offered = {t["function"]["name"] for t in pair["tools"]}
        text = reference_text(rejected)  # what a model would write: read back by the server's parser
        result = prompt[-1]["content"] if prompt[-1]["role"] == "tool" else None
        score = score_reply(text, chosen, result)
        _, calls = parse_tool_calls(text)
        kind = pair["kind"]
        seen.add(kind)
        if kind in ("wrong_tool", "wrong_arguments", "missed_call"):
            assert score["kind"] == "call"  # the reference calls a tool
        if kind == "wrong_tool":
            [call] = calls
            params = TOOLS[call.name]["function"]["parameters"]
            args = json.loads(call.arguments)
            assert not score["name_ok"] and call.name in offered
            assert set(params["required"]) <= set(args) <= set(params["properties"])
        elif kind == "wrong_arguments":
            [call] = calls
            name, want_args = reference_call(chosen["tool_calls"][0])
            args = json.loads(call.arguments)
            assert score["name_ok"] and not score["args_exact"]
            differ = {k for k in want_args.keys() | args.keys() if args.get(k, "missing") != want_args.get(k)}
            assert len(differ) == 1 and differ <= set(TOOLS[name]["function"]["parameters"]["required"])
        elif kind == "missed_call":
            assert calls == [] and score["markers"] == 0 and rejected["content"]
        elif kind == "false_call":
            assert score["kind"] == "plain" and score["attempted_call"] and len(calls) == 1
            assert calls[0].name in offered
        else:
            assert kind == "ignored_result" and result is not None
            assert score["kind"] == "plain" and not score["attempted_call"] and not score["mentions_result"]
            # Nor any value the result adds to the request.
            name, args = reference_call(prompt[-2]["tool_calls"][0])
            told = [v for v in _leaves(json.loads(result)) if v not in args.values()]
            assert told and not any(re.search(rf"(?<![\w.]){re.escape(str(v))}(?!\w|\.\d)", text) for v in told
                                    if not isinstance(v, bool)), (text, told)
    assert seen == set(KINDS)


def _leaves(value):
    if isinstance(value, dict):
        return [x for v in value.values() for x in _leaves(v)]
    if isinstance(value, list):
        return [x for v in value for x in _leaves(v)]
    return [value]


def _argument_values(pairs: list[dict]) -> set[str]:
    out = set()
    for p in pairs:
        for m in p["prompt"] + p["chosen"] + p["rejected"]:
            for call in m.get("tool_calls") or []:
                _, args = reference_call(call)
                out |= {json.dumps(v) for k, v in args.items()
                        if not isinstance(v, bool) and k != "unit"}  # enum and booleans are shared by design
    return out


def test_no_held_out_value_occurs_in_training_pairs(generated):
    out, _, rows = generated
    held_out = {json.dumps(v) for pool in value_split().values() for split in ("val", "test") for v in pool[split]}
    held_out |= {json.dumps(f"{v.lower()}@acme.io") for v in value_split()["name"]["val"] + value_split()["name"]["test"]}
    train_values = _argument_values(rows["train"])
    assert len(train_values) > 100
    assert not train_values & held_out, sorted(train_values & held_out)[:10]
    assert _argument_values(rows["test"]) & held_out  # the check can see a held-out value
    # Strings not even inside the text of a training pair (as whole tokens).
    text = (out / "train.jsonl").read_text(encoding="utf-8")
    strings = [v for name, pool in value_split().items() if name not in ("integer", "decimal")
               for v in pool["test"]]
    found = re.findall(r"(?<!\w)(?:" + "|".join(map(re.escape, strings)) + r")(?!\w)", text)
    assert not found, sorted(set(found))[:10]


def test_the_same_seed_writes_the_same_bytes_and_another_seed_other_pairs(tmp_path):
    a = write_preference_dataset(tmp_path / "a", 60, 10, 10, seed=5)
    b = write_preference_dataset(tmp_path / "b", 60, 10, 10, seed=5)
    c = write_preference_dataset(tmp_path / "c", 60, 10, 10, seed=6)
    for name in ("train.jsonl", "val.jsonl", "test.jsonl", "meta.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert (tmp_path / "a" / "train.jsonl").read_bytes() != (tmp_path / "c" / "train.jsonl").read_bytes()
    assert a == b and a["seed"] == 5 and c["seed"] == 6
    rows = make_rows("val", 10, seed=5)
    assert make_preference_pairs(rows, 5, "val") == make_preference_pairs(rows, 5, "val")
    with pytest.raises(LMForgeError, match="unknown split 'dev'"):
        make_preference_pairs(rows, 5, "dev")


def test_a_non_empty_directory_is_replaced_only_when_asked(tmp_path):
    out = tmp_path / "prefs"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(LMForgeError, match="exists and is not empty; pass --overwrite"):
        write_preference_dataset(out, 10, 2, 2)
    with pytest.raises(LMForgeError, match="not an earlier preference dataset"):
        write_preference_dataset(out, 10, 2, 2, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    write_preference_dataset(out, 10, 2, 2, seed=1)
    with pytest.raises(LMForgeError, match="exists and is not empty"):
        write_preference_dataset(out, 12, 2, 2, seed=1)
    assert json.loads((out / "meta.json").read_text())["counts"]["train"] == 10
    write_preference_dataset(out, 12, 2, 2, seed=1, overwrite=True)
    assert json.loads((out / "meta.json").read_text())["counts"]["train"] == 12
    assert len((out / "train.jsonl").read_text().splitlines()) == 12
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prefs"]  # no temporary left beside it
    with pytest.raises(LMForgeError, match="n_val must be an integer >= 0"):
        write_preference_dataset(tmp_path / "other", 10, -1, 2)


def test_data_preferences_verb(tmp_path, capsys):
    from lmforge.recipes.reward.cli_data import add_data_verbs

    parser = argparse.ArgumentParser()
    add_data_verbs(parser.add_subparsers())
    out = tmp_path / "p"
    args = parser.parse_args(["preferences", "--out", str(out), "--train", "40", "--val", "5", "--test", "6",
                              "--seed", "2"])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}: train 40, val 5, test 6 pairs" in printed and "rejected replies, all splits: false_call " in printed
    assert (out / "train.jsonl").read_bytes() == _written(tmp_path / "direct", 40, 5, 6, 2)
    args = parser.parse_args(["preferences", "--out", str(out)])
    with pytest.raises(LMForgeError, match="pass --overwrite"):
        args.func(args)


def _written(out: Path, n_train: int, n_val: int, n_test: int, seed: int) -> bytes:
    write_preference_dataset(out, n_train, n_val, n_test, seed=seed)
    return (out / "train.jsonl").read_bytes()
