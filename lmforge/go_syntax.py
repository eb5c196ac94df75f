"""Go syntax, in one place: the tree-sitter parser, a function body's parse and its validator, the
plan (an outline of a body's top-level statements) and the AST similarity of two bodies.

HRGC (``lmforge.recipes.hrgc``) builds its data, validator and metrics on these; any kind that
scores Go code (a reward that checks code parses, for instance) uses the same functions.
"""

from __future__ import annotations

import difflib
import re

from lmforge.errors import LMForgeError

PLAN_VERSION = 1  # bump when plan_of changes: plans of different versions must not be mixed
MAX_ITEM_CHARS = 40  # longest expression text kept in one plan item


def go_parser():
    """A tree-sitter parser for Go."""
    try:
        import tree_sitter_go
        from tree_sitter import Language, Parser
    except ImportError as e:
        raise LMForgeError("lmforge data go-functions needs tree-sitter and tree-sitter-go: "
                           "pip install tree-sitter tree-sitter-go") from e
    return Parser(Language(tree_sitter_go.language()))


# ---- plans --------------------------------------------------------------------------------------
def _compact(text: str, limit: int = MAX_ITEM_CHARS) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= limit else text[:limit - 1] + "…"


def node_text(node) -> str:
    """The source text of a tree-sitter node."""
    return node.text.decode("utf-8")


def statements_of(block) -> list:
    """The statements directly inside a ``block`` node (comments and empty statements dropped)."""
    items = []
    for child in block.named_children:
        if child.type == "statement_list":
            items.extend(c for c in child.named_children if c.type not in ("comment", "empty_statement"))
        elif child.type not in ("comment", "empty_statement"):
            items.append(child)
    return items


def _call_of(node) -> str | None:
    """``call NAME`` when ``node`` is (or wraps a single) call expression."""
    while node is not None and node.type in ("expression_list", "parenthesized_expression", "unary_expression"):
        if node.named_child_count != 1:
            return None
        node = node.named_children[0]
    if node is not None and node.type == "call_expression":
        return "call " + _compact(node_text(node.child_by_field_name("function")))
    return None


def _value(node) -> str:
    return _call_of(node) or _compact(node_text(node))


def _outline(stmt) -> str:
    kind = stmt.type
    field = stmt.child_by_field_name
    if kind == "if_statement":
        init = field("initializer")
        item = "if " + (_outline(init) + "; " if init is not None else "") + _compact(node_text(field("condition")))
        body = statements_of(field("consequence"))
        if len(body) == 1 and body[0].type in ("return_statement", "break_statement", "continue_statement",
                                               "goto_statement"):
            item += " → " + body[0].type.removesuffix("_statement")
        if field("alternative") is not None:
            item += " else"
        return item
    if kind == "for_statement":
        clause = next((c for c in stmt.named_children if c.type != "block"), None)
        if clause is None:
            return "for ever"
        if clause.type == "range_clause":
            return "for range " + _compact(node_text(clause.child_by_field_name("right")))
        if clause.type == "for_clause":
            cond = clause.child_by_field_name("condition")
            return "for " + (_compact(node_text(cond)) if cond is not None else "ever")
        return "for " + _compact(node_text(clause))
    if kind in ("expression_statement", "go_statement", "defer_statement"):
        inner = stmt.named_children[0]
        prefix = {"go_statement": "go ", "defer_statement": "defer "}.get(kind, "")
        return prefix + _value(inner)
    if kind == "short_var_declaration":
        return f"{_compact(node_text(field('left')))} := {_value(field('right'))}"
    if kind == "assignment_statement":
        op = next(c for c in stmt.children if not c.is_named).type
        return f"{_compact(node_text(field('left')))} {op} {_value(field('right'))}"
    if kind == "return_statement":
        values = stmt.named_children
        return "return" + (" " + _value(values[0]) if values else "")
    if kind in ("expression_switch_statement", "type_switch_statement", "select_statement"):
        cases = sum(c.type in ("expression_case", "type_case", "communication_case", "default_case")
                    for c in stmt.named_children)
        head = {"expression_switch_statement": "switch", "type_switch_statement": "switch type",
                "select_statement": "select"}[kind]
        subject = field("value") if kind != "select_statement" else None
        subject_text = " " + _compact(node_text(subject)) if subject is not None else ""
        return f"{head}{subject_text} ({cases} case{'' if cases == 1 else 's'})"
    if kind in ("var_declaration", "const_declaration", "type_declaration"):
        names = [node_text(n) for spec in stmt.named_children for n in spec.children_by_field_name("name")]
        return kind.removesuffix("_declaration") + " " + _compact(", ".join(names))
    if kind in ("inc_statement", "dec_statement", "send_statement"):
        return _compact(node_text(stmt))
    if kind == "labeled_statement":
        inner = [c for c in stmt.named_children if c.type != "label_name"]
        return f"{node_text(field('label'))}: " + (_outline(inner[0]) if inner else "")
    if kind == "block":
        return "block"
    return kind.removesuffix("_statement")  # break, continue, goto, fallthrough


def plan_of(body) -> str:
    """The plan of a function body (a tree-sitter ``block``): one item per top-level statement, joined
    by `` | ``; the same body always gives the same plan."""
    return " | ".join(_outline(s) for s in statements_of(body))


# ---- parsing and validation ---------------------------------------------------------------------
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


# ---- similarity ---------------------------------------------------------------------------------
def node_kinds(parser, spec: str, code: str) -> list[str]:
    """Named syntax-node kinds of a body, depth first (``ERROR`` where it does not parse)."""
    _, body, _ = parse_body(parser, spec, code)
    if body is None:
        return []
    out, stack = [], [body]
    while stack:
        node = stack.pop()
        out.append(node.type)
        stack.extend(reversed(node.named_children))
    return out


def ast_similarity(parser, spec: str, code: str, reference: str) -> float:
    a, b = node_kinds(parser, spec, code), node_kinds(parser, spec, reference)
    if not a and not b:
        return 1.0
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()
