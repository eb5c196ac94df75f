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

from lmforge.data.go_functions import GoFunction, plan_of, statements_of

LABELS = ("continue", "refine", "done")
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


def _signature(spec: str) -> str:
    """The spec without its doc comment (a signature may span lines)."""
    lines = spec.split("\n")
    while lines and lines[0].lstrip().startswith("//"):
        lines.pop(0)
    return "\n".join(lines)


def parse_body(parser, spec: str, code: str):
    """``(tree, body node or None, offset of the body in the parsed source)``."""
    prefix = "package p\n\n" + _signature(spec) + " "
    src = (prefix + code + "\n").encode("utf-8")
    tree = parser.parse(src)
    decl = next((n for n in tree.root_node.named_children
                 if n.type in ("function_declaration", "method_declaration")), None)
    body = decl.child_by_field_name("body") if decl is not None else None
    return tree, body, len(prefix.encode("utf-8"))


def _first_error(node):
    if node.type == "ERROR" or node.is_missing:
        return node
    for child in node.children:
        if child.has_error:
            return _first_error(child)
    return None


def validate(parser, spec: str, code: str, plan: str | None = None) -> str:
    """The validator's verdict on ``code`` as the body of ``spec``: "" when it parses (and, given a
    plan, follows it), else a message naming the first problem."""
    tree, body, offset = parse_body(parser, spec, code)
    if tree.root_node.has_error or body is None:
        error = _first_error(tree.root_node) or tree.root_node
        line = error.start_point[0] - 1  # the package clause and a blank line come first
        near = error.text.decode("utf-8", "replace").strip().split("\n")[0][:30]
        what = f"missing {error.type}" if error.is_missing else f"unexpected {near!r}" if near else "unexpected end"
        return f"syntax error: line {max(line, 1)} of the function: {what}"
    after = code.encode("utf-8")[body.end_byte - offset:].decode("utf-8", "replace").strip()
    if after:  # a body that closes early and more code after it: not one function body
        return f"syntax error: text after the function's closing brace: {after.split(chr(10))[0][:30]!r}"
    if plan is not None:
        got = plan_of(body)
        if got != plan:
            want_items, got_items = plan.split(" | "), got.split(" | ")
            i = next((i for i, (a, b) in enumerate(zip(want_items, got_items)) if a != b),
                     min(len(want_items), len(got_items)))
            want = want_items[i] if i < len(want_items) else "(nothing more)"
            have = got_items[i] if i < len(got_items) else "(nothing)"
            return f"does not follow the plan: step {i + 1} should be {want!r}, the code has {have!r}"
    return ""


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
