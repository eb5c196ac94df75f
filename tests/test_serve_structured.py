"""Structured outputs and forced tool calls through `lmforge serve` (official `openai` client, real server
on loopback): replies under response_format json_schema / json_object always parse and validate, and
tool_choice required / named always yields valid calls, constrained and free requests in one batch."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import jsonschema
import openai
import pytest

from .serve_helpers import ASK_TOOL, GREETING, HELLO, TOOLS, Server, train_chat_model

HANG = 120  # seconds: only a guard against a hang on a busy machine
ENDLESS_OBJECT = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
                  "$ref": "#/$defs/n"}
# Endless too, but only once allOf's branches are merged (an object that requires itself), which the compile-time
# check does not model: the grammar fails in the middle of the reply.
MERGED_ENDLESS = {"allOf": [{"type": "object"}, {"properties": {"c": {"$ref": "#"}}, "required": ["c"]}]}
NESTED_300 = {"type": "integer"}
for _ in range(300):
    NESTED_300 = {"type": "object", "properties": {"a": NESTED_300}, "required": ["a"]}
SCHEMA = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome", "Berlin"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    "where": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
    "required": ["city", "count", "ok", "tags", "where"]}
# Bounded arguments, so that every sampled call ends well inside max_tokens.
BOUNDED_TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository",
                                       "parameters": {"type": "object", "properties": {
                                           "path": {"type": "string", "maxLength": 12}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "list_dir", "parameters": {"type": "object", "properties": {
        "dir": {"enum": ["src", "docs"]}, "depth": {"type": "integer", "minimum": 1, "maximum": 3}},
        "required": ["dir", "depth"]}}}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # A longer context than the other serve tests' model: two tools' schemas take ~380 prompt tokens.
    return train_chat_model(tmp_path_factory.mktemp("chat"), n_positions=768)


@pytest.fixture(scope="module")
def client(checkpoint):
    server = Server(checkpoint, "--max-batch-size", "8")
    yield openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=HANG)
    server.stop()


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def function(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object"}}}


def test_json_schema_replies_always_parse_and_validate(client):
    """The model never learnt JSON: unconstrained, it answers with its greeting; constrained, every
    sampled reply is a valid document."""
    free = client.chat.completions.create(model="tiny", messages=GREETING, temperature=0)
    assert free.choices[0].message.content == HELLO
    r = client.chat.completions.create(model="tiny", messages=GREETING, temperature=1.0, n=8, seed=3,
                                       response_format=schema_format(SCHEMA), max_tokens=150)
    replies = [json.loads(c.message.content) for c in r.choices]
    for reply, choice in zip(replies, r.choices):
        jsonschema.validate(reply, SCHEMA)
        assert choice.finish_reason == "stop"
    assert len({json.dumps(x) for x in replies}) > 1  # sampled, not one fixed answer
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=GREETING, temperature=1.0, seed=4, stream=True, max_tokens=150,
        response_format=schema_format(SCHEMA)) if c.choices)
    jsonschema.validate(json.loads(streamed), SCHEMA)


def test_json_object_mode_and_the_developer_role(client):
    messages = [{"role": "developer", "content": "Answer in JSON."}, *GREETING]
    r = client.chat.completions.create(model="tiny", messages=messages, temperature=0.8, seed=1, n=4,
                                       response_format={"type": "json_object"}, max_tokens=120)
    for choice in r.choices:
        if choice.finish_reason == "stop":  # an open-ended object may run into max_tokens; a whole one parses
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.message.content.startswith("{")
    assert any(c.finish_reason == "stop" for c in r.choices)
    as_system = [{"role": "system", "content": "Answer in JSON."}, *GREETING]
    a = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=20)
    b = client.chat.completions.create(model="tiny", messages=as_system, temperature=0, max_tokens=20)
    assert a.choices[0].message.content == b.choices[0].message.content


def check_calls(choice, tools: list[dict], only: str | None = None) -> list[str]:
    assert choice.finish_reason == "tool_calls"
    specs = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    names = []
    for call in choice.message.tool_calls:
        assert call.function.name in specs and (only is None or call.function.name == only)
        jsonschema.validate(json.loads(call.function.arguments), specs[call.function.name])
        names.append(call.function.name)
    assert names
    return names


def test_tool_choice_required_always_calls_a_tool_with_valid_arguments(client):
    # The greeting is what the model says without a call; forced, it must call.
    r = client.chat.completions.create(model="tiny", messages=GREETING, tools=BOUNDED_TOOLS, tool_choice="required",
                                       temperature=1.0, n=8, seed=5, max_tokens=200)
    for choice in r.choices:
        check_calls(choice, BOUNDED_TOOLS)
    one = client.chat.completions.create(model="tiny", messages=GREETING, tools=BOUNDED_TOOLS, n=4, seed=6,
                                         tool_choice="required", parallel_tool_calls=False, temperature=1.0)
    assert all(len(check_calls(c, BOUNDED_TOOLS)) == 1 for c in one.choices)


def test_a_named_tool_choice_calls_that_tool(client):
    # The model learnt to open main.go with read_file; told to use list_dir, it does.
    named = {"type": "function", "function": {"name": "list_dir"}}
    r = client.chat.completions.create(model="tiny", messages=ASK_TOOL, tools=BOUNDED_TOOLS, tool_choice=named,
                                       temperature=1.0, n=4, seed=7, max_tokens=200)
    for choice in r.choices:
        assert set(check_calls(choice, BOUNDED_TOOLS, only="list_dir")) == {"list_dir"}
    learnt = client.chat.completions.create(model="tiny", messages=ASK_TOOL, tools=TOOLS, tool_choice="required",
                                            temperature=0)
    call = learnt.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("read_file", {"path": "main.go"})


def test_constrained_and_free_requests_share_a_batch(client):
    def free():
        return client.chat.completions.create(model="tiny", messages=GREETING, temperature=0).choices[0]

    def constrained():
        return client.chat.completions.create(model="tiny", messages=GREETING, temperature=1.0, seed=8,
                                              response_format=schema_format(SCHEMA), max_tokens=150).choices[0]

    # One after the other, the free request reuses the constrained one's prompt (the prefix cache):
    # the kept logits must be the model's, not the masked ones.
    constrained()
    assert free().message.content == HELLO
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        frees = [pool.submit(free) for _ in range(3)]
        masked = [pool.submit(constrained) for _ in range(3)]
        assert all(f.result().message.content == HELLO for f in frees)
        for m in masked:
            jsonschema.validate(json.loads(m.result().message.content), SCHEMA)


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": schema_format({"type": "array", "items": {"type": "integer"}, "uniqueItems": True})},
     "response_format", "response_format.json_schema.schema: "),
    ({"response_format": schema_format({"type": "array", "items": {"type": "integer"}, "uniqueItems": True})},
     "response_format", "uniqueItems"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "'schema'"),
    ({"response_format": {"type": "yaml"}}, "response_format", "json_object"),
    ({"tools": BOUNDED_TOOLS, "response_format": {"type": "json_object"}}, "response_format", "tool_choice"),
    ({"tools": BOUNDED_TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "exclude each other"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": BOUNDED_TOOLS}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "no 'tools'"),
    ({"tool_choice": "sometimes", "tools": BOUNDED_TOOLS}, "tool_choice", "\"required\""),
    # a probe found these compiled and replied "" with status 200: no value satisfies them
    ({"response_format": schema_format({"$ref": "#"})}, "response_format", "admits no value at all"),
    ({"response_format": schema_format({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                        "$ref": "#/$defs/a"})}, "response_format", "admits no value at all"),
    # and these were a 500 with llguidance's parser state once the reply entered the recursion: every value
    # of the part named holds another one without end
    ({"response_format": schema_format({"type": "array", "items": {"$ref": "#"}, "minItems": 1})},
     "response_format", "at #: no finite value"),
    ({"response_format": schema_format(ENDLESS_OBJECT)}, "response_format", "at #/$defs/n: no finite value"),
    ({"response_format": schema_format({"type": "object", "properties": {"x": {"$ref": "#/$defs/n"}},
                                        "$defs": ENDLESS_OBJECT["$defs"]})},  # optional, but a reply may go there
     "response_format", "at #/$defs/n: no finite value"),
    ({"tools": [function("f", ENDLESS_OBJECT)], "tool_choice": "required"}, "tools",
     "tools[0] (f) parameters cannot be used for constrained decoding: at #/$defs/n: no finite value"),
    # a tool named '</tool_call>' ended its own forced call and came back as content; OpenAI's rule for names
    ({"tools": [function("</tool_call>")], "tool_choice": "required"}, "tools[0].function.name",
     "must match ^[a-zA-Z0-9_-]{1,64}$"),
    ({"tools": [function("ok"), function("   ")]}, "tools[1].function.name", "must match"),
    ({"tools": [function("ok"), function("x" * 65)]}, "tools[1].function.name", "must match"),
    # these were reported as param 'tool_choice'
    ({"tools": [function("f"), function("f")], "tool_choice": "required"}, "tools", "two tools are named 'f'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": True}}], "tool_choice": "required"},
     "tools", "must be a JSON schema object"),
    # a chain of 3,000 $refs crashed the server process (llguidance's recursion), 300 levels were a 500
    ({"response_format": schema_format({"$defs": {**{f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(3000)},
                                                  "d3000": {"type": "integer"}}, "$ref": "#/$defs/d0"})},
     "response_format", "holds 3001 $refs, more than the 256"),
    ({"response_format": schema_format(NESTED_300)}, "response_format",
     "the JSON schema nests more than 128 levels of JSON"),
])
def test_constraints_that_cannot_be_honoured_are_a_400_naming_the_part(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=GREETING, **extra)
    error = info.value.body
    assert error["param"] == param and words in error["message"]


@pytest.mark.parametrize("extra, param", [
    ({"response_format": schema_format(MERGED_ENDLESS)}, "response_format"),
    ({"tools": [function("f", MERGED_ENDLESS)], "tool_choice": "required"}, "tools"),
])
def test_a_grammar_that_fails_mid_reply_is_a_client_error(client, extra, param):
    """A probe found a 500 (an error event in a stream) carrying llguidance's parser state."""
    body = {"model": "tiny", "messages": GREETING, "max_tokens": 100, "temperature": 0, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**body)
    error = info.value.body
    assert error["param"] == param and error["code"] == "invalid_schema"
    assert "constrained decoding failed" in error["message"] and "no finite value" in error["message"]
    assert "parser" not in error["message"] and "<state>" not in error["message"]
    # A stream has sent its 200 already: the error comes as its last event, then [DONE].
    r = httpx.post(f"{client.base_url}chat/completions", json={**body, "stream": True}, timeout=HANG)
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"] == error
    assert client.chat.completions.create(model="tiny", messages=GREETING, temperature=0).choices[0].message.content \
        == HELLO
