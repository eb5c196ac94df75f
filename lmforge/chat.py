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
    return env.from_string(source)


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
        if m.get("content") is None and not m.get("tool_calls"):
            raise LMForgeError(f"messages[{i}] has no content")
    return messages


def render_chat(messages: list[dict[str, Any]], bos_token: str, eos_token: str, tools: list | None = None,
                add_generation_prompt: bool = True, template: str = CHAT_TEMPLATE) -> str:
    """The prompt text for ``messages`` (and ``tools``), ending with the assistant header."""
    check_messages(messages)
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


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Split generated text into its plain content and its well-formed tool calls.

    A block whose JSON does not parse, or lacks a string ``name`` / object ``arguments``, stays in
    the content as text: the caller then sees what the model wrote instead of a call that would fail.
    """
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
