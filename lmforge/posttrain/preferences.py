"""Preference pairs: a prompt, a preferred (chosen) reply and a dispreferred (rejected) one.

The reward and dpo kinds read them; ``lmforge.posttrain.pairs`` renders and packs them.

**Reading** (``read_preferences``, ``read_preference_splits``): each row becomes a ``PreferencePair``.
Layouts (``PREFERENCE_FORMATS``), detected per row or forced by name:

* ``plain``: ``{"prompt": str, "chosen": str, "rejected": str}`` (the prompt is one user turn, or a
  message list; the replies are assistant text);
* ``ultrafeedback``: UltraFeedback-binarized's ``{"prompt": str, "chosen": [messages], "rejected":
  [messages]}`` where each side is the whole conversation (it repeats the prompt, then the reply),
  and TRL's conversational ``{"prompt": [messages], "chosen": [reply], "rejected": [reply]}``; without
  a prompt the two sides' shared messages are the prompt;
* ``hh_rlhf``: Anthropic hh-rlhf's ``{"chosen": str, "rejected": str}`` transcripts of ``\\n\\nHuman:`` /
  ``\\n\\nAssistant:`` turns that share all but their final Assistant turn.

Every layout may add ``tools`` (OpenAI specs), ``margin`` (a number) and ``kind`` (a string). A
reply's tool calls may be OpenAI ``tool_calls`` or ``<tool_call>{...}</tool_call>`` text; both come
out in OpenAI form exactly as the sft reader (``lmforge.posttrain.formats``) writes them. Containers,
bad-row errors (``RowError`` naming ``file:line``) and ``skip_bad_rows`` are the sft reader's.

**Generating** (``write_preference_dataset``): pairs built offline from the generated tool-calling
set (``lmforge.posttrain.toolcalls``): the chosen reply is the row's reference turn, the rejected one
a mistake of one of the ``KINDS``, drawn from the same split's argument values.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.chat import TOOL_CALL_OPEN
from lmforge.errors import LMForgeError
from lmforge.posttrain.formats import (
    ReadStats,
    RowError,
    _expand_paths,
    _hermes_assistant,
    _kind,
    _message,
    _messages,
    _present,
    _Problem,
    _read,
    _tools,
    split_files,
)
from lmforge.posttrain.toolcalls import (
    SPLITS,
    TOOL_NAMES,
    TOOLS,
    _arguments,
    _leaves,
    _mentions,
    _tool_result,
    _Values,
    call_message,
    case_of,
    json_equal,
    make_rows,
    reference_call,
    value_split,
    write_splits,
)


@dataclass
class PreferencePair:
    """One comparison. ``prompt`` is an OpenAI message list that ends where the reply begins (its last
    message is a user or tool turn); ``chosen`` and ``rejected`` are assistant messages (``content``
    and/or ``tool_calls``); ``tools`` the JSON schemas offered, if any; ``margin`` how much better
    the chosen reply is, when the data says (a Bradley-Terry margin), else None; ``kind`` what is
    wrong with the rejected reply when the data says (``wrong_tool``, ``wrong_arguments``,
    ``missed_call``, ``false_call`` ...), else ""; ``source`` is ``file:line``."""

    prompt: list[dict[str, Any]]
    chosen: dict[str, Any]
    rejected: dict[str, Any]
    tools: list[dict[str, Any]] | None = None
    margin: float | None = None
    kind: str = ""
    source: str = ""


PREFERENCE_FORMATS = ("plain", "ultrafeedback", "hh_rlhf")
LAYOUT_HINT = ("Known layouts: plain {prompt: text, chosen: text, rejected: text}; ultrafeedback {prompt?: text "
               "or messages, chosen: messages, rejected: messages}; hh_rlhf {chosen, rejected: '\\n\\nHuman: ... "
               "\\n\\nAssistant: ...' transcripts}; each may add tools, margin and kind.")


# --------------------------------------------------------------------------------------------------
# Reading


def read_preferences(paths: str | Path | Sequence[str | Path], format: str = "auto", skip_bad_rows: bool = False,
                     stats: ReadStats | None = None, split: str | None = None) -> list[PreferencePair]:
    """The pairs of every row of ``paths`` (files, directories of files, ``datasets`` directories), in
    order. A malformed row raises ``RowError`` naming its source, or with ``skip_bad_rows`` is counted
    in ``stats`` and skipped. ``split`` picks a ``DatasetDict``'s split (default ``train``)."""
    _check_format_name(format)
    files = _expand_paths(paths)
    stats = stats if stats is not None else ReadStats()
    return list(_read(files, format, skip_bad_rows, stats, split, convert=_convert))


def preference_from_row(row: Any, source: str, format: str = "auto") -> PreferencePair:
    """The pair of one row; raises ``RowError`` naming ``source``."""
    _check_format_name(format)
    return _convert(row, source, format)[1]


TRAIN_SPLITS = ("train", "train_prefs")  # train_prefs: UltraFeedback-binarized's DatasetDict
VAL_SPLITS = ("validation", "val", "test_prefs", "test")


def read_preference_splits(path: str | Path, format: str = "auto", skip_bad_rows: bool = False,
                           stats: ReadStats | None = None, val_fraction: float = 0.0,
                           seed: int = 0) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, val) pairs of ``path``: a directory with ``train.jsonl`` (+ ``val.jsonl``; .json and
    .parquet too), a ``DatasetDict`` directory (``train`` or ``train_prefs``; ``validation``, ``val``,
    ``test_prefs`` or ``test`` for val), or anything else ``read_preferences`` reads, of which
    ``val_fraction`` of the pairs (at least one, chosen by ``seed``) is held out. A directory with
    held-out files (val, test) but no train file is refused (``split_files``)."""
    if not 0 <= val_fraction < 1:
        raise LMForgeError(f"val_fraction must be >= 0 and < 1, got {val_fraction}")
    path = Path(path)
    stats = stats if stats is not None else ReadStats()

    def read(paths: Any, split: str | None = None) -> list[PreferencePair]:
        return read_preferences(paths, format, skip_bad_rows, stats, split)

    splits = split_files(path)
    if splits is not None:
        return read(splits[0]), read(splits[1]) if splits[1] else []
    if (path / "dataset_dict.json").is_file():
        names = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        train_name = next((n for n in TRAIN_SPLITS if n in names), None)
        if train_name is None:
            raise LMForgeError(f"{path}: no training split (splits: {names}). Name it one of "
                               f"{', '.join(TRAIN_SPLITS)}, or save that split on its own.")
        val_name = next((n for n in VAL_SPLITS if n in names), None)
        return read(path, train_name), read(path, val_name) if val_name else []
    pairs = read(path)
    if not val_fraction:
        return pairs, []
    held = np.random.default_rng(seed).random(len(pairs)) < val_fraction
    if len(pairs) > 1 and not held.any():
        held[-1] = True
    return [p for p, h in zip(pairs, held) if not h], [p for p, h in zip(pairs, held) if h]


def _check_format_name(format: str) -> None:
    if format != "auto" and format not in PREFERENCE_FORMATS:
        raise LMForgeError(f"unknown preference format {format!r}. Use 'auto' (detect each row's layout) or one "
                           f"of {', '.join(PREFERENCE_FORMATS)}.")


def _detect(row: dict) -> str:
    keys = _present(row)
    missing = [k for k in ("chosen", "rejected") if k not in keys]
    if missing:
        raise _Problem(f"no {' or '.join(map(repr, missing))} field (keys: {sorted(keys)}). {LAYOUT_HINT} "
                       "Rename the fields, or drop the row.")
    texts = [isinstance(row[k], str) for k in ("chosen", "rejected")]
    if all(texts):
        return "plain" if "prompt" in keys else "hh_rlhf"
    if not any(texts):
        return "ultrafeedback"
    raise _Problem(f"chosen is a {_kind(row['chosen'])} and rejected a {_kind(row['rejected'])}: give both replies "
                   "as text, or both as message lists.")


_REQUIRED = {"plain": ("prompt", "chosen", "rejected"), "ultrafeedback": ("chosen", "rejected"),
             "hh_rlhf": ("chosen", "rejected")}


def _convert(row: Any, source: str, format: str) -> tuple[str, PreferencePair]:
    if not isinstance(row, dict):
        raise RowError(f"{source}: expected a JSON object (one preference pair), got {_kind(row)}. Fix or delete "
                       "that row.", source)
    fmt = None
    try:
        if format == "auto":
            fmt = _detect(row)
        else:
            fmt = format
            missing = [k for k in _REQUIRED[fmt] if row.get(k) is None]
            if missing:
                raise _Problem(f"no {' or '.join(map(repr, missing))} field (keys: {sorted(_present(row))}). "
                               f"Check format={fmt!r}, or use format='auto'. {LAYOUT_HINT}")
        prompt, chosen, rejected = _PARSERS[fmt](row)
        _check_pair(prompt, chosen, rejected)
        pair = PreferencePair(prompt, chosen, rejected, _tools(row.get("tools")), _margin(row.get("margin")),
                              _label(row.get("kind")), source)
    except _Problem as e:
        where = f"{source} ({fmt})" if fmt else source
        raise RowError(f"{where}: {e}", source) from None
    return fmt, pair


def _check_pair(prompt: list[dict], chosen: dict, rejected: dict) -> None:
    if not prompt:
        raise _Problem("there is no prompt: nothing comes before the replies. Give a 'prompt', or start both "
                       "sides with the user's turn.")
    if prompt[-1]["role"] not in ("user", "tool"):
        raise _Problem(f"the prompt ends with a {prompt[-1]['role']} message; the replies must answer a user or "
                       "tool message.")
    for name, reply in (("chosen", chosen), ("rejected", rejected)):
        if not reply["content"].strip() and not reply.get("tool_calls"):
            raise _Problem(f"the {name} reply is empty. A pair needs two replies; drop the row.")
    if chosen == rejected:
        raise _Problem("chosen and rejected are the same reply, so there is nothing to prefer. Drop the row.")


def _margin(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _Problem(f"margin is {value!r}; it must be a finite number (how much better chosen is), or absent.")
    return float(value)


def _label(value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _Problem(f"kind is a {_kind(value)}, not a string naming what is wrong with the rejected reply.")
    return value


# ----- replies and message lists


def _reply_text(value: Any, where: str) -> dict:
    """An assistant reply given as text; ``<tool_call>`` blocks become OpenAI tool calls."""
    if not isinstance(value, str):
        raise _Problem(f"{where} is a {_kind(value)}, not the reply's text.")
    return _hermes_assistant(value, where)


def _side_messages(value: Any, where: str) -> list[dict]:
    """A message list in canonical form; assistant text with ``<tool_call>`` blocks becomes OpenAI calls."""
    out = []
    for i, m in enumerate(_messages(value, where)):
        if m["role"] == "assistant" and "tool_calls" not in m and TOOL_CALL_OPEN in m["content"]:
            m = _hermes_assistant(m["content"], f"{where}[{i}]")
        out.append(m)
    return out


def _first_difference(a: list[dict], b: list[dict]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ----- plain


def _plain(row: dict) -> tuple[list[dict], dict, dict]:
    prompt = row["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise _Problem("prompt is empty. Give the user's request.")
        messages = [_message("user", prompt)]
    elif isinstance(prompt, (list, dict)):
        messages = _side_messages(prompt, "prompt")
    else:
        raise _Problem(f"prompt is a {_kind(prompt)}; give the user's text or a list of messages.")
    return messages, _reply_text(row["chosen"], "chosen"), _reply_text(row["rejected"], "rejected")


# ----- ultrafeedback (and TRL's conversational layout)


def _ultrafeedback(row: dict) -> tuple[list[dict], dict, dict]:
    prompt = row.get("prompt")
    given: list[dict] | None = None
    if isinstance(prompt, str):
        if not prompt.strip():
            raise _Problem("prompt is empty. Give the user's request, or leave the field out.")
        given = [_message("user", prompt)]
    elif prompt is not None:
        given = _side_messages(prompt, "prompt")
    chosen_context, chosen = _conversation_side(row["chosen"], "chosen", given)
    rejected_context, rejected = _conversation_side(row["rejected"], "rejected", given)
    i = _first_difference(chosen_context, rejected_context)
    if i is not None:
        raise _Problem(f"chosen and rejected differ before their final reply (at message {i} after the prompt), so "
                       "they answer different prompts. Both must continue the same conversation.")
    return (given or []) + chosen_context, chosen, rejected


def _conversation_side(value: Any, where: str, given: list[dict] | None) -> tuple[list[dict], dict]:
    """(the messages before the reply that the prompt does not hold, the reply) of one side: a whole
    conversation that repeats the prompt, or what follows the prompt."""
    messages = _side_messages(value, where)
    if given is not None and messages[0]["role"] != "assistant":
        if _first_difference(messages[:len(given)], given) is not None:
            raise _Problem(f"{where} does not begin with the prompt's messages (its first is "
                           f"{messages[0]['role']}: {messages[0]['content'][:80]!r}). Give the whole conversation, "
                           "prompt first, or only the reply.")
        messages = messages[len(given):]
        if not messages:
            raise _Problem(f"{where} holds only the prompt; its last message must be the assistant's reply.")
    last = messages[-1]
    if last["role"] != "assistant":
        raise _Problem(f"{where} ends with a {last['role']} message; its last message must be the assistant's reply.")
    return messages[:-1], last


# ----- hh_rlhf

_HH_TURN = re.compile(r"(?:\A|\n\n)(Human|Assistant):")
_HH_ROLES = {"Human": "user", "Assistant": "assistant"}


def _hh_rlhf(row: dict) -> tuple[list[dict], dict, dict]:
    chosen = _transcript(row["chosen"], "chosen")
    rejected = _transcript(row["rejected"], "rejected")
    i = _first_difference(chosen[:-1], rejected[:-1])
    if i is not None:
        raise _Problem(f"chosen and rejected differ before their final Assistant turn (at turn {i}), so they answer "
                       "different prompts. The two transcripts must share every turn but the last.")
    return chosen[:-1], chosen[-1], rejected[-1]


def _transcript(text: Any, where: str) -> list[dict]:
    if not isinstance(text, str):
        raise _Problem(f"{where} is a {_kind(text)}, not a '\\n\\nHuman: ... \\n\\nAssistant: ...' transcript.")
    marks = list(_HH_TURN.finditer(text))
    if not marks or text[:marks[0].start()].strip():
        raise _Problem(f"{where} does not start with a '\\n\\nHuman:' turn ({text[:60]!r}). An hh-rlhf transcript "
                       "is '\\n\\nHuman: ...' and '\\n\\nAssistant: ...' turns.")
    messages = []
    for i, mark in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        messages.append(_message(_HH_ROLES[mark.group(1)], text[mark.end():end].strip()))
    if messages[-1]["role"] != "assistant":
        raise _Problem(f"{where} ends with a Human turn; the transcript must end with the Assistant's reply.")
    return messages


_PARSERS = {"plain": _plain, "ultrafeedback": _ultrafeedback, "hh_rlhf": _hh_rlhf}


# --------------------------------------------------------------------------------------------------
# The generated set: pairs from the tool-calling rows of ``lmforge.posttrain.toolcalls``

FORMAT_VERSION = 1
KINDS = ("wrong_tool", "wrong_arguments", "missed_call", "false_call", "ignored_result")
KIND_DOC = {
    "wrong_tool": "a call to another offered tool, with arguments of the right types for it",
    "wrong_arguments": "the right tool with one required argument changed to another value or left out",
    "missed_call": "a plain text reply where a tool call was needed",
    "false_call": "a tool call where a plain answer was right (no tool needed, or the result is already there)",
    "ignored_result": "after a tool result, an answer that mentions none of the values the result adds",
}
# The mistakes that each case of row (toolcalls.CASES) can make.
CASE_KINDS = {
    "single_call": ("wrong_tool", "wrong_arguments", "missed_call"),
    "call_after_chat": ("wrong_tool", "wrong_arguments", "missed_call"),
    "tool_result_answer": ("ignored_result", "false_call"),
    "no_call": ("false_call",),
}
_MISSED_CALL = ("Sorry, I can't help with that.", "I don't have access to that.", "Sure, done!",
                "I will take care of {value} for you.", "I can't check {value} right now.",
                "Let me know if there is anything else about {value}.")
_NON_ANSWERS = ("I have checked that for you.", "The tool has finished.", "Done. Anything else?",
                "I got a result back.", "All set.")


def make_preference_pairs(rows: list[dict[str, Any]], seed: int, split: str) -> list[dict[str, Any]]:
    """One pair per tool-calling row of ``split`` (``toolcalls.make_rows``): the prompt is the row but its
    last turn, chosen is that turn, rejected a mistake of a kind the row's case allows (``CASE_KINDS``),
    picked by ``seed``. Argument values come from ``split``'s share of the pools only."""
    if split not in SPLITS:
        raise LMForgeError(f"unknown split {split!r}; use one of: {', '.join(SPLITS)}")
    rng = random.Random(f"lmforge-preferences-{seed}-{split}")
    values = _Values(split)
    pairs = []
    for row in rows:
        case = case_of(row)
        kind = rng.choice(CASE_KINDS[case])
        rejected = _REJECTED[kind](row, rng, values)
        pairs.append({"prompt": row["messages"][:-1], "chosen": [row["messages"][-1]], "rejected": [rejected],
                      "tools": row["tools"], "kind": kind, "case": case})
    return pairs


def _call_of(message: dict) -> tuple[str, dict]:
    return reference_call(message["tool_calls"][0])


def _plausible_call(tool: str, rng: random.Random, values: _Values) -> dict:
    """A call to ``tool`` with arguments of the right types (its optional ones half the time)."""
    params = TOOLS[tool]["function"]["parameters"]
    optional = tuple(k for k in params["properties"] if k not in params["required"] and rng.random() < 0.5)
    return call_message(tool, _arguments(tool, rng, values, optional, {}))


def _wrong_tool(row: dict, rng: random.Random, values: _Values) -> dict:
    name, _ = _call_of(row["messages"][-1])
    others = [t["function"]["name"] for t in row["tools"] if t["function"]["name"] != name]
    return _plausible_call(rng.choice(others), rng, values)


def _wrong_arguments(row: dict, rng: random.Random, values: _Values) -> dict:
    name, args = _call_of(row["messages"][-1])
    key = rng.choice(TOOLS[name]["function"]["parameters"]["required"])
    wrong = dict(args)
    if rng.random() < 1 / 3:
        del wrong[key]
    else:
        while json_equal(wrong[key], args[key]):
            wrong[key] = _arguments(name, rng, values, (), {})[key]
    return call_message(name, wrong)


def _missed_call(row: dict, rng: random.Random, values: _Values) -> dict:
    name, args = _call_of(row["messages"][-1])
    value = args[TOOLS[name]["function"]["parameters"]["required"][0]]
    return _message("assistant", rng.choice(_MISSED_CALL).format(value=value))


def _false_call(row: dict, rng: random.Random, values: _Values) -> dict:
    if case_of(row) == "tool_result_answer":  # the call again, its result already there
        return call_message(*_call_of(row["messages"][-3]))
    return _plausible_call(rng.choice([t["function"]["name"] for t in row["tools"]]), rng, values)


def _ignored_result(row: dict, rng: random.Random, values: _Values) -> dict:
    name, args = _call_of(row["messages"][-3])
    result = json.loads(row["messages"][-2]["content"])
    # What the result tells beyond the request (a stock's symbol is both): none of it may appear.
    told = [v for v in _leaves(result) if not any(json_equal(v, a) for a in args.values())]
    if rng.random() < 0.5:  # an answer of the right shape with made-up values
        _, answer = _tool_result(name, args, rng)
        if not any(_mentions(answer, v) for v in told):
            return _message("assistant", answer)
    return _message("assistant", rng.choice(_NON_ANSWERS))


_REJECTED = {"wrong_tool": _wrong_tool, "wrong_arguments": _wrong_arguments, "missed_call": _missed_call,
             "false_call": _false_call, "ignored_result": _ignored_result}


def write_preference_dataset(out_dir: str | Path, n_train: int = 2000, n_val: int = 200, n_test: int = 300,
                             seed: int = 0, overwrite: bool = False) -> dict[str, Any]:
    """Write ``OUT/{train,val,test}.jsonl`` (pairs in the ``ultrafeedback`` layout: ``prompt`` messages,
    ``chosen`` / ``rejected`` one-reply lists, ``tools``, ``kind``, ``case``) and ``OUT/meta.json``;
    returns the meta dict. The prompts are those of ``write_tool_call_dataset`` with the same seed."""
    def describe(pairs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
        return {
            "format": "lmforge-preferences",
            "version": FORMAT_VERSION,
            "seed": seed,
            "counts": {split: len(p) for split, p in pairs.items()},
            "kinds": {split: dict(sorted(Counter(x["kind"] for x in p).items())) for split, p in pairs.items()},
            "cases": {split: dict(sorted(Counter(x["case"] for x in p).items())) for split, p in pairs.items()},
            "kind_doc": KIND_DOC,
            "tools": TOOL_NAMES,
            "value_split": value_split(),
        }

    return write_splits(out_dir, {"train": n_train, "val": n_val, "test": n_test},
                        lambda split, n: make_preference_pairs(make_rows(split, n, seed), seed, split), describe,
                        "preference dataset", overwrite)
