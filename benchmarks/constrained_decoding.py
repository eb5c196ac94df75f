"""Grammar-constrained decoding on the CPU: llguidance (what ``lmforge.infer.constrain`` uses) beside
xgrammar, then the cost of the mask through a real model.

1. **Engines side by side**, with lmforge byte-level BPE tokenizers of 4,096 and 50,257 tokens (GPT-2's
   size), both trained here on the Python standard library's sources (~31 MB; a few seconds each):
   - building each engine's tokenizer tables;
   - compiling a typical JSON schema (nested objects, arrays, enums, bounds) and the tools grammar of
     lmforge's 7 tool-calling tools (one or more ``<tool_call>`` blocks), timed to the first mask, fresh
     each time (no cache);
   - per token, in lock step over real token streams (32 different valid replies): filling the rows'
     bitmask one matcher after the other and with each engine's parallel API, applying it to ``[B, V]``
     logits, accepting the tokens; at batch 1 and 32. Both write the same bitmask layout, so the apply
     is timed once per kernel: lmforge's ``apply_bitmask`` and xgrammar's C++ CPU kernel;
   - which of a set of schemas each engine compiles, its message when it does not, and whether a
     schema it compiles is enforced (a reply the schema rejects, fed token by token: is it let through?).
2. **Through the model**: a decode loop with ``model.new_kv_cache(B)`` at batch 1 and 32, sampled, free
   vs constrained by the JSON schema (``fill_bitmask`` + ``apply_bitmask`` + ``accept``, the matcher
   restarted when its reply ends), for GPT-2 124M (random init, vocab 50,257) and a tiny llama (vocab
   4,096); ms per step in alternating rounds, the median counts. Greedy isolates the mask (argmax costs
   the same either way; the whole-step difference is within the forward's noise for GPT-2, so the
   mask's own time, fill + apply + accept, is the overhead figure); sampled is what the engine does,
   where ``sample_rows`` sorts each row and a mostly -inf row sorts faster than the mask costs.
3. **Tool-call validity**: the test suite's tiny tool-calling model (``make_tool_sft_checkpoint``: a
   2 x 64 llama, 200 sft steps on lmforge's generated tool-calling rows), trained with each of
   ``--validity-seeds``, served by a real ``lmforge serve`` and asked the test rows that expect a call,
   greedy, with ``tool_choice`` "auto" (unconstrained) and "required" (the tools grammar).

    OMP_NUM_THREADS=1 python benchmarks/constrained_decoding.py [--vocabs 4096,50257] [--rounds 3]
        [--steps 16] [--no-model] [--validity-seeds 0,1,2 --rows 100] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import cpu_name

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from lmforge.errors import LMForgeError
from lmforge.infer.constrain import GrammarCompiler, apply_bitmask, fill_bitmask, new_bitmask
from lmforge.infer.generate import sample_rows
from lmforge.models.gpt import GPT, GPTConfig
from lmforge.posttrain.toolcalls import TOOLS
from lmforge.tokenizer import SPECIAL_TOKENS, Tokenizer, train_tokenizer

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0},
    "name": {"type": "string", "maxLength": 40},
    "email": {"type": "string"},
    "status": {"type": "string", "enum": ["active", "suspended", "deleted"]},
    "score": {"type": "number"},
    "verified": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                 "zip": {"type": "string"}}, "required": ["street", "city"]},
    "orders": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
        "required": ["sku", "qty", "price"]}}},
    "required": ["id", "name", "status", "verified", "tags", "address", "orders"]}
TOOL_LIST = list(TOOLS.values())
SEPARATORS = (", ", ": ")

# Schemas one or the other engine may refuse (the first few are fine for both).
SUPPORT = {
    "nested objects, enums, bounds": SCHEMA,
    "$defs + $ref, anyOf with null": {
        "$defs": {"p": {"type": "object", "properties": {"x": {"type": "number"}}}}, "type": "object",
        "properties": {"a": {"$ref": "#/$defs/p"}, "b": {"anyOf": [{"type": "null"}, {"type": "string"}]}}},
    "pattern, format date-time": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                                   "at": {"type": "string", "format": "date-time"}}},
    "prefixItems, minItems": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "minItems": 2},
    "oneOf, overlapping": {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]},
    "oneOf, exclusive (const tags)": {"oneOf": [
        {"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
        {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]}]},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "not": {"not": {"type": "string"}},
    "if / then": {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
    "contains": {"type": "array", "contains": {"type": "integer"}},
    "propertyNames": {"type": "object", "propertyNames": {"pattern": "^x"}},
    "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}},
    "unevaluatedProperties": {"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False},
    "pattern with look-ahead": {"type": "string", "pattern": "^(?!a)[a-z]+$"},
    "unknown format": {"type": "string", "format": "calendar-date"},
    "minimum > maximum, required": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 3}}, "required": ["n"]},
    "$ref to a missing $defs entry": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
    "remote $ref": {"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}},
    "minProperties with optional keys": {"type": "object", "properties": {"a": {}, "b": {}}, "minProperties": 1},
}


# A reply each of those schemas rejects (jsonschema agrees): does an engine that compiles it still allow it?
COUNTER = {"oneOf, overlapping": '"ab"', "uniqueItems": "[1, 1]", "not": '"x"', "if / then": '{"a": 1}',
           "contains": '["x"]', "propertyNames": '{"y": 1}', "dependentRequired": '{"a": 1}',
           "unevaluatedProperties": '{"b": 1}', "pattern with look-ahead": '"abc"'}


def stdlib_texts() -> list[str]:
    import sysconfig

    from lmforge.quickstart import python_stdlib_globs

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted({f for glob in python_stdlib_globs(root) for f in root.glob(glob) if f.is_file()})
    texts = []
    for f in files:
        try:
            texts.append(f.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
    return texts


def tokenizer_of(vocab: int, work: Path, texts: list[str]) -> Tokenizer:
    path = work / f"tok{vocab}"
    if not (path / "tokenizer.json").is_file():
        train_tokenizer(texts, vocab, path, show_progress=False)
    tokenizer = Tokenizer.load(path)
    if tokenizer.vocab_size != vocab:
        raise SystemExit(f"the tokenizer reached {tokenizer.vocab_size} tokens, not {vocab}: more text needed")
    return tokenizer


def schema_reply(i: int) -> str:
    r = random.Random(i)
    value = {"id": r.randint(0, 10**6), "name": r.choice(["Ana Lopez", "Ben Kim", "Chloe Martin"]) + f" {i}",
             "email": f"user{i}@example.com", "status": r.choice(["active", "suspended", "deleted"]),
             "score": round(r.random() * 100, 3), "verified": r.random() < .5,
             "tags": [r.choice(["new", "vip", "beta", "eu", "us"]) for _ in range(r.randint(0, 4))],
             "address": {"street": f"{r.randint(1, 200)} Main Street", "city": r.choice(["Paris", "Oslo", "Lima"]),
                         "zip": str(r.randint(10000, 99999))},
             "orders": [{"sku": f"SKU-{r.randint(100, 999)}", "qty": r.randint(1, 9),
                         "price": round(r.random() * 50, 2)} for _ in range(r.randint(1, 3))]}
    return json.dumps(value)


def tools_reply(i: int) -> str:
    r = random.Random(i)
    out = []
    for _ in range(r.randint(1, 2)):
        name, args = r.choice([("get_weather", {"city": r.choice(["Paris", "Oslo"]), "unit": "celsius"}),
                               ("set_timer", {"minutes": r.randint(1, 90), "label": "tea"}),
                               ("send_email", {"to": "bob@example.com", "subject": "lunch", "body": "see you there"}),
                               ("convert_currency", {"amount": r.randint(1, 500) + 0.5, "from": "USD", "to": "EUR"})])
        out.append('<tool_call>{"name": ' + json.dumps(name) + ', "arguments": ' + json.dumps(args) + "}</tool_call>")
    return "".join(out)


# ---- the two engines behind one small interface ------------------------------------------------------------
class Llguidance:
    """lmforge.infer.constrain, as the engine will use it."""

    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, vocab: int):
        self.compiler = GrammarCompiler(tokenizer, vocab)

    def compile(self, what: str):
        self.compiler._cache.clear()
        return self.compiler.json_schema(SCHEMA) if what == "schema" else self.compiler.tool_calls(TOOL_LIST)

    def schema(self, schema: dict):
        self.compiler._cache.clear()
        return self.compiler.json_schema(schema)

    @staticmethod
    def matcher(grammar):
        return grammar.matcher()

    @staticmethod
    def fill(matcher, bitmask, row):
        matcher.fill(bitmask, row)

    @staticmethod
    def fill_batch(matchers, bitmask):
        fill_bitmask([(m, i) for i, m in enumerate(matchers)], bitmask)

    @staticmethod
    def accept(matcher, token):
        return matcher.accept(token)


class Xgrammar:
    """xgrammar with the same constraints: compact JSON (", " / ": "), unlisted properties not generated
    (its strict mode), special tokens other than eos never matching text."""

    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer, vocab: int):
        import xgrammar as xgr

        self.xgr = xgr
        table = tokenizer._backend.get_vocab(with_added_tokens=True)
        encoded = [""] * len(table)
        for token, i in table.items():
            encoded[i] = token
        for i in range(len(SPECIAL_TOKENS)):  # an empty token is a special one to xgrammar
            if i != tokenizer.eos_id:
                encoded[i] = ""
        info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=[tokenizer.eos_id])
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=2)

    def schema(self, schema: dict):
        return self.compiler.compile_json_schema(schema, any_whitespace=False, separators=SEPARATORS, strict_mode=True)

    def compile(self, what: str):
        xgr = self.xgr
        if what == "schema":
            return self.schema(SCHEMA)
        calls = []
        for tool in TOOL_LIST:
            fn = tool["function"]
            head = '<tool_call>{"name": ' + json.dumps(fn["name"]) + ', "arguments": '
            calls.append(xgr.Grammar.concat(
                xgr.Grammar.from_ebnf("root ::= " + json.dumps(head)),
                xgr.Grammar.from_json_schema(fn["parameters"], any_whitespace=False, separators=SEPARATORS,
                                             strict_mode=True),
                xgr.Grammar.from_ebnf('root ::= "}</tool_call>"')))
        tag = {"type": "structural_tag", "format": {"type": "plus", "content": {
            "type": "grammar", "grammar": str(xgr.Grammar.union(*calls))}}}
        return self.compiler.compile_structural_tag(json.dumps(tag))

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    @staticmethod
    def fill(matcher, bitmask, row):
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, matchers, bitmask):
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    @staticmethod
    def accept(matcher, token):
        return matcher.accept_token(token)


def median_time(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def import_ms(module: str) -> float:
    """Importing ``module`` in a fresh process that has already imported torch (as lmforge has)."""
    import subprocess

    code = f"import time, torch; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout) * 1e3


def engine_figures(tokenizer: Tokenizer, rounds: int) -> dict:
    vocab = tokenizer.vocab_size
    out: dict = {}
    engines = []
    for cls in (Llguidance, Xgrammar):
        start = time.perf_counter()
        engine = cls(tokenizer, vocab)
        out[cls.name] = {"tokenizer_ms": (time.perf_counter() - start) * 1e3}
        engines.append(engine)
    for engine in engines:
        fig = out[engine.name]
        for what in ("schema", "tools"):
            def first_mask(what=what, engine=engine):
                matcher = engine.matcher(engine.compile(what))
                engine.fill(matcher, new_bitmask(1, vocab), 0)
            fig[f"compile_{what}_ms"] = median_time(first_mask, rounds) * 1e3
        for what, make in (("schema", schema_reply), ("tools", tools_reply)):
            grammar = engine.compile(what)
            for batch in (1, 32):
                streams = [tokenizer.encode(make(i)) + [tokenizer.eos_id] for i in range(batch)]
                steps = min(map(len, streams))
                for mode in ("one_by_one", "parallel"):
                    matchers = [engine.matcher(grammar) for _ in range(batch)]
                    bitmask = new_bitmask(batch, vocab)
                    fill = accept = 0.0
                    for s in range(steps):
                        t0 = time.perf_counter()
                        if mode == "parallel" and batch > 1:
                            engine.fill_batch(matchers, bitmask)
                        else:
                            for row, matcher in enumerate(matchers):
                                engine.fill(matcher, bitmask, row)
                        t1 = time.perf_counter()
                        for row, matcher in enumerate(matchers):
                            if not engine.accept(matcher, streams[row][s]):
                                raise SystemExit(f"{engine.name} refused token {s} of reply {row} ({what})")
                        accept += time.perf_counter() - t1
                        fill += t1 - t0
                    if batch == 1 and mode == "parallel":
                        continue
                    fig[f"{what}_b{batch}_fill_{mode}_ms"] = fill / steps * 1e3
                    fig[f"{what}_b{batch}_accept_ms"] = accept / steps * 1e3
    return out


def apply_figures(vocab: int, rounds: int) -> dict:
    import xgrammar as xgr

    out = {}
    gen = torch.Generator().manual_seed(0)
    for batch in (1, 32):
        bitmask = torch.randint(-2**31, 2**31 - 1, (batch, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
        rows = list(range(batch))
        for dtype in (torch.float32, torch.bfloat16):
            logits = torch.randn(batch, vocab, generator=gen).to(dtype)
            mine, theirs = logits.clone(), logits.clone()
            apply_bitmask(mine, bitmask, rows)
            xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab, indices=rows)
            assert torch.equal(mine, theirs)
            copies = [logits.clone() for _ in range(40 * rounds)]
            it = iter(copies)
            lm = median_time(lambda it=it, b=bitmask, r=rows: [apply_bitmask(next(it), b, r) for _ in range(40)],
                             rounds) / 40
            it = iter(copies)
            xg = median_time(lambda it=it, b=bitmask, r=rows: [
                xgr.apply_token_bitmask_inplace(next(it), b, vocab_size=vocab, indices=r) for _ in range(40)],
                rounds) / 40
            name = str(dtype).split(".")[-1]
            out[f"b{batch}_{name}"] = {"lmforge_ms": lm * 1e3, "xgrammar_ms": xg * 1e3}
    return out


def support_table(tokenizer: Tokenizer) -> dict:
    """Each engine's verdict on each schema of ``SUPPORT``; where it compiles one of them, whether its
    matcher still lets through the reply ``COUNTER`` gives (one the schema rejects)."""
    import jsonschema

    vocab = tokenizer.vocab_size
    engines = [Llguidance(tokenizer, vocab), Xgrammar(tokenizer, vocab)]
    out = {}
    for label, schema in SUPPORT.items():
        row = {}
        for engine in engines:
            try:
                grammar = engine.schema(schema)
            except (LMForgeError, RuntimeError, ValueError) as e:  # lmforge's; xgrammar's
                message = " ".join(str(e).split())
                row[engine.name] = "refused: " + re.sub(r"\(constrained decoding implements: .*\)", "(...)", message)
                continue
            row[engine.name] = "compiles"
            if label in COUNTER:
                text = COUNTER[label]
                assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)), label
                matcher = engine.matcher(grammar)
                if all(engine.accept(matcher, t) for t in tokenizer.encode(text) + [tokenizer.eos_id]):
                    row[engine.name] += f", but lets through {text}, which the schema rejects"
                else:  # enforced, or refused for another reason (strict mode: no unlisted property)
                    row[engine.name] += f"; refuses {text}"
        out[label] = row
    return out


# ---- through the model ---------------------------------------------------------------------------------------
@torch.inference_mode()
def decode_figures(model: GPT, tokenizer: Tokenizer, batch: int, steps: int, rounds: int, greedy: bool) -> dict:
    """ms per decode step, free and constrained (the JSON schema on every row), alternating rounds.
    Sampled as the engine samples (``sample_rows``: a full sort of each row, which is cheaper when most
    of a row is -inf), or greedy (argmax: the same cost either way, so the difference is the mask's)."""
    vocab = model.config.vocab_size
    compiler = GrammarCompiler(tokenizer, vocab)
    grammar = compiler.json_schema(SCHEMA)
    prompt = torch.tensor([tokenizer.encode("Reply with the user record as JSON:\n")] * batch)
    ones = torch.ones(batch)

    def run(constrained: bool, seed: int) -> tuple[float, float]:
        gen = torch.Generator().manual_seed(seed)
        cache = model.new_kv_cache(batch)
        logits = model.logits(prompt, kv_cache=cache, last_only=True)[:, -1]
        matchers = [grammar.matcher() for _ in range(batch)]
        bitmask = new_bitmask(batch, vocab)
        rows = list(range(batch))
        total = masking = 0.0
        for _ in range(steps):
            start = time.perf_counter()
            if constrained:
                fill_bitmask([(m, r) for r, m in enumerate(matchers)], bitmask)
                apply_bitmask(logits, bitmask, rows)
            mid = time.perf_counter()
            if greedy:
                tokens = logits.argmax(-1)
            else:
                tokens = sample_rows(logits, ones, torch.zeros(batch, dtype=torch.long), ones,
                                     torch.rand(batch, generator=gen))
            after = time.perf_counter()
            if constrained:
                for m, token in zip(matchers, tokens.tolist()):
                    if not m.accept(token):
                        raise SystemExit(f"a masked token was sampled: {m.error}")
                    if m.is_done:
                        m.reset()  # a reply ended: start another (the cost per token is what is measured)
            done = time.perf_counter()
            logits = model.logits(tokens[:, None], kv_cache=cache)[:, -1]
            total += time.perf_counter() - start
            masking += (mid - start) + (done - after)
        return total / steps * 1e3, masking / steps * 1e3

    run(False, 0), run(True, 0)  # warm-up: first calls allocate
    free, constrained, masks = [], [], []
    for r in range(rounds):
        for mode in ((False, True) if r % 2 == 0 else (True, False)):
            step, mask = run(mode, r)
            (constrained if mode else free).append(step)
            if mode:
                masks.append(mask)
    f, c = statistics.median(free), statistics.median(constrained)
    return {"free_ms": f, "constrained_ms": c, "overhead_ms": c - f, "overhead_pct": (c - f) / f * 100,
            "mask_ms": statistics.median(masks)}


# ---- tool-call validity (item 2: with and without constraints) -------------------------------------------------
@torch.inference_mode()
def tool_call_validity(checkpoint: Path, rows: list[dict], tool_choice: str) -> dict:
    """Greedy replies of ``checkpoint`` served by a real ``lmforge serve`` (the official ``openai``
    client) to ``rows`` (lmforge.posttrain.toolcalls rows whose last message is a call), with the row's
    tools and ``tool_choice`` ("auto": the model decides, unconstrained; "required": the tools grammar).
    A reply is valid when it holds at least one call and every call names one of the tools with
    arguments that validate against its parameters; ``right_tool``: its first call names the
    reference tool; ``cut``: the reply ran into the context's end (a string the model never closes)."""
    import jsonschema
    import openai
    from serve_helpers import Server

    server = Server(checkpoint, "--max-batch-size", "16")
    valid = right = cut = 0
    try:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=600)
        for row in rows:
            reply = client.chat.completions.create(model="tiny", messages=row["messages"][:-1], tools=row["tools"],
                                                   tool_choice=tool_choice, temperature=0)  # up to the context
            calls = reply.choices[0].message.tool_calls or []
            cut += reply.choices[0].finish_reason == "length"
            params = {(t.get("function") or t)["name"]: (t.get("function") or t).get("parameters")
                      or {"type": "object"} for t in row["tools"]}
            ok = bool(calls)
            for call in calls:
                try:
                    jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
                except (KeyError, ValueError, jsonschema.ValidationError):
                    ok = False
            valid += ok
            reference = row["messages"][-1]["tool_calls"][0]["function"]["name"]
            right += bool(calls) and calls[0].function.name == reference
    finally:
        server.stop()
    return {"rows": len(rows), "valid": valid / len(rows), "right_tool": right / len(rows), "cut": cut / len(rows)}


def validity_rows(n: int, seed: int = 0) -> list[dict]:
    from lmforge.posttrain.toolcalls import make_rows

    rows = [r for r in make_rows("test", 3 * n, seed) if r["messages"][-1].get("tool_calls")]
    return rows[:n]


# ---- the report --------------------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocabs", default="4096,50257")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=16, help="decode steps per timed model run")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-model", action="store_true", help="skip the decode loop through the models")
    p.add_argument("--validity-seeds", default="0,1,2", help="train the tests' tool-calling model with each seed "
                   "and measure its tool-call validity through lmforge serve, unconstrained and forced ('' = skip)")
    p.add_argument("--rows", type=int, default=100)
    p.add_argument("--work", default=None, help="where the tokenizers are kept (default: a temporary folder)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from importlib.metadata import version

    results: dict = {"cpu": cpu_name(), "threads": args.threads, "llguidance": version("llguidance"),
                     "xgrammar": version("xgrammar"), "torch": torch.__version__}
    print(f"# {results['cpu']}, {args.threads} thread(s), OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; "
          f"llguidance {results['llguidance']}, xgrammar {results['xgrammar']}, torch {torch.__version__}")
    work = Path(args.work or tempfile.mkdtemp(prefix="lmforge-constrain-"))
    results["import_ms"] = {name: import_ms(name) for name in ("llguidance", "xgrammar")}
    print(f"import after torch: llguidance {results['import_ms']['llguidance']:.0f} ms, "
          f"xgrammar {results['import_ms']['xgrammar']:.0f} ms")
    import xgrammar  # noqa: F401  (imported once, outside the timings)

    texts = stdlib_texts()
    tokenizers = {v: tokenizer_of(v, work, texts) for v in map(int, args.vocabs.split(","))}

    results["engines"] = {}
    for vocab, tokenizer in tokenizers.items():
        figs = results["engines"][vocab] = engine_figures(tokenizer, args.rounds)
        figs["apply"] = apply_figures(vocab, args.rounds)
        lg, xg = figs["llguidance"], figs["xgrammar"]
        print(f"\n## vocab {vocab:,}: llguidance | xgrammar (ms)")
        print("| figure | llguidance | xgrammar |\n| --- | --- | --- |")
        for key in lg:
            print(f"| {key} | {lg[key]:.3f} | {xg[key]:.3f} |")
        print("\n| apply the bitmask to [B, V] logits | lmforge apply_bitmask | xgrammar CPU kernel |\n"
              "| --- | --- | --- |")
        for key, v in figs["apply"].items():
            print(f"| {key} | {v['lmforge_ms']:.3f} | {v['xgrammar_ms']:.3f} |")

    first = next(iter(tokenizers.values()))
    results["support"] = support_table(first)
    print("\n## schema support\n| schema | llguidance (lmforge's message) | xgrammar |\n| --- | --- | --- |")
    for label, row in results["support"].items():
        print(f"| {label} | {row['llguidance']} | {row['xgrammar'][:160]} |")

    if not args.no_model:
        results["model"] = {}
        models = {}
        if 50257 in tokenizers:
            models["gpt2-124M"] = (GPTConfig(flavor="gpt2", vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12,
                                             n_head=12), tokenizers[50257])
        if 4096 in tokenizers:
            models["tiny llama 2x128"] = (GPTConfig(flavor="llama", vocab_size=4096, n_positions=1024, n_embd=128,
                                                    n_layer=2, n_head=2), tokenizers[4096])
        print("\n## decode through the model (ms per step; the JSON schema on every row; mask = fill + apply + accept)")
        print("| model | batch | decoding | free | constrained | difference | mask | mask / free step |\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- |")
        for label, (config, tokenizer) in models.items():
            torch.manual_seed(0)
            model = GPT(config).eval()
            for batch in (1, 32):
                for greedy in (True, False):
                    how = "greedy" if greedy else "sampled"
                    fig = decode_figures(model, tokenizer, batch, args.steps, args.rounds, greedy)
                    results["model"][f"{label} b{batch} {how}"] = fig
                    print(f"| {label} | {batch} | {how} | {fig['free_ms']:.2f} | {fig['constrained_ms']:.2f} | "
                          f"{fig['overhead_ms']:+.2f} ({fig['overhead_pct']:+.1f}%) | {fig['mask_ms']:.2f} | "
                          f"{fig['mask_ms'] / fig['free_ms']:.1%} |", flush=True)

    if args.validity_seeds:
        from posttrain_helpers import make_tool_sft_checkpoint

        rows = validity_rows(args.rows)
        results["validity"] = {}
        print(f"\n## tool-call validity through lmforge serve, {len(rows)} test rows expecting a call, greedy; "
              "the tests' tiny tool-calling model (2 x 64 llama, 200 sft steps), one per seed")
        print("| seed | tool_choice | valid calls | right tool | cut by the context |\n| --- | --- | --- | --- | --- |")
        for seed in map(int, args.validity_seeds.split(",")):
            checkpoint = make_tool_sft_checkpoint(work / f"tool_sft_{seed}", seed=seed).checkpoint
            for choice in ("auto", "required"):
                fig = results["validity"][f"seed {seed} {choice}"] = tool_call_validity(checkpoint, rows, choice)
                print(f"| {seed} | {choice} | {fig['valid']:.1%} | {fig['right_tool']:.1%} | {fig['cut']:.1%} |",
                      flush=True)

    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
