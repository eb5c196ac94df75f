"""Refinement examples for HRGC's continue / refine / done head, built from real Go functions.

From one function (spec, plan, body) come states the head must tell apart, each with its label by
construction and the validator's message a refinement step is conditioned on:

* **done** — the real body: it parses and follows the plan;
* **continue** — the body cut after one of its top-level statements: unfinished;
* **refine** — a corruption of the body that the real parser rejects or that breaks the plan
  (the target is the real body): ``drop_brace`` (one ``{`` or ``}`` removed), ``delete_line`` (one
  line of a statement removed), ``swap_lines`` (two adjacent lines exchanged), ``rename_variable``
  (a variable renamed where the plan names it).

A corruption is kept only when it really fails validation (``validate``); one that still parses
and matches the plan is retried elsewhere and, failing that, dropped.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from lmforge.go_syntax import parse_body, statements_of, validate
from lmforge.recipes.hrgc.functions import GoFunction

CORRUPTIONS = ("drop_brace", "delete_line", "swap_lines", "rename_variable")
_TRIES = 8  # places tried per corruption before giving up on it


@dataclass(frozen=True)
class RefinementExample:
    spec: str
    plan: str
    attempt: str
    label: str  # continue | refine | done
    kind: str  # done | prefix | one of CORRUPTIONS
    message: str  # what the validator said about the attempt ("" when it passes)
    target: str  # the real body


def _body_lines(code: str) -> list[int]:
    """Indices of the lines strictly inside the braces that hold code (not blank)."""
    lines = code.split("\n")
    return [i for i in range(1, len(lines) - 1) if lines[i].strip()]


def _drop_brace(code: str, rng: random.Random) -> str | None:
    positions = [m.start() for m in re.finditer(r"[{}]", code)]
    if not positions:
        return None
    at = rng.choice(positions)
    return code[:at] + code[at + 1:]


def _delete_line(code: str, rng: random.Random) -> str | None:
    candidates = _body_lines(code)
    if len(candidates) < 2:
        return None
    lines = code.split("\n")
    del lines[rng.choice(candidates)]
    return "\n".join(lines)


def _swap_lines(code: str, rng: random.Random) -> str | None:
    lines = code.split("\n")
    pairs = [i for i in _body_lines(code) if i + 1 < len(lines) - 1 and lines[i + 1].strip()
             and lines[i].strip() != lines[i + 1].strip()]
    if not pairs:
        return None
    i = rng.choice(pairs)
    lines[i], lines[i + 1] = lines[i + 1], lines[i]
    return "\n".join(lines)


def _rename_variable(code: str, rng: random.Random, plan: str) -> str | None:
    """Rename one occurrence of a name the plan mentions (a declared or assigned variable)."""
    names = sorted({n for item in plan.split(" | ") for n in re.findall(r"\b([a-z]\w*)\b(?=[^|]*:?=)", item)
                    if n not in ("call", "if", "for", "range", "return", "var", "go", "defer", "switch")})
    if not names:
        return None
    name = rng.choice(names)
    spots = [m.start() for m in re.finditer(rf"\b{re.escape(name)}\b", code)]
    if not spots:
        return None
    at = rng.choice(spots)
    return code[:at] + name + "_x" + code[at + len(name):]


def corrupt(parser, fn: GoFunction, kind: str, rng: random.Random) -> tuple[str, str] | None:
    """``(attempt, validator message)`` for one corruption of ``fn.code`` that really fails
    validation, or None when this function offers no such place."""
    for _ in range(_TRIES):
        if kind == "rename_variable":
            attempt = _rename_variable(fn.code, rng, fn.plan)
        else:
            attempt = {"drop_brace": _drop_brace, "delete_line": _delete_line, "swap_lines": _swap_lines}[kind](
                fn.code, rng)
        if attempt is None:
            return None
        message = validate(parser, fn.spec, attempt, fn.plan)
        if message:
            return attempt, message
    return None


def prefix_cut(parser, fn: GoFunction, rng: random.Random) -> str | None:
    """The body cut right after one of its top-level statements (not the last): an unfinished attempt."""
    _, body, offset = parse_body(parser, fn.spec, fn.code)
    if body is None:
        return None
    statements = statements_of(body)
    if len(statements) < 2:
        return None
    cut = rng.choice(statements[:-1]).end_byte - offset
    return fn.code.encode("utf-8")[:cut].decode("utf-8") + "\n"


def refinement_examples(parser, fn: GoFunction, rng: random.Random) -> list[RefinementExample]:
    """The done state, a continue state (when the body has 2+ statements) and one refine state per
    corruption kind that applies; nothing when the real body does not validate on its own."""
    def example(attempt: str, label: str, kind: str, message: str) -> RefinementExample:
        return RefinementExample(fn.spec, fn.plan, attempt, label, kind, message, fn.code)

    if validate(parser, fn.spec, fn.code, fn.plan):
        return []  # the function does not stand alone (it cannot be the "done" reference)
    out = [example(fn.code, "done", "done", "")]
    prefix = prefix_cut(parser, fn, rng)
    if prefix is not None:
        out.append(example(prefix, "continue", "prefix", validate(parser, fn.spec, prefix, fn.plan)))
    for kind in CORRUPTIONS:
        found = corrupt(parser, fn, kind, rng)
        if found is not None:
            out.append(example(found[0], "refine", kind, found[1]))
    return out
