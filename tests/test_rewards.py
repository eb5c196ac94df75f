"""Reward functions (lmforge.posttrain.rewards): the built-ins score known good and bad completions
right, a trained reward model scores as it would alone, and a reward function that cannot be imported,
is not callable, raises, or returns anything but one number per completion is refused before compute."""

from __future__ import annotations

import contextlib
import json
import math

import numpy as np
import pytest
import torch

from lmforge.errors import LMForgeError
from lmforge.posttrain.rewards import (
    TOOL_CALL_MALFORMED,
    exact_match,
    go_builds,
    go_code,
    go_parses,
    go_vet,
    load_rewards,
    tool_call,
)
from lmforge.posttrain.toolcalls import call_message

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "lookup_stock", "parameters": {
        "type": "object", "properties": {"symbol": {"type": "string"}}, "required": ["symbol"]}}}]
CALL_ROW = {"messages": [{"role": "user", "content": "Weather in Oslo in celsius?"},
                         call_message("get_weather", {"city": "Oslo", "unit": "celsius"})], "tools": TOOLS}
CHAT_ROW = {"messages": [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello!"}],
            "tools": TOOLS}
ANSWER_ROW = {"messages": [{"role": "user", "content": "Price of AAPL?"}, call_message("lookup_stock", {"symbol": "AAPL"}),
                           {"role": "tool", "content": json.dumps({"symbol": "AAPL", "price": 187.5})},
                           {"role": "assistant", "content": "AAPL is at 187.5."}], "tools": TOOLS}


def call(name: str, args: dict) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {json.dumps(args)}}}</tool_call>'


def test_tool_call_reward_scores_calls_abstentions_and_answers():
    cases = [
        (CALL_ROW, call("get_weather", {"city": "Oslo", "unit": "celsius"}), 1.0),  # the exact call
        (CALL_ROW, call("get_weather", {"unit": "celsius", "city": "Oslo"}), 1.0),  # key order does not matter
        (CALL_ROW, call("get_weather", {"city": "Oslo"}), 0.5 + 0.5 * (2 / 3)),  # right tool, argument F1 2/3
        (CALL_ROW, call("get_weather", {"city": "Lima", "unit": "kelvin"}), 0.5),  # right tool, no argument right
        (CALL_ROW, call("lookup_stock", {"symbol": "Oslo"}), 0.2),  # a valid call of the wrong tool
        (CALL_ROW, "It is sunny in Oslo.", 0.0),  # no call where one was needed
        (CALL_ROW, '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', TOOL_CALL_MALFORMED),
        # the right call, then a broken one: malformed, whatever came before it
        (CALL_ROW, call("get_weather", {"city": "Oslo", "unit": "celsius"}) + '<tool_call>{"name"', TOOL_CALL_MALFORMED),
        (CHAT_ROW, "Hello there!", 1.0),  # the right abstention
        (CHAT_ROW, call("get_weather", {"city": "Oslo"}), 0.0),  # a call where none was wanted
        (CHAT_ROW, "", 0.0),  # an empty reply is no answer
        (ANSWER_ROW, "AAPL trades at 187.5 right now.", 1.0),  # carries the tool's result
        (ANSWER_ROW, "It trades high.", 0.5),  # plain, but without the result
        (ANSWER_ROW, call("lookup_stock", {"symbol": "AAPL"}), 0.0),  # calls again instead of answering
    ]
    got = tool_call([row for row, _, _ in cases], [text for _, text, _ in cases])
    assert got == pytest.approx([want for _, _, want in cases])
    with pytest.raises(LMForgeError, match="reference assistant turn"):
        tool_call([{"messages": [{"role": "user", "content": "hi"}]}], ["hello"])


def test_exact_match_normalises_whitespace():
    rows = [{"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"},
            {"messages": [{"role": "user", "content": "Say hi"}], "answer": "hello  world"}, CHAT_ROW]
    assert exact_match(rows, [" 4\n", "hello world", "Hello!"]) == [1.0, 1.0, 1.0]
    assert exact_match(rows, ["5", "hello, world", "Hello"]) == [0.0, 0.0, 0.0]
    with pytest.raises(LMForgeError, match="'answer' field"):
        exact_match([{"messages": [{"role": "user", "content": "?"}]}], ["x"])


GOOD_GO = "func Add(a, b int) int {\n\treturn a + b\n}\n"
TYPE_ERROR_GO = "func Add(a, b int) int {\n\treturn a + c\n}\n"  # parses; does not compile
VET_ERROR_GO = 'import "fmt"\n\nfunc Show() {\n\tfmt.Printf("%d\\n", "text")\n}\n'  # compiles; vet objects
BROKEN_GO = "func Add(a, b int) int {\n\treturn a +\n"
MAIN_GO = 'package main\n\nimport "fmt"\n\nfunc main() {\n\tfmt.Println("hi")\n}\n'


def test_go_parses_reads_the_code_blocks():
    fenced = f"Here you go:\n```go\n{GOOD_GO}```\nIt adds."
    assert go_code(fenced) == GOOD_GO
    completions = [GOOD_GO, fenced, MAIN_GO, TYPE_ERROR_GO, BROKEN_GO, "add the two numbers", "", "```go\nfunc (\n```"]
    assert go_parses([{}] * len(completions), completions) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_go_builds_and_vet_run_the_go_tool(monkeypatch):
    completions = [GOOD_GO, MAIN_GO, f"```go\n{GOOD_GO}```", TYPE_ERROR_GO, VET_ERROR_GO, BROKEN_GO,
                   "package main\n\nfunc helper() {}\n", ""]
    rows = [{}] * len(completions)
    assert go_builds(rows, completions) == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert go_vet(rows, completions) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    monkeypatch.setenv("PATH", "")
    with pytest.raises(LMForgeError, match="`go` tool, which is not on PATH"):
        go_builds([{}], [GOOD_GO])


USER_REWARDS = '''
import math

def brevity(prompts, completions):
    return [-len(c) / 100 for c in completions]

def as_text(prompts, completions):
    return ["good" for c in completions]

def short(prompts, completions):
    return [1.0]

def boom(prompts, completions):
    raise KeyError("answer")

def not_finite(prompts, completions):
    return [math.nan for c in completions]

def scalar(prompts, completions):
    return 1.0

WEIGHT = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "grpo_user_rewards.py").write_text(USER_REWARDS)
    (tmp_path / "grpo_broken_rewards.py").write_text("import no_such_package_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "grpo_user_rewards"


def test_user_reward_functions_and_weights(user_module):
    rewards = load_rewards([{"name": "tool_call", "weight": 2.0}, f"{user_module}:brevity"])
    assert rewards.labels == ["tool_call", "grpo_user_rewards_brevity"]
    reply = call("get_weather", {"city": "Oslo", "unit": "celsius"})
    scores = rewards.score([CALL_ROW, CHAT_ROW], [reply, "Hello!"])
    assert scores.reshape(-1).tolist() == pytest.approx([1.0, -len(reply) / 100, 1.0, -0.06])
    assert rewards.total(scores).tolist() == pytest.approx([2.0 - len(reply) / 100, 2.0 - 0.06])
    rewards.check([CALL_ROW])


@pytest.mark.parametrize("spec, message", [
    ("grpo_broken_rewards:score", "'grpo_broken_rewards:score': module 'grpo_broken_rewards' cannot be imported "
                                  r"\(ModuleNotFoundError"),
    ("grpo_no_such_module:score", "module 'grpo_no_such_module' cannot be imported"),
    ("grpo_user_rewards:missing", "has no attribute 'missing'"),
    ("grpo_user_rewards:WEIGHT", "'grpo_user_rewards:WEIGHT' is a int, not callable"),
    ("tool_cal", "unknown reward function 'tool_cal'. Did you mean 'tool_call'"),
    ({"name": "tool_call", "weight": "high"}, r"recipe.rewards\[0\].weight must be a number"),
    ({"name": "tool_call", "scale": 2}, "unknown keys"),
])
def test_reward_names_that_cannot_be_used_are_refused(user_module, spec, message):
    with pytest.raises(LMForgeError, match=message):
        load_rewards([spec])


@pytest.mark.parametrize("name, message", [
    ("as_text", r"returned 'good' \(a str\) for completion 0; it must return numbers"),
    ("short", "returned 1 values for 2 completions"),
    ("boom", "raised KeyError: 'answer'"),
    ("not_finite", "returned nan for completion 0; rewards must be finite"),
    ("scalar", "returned a float, not a list"),
])
def test_reward_functions_that_return_the_wrong_thing_are_refused(user_module, name, message):
    rewards = load_rewards([f"{user_module}:{name}"])
    with pytest.raises(LMForgeError, match=f"reward function '{user_module}:{name}' {message}"):
        rewards.score([CALL_ROW, CHAT_ROW], ["a", "b"])
    with pytest.raises(LMForgeError, match=f"'{user_module}:{name}'"):
        rewards.check([CALL_ROW, CHAT_ROW])  # what training calls before it builds anything


def test_a_bad_reward_stops_training_before_any_compute(tool_sft, user_module, tmp_path):
    from lmforge.config import load_config
    from lmforge.train import train

    for name in ("grpo_user_rewards:short", "grpo_broken_rewards:score"):
        cfg = load_config(values={
            "kind": "grpo", "name": "bad", "out_dir": str(tmp_path / "runs"),
            "data": {"train_path": str(tool_sft.data), "seq_len": 512},
            "recipe": {"rewards": [{"name": "tool_call"}, {"name": name, "weight": 0.5}]},
            "training": {"init_from": str(tool_sft.checkpoint), "device": "cpu", "max_steps": 2,
                         "micro_batch_size": 8},
            "logging": {"tensorboard": False, "progress_bar": False}})
        with pytest.raises(LMForgeError, match=name):
            train(cfg)
    assert not (tmp_path / "runs").exists()  # no run directory, no model built


def test_a_trained_reward_model_is_a_reward_function(tool_sft, tmp_path):
    from lmforge.models import load_model
    from lmforge.models.reward import RewardModel, reward_config_from
    from lmforge.posttrain.rollout import encode_prompt

    chat = load_model(tool_sft.checkpoint)
    torch.manual_seed(0)
    model = RewardModel(reward_config_from(chat.config))
    model.load_initial_weights(chat, str(tool_sft.checkpoint))
    model.save_pretrained(tmp_path / "rm")
    tool_sft.tokenizer.save(tmp_path / "rm")
    rewards = load_rewards([f"reward_model:{tmp_path / 'rm'}"])
    assert rewards.labels == ["reward_model"]
    replies = [call("get_weather", {"city": "Oslo", "unit": "celsius"}), "Hello!", "It is at 187.5."]
    rows = [CALL_ROW, CHAT_ROW, ANSWER_ROW]
    got = rewards.score(rows, replies)[:, 0]
    tok = tool_sft.tokenizer
    model.eval()
    for row, reply, score in zip(rows, replies, got):
        ids = torch.tensor([[*encode_prompt(tok, row), *tok.encode(reply), tok.eos_id]])
        with torch.no_grad():
            want = float(model.scores(ids)[0, -1])  # the score at the reply's closing eos, scored alone
        assert math.isclose(score, want, rel_tol=1e-4, abs_tol=1e-5)
    assert len(set(got.round(6).tolist())) == 3
    # Under FSDP each reward model scores inside its own gathering (ModelHost.gathered), never two at once
    two = load_rewards([{"name": f"reward_model:{tmp_path / 'rm'}", "label": "a"}, "tool_call",
                        {"name": f"reward_model:{tmp_path / 'rm'}", "label": "b"}])
    models = [f.fn.model for f in two.functions if hasattr(f.fn, "model")]
    held, entered, seen = [], [], []

    @contextlib.contextmanager
    def gathered(*modules):
        entered.append(modules)
        held.extend(modules)
        try:
            yield
        finally:
            del held[-len(modules):]

    for m in models:
        m.rewards = (lambda batch, m=m, score=m.rewards: (seen.append((m, list(held))), score(batch))[1])
    scored = two.score(rows, replies, gathered)
    assert entered == [(models[0],), (models[1],)] and seen == [(m, [m]) for m in models]
    np.testing.assert_allclose(scored[:, [0, 2]], np.stack([got, got], axis=1), rtol=1e-5, atol=1e-6)
    assert two.score([], [], gathered).shape == (0, 3) and len(entered) == 4  # entered alike with nothing to do
    with pytest.raises(LMForgeError, match="not a reward model"):
        load_rewards([f"reward_model:{tool_sft.checkpoint}"])
    with pytest.raises(LMForgeError, match="no such checkpoint"):
        load_rewards([f"reward_model:{tmp_path / 'missing'}"])
