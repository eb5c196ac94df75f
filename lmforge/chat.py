"""The chat and tool-call format of lmforge models: one Jinja template, used everywhere.

A conversation is rendered as turns that open with the tokenizer's bos token and the role on its
own line, and close with its eos token::

    <s>system
    You are terse.</s>
    <s>user
    Open main.go</s>
    <s>assistant
    <tool_call>{"name": "read_file", "arguments": {"path": "main.go"}}</tool_call></s>
    <s>tool
    package main ...</s>
    <s>assistant
    It is the entry point.</s>

An assistant turn ends with eos, the token generation already stops at, and bos/eos are single
special tokens in every lmforge tokenizer. With ``tools`` the system turn lists each tool's JSON
schema and tells the model how to call one: a ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
block per call, the format the SFT stage trains to and ``parse_tool_calls`` reads back.

The template is stored as ``chat_template`` in ``tokenizer_config.json`` (and in GGUF exports), so
transformers' ``apply_chat_template`` and llama.cpp render exactly what ``render_chat`` renders.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from lmforge.errors import LMForgeError

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
ROLES = ("system", "user", "assistant", "tool")

# Every newline of the output comes from a '\n' expression: trim_blocks (which transformers and
# llama.cpp both set) would eat literal ones next to block tags.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set ns.system = messages[0]['content'] -%}"
    "{%- set messages = messages[1:] -%}"
    "{%- endif -%}"
    "{%- if tools -%}"
    "{%- if ns.system -%}{%- set ns.system = ns.system + '\\n\\n' -%}{%- endif -%}"
    "{%- set ns.system = ns.system + 'You can call these tools. To call one, reply with "
    "<tool_call>{\"name\": NAME, \"arguments\": {...}}</tool_call> for each call.\\nTools:' -%}"
    "{%- for tool in tools -%}"
    "{%- set ns.system = ns.system + '\\n' + ((tool['function'] if tool['function'] is defined else tool) | tojson) -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- if ns.system -%}"
    "{{ bos_token + 'system\\n' + ns.system + eos_token + '\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{ bos_token + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}{%- endif -%}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{%- set args = fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) -%}"
    "{{ '<tool_call>{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' + args + '}</tool_call>' }}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ eos_token + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ bos_token + 'assistant\\n' }}"
    "{%- endif -%}"
)


def _tojson(value: Any, indent: int | None = None) -> str:
    # transformers' variant: plain JSON, no HTML escaping, unicode kept.
    return json.dumps(value, ensure_ascii=False, indent=indent)


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str):
    # Compiling costs milliseconds, rendering microseconds: fine-tuning renders each conversation
    # several times, so each template is compiled once.
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception  # Hugging Face templates refuse conversations with it
    return env.from_string(source)


def _raise_exception(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate OpenAI-style chat messages; raises ``LMForgeError`` naming the first bad one."""
    if not isinstance(messages, list) or not messages:
        raise LMForgeError("'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise LMForgeError(f"messages[{i}] must be an object with 'role' and 'content'")
        if m.get("role") not in ROLES:
            raise LMForgeError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.get('role')!r}")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise LMForgeError(f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": "
                                       "...}) are supported by a text model")
                parts.append(part["text"])
            m = {**m, "content": "".join(parts)}
            messages[i] = m
        elif content is not None and not isinstance(content, str):
            raise LMForgeError(f"messages[{i}].content must be a string")
        if m.get("tool_calls") is not None:
            _check_tool_calls(m["tool_calls"], i)
        if m.get("content") is None and not m.get("tool_calls"):
            raise LMForgeError(f"messages[{i}] has no content")
    return messages


# Special-token spellings in what the caller wrote (message contents, tool calls, tool results, tool
# definitions) are text, never the special tokens: else a user could close their turn with "</s>" and
# forge a system or assistant turn. "Special" here means every control token (``Tokenizer.special_spellings``):
# the added tokens flagged special and, flagged or not, those the template and generation rely on (bos, eos,
# the tool-call and turn markers): many tokenizers have their eos as an added token without the flag.
# ``protect`` replaces each such spelling with MARK + a code character before the template runs, so in the
# rendered "markup" every special spelling left is the template's own; ``unmark`` turns the codes back into
# the spellings (Tokenizer.encode_markup encodes them as text).
MARK = "\U000F0000"  # a supplementary private-use character; MARK itself is escaped as MARK + MARK
_CODE0 = 0xF0001  # special k of the list given to ``protect`` is MARK + chr(_CODE0 + k)
_UNMARK_RE = re.compile(re.escape(MARK) + "(.)", re.DOTALL)


def protect(value: Any, specials: list[str]) -> Any:
    """``value`` (messages, tools: nested dicts, lists and strings) with every string's MARK and
    special-token spellings (``specials``) replaced by their marks; other values as they are."""
    pattern, codes = _protector(tuple(specials))

    def walk(v: Any) -> Any:
        if isinstance(v, str):
            return pattern.sub(lambda m: codes[m.group(0)], v)
        if isinstance(v, dict):  # keys too: a tool call's argument names, a schema's property names
            return {walk(k): walk(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(x) for x in v]
        return v
    return walk(value)


@functools.lru_cache(maxsize=8)
def _protector(specials: tuple[str, ...]) -> tuple[re.Pattern, dict[str, str]]:
    codes = {MARK: MARK + MARK, **{s: MARK + chr(_CODE0 + k) for k, s in enumerate(specials) if s}}
    spellings = sorted(codes, key=len, reverse=True)  # the longest first: "<|end|>" before "<|end"
    return re.compile("|".join(re.escape(s) for s in spellings)), codes


def unmark(markup: str, specials: list[str]) -> str:
    """The text of ``markup``: each mark back to what it stands for."""
    if MARK not in markup:
        return markup

    def one(m: re.Match) -> str:
        code = m.group(1)
        return MARK if code == MARK else specials[ord(code) - _CODE0]
    return _UNMARK_RE.sub(one, markup)


def _check_tool_calls(calls: Any, i: int) -> None:
    shape = (f"messages[{i}].tool_calls must be a list of {{\"id\": ..., \"type\": \"function\", \"function\": "
             "{\"name\": ..., \"arguments\": ...}} objects")
    if not isinstance(calls, list):
        raise LMForgeError(f"{shape}, got {type(calls).__name__}")
    for k, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{k}]"
        if not isinstance(call, dict):
            raise LMForgeError(f"{shape}; {where} is a {type(call).__name__}")
        fn = call["function"] if "function" in call else call
        if "function" in call and not isinstance(fn, dict):
            raise LMForgeError(f"{shape}; {where}.function is a {type(fn).__name__}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise LMForgeError(f"{shape}; {where}.function.name is missing or not a string")
        if not isinstance(fn.get("arguments"), (str, dict)):
            raise LMForgeError(f"{shape}; {where}.function.arguments must be a JSON object or its text")


def render_chat(messages: list[dict[str, Any]], bos_token: str, eos_token: str, tools: list | None = None,
                add_generation_prompt: bool = True, template: str = CHAT_TEMPLATE,
                protect_specials: list[str] | None = None) -> str:
    """The prompt text for ``messages`` (and ``tools``), ending with the assistant header.

    With ``protect_specials`` (``Tokenizer.special_spellings``: the spellings of its control tokens, whether
    flagged special or not) it is the markup instead: the messages' and tools' spellings of those tokens (and
    of ``MARK``) are marked (``protect``), so that only the template's own markers remain special; ``unmark``
    gives the text."""
    check_messages(messages)
    if protect_specials is not None:
        messages, tools = protect(messages, protect_specials), protect(tools, protect_specials)
    try:
        return _compiled_template(template).render(
            messages=messages, tools=tools or None, bos_token=bos_token, eos_token=eos_token,
            add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja2's TemplateError and the sandbox's errors
        raise LMForgeError(f"the chat template failed to render these messages: {e}") from e


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's form)
    id: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


def parse_tool_calls(text: str, cut: bool = False) -> tuple[str, list[ToolCall]]:
    """Split generated text into its plain content and its well-formed tool calls.

    A block whose JSON does not parse, or lacks a string ``name`` / object ``arguments``, stays in
    the content as text: the caller then sees what the model wrote instead of a call that would fail.
    ``cut``: the text was cut (by max_tokens or the context) before it ended: an unclosed last
    ``<tool_call>`` is a call the model did not finish, and is dropped instead of kept as content (a text
    cut inside the marker itself keeps those characters: "<" may as well begin "<b>");
    the complete calls before it are returned.
    """
    if cut:
        at = text.rfind(TOOL_CALL_OPEN)
        if at >= 0 and TOOL_CALL_CLOSE not in text[at:]:
            text = text[:at]
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for match in _CALL_RE.finditer(text):
        try:
            body = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        args = body.get("arguments", {}) if isinstance(body, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str) or not isinstance(args, dict):
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(ToolCall(body["name"], json.dumps(args, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}"))
    kept.append(text[last:])
    return "".join(kept).strip() if calls else text, calls


def choice_seed(seed: int, index: int) -> int:
    """The sampler's seed for choice ``index`` of a request with ``seed`` (``lmforge serve``'s n > 1), or for
    reply ``index`` of a ``lmforge chat`` conversation: a hash of both, so that different (seed, index) pairs do
    not share samples (``seed + index`` made choice 1 of seed 1 choice 0 of seed 2). Index 0 keeps the seed."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63
