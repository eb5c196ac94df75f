"""Reward functions for the reinforcement-learning kinds (grpo, ppo): what a completion is worth.

A reward function is any callable ``fn(prompts, completions) -> list[float]``: ``prompts`` are the
dataset rows the completions answer (dicts with ``messages``, ``tools``, the reference reply as the
last message where the row has one, ``answer`` and any other field of the row), ``completions`` the
decoded replies (text, without the closing eos), one per row; it returns one number per completion.

A recipe names them in ``recipe.rewards``, each a built-in name or ``module:function`` (imported with
``importlib``: the user's own code, which they name), with a weight::

    rewards:
      - {name: tool_call, weight: 1.0}
      - {name: my_rewards:brevity, weight: 0.1}

Built-ins (``BUILTIN_REWARDS``): ``tool_call`` (the reply's tool call against the reference, read by
the server's parser), ``exact_match``, ``go_parses`` (tree-sitter-go), ``go_builds`` and ``go_vet``
(the ``go`` tool), and ``reward_model:PATH`` (a trained ``lmforge.models.reward.RewardModel``).

``load_rewards`` resolves the names and ``Rewards.check`` calls each function on the first two rows
of the data, so a name that does not import, is not callable, raises, or returns anything but one
number per completion is refused with an ``LMForgeError`` naming it, before any compute is spent.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import math
import numbers
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.errors import LMForgeError
from lmforge.typed import short_repr
from lmforge.posttrain.rollout import (
    encode_prompt,
    pack_sequences,
    reference_message,
    row_length,
)

RewardFn = Callable[[list[dict[str, Any]], list[str]], Sequence[float]]


# ---- tool calls -------------------------------------------------------------------------------------
# A <tool_call> marker the server's parser cannot read scores as no call, not below it. With -0.5, one
# of three GRPO seeds of the tests' tiny sft model escaped the penalty by never calling a tool and
# writing repetitive plain text, which earns the abstention credit on no-call rows: held-out reward
# up, tool calling gone (reward hacking). With 0 all three seeds improved their tool calls.
TOOL_CALL_MALFORMED = 0.0


def tool_call_value(score: dict[str, Any]) -> float:
    """The reward of one ``toolcalls.score_reply`` result:

    - a malformed call (a ``<tool_call>`` marker the parser cannot read): 0 (as no call), whatever else;
    - the reference calls a tool: no call 0; a valid call 0.2, plus 0.3 for the right tool, plus
      0.5 x the argument F1 when the tool is right (the exact call: 1.0);
    - the reference is a plain reply: any call attempt 0; a plain, non-empty reply 1.0 (after a tool
      result: 0.5, and 1.0 when it carries the result's values that the reference answer carries).
    """
    if score["malformed"]:
        return TOOL_CALL_MALFORMED
    if score["kind"] == "call":
        if not score["calls"]:
            return 0.0
        if not score["name_ok"]:
            return 0.2
        tp, fp, fn = score["tp"], score["fp"], score["fn"]
        f1 = 2 * tp / (2 * tp + fp + fn) if (tp + fp + fn) else 1.0
        return 0.5 + 0.5 * f1
    if score["attempted_call"] or not score["abstained"]:
        return 0.0
    if score.get("checked_values"):
        return 1.0 if score["mentions_result"] else 0.5
    return 1.0


def tool_call(prompts: list[dict[str, Any]], completions: list[str]) -> list[float]:
    """Validity and correctness of each reply's tool call against the row's reference (its last,
    assistant, message), through the server's own parser (``tool_call_value`` says how)."""
    from lmforge.posttrain.toolcalls import _last_tool_result, score_reply

    out = []
    for row, text in zip(prompts, completions):
        reference = reference_message(row)
        if reference is None:
            raise LMForgeError("the tool_call reward needs rows whose last message is the reference assistant "
                               "turn (as `lmforge data tool-calls` writes them); this row ends with a "
                               f"{row['messages'][-1].get('role')!r} message")
        out.append(tool_call_value(score_reply(text, reference, _last_tool_result(row["messages"]))))
    return out


# ---- exact answers -----------------------------------------------------------------------------------
def _normalise(text: str) -> str:
    return " ".join(text.split())


def reference_answer(row: dict[str, Any]) -> str | None:
    """A row's expected answer: its ``answer`` field, else its reference reply as the model would write it."""
    if "answer" in row:
        return str(row["answer"])
    reference = reference_message(row)
    if reference is None:
        return None
    from lmforge.posttrain.toolcalls import reference_text

    return reference_text(reference)


def exact_match(prompts: list[dict[str, Any]], completions: list[str]) -> list[float]:
    """1.0 where the reply equals the row's ``answer`` (or reference reply), whitespace-normalised."""
    out = []
    for row, text in zip(prompts, completions):
        answer = reference_answer(row)
        if answer is None:
            raise LMForgeError("the exact_match reward needs an 'answer' field or a closing assistant turn in "
                               "each row; this row has neither")
        out.append(float(_normalise(text) == _normalise(answer)))
    return out


# ---- Go code -------------------------------------------------------------------------------------------
_FENCE = re.compile(r"```[ \t]*(?:go|golang)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def go_code(text: str) -> str:
    """The Go code of a reply: its fenced code blocks (```go ... ```) joined, else all of it."""
    blocks = _FENCE.findall(text)
    return "\n".join(blocks) if blocks else text


_PARSER: list[Any] = []  # one tree-sitter parser per process, made on first use


def go_parses(prompts: list[dict[str, Any]], completions: list[str]) -> list[float]:
    """1.0 where the reply's Go code (``go_code``) is a source file tree-sitter-go parses without an
    error (declarations, with or without a package clause), else 0.0; an empty reply scores 0."""
    from lmforge.go_syntax import go_parser

    if not _PARSER:
        _PARSER.append(go_parser())
    out = []
    for text in completions:
        root = _PARSER[0].parse(go_code(text).encode("utf-8")).root_node
        out.append(float(root.named_child_count > 0 and not root.has_error))
    return out


_PACKAGE = re.compile(r"^\s*package\s+\w+", re.MULTILINE)
GO_TIMEOUT_S = 60


def _go_tool() -> str:
    go = shutil.which("go")
    if go is None:
        raise LMForgeError("the go_builds / go_vet rewards run the `go` tool, which is not on PATH: install Go "
                           "(https://go.dev/dl, or `apt-get install golang-go`) or use the go_parses reward")
    return go


def _go_check(go: str, command: str, code: str) -> float:
    """1.0 when ``go build`` (and for ``vet``, then ``go vet``) of ``code`` as a one-file module succeeds. Code without a
    package clause is put in a library package (``package reward``), so a lone function compiles."""
    if not _PACKAGE.search(code):
        code = "package reward\n\n" + code
    with tempfile.TemporaryDirectory(prefix="lmforge-go-") as tmp:
        Path(tmp, "go.mod").write_text("module lmforge.local/reward\n\ngo 1.18\n")
        Path(tmp, "reward.go").write_text(code, encoding="utf-8")
        # Offline and self-contained: no module downloads, no toolchain switch, no C compiler.
        env = {**os.environ, "GOFLAGS": "-mod=mod", "GOPROXY": "off", "GOTOOLCHAIN": "local", "CGO_ENABLED": "0",
               "GO111MODULE": "on"}
        steps = [[go, "build", "-o", os.devnull, "./..."]] + ([[go, "vet", "./..."]] if command == "vet" else [])
        for args in steps:  # vet type-checks but does not link (a main package without main passes it)
            try:
                done = subprocess.run(args, cwd=tmp, env=env, capture_output=True, timeout=GO_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                return 0.0
            if done.returncode != 0:
                return 0.0
    return 1.0


def _go_rewards(command: str, completions: list[str]) -> list[float]:
    go = _go_tool()
    codes = [go_code(text) for text in completions]
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        return list(pool.map(lambda code: _go_check(go, command, code) if code.strip() else 0.0, codes))


def go_builds(prompts: list[dict[str, Any]], completions: list[str]) -> list[float]:
    """1.0 where the reply's Go code compiles (``go build``, offline, standard library only), else 0.0."""
    return _go_rewards("build", completions)


def go_vet(prompts: list[dict[str, Any]], completions: list[str]) -> list[float]:
    """1.0 where the reply's Go code compiles and ``go vet`` finds nothing, else 0.0."""
    return _go_rewards("vet", completions)


# ---- a trained reward model ------------------------------------------------------------------------------
class RewardModelScore:
    """``reward_model:PATH``: the score a trained ``RewardModel`` (a checkpoint or run directory) gives
    each prompt + reply, read at the reply's closing eos as the reward kind trains it. The prompt is
    rendered with the reward model's own tokenizer and chat template; a sequence longer than its
    context is scored on its last ``n_positions`` tokens."""

    def __init__(self, path: str, batch_size: int = 32):
        from lmforge.checkpoint import resolve_model_dir
        from lmforge.infer.loading import find_tokenizer
        from lmforge.models import load_model
        from lmforge.tokenizer import Tokenizer

        if not Path(path).exists():
            raise LMForgeError(f"reward_model:{path}: no such checkpoint; give the directory of a model trained by "
                               "the reward kind (runs/NAME or runs/NAME/checkpoints/best)")
        model_dir = resolve_model_dir(path)
        model = load_model(model_dir)
        if not hasattr(model, "rewards"):
            raise LMForgeError(f"reward_model:{path} holds a {model.family!r} model, not a reward model; give a "
                               "checkpoint of the reward kind")
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = Tokenizer.load(find_tokenizer(model_dir))
        self.batch_size = batch_size

    def to(self, device: torch.device) -> RewardModelScore:
        self.model.to(device)
        return self

    @torch.no_grad()
    def __call__(self, prompts: list[dict[str, Any]], completions: list[str]) -> list[float]:
        tok, n_ctx = self.tokenizer, self.model.config.n_positions
        device = next(self.model.parameters()).device
        out: list[float] = []
        for start in range(0, len(prompts), self.batch_size):
            heads, tails = [], []
            for row, text in zip(prompts[start:start + self.batch_size], completions[start:start + self.batch_size]):
                prompt, reply = encode_prompt(tok, row), [*tok.encode(text), tok.eos_id]
                cut = max(0, len(prompt) + len(reply) - n_ctx)
                heads.append(prompt[cut:] if cut < len(prompt) else [])
                tails.append(reply[max(0, cut - len(prompt)):])
            batch = pack_sequences(heads, tails, n_ctx, with_last_token=True, row_len=row_length(n_ctx, device))
            batch = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}
            out += self.model.rewards(batch).float().cpu().tolist()
        return out


# ---- the registry ----------------------------------------------------------------------------------------
BUILTIN_REWARDS: dict[str, RewardFn] = {
    "tool_call": tool_call,
    "exact_match": exact_match,
    "go_parses": go_parses,
    "go_builds": go_builds,
    "go_vet": go_vet,
}
REWARD_MODEL_PREFIX = "reward_model:"
_KNOWN = ", ".join([*BUILTIN_REWARDS, "reward_model:PATH"])


@dataclass
class RewardFunction:
    name: str  # as the config names it
    label: str  # its metrics' name: reward/LABEL
    fn: Any
    weight: float


def _label(name: str) -> str:
    if name.startswith(REWARD_MODEL_PREFIX):
        return "reward_model"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def resolve_reward(name: str) -> Any:
    """The callable a reward name means: a built-in, ``reward_model:PATH``, or ``module:function``."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if name.startswith(REWARD_MODEL_PREFIX):
        return RewardModelScore(name[len(REWARD_MODEL_PREFIX):])
    if ":" not in name:
        close = difflib.get_close_matches(name, list(BUILTIN_REWARDS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise LMForgeError(f"unknown reward function {name!r}.{hint} Use a built-in ({_KNOWN}) or your own as "
                           "'module:function' (a module Python can import)")
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any failure of the user's module is reported the same way
        raise LMForgeError(f"reward function {name!r}: module {module_name!r} cannot be imported ({type(e).__name__}: "
                           f"{e}). Put it on PYTHONPATH (or install it) and fix the error, or use a built-in "
                           f"({_KNOWN})") from e
    fn = getattr(module, attr, None) if attr else None
    if fn is None:
        raise LMForgeError(f"reward function {name!r}: module {module_name!r} has no attribute {attr!r}; name a "
                           "function defined in it as 'module:function'")
    if not callable(fn):
        raise LMForgeError(f"reward function {name!r} is a {type(fn).__name__}, not callable; name a function "
                           "fn(prompts, completions) -> list of floats")
    return fn


def _number(value: Any) -> float | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, (numbers.Real, np.bool_)):  # bools count as 0 / 1
        return float(value)
    return None


class Rewards:
    """The reward functions of a run, with their weights."""

    def __init__(self, functions: list[RewardFunction]):
        if not functions:
            raise LMForgeError("no reward function: list at least one in recipe.rewards, e.g. "
                               "[{name: tool_call, weight: 1.0}]")
        labels = [f.label for f in functions]
        if len(set(labels)) != len(labels):
            raise LMForgeError(f"two reward functions share the metric name {labels!r}: give one a 'label'")
        self.functions = functions

    @property
    def labels(self) -> list[str]:
        return [f.label for f in self.functions]

    @property
    def weights(self) -> np.ndarray:
        return np.asarray([f.weight for f in self.functions], dtype=np.float64)

    def to(self, device: torch.device) -> Rewards:
        """Move what runs a model (``reward_model:PATH``) onto ``device``."""
        for f in self.functions:
            if hasattr(f.fn, "to"):
                f.fn.to(device)
        return self

    def place(self, device: torch.device, frozen: Callable[[Any], Any]) -> None:
        """Put what runs on the training's device: each ``reward_model:PATH``'s model through ``frozen``
        (``ModelHost.frozen``: whole under DDP, sharded under FSDP), any other function with a ``to``
        moved to ``device``."""
        for f in self.functions:
            if isinstance(f.fn, RewardModelScore):
                frozen(f.fn.model)
            elif hasattr(f.fn, "to"):
                f.fn.to(device)

    def _call(self, f: RewardFunction, rows: list[dict[str, Any]], completions: list[str]) -> list[float]:
        try:
            values = f.fn(rows, completions)
        except LMForgeError as e:
            raise LMForgeError(f"reward function {f.name!r}: {e}") from e
        except Exception as e:  # noqa: BLE001 - the user's code: say whose it is
            raise LMForgeError(f"reward function {f.name!r} raised {type(e).__name__}: {e}; fix it so that it "
                               "returns one number per completion") from e
        try:
            values = list(values)
        except TypeError:
            raise LMForgeError(f"reward function {f.name!r} returned a {type(values).__name__}, not a list; it must "
                               f"return one number per completion ({len(completions)} here)") from None
        if len(values) != len(completions):
            raise LMForgeError(f"reward function {f.name!r} returned {len(values)} values for {len(completions)} "
                               "completions; it must return one number per completion, in order")
        out = []
        for i, value in enumerate(values):
            number = _number(value)
            if number is None:
                raise LMForgeError(f"reward function {f.name!r} returned {value!r} (a {type(value).__name__}) for "
                                   f"completion {i}; it must return numbers (int or float)")
            if not math.isfinite(number):
                raise LMForgeError(f"reward function {f.name!r} returned {number} for completion {i}; rewards must "
                                   "be finite numbers")
            out.append(number)
        return out

    def score(self, rows: list[dict[str, Any]], completions: list[str],
              gathered: Callable[..., Any] | None = None) -> np.ndarray:
        """``[N, F]`` raw (unweighted) rewards of ``completions`` (answering ``rows``), one column per function.
        ``gathered``: ``ModelHost.gathered`` of a sharded run; each reward model then scores inside its own
        gathering, one at a time, and every process must call this alike (even with no completions)."""
        columns = []
        for f in self.functions:
            model = f.fn.model if isinstance(f.fn, RewardModelScore) else None
            with gathered(model) if gathered is not None and model is not None else contextlib.nullcontext():
                columns.append(np.asarray(self._call(f, rows, completions), dtype=np.float64) if completions
                               else np.zeros(0))
        return np.stack(columns, axis=1)

    def total(self, scores: np.ndarray) -> np.ndarray:
        """The weighted sum of each row of ``score``'s result."""
        return scores @ self.weights

    def check(self, rows: list[dict[str, Any]]) -> None:
        """Call every function on the first rows with their reference replies (or empty replies) as the
        completions: one that raises, or returns anything but one number per completion, is refused now."""
        if not rows:
            return
        # Two rows where there are two: a function that returns a list of fixed length is caught too.
        picked = rows[:2]
        self.score(picked, [reference_answer(row) or "" for row in picked])


def load_rewards(specs: Sequence[Any], where: str = "recipe.rewards") -> Rewards:
    """``Rewards`` from config entries: ``NAME`` or ``{name: NAME, weight: W, label: L}``."""
    if isinstance(specs, (str, dict)) or not isinstance(specs, Sequence):
        raise LMForgeError(f"{where} must be a list of reward functions, e.g. [{{name: tool_call, weight: 1.0}}]")
    functions = []
    for i, spec in enumerate(specs):
        at = f"{where}[{i}]"
        if isinstance(spec, str):
            spec = {"name": spec}
        if not isinstance(spec, dict):
            raise LMForgeError(f"{at} must be a name or {{name: NAME, weight: W}}, got {short_repr(spec)}")
        unknown = set(spec) - {"name", "weight", "label"}
        if unknown:
            raise LMForgeError(f"{at} has unknown keys {sorted(unknown)}; a reward entry takes name, weight, label")
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise LMForgeError(f"{at} needs a 'name': a built-in ({_KNOWN}) or 'module:function'")
        weight = spec.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise LMForgeError(f"{at}.weight must be a number, got {short_repr(weight)}")
        label = spec.get("label") or _label(name)
        if not isinstance(label, str):
            raise LMForgeError(f"{at}.label must be a string, got {short_repr(label)}")
        functions.append(RewardFunction(name, label, resolve_reward(name), float(weight)))
    return Rewards(functions)


__all__ = ["BUILTIN_REWARDS", "RewardFunction", "RewardModelScore", "Rewards", "exact_match", "go_builds", "go_code",
           "go_parses", "go_vet", "load_rewards", "reference_answer", "resolve_reward", "tool_call", "tool_call_value"]
