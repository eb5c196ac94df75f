"""Read chat and tool-calling datasets in their real-world layouts as one canonical conversation form.

Every row becomes a ``Conversation``: OpenAI-style ``messages`` (roles system / user / assistant /
tool; an assistant message may carry ``tool_calls``), OpenAI tool specs in ``tools``, and the
``source`` it came from (``data.jsonl:12``, ``data.parquet#row 7``, ``DIR#train/row 3``).

Layouts (``FORMATS``), detected per row from its keys (``detect_format``) or forced by name:

* ``openai``: ``{"messages": [...], "tools"?: [...]}``;
* ``prompt_completion``: ``{"prompt": str | messages, "completion": str | messages, "system"?}``;
* ``sharegpt``: ``{"conversations": [{"from": "human", "value": ...}, ...], "tools"?}``, with the
  Hermes function-calling conventions (``<tool_call>``, ``<tool_response>``, ``<tools>`` blocks);
* ``glaive``: glaive-function-calling-v2's ``{"system": "SYSTEM: ...", "chat": "USER: ..."}``;
* ``xlam``: Salesforce xLAM's ``{"query", "answers", "tools"}`` (JSON strings).

Tool-call arguments always come out as ``json.dumps(args, ensure_ascii=False)`` of a JSON object:
the text ``lmforge.chat.parse_tool_calls`` produces when serving, so training and serving agree.

Containers: ``.jsonl``, ``.json`` (a list of rows, or JSON Lines), ``.parquet``, a
``datasets.save_to_disk`` directory (a ``DatasetDict``'s ``train`` split unless ``split`` names
another), or a directory of ``.jsonl`` / ``.json`` / ``.parquet`` files (read in name order).
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.chat import ROLES, TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from lmforge.data.sources import source_kind
from lmforge.errors import LMForgeError

FORMATS = ("openai", "prompt_completion", "sharegpt", "glaive", "xlam")

# The keys that identify each layout (all must be present and not null), and the optional ones.
LAYOUT_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "openai": (("messages",), ("tools",)),
    "prompt_completion": (("prompt", "completion"), ("system", "tools")),
    "sharegpt": (("conversations",), ("system", "tools")),
    "glaive": (("chat",), ("system",)),
    "xlam": (("query", "answers"), ("tools",)),
}

# Other names for the canonical roles: OpenAI's newer "developer" and its older "function".
ROLE_ALIASES = {"developer": "system", "function": "tool"}
# ShareGPT speakers. "function_call" (LLaMA-Factory's tool-calling ShareGPT) is an assistant turn
# whose value is the call's JSON.
SHAREGPT_SPEAKERS = {
    "system": "system", "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "model": "assistant",
    "function_call": "assistant",
    "tool": "tool", "observation": "tool", "function_response": "tool",
}
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
# What json raises for what it cannot read or write: RecursionError for thousands of nested [ or {.
JSON_ERRORS = (ValueError, RecursionError)
_RECORD_BATCH = 1024  # rows per read from parquet / HF datasets
_BAD_EXAMPLES = 5


class RowError(LMForgeError):
    """One malformed row. The message starts with the row's source (``file:line`` or ``file#row N``)."""

    def __init__(self, message: str, source: str | None = None):
        super().__init__(message)
        self.source = source


@dataclass
class Conversation:
    messages: list[dict]
    tools: list[dict] | None
    source: str


@dataclass
class ReadStats:
    """Rows read, kept (by layout) and skipped as bad (with the first few messages)."""

    rows: int = 0
    kept: int = 0
    bad: int = 0
    by_format: Counter = field(default_factory=Counter)
    bad_examples: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"rows": self.rows, "kept": self.kept, "bad": self.bad,
                "by_format": dict(sorted(self.by_format.items())), "bad_examples": list(self.bad_examples)}

    def skipped(self) -> str:
        """The malformed rows ``skip_bad_rows`` left out, for a report ("" when none)."""
        if not self.bad:
            return ""
        return f"{self.bad:,} malformed rows skipped (recipe.skip_bad_rows); first: {self.bad_examples[0]}"


class _Problem(Exception):
    """What is wrong with a row, without its source (added by ``conversation_from_row``)."""


# --------------------------------------------------------------------------------------------------
# Public API


def read_conversations(paths: str | Path | Sequence[str | Path], format: str = "auto",
                       skip_bad_rows: bool = False, stats: ReadStats | None = None,
                       split: str | None = None) -> Iterator[Conversation]:
    """Conversations from every row of ``paths``, in order.

    A malformed row raises ``RowError`` (its source, the problem, a fix), or with ``skip_bad_rows``
    is counted in ``stats`` and skipped. Paths and ``format`` are checked here, before the first row.
    ``split`` picks a ``DatasetDict``'s split (default ``train``); other containers ignore it.
    """
    _check_format_name(format)
    files = _expand_paths(paths)
    return _read(files, format, skip_bad_rows, stats if stats is not None else ReadStats(), split)


def conversation_from_row(row: dict, source: str, format: str = "auto") -> Conversation:
    """The canonical conversation of one row; raises ``RowError`` naming ``source``."""
    return _convert(row, source, format)[1]


def detect_format(row: dict) -> str:
    """The layout of ``row`` from its keys; raises ``RowError`` listing the known layouts."""
    if not isinstance(row, dict):
        raise RowError(f"expected a JSON object (one conversation), got {_kind(row)}. {_LAYOUT_HINT}")
    try:
        return _detect(row)
    except _Problem as e:
        raise RowError(str(e)) from None


# --------------------------------------------------------------------------------------------------
# Rows to conversations


def _check_format_name(format: str) -> None:
    if format != "auto" and format not in FORMATS:
        raise LMForgeError(f"unknown conversation format {format!r}. Use 'auto' (detect each row's layout "
                           f"from its keys) or one of {', '.join(FORMATS)}.")


def _layout_list() -> str:
    return "; ".join(f"{name} {{{', '.join(req + tuple(k + '?' for k in opt))}}}"
                     for name, (req, opt) in LAYOUT_KEYS.items())


_LAYOUT_HINT = f"Known layouts (keys, ? = optional): {_layout_list()}."


def _present(row: dict) -> set[str]:
    # A null is an absent key: columnar files give every row every column of the file.
    return {k for k, v in row.items() if v is not None}


def _detect(row: dict) -> str:
    keys = _present(row)
    found = [name for name, (req, _) in LAYOUT_KEYS.items() if keys.issuperset(req)]
    if len(found) == 1:
        return found[0]
    if found:
        raise _Problem(f"the row fits several layouts ({', '.join(found)}; keys {sorted(keys)}). Pass "
                       "format=NAME to say which one it is.")
    raise _Problem(f"no known conversation layout has these keys: {sorted(keys)}. {_LAYOUT_HINT} "
                   "Rename the fields to one of these, or pass format=NAME.")


def _convert(row: Any, source: str, format: str) -> tuple[str, Conversation]:
    _check_format_name(format)
    if not isinstance(row, dict):
        raise RowError(f"{source}: expected a JSON object (one conversation), got {_kind(row)}. Fix or "
                       "delete that row.", source)
    fmt = None
    try:
        if format == "auto":
            fmt = _detect(row)
        else:
            fmt = format
            missing = [k for k in LAYOUT_KEYS[fmt][0] if row.get(k) is None]
            if missing:
                raise _Problem(f"no {' or '.join(map(repr, missing))} field (keys: {sorted(_present(row))}). "
                               f"Check format={fmt!r}, or use format='auto'. {_LAYOUT_HINT}")
        messages, tools = _PARSERS[fmt](row)
        if not any(m["role"] == "assistant" for m in messages):
            raise _Problem(f"the conversation has no assistant turn (roles: {[m['role'] for m in messages]}), "
                           "so there is nothing to train on. Check the role names, or drop the row.")
    except _Problem as e:
        where = f"{source} ({fmt})" if fmt else source
        raise RowError(f"{where}: {e}", source) from None
    return fmt, Conversation(messages, tools or None, source)


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


# ----- shared pieces: content, messages, tool calls, tool specs


def _content(value: Any, where: str, name: str = "content") -> str | None:
    """A message's text: a string, or OpenAI's list of text parts joined; None when absent."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise _Problem(f"{where}.{name} has a part that is not text ({str(part)[:80]}). Only "
                               '{"type": "text", "text": ...} parts are supported by a text model.')
            parts.append(part["text"])
        return "".join(parts)
    raise _Problem(f"{where}.{name} is a {_kind(value)}, not a string. Give the text as a string.")


def _records(value: Any, where: str) -> list:
    """A list of turns: also from a JSON string, or from a dict of equal-length lists (what a
    ``datasets`` ``Sequence`` of structs gives back) turned into a list of dicts."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except JSON_ERRORS as e:
            raise _Problem(f"{where} is a string that is not JSON ({e}). Give a list of turns.") from None
    if isinstance(value, dict) and value and all(isinstance(v, list) for v in value.values()):
        lengths = {len(v) for v in value.values()}
        if len(lengths) == 1:
            keys = list(value)
            value = [dict(zip(keys, items)) for items in zip(*value.values())]
    if not isinstance(value, list):
        raise _Problem(f"{where} is a {_kind(value)}, not a list of turns.")
    if not value:
        raise _Problem(f"{where} is empty. A conversation needs at least one user and one assistant turn.")
    return value


def _messages(value: Any, where: str) -> list[dict]:
    """OpenAI chat messages, checked and in canonical form."""
    out = []
    for i, m in enumerate(_records(value, where)):
        here = f"{where}[{i}]"
        if not isinstance(m, dict):
            raise _Problem(f"{here} is a {_kind(m)}, not an object with 'role' and 'content'.")
        role = m.get("role")
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in ROLES:
            raise _Problem(f"{here}.role is {m.get('role')!r}, not a known role. Use one of {', '.join(ROLES)} "
                           "('developer' and 'function' are read as system and tool).")
        content = _content(m.get("content"), here)
        calls = []
        if m.get("tool_calls"):
            if role != "assistant":
                raise _Problem(f"{here} is a {role} message with tool_calls; only assistant messages call tools.")
            listed = _records(m["tool_calls"], f"{here}.tool_calls")
            calls = [_openai_tool_call(c, f"{here}.tool_calls[{j}]") for j, c in enumerate(listed)]
        if isinstance(m.get("function_call"), dict) and role == "assistant":  # OpenAI's older single call
            fc = m["function_call"]
            calls.append(_tool_call(fc.get("name"), fc.get("arguments"), f"{here}.function_call"))
        if content is None and not calls:
            raise _Problem(f"{here} ({role}) has no content. Give it a 'content' string (an assistant "
                           "message may carry 'tool_calls' instead).")
        msg = _message(role, content or "", calls)
        if role == "tool":
            msg.update({k: m[k] for k in ("name", "tool_call_id") if isinstance(m.get(k), str)})
        out.append(msg)
    return out


def _message(role: str, content: str, calls: list[dict] | None = None) -> dict:
    msg = {"role": role, "content": content}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _openai_tool_call(call: Any, where: str) -> dict:
    if not isinstance(call, dict):
        raise _Problem(f"{where} is a {_kind(call)}, not an object like "
                       '{"type": "function", "function": {"name": ..., "arguments": ...}}.')
    if call.get("type", "function") != "function":
        raise _Problem(f"{where} is a {call.get('type')!r} call; only function calls are supported.")
    fn = call["function"] if isinstance(call.get("function"), dict) else call  # also the flat {"name", "arguments"}
    out = _tool_call(fn.get("name"), fn.get("arguments"), where)
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]  # kept: tool messages refer to it by tool_call_id
    return out


def _tool_call(name: Any, arguments: Any, where: str) -> dict:
    """A canonical tool call; ``arguments`` (an object, its JSON text, or absent) is re-dumped."""
    if not isinstance(name, str) or not name.strip():
        raise _Problem(f"{where} has no function name. Each call needs a \"name\" string and its "
                       "\"arguments\" object.")
    if arguments is None:
        args: Any = {}  # a call without arguments, as parse_tool_calls reads one
    elif isinstance(arguments, str):
        try:
            args = json.loads(arguments, strict=False)  # strict=False: raw newlines inside strings
        except JSON_ERRORS as e:
            raise _Problem(f"{where} ({name}): the arguments are not valid JSON ({e}): {arguments[:120]!r}. "
                           'Arguments must be a JSON object, e.g. {"city": "Paris"}.') from None
    else:
        args = arguments
    if not isinstance(args, dict):
        raise _Problem(f"{where} ({name}): the arguments are a {_kind(args)}, not a JSON object. "
                       'Arguments must be a JSON object, e.g. {"city": "Paris"} ({} for none).')
    try:
        text = json.dumps(args, ensure_ascii=False, allow_nan=False)
    except JSON_ERRORS as e:  # Python's json reads NaN and Infinity, but they are not JSON (nor what the server emits)
        raise _Problem(f"{where} ({name}): the arguments cannot be written as JSON ({e}). NaN and Infinity are not "
                       "JSON: use a number, a string or null.") from None
    return {"type": "function", "function": {"name": name, "arguments": text}}


def _tools(value: Any, where: str = "tools") -> list[dict] | None:
    """OpenAI tool specs from a list (or its JSON text) of specs or bare function definitions."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            value = _loads_lenient(value)
        except JSON_ERRORS as e:
            raise _Problem(f"{where} is a string that is not JSON ({e}). Give a JSON list of tool specs.") from None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        raise _Problem(f"{where} is a {_kind(value)}, not a list of tool specs.")
    return [_tool_spec(t, f"{where}[{i}]") for i, t in enumerate(value)] or None


def _tool_spec(tool: Any, where: str) -> dict:
    if not isinstance(tool, dict):
        raise _Problem(f"{where} is a {_kind(tool)}, not a tool spec object.")
    if isinstance(tool.get("function"), dict):
        fn = dict(tool["function"])
    else:  # a bare function definition {"name", "description", "parameters"}
        fn = {k: v for k, v in tool.items() if not (k == "type" and v == "function")}
    if not isinstance(fn.get("name"), str) or not fn["name"].strip():
        raise _Problem(f"{where} has no function name. A tool spec looks like {{\"type\": \"function\", "
                       "\"function\": {\"name\": ..., \"description\": ..., \"parameters\": {JSON schema}}}.")
    if isinstance(fn.get("parameters"), str):
        try:
            fn["parameters"] = json.loads(fn["parameters"])
        except JSON_ERRORS as e:
            raise _Problem(f"{where} ({fn['name']}): parameters are a string that is not JSON ({e}).") from None
    if "parameters" in fn and not isinstance(fn["parameters"], dict):
        raise _Problem(f"{where} ({fn['name']}): parameters must be a JSON schema object.")
    return {"type": "function", "function": fn}


# Glaive writes a call's arguments as a single-quoted string holding JSON:
# {"name": "f", "arguments": '{"a": 1}'}. The greedy (.*) runs to the last quote before the final brace.
_QUOTED_ARGUMENTS = re.compile(r"(\"arguments\"\s*:\s*)'(.*)'(\s*\}\s*)$", re.DOTALL)
_LITERAL_ERRORS = (ValueError, TypeError, SyntaxError, MemoryError, RecursionError)


def _loads_lenient(text: str) -> Any:
    """JSON, else one of the two non-JSON spellings that real tool-calling data uses: Glaive's
    single-quoted arguments string, and Hermes' Python dict literals (``{'name': 'f', 'arguments':
    {'a': True}}``). Raises one of ``JSON_ERRORS`` when it is none of these."""
    text = text.strip()
    try:
        return json.loads(text, strict=False)
    except JSON_ERRORS as e:
        error = e
    m = _QUOTED_ARGUMENTS.search(text)
    if m:
        try:
            return json.loads(text[:m.start()] + m.group(1) + json.dumps(m.group(2)) + m.group(3), strict=False)
        except JSON_ERRORS:
            pass
    try:
        value = ast.literal_eval(text)  # literals only: never runs code
        json.dumps(value)  # sets, bytes, complex numbers are not JSON
        return value
    except _LITERAL_ERRORS:
        raise error from None


def _call_objects(text: str, where: str) -> list[dict]:
    """The calls in one call block: an object ``{"name", "arguments"}`` or a list of them."""
    try:
        body = _loads_lenient(text)
    except JSON_ERRORS as e:
        raise _Problem(f"{where}: the tool call is not valid JSON ({e}): {text.strip()[:120]!r}. Write it as "
                       '{"name": ..., "arguments": {...}}.') from None
    body = body if isinstance(body, list) else [body]
    for item in body:
        if not isinstance(item, dict):
            raise _Problem(f"{where}: the tool call is a {_kind(item)}, not an object like "
                           '{"name": ..., "arguments": {...}}.')
    return [_tool_call(item.get("name"), item.get("arguments"), where) for item in body]


# ----- openai


def _openai(row: dict) -> tuple[list[dict], list[dict] | None]:
    # "functions" is the tool list of OpenAI's older function-calling API.
    return _messages(row["messages"], "messages"), _tools(row.get("tools", row.get("functions")))


# ----- prompt_completion


def _prompt_completion(row: dict) -> tuple[list[dict], list[dict] | None]:
    def side(name: str, role: str) -> list[dict]:
        value = row[name]
        if isinstance(value, str):
            return [_message(role, value)]
        if isinstance(value, (list, dict)):
            return _messages(value, name)
        raise _Problem(f"{name} is a {_kind(value)}; give a string or a list of messages.")

    messages = side("prompt", "user") + side("completion", "assistant")
    system = row.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise _Problem(f"system is a {_kind(system)}, not a string.")
        if messages[0]["role"] == "system":
            raise _Problem("the row has both a 'system' field and a system message in its prompt; keep one.")
        if system.strip():
            messages.insert(0, _message("system", system))
    return messages, _tools(row.get("tools"))


# ----- sharegpt (and Hermes function calling)

_CALL_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)
_RESPONSE_BLOCK = re.compile(r"<tool_response>(.*?)</tool_response>", re.DOTALL)
_TOOLS_BLOCK = re.compile(r"<tools>(.*?)</tools>", re.DOTALL)


def _sharegpt(row: dict) -> tuple[list[dict], list[dict] | None]:
    messages: list[dict] = []
    for i, turn in enumerate(_records(row["conversations"], "conversations")):
        where = f"conversations[{i}]"
        if not isinstance(turn, dict):
            raise _Problem(f"{where} is a {_kind(turn)}, not an object like {{\"from\": \"human\", \"value\": ...}}.")
        speaker = turn.get("from", turn.get("role"))  # some ShareGPT exports use role/content
        if not isinstance(speaker, str) or speaker not in SHAREGPT_SPEAKERS:
            raise _Problem(f"{where}.from is {speaker!r}, not a known speaker. Use one of "
                           f"{', '.join(SHAREGPT_SPEAKERS)}.")
        role = SHAREGPT_SPEAKERS[speaker]
        text = _content(turn.get("value", turn.get("content")), where, "value")
        if text is None:
            raise _Problem(f"{where} ({speaker}) has no value. Give each turn its text in 'value'.")
        if speaker == "function_call":
            messages.append(_message("assistant", "", _call_objects(text, where)))
        elif role == "assistant":
            messages.append(_hermes_assistant(text, where))
        elif role == "tool":
            messages.extend(_hermes_tool(text, where))
        else:
            messages.append(_message(role, text))

    system = row.get("system")  # LLaMA-Factory keeps the system prompt beside the turns
    if isinstance(system, str) and system.strip():
        if messages[0]["role"] == "system":
            raise _Problem("the row has both a 'system' field and a system turn; keep one.")
        messages.insert(0, _message("system", system))

    tools = _tools(row.get("tools"))
    if tools is None:  # Hermes lists the tools inside the system prompt instead
        messages, tools = _system_tools(messages)
    return messages, tools


def _hermes_assistant(text: str, where: str) -> dict:
    blocks = list(_CALL_BLOCK.finditer(text))
    rest = _CALL_BLOCK.sub("", text)
    if TOOL_CALL_OPEN in rest or TOOL_CALL_CLOSE in rest:
        raise _Problem(f"{where} has a {TOOL_CALL_OPEN} without its {TOOL_CALL_CLOSE} (or the reverse). Close "
                       "every tool call block.")
    if not blocks:
        return _message("assistant", text)
    calls = [c for j, b in enumerate(blocks) for c in _call_objects(b.group(1), f"{where} tool call {j}")]
    return _message("assistant", rest.strip(), calls)


def _hermes_tool(text: str, where: str) -> list[dict]:
    blocks = list(_RESPONSE_BLOCK.finditer(text))
    if not blocks:
        return [_message("tool", text)]
    if _RESPONSE_BLOCK.sub("", text).strip():
        raise _Problem(f"{where} has text outside its <tool_response> blocks. Put each result in its own block.")
    return [_message("tool", b.group(1).strip()) for b in blocks]


def _system_tools(messages: list[dict]) -> tuple[list[dict], list[dict] | None]:
    """Move the tools of ``<tools>...</tools>`` blocks in system messages into ``tools``.

    Hermes prompts also name the tag in prose ("within <tools></tools> XML tags"): an empty block
    is prose and stays."""
    tools: list[dict] = []
    out = []

    def take(block: re.Match) -> str:
        if not block.group(1).strip():
            return block.group(0)
        tools.extend(_tools_block(block.group(1), "the system prompt's <tools> block"))
        return ""

    for msg in messages:
        if msg["role"] != "system":
            out.append(msg)
            continue

        text = _TOOLS_BLOCK.sub(take, msg["content"])
        if text == msg["content"]:
            out.append(msg)
        elif text.strip():  # a system prompt that held only the tools is dropped
            out.append(_message("system", text.strip()))
    return out, tools or None


def _tools_block(text: str, where: str) -> list[dict]:
    """A ``<tools>`` block: one JSON list (or object), or one JSON object per line."""
    try:
        value = _loads_lenient(text)
    except JSON_ERRORS:
        try:
            value = [_loads_lenient(line) for line in text.splitlines() if line.strip()]
        except JSON_ERRORS as e:
            raise _Problem(f"{where} is neither a JSON list of tools nor one JSON object per line ({e}). "
                           "Fix the block, or give the tools in a 'tools' field.") from None
    return _tools(value, where) or []


# ----- glaive

_GLAIVE_TURN = re.compile(r"^(USER|ASSISTANT|FUNCTION RESPONSE):[ \t]*", re.MULTILINE)
_GLAIVE_ROLES = {"USER": "user", "ASSISTANT": "assistant", "FUNCTION RESPONSE": "tool"}
_FUNCTIONCALL = "<functioncall>"


def _glaive(row: dict) -> tuple[list[dict], list[dict] | None]:
    messages: list[dict] = []
    tools = None
    system = row.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise _Problem(f"system is a {_kind(system)}, not a string.")
        text, tools = _glaive_system(re.sub(r"^\s*SYSTEM:", "", system))
        if text:
            messages.append(_message("system", text))

    chat = row["chat"]
    if not isinstance(chat, str):
        raise _Problem(f"chat is a {_kind(chat)}, not a string of 'USER: ...' / 'ASSISTANT: ...' turns.")
    marks = list(_GLAIVE_TURN.finditer(chat))
    if not marks or chat[:marks[0].start()].strip():
        raise _Problem("chat does not start with a 'USER:', 'ASSISTANT:' or 'FUNCTION RESPONSE:' turn. "
                       "Each turn starts a line with its speaker.")
    for i, mark in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(chat)
        body = chat[mark.end():end].replace("<|endoftext|>", "").strip()
        role = _GLAIVE_ROLES[mark.group(1)]
        if role == "assistant" and _FUNCTIONCALL in body:
            text, *calls = body.split(_FUNCTIONCALL)
            where = f"chat turn {i} (ASSISTANT)"
            found = [c for call in calls
                     for c in _call_objects(call.replace("</functioncall>", ""), where)]
            messages.append(_message("assistant", text.strip(), found))
        else:
            messages.append(_message(role, body))
    return messages, tools


def _glaive_system(text: str) -> tuple[str, list[dict] | None]:
    """The system text around its function definitions (JSON objects one after another), and those
    definitions as tool specs."""
    start = text.find("{")
    if start < 0:
        return text.strip(), None
    decoder = json.JSONDecoder(strict=False)
    functions, pos = [], start
    while pos < len(text) and text[pos] == "{":
        try:
            fn, pos = decoder.raw_decode(text, pos)
        except JSON_ERRORS as e:
            raise _Problem(f"system: function definition {len(functions)} is not valid JSON ({e}). Fix it, "
                           "or move the text out of the system field.") from None
        functions.append(fn)
        while pos < len(text) and text[pos].isspace():
            pos += 1
    tools = [_tool_spec(fn, f"system function {i}") for i, fn in enumerate(functions)]
    rest = "\n".join(part for part in (text[:start].strip(), text[pos:].strip()) if part)
    return rest, tools


# ----- xlam


def _xlam(row: dict) -> tuple[list[dict], list[dict] | None]:
    query = row["query"]
    if not isinstance(query, str) or not query.strip():
        raise _Problem(f"query is {'empty' if isinstance(query, str) else 'a ' + _kind(query)}; it must be "
                       "the user's request as a string.")
    answers = _json_field(row["answers"], "answers")
    if isinstance(answers, dict):
        answers = [answers]
    if not isinstance(answers, list) or not answers:
        raise _Problem("answers must be a non-empty JSON list of calls [{\"name\": ..., \"arguments\": {...}}]; "
                       "a row without calls has no assistant reply to train on.")
    calls = []
    for j, answer in enumerate(answers):
        if not isinstance(answer, dict):
            raise _Problem(f"answers[{j}] is a {_kind(answer)}, not a call {{\"name\": ..., \"arguments\": {{...}}}}.")
        calls.append(_tool_call(answer.get("name"), answer.get("arguments"), f"answers[{j}]"))

    tools = None
    if row.get("tools") is not None:
        raw = _json_field(row["tools"], "tools")
        if not isinstance(raw, list):
            raise _Problem(f"tools is a {_kind(raw)}, not a JSON list of tools.")
        tools = [_xlam_tool(t, f"tools[{i}]") for i, t in enumerate(raw)]
    return [_message("user", query), _message("assistant", "", calls)], tools


def _json_field(value: Any, where: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except JSON_ERRORS as e:
        raise _Problem(f"{where} is a string that is not JSON ({e}). Fix the JSON text.") from None


def _xlam_tool(tool: Any, where: str) -> dict:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise _Problem(f"{where} is not a tool {{\"name\", \"description\", \"parameters\"}}.")
    params = _json_field(tool.get("parameters") or {}, f"{where}.parameters")
    if not isinstance(params, dict):
        raise _Problem(f"{where}.parameters is a {_kind(params)}, not an object.")
    # An argument may be called "type", so a JSON schema is told apart by its "type" being "object".
    if params.get("type") != "object":
        properties, required = {}, []
        for arg, spec in params.items():
            if not isinstance(spec, dict):
                raise _Problem(f"{where}.parameters.{arg} is a {_kind(spec)}, not {{\"type\", \"description\"}}.")
            schema, optional = _xlam_type(spec.get("type"))
            prop = dict(schema)
            if isinstance(spec.get("description"), str):
                prop["description"] = spec["description"]
            if "default" in spec:
                prop["default"] = spec["default"]
            elif not optional:
                required.append(arg)
            properties[arg] = prop
        params = {"type": "object", "properties": properties, "required": required}
    fn = {"name": tool["name"]}
    if isinstance(tool.get("description"), str):
        fn["description"] = tool["description"]
    fn["parameters"] = params
    return {"type": "function", "function": fn}


_SCHEMA_TYPES = {
    "str": "string", "string": "string", "text": "string", "date": "string", "datetime": "string",
    "int": "integer", "integer": "integer",
    "float": "number", "number": "number", "double": "number", "decimal": "number",
    "bool": "boolean", "boolean": "boolean",
    "list": "array", "array": "array", "tuple": "array", "set": "array", "sequence": "array",
    "dict": "object", "object": "object", "mapping": "object", "json": "object",
}


def _xlam_type(spelled: Any) -> tuple[dict, bool]:
    """The JSON schema of an xLAM type string ("str", "List[int]", "int, optional", ...) and whether
    it says optional. Types without a JSON counterpart (Union, Any, callable) get no "type"."""
    if not isinstance(spelled, str):
        return {}, False
    text = spelled.strip()
    optional = False
    if re.search(r",\s*optional\s*$", text, re.IGNORECASE):
        text, optional = re.sub(r",\s*optional\s*$", "", text, flags=re.IGNORECASE), True
    m = re.fullmatch(r"optional\[(.*)\]", text, re.IGNORECASE)
    if m:
        text, optional = m.group(1), True
    m = re.fullmatch(r"([\w.]+)\s*(?:\[(.*)\])?", text)
    if not m:
        return {}, optional
    base = _SCHEMA_TYPES.get(m.group(1).lower().rsplit(".", 1)[-1])
    if base is None:
        return {}, optional
    schema: dict = {"type": base}
    if base == "array" and m.group(2) and "," not in m.group(2):  # List[X]: items of X
        items, _ = _xlam_type(m.group(2))
        if items:
            schema["items"] = items
    return schema, optional


_PARSERS: dict[str, Callable[[dict], tuple[list[dict], list[dict] | None]]] = {
    "openai": _openai, "prompt_completion": _prompt_completion, "sharegpt": _sharegpt,
    "glaive": _glaive, "xlam": _xlam,
}


# --------------------------------------------------------------------------------------------------
# Containers to rows


HELD_OUT_SPLITS = ("val", "validation", "test")
# a split's file: train.jsonl, or a shard of it as the Hub names them (train-00000-of-00002.parquet, test_prefs...)
_SPLIT_NAME = re.compile(r"^(train|val|validation|test)(?:[-_.].*)?$")


def split_files(path: Path) -> tuple[list[Path], list[Path]] | None:
    """The train and val files of a directory laid out in splits (``train.jsonl`` + optional
    ``val.jsonl`` or ``validation.jsonl``; .json / .parquet too); None for any other path. A directory
    with held-out files (val, validation, test) but no train file is refused: read whole, as a
    directory of other files is, it would train on its held-out rows."""
    if not path.is_dir():
        return None
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in FILE_SUFFIXES)
    split = {p: m.group(1) for p in files if (m := _SPLIT_NAME.match(p.stem.lower()))}
    train = [p for p in files if split.get(p) == "train"]
    held = [p for p in files if split.get(p) in HELD_OUT_SPLITS]
    if not train:
        if held:
            raise LMForgeError(f"{path} has no train.jsonl (or train.json / train.parquet), only held-out files "
                               f"({', '.join(p.name for p in held)}), which are never trained on. Name the training "
                               "file train.jsonl, or give the file to train on.")
        return None
    return train, [p for p in held if split[p] != "test"]


def _expand_paths(paths: str | Path | Sequence[str | Path]) -> list[tuple[Path, str]]:
    """(file or dataset directory, container kind) for every input, directories expanded."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise LMForgeError("no input paths given. Pass a .jsonl, .json or .parquet file, a directory of "
                           "them, or a datasets directory.")
    out = []
    for raw in paths:
        path = Path(raw)
        kind = source_kind(path)  # raises for a missing path
        if kind == "directory":
            files = sorted(p for p in path.iterdir()
                           if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in FILE_SUFFIXES)
            if not files:
                raise LMForgeError(f"{path}: no .jsonl, .json or .parquet files in this directory (only its "
                                   "top level is read). Point at the folder that holds the data files.")
            out += [(f, _file_kind(f)) for f in files]
        elif kind in ("hf_dataset", "hf_dataset_dict", "jsonl", "parquet"):
            out.append((path, kind))
        else:
            out.append((path, _file_kind(path)))
    return out


def _file_kind(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in FILE_SUFFIXES:
        raise LMForgeError(f"{path}: unsupported file type {suffix or '(none)'!r}. Conversations are read from "
                           ".jsonl, .json and .parquet files and datasets.save_to_disk directories.")
    return suffix[1:]


def _read(files: list[tuple[Path, str]], format: str, skip_bad_rows: bool, stats: ReadStats,
          split: str | None, convert: Callable[[Any, str, str], tuple[str, Any]] = _convert) -> Iterator[Any]:
    """What ``convert(row, source, format)`` makes of each row: (layout, item); bad rows as ``read_conversations``
    says. ``lmforge.posttrain.preferences`` passes its own ``convert``."""
    for path, kind in files:
        for source, row in _ROW_READERS[kind](path, split):
            stats.rows += 1
            try:
                if isinstance(row, RowError):  # the container could not even decode this row
                    raise row
                fmt, item = convert(row, source, format)
            except RowError as e:
                if not skip_bad_rows:
                    raise
                stats.bad += 1
                if len(stats.bad_examples) < _BAD_EXAMPLES:
                    stats.bad_examples.append(str(e))
                continue
            stats.kept += 1
            stats.by_format[fmt] += 1
            yield item


_Rows = Iterator[tuple[str, Any]]  # (source, row) where row is a RowError when it could not be decoded


def _jsonl_rows(path: Path, split: str | None = None) -> _Rows:
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            source = f"{path}:{lineno}"
            try:
                yield source, json.loads(line)  # bytes: json detects UTF-8/16/32 and skips a BOM
            except JSON_ERRORS as e:  # JSONDecodeError, UnicodeDecodeError and RecursionError
                yield source, RowError(f"{source}: not valid JSON ({e}). Each line of a JSON Lines file must be "
                                       "one JSON object, one conversation; fix or delete that line.", source)


def _json_rows(path: Path, split: str | None = None) -> _Rows:
    data = path.read_bytes()
    try:
        rows = json.loads(data)
    except JSON_ERRORS as e:
        if _looks_like_jsonl(data):  # many .json files on the Hub are JSON Lines
            yield from _jsonl_rows(path)
            return
        raise LMForgeError(f"{path}: not valid JSON ({e}). A .json file must hold one JSON list of "
                           "conversations, or one JSON object per line.") from None
    if not isinstance(rows, list):
        raise LMForgeError(f"{path}: holds a JSON {_kind(rows)}, not a list of conversations. Put the rows in "
                           "a list, or write one per line to a .jsonl file.")
    for i, row in enumerate(rows):
        yield f"{path}#row {i}", row


def _looks_like_jsonl(data: bytes) -> bool:
    first = next((line for line in data.splitlines() if line.strip()), b"")
    try:
        return isinstance(json.loads(first), dict)
    except JSON_ERRORS:
        return False


def _drop_nulls(value: Any) -> Any:
    """Columnar files give every struct every field seen in the file, null where a row lacks it
    (a tool's schema gains the other tools' properties): drop those nulls."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _parquet_rows(path: Path, split: str | None = None) -> _Rows:
    # Imported here: pyarrow is slow to import and only parquet files need it.
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=_RECORD_BATCH)
    except (pa.ArrowException, OSError) as e:
        raise LMForgeError(f"{path}: not a readable parquet file ({e}). Check or re-export the file.") from None
    row = 0
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as e:
            raise LMForgeError(f"{path}: reading the rows from row {row} on failed ({e}). Check or re-export "
                               "the file.") from None
        if batch is None:
            return
        for record in batch.to_pylist():
            yield f"{path}#row {row}", _drop_nulls(record)
            row += 1


def _dataset_rows(path: Path, split: str | None = None, is_dict: bool = False) -> _Rows:
    try:
        import datasets
    except ImportError as e:
        raise LMForgeError(f"{path} is a Hugging Face dataset, and reading it needs the `datasets` package: "
                           "pip install 'lmforge[hf]' (or pip install datasets).") from e
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds for a damaged directory
        raise LMForgeError(f"{path}: not a readable datasets directory ({e}). Re-create it with "
                           "save_to_disk.") from None
    prefix = ""
    if is_dict:
        name = split or "train"  # a test split must never become training data by default
        if name not in loaded:
            raise LMForgeError(f"{path}: no split {name!r} (splits: {sorted(loaded)}). Pass split=NAME.")
        loaded, prefix = loaded[name], f"{name}/"
    row = 0
    for batch in loaded.iter(batch_size=_RECORD_BATCH):
        for values in zip(*batch.values()):
            yield f"{path}#{prefix}row {row}", _drop_nulls(dict(zip(batch, values)))
            row += 1


_ROW_READERS: dict[str, Callable[[Path, str | None], _Rows]] = {
    "jsonl": _jsonl_rows, "json": _json_rows, "parquet": _parquet_rows,
    "hf_dataset": _dataset_rows,
    "hf_dataset_dict": lambda path, split: _dataset_rows(path, split, is_dict=True),
}
