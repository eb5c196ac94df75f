"""A synthetic tool-calling dataset, and the evaluation that scores a chat model on its held-out split.

**The data** (``write_tool_call_dataset``): ``train.jsonl``, ``val.jsonl``, ``test.jsonl`` and
``meta.json``. Each row is an OpenAI-style conversation ``{"messages": [...], "tools": [...]}`` whose
*last* message is the assistant turn that training teaches and the evaluation scores (the
reference). Seven tools with typed arguments (string, integer, number, boolean, enum; required and
optional) are offered two to four at a time (the right one always among them; two or three in 80% of
rows), so that the rendered prompt stays short for a small model. Four kinds of row (``CASES``):

* ``single_call`` — a request; the reference is one tool call;
* ``call_after_chat`` — an unrelated exchange first, then a request; the reference is the call;
* ``tool_result_answer`` — request, call, the tool's JSON result; the reference is a plain answer
  that uses the result;
* ``no_call`` — chit-chat or a general question with tools available; the reference is a plain reply
  (the right behaviour is not to call a tool).

Argument values (cities, currency codes, file patterns, names, labels, integers, decimals …) are
split between train, val and test by a fixed hash of the value, the same for every seed: no value
of a held-out row's arguments occurs in any training row. Enum and boolean values are part of the
schema and are shared. The general questions of ``no_call`` rows are split the same way. The seed
picks the rows; the same seed writes the same bytes.

**The evaluation** (``evaluate_tool_calls``) prompts the model exactly as ``lmforge serve`` does for a
chat request with tools, decodes greedily (the continuous-batching ``Engine`` at temperature 0), and
reads the reply with the server's own ``parse_tool_calls``. ``score_reply`` scores one reply against
its reference; ``METRIC_DOC`` defines every reported metric.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import random
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmforge.chat import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    parse_tool_calls,
)
from lmforge.errors import LMForgeError

SPLITS = ("train", "val", "test")
CASES = ("single_call", "call_after_chat", "tool_result_answer", "no_call")
# Share of each case in every split; single_call takes what rounding leaves.
CASE_SHARES = {"call_after_chat": 0.10, "tool_result_answer": 0.15, "no_call": 0.20}
SPLIT_SHARES = (0.70, 0.15, 0.15)  # train / val / test share of every value pool
FORMAT_VERSION = 1
# The rendered prompt (template text, "<s>"/"</s>" as bos/eos) of a row stays within this: about 300
# tokens of a byte-level BPE trained on the data.
MAX_PROMPT_CHARS = 1100


# ---- tools ------------------------------------------------------------------------------------------

def _tool(name: str, description: str, properties: dict[str, dict], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


_S, _I, _N, _B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
UNITS = ["celsius", "fahrenheit"]
TOOLS: dict[str, dict[str, Any]] = {t["function"]["name"]: t for t in (
    _tool("get_weather", "Weather in a city.", {"city": _S, "unit": {"type": "string", "enum": UNITS}}, ["city"]),
    _tool("convert_currency", "Convert money.", {"amount": _N, "from": _S, "to": _S}, ["amount", "from", "to"]),
    _tool("search_files", "Find files by glob pattern.", {"pattern": _S, "max_results": _I}, ["pattern"]),
    _tool("set_timer", "Start a timer.", {"minutes": _I, "label": _S}, ["minutes"]),
    _tool("send_email", "Send an email.", {"to": _S, "subject": _S, "body": _S}, ["to", "subject"]),
    _tool("run_tests", "Run a package's tests.", {"package": _S, "verbose": _B}, ["package"]),
    _tool("lookup_stock", "Stock price by ticker.", {"symbol": _S}, ["symbol"]),
)}
TOOL_NAMES = list(TOOLS)

# ---- value pools (split by a fixed hash of each value) ---------------------------------------------

_POOL_TEXT = {
    "city": "Paris Berlin Tokyo Oslo Lima Cairo Madrid Rome Dublin Vienna Prague Lisbon Athens Warsaw Seoul "
            "Delhi Dakar Nairobi Quito Bogota Havana Denver Boston Austin Chicago Toronto Sydney Perth Hanoi "
            "Manila Jakarta Riga Tallinn Helsinki Zurich Geneva Milan Naples Porto Seville Kyoto Osaka Lagos "
            "Accra Tunis Baku Minsk Kyiv Sofia Bern",
    "currency": "USD EUR GBP JPY CHF CAD AUD NZD SEK NOK DKK PLN CZK HUF INR CNY KRW BRL MXN ZAR TRY SGD HKD "
                "THB ISK RON",
    "pattern": "*.go *.py *.md *.txt *.json *.yaml *.csv *.rs *.js *.ts *.c *.h *.sh *.toml *.log *.sql "
               "*.html *.css *.ini *.cfg *.xml *.png *.jpg *.pdf *.proto *.java *.kt *.rb *.php *.lua "
               "test_*.py *_test.go Makefile",
    "name": "Ana Ben Chloe Dev Eli Fay Gus Hana Ivan Jo Kai Liam Mia Nia Omar Pia Quinn Raj Sam Tara Uma "
            "Vic Wes Yara Zoe Amir Bea Cleo Dan Esme Finn Gia Hugo Ines Jude Lea",
    "package": "auth billing parser router cache storage payments queue logger metrics scheduler mailer uploads "
               "sessions invoices webhooks crawler indexer lexer renderer auditlog geo ledger notifier",
    "subject": "lunch|budget|offsite|invoice|holiday plans|team dinner|code review|weekly sync|the demo|"
               "quarterly goals|new laptop|travel dates|the launch|hiring|rent|book club|the contract|"
               "game night|design doc|onboarding",
    "body": "I will be late|see you there|all done|please call me|running behind|thanks again|it is ready|"
            "looks good to me|can we move it|sounds great|on my way|no changes needed|need more time|"
            "count me in|will send it soon|happy to help|let us talk",
    "label": "tea pasta laundry nap eggs oven rice bread workout plants parking pizza stretch yoga coffee soup "
             "cookies meds homework popcorn",
    "symbol": "AAPL MSFT GOOG AMZN TSLA NVDA META NFLX IBM ORCL INTC AMD CSCO ADBE CRM UBER SHOP SPOT PYPL BABA "
              "SONY NKE PEP DIS WMT COST SBUX",
    "integer": " ".join(str(i) for i in range(1, 1000)),
    "decimal": " ".join(f"{i}.5" for i in range(1, 400)),
}
_SEPARATED = {"subject", "body"}  # multi-word values, '|'-separated

# Invented values beside the real ones (a fixed list, whatever the dataset's seed): with a few dozen
# cities a model can learn the training values by heart and still score on nothing held out; with
# hundreds it has to copy the value from the request, which is the skill the held-out split measures.
_INVENTED = {"city": 600, "name": 400, "package": 300, "label": 300, "symbol": 400, "currency": 200,
             "pattern": 300}
_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"


def _invented(name: str, n: int) -> list[str]:
    rng = random.Random(f"lmforge-tool-values-{name}")
    out: set[str] = set()
    while len(out) < n:
        syllables = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(2, 3)))
        letters = "".join(rng.choice("ABCDEFGHIJKLMNOPRSTUVWXYZ") for _ in range(rng.randint(3, 4)))
        out.add({"city": syllables.capitalize(), "name": syllables[:4].capitalize(), "package": syllables,
                 "label": syllables, "symbol": letters, "currency": letters[:3],
                 "pattern": "*." + syllables[:rng.randint(2, 3)]}[name])
    return sorted(out)


@functools.lru_cache(maxsize=None)
def _pool(name: str) -> tuple[str, ...]:
    text = _POOL_TEXT[name]
    real = text.split("|") if name in _SEPARATED else text.split()
    invented = [v for v in _invented(name, _INVENTED[name]) if v not in real] if name in _INVENTED else []
    return tuple(real + invented)


def _rank(value: str) -> str:
    return hashlib.sha256(value.encode("utf-8")).hexdigest()


def split_values(pool: list[str]) -> dict[str, list[str]]:
    """A pool's values by split: ordered by a hash of the value, the first 70% train, then 15% val
    and 15% test. Independent of the seed, so datasets written with different seeds agree."""
    ordered = sorted(pool, key=_rank)
    n_train = round(len(ordered) * SPLIT_SHARES[0])
    n_val = round(len(ordered) * SPLIT_SHARES[1])
    return {"train": ordered[:n_train], "val": ordered[n_train:n_train + n_val],
            "test": ordered[n_train + n_val:]}


def value_split() -> dict[str, dict[str, list]]:
    """Every pool's split (integers and decimals as numbers), as meta.json records it."""
    out: dict[str, dict[str, list]] = {}
    for name in _POOL_TEXT:
        parts = split_values(list(_pool(name)))
        if name == "integer":
            parts = {s: sorted(int(v) for v in vs) for s, vs in parts.items()}
        elif name == "decimal":
            parts = {s: sorted(float(v) for v in vs) for s, vs in parts.items()}
        else:
            parts = {s: sorted(vs) for s, vs in parts.items()}
        out[name] = parts
    return out


# ---- general questions (no tool needed), split like the values --------------------------------------

CHAT_PAIRS: list[tuple[str, str]] = [
    ("Hi!", "Hello! How can I help you today?"),
    ("Good morning.", "Good morning! What can I do for you?"),
    ("Thanks, that was helpful.", "You're welcome!"),
    ("Who are you?", "I am a small assistant that can answer questions and use tools."),
    ("Tell me a joke.", "Why did the robot go on vacation? It needed to recharge."),
    ("What is the boiling point of water?", "Water boils at 100 degrees Celsius at sea level."),
    ("How many days are in a week?", "There are seven days in a week."),
    ("What color is the sky?", "On a clear day the sky is blue."),
    ("Can you recommend a book?", "Try a classic novel you have not read yet."),
    ("What does CPU stand for?", "CPU stands for central processing unit."),
    ("How are you?", "I'm doing well, thanks for asking!"),
    ("What is a prime number?", "A number with exactly two divisors: one and itself."),
    ("Name a primary color.", "Red is a primary color."),
    ("What is the opposite of hot?", "The opposite of hot is cold."),
    ("Write a short poem about autumn.", "Leaves drift down, the air turns cool, the year slows."),
    ("What is photosynthesis?", "Plants turn light, water and carbon dioxide into sugar and oxygen."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("What is the largest ocean?", "The Pacific is the largest ocean."),
    ("Say something nice.", "You are doing great, keep going!"),
    ("Define gravity.", "Gravity is the force that pulls masses toward each other."),
    ("What year comes after 1999?", "The year 2000."),
    ("Is a tomato a fruit?", "Yes, botanically a tomato is a fruit."),
    ("Goodbye!", "Goodbye! Have a nice day."),
    ("How many minutes are in an hour?", "There are 60 minutes in an hour."),
    ("Can you keep a secret?", "I don't remember anything between chats."),
    ("What is a verb?", "A word for an action, like run or write."),
    ("Give me a word that rhymes with cat.", "Hat rhymes with cat."),
    ("Who wrote Hamlet?", "William Shakespeare wrote Hamlet."),
    ("What do bees make?", "Bees make honey."),
    ("How many sides does a triangle have?", "A triangle has three sides."),
    ("What is machine learning?", "Teaching computers to find patterns in data."),
    ("Do you dream?", "No, I only think when someone asks me something."),
    ("Suggest a name for a dog.", "How about Biscuit?"),
    ("Explain what a timer does.", "A timer counts down and alerts you when the time is up."),
    ("Why is the sea salty?", "Rivers carry minerals into it and the water evaporates."),
    ("Are you a robot?", "I am a language model, a kind of computer program."),
    ("What should I cook tonight?", "A simple stir fry is quick and tasty."),
    ("What is the weather usually like in a desert?", "Hot and dry by day, cool at night."),
    ("Which currencies do you know?", "Dollars, euros and yen are common ones."),
    ("What is a stock market?", "A place where shares of companies are bought and sold."),
    ("How do I write a good email?", "Keep it short, clear and polite."),
    ("Why do tests matter in software?", "They catch mistakes before users do."),
    ("What is a file extension?", "The letters after the dot in a file name, like txt."),
    ("Thank you!", "Happy to help!"),
]

# ---- request phrasings: (text, optional arguments it mentions, fixed argument values) ----------------

Template = tuple[str, tuple[str, ...], dict[str, Any]]
PHRASINGS: dict[str, list[Template]] = {
    "get_weather": [
        ("What's the weather in {city}?", (), {}),
        ("What is the weather like in {city} today?", (), {}),
        ("How warm is it in {city} right now?", (), {}),
        ("Weather for {city}, please.", (), {}),
        ("Is it raining in {city}?", (), {}),
        ("Check the weather in {city}.", (), {}),
        ("Give me the weather in {city} in {unit}.", ("unit",), {}),
        ("What's the temperature in {city} in {unit}?", ("unit",), {}),
        ("How cold is {city}? Use {unit}.", ("unit",), {}),
    ],
    "convert_currency": [
        ("Convert {amount} {from} to {to}.", (), {}),
        ("How much is {amount} {from} in {to}?", (), {}),
        ("What are {amount} {from} worth in {to}?", (), {}),
        ("Change {amount} {from} into {to} for me.", (), {}),
        ("I have {amount} {from}. How many {to} is that?", (), {}),
    ],
    "search_files": [
        ("Find files matching {pattern}.", (), {}),
        ("Search for {pattern} files.", (), {}),
        ("List the files that match {pattern}.", (), {}),
        ("Which files match {pattern}?", (), {}),
        ("Find up to {max_results} files matching {pattern}.", ("max_results",), {}),
        ("Show me at most {max_results} {pattern} files.", ("max_results",), {}),
        ("Search {pattern}, limit {max_results} results.", ("max_results",), {}),
    ],
    "set_timer": [
        ("Set a timer for {minutes} minutes.", (), {}),
        ("Start a {minutes} minute timer.", (), {}),
        ("Remind me in {minutes} minutes.", (), {}),
        ("Timer: {minutes} minutes, please.", (), {}),
        ("Set a {minutes} minute timer called {label}.", ("label",), {}),
        ("Set a timer for {minutes} minutes for the {label}.", ("label",), {}),
        ("Start a {label} timer for {minutes} minutes.", ("label",), {}),
    ],
    "send_email": [
        ("Email {to} with the subject {subject}.", (), {}),
        ("Send an email to {to} about {subject}.", (), {}),
        ("Write to {to}, subject: {subject}.", (), {}),
        ("Send {to} an email titled {subject} saying {body}.", ("body",), {}),
        ("Email {to} about {subject} and say {body}.", ("body",), {}),
        ("Mail {to}. Subject: {subject}. Body: {body}.", ("body",), {}),
    ],
    "run_tests": [
        ("Run the tests for {package}.", (), {}),
        ("Run the {package} tests.", (), {}),
        ("Can you test the {package} package?", (), {}),
        ("Do the {package} tests pass?", (), {}),
        ("Run the {package} tests with verbose output.", (), {"verbose": True}),
        ("Run the tests in {package} verbosely.", (), {"verbose": True}),
        ("Run the {package} tests quietly, not verbose.", (), {"verbose": False}),
    ],
    "lookup_stock": [
        ("What is the price of {symbol}?", (), {}),
        ("How is {symbol} trading today?", (), {}),
        ("Look up the stock {symbol}.", (), {}),
        ("Get me a quote for {symbol}.", (), {}),
        ("What's {symbol} at right now?", (), {}),
    ],
}
_LEADS = ("", "", "", "", "Hey, ", "Quick question: ", "Please help. ")
_CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "foggy", "snowy", "clear")
_STEMS = ("main", "util", "app", "core", "io", "db", "web", "cli", "api", "lib")


class _Values:
    """Draws argument values from one split's share of each pool."""

    def __init__(self, split: str):
        self.parts = {name: split_values(list(_pool(name)))[split] for name in _POOL_TEXT}
        self.ints = sorted(int(v) for v in self.parts["integer"])

    def pick(self, rng: random.Random, pool: str) -> str:
        return rng.choice(self.parts[pool])

    def int_in(self, rng: random.Random, low: int, high: int) -> int:
        return rng.choice([i for i in self.ints if low <= i <= high])

    def email(self, rng: random.Random) -> str:
        return f"{self.pick(rng, 'name').lower()}@acme.io"


def _arguments(tool: str, rng: random.Random, values: _Values, optional: tuple[str, ...],
               fixed: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments, in the schema's property order."""
    if tool == "get_weather":
        args = {"city": values.pick(rng, "city"), "unit": rng.choice(UNITS)}
    elif tool == "convert_currency":
        source, target = rng.sample(values.parts["currency"], 2)
        amount = values.int_in(rng, 1, 999) if rng.random() < 0.6 else float(values.pick(rng, "decimal"))
        args = {"amount": amount, "from": source, "to": target}
    elif tool == "search_files":
        args = {"pattern": values.pick(rng, "pattern"), "max_results": values.int_in(rng, 1, 50)}
    elif tool == "set_timer":
        args = {"minutes": values.int_in(rng, 2, 999), "label": values.pick(rng, "label")}
    elif tool == "send_email":
        args = {"to": values.email(rng), "subject": values.pick(rng, "subject"), "body": values.pick(rng, "body")}
    elif tool == "run_tests":
        args = {"package": values.pick(rng, "package"), "verbose": None}
    elif tool == "lookup_stock":
        args = {"symbol": values.pick(rng, "symbol")}
    else:  # pragma: no cover - TOOLS and this function are written together
        raise AssertionError(tool)
    required = TOOLS[tool]["function"]["parameters"]["required"]
    args.update(fixed)
    return {k: v for k, v in args.items() if (k in required or k in optional or k in fixed) and v is not None}


def _tool_result(tool: str, args: dict[str, Any], rng: random.Random) -> tuple[dict[str, Any], str]:
    """A plausible JSON result of the call, and the assistant's answer that uses it."""
    if tool == "get_weather":
        t = rng.randint(30, 95) if args.get("unit") == "fahrenheit" else rng.randint(-5, 35)
        c = rng.choice(_CONDITIONS)
        answer = rng.choice([f"It is {t} degrees and {c} in {args['city']}.", f"{args['city']}: {c}, {t} degrees."])
        return {"temperature": t, "condition": c}, answer
    if tool == "convert_currency":
        value = round(args["amount"] * rng.uniform(0.2, 5.0), 2)
        return {"result": value}, f"{_num(args['amount'])} {args['from']} is {_num(value)} {args['to']}."
    if tool == "search_files":
        stems = rng.sample(_STEMS, min(rng.randint(1, 3), args.get("max_results", 3)))
        pattern = args["pattern"]
        files = [pattern.replace("*", stem) for stem in stems] if "*" in pattern else [pattern]
        return {"files": files}, f"Found {len(files)}: {', '.join(files)}."
    if tool == "set_timer":
        ends = f"{rng.randint(6, 22):02d}:{rng.randint(0, 59):02d}"
        label = f"The {args['label']} timer" if "label" in args else "Your timer"
        return {"ends_at": ends}, f"{label} ends at {ends}."
    if tool == "send_email":
        mid = f"m{rng.randint(1000, 9999)}"
        return {"status": "sent", "id": mid}, f"Sent to {args['to']}, message id {mid}."
    if tool == "run_tests":
        passed, failed = rng.randint(3, 99), rng.choice([0, 0, 0, 1, 2, 3])
        answer = (f"All {passed} tests passed." if not failed else f"{passed} passed and {failed} failed.")
        return {"passed": passed, "failed": failed}, answer
    if tool == "lookup_stock":
        price = round(rng.uniform(5, 900), 2)
        return {"symbol": args["symbol"], "price": price}, f"{args['symbol']} is at {_num(price)}."
    raise AssertionError(tool)  # pragma: no cover


def _num(x: float) -> str:
    return json.dumps(x)


def call_message(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn that calls one tool (OpenAI form, arguments as JSON text)."""
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}]}


class _RowMaker:
    def __init__(self, split: str, rng: random.Random):
        self.rng = rng
        self.values = _Values(split)
        chat = split_values([q for q, _ in CHAT_PAIRS])[split]
        self.chat = [pair for pair in CHAT_PAIRS if pair[0] in chat]

    def tools_for(self, needed: str | None) -> list[dict[str, Any]]:
        rng = self.rng
        n = rng.choices((2, 3, 4), weights=(4, 4, 2))[0]  # 4 tools make the longest prompts: fewer of them
        others = [t for t in TOOL_NAMES if t != needed]
        names = rng.sample(others, n - 1 if needed else n) + ([needed] if needed else [])
        rng.shuffle(names)
        return [copy.deepcopy(TOOLS[name]) for name in names]

    def request(self) -> tuple[str, str, dict[str, Any]]:
        """(tool, user text, arguments) of a random request."""
        rng = self.rng
        tool = rng.choice(TOOL_NAMES)
        text, optional, fixed = rng.choice(PHRASINGS[tool])
        args = _arguments(tool, rng, self.values, optional, fixed)
        fields = {k: (_num(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
                  for k, v in args.items()}
        text, lead = text.format(**fields), rng.choice(_LEADS)
        if lead and not text.startswith("I "):
            text = text[0].lower() + text[1:]
        return tool, lead + text, args

    def chat_pair(self) -> tuple[str, str]:
        rng = self.rng
        if rng.random() < 0.3:  # arithmetic: endless variety, numbers from this split
            a, b = self.values.int_in(rng, 1, 120), self.values.int_in(rng, 1, 120)
            return rng.choice([(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."),
                               (f"Add {a} and {b}.", f"{a} + {b} = {a + b}.")])
        if rng.random() < 0.15:
            name = self.values.pick(rng, "name")
            return rng.choice([(f"Say hi to {name}.", f"Hi {name}, nice to meet you!"),
                               (f"My name is {name}.", f"Nice to meet you, {name}!")])
        return rng.choice(self.chat)

    def row(self, case: str) -> dict[str, Any]:
        if case == "no_call":
            question, answer = self.chat_pair()
            return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
                    "tools": self.tools_for(None)}
        tool, text, args = self.request()
        messages: list[dict[str, Any]] = []
        if case == "call_after_chat":
            question, answer = self.chat_pair()
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        messages += [{"role": "user", "content": text}, call_message(tool, args)]
        if case == "tool_result_answer":
            result, answer = _tool_result(tool, args, self.rng)
            messages += [{"role": "tool", "name": tool, "content": json.dumps(result, ensure_ascii=False)},
                         {"role": "assistant", "content": answer}]
        return {"messages": messages, "tools": self.tools_for(tool)}

    def fitted(self, case: str) -> dict[str, Any]:
        """A row whose prompt renders to at most ``MAX_PROMPT_CHARS``: tools it does not need are
        dropped (last first) while it is longer; two always stay."""
        from lmforge.chat import render_chat

        row = self.row(case)
        needed = next((m["tool_calls"][0]["function"]["name"] for m in row["messages"] if m.get("tool_calls")), None)
        while len(row["tools"]) > 2 and len(render_chat(row["messages"][:-1], "<s>", "</s>",
                                                        tools=row["tools"])) > MAX_PROMPT_CHARS:
            drop = max(i for i, t in enumerate(row["tools"]) if t["function"]["name"] != needed)
            row["tools"] = row["tools"][:drop] + row["tools"][drop + 1:]
        return row


def case_counts(n: int) -> dict[str, int]:
    """How many rows of each case a split of ``n`` rows holds."""
    counts = {case: round(n * share) for case, share in CASE_SHARES.items()}
    return {"single_call": n - sum(counts.values()), **counts}


def case_of(row: dict[str, Any]) -> str:
    """The case of a row, read from its shape."""
    messages = row["messages"]
    last = messages[-1]
    if last.get("tool_calls"):
        return "call_after_chat" if any(m["role"] == "assistant" for m in messages[:-1]) else "single_call"
    if any(m["role"] == "tool" for m in messages):
        return "tool_result_answer"
    return "no_call"


def make_rows(split: str, n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` rows of ``split`` (its share of the values), in the case proportions of ``case_counts``."""
    if split not in SPLITS:
        raise LMForgeError(f"unknown split {split!r}; use one of: {', '.join(SPLITS)}")
    rng = random.Random(f"lmforge-toolcalls-{seed}-{split}")
    cases = [case for case, k in case_counts(n).items() for _ in range(k)]
    rng.shuffle(cases)
    maker = _RowMaker(split, rng)
    return [maker.fitted(case) for case in cases]


def write_tool_call_dataset(out_dir: str | Path, n_train: int = 2000, n_val: int = 200, n_test: int = 300,
                            seed: int = 0, overwrite: bool = False) -> dict[str, Any]:
    """Write ``OUT/{train,val,test}.jsonl`` and ``OUT/meta.json``; returns the meta dict."""
    def describe(rows: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
        return {
            "format": "lmforge-toolcalls",
            "version": FORMAT_VERSION,
            "seed": seed,
            "counts": {split: len(r) for split, r in rows.items()},
            "cases": {split: dict(sorted(Counter(case_of(row) for row in r).items())) for split, r in rows.items()},
            "tools": TOOL_NAMES,
            "value_split": value_split(),
            "question_split": split_values([q for q, _ in CHAT_PAIRS]),
            "shared_values": {"get_weather.unit": UNITS, "run_tests.verbose": [True, False]},
        }

    return write_splits(out_dir, {"train": n_train, "val": n_val, "test": n_test},
                        lambda split, n: make_rows(split, n, seed), describe, "tool-call dataset", overwrite)


def write_splits(out_dir: str | Path, sizes: dict[str, int], make: Callable[[str, int], list[dict[str, Any]]],
                 describe: Callable[[dict[str, list[dict[str, Any]]]], dict[str, Any]], what: str,
                 overwrite: bool) -> dict[str, Any]:
    """Write a generated dataset: ``OUT/{split}.jsonl`` with ``make(split, n)``'s rows for each of
    ``sizes`` and ``OUT/meta.json`` with ``describe(rows)``, all at once (a directory that appears
    complete or not at all). An existing non-empty ``OUT`` is replaced only with ``overwrite`` and
    only when it is an earlier such dataset (it has a meta.json). Returns the meta dict."""
    from lmforge.files import atomic_directory, remove_stale

    for split, n in sizes.items():
        if not isinstance(n, int) or n < 0:
            raise LMForgeError(f"n_{split} must be an integer >= 0, got {n!r}")
    out = Path(out_dir).resolve()  # resolved so that "." still has a name for the temporary sibling
    remove_stale(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not overwrite:
            raise LMForgeError(f"{out} exists and is not empty; pass --overwrite (overwrite=True from Python) to "
                               "replace it, or choose another directory")
        if not (out / "meta.json").is_file():
            raise LMForgeError(f"{out} is not an earlier {what} (no meta.json), so it is not "
                               "replaced even with --overwrite; choose another directory")
    rows = {split: make(split, n) for split, n in sizes.items()}
    meta = describe(rows)
    with atomic_directory(out, fix="or choose another directory") as tmp:
        for split, r in rows.items():
            with open(tmp / f"{split}.jsonl", "w", encoding="utf-8", newline="\n") as f:
                f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in r)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return meta


def load_rows(path: str | Path, split: str = "test") -> list[dict[str, Any]]:
    """Rows of a jsonl file, or of ``DIR/{split}.jsonl`` for a dataset directory. Each must be a
    ``{"messages": [...], "tools": [...]}`` object whose last message is an assistant turn; a bad
    row is reported as ``FILE:LINE: what is wrong``."""
    from lmforge.posttrain.rollout import read_message_rows

    path = Path(path)
    file = path / f"{split}.jsonl" if path.is_dir() else path
    return read_message_rows(file, "give a tool-call dataset directory or one of its .jsonl files", _check_scored_row)


def _check_scored_row(row: dict[str, Any]) -> None:
    last = row["messages"][-1]
    if last.get("role") != "assistant":
        raise LMForgeError(f"the last message must be the assistant turn to score, got role {last.get('role')!r}")
    calls = last.get("tool_calls") or []
    for call in calls if isinstance(calls, list) else [calls]:  # a call not in a list is refused as a call
        reference_call(call)


# ---- scoring ------------------------------------------------------------------------------------------

METRIC_DOC = {
    "rows": "rows scored",
    "call_rows": "rows whose reference is a tool call",
    "no_call_rows": "rows whose reference is a plain reply and that hold no tool result (no tool needed)",
    "answer_rows": "rows whose reference is a plain answer after a tool result",
    "answer_checkable_rows": "answer rows whose reference contains a tool-result value (see answer_mentions_result)",
    "parse_rate": "call rows whose reply holds >= 1 call parse_tool_calls accepts",
    "tool_name_acc": "call rows whose first parsed call has the reference's tool name",
    "exact_args": "call rows with the right name and arguments equal to the reference's as JSON objects",
    "arg_f1": "micro F1 over (key, value) argument pairs of the first parsed call vs the reference call, "
              "values compared as JSON values, whatever the call's name (no call: every reference pair is a miss)",
    "abstention": "no-call rows whose reply is non-empty plain text with no call and no <tool_call> marker",
    "false_call_rate": "no-call rows whose reply attempts a call (a parsed call or a <tool_call> marker)",
    "answer_call_rate": "answer rows whose reply attempts another call",
    "answer_mentions_result": "answer rows (with a checkable value) whose reply contains every tool-result "
                              "value (JSON leaf) that the reference answer contains",
    "malformed_calls": "replies (all rows) with more <tool_call> markers than parsed calls",
}


def json_equal(a: Any, b: Any) -> bool:
    """Equality of JSON values: booleans are not numbers, 2 equals 2.0, containers compare deeply."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def reference_call(call: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(name, arguments) of an OpenAI tool call whose arguments are JSON text or an object."""
    fn = call.get("function", call) if isinstance(call, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    args = fn.get("arguments", {}) if isinstance(fn, dict) else None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            args = None
    if not isinstance(name, str) or not isinstance(args, dict):
        raise LMForgeError("a reference tool call needs a string 'name' and 'arguments' that are a JSON object")
    return name, args


def reference_text(message: dict[str, Any]) -> str:
    """The text of an assistant turn as the chat template renders it (what a model should write)."""
    text = message.get("content") or ""
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        args = fn["arguments"] if isinstance(fn["arguments"], str) else json.dumps(fn["arguments"], ensure_ascii=False)
        name = json.dumps(fn["name"], ensure_ascii=False)
        text += f'{TOOL_CALL_OPEN}{{"name": {name}, "arguments": {args}}}{TOOL_CALL_CLOSE}'
    return text


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _leaves(v)]
    if isinstance(value, list):
        return [x for v in value for x in _leaves(v)]
    return [value]


def _mentions(text: str, value: Any) -> bool:
    """``value`` (a JSON leaf) occurs in ``text`` as a whole token: 14 is not found in 140 or 1.14."""
    if value is None or isinstance(value, bool):
        return False
    needle = value if isinstance(value, str) else json.dumps(value)
    if not needle:
        return False
    return re.search(r"(?<![\w.])" + re.escape(needle) + r"(?!\w|\.\d)", text) is not None


def result_values(tool_result: str | None, reference_answer: str) -> list[Any]:
    """The leaves of a tool result (JSON text) that the reference answer mentions: what a good
    answer must carry over. Empty when the result is not JSON or none is mentioned."""
    if not tool_result:
        return []
    try:
        data = json.loads(tool_result)
    except json.JSONDecodeError:
        return []
    return [v for v in _leaves(data) if _mentions(reference_answer, v)]


def score_reply(reply: str, reference: dict[str, Any], tool_result: str | None = None) -> dict[str, Any]:
    """Score one generated reply against the reference assistant message.

    Returns ``kind`` ("call" when the reference calls a tool, else "plain"), ``calls`` (parsed calls),
    ``markers`` (``<tool_call>`` occurrences), ``malformed``, ``content`` (the reply's text outside the
    calls, stripped); for a call reference ``name_ok``, ``args_exact``, ``tp``/``fp``/``fn`` (argument
    pairs); for a plain reference ``attempted_call``, ``abstained``, and with ``tool_result`` (the
    JSON text of the tool message before it) ``checked_values`` and ``mentions_result``.
    """
    content, calls = parse_tool_calls(reply)
    markers = reply.count(TOOL_CALL_OPEN)
    out: dict[str, Any] = {"calls": len(calls), "markers": markers, "malformed": markers > len(calls),
                           "content": content.strip() if calls else reply.strip()}
    ref_calls = reference.get("tool_calls") or []
    if ref_calls:
        ref_name, ref_args = reference_call(ref_calls[0])
        name, args = (calls[0].name, json.loads(calls[0].arguments)) if calls else (None, {})
        tp = sum(1 for k, v in args.items() if k in ref_args and json_equal(v, ref_args[k]))
        out.update(kind="call", name_ok=name == ref_name, args_exact=name == ref_name and json_equal(args, ref_args),
                   tp=tp, fp=len(args) - tp, fn=len(ref_args) - tp)
    else:
        attempted = bool(calls) or markers > 0
        out.update(kind="plain", attempted_call=attempted, abstained=not attempted and bool(out["content"]))
        if tool_result is not None:
            wanted = result_values(tool_result, reference.get("content") or "")
            out["checked_values"] = wanted
            out["mentions_result"] = bool(wanted) and all(_mentions(reply, v) for v in wanted)
    return out


def _last_tool_result(messages: list[dict[str, Any]]) -> str | None:
    for m in reversed(messages[:-1]):
        if m.get("role") == "tool":
            return m.get("content") if isinstance(m.get("content"), str) else None
    return None


def aggregate_scores(rows: list[dict[str, Any]], scores: list[dict[str, Any]]) -> dict[str, Any]:
    """The metrics of ``METRIC_DOC`` from per-row ``score_reply`` results (rates are None where a
    group is empty)."""
    def rate(num: int, den: int) -> float | None:
        return num / den if den else None

    calls = [s for s in scores if s["kind"] == "call"]
    after_result = [any(m.get("role") == "tool" for m in row["messages"][:-1]) for row in rows]
    answers = [s for s, after in zip(scores, after_result) if s["kind"] == "plain" and after]
    plain = [s for s, after in zip(scores, after_result) if s["kind"] == "plain" and not after]
    tp, fp, fn = (sum(s[k] for s in calls) for k in ("tp", "fp", "fn"))
    checkable = [s for s in answers if s.get("checked_values")]
    abstained = sum(s["abstained"] for s in plain)
    # exact_args first: where a caller takes the first figure as the headline (the pipeline's eval stage).
    return {
        "exact_args": rate(sum(s["args_exact"] for s in calls), len(calls)),
        "tool_name_acc": rate(sum(s["name_ok"] for s in calls), len(calls)),
        "parse_rate": rate(sum(s["calls"] > 0 for s in calls), len(calls)),
        "arg_f1": rate(2 * tp, 2 * tp + fp + fn),
        "abstention": rate(abstained, len(plain)),
        "false_call_rate": rate(sum(s["attempted_call"] for s in plain), len(plain)),
        "answer_call_rate": rate(sum(s["attempted_call"] for s in answers), len(answers)),
        "answer_mentions_result": rate(sum(s["mentions_result"] for s in checkable), len(checkable)),
        "malformed_calls": sum(s["malformed"] for s in scores),
        "rows": len(scores),
        "call_rows": len(calls),
        "no_call_rows": len(plain),
        "answer_rows": len(answers),
        "answer_checkable_rows": len(checkable),
    }


# ---- generation -----------------------------------------------------------------------------------------

def prompt_ids(tokenizer: Any, row: dict[str, Any]) -> list[int]:
    """The ids ``lmforge serve`` feeds the model for this row's conversation without its last turn."""
    return [tokenizer.eos_id, *tokenizer.encode_chat(row["messages"][:-1], tools=row.get("tools") or None)]


def generate_greedy(model: Any, prompts: list[list[int]], eos_id: int, max_new_tokens: int,
                    batch_size: int = 16, on_done: Any = None) -> list[list[int]]:
    """Greedy replies (eos not included) to many prompts at once, with the server's continuous-batching
    ``Engine`` at temperature 0, run in this thread (``rollout.sample``). ``on_done()`` is called as
    each one ends."""
    from lmforge.posttrain.rollout import sample

    done = sample(model, prompts, eos_id, max_new_tokens, temperature=0, batch_size=batch_size, on_done=on_done)
    return [c.tokens for c in done]


def evaluate_tool_calls(model: Any, tokenizer: Any, rows: list[dict[str, Any]], max_new_tokens: int = 96,
                        batch_size: int = 16, progress: bool = True, n_examples: int = 4) -> dict[str, Any]:
    """Generate a greedy reply for every row (prompted with all of the row but its last turn, as the
    server prompts) and score it against that last turn: ``aggregate_scores``'s metrics plus
    ``replies`` (in row order) and ``examples`` (a few prompt tail / reply / reference triples)."""
    from tqdm.auto import tqdm

    if not rows:
        raise LMForgeError("no rows to evaluate")
    prompts = [prompt_ids(tokenizer, row) for row in rows]
    with tqdm(total=len(rows), desc="tool-call eval", unit=" rows", disable=not progress) as bar:
        outputs = generate_greedy(model, prompts, tokenizer.eos_id, max_new_tokens, batch_size,
                                  on_done=lambda: bar.update(1))
    replies = [tokenizer.decode(ids) for ids in outputs]
    scores = [score_reply(reply, row["messages"][-1], _last_tool_result(row["messages"]))
              for reply, row in zip(replies, rows)]
    metrics = aggregate_scores(rows, scores)
    examples = []
    seen: Counter = Counter()
    for row, reply in zip(rows, replies):
        case = case_of(row)
        if len(examples) >= n_examples or seen[case] >= max(1, n_examples // len(CASES)):
            continue
        seen[case] += 1
        prompt = tokenizer.apply_chat_template(row["messages"][:-1], tools=row.get("tools") or None)
        examples.append({"case": case, "prompt_tail": prompt[-160:], "reply": reply,
                         "reference": reference_text(row["messages"][-1])})
    return {**metrics, "replies": replies, "examples": examples}


_REPORT_ORDER = ("rows", "call_rows", "no_call_rows", "answer_rows", "parse_rate", "tool_name_acc", "exact_args",
                 "arg_f1", "abstention", "false_call_rate", "answer_call_rate", "answer_mentions_result",
                 "malformed_calls")


def format_tool_call_report(results: dict[str, dict[str, Any]]) -> str:
    """A table of the metrics, one column per model label (e.g. "fine-tuned", "before fine-tuning")."""
    labels = list(results)
    header = ["metric", *labels]
    lines = []
    for key in _REPORT_ORDER:
        if not any(key in r for r in results.values()):
            continue
        cells = [key]
        for label in labels:
            v = results[label].get(key)
            cells.append("-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v))
        lines.append(cells)
    widths = [max(len(str(row[i])) for row in [header, *lines]) for i in range(len(header))]

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *(fmt(c) for c in lines)])
