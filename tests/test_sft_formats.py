"""The SFT conversation loaders: every published layout (OpenAI messages, prompt/completion, ShareGPT
with Hermes tool calls, Glaive v2, xLAM) in every container (.jsonl, .json, .parquet, a datasets
directory, a directory of files) comes out as the same canonical conversation, renders with
lmforge's chat template, and its tool calls read back through ``parse_tool_calls`` unchanged. Bad
rows name their file and line; ``skip_bad_rows`` counts them instead."""

from __future__ import annotations

import json
import re
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.chat import parse_tool_calls, render_chat
from lmforge.errors import LMForgeError
from lmforge.posttrain.formats import (FORMATS, Conversation, ReadStats, RowError, conversation_from_row,
                                         detect_format, read_conversations)


def call(name: str, arguments: str, id: str | None = None) -> dict:
    out = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if id is not None:
        out["id"] = id
    return out


def tool(name: str, description: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


# ----- rows in each layout, and what they must become

WEATHER_TOOL = tool("get_weather", "Current weather in a city.", {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"]})

OPENAI_ROW = {
    "messages": [
        {"role": "developer", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Zürich?"}]},
        # Compact, escaped JSON text: normalised to json.dumps(..., ensure_ascii=False).
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Z\\u00fcrich",  "unit":"c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp_c": 21}'},
        {"role": "assistant", "content": "21 °C and sunny."},
    ],
    "tools": json.dumps([WEATHER_TOOL]),  # many Hub datasets store the tool list as a JSON string
}
OPENAI_WANT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "tool_calls": [call("get_weather", '{"city": "Zürich", "unit": "c"}', "call_1")]},
    {"role": "tool", "content": '{"temp_c": 21}', "tool_call_id": "call_1", "name": "get_weather"},
    {"role": "assistant", "content": "21 °C and sunny."},
]

# OpenAI's older function-calling API: "functions", "function_call", a "function" role; and a call
# whose arguments are an object rather than JSON text.
ROLL = {"name": "roll", "description": "Roll a die.", "parameters": {"type": "object", "properties": {"sides": {"type": "integer"}}}}
OPENAI_LEGACY_ROW = {"messages": [
    {"role": "user", "content": "Roll a d20, then a d6."},
    {"role": "assistant", "content": None, "function_call": {"name": "roll", "arguments": '{"sides":20}'}},
    {"role": "function", "name": "roll", "content": "17"},
    {"role": "assistant", "content": "Now the d6.", "tool_calls": [{"function": {"name": "roll", "arguments": {"sides": 6}}}]},
    {"role": "tool", "content": "4"},
    {"role": "assistant", "content": "17 and 4."},
], "functions": [ROLL]}
OPENAI_LEGACY_WANT = [
    {"role": "user", "content": "Roll a d20, then a d6."},
    {"role": "assistant", "content": "", "tool_calls": [call("roll", '{"sides": 20}')]},
    {"role": "tool", "content": "17", "name": "roll"},
    {"role": "assistant", "content": "Now the d6.", "tool_calls": [call("roll", '{"sides": 6}')]},
    {"role": "tool", "content": "4"},
    {"role": "assistant", "content": "17 and 4."},
]

PROMPT_COMPLETION_ROW = {"system": "Answer in French.", "prompt": "Say hello.", "completion": "Bonjour !"}
PROMPT_COMPLETION_WANT = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Say hello."},
                          {"role": "assistant", "content": "Bonjour !"}]
PROMPT_COMPLETION_CHAT_ROW = {"prompt": [{"role": "user", "content": "2 + 2?"}],
                              "completion": [{"role": "assistant", "content": "4"}]}
PROMPT_COMPLETION_CHAT_WANT = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]

# NousResearch hermes-function-calling-v1: tools in the system prompt as a Python literal (the tag is
# also named in prose), calls written as Python dicts or JSON, results in <tool_response> blocks.
HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within <tools> </tools> "
    "XML tags. You may call one or more functions to assist with the user query.\n<tools>\n"
    "[{'type': 'function', 'function': {'name': 'get_stock_price', 'description': 'Current price of a stock.', "
    "'parameters': {'type': 'object', 'properties': {'symbol': {'type': 'string'}, 'realtime': {'type': 'boolean'}}, "
    "'required': ['symbol']}}}, {'type': 'function', 'function': {'name': 'get_news', 'description': "
    "'Latest news about a company.', 'parameters': {'type': 'object', 'properties': {'company': {'type': 'string'}, "
    "'limit': {'type': 'integer'}, 'include_blogs': {'type': 'boolean'}}, 'required': ['company']}}}]\n</tools>\n"
    "For each function call return a json object with function name and arguments within <tool_call> </tool_call> "
    "tags with the following schema:\n<tool_call>\n{'arguments': <args-dict>, 'name': <function-name>}\n</tool_call>\n")
HERMES_ROW = {
    "id": "753d8365-0e54-43b1-9514-3f9b819fd31c",
    "conversations": [
        {"from": "system", "value": HERMES_SYSTEM},
        {"from": "human", "value": "What does TSLA trade at, and what is the news on Société Générale?"},
        {"from": "gpt", "value": (
            "I'll look both up.\n<tool_call>\n{'arguments': {'symbol': 'TSLA', 'realtime': True}, "
            "'name': 'get_stock_price'}\n</tool_call>\n<tool_call>\n{\"name\": \"get_news\", \"arguments\": "
            "{\"company\": \"Société Générale\", \"limit\": 2, \"include_blogs\": false}}\n</tool_call>\n")},
        {"from": "tool", "value": (
            "<tool_response>\n{\"name\": \"get_stock_price\", \"content\": {\"price\": 251.3}}\n</tool_response>\n"
            "<tool_response>\n{\"name\": \"get_news\", \"content\": [\"Q3 results beat\"]}\n</tool_response>\n")},
        {"from": "gpt", "value": "TSLA trades at $251.30; Société Générale's Q3 results beat expectations."},
    ],
    "category": "Finance", "subcategory": "Stocks", "task": "Price and news",
}
HERMES_WANT = [
    {"role": "system", "content": (
        "You are a function calling AI model. You are provided with function signatures within <tools> </tools> "
        "XML tags. You may call one or more functions to assist with the user query.\n\n"
        "For each function call return a json object with function name and arguments within <tool_call> </tool_call> "
        "tags with the following schema:\n<tool_call>\n{'arguments': <args-dict>, 'name': <function-name>}\n</tool_call>")},
    {"role": "user", "content": "What does TSLA trade at, and what is the news on Société Générale?"},
    {"role": "assistant", "content": "I'll look both up.", "tool_calls": [
        call("get_stock_price", '{"symbol": "TSLA", "realtime": true}'),
        call("get_news", '{"company": "Société Générale", "limit": 2, "include_blogs": false}')]},
    {"role": "tool", "content": '{"name": "get_stock_price", "content": {"price": 251.3}}'},
    {"role": "tool", "content": '{"name": "get_news", "content": ["Q3 results beat"]}'},
    {"role": "assistant", "content": "TSLA trades at $251.30; Société Générale's Q3 results beat expectations."},
]
HERMES_TOOLS = [
    tool("get_stock_price", "Current price of a stock.", {
        "type": "object", "properties": {"symbol": {"type": "string"}, "realtime": {"type": "boolean"}},
        "required": ["symbol"]}),
    tool("get_news", "Latest news about a company.", {
        "type": "object", "properties": {"company": {"type": "string"}, "limit": {"type": "integer"},
                                         "include_blogs": {"type": "boolean"}}, "required": ["company"]}),
]

# glaiveai/glaive-function-calling-v2: function definitions one after another in the system text,
# the call's arguments a single-quoted string of JSON, <|endoftext|> after assistant turns.
GLAIVE_ROW = {
    "system": (
        "SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -\n"
        "{\n    \"name\": \"get_exchange_rate\",\n    \"description\": \"Get the exchange rate between two currencies\",\n"
        "    \"parameters\": {\n        \"type\": \"object\",\n        \"properties\": {\n"
        "            \"base_currency\": {\n                \"type\": \"string\"\n            },\n"
        "            \"target_currency\": {\n                \"type\": \"string\"\n            }\n        },\n"
        "        \"required\": [\n            \"base_currency\",\n            \"target_currency\"\n        ]\n    }\n}\n\n"
        "{\n    \"name\": \"get_random_quote\",\n    \"description\": \"Get a random quote\",\n    \"parameters\": {}\n}\n\n"
        "{\n    \"name\": \"send_message\",\n    \"description\": \"Send a text message\",\n    \"parameters\": {\n"
        "        \"type\": \"object\",\n        \"properties\": {\n            \"to\": {\"type\": \"string\"},\n"
        "            \"text\": {\"type\": \"string\"}\n        }\n    }\n}\n"),
    "chat": (
        "USER: Hi, what's the exchange rate between US dollar and Euro?\n\n\n"
        "ASSISTANT: <functioncall> {\"name\": \"get_exchange_rate\", \"arguments\": "
        "'{\"base_currency\": \"US dollar\", \"target_currency\": \"Euro\"}'} <|endoftext|>\n\n\n"
        "FUNCTION RESPONSE: {\"exchange_rate\": 0.85}\n\n\n"
        "ASSISTANT: One US dollar is 0.85 Euro. <|endoftext|>\n\n\n"
        "USER: And a quote, please. Make it one that's short.\n\n\n"
        "ASSISTANT: <functioncall> {\"name\": \"get_random_quote\", \"arguments\": {}} <|endoftext|>\n\n\n"
        "FUNCTION RESPONSE: {\"quote\": \"Stay hungry.\"}\n\n\n"
        "ASSISTANT: \"Stay hungry.\" <|endoftext|>\n\n\n"
        # JSON escapes and an apostrophe inside the single-quoted arguments: read verbatim, not as Python.
        "USER: Tell Ann I said \"hi\" and that it's done.\n\n\n"
        "ASSISTANT: <functioncall> {\"name\": \"send_message\", \"arguments\": "
        "'{\"to\": \"Ann\", \"text\": \"I said \\\"hi\\\" and it's done.\"}'} <|endoftext|>\n\n\n"
        "FUNCTION RESPONSE: {\"status\": \"sent\"}\n\n\n"
        "ASSISTANT: Sent. <|endoftext|>\n\n\n"),
}
GLAIVE_WANT = [
    {"role": "system", "content": "You are a helpful assistant with access to the following functions. Use them if required -"},
    {"role": "user", "content": "Hi, what's the exchange rate between US dollar and Euro?"},
    {"role": "assistant", "content": "", "tool_calls": [
        call("get_exchange_rate", '{"base_currency": "US dollar", "target_currency": "Euro"}')]},
    {"role": "tool", "content": '{"exchange_rate": 0.85}'},
    {"role": "assistant", "content": "One US dollar is 0.85 Euro."},
    {"role": "user", "content": "And a quote, please. Make it one that's short."},
    {"role": "assistant", "content": "", "tool_calls": [call("get_random_quote", "{}")]},
    {"role": "tool", "content": '{"quote": "Stay hungry."}'},
    {"role": "assistant", "content": '"Stay hungry."'},
    {"role": "user", "content": 'Tell Ann I said "hi" and that it\'s done.'},
    {"role": "assistant", "content": "", "tool_calls": [
        call("send_message", json.dumps({"to": "Ann", "text": 'I said "hi" and it\'s done.'}))]},
    {"role": "tool", "content": '{"status": "sent"}'},
    {"role": "assistant", "content": "Sent."},
]
GLAIVE_TOOLS = [
    tool("get_exchange_rate", "Get the exchange rate between two currencies", {
        "type": "object", "properties": {"base_currency": {"type": "string"}, "target_currency": {"type": "string"}},
        "required": ["base_currency", "target_currency"]}),
    tool("get_random_quote", "Get a random quote", {}),
    tool("send_message", "Send a text message", {
        "type": "object", "properties": {"to": {"type": "string"}, "text": {"type": "string"}}}),
]
GLAIVE_PLAIN_ROW = {"system": "SYSTEM: You are a helpful assistant, with no access to external functions.\n\n",
                    "chat": "USER: Hi!\n\n\nASSISTANT: Hello! How can I help? <|endoftext|>\n\n\n"}
GLAIVE_PLAIN_WANT = [{"role": "system", "content": "You are a helpful assistant, with no access to external functions."},
                     {"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"}]

# Salesforce/xlam-function-calling-60k: answers and tools are JSON strings; parameters map argument
# names (one of them literally "type") to {"type": "str" | "List[int]" | ..., "default"?}.
XLAM_ROW = {
    "id": 4,
    "query": "Find live giveaways for beta access, and the max subarray sum of [2, -1, 3].",
    "answers": json.dumps([{"name": "live_giveaways_by_type", "arguments": {"type": "beta"}},
                           {"name": "find_max_subarray_sum", "arguments": {"nums": [2, -1, 3]}}]),
    "tools": json.dumps([
        {"name": "live_giveaways_by_type", "description": "Retrieve live giveaways from the GamerPower API.",
         "parameters": {"type": {"description": "The type of giveaways (game, loot, beta).", "type": "str",
                                 "default": "game"}}},
        {"name": "find_max_subarray_sum", "description": "Maximum sum of a contiguous subarray.",
         "parameters": {"nums": {"description": "The input list of integers.", "type": "List[int]"},
                        "limit": {"description": "Stop after this many items.", "type": "int, optional"},
                        "scale": {"description": "Multiply the sum.", "type": "float", "default": 1.0},
                        "strict": {"description": "Reject empty lists.", "type": "bool"}}},
    ]),
}
XLAM_WANT = [
    {"role": "user", "content": "Find live giveaways for beta access, and the max subarray sum of [2, -1, 3]."},
    {"role": "assistant", "content": "", "tool_calls": [
        call("live_giveaways_by_type", '{"type": "beta"}'), call("find_max_subarray_sum", '{"nums": [2, -1, 3]}')]},
]
XLAM_TOOLS = [
    tool("live_giveaways_by_type", "Retrieve live giveaways from the GamerPower API.", {
        "type": "object", "required": [],
        "properties": {"type": {"type": "string", "description": "The type of giveaways (game, loot, beta).",
                                "default": "game"}}}),
    tool("find_max_subarray_sum", "Maximum sum of a contiguous subarray.", {
        "type": "object", "required": ["nums", "strict"], "properties": {
            "nums": {"type": "array", "items": {"type": "integer"}, "description": "The input list of integers."},
            "limit": {"type": "integer", "description": "Stop after this many items."},
            "scale": {"type": "number", "description": "Multiply the sum.", "default": 1.0},
            "strict": {"type": "boolean", "description": "Reject empty lists."}}}),
]

# (row, its layout, messages, tools)
CASES = {
    "openai": (OPENAI_ROW, "openai", OPENAI_WANT, [WEATHER_TOOL]),
    "openai_legacy": (OPENAI_LEGACY_ROW, "openai", OPENAI_LEGACY_WANT, [{"type": "function", "function": ROLL}]),
    "prompt_completion": (PROMPT_COMPLETION_ROW, "prompt_completion", PROMPT_COMPLETION_WANT, None),
    "prompt_completion_chat": (PROMPT_COMPLETION_CHAT_ROW, "prompt_completion", PROMPT_COMPLETION_CHAT_WANT, None),
    "hermes": (HERMES_ROW, "sharegpt", HERMES_WANT, HERMES_TOOLS),
    "glaive": (GLAIVE_ROW, "glaive", GLAIVE_WANT, GLAIVE_TOOLS),
    "glaive_plain": (GLAIVE_PLAIN_ROW, "glaive", GLAIVE_PLAIN_WANT, None),
    "xlam": (XLAM_ROW, "xlam", XLAM_WANT, XLAM_TOOLS),
}


def write_jsonl(path: Path, rows: list, blank_after_first: bool = False) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) for r in rows]
    if blank_after_first:
        lines.insert(1, "")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def assert_renders_and_round_trips(conv: Conversation) -> None:
    """The conversation renders in lmforge's template, and each assistant turn's tool calls parse back
    from the rendered text with the same names and byte-identical argument strings."""
    text = render_chat(conv.messages, "<s>", "</s>", tools=conv.tools, add_generation_prompt=False)
    for spec in conv.tools or []:
        assert json.dumps(spec["function"], ensure_ascii=False) in text
    turns = re.findall(r"<s>assistant\n(.*?)</s>", text, re.DOTALL)
    assistants = [m for m in conv.messages if m["role"] == "assistant"]
    assert len(turns) == len(assistants)
    for turn, message in zip(turns, assistants):
        content, calls = parse_tool_calls(turn)
        want = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
        assert [(c.name, c.arguments) for c in calls] == want
        assert content == message["content"]


# ----- each layout


@pytest.mark.parametrize("case", CASES)
def test_each_layout_becomes_the_canonical_conversation(case):
    row, layout, messages, tools = CASES[case]
    assert detect_format(row) == layout
    conv = conversation_from_row(json.loads(json.dumps(row)), "data.jsonl:7")
    assert conv == Conversation(messages, tools, "data.jsonl:7")
    assert conversation_from_row(row, "x", format=layout) == Conversation(messages, tools, "x")  # forced = detected
    assert_renders_and_round_trips(conv)


def test_the_rendered_calls_are_the_servers_argument_text():
    # parse_tool_calls re-dumps the arguments it reads: a stored string in any other spelling would
    # train the model on text the server never emits.
    for row, *_ in CASES.values():
        for m in conversation_from_row(row, "x").messages:
            for c in m.get("tool_calls", []):
                args = c["function"]["arguments"]
                assert args == json.dumps(json.loads(args), ensure_ascii=False)


def test_hermes_tools_one_object_per_line_and_a_separate_tools_field():
    per_line = (
        "You can call tools.\n<tools>\n"
        '{"type": "function", "function": {"name": "get_time", "description": "Time now.", "parameters": {}}}\n'
        "{'name': 'get_date', 'description': 'Date today.', 'parameters': {}}\n</tools>")
    row = {"conversations": [{"from": "system", "value": per_line}, {"from": "human", "value": "Time?"},
                             {"from": "gpt", "value": "<tool_call>\n{\"name\": \"get_time\"}\n</tool_call>"}]}
    conv = conversation_from_row(row, "x")
    assert conv.tools == [tool("get_time", "Time now.", {}), tool("get_date", "Date today.", {})]
    assert conv.messages[0] == {"role": "system", "content": "You can call tools."}
    assert conv.messages[2] == {"role": "assistant", "content": "", "tool_calls": [call("get_time", "{}")]}

    # A system prompt that was only the tool list goes away.
    tools_only = f"<tools>\n{json.dumps([tool('get_time', 'Time now.', {})])}\n</tools>\n"
    only_tools = {"conversations": [{"from": "system", "value": tools_only}, *row["conversations"][1:]]}
    assert [m["role"] for m in conversation_from_row(only_tools, "x").messages] == ["user", "assistant"]

    # With a tools field the system text is left as it is.
    with_field = {**row, "tools": [tool("get_time", "Time now.", {})]}
    conv = conversation_from_row(with_field, "x")
    assert conv.tools == [tool("get_time", "Time now.", {})]
    assert conv.messages[0] == {"role": "system", "content": per_line}


def test_sharegpt_variants_llama_factory_function_call_and_observation():
    row = {"conversations": [
        {"from": "human", "value": "Weather in Oslo?"},
        {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Oslo"}}'},
        {"from": "observation", "value": '{"temp_c": 3}'},
        {"from": "gpt", "value": "3 °C."}],
        "system": "Be brief.", "tools": json.dumps([WEATHER_TOOL["function"]])}
    conv = conversation_from_row(row, "x")
    assert conv.messages == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", '{"city": "Oslo"}')]},
        {"role": "tool", "content": '{"temp_c": 3}'}, {"role": "assistant", "content": "3 °C."}]
    assert conv.tools == [WEATHER_TOOL]


def test_detect_format_names_every_layout_when_none_fits():
    with pytest.raises(RowError) as e:
        detect_format({"text": "hello", "label": 1})
    for name in FORMATS:
        assert name in str(e.value)
    assert "openai {messages, tools?}" in str(e.value) and "['label', 'text']" in str(e.value)
    # A null column is an absent one (columnar files give every row every column).
    assert detect_format({"messages": None, "conversations": [], "prompt": "x"}) == "sharegpt"


def test_unknown_format_names_are_refused_before_reading(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [OPENAI_ROW])
    for bad in (lambda: read_conversations(path, format="chatml"),
                lambda: conversation_from_row(OPENAI_ROW, "x", format="chatml")):
        with pytest.raises(LMForgeError, match="unknown conversation format 'chatml'") as e:
            bad()
        assert not isinstance(e.value, RowError)


# ----- containers


def test_jsonl_rows_keep_their_line_numbers_and_formats_are_counted(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [OPENAI_ROW, HERMES_ROW, XLAM_ROW], blank_after_first=True)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())  # a byte order mark, as some editors write
    stats = ReadStats()
    convs = list(read_conversations(str(path), stats=stats))
    assert [c.source for c in convs] == [f"{path}:1", f"{path}:3", f"{path}:4"]
    assert [c.messages for c in convs] == [OPENAI_WANT, HERMES_WANT, XLAM_WANT]
    assert (stats.rows, stats.kept, stats.bad) == (3, 3, 0)
    assert stats.by_format == {"openai": 1, "sharegpt": 1, "xlam": 1}


def test_json_list_and_json_lines_in_a_json_file(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([GLAIVE_ROW, PROMPT_COMPLETION_ROW], indent=2), encoding="utf-8")
    convs = list(read_conversations(path))
    assert [(c.source, c.messages, c.tools) for c in convs] == [
        (f"{path}#row 0", GLAIVE_WANT, GLAIVE_TOOLS), (f"{path}#row 1", PROMPT_COMPLETION_WANT, None)]
    # Many .json files on the Hub are JSON Lines: read them as such.
    lines = write_jsonl(tmp_path / "lines.json", [XLAM_ROW, OPENAI_LEGACY_ROW])
    assert [(c.source, c.messages) for c in read_conversations(lines)] == [
        (f"{lines}:1", XLAM_WANT), (f"{lines}:2", OPENAI_LEGACY_WANT)]


def test_parquet_with_nested_columns_and_rows_of_two_layouts(tmp_path):
    search = tool("search", "Web search.", {"type": "object", "properties": {"query": {"type": "string"}, "k": {"type": "integer"}},
                                            "required": ["query"]})
    rows = [
        {"messages": [{"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
                      {"role": "tool", "content": "18C", "tool_call_id": None},
                      {"role": "assistant", "content": "18 °C.", "tool_calls": None}],
         "tools": [WEATHER_TOOL], "conversations": None},
        {"messages": [{"role": "user", "content": "Find lmforge."},
                      {"role": "assistant", "content": "", "tool_calls": [
                          {"type": "function", "function": {"name": "search", "arguments": '{"query": "lmforge", "k": 3}'}}]}],
         "tools": [search], "conversations": None},
        {"messages": None, "tools": None,
         "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]},
    ]
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    stats = ReadStats()
    convs = list(read_conversations(path, stats=stats))
    assert [c.source for c in convs] == [f"{path}#row 0", f"{path}#row 1", f"{path}#row 2"]
    # The file's struct holds every tool's properties; each row gets back exactly its own.
    assert [c.tools for c in convs] == [[WEATHER_TOOL], [search], None]
    assert convs[0].messages == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", '{"city": "Paris"}')]},
        {"role": "tool", "content": "18C"}, {"role": "assistant", "content": "18 °C."}]
    assert convs[1].messages[1]["tool_calls"] == [call("search", '{"query": "lmforge", "k": 3}')]
    assert convs[2].messages == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    assert stats.by_format == {"openai": 2, "sharegpt": 1}
    for conv in convs:
        assert_renders_and_round_trips(conv)


def test_datasets_directories_read_the_train_split_unless_told(tmp_path):
    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_list([GLAIVE_ROW, GLAIVE_PLAIN_ROW]),
        "test": datasets.Dataset.from_list([XLAM_ROW]),
    })
    path = tmp_path / "glaive_dd"
    dd.save_to_disk(str(path))
    convs = list(read_conversations(path))
    assert [(c.source, c.messages, c.tools) for c in convs] == [
        (f"{path}#train/row 0", GLAIVE_WANT, GLAIVE_TOOLS), (f"{path}#train/row 1", GLAIVE_PLAIN_WANT, None)]
    assert [(c.source, c.messages) for c in read_conversations(path, split="test")] == [(f"{path}#test/row 0", XLAM_WANT)]
    with pytest.raises(LMForgeError, match=r"no split 'dev' \(splits: \['test', 'train'\]\)"):
        list(read_conversations(path, split="dev"))

    # A Sequence of structs comes back from datasets as a dict of lists: read as the list of turns.
    features = datasets.Features({"conversations": datasets.Sequence({"from": datasets.Value("string"),
                                                                       "value": datasets.Value("string")})})
    turns = HERMES_ROW["conversations"]
    ds = datasets.Dataset.from_dict({"conversations": [{"from": [t["from"] for t in turns],
                                                        "value": [t["value"] for t in turns]}]}, features=features)
    single = tmp_path / "hermes_ds"
    ds.save_to_disk(str(single))
    [conv] = read_conversations([single])
    assert (conv.source, conv.messages, conv.tools) == (f"{single}#row 0", HERMES_WANT, HERMES_TOOLS)


def test_a_directory_of_files_is_read_in_name_order(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "b.jsonl", [XLAM_ROW])
    (folder / "a.json").write_text(json.dumps([OPENAI_ROW]), encoding="utf-8")
    pq.write_table(pa.Table.from_pylist([PROMPT_COMPLETION_ROW]), folder / "c.parquet")
    (folder / "README.md").write_text("not data", encoding="utf-8")
    convs = list(read_conversations(folder))
    assert [(c.source, c.messages) for c in convs] == [
        (f"{folder / 'a.json'}#row 0", OPENAI_WANT), (f"{folder / 'b.jsonl'}:1", XLAM_WANT),
        (f"{folder / 'c.parquet'}#row 0", PROMPT_COMPLETION_WANT)]


def test_container_problems_are_clear_errors_even_when_skipping_bad_rows(tmp_path):
    with pytest.raises(LMForgeError, match="input path not found"):
        read_conversations(tmp_path / "missing.jsonl")  # at the call, before any row is read
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(LMForgeError, match=f"{re.escape(str(broken))}: not a readable parquet file"):
        list(read_conversations(broken, skip_bad_rows=True))
    not_list = tmp_path / "obj.json"
    not_list.write_text(json.dumps({"data": [OPENAI_ROW]}), encoding="utf-8")
    with pytest.raises(LMForgeError, match="holds a JSON dict, not a list of conversations"):
        list(read_conversations(not_list, skip_bad_rows=True))
    text = tmp_path / "notes.txt"
    text.write_text("hi", encoding="utf-8")
    with pytest.raises(LMForgeError, match="unsupported file type '.txt'"):
        read_conversations(text)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LMForgeError, match="no .jsonl, .json or .parquet files"):
        read_conversations(tmp_path / "empty")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    with pytest.raises(LMForgeError, match=f"{re.escape(str(deep))}: not valid JSON"):
        list(read_conversations(deep, skip_bad_rows=True))


# ----- bad rows

BAD_ROWS = {
    "not_json": ('{"messages": [{"role": "user"', "not valid JSON"),
    "not_an_object": ('["user", "hi"]', "expected a JSON object (one conversation), got list"),
    "unknown_layout": ({"text": "hello"}, "no known conversation layout has these keys: ['text']"),
    "two_layouts": ({"messages": OPENAI_LEGACY_ROW["messages"], "conversations": HERMES_ROW["conversations"]},
                    "fits several layouts (openai, sharegpt"),
    "unknown_role": ({"messages": [{"role": "bot", "content": "hi"}, {"role": "assistant", "content": "x"}]},
                     "messages[0].role is 'bot', not a known role. Use one of system, user, assistant, tool"),
    "unknown_speaker": ({"conversations": [{"from": "narrator", "value": "Once"}, {"from": "gpt", "value": "x"}]},
                        "conversations[0].from is 'narrator', not a known speaker"),
    "missing_content": ({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]},
                        "messages[0] (user) has no content"),
    "arguments_not_json": ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{city: Paris}"}}]}]},
        "messages[1].tool_calls[0] (f): the arguments are not valid JSON"),
    "arguments_not_an_object": ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}]}]},
        "(f): the arguments are a list, not a JSON object"),
    "call_without_name": ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"arguments": "{}"}}]}]}, "messages[1].tool_calls[0] has no function name"),
    "no_assistant_turn": ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]},
                          "no assistant turn (roles: ['system', 'user'])"),
    "hermes_block_not_json": ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value":
                              "<tool_call>\n{'name': 'f', 'arguments': {oops}}\n</tool_call>"}]},
                              "conversations[1] tool call 0: the tool call is not valid JSON"),
    "hermes_text_outside_responses": ({"conversations": [
        {"from": "human", "value": "hi"}, {"from": "gpt", "value": '<tool_call>{"name": "f"}</tool_call>'},
        {"from": "tool", "value": "<tool_response>{}</tool_response> and more"}, {"from": "gpt", "value": "ok"}]},
        "conversations[2] has text outside its <tool_response> blocks"),
    "hermes_block_unclosed": ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value":
                              '<tool_call>\n{"name": "f", "arguments": {}}'}]}, "without its </tool_call>"),
    "glaive_arguments_not_json": ({"system": "SYSTEM: hi", "chat": "USER: x\n\n\nASSISTANT: <functioncall> "
                                  "{\"name\": \"f\", \"arguments\": '{city: Oslo}'} <|endoftext|>"},
                                  "chat turn 1 (ASSISTANT) (f): the arguments are not valid JSON"),
    "xlam_answers_not_json": ({"query": "q", "answers": '[{"name": "f"', "tools": "[]"},
                              "answers is a string that is not JSON"),
    # nested too deeply for Python's json (a RecursionError): a bad row like any other
    "nested_too_deep": ('{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}",
                        "not valid JSON (maximum recursion depth exceeded"),
    "arguments_nested_too_deep": ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[" * 100_000 + "]" * 100_000}}]}]},
        "messages[1].tool_calls[0] (f): the arguments are not valid JSON (maximum recursion depth exceeded"),
    # NaN and Infinity are read by Python's json but are not JSON: never trained on as arguments
    "arguments_nan": ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": '{"a": NaN}'}}]}]},
        "messages[1].tool_calls[0] (f): the arguments cannot be written as JSON"),
    "arguments_infinity_object": ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", '
                                  '"tool_calls": [{"function": {"name": "f", "arguments": {"a": [-Infinity]}}}]}]}',
                                  "messages[1].tool_calls[0] (f): the arguments cannot be written as JSON"),
}


@pytest.mark.parametrize("case", BAD_ROWS)
def test_a_bad_row_names_its_file_and_line(tmp_path, case):
    row, fragment = BAD_ROWS[case]
    path = write_jsonl(tmp_path / "bad.jsonl", [OPENAI_ROW, row], blank_after_first=True)
    rows = read_conversations(path)
    assert next(rows).source == f"{path}:1"
    with pytest.raises(RowError) as e:
        next(rows)
    assert str(e.value).startswith(f"{path}:3")
    assert e.value.source == f"{path}:3"
    assert fragment in str(e.value)


def test_skip_bad_rows_counts_and_keeps_the_first_messages(tmp_path):
    bad = [row for row, _ in BAD_ROWS.values()]
    path = write_jsonl(tmp_path / "some_bad.jsonl", [OPENAI_ROW, *bad, XLAM_ROW])
    stats = ReadStats()
    convs = list(read_conversations(path, skip_bad_rows=True, stats=stats))
    assert [c.source for c in convs] == [f"{path}:1", f"{path}:{len(bad) + 2}"]
    assert (stats.rows, stats.kept, stats.bad) == (len(bad) + 2, 2, len(bad))
    assert stats.by_format == {"openai": 1, "xlam": 1}
    assert len(stats.bad_examples) == 5
    for lineno, (message, (_, fragment)) in enumerate(zip(stats.bad_examples, BAD_ROWS.values()), start=2):
        assert message.startswith(f"{path}:{lineno}") and fragment in message


def test_a_forced_format_that_does_not_fit_says_which_field_is_missing():
    with pytest.raises(RowError) as e:
        conversation_from_row(HERMES_ROW, "rows.json#row 4", format="openai")
    assert str(e.value).startswith("rows.json#row 4 (openai): no 'messages' field")


# ----- the sft kind's data: splits, rows too long, and what is reported


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from lmforge.tokenizer import train_tokenizer

    texts = [render_chat(want, "<s>", "</s>", add_generation_prompt=False) for _, _, want, _ in CASES.values()]
    return train_tokenizer(texts * 5, vocab_size=300, out_dir=tmp_path_factory.mktemp("tok"), show_progress=False)


def sft_splits(path: Path) -> tuple[list, list]:
    from lmforge.recipes.sft.data import SFTSettings, read_splits

    return read_splits(path, SFTSettings(), 0.2, 0, ReadStats())


def test_a_directory_with_held_out_files_but_no_train_file_is_refused(tmp_path):
    typo = tmp_path / "typo"  # was: all three files read, test rows trained on
    typo.mkdir()
    for name in ("trian.jsonl", "val.jsonl", "test.jsonl"):
        write_jsonl(typo / name, [OPENAI_ROW] * 3)
    with pytest.raises(LMForgeError, match=r"typo has no train.jsonl .*only held-out files \(test.jsonl, val.jsonl\)"):
        sft_splits(typo)
    only_val = tmp_path / "only_val"
    only_val.mkdir()
    write_jsonl(only_val / "Validation.jsonl", [OPENAI_ROW] * 3)
    with pytest.raises(LMForgeError, match=r"only_val has no train.jsonl .*\(Validation.jsonl\)"):
        sft_splits(only_val)
    # a directory of other files is read whole, val_fraction held out (docs/sft.md); one with splits by them
    shards = tmp_path / "shards"
    shards.mkdir()
    write_jsonl(shards / "part-0.jsonl", [OPENAI_ROW] * 5)
    write_jsonl(shards / "part-1.jsonl", [XLAM_ROW] * 5)
    train, val = sft_splits(shards)
    assert len(train) + len(val) == 10 and val
    write_jsonl(typo / "train.jsonl", [XLAM_ROW] * 2)
    train, val = sft_splits(typo)
    assert [c.source for c in train + val] == [f"{typo / 'train.jsonl'}:{i}" for i in (1, 2)] + [
        f"{typo / 'val.jsonl'}:{i}" for i in (1, 2, 3)]
    # the Hub's shard names count as their split: a test shard alone is refused, and never trained on
    hub = tmp_path / "hub"
    hub.mkdir()
    write_jsonl(hub / "test-00000-of-00001.jsonl", [OPENAI_ROW] * 3)
    with pytest.raises(LMForgeError, match=r"hub has no train.jsonl .*\(test-00000-of-00001.jsonl\)"):
        sft_splits(hub)
    write_jsonl(hub / "train-00000-of-00002.jsonl", [XLAM_ROW] * 2)
    write_jsonl(hub / "train-00001-of-00002.jsonl", [XLAM_ROW] * 2)
    train, val = sft_splits(hub)
    assert {c.source.rsplit(":", 1)[0] for c in train} == {str(hub / f"train-0000{i}-of-00002.jsonl") for i in (0, 1)}
    assert len(train) == 4 and not val


@pytest.mark.parametrize("kind, module, builder, kept", [
    ("sft", "lmforge.recipes.sft.data", "build_sft_data", "0 of 0 conversations kept"),
    ("reward", "lmforge.recipes.reward.data", "build_reward_data", "0 of 0 pairs kept; 0 tokens"),
])
def test_skipped_bad_rows_are_reported_when_no_row_is_left(tmp_path, tokenizer_dir, kind, module, builder, kept):
    import importlib

    from lmforge.config import load_config
    from lmforge.train.distributed import DistInfo

    path = write_jsonl(tmp_path / "bad.jsonl", ["{not json"])
    cfg = load_config(values={"kind": kind, "data": {"train_path": str(path), "tokenizer": str(tokenizer_dir),
                                                     "seq_len": 64}, "recipe": {"skip_bad_rows": True}})
    with pytest.raises(LMForgeError, match=rf"{kept}; 1 malformed rows skipped \(recipe.skip_bad_rows\); first: "
                                           rf"{re.escape(str(path))}:1: not valid"):
        getattr(importlib.import_module(module), builder)(cfg, DistInfo())


def test_a_row_too_long_for_seq_len_is_left_out_without_tokenizing_it(tmp_path, tokenizer_dir, monkeypatch):
    from lmforge import tokenizer as tokenizer_module
    from lmforge.posttrain.render import TOO_LONG, RenderStats, render_examples
    from lmforge.tokenizer import Tokenizer

    def row(text: str) -> dict:
        return {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]}

    tokenizer = Tokenizer.load(tokenizer_dir)
    most = tokenizer.max_chars(64)  # most // 2 characters are at least 96 tokens, more than 64
    path = write_jsonl(tmp_path / "rows.jsonl", [row("hi"), row("weather " * (most // 16)), row("weather " * 100_000)])
    encoded = []  # the characters the tokenizer is asked to encode, per text
    encode_texts = tokenizer_module._encode_texts  # what every encoding of text goes through
    monkeypatch.setattr(tokenizer_module, "_encode_texts",
                        lambda backend, texts: encoded.extend(map(len, texts)) or encode_texts(backend, texts))
    stats = RenderStats()
    examples = render_examples(tokenizer, list(read_conversations(path)), 64, stats=stats)
    assert most // 2 < max(encoded) < most  # the second row was tokenized (and measured); the 800,000 characters not
    assert [e.source for e in examples] == [f"{path}:1"]
    assert stats.skipped == {TOO_LONG: 2} and stats.untokenized == 1
    summary = stats.summary(64)
    assert f"2 skipped: {TOO_LONG}" in summary and f"longest {stats.longest} tokens" in summary
    assert "1 of them not tokenized: more characters than 64 tokens can hold" in summary
