"""The traps a newcomer writing a training kind (docs/adding-a-recipe.md) fell into, each now an error that
names the kind, the problem and the fix: options two kinds declare, a loader state JSON cannot hold, a bug
in a kind's resume code, unsaved buffers without ``reset_buffers``, unknown ``uses`` names, reserved kind
names, a kind on PYTHONPATH but not installed; and the guide and docstrings kept in step with the code."""

from __future__ import annotations

import re
import typing
from dataclasses import dataclass, fields
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from lmforge import recipes
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.errors import LMForgeError
from lmforge.models.base import LMForgeModel
from lmforge.recipes import CLIOptions, Counts, RecipeSpec, TrainData
from tests.train_helpers import PEAK_FLOPS

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "adding-a-recipe.md"


@pytest.fixture
def registry(monkeypatch):
    """The registry with the built-in kinds, restored after the test."""
    recipes.kinds()
    monkeypatch.setattr(recipes, "_KINDS", dict(recipes._KINDS))
    monkeypatch.setattr(recipes, "_FAMILIES", dict(recipes._FAMILIES))
    return recipes


@dataclass
class SumConfig:
    width: int = 2


class Summer(LMForgeModel):
    family = "trap_sum"
    config_class = SumConfig

    def __init__(self, config):
        super().__init__(config)
        self.proj = nn.Linear(config.width, 1)

    def forward(self, batch):
        error = self.proj(batch["x"]).squeeze(-1) - batch["x"].sum(-1)
        return (error ** 2).mean(), {}


class Rows:
    """A loader; subclasses below make the newcomer's mistakes."""

    drawn_total = 0

    def __init__(self, seed):
        self.seed, self.drawn = seed, 0

    def next_batch(self):
        Rows.drawn_total += 1
        gen = torch.Generator().manual_seed(self.seed * 1000 + self.drawn)
        self.drawn += 1
        return {"x": torch.rand(4, 2, generator=gen)}

    def state_dict(self):
        return {"seed": self.seed, "drawn": self.drawn}

    def load_state_dict(self, state):
        self.drawn = state["drawn"]


class GeneratorState(Rows):
    def state_dict(self):  # a torch.Generator's state: a tensor, which JSON cannot hold
        return {"drawn": self.drawn, "gen": torch.Generator().manual_seed(self.seed).get_state()}


class BuggyResume(Rows):
    def load_state_dict(self, state):
        self.drawn = state["position"]  # not what state_dict wrote: a KeyError on every resume


def trap_kind(name="trap", loader=Rows, **spec):
    return RecipeSpec(name=name, summary="adds two numbers", families=(Summer,),
                      build_data=lambda cfg, dist: TrainData(train=loader(cfg.seed), val=None),
                      count=lambda model, batch: Counts(tokens=4, examples=4, flops=1e3), **spec)


def trap_config(tmp_path, name="trap", **training):
    recipe = {"name": name, "out_dir": str(tmp_path / "runs"), "kind": "trap", "model": {"family": "trap_sum"},
              "training": {"max_steps": 4, "lr": 0.05, "warmup_steps": 0, "save_interval": 2, "log_interval": 2,
                           "device": "cpu", "precision": "fp32", "peak_flops": PEAK_FLOPS, **training},
              "logging": {"tensorboard": False, "progress_bar": False}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return load_config(str(path))


# ---- 1: two kinds adding one option string --------------------------------------------------------------
def _prompt(default):
    return lambda group: group.add_argument("--prompt", default=default, help="the trap kind's prompt")


def test_two_kinds_declaring_one_option_differently_is_an_error_naming_both(registry, capsys):
    registry.register(trap_kind(generate=CLIOptions(run=lambda args: 0, add=_prompt(None), help="t")))
    assert main(["--help"]) == 2  # every command stopped here with argparse's bare ArgumentError
    err = capsys.readouterr().err
    assert err.startswith("lmforge: error: kind 'trap' adds --prompt to `lmforge generate`, which kind 'lm' adds "
                          "differently (default)"), err
    assert "Rename the kind's option (e.g. --trap-prompt), or declare it exactly as kind 'lm' does" in err


def test_an_option_of_the_verb_itself_is_refused_for_a_kind(registry, capsys):
    device = lambda group: group.add_argument("--device", default="auto")  # noqa: E731
    registry.register(trap_kind(generate=CLIOptions(run=lambda args: 0, add=device, help="t")))
    assert main(["generate", "--help"]) == 2
    assert "kind 'trap' adds --device to `lmforge generate`, which `lmforge generate` itself (for every kind) " \
           "adds again" in capsys.readouterr().err


def test_two_kinds_may_share_an_option_declared_alike(registry, tmp_path, capsys):
    from lmforge.cli import build_parser
    from lmforge.recipes.lm.cli import add_generate_args

    seen = []

    def run(args):
        seen.append((args.prompt, args.temperature))
        return 0

    registry.register(trap_kind(generate=CLIOptions(run=run, add=add_generate_args, uses=("sampling",), help="t")))
    parser = build_parser()
    generate = parser._subparsers._group_actions[0].choices["generate"]
    assert generate.get_default("kind_options")["--prompt"] == {"lm", "trap"}
    model_dir = Summer(SumConfig()).save_pretrained(tmp_path / "m")
    assert main(["generate", str(model_dir), "--prompt", "1+2", "--temperature", "0"]) == 0
    assert seen == [("1+2", 0.0)]


# ---- 2: the loader's state must be JSON ------------------------------------------------------------------
def test_a_loader_state_json_cannot_hold_is_refused_before_step_one(registry, tmp_path):
    from lmforge.train import train

    registry.register(trap_kind(loader=GeneratorState))
    Rows.drawn_total = 0
    with pytest.raises(LMForgeError, match=r"kind 'trap': its train loader's state \(GeneratorState\.state_dict\(\)"
                                           r"\['gen'\] \(a Tensor\)\) cannot be written.*JSON values only"):
        train(trap_config(tmp_path))
    assert Rows.drawn_total == 0  # before any step (it failed at the first checkpoint, after the steps before)


# ---- 4: a bug in the kind's resume code is the kind's --------------------------------------------------
def test_a_bug_in_the_kind_s_resume_code_is_reported_as_the_kind_s(registry, tmp_path):
    from lmforge.train import train

    registry.register(trap_kind(loader=BuggyResume))
    train(trap_config(tmp_path, "trap", max_steps=2))
    with pytest.raises(LMForgeError) as caught:
        train(trap_config(tmp_path, "trap", max_steps=4), resume=True)
    message = str(caught.value)
    assert "kind 'trap''s BuggyResume.load_state_dict raised KeyError: 'position'" in message, message
    assert "(keys seed, drawn)" in message and "does not fit this run" not in message
    assert isinstance(caught.value.__cause__, KeyError)


# ---- 5: unsaved buffers need reset_buffers --------------------------------------------------------------
@dataclass
class TabledConfig(SumConfig):
    pass


class Tabled(Summer):
    family = "trap_tabled"
    config_class = TabledConfig

    def __init__(self, config):
        super().__init__(config)
        self.register_buffer("table", torch.arange(3.0), persistent=False)


def test_a_family_with_unsaved_buffers_and_no_reset_buffers_is_named_on_loading(registry, tmp_path):
    from lmforge.models import build_empty_model, load_model

    registry.register(RecipeSpec(name="tabled", summary="", families=(Tabled,), build_data=None, count=None))
    directory = Tabled(TabledConfig()).save_pretrained(tmp_path / "m")  # trains and saves: nothing is wrong yet
    want = (r"model family 'trap_tabled' \(Tabled\) cannot be loaded: its module Tabled \(the model itself\) has "
            r"buffers it does not save \(table; persistent=False\).*meta device.*Give Tabled a "
            r"reset_buffers\(self, device\)")
    with pytest.raises(LMForgeError, match=want):  # eval, generate
        load_model(directory)
    with pytest.raises(LMForgeError, match=want):  # --resume
        build_empty_model(TabledConfig(), "cpu")


# ---- 10, 14, 12: what register and get_kind say ---------------------------------------------------------
def test_register_refuses_unknown_shared_option_sets(registry):
    from lmforge.cli_common import SHARED_OPTIONS

    with pytest.raises(LMForgeError, match=r"kind 'trap': generate=CLIOptions\(uses=...\) names unknown shared "
                                           r"option sets 'sampler'; the sets are 'sampling', 'precision', "
                                           r"'baseline', 'batch-size'"):
        registry.register(trap_kind(generate=CLIOptions(run=print, uses=("sampler",))))
    with pytest.raises(LMForgeError, match=r"a tuple of one name needs a comma"):
        registry.register(trap_kind(eval=CLIOptions(run=print, uses=("sampling"))))
    assert list(SHARED_OPTIONS) == ["sampling", "precision", "baseline", "batch-size"]
    registry.register(trap_kind(eval=CLIOptions(run=print, uses=tuple(SHARED_OPTIONS)[2:])))


@pytest.mark.parametrize("name", ["tokenizer", "data", "eval", "export", "serve"])
def test_pipeline_stage_names_cannot_be_training_kinds(registry, name):
    with pytest.raises(LMForgeError, match=f"a training kind cannot be named '{name}': pipelines run stages"):
        registry.register(trap_kind(name=name))


def test_the_reserved_kind_names_are_the_pipeline_s_stages():
    from lmforge.pipeline.spec import STAGE_KEYS

    assert set(recipes.RESERVED_KIND_NAMES) == set(STAGE_KEYS)


def test_an_unknown_kind_says_how_kinds_of_other_packages_are_found():
    with pytest.raises(LMForgeError, match=r"unknown training kind 'bigram'.*'lmforge.recipes' entry point of an "
                                           r"installed package.*pip install -e PATH.*docs/adding-a-recipe.md"):
        recipes.get_kind("bigram")


# ---- 8, 9, 10, 11, 13: the guide and the docstrings say what the code does -------------------------------
def test_make_optimizer_is_annotated_as_the_loop_calls_it(registry, tmp_path):
    from lmforge.train import train

    hint = typing.get_type_hints(RecipeSpec)["make_optimizer"]
    (callable_type,) = [a for a in typing.get_args(hint) if a is not type(None)]
    assert len(typing.get_args(callable_type)[0]) == 3  # (model, RunConfig, device)
    calls = []

    def make_optimizer(*args):
        calls.append(args)
        return torch.optim.SGD(args[0].parameters(), lr=0.01)

    registry.register(trap_kind(make_optimizer=make_optimizer))
    train(trap_config(tmp_path, max_steps=1))
    assert len(calls) == 1 and len(calls[0]) == 3


def test_8bit_moments_with_a_kinds_own_optimizer_are_refused_when_declared_at_config_else_at_the_trainer(
        registry, tmp_path):
    """A kind naming its own optimizer (RecipeSpec.own_optimizer) has training.optimizer_states=8bit refused by
    load_config; one that does not is still refused, when the trainer builds its optimizer."""
    from lmforge.train import train

    sgd = dict(make_optimizer=lambda model, cfg, device: torch.optim.SGD(model.parameters(), lr=0.01))
    registry.register(trap_kind(own_optimizer="SGD", **sgd))
    with pytest.raises(LMForgeError, match=r"optimizer_states=8bit is AdamW's, and the trap kind trains with its own "
                                           r"optimizer \(SGD\).*drop training.optimizer_states"):
        trap_config(tmp_path, optimizer_states="8bit")
    registry.register(trap_kind(name="trap2", **sgd))
    cfg = load_config(str(tmp_path / "trap.yaml"), ["kind=trap2"])  # the recipe trap_config wrote, of the other kind
    assert cfg.training.optimizer_states == "8bit"
    with pytest.raises(LMForgeError, match=r"optimizer_states=8bit is AdamW's.*own optimizer \(SGD\)"):
        train(cfg)


def test_the_loss_is_handed_the_model_itself_not_a_wrapper(registry, tmp_path):
    """What the guide says of `loss`: without compile, `module` is the model (the loop's wrapper, which DDP
    wraps, is around the loss, not handed to it)."""
    from lmforge.train import train

    handed = []

    def loss(module, batch):
        handed.append(type(module))
        return module(batch)

    registry.register(trap_kind(loss=loss))
    train(trap_config(tmp_path, max_steps=1, compile=False))
    assert handed == [Summer]
    assert "DDP-wrapped model" not in GUIDE.read_text()


def test_the_guide_and_the_docstrings_name_every_field_kind_and_option_set():
    from lmforge.cli_common import SHARED_OPTIONS

    guide = GUIDE.read_text()
    table = guide.split("## What the spec can say", 1)[1].split("\n## ", 1)[0]
    rows = {name for line in table.splitlines() if line.startswith("| `")
            for name in re.findall(r"`(\w+)", line.split("|")[1])}
    assert {f.name for f in fields(RecipeSpec)} <= rows
    builtin = {module.rsplit(".", 1)[1] for module in recipes.BUILTIN}
    intro = guide.split("\n## ", 1)[0]
    registry_doc = recipes.__doc__.split("Adding a kind", 1)[0]
    for kind in builtin:
        assert f"`{kind}`" in intro and f"``{kind}``" in registry_doc, kind
    for name in SHARED_OPTIONS:
        assert f'`"{name}"`' in table and f"``{name}``" in CLIOptions.__doc__, name
    assert "`--seed` defaults to None" in table
    # an out-of-tree kind changes nothing in lmforge's CLI: two kinds share an option by declaring it alike
    assert "An option that two kinds need belongs in a shared set" not in guide
