"""Grammar-constrained decoding: JSON mode, JSON schemas and forced tool calls, by masking logits.

A ``GrammarCompiler`` is built once per (tokenizer, model vocabulary size). It compiles a request's
constraint into a ``Grammar`` (cached, LRU, by the spec's JSON text): ``json_object()`` (any JSON
object), ``json_schema(schema)`` (a reply that parses and validates against ``schema``) or
``tool_calls(tools, name)`` (one or more ``<tool_call>{"name": N, "arguments": ARGS}</tool_call>``
blocks, the text ``lmforge.chat``'s template writes for a call, byte for byte, then eos). Each
request gets its own ``Matcher`` (``grammar.matcher()``): every step it writes the tokens it allows
into its row of a batch bitmask (``fill``), ``apply_bitmask`` sets the other logits of the
constrained rows to -inf (the free rows of the batch are left as they are), and the sampled token is
fed back (``accept``). When the grammar is complete only the eos token is allowed (``is_done``);
eos is allowed exactly when the grammar can end (``can_end``). Special tokens other than eos, and
the ids a model's padded vocabulary has beyond the tokenizer's, are never allowed.

JSON is written the way ``json.dumps`` writes it (and the chat template writes tool arguments): one
line, ", " between items and ": " after keys, no other whitespace. A small model then stays in the
format it was trained on and cannot loop on whitespace.

The engine is llguidance (https://github.com/guidance-ai/llguidance): the schema support is its own
(see ``SUPPORTED``); a schema it cannot compile raises ``LMForgeError`` naming the part that failed
(a JSON pointer into the schema) and why. benchmarks/constrained_decoding.py measures it beside
xgrammar.

Typical use in a decode loop (``B`` rows, some constrained)::

    compiler = GrammarCompiler(tokenizer, model.config.vocab_size)
    grammar = compiler.json_schema(schema)           # at request time: a bad schema fails here
    matcher = grammar.matcher()                      # one per request
    bitmask = new_bitmask(max_batch, model.config.vocab_size)
    ...each step:
    matcher.fill(bitmask, row)                       # for each constrained row (or fill_bitmask)
    apply_bitmask(logits, bitmask, rows)             # logits [B, V], masked in place
    token = sample(logits)[row]
    matcher.accept(token)                            # False: the token was not allowed
"""

from __future__ import annotations

import copy
import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from lmforge.errors import LMForgeError

# What llguidance's JSON-schema compiler implements (its docs/json_schema.md); anything else that
# constrains values ("uniqueItems", "not", "if", "contains", "propertyNames", "dependentRequired",
# "unevaluatedProperties", ...) is refused. Annotations ("title", "description", "default",
# "examples", "$comment", ...) and unknown "x-..." keys are ignored.
SUPPORTED = ("type, properties, required, additionalProperties, patternProperties (disjoint patterns), "
             "items, prefixItems, minItems, maxItems, enum, const, anyOf, allOf, oneOf (when its branches "
             "cannot overlap), $ref to $defs/definitions in the schema, minLength, maxLength, pattern (no "
             "look-around), format (date-time, date, time, duration, email, hostname, ipv4, ipv6, uuid, uri), "
             "minimum, maximum, exclusiveMinimum, exclusiveMaximum, multipleOf, minProperties/maxProperties "
             "(only when every listed property is required)")

ITEM_SEPARATOR, KEY_SEPARATOR = ", ", ": "  # json.dumps' defaults, what the chat template writes
# Top-level options of llguidance's JSON compiler (the schema's own "x-guidance" is dropped): compact
# one-line JSON, and no option that would loosen the schema (lenient ignores unsupported keywords).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ITEM_SEPARATOR, "key_separator": KEY_SEPARATOR,
                 "lenient": False, "coerce_one_of": False}
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"  # lmforge.chat's

# Keywords whose value is one subschema, a name -> subschema map, or a list of subschemas: how
# the error locator and the strict rewrite walk a schema.
_ONE = ("additionalProperties", "items", "additionalItems", "contains", "propertyNames", "not", "if", "then",
        "else", "unevaluatedItems", "unevaluatedProperties")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


def _llguidance():
    try:
        import llguidance  # not llguidance.torch: importing it compiles a kernel with torch.compile (~3 s)
    except ImportError as e:  # pragma: no cover - a dependency of lmforge
        raise LMForgeError("constrained decoding needs the llguidance package: pip install 'llguidance>=1.0'") from e
    return llguidance


def _canonical(value: Any) -> str:
    # Keys keep their order: the order of "properties" is the order the reply writes them in.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _pointer(path: Sequence[str | int]) -> str:
    return "#" + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


def _subschemas(schema: Any, path: tuple = (), defs: bool = True):
    """(path, subschema) of ``schema`` and every schema inside it, parents before children (without
    the ``$defs`` / ``definitions`` entries unless ``defs``)."""
    if not isinstance(schema, dict):
        return
    yield path, schema
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            yield from _subschemas(schema[key], (*path, key), defs)
    for key in _MAP:
        if isinstance(schema.get(key), dict) and (defs or key not in ("$defs", "definitions")):
            for name, sub in schema[key].items():
                yield from _subschemas(sub, (*path, key, name), defs)
    for key in _LIST:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                yield from _subschemas(sub, (*path, key, i), defs)


def _resolve(schema: dict[str, Any], ref: Any) -> Any:
    """The subschema a local ``$ref`` ("#", "#/$defs/name", any JSON pointer) names; None if none."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    node: Any = schema
    for part in ref[2:].split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _finite(sub: Any, schema: dict[str, Any], finite: set[str]) -> bool:
    """Whether ``sub`` (a part of ``schema``) admits a finite value, given that the ``$ref`` targets in
    ``finite`` do and the others do not. Only recursion is judged: whatever it does not model (false,
    patterns, bounds, how allOf branches merge) counts as admitting one, so it never refuses a schema
    that has a finite value."""
    if not isinstance(sub, dict):
        return True
    ref = sub.get("$ref")
    if isinstance(ref, str) and ref not in finite and _resolve(schema, ref) is not None:
        return False
    if "const" in sub or "enum" in sub:
        return True

    def each(key: str) -> list:
        return sub[key] if isinstance(sub.get(key), list) else []

    if not all(_finite(s, schema, finite) for s in each("allOf")):
        return False
    if any(each(key) and not any(_finite(s, schema, finite) for s in each(key)) for key in ("anyOf", "oneOf")):
        return False
    types = sub.get("type", "null")  # no type: any, null among them
    for kind in [types] if isinstance(types, str) else types if isinstance(types, list) else ["null"]:
        if kind == "object" and isinstance(sub.get("required", []), list):
            props = sub.get("properties") if isinstance(sub.get("properties"), dict) else {}
            other = True if sub.get("patternProperties") else sub.get("additionalProperties", True)
            if all(_finite(props.get(name, other) if isinstance(name, str) else True, schema, finite)
                   for name in sub.get("required", [])):
                return True
        elif kind == "array":
            least = sub.get("minItems", 0) if isinstance(sub.get("minItems", 0), int) else 0
            prefix = each("prefixItems") or each("items")
            rest = sub.get("additionalItems" if isinstance(sub.get("items"), list) else "items", True)
            if all(_finite(prefix[i] if i < len(prefix) else rest, schema, finite)
                   for i in range(min(least, len(prefix) + 1))):
                return True
        else:
            return True
    return False


def _endless(schema: dict[str, Any]) -> str | None:
    """The JSON pointer of a part of ``schema`` that a reply may reach (the root, or a $ref target) and
    that admits no finite value, every value of it holding another through $ref (``{"type": "array",
    "items": {"$ref": "#"}, "minItems": 1}``); None when there is none. llguidance compiles such a
    schema, and its matcher fails once a reply enters that part."""
    users: dict[str, list[str]] = {"#": []}  # each $ref target a reply can reach: the targets that refer to it
    todo = ["#"]
    while todo:
        ref = todo.pop()
        for _, sub in _subschemas(_resolve(schema, ref), defs=False):
            target = sub.get("$ref")
            if isinstance(target, str) and _resolve(schema, target) is not None:
                if target not in users:
                    users[target] = []
                    todo.append(target)
                users[target].append(ref)
    finite: set[str] = set()
    todo = list(users)
    while todo:  # the least fixed point: a target admits a finite value once the targets it needs do
        ref = todo.pop()
        if ref not in finite and _finite(_resolve(schema, ref), schema, finite):
            finite.add(ref)
            todo.extend(users[ref])  # only these can change
    endless = [ref for ref in users if ref not in finite]
    return endless[-1] if endless else None


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``schema`` where an object schema that lists its ``properties`` (and requires no
    other) allows no others unless it says so (``additionalProperties: false`` where it is unset) —
    what OpenAI's strict mode asks of a schema, and what keeps a small model from inventing keys. It
    validates a subset of what ``schema`` validates. Left open, where schemas are merged and a closed
    one would shut out the other's properties: objects without ``properties`` (any object), ones with
    ``patternProperties`` / ``unevaluatedProperties`` / ``allOf`` / ``anyOf`` / ``oneOf`` / ``$ref``
    beside their properties, ``allOf`` branches and the ``$defs`` they refer to, and the ``anyOf`` /
    ``oneOf`` branches of a schema that has properties of its own."""
    schema = copy.deepcopy(schema)
    merged = ("allOf", "anyOf", "oneOf", "$ref")
    skip: set[int] = set()
    merged_refs: set[str] = set()
    for _, sub in _subschemas(schema):
        for key in ("allOf", "anyOf", "oneOf"):
            branches = [b for b in sub.get(key, []) if isinstance(b, dict)] if isinstance(sub.get(key), list) else []
            if key == "allOf" or any(k in sub for k in ("properties", "required", "additionalProperties")):
                skip.update(id(b) for b in branches)
                merged_refs.update(b["$ref"] for b in branches if isinstance(b.get("$ref"), str))
    for path, sub in _subschemas(schema):
        if _pointer(path) in merged_refs:
            skip.add(id(sub))
    for _, sub in _subschemas(schema):
        props = sub.get("properties")
        required = sub.get("required", [])
        if (id(sub) in skip or not isinstance(props, dict) or not isinstance(required, list)
                or any(k in sub for k in ("additionalProperties", "patternProperties", "unevaluatedProperties",
                                          *merged))
                or any(name not in props for name in required)):
            continue
        sub["additionalProperties"] = False
    return schema


def _clean_error(message: str) -> str:
    message = " ".join(line.strip() for line in message.strip().splitlines() if line.strip())
    unimplemented = re.fullmatch(r"Unimplemented keys: \[(.*)\]", message)
    if unimplemented:
        keys = unimplemented.group(1).replace('"', "")
        return (f"unsupported keyword{'s' if ',' in keys else ''} {keys} (constrained decoding implements: "
                f"{SUPPORTED})")
    if message.startswith("Unknown format:"):
        return (f"unsupported string format {message.split(':', 1)[1].strip()!r} (supported: date-time, date, "
                "time, duration, email, hostname, ipv4, ipv6, uuid, uri)")
    if message.startswith("oneOf constraints are not supported"):
        return "oneOf whose branches can overlap is not supported; use anyOf (or make the branches exclusive)"
    return message


class Grammar:
    """A compiled constraint; ``matcher()`` gives each request its own state."""

    def __init__(self, kind: str, source: str, template: Any, compiler: GrammarCompiler):
        self.kind = kind  # "json_object" | "json_schema" | "tool_calls"
        self.source = source  # the llguidance grammar text
        self._template = template  # a fresh matcher, copied for each request (about 1 µs)
        self._compiler = compiler

    def matcher(self) -> Matcher:
        return Matcher(self._template.deep_copy(), self._compiler)

    def __repr__(self) -> str:
        return f"Grammar({self.kind}, {len(self.source)} chars)"


class Matcher:
    """One request's place in its grammar. Used by one thread at a time (the engine's)."""

    def __init__(self, matcher: Any, compiler: GrammarCompiler):
        self._m = matcher
        self._words = compiler.bitmask_words
        self.tokens = 0  # accepted so far (eos included)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (``new_bitmask``'s layout: bit
        ``t % 32`` of word ``t // 32`` is token ``t``)."""
        _check_bitmask(bitmask, self._words)
        if not 0 <= row < bitmask.shape[0]:
            raise IndexError(f"row {row} is outside the bitmask's {bitmask.shape[0]} rows")
        self._m.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * self._words * 4, self._words * 4)

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False when the grammar does not allow it (the matcher then stays in
        error: ``error`` says why, and ``fill`` allows only eos)."""
        ok = self._m.consume_token(int(token))
        if ok:
            self.tokens += 1
        return ok

    @property
    def is_done(self) -> bool:
        """The grammar is complete (or failed): only eos can follow."""
        return self._m.is_stopped()

    @property
    def can_end(self) -> bool:
        """eos is allowed now: what was accepted is a whole reply (more may still be allowed, e.g.
        another tool call)."""
        return self._m.is_accepting()

    @property
    def error(self) -> str | None:
        return self._m.get_error() or None if self._m.is_error() else None

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (speculative decoding, a stop string cut)."""
        if n > self.tokens or not self._m.rollback(n):
            raise ValueError(f"cannot roll back {n} tokens ({self.tokens} accepted)")
        self.tokens -= n

    def reset(self) -> None:
        """Back to the start of the grammar."""
        self._m.reset()
        self.tokens = 0


class GrammarCompiler:
    """Compiles constraints for one tokenizer and model vocabulary; thread-safe (requests compile on
    the HTTP threads, where a bad schema becomes a 400; matchers run on the engine thread)."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, cache_size: int = 128):
        llg = _llguidance()
        vocab_size = tokenizer.vocab_size if vocab_size is None else int(vocab_size)
        if vocab_size < tokenizer.vocab_size:
            raise LMForgeError(f"the model's vocabulary ({vocab_size}) is smaller than its tokenizer's "
                               f"({tokenizer.vocab_size}): they do not belong together")
        self.vocab_size = vocab_size
        self.bitmask_words = (vocab_size + 31) // 32
        self.eos_id = tokenizer.eos_id
        # The tokenizer.json text: llguidance reads the vocabulary, the byte-level decoder and which
        # added tokens are special (those never match text). Ids past the tokenizer's are never allowed.
        self._tokenizer = llg.LLTokenizer(tokenizer._backend.to_str(), n_vocab=vocab_size, eos_token=self.eos_id)
        self._cache: OrderedDict[tuple, Grammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    # ---- the constraints -----------------------------------------------------------------------------
    def json_object(self) -> Grammar:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return self._cached(("json_object",), lambda: self._json_grammar({"type": "object"}, "json_object"))

    def json_schema(self, schema: dict[str, Any], strict: bool = True) -> Grammar:
        """A JSON value that validates against ``schema``. ``strict``: an object schema that lists
        its properties allows no others unless it says so (``strict_schema``; without it the schema
        is read as JSON Schema reads it, where unlisted properties are allowed by default)."""
        if not isinstance(schema, dict):
            raise LMForgeError(f"the JSON schema must be a JSON object, got {type(schema).__name__}")
        _check_size(schema, "the JSON schema")
        key = ("json_schema", strict, self._key(schema, "the JSON schema"))
        return self._cached(key, lambda: self._json_grammar(self._prepared(schema, strict), "json_schema"))

    def tool_calls(self, tools: list[dict[str, Any]], name: str | None = None, parallel: bool = True,
                   strict: bool = True, max_calls: int | None = None) -> Grammar:
        """One call (several with ``parallel``) of the ``tools`` (OpenAI's ``tools`` entries, or bare
        ``{"name", "parameters"}`` functions), or of the tool ``name`` only: each call is
        ``<tool_call>{"name": NAME, "arguments": ARGS}</tool_call>``, ARGS validating against its tool's
        ``parameters`` (any JSON object for a tool without them); then eos. ``strict`` as in
        ``json_schema``, for each tool's parameters. ``max_calls`` bounds the calls of a parallel reply
        (a model that repeats its call stops there; None: only max_tokens bounds them)."""
        if max_calls is not None and max_calls < 1:
            raise LMForgeError(f"max_calls must be >= 1, got {max_calls}")
        if isinstance(tools, list):  # each tool's parameters compile on their own
            for i, tool in enumerate(tools):
                _check_size(tool, f"tools[{i}]")
        calls = 1 if not parallel else max_calls
        functions = self._functions(tools)
        if name is not None:
            if name not in functions:
                raise LMForgeError(f"tool_choice names the function {name!r}, which is not among the tools "
                                   f"({', '.join(map(repr, functions)) or 'none'})")
            functions = {name: functions[name]}
        key = ("tool_calls", name, calls, strict, self._key(tools, "tools"))
        return self._cached(key, lambda: self._tools_grammar(functions, calls, strict))

    # ---- compiling -------------------------------------------------------------------------------------
    @staticmethod
    def _key(spec: Any, what: str) -> str:
        try:
            return _canonical(spec)
        except (TypeError, ValueError) as e:
            raise LMForgeError(f"{what} must be plain JSON ({e})") from e

    def _cached(self, key: tuple, build) -> Grammar:
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        grammar = build()  # outside the lock: two threads may compile the same spec, both results are fine
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    @staticmethod
    def _prepared(schema: dict[str, Any], strict: bool) -> dict[str, Any]:
        schema = {k: v for k, v in schema.items() if k != "x-guidance"}  # no loosening options from the client
        return strict_schema(schema) if strict else schema

    def _json_grammar(self, schema: dict[str, Any], kind: str, where: str = "the JSON schema") -> Grammar:
        llg = _llguidance()
        source = llg.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        grammar = self._build(kind, source, lambda message: self._locate(schema, message, where))
        _check_finite(schema, where)
        return grammar

    def _build(self, kind: str, source: str, explain) -> Grammar:
        llg = _llguidance()
        matcher = llg.LLMatcher(self._tokenizer, source, log_level=0)
        if matcher.is_error():
            raise LMForgeError(explain(matcher.get_error()))
        # A grammar that allows nothing at its start (a schema whose $ref leads back to itself before any
        # value: {"$ref": "#"}) compiles, and its reply would be empty; llguidance stops such a matcher
        # at its first mask.
        first = matcher.deep_copy()
        mask = torch.zeros(self.bitmask_words, dtype=torch.int32)
        first.unsafe_compute_mask_ptr(mask.data_ptr(), self.bitmask_words * 4)
        if first.is_stopped() and not first.is_accepting():
            raise LMForgeError("it admits no value at all: a $ref leads back to itself before any value is "
                               "written (e.g. {\"$ref\": \"#\"}, or two $defs naming each other); give each "
                               "recursion a value to start with (an object, an array)")
        return Grammar(kind, source, matcher, self)

    def _check(self, schema: dict[str, Any]) -> str:
        """llguidance's error for ``schema`` alone, "" when it compiles."""
        llg = _llguidance()
        try:
            source = llg.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        except ValueError as e:
            return str(e)
        return llg.LLMatcher.validate_grammar(source, self._tokenizer)

    def _locate(self, schema: dict[str, Any], message: str, where: str) -> str:
        """The error message for ``schema``: llguidance's reason, and the deepest subschema that fails
        alone with the same reason (its JSON pointer); the root when none does."""
        found: tuple = ()
        subs = list(_subschemas(schema))
        if len(subs) <= 500:  # each check costs ~0.2-1 ms; only a failed compile pays it
            defs = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)}
            for path, sub in subs[1:]:
                if len(path) > len(found) and self._check({**defs, **sub}) == message:
                    found = path
        unsat = re.search(r"required property '([^']*)' is unsatisfiable", message)
        located = dict(subs).get(found, schema)
        if unsat and isinstance(located.get("properties"), dict) and unsat.group(1) in located["properties"]:
            found = (*found, "properties", unsat.group(1))
            message = "no value can satisfy this required property's schema"
        return f"{where} cannot be used for constrained decoding: at {_pointer(found)}: {_clean_error(message)}"

    def _functions(self, tools: Any) -> dict[str, dict[str, Any]]:
        if not isinstance(tools, list) or not tools:
            raise LMForgeError("tool calls need a non-empty list of tools")
        functions: dict[str, dict[str, Any]] = {}
        for i, tool in enumerate(tools):
            fn = tool.get("function", tool) if isinstance(tool, dict) else None
            name = fn.get("name") if isinstance(fn, dict) else None
            if not isinstance(name, str) or not name or any(ord(c) < 32 for c in name):
                raise LMForgeError(f"tools[{i}]: a function needs a \"name\" (a non-empty string without "
                                   "control characters)")
            if name in functions:
                raise LMForgeError(f"tools[{i}]: two tools are named {name!r}")
            params = fn.get("parameters")
            if params is None or params == {}:
                params = {"type": "object"}  # a tool without parameters: any JSON object
            if not isinstance(params, dict):
                raise LMForgeError(f"tools[{i}] ({name}): \"parameters\" must be a JSON schema object")
            kind = params.get("type", "object")
            if kind != "object" and kind != ["object"]:
                raise LMForgeError(f"tools[{i}] ({name}): \"parameters\" must describe an object (type "
                                   f"\"object\"), got type {kind!r}: arguments are always a JSON object")
            functions[name] = {"index": i, "parameters": {**params, "type": "object"}}
        return functions

    def _tools_grammar(self, functions: dict[str, dict[str, Any]], calls: int | None, strict: bool) -> Grammar:
        # A Lark grammar for the fixed text, one JSON-schema grammar per tool's arguments (each its own
        # document: "$ref": "#/$defs/..." in a tool's parameters resolve in them). The text is the
        # chat template's: '<tool_call>{"name": ' + json name + ', "arguments": ' + args + '}</tool_call>'.
        rules, schemas, grammars = [], {}, []
        for j, (name, fn) in enumerate(functions.items()):
            schemas[j] = params = self._prepared(fn["parameters"], strict)
            self._key(params, f"tools[{fn['index']}] ({name}) parameters")
            head = json.dumps(name, ensure_ascii=False) + ", " + json.dumps("arguments") + KEY_SEPARATOR
            rules.append(f"tool_{j}: {_lark_string(head)} @args_{j}")
            grammars.append({"name": f"args_{j}", "json_schema": {**params, "x-guidance": _JSON_OPTIONS}})
        opening = TOOL_CALL_OPEN + "{" + json.dumps("name") + KEY_SEPARATOR
        repeat = "call+" if calls is None else "call" if calls == 1 else f"call{{1,{calls}}}"
        alternatives = " | ".join(f"tool_{j}" for j in schemas)
        call = f"call: {_lark_string(opening)} ({alternatives}) {_lark_string('}' + TOOL_CALL_CLOSE)}"
        lark = "\n".join([f"start: {repeat}", call, *rules])
        source = json.dumps({"grammars": [{"lark_grammar": lark}, *grammars]}, ensure_ascii=False)

        def explain(message: str) -> str:  # which tool's parameters fail, and where
            for j, (name, fn) in enumerate(functions.items()):
                problem = self._check(schemas[j])
                if problem:
                    return self._locate(schemas[j], problem, f"tools[{fn['index']}] ({name}) parameters")
            return f"the tools cannot be used for constrained decoding: {_clean_error(message)}"

        grammar = self._build("tool_calls", source, explain)
        for j, (name, fn) in enumerate(functions.items()):
            _check_finite(schemas[j], f"tools[{fn['index']}] ({name}) parameters")
        return grammar


MAX_SCHEMA_DEPTH = 128  # JSON levels (a schema level is one or two): deeper ones overflowed Python's recursion
MAX_SCHEMA_REFS = 256  # llguidance follows $refs recursively: a chain of ~1,000 crashed the process (segfault)


def _check_size(spec: Any, where: str) -> None:
    """Refuse a spec too deep or with too many $refs to compile safely, before anything walks it recursively."""
    refs, todo = 0, [(spec, 1)]
    while todo:
        node, depth = todo.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise LMForgeError(f"{where} nests more than {MAX_SCHEMA_DEPTH} levels of JSON: too deep for constrained "
                               "decoding; flatten it")
        if isinstance(node, dict):
            refs += isinstance(node.get("$ref"), str)
            todo.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            todo.extend((v, depth + 1) for v in node)
    if refs > MAX_SCHEMA_REFS:
        raise LMForgeError(f"{where} holds {refs} $refs, more than the {MAX_SCHEMA_REFS} constrained decoding takes; "
                           "inline or merge some definitions")


def _check_finite(schema: dict[str, Any], where: str) -> None:
    endless = _endless(schema)
    if endless is not None:
        raise LMForgeError(f"{where} cannot be used for constrained decoding: at {endless}: no finite value fits it, "
                           "each of its values must hold another one through $ref without end (a required property, "
                           "or minItems >= 1, whose schema leads back to it); make that recursion optional, or remove "
                           "that part (a reply may enter it wherever it is used)")


def _lark_string(text: str) -> str:
    """``text`` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


# ---- batch helpers ---------------------------------------------------------------------------------------

def _check_bitmask(bitmask: torch.Tensor, words: int) -> None:
    # The matchers write through a raw pointer: the layout must be exactly new_bitmask's.
    if (bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2
            or not bitmask.is_contiguous() or bitmask.shape[1] != words):
        raise ValueError(f"the bitmask must be a contiguous [batch, {words}] int32 CPU tensor (new_bitmask(batch, "
                         f"vocab_size)), got {bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}")


def new_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """A ``[batch_size, ceil(vocab_size / 32)]`` int32 bitmask on the CPU, every token allowed; the
    matchers ``fill`` its rows."""
    return torch.full((batch_size, (vocab_size + 31) // 32), -1, dtype=torch.int32)


_executor = None
_executor_lock = threading.Lock()


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def fill_bitmask(matchers: Sequence[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
    """``matcher.fill(bitmask, row)`` for each ``(matcher, row)``. With 4 cores or more, several
    are filled in parallel on llguidance's own thread pool (not torch's); on 2 cores that was no
    faster (benchmarks/constrained_decoding.py), so they are filled one after the other."""
    global _executor
    if len(matchers) < 2 or _cores() < 4:
        for matcher, row in matchers:
            matcher.fill(bitmask, row)
        return
    if _executor is None:
        with _executor_lock:
            if _executor is None:
                _executor = _llguidance().LLExecutor(min(8, _cores()))
    words = bitmask.shape[-1]
    for matcher, row in matchers:
        _check_bitmask(bitmask, matcher._words)
        if not 0 <= row < bitmask.shape[0]:
            raise IndexError(f"row {row} is outside the bitmask's {bitmask.shape[0]} rows")
    _executor.unsafe_compute_mask_ptr([(m._m, row) for m, row in matchers], bitmask.data_ptr(), words * 4,
                                      bitmask.shape[0])


_BIAS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _bias_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: for each byte of a bitmask, its 8 tokens' additive bias (0 allowed, -inf not)."""
    table = _BIAS.get((device, dtype))
    if table is None:
        bits = torch.arange(256)[:, None] >> torch.arange(8) & 1
        table = _BIAS[(device, dtype)] = torch.where(bits.bool(), 0.0, float("-inf")).to(device=device, dtype=dtype)
    return table


def _bias(bitmask: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    n = bitmask.shape[0]
    index = bitmask.contiguous().view(torch.uint8).view(-1).long()  # little-endian: byte k holds tokens 8k..8k+7
    return _bias_table(bitmask.device, dtype).index_select(0, index).view(n, -1)[:, :vocab]


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (CPU) on ``device``, through a fresh pinned copy: no host sync, and the caller may
    overwrite ``tensor`` at once."""
    if device.type == "cpu":
        return tensor
    try:
        staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    except RuntimeError:  # no pinned memory on this platform: a plain (synchronous) copy
        return tensor.to(device)
    return staged.copy_(tensor).to(device, non_blocking=True)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | torch.Tensor) -> None:
    """Set to -inf, in place, the logits of the tokens that ``bitmask`` disallows, in ``rows`` of the
    ``[B, V]`` ``logits`` only (row ``r`` of logits takes row ``r`` of the bitmask); the other rows
    are untouched. fp32, bf16 or fp16 logits, on any device: the bitmask (a CPU tensor, as
    ``new_bitmask`` makes it) is copied through a fresh pinned buffer and the rows stay on the
    device, so a CUDA step adds no host sync. Every token past ``bitmask``'s width is disallowed."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    n, vocab = logits.shape
    if isinstance(rows, torch.Tensor):
        if rows.numel() == 0:
            return
        if rows.device.type == "cpu" or logits.device.type == "cpu":
            rows = rows.tolist()
    elif not rows:
        return
    if bitmask.shape[0] < n:
        raise ValueError(f"the bitmask has {bitmask.shape[0]} rows; the logits have {n}")
    words = bitmask.shape[-1]
    if words * 32 < vocab:  # tokens the bitmask does not cover are never allowed
        wide = torch.zeros((bitmask.shape[0], (vocab + 31) // 32), dtype=torch.int32)
        wide[:, :words] = bitmask.cpu()
        bitmask = wide
    if logits.device.type == "cpu":
        bitmask = bitmask.cpu()
        if isinstance(rows, list) and len(rows) == n and sorted(rows) == list(range(n)):
            logits.add_(_bias(bitmask[:n], vocab, logits.dtype))
        else:
            bias = _bias(bitmask[rows], vocab, logits.dtype)
            for j, row in enumerate(rows):
                logits[row].add_(bias[j])
        return
    _apply_whole_batch(logits, bitmask, rows)


def _apply_whole_batch(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | torch.Tensor) -> None:
    """An accelerator's way: the whole batch in one go, the free rows' bitmask set to "all allowed" on
    the device (no row indexing, nothing read back). Copies go through fresh pinned buffers (the
    caching host allocator keeps them alive until the copy has run), so the caller may refill its
    bitmask at once."""
    n, vocab = logits.shape
    device = logits.device
    mask = _to_device(bitmask[:n], device)
    if isinstance(rows, torch.Tensor):
        constrained = torch.zeros(n, dtype=torch.bool, device=device).index_fill_(0, rows.to(device), True)
    else:
        flags = torch.zeros(n, dtype=torch.bool)
        flags[list(rows)] = True
        constrained = _to_device(flags, device)
    mask = torch.where(constrained[:, None], mask, torch.full_like(mask, -1))
    logits.add_(_bias(mask, vocab, logits.dtype))
