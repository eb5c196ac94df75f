"""Grammar-constrained decoding (lmforge.infer.constrain): a random-init model, decoding under a grammar,
always writes JSON that parses and validates, and tool calls that lmforge.chat reads back."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from lmforge.chat import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, parse_tool_calls
from lmforge.errors import LMForgeError
from lmforge.infer.constrain import (
    GrammarCompiler,
    _apply_whole_batch,
    apply_bitmask,
    fill_bitmask,
    new_bitmask,
    strict_schema,
)
from lmforge.models.gpt import GPT, GPTConfig
from lmforge.posttrain.toolcalls import TOOLS
from lmforge.tokenizer import SPECIAL_TOKENS, Tokenizer, train_tokenizer

PAD = 37  # the model's vocabulary is the tokenizer's plus 37 padded rows (not a multiple of 32)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    texts = []
    for i in range(300):
        row = {"id": i, "name": f"user {i}", "tags": ["a", "b"][: i % 3], "ok": i % 2 == 0, "score": i / 7,
               "city": ["Paris", "Oslo", "Lima"][i % 3]}
        texts.append(json.dumps(row))
        texts.append(f'<tool_call>{{"name": "get_weather", "arguments": {{"city": "{row["city"]}"}}}}</tool_call>')
        texts.append(f"def f{i}(x):\n    return x * {i} + len('{row['name']}')\n")
    return Tokenizer.load(train_tokenizer(texts, 700, tmp_path_factory.mktemp("tok"), show_progress=False))


@pytest.fixture(scope="module")
def model(tokenizer) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(flavor="llama", vocab_size=tokenizer.vocab_size + PAD, n_layer=1, n_embd=32, n_head=2,
                         n_positions=1024)).eval()


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, tokenizer.vocab_size + PAD)


def allowed(bitmask: torch.Tensor, row: int, vocab: int) -> torch.Tensor:
    bits = (bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.view(-1)[:vocab].bool()


@torch.inference_mode()
def decode(model, tokenizer, grammar, seed: int, greedy: bool = False, max_new: int = 400,
           check_mask: bool = True) -> tuple[str, bool]:
    """One reply under ``grammar`` (batch of 2: row 1 decodes free and must be left alone); returns
    (text, finished with eos). Checks at every step that the mask allows no special token but eos,
    no padded id, and eos exactly when the grammar can end."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    matcher = grammar.matcher()
    bitmask = new_bitmask(2, vocab)
    cache = model.new_kv_cache(2)
    ids = torch.tensor([[tokenizer.bos_id, 7, 8], [tokenizer.bos_id, 9, 10]])
    out: list[int] = []
    for _ in range(max_new):
        logits = model.logits(ids, kv_cache=cache, last_only=True)[:, -1].float()
        free = logits[1].clone()
        matcher.fill(bitmask, 0)
        apply_bitmask(logits, bitmask, [0])
        assert torch.equal(logits[1], free)
        if check_mask:
            ok = allowed(bitmask, 0, vocab)
            assert not ok[tokenizer.vocab_size:].any(), "a padded id is allowed"
            specials = [i for i in range(len(SPECIAL_TOKENS)) if i != tokenizer.eos_id]
            assert not ok[specials].any(), "a special token is allowed"
            assert bool(ok[tokenizer.eos_id]) == matcher.can_end
            assert torch.isneginf(logits[0][~ok]).all() and not torch.isinf(logits[0][ok]).any()
        if greedy:
            token = int(logits[0].argmax())
        else:
            token = int(torch.multinomial(logits[0].softmax(-1), 1, generator=gen))
        assert matcher.accept(token), matcher.error
        if token == tokenizer.eos_id:
            assert matcher.is_done
            return tokenizer.decode(out), True
        out.append(token)
        ids = torch.tensor([[token], [int(free.argmax())]])
    return tokenizer.decode(out), False


S = {"type": "string", "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                      "score": {"type": "number", "minimum": -5, "maximum": 5},
                                      "active": {"type": "boolean"}},
     "required": ["name", "age", "score", "active"]},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99999},
                                                  "nick": S, "role": {"enum": ["admin", "dev", "guest"]}},
                 "required": ["id", "role"]},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["zip"]},
        "note": {"type": ["string", "null"], "maxLength": 6}},
     "required": ["user", "tags", "address"]},
    {"type": "array", "minItems": 1, "maxItems": 3,
     "items": {"type": "object", "properties": {"sku": {"type": "string", "minLength": 2, "maxLength": 5},
                                                "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                                                "gift": {"const": True}},
               "required": ["sku", "qty"]}},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                          "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                         "required": ["x", "y"]}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/point"},
                                      "path": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 3},
                                      "label": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 4},
                                                          {"type": "boolean"}]}},
     "required": ["a", "path", "label"]},
]


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_json_schema_replies_always_validate(model, tokenizer, compiler, index):
    schema = SCHEMAS[index]
    grammar = compiler.json_schema(schema)
    for seed in range(10):  # greedy, then sampled
        text, finished = decode(model, tokenizer, grammar, seed, greedy=seed == 0)
        assert finished, text
        value = json.loads(text)
        jsonschema.validate(value, schema)
        # one line, json.dumps' separators: what the chat template writes
        assert text == json.dumps(value, ensure_ascii=False) or "." in text or "\\" in text


def test_a_schema_no_value_satisfies_is_refused_and_a_recursive_one_is_not(tokenizer, compiler):
    with pytest.raises(LMForgeError, match="admits no value at all"):
        compiler.json_schema({"$ref": "#"})
    with pytest.raises(LMForgeError, match="admits no value at all"):
        compiler.json_schema({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})
    tree = {"type": "object", "properties": {"child": {"$ref": "#"}}}  # nests, and {} ends it
    matcher = compiler.json_schema(tree).matcher()
    for token in tokenizer.encode('{"child": {}}'):
        assert matcher.accept(token)
    assert matcher.can_end


def test_strict_schema_generates_only_listed_properties(model, tokenizer, compiler):
    schema = {"type": "object", "properties": {"k": {"enum": [1, 2]}}}
    value = json.loads(decode(model, tokenizer, compiler.json_schema(schema), 0, max_new=100)[0])
    assert set(value) <= {"k"}
    assert strict_schema(schema)["additionalProperties"] is False
    # left open: any-object schemas, allOf branches (their intersection would lose properties), required
    # names that properties does not list
    assert "additionalProperties" not in strict_schema({"type": "object"})
    merged = strict_schema({"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]})
    assert all("additionalProperties" not in branch for branch in merged["allOf"])
    assert "additionalProperties" not in strict_schema({"properties": {"a": {}}, "required": ["a", "b"]})
    sibling = strict_schema({"properties": {"a": {}}, "anyOf": [{"required": ["a"]}, {"properties": {"b": {}}}]})
    assert "additionalProperties" not in sibling and "additionalProperties" not in sibling["anyOf"][1]
    union = strict_schema({"oneOf": [{"$ref": "#/$defs/c"}], "$defs": {"c": {"properties": {"k": {"const": 1}}}}})
    assert union["$defs"]["c"]["additionalProperties"] is False


def test_json_object_replies_parse(model, tokenizer, compiler):
    finished = 0
    for seed in range(4):
        text, done = decode(model, tokenizer, compiler.json_object(), seed, max_new=300, check_mask=seed == 0)
        if done:
            finished += 1
            assert isinstance(json.loads(text), dict)
    assert finished >= 2


TEST_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "set_timer", "parameters": {
        "type": "object", "properties": {"minutes": {"type": "integer", "minimum": 1, "maximum": 600},
                                         "label": {"type": "string", "maxLength": 8}}, "required": ["minutes"]}}},
    {"name": "move", "parameters": {  # a bare function, its own $defs
        "type": "object", "$defs": {"p": {"type": "object", "properties": {"x": {"enum": [0, 1]}}, "required": ["x"]}},
        "properties": {"to": {"$ref": "#/$defs/p"}}, "required": ["to"]}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: any JSON object
]
PARAMS = {(t.get("function") or t)["name"]: (t.get("function") or t).get("parameters", {"type": "object"})
          for t in TEST_TOOLS}
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r'\{"name": ("[^"]*"), "arguments": (.*?)\}'
                    + re.escape(TOOL_CALL_CLOSE))


def check_calls(text: str, names: set[str]) -> list:
    """The calls of ``text``: it is tool-call blocks only, in the template's exact form, each of one
    of ``names`` with arguments that validate."""
    content, calls = parse_tool_calls(text)
    assert calls and content == "", text
    blocks = list(_BLOCK.finditer(text))
    assert "".join(m.group(0) for m in blocks) == text and len(blocks) == len(calls), text
    for block, call in zip(blocks, calls):
        assert json.loads(block.group(1)) == call.name and call.name in names
        args = json.loads(call.arguments)
        assert json.loads(block.group(2)) == args
        jsonschema.validate(args, PARAMS[call.name])
    return calls


def test_required_tool_calls_always_parse(model, tokenizer, compiler):
    grammar = compiler.tool_calls(TEST_TOOLS)
    finished = 0
    for seed in range(12):
        text, done = decode(model, tokenizer, grammar, seed, max_new=300)
        if done or seed == 0:  # the any-object tool may run long; the others always end
            assert done, text
            finished += 1
            check_calls(text, set(PARAMS))
    assert finished >= 8


def test_named_tool_only(model, tokenizer, compiler):
    for parallel, max_calls in ((False, None), (True, 3)):
        grammar = compiler.tool_calls(TEST_TOOLS, name="set_timer", parallel=parallel, max_calls=max_calls)
        for seed in range(6):
            text, done = decode(model, tokenizer, grammar, seed, greedy=seed == 0, max_new=300)
            assert done, text  # greedy repeats its call: max_calls ends the reply
            calls = check_calls(text, {"set_timer"})
            assert len(calls) <= (max_calls or 1)


def test_tool_calls_of_the_sft_tools(model, tokenizer, compiler):
    """lmforge's generated tool-calling data (strings without bounds): every reply that ends is valid."""
    tools = list(TOOLS.values())
    grammar = compiler.tool_calls(tools, parallel=False)
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for seed in range(3):
        text, done = decode(model, tokenizer, grammar, seed, max_new=200, check_mask=False)
        if done:
            _, calls = parse_tool_calls(text)
            assert len(calls) == 1 and calls[0].name in params
            jsonschema.validate(json.loads(calls[0].arguments), params[calls[0].name])


def test_eos_only_where_the_grammar_can_end(tokenizer, compiler):
    vocab = compiler.vocab_size
    bitmask = new_bitmask(1, vocab)
    matcher = compiler.tool_calls(TEST_TOOLS, name="ping").matcher()
    steps = []
    call = '<tool_call>{"name": "ping", "arguments": {}}</tool_call>'
    for token in tokenizer.encode(call * 2):
        matcher.fill(bitmask, 0)
        steps.append((bool(allowed(bitmask, 0, vocab)[tokenizer.eos_id]), matcher.can_end, matcher.is_done))
        assert matcher.accept(token)
    matcher.fill(bitmask, 0)
    ok = allowed(bitmask, 0, vocab)
    assert ok[tokenizer.eos_id] and matcher.can_end and not matcher.is_done  # another call may follow
    assert not any(eos or end or done for eos, end, done in steps[:len(tokenizer.encode(call)) - 1])
    assert not matcher.accept(tokenizer.encode("x")[0])  # not allowed: the matcher reports it
    assert matcher.error


def test_rollback_and_reset(tokenizer, compiler):
    vocab = compiler.vocab_size
    matcher = compiler.json_schema(SCHEMAS[0]).matcher()
    first, later = new_bitmask(1, vocab), new_bitmask(1, vocab)
    matcher.fill(first, 0)
    tokens = tokenizer.encode('{"name": "ab')
    for token in tokens:
        assert matcher.accept(token)
    matcher.rollback(len(tokens))
    matcher.fill(later, 0)
    assert torch.equal(first, later)
    for token in tokens:
        assert matcher.accept(token)
    matcher.reset()
    matcher.fill(later, 0)
    assert torch.equal(first, later) and matcher.tokens == 0
    with pytest.raises(ValueError):
        matcher.rollback(1)


def test_apply_bitmask_masks_only_the_constrained_rows():
    torch.manual_seed(0)
    vocab = 100
    bitmask = torch.randint(-2**31, 2**31 - 1, (6, (vocab + 31) // 32), dtype=torch.int32)
    bits = torch.stack([allowed(bitmask, r, vocab) for r in range(6)])
    for dtype in (torch.float32, torch.bfloat16):
        for rows in ([0, 2], torch.tensor([3]), [0, 1, 2, 3], [], [3, 1]):
            logits = torch.randn(4, vocab).to(dtype)
            before = logits.clone()
            apply_bitmask(logits, bitmask, rows)
            chosen = set(rows.tolist() if isinstance(rows, torch.Tensor) else rows)
            if len(chosen):  # the accelerators' way (whole batch, nothing read back) gives the same
                whole = before.clone()
                _apply_whole_batch(whole, bitmask, rows)
                assert torch.equal(whole, logits)
            for r in range(4):
                if r in chosen:
                    assert torch.isneginf(logits[r][~bits[r]]).all()
                    assert torch.equal(logits[r][bits[r]], before[r][bits[r]])
                else:
                    assert torch.equal(logits[r], before[r])
    # a bitmask narrower than the logits (ids past it: a padded vocabulary) leaves no id past it allowed
    logits = torch.zeros(1, 70)
    apply_bitmask(logits, torch.full((1, 1), -1, dtype=torch.int32), [0])
    assert (logits[0, :32] == 0).all() and torch.isneginf(logits[0, 32:]).all()


def test_fill_bitmask_in_parallel_equals_one_by_one(tokenizer, compiler):
    grammars = [compiler.json_schema(s) for s in SCHEMAS] + [compiler.tool_calls(TEST_TOOLS)]
    matchers = [g.matcher() for g in grammars]
    for m, text in zip(matchers, ['{"name": "x', '{"user": {"id": 1', "[", '{"a": {"x": 1, "y": ', "<tool_"]):
        for token in tokenizer.encode(text):
            assert m.accept(token)
    one, par = new_bitmask(8, compiler.vocab_size), new_bitmask(8, compiler.vocab_size)
    rows = [0, 2, 3, 5, 7]
    for m, row in zip(matchers, rows):
        m.fill(one, row)
    fill_bitmask(list(zip(matchers, rows)), par)
    assert torch.equal(one, par)


def test_cache_keys_keep_property_order(compiler):
    a = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}
    b = {"type": "object", "properties": {"y": {"type": "integer"}, "x": {"type": "integer"}}}
    assert compiler.json_schema(a) is compiler.json_schema(json.loads(json.dumps(a)))
    assert compiler.json_schema(a) is not compiler.json_schema(b)
    assert compiler.json_schema(a) is not compiler.json_schema(a, strict=False)
    assert compiler.tool_calls(TEST_TOOLS) is not compiler.tool_calls(TEST_TOOLS, parallel=False)
    single = compiler.tool_calls(TEST_TOOLS, parallel=False)
    assert single is compiler.tool_calls(TEST_TOOLS, parallel=False, max_calls=4)  # max_calls: parallel only


@pytest.mark.parametrize("schema, where, why", [
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}},
     "#/properties/tags", "uniqueItems"),
    ({"type": "object", "properties": {"a": {"type": "object", "properties": {
        "when": {"type": "string", "format": "calendar"}}}}}, "#/properties/a/properties/when", "calendar"),
    ({"$defs": {"d": {"type": "string", "pattern": "(?=x)y"}}, "type": "object",
      "properties": {"a": {"$ref": "#/$defs/d"}}}, "#/$defs/d", "look-around"),
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 3}}, "required": ["n"]},
     "#/properties/n", "no value"),
    ({"type": "object", "properties": {"a": {"not": {"type": "null"}}}}, "#/properties/a", "not"),
    ({"type": "strng"}, "#:", "strng"),
])
def test_uncompilable_schema_names_the_part(compiler, schema, where, why):
    with pytest.raises(LMForgeError) as e:
        compiler.json_schema(schema)
    assert where in str(e.value) and why in str(e.value), str(e.value)


def test_client_options_cannot_loosen_the_schema(compiler):
    with pytest.raises(LMForgeError, match="uniqueItems"):  # lenient would ignore the keyword
        compiler.json_schema({"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}})


def test_bad_tools_name_the_tool(compiler):
    bad = [*TEST_TOOLS[:2], {"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "properties": {"ids": {"type": "array", "contains": {"type": "integer"}}}}}}]
    with pytest.raises(LMForgeError, match=r"tools\[2\] \(tag\) parameters .*#/properties/ids.*contains"):
        compiler.tool_calls(bad)
    with pytest.raises(LMForgeError, match="not among the tools"):
        compiler.tool_calls(TEST_TOOLS, name="nope")
    with pytest.raises(LMForgeError, match="describe an object"):
        compiler.tool_calls([{"name": "f", "parameters": {"type": "string"}}])
    with pytest.raises(LMForgeError, match="two tools"):
        compiler.tool_calls([TEST_TOOLS[0], TEST_TOOLS[0]])
    with pytest.raises(LMForgeError, match="JSON object"):
        compiler.json_schema(["not", "a", "schema"])
    # before llguidance sees them: a chain of ~1,000 $refs crashed the process, ~300 levels overflowed Python's stack
    chain = {"type": "object", "$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(1000)},
             "properties": {"x": {"$ref": "#/$defs/d0"}}}
    with pytest.raises(LMForgeError, match=r"tools\[1\] holds 1001 \$refs, more than the 256"):
        compiler.tool_calls([TEST_TOOLS[0], {"name": "f", "parameters": chain}])
    deep: dict = {"type": "integer"}
    for _ in range(70):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(LMForgeError, match=r"tools\[0\] nests more than 128 levels of JSON"):
        compiler.tool_calls([{"name": "f", "parameters": deep}])


def test_model_vocab_smaller_than_tokenizer_is_refused(tokenizer):
    with pytest.raises(LMForgeError, match="smaller"):
        GrammarCompiler(tokenizer, tokenizer.vocab_size - 1)
