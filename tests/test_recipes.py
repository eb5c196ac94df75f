"""Training kinds as plug-ins (lmforge.recipes): a new kind in one folder trains, evaluates and is
counted through its spec alone; the command line shows each kind's options where they apply; old
checkpoints and old spellings of moved settings still load; each kind counts what it processed."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from lmforge import recipes
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.errors import LMForgeError
from lmforge.models import load_model
from tests.train_helpers import PEAK_FLOPS, FakeClock

# A whole training kind, as a newcomer would write it in lmforge/recipes/toy/__init__.py: its own model
# family (a linear map that learns to add two numbers), data, loss, counts, metric for best/ and eval verb.
# Its family is not the guide's (toy_adder), so that the guide's kind, added to BUILTIN, breaks no test.
TOY_KIND = textwrap.dedent('''
    from dataclasses import dataclass

    import torch
    from torch import nn

    from lmforge.models.base import LMForgeModel
    from lmforge.recipes import CLIOptions, Counts, RecipeSpec, TrainData, register


    @dataclass
    class AdderConfig:
        width: int = 2


    class Adder(LMForgeModel):
        family = "toy_sum"
        config_class = AdderConfig

        def __init__(self, config):
            super().__init__(config)
            self.proj = nn.Linear(config.width, 1)

        def forward(self, batch):
            error = self.proj(batch["x"]).squeeze(-1) - batch["x"].sum(-1)
            return (error ** 2).mean(), {"abs_error": error.abs().mean().detach()}


    @dataclass
    class ToySettings:
        loss_scale: float = 1.0


    class Pairs:
        def __init__(self, seed, rows=4):
            self.gen, self.rows, self.drawn = torch.Generator().manual_seed(seed), rows, 0

        def next_batch(self):
            self.drawn += 1
            return {"x": torch.rand(self.rows, 2, generator=self.gen)}

        def iter_eval_batches(self, max_batches=None):
            gen = torch.Generator().manual_seed(99)
            for _ in range(max_batches or 2):
                yield {"x": torch.rand(8, 2, generator=gen)}

        def state_dict(self):
            return {"drawn": self.drawn}

        def load_state_dict(self, state):
            self.drawn = state["drawn"]


    SEEN_LOSS_SCALES = []


    def loss(module, batch):
        value, metrics = module(batch)
        return value * SEEN_LOSS_SCALES[-1], metrics


    def build_data(cfg, dist):
        SEEN_LOSS_SCALES.append(cfg.recipe.loss_scale)
        return TrainData(train=Pairs(cfg.seed), val=Pairs(0), description="random pairs",
                         derive_eval_metrics=lambda m: {**m, "score": 1.0 / (1.0 + m["abs_error"])})


    def run_eval(args):
        print(f"toy eval of {args.checkpoint} with --toy-answers {args.toy_answers}")
        return 0


    SPEC = register(RecipeSpec(
        name="toy", summary="adds two numbers", families=(Adder,), build_data=build_data,
        count=lambda model, batch: Counts(tokens=3 * batch["x"].shape[0], examples=batch["x"].shape[0], flops=1e3),
        settings=ToySettings, loss=loss, best_metric="eval/score", best_higher_is_better=True,
        eval=CLIOptions(run=run_eval, add=lambda g: g.add_argument("--toy-answers", type=int, default=1),
                        help="prints what it was asked"),
    ))
''')


@pytest.fixture
def toy_kind(tmp_path, monkeypatch):
    """The toy kind registered as a plug-in for one test (the registry is restored afterwards)."""
    return plugin(tmp_path, monkeypatch, "toy_recipe", TOY_KIND)


def plugin(tmp_path, monkeypatch, name: str, source: str | dict[str, str]):
    """Package ``name`` holding ``source`` (its ``__init__.py``, or file name -> text), imported as a plug-in
    for one test (the registry is restored afterwards)."""
    import importlib

    package = tmp_path / "plugins" / name
    package.mkdir(parents=True)
    for file, text in ({"__init__.py": source} if isinstance(source, str) else source).items():
        (package / file).write_text(text)
    recipes.kinds()  # the built-in kinds first, so the copies below hold them
    monkeypatch.setattr(recipes, "_KINDS", dict(recipes._KINDS))
    monkeypatch.setattr(recipes, "_FAMILIES", dict(recipes._FAMILIES))
    monkeypatch.syspath_prepend(str(tmp_path / "plugins"))
    for module in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:  # an earlier test's copy
        monkeypatch.delitem(sys.modules, module)
    return importlib.import_module(name)  # the one registry line of a built-in kind does this import


def toy_recipe_file(tmp_path, **training):
    recipe = {"name": "toy", "out_dir": str(tmp_path / "runs"), "kind": "toy", "model": {"family": "toy_sum"},
              "recipe": {"loss_scale": 2.0},
              "training": {"max_steps": 6, "lr": 0.05, "warmup_steps": 0, "eval_interval": 2, "save_interval": 3,
                           "log_interval": 2, "eval_batches": 2, "device": "cpu", "precision": "fp32",
                           "peak_flops": PEAK_FLOPS, **training},
              "logging": {"tensorboard": False, "progress_bar": False}}
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_a_new_kind_in_one_folder_trains_evaluates_and_counts_through_its_spec(toy_kind, tmp_path, monkeypatch, capsys):
    from lmforge.train import train
    from lmforge.train.loop import Trainer

    assert "toy" in [s.name for s in recipes.kinds()] and recipes.kind_of_family("toy_sum").name == "toy"
    cfg = load_config(str(toy_recipe_file(tmp_path)))
    assert cfg.kind == "toy" and cfg.recipe.loss_scale == 2.0 and cfg.to_dict()["recipe"] == {"loss_scale": 2.0}
    clock = FakeClock()
    clock.charge(monkeypatch, Trainer, "_train_step", 0.5)
    result = train(cfg, clock=clock)
    assert result.step == 6 and toy_kind.SEEN_LOSS_SCALES == [2.0]  # its settings reached its data and loss
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "train/tokens_per_s" in r]
    # The kind counts 3 tokens and 1 example per row, 4 rows a step: 12 tokens / 0.5 s, 4 examples / 0.5 s.
    assert [(r["train/tokens_per_s"], r["train/examples_per_s"], r["train/tokens"]) for r in logged] == \
        [(24.0, 8.0, 24), (24.0, 8.0, 48), (24.0, 8.0, 72)]
    assert all(r["train/mfu"] == pytest.approx(1e3 / 0.5 / PEAK_FLOPS) for r in logged)  # 1e3 FLOPs per 0.5 s step
    scores = {r["step"]: r["eval/score"] for r in rows if "eval/score" in r}
    best_step = max(scores, key=lambda s: (scores[s], s))
    state = json.loads((result.run_dir / "checkpoints" / "step-000006" / "trainer_state.json").read_text())
    assert state["best_metric"] == "eval/score" and state["best_score"] == pytest.approx(-scores[best_step])
    best = load_model(result.run_dir / "checkpoints" / "best")
    assert type(best).__name__ == "Adder"

    # its eval verb, with its own option, reached through the checkpoint's family
    assert main(["eval", str(result.run_dir), "--data", "unused", "--toy-answers", "3"]) == 0
    assert f"toy eval of {result.run_dir} with --toy-answers 3" in capsys.readouterr().out
    assert main(["eval", str(result.run_dir), "--data", "unused", "--max-iterations", "2"]) == 2
    assert "--max-iterations is for hrgc checkpoints" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    assert "kind toy: prints what it was asked" in capsys.readouterr().out


def test_kinds_of_installed_packages_load_through_entry_points(tmp_path, monkeypatch):
    """A kind in another package registers through the `lmforge.recipes` entry-point group; one that does not
    import is named in the error; a second class under a taken family name is refused."""
    import importlib.metadata

    package = tmp_path / "plugins" / "toy_recipe"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(TOY_KIND)
    monkeypatch.syspath_prepend(str(tmp_path / "plugins"))
    monkeypatch.delitem(sys.modules, "toy_recipe", raising=False)
    recipes.kinds()  # the built-in kinds first, so the copies below hold them
    monkeypatch.setattr(recipes, "_KINDS", dict(recipes._KINDS))
    monkeypatch.setattr(recipes, "_FAMILIES", dict(recipes._FAMILIES))
    monkeypatch.setattr(recipes, "_state", {"loaded": False, "loading": False})
    entry = importlib.metadata.EntryPoint(name="toy", value="toy_recipe", group=recipes.ENTRY_POINT_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None: [entry] if group == recipes.ENTRY_POINT_GROUP else [])
    names = [s.name for s in recipes.kinds()]  # a subset: a kind added to BUILTIN breaks nothing here
    assert {"dpo", "grpo", "hrgc", "lm", "ppo", "puzzles", "reward", "sft", "toy"} <= set(names)
    assert names == sorted(names) and names.count("toy") == 1
    assert recipes.model_class("toy_sum").__name__ == "Adder"

    import toy_recipe

    class Other(toy_recipe.Adder):
        pass
    with pytest.raises(LMForgeError, match="'toy_sum' that kind 'toy' already defines with another class"):
        recipes.register(recipes.RecipeSpec(name="toy2", summary="", families=(Other,), build_data=None, count=None))

    broken = importlib.metadata.EntryPoint(name="broken", value="no_such_module_here", group=recipes.ENTRY_POINT_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [broken])
    monkeypatch.setattr(recipes, "_state", {"loaded": False, "loading": False})
    with pytest.raises(LMForgeError, match="the training kind 'broken' of an installed package.*does not import"):
        recipes.kinds()


def test_every_reference_of_the_built_in_kinds_names_what_it_means():
    """A kind's spec names what imports torch by reference (imported on first use, so a typo would show only
    when that kind trains): each one imports, each family's class carries the family's name, and a function
    given by reference is called through."""
    specs = [s for s in recipes.kinds() if s.name in ("dpo", "grpo", "hrgc", "lm", "ppo", "puzzles", "reward", "sft")]
    assert len(specs) == 8
    lazy = []
    for spec in specs:
        for entry in spec.families:
            assert entry.load().family == entry.family, (spec.name, entry)
        options = [o for o in (spec.eval, spec.generate) if o is not None]
        lazy += [(spec.name, value) for holder in (spec, *options) for value in vars(holder).values()
                 if isinstance(value, recipes.Lazy)]
    assert len(lazy) >= 20
    for name, value in lazy:
        assert value.load() is not None, (name, value)
    assert recipes.get_kind("lm").family_names() == ("gpt",)
    assert dataclasses.is_dataclass(recipes.get_kind("sft").settings_class())


def test_a_family_given_by_reference_and_by_class_is_one_family(monkeypatch):
    """A kind of another package may give its model classes as they are (as before references): its gpt is
    the built-in kinds' gpt, named by reference, without a clash. A reference that names nothing, or a class
    of another family, is an error that names it."""
    from lmforge.models.gpt import GPT

    recipes.kinds()
    monkeypatch.setattr(recipes, "_KINDS", dict(recipes._KINDS))
    monkeypatch.setattr(recipes, "_FAMILIES", dict(recipes._FAMILIES))
    spec = recipes.register(recipes.RecipeSpec(name="plain_gpt", summary="", families=(GPT,), build_data=None,
                                               count=None))
    assert spec.families == (recipes.Family("gpt", GPT),) and spec.model_classes() == (GPT,)
    assert recipes.kind_of_family("gpt").name == "lm" and recipes.model_class("gpt") is GPT
    with pytest.raises(LMForgeError, match="'lmforge.models.gpt:GTP': lmforge.models.gpt has no 'GTP'"):
        recipes.Lazy("lmforge.models.gpt:GTP")()
    with pytest.raises(LMForgeError, match="'lmforge.modles.gpt:GPT' names a module that does not exist"):
        recipes.Family("gpt", "lmforge.modles.gpt:GPT").load()
    with pytest.raises(LMForgeError, match="'lmforge.models.gpt:GPT' is a class of the family 'gpt'"):
        recipes.Family("llama", "lmforge.models.gpt:GPT").load()
    with pytest.raises(LMForgeError, match="give a reference"):
        recipes.Lazy("lmforge.models.gpt.GPT")


def test_kind_options_are_refused_on_other_kinds_checkpoints(trained_run, capsys):
    run = trained_run.run_dir
    assert main(["generate", str(run), "--puzzle", "." * 81]) == 2
    err = capsys.readouterr().err
    assert "--puzzle is for puzzles checkpoints" in err and "'gpt' model (kind lm)" in err
    assert main(["eval", str(run), "--data", "x", "--no-compile"]) == 2
    assert "--no-compile is for hrgc checkpoints" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    for heading in ("sampling (kinds: hrgc, lm)", "kind lm: continue a prompt", "kind puzzles: solve one Sudoku",
                    "kind hrgc: write one function body"):
        assert heading in out


def test_old_spellings_and_old_checkpoints_of_moved_settings(tmp_path):
    # lmforge 0.1 wrote HRGC's and the puzzle models' training settings into the model's config.yaml
    from lmforge.recipes.hrgc.model import HRGC, HRGCConfig
    from lmforge.recipes.puzzles.trm import TRM, TRMConfig

    for model, extra in ((HRGC(HRGCConfig(vocab_size=64)), {"plan_loss_weight": 0.5, "validation_frequency": 7}),
                         (TRM(TRMConfig(seq_len=4, vocab_size=5, num_puzzle_identifiers=1, hidden_size=16,
                                        num_heads=2)), {"puzzle_emb_lr": 0.01, "puzzle_emb_weight_decay": 0.2})):
        directory = model.save_pretrained(tmp_path / model.family)
        config = yaml.safe_load((directory / "config.yaml").read_text())
        assert not set(extra) & set(config)  # no longer written
        (directory / "config.yaml").write_text(yaml.safe_dump({**config, **extra}))
        again = load_model(directory)
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    cfg = load_config("hrgc_go_tiny", ["model.plan_loss_weight=0.3", "model.validation_samples=2"])
    assert (cfg.recipe.plan_loss_weight, cfg.recipe.validation_samples) == (0.3, 2)
    with pytest.raises(LMForgeError, match="'model.plan_loss_weight' and 'recipe.plan_loss_weight' are both given"):
        load_config("hrgc_go_tiny", ["model.plan_loss_weight=0.3", "recipe.plan_loss_weight=0.2"])
    with pytest.raises(LMForgeError, match="unknown config key 'recipe.plan_loss_wieght'"):
        load_config("hrgc_go_tiny", ["recipe.plan_loss_wieght=0.3"])
    with pytest.raises(LMForgeError, match="kind 'lm' has no settings of its own"):
        load_config("go_coder_tiny", ["recipe.x=1"])
    for recipe in ("go_coder_tiny", "trm_sudoku_tiny"):
        with pytest.raises(LMForgeError, match="section 'recipe' must be a mapping"):
            load_config(recipe, ["recipe=5"])
    with pytest.raises(LMForgeError, match="kind 'puzzles' trains the model families hrm, trm, puzzle_transformer"):
        load_config("go_coder_tiny", ["kind=puzzles"])
    with pytest.raises(LMForgeError, match="unknown training kind 'lmm'.*Did you mean 'lm'"):
        load_config("go_coder_tiny", ["kind=lmm"])
    # a guide's name belongs to its kind: on another kind's run it is refused with the key it means
    with pytest.raises(LMForgeError, match="'lr': it is how the puzzles kind's guide spells training.lr; for this lm "
                                           "run write training.lr=0.001"):
        load_config("go_coder_tiny", ["lr=1e-3"])
    assert load_config("hrm_sudoku", ["lr=1e-3"]).training.lr == 1e-3
    with pytest.raises(LMForgeError, match="'training.optimizer.lr': it is how the lm kind's guide spells "
                                           "training.lr; for this hrgc run write training.lr=0.001"):
        load_config("hrgc_go_tiny", ["training.optimizer.lr=1e-3"])
    # the names seed 002 shares with Hugging Face's Trainer are every kind's (seed 000's hrgc guide writes them)
    assert load_config("hrgc_go_tiny", ["training.batch_size=4"]).training.micro_batch_size == 4


def test_hrgc_counts_the_tokens_it_read_not_the_padding():
    from lmforge.recipes.hrgc.model import HRGC, HRGCConfig, ModuleConfig
    from lmforge.recipes.hrgc.training import count

    model = HRGC(HRGCConfig(vocab_size=64, planner_config=ModuleConfig(n_positions=16, n_embd=16, n_layer=1, n_head=2),
                            generator_config=ModuleConfig(n_positions=32, n_embd=32, n_layer=2, n_head=2)))
    pad = model.config.pad_token_id
    plan = torch.tensor([[5, 6, 7, pad], [5, 6, pad, pad]])  # 5 real tokens of 8
    code = torch.tensor([[5, 6, 7, 8, 9, pad], [5, 6, 7, pad, pad, pad]])  # 8 of 12
    c = count(model, {"plan_ids": plan, "code_ids": code})
    assert (c.tokens, c.examples) == (13, 2)
    assert c.flops == 5 * model.planner.flops_per_token(4) + 8 * model.generator.flops_per_token(6)


def _one_small_model_per_family() -> list:
    from lmforge.models.gpt import GPT, GPTConfig
    from lmforge.models.reward import RewardModel, reward_config_from
    from lmforge.recipes.hrgc.model import HRGC, HRGCConfig, ModuleConfig
    from lmforge.recipes.puzzles.baseline import PuzzleTransformer, PuzzleTransformerConfig
    from lmforge.recipes.puzzles.hrm import HRM, HRMConfig
    from lmforge.recipes.puzzles.trm import TRM, TRMConfig

    gpt = GPTConfig(flavor="llama", vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    puzzle = dict(seq_len=9, vocab_size=11, num_puzzle_identifiers=2, hidden_size=16, num_heads=2)
    module = dict(n_positions=16, n_embd=16, n_layer=1, n_head=2)
    models = [GPT(gpt), GPT(GPTConfig(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                      tie_word_embeddings=False)),
              RewardModel(reward_config_from(gpt)),
              HRGC(HRGCConfig(vocab_size=64, planner_config=ModuleConfig(**module),
                              generator_config=ModuleConfig(**module))),
              TRM(TRMConfig(**puzzle, L_layers=1, H_cycles=1, L_cycles=1)),  # rotary tables: buffers not saved
              HRM(HRMConfig(**puzzle, H_layers=1, L_layers=1, pos_encodings="learned")),
              PuzzleTransformer(PuzzleTransformerConfig(**puzzle, halt_max_steps=1))]
    # Any other registered family (a kind added to BUILTIN, docs/adding-a-recipe.md): built with its
    # config's defaults; a family whose defaults build no model gets a small one in the list above.
    listed = {m.family for m in models} | {"actor_critic"}  # ppo's actor_critic saves a gpt + value/
    for family in sorted(set(recipes.families()) - listed):
        cls = recipes.model_class(family)
        try:
            models.append(cls(cls.config_class()))
        except Exception as e:  # noqa: BLE001 - told to the author of the family
            raise AssertionError(f"{cls.__name__}({cls.config_class.__name__}()) builds no model ({e}): add a small "
                                 f"{family!r} model to _one_small_model_per_family") from e
    return models


def test_every_family_loads_its_saved_tensors_without_a_random_initialisation(tmp_path):
    """``from_pretrained`` builds the model on the meta device and takes the file's tensors: it draws no random
    numbers (a 1.3B model spent ~30 s initialising weights it threw away, and a load moved a run's seed
    stream), leaves nothing on the meta device, and gives back every tensor, the unsaved ones (rotary tables)
    rebuilt. A bf16 file loads into the model's own fp32."""
    from lmforge.models.base import LMForgeModel

    models = _one_small_model_per_family()
    assert {m.family for m in models} == set(recipes.families()) - {"actor_critic"}  # ppo saves a gpt + value/
    for i, model in enumerate(models):
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
        directory = model.save_pretrained(tmp_path / str(i))
        state = torch.random.get_rng_state()
        loaded = LMForgeModel.from_pretrained(directory)
        assert torch.equal(torch.random.get_rng_state(), state), model.family
        mine, theirs = dict(model.named_buffers()), dict(loaded.named_buffers())
        mine.update(model.named_parameters()), theirs.update(loaded.named_parameters())
        assert mine.keys() == theirs.keys() and mine, model.family
        for name, tensor in theirs.items():
            assert tensor.device.type == "cpu" and torch.equal(tensor, mine[name]), (model.family, name)
    from safetensors.torch import load_file, save_file

    weights = tmp_path / "0" / "model.safetensors"
    save_file({k: v.bfloat16() for k, v in load_file(str(weights)).items()}, str(weights))
    loaded = LMForgeModel.from_pretrained(tmp_path / "0")
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    assert torch.equal(loaded.tok_embed.weight, models[0].tok_embed.weight.bfloat16().float())


def test_loading_any_family_does_not_import_the_compiler(tmp_path):
    """A verb that loads a model (generate, eval, serve, export) does not pay for torch._dynamo's import (~2 s of
    CPU): neither lmforge's modules nor building the model on the meta device import it. Counted in a fresh
    process: this one may have imported it already."""
    import subprocess

    dirs = [str(model.save_pretrained(tmp_path / str(i))) for i, model in enumerate(_one_small_model_per_family())]
    script = textwrap.dedent(f"""
        import sys
        import lmforge.cli
        from lmforge.models import count_parameters, load_model
        for directory in {dirs!r}:
            count_parameters(load_model(directory).config)
        print("torch._dynamo" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"], done.stdout


def test_the_triton_check_is_a_constant_to_the_compiler():
    """Traced inside a compiled forward, ``can_build_triton_kernels`` is one constant, not file-system lookups
    that break the graph (fullgraph=True refuses a break)."""
    from lmforge.models.triton_support import can_build_triton_kernels

    def forward(x):
        return x + 1 if can_build_triton_kernels() else x - 1

    compiled = torch.compile(forward, backend="eager", fullgraph=True)
    assert torch.equal(compiled(torch.zeros(2)), forward(torch.zeros(2)))


def test_an_empty_model_for_a_resume_has_every_tensor_and_tie_of_the_built_one():
    """``build_empty_model`` (what a resume builds: no values, the checkpoint gives them) allocates every parameter
    and buffer with the built model's shape, shares what the built model shares (a tied head: one optimizer
    entry, as in the checkpoint), and computes the tables a model does not save."""
    from lmforge.models import build_empty_model

    def ties(model):
        names: dict[int, list[str]] = {}
        for module_name, module in model.named_modules():
            for name, param in module._parameters.items():
                names.setdefault(id(param), []).append(f"{module_name}.{name}")
        return sorted(sorted(group) for group in names.values())

    for model in _one_small_model_per_family():
        empty = build_empty_model(model.config, "cpu")
        built = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        got = {**dict(empty.named_parameters()), **dict(empty.named_buffers())}
        assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in built.items()}, model.family
        assert not any(t.is_meta for t in got.values()), model.family
        assert ties(empty) == ties(model), model.family
        for name in (n for m_name, m in model.named_modules() for n in
                     (f"{m_name}.{b}".lstrip(".") for b in m._non_persistent_buffers_set)):
            assert torch.equal(got[name], built[name]), (model.family, name)


def test_a_module_with_unsaved_buffers_must_say_how_to_rebuild_them():
    from lmforge.models.base import rebuild_unsaved_buffers

    class Table(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.empty(3, device="meta"), persistent=False)
            self.register_buffer("kept", torch.ones(3))  # saved: loaded, not rebuilt

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Table())
    with pytest.raises(LMForgeError, match=r"its module Table \(1\) has buffers it does not save \(table; "
                                           r"persistent=False\).*Give Table a reset_buffers\(self, device\)"):
        rebuild_unsaved_buffers(model, "cpu")
    Table.reset_buffers = lambda self, device: setattr(self, "table", torch.arange(3.0, device=device))
    rebuild_unsaved_buffers(model, "cpu")
    assert torch.equal(model[1].table, torch.arange(3.0))


def test_a_loaded_model_keeps_its_weights_when_its_directory_is_saved_over(tmp_path, monkeypatch):
    """A loaded model's tensors are a memory map of its file: ``save_pretrained`` into that directory writes
    new files and renames them into place, so the loaded model does not change (safetensors before 0.5
    wrote in place; the stand-in below does the same)."""
    from safetensors.torch import save

    from lmforge.models import base
    from lmforge.models.gpt import GPT, GPTConfig

    def in_place(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(save(tensors, metadata=metadata))

    monkeypatch.setattr(base, "save_file", in_place)
    config = GPTConfig(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    first, second = GPT(config), GPT(config)
    first.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    second.save_pretrained(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), first.state_dict().values()))
    assert all(torch.equal(a, b) for a, b in zip(load_model(tmp_path).state_dict().values(),
                                                 second.state_dict().values()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "model.safetensors"]


GUIDE = Path(__file__).resolve().parent.parent / "docs" / "adding-a-recipe.md"


def guide_blocks(lang: str) -> list[str]:
    """The code blocks of docs/adding-a-recipe.md fenced as ```LANG, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", GUIDE.read_text(), re.S | re.M)


@pytest.fixture
def guide_kind(tmp_path, monkeypatch):
    """The guide's example kind (every ```python block of docs/adding-a-recipe.md, as written, as the file of
    lmforge/recipes/adder/ its first line names), registered as a plug-in for one test (the registry is
    restored afterwards). Its references to lmforge.recipes.adder name the plug-in's package."""
    files = {}
    for block in guide_blocks("python"):
        first = re.match(r"# lmforge/recipes/adder/(\w+\.py)\n", block)
        assert first, f"a python block of the guide that does not start with its file's path:\n{block}"
        files[first.group(1)] = block.replace("lmforge.recipes.adder", "guide_adder")
    assert "__init__.py" in files
    return plugin(tmp_path, monkeypatch, "guide_adder", files)


def test_the_guide_s_example_kind_trains_and_resumes_exactly(guide_kind, tmp_path, capsys):
    """The guide's kind and recipe, as written: it trains through the loop, its checkpoint resumes into the
    same losses and weights as the run that was not stopped (its loader's state is exact), and its eval verb
    runs for its checkpoints."""
    from safetensors.torch import load_file

    from lmforge.train import train

    (recipe_text,) = guide_blocks("yaml")
    recipe = tmp_path / "adder.yaml"
    recipe.write_text(recipe_text)
    spec = yaml.safe_load(recipe_text)
    assert recipes.get_kind(spec["kind"]) is guide_kind.SPEC
    quick = [f"out_dir={tmp_path / 'runs'}", "training.max_steps=6", "training.save_interval=3",
             "training.eval_interval=3", "training.log_interval=1", "training.warmup_steps=0", "training.device=cpu",
             "training.precision=fp32", f"training.peak_flops={PEAK_FLOPS}", "logging.tensorboard=false",
             "logging.progress_bar=false"]
    straight = train(load_config(str(recipe), [*quick, "name=straight"]))
    assert straight.step == 6
    resumed_dir = tmp_path / "runs" / "resumed" / "checkpoints"
    resumed_dir.mkdir(parents=True)
    shutil.copytree(straight.run_dir / "checkpoints" / "step-000003", resumed_dir / "step-000003")
    resumed = train(load_config(str(recipe), [*quick, "name=resumed"]), resume=True)
    assert resumed.step == 6

    def losses(run_dir):
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}

    a, b = losses(straight.run_dir), losses(resumed.run_dir)
    assert sorted(b) == [4, 5, 6] and [a[s] for s in (4, 5, 6)] == [b[s] for s in (4, 5, 6)]
    wa, wb = (load_file(str(r.run_dir / "checkpoints" / "step-000006" / "model.safetensors"))
              for r in (straight, resumed))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert main(["eval", str(straight.run_dir), "--data", "x"]) == 0
    assert "..." in capsys.readouterr().out


def test_the_guide_s_kind_added_beside_the_built_in_ones_breaks_no_test(guide_kind, toy_kind, tmp_path):
    """What the guide says to do (its kind in BUILTIN) keeps this file's tests passing: its family is not this
    file's toy kind's, and the test of every family's save and load covers it without a new line."""
    assert recipes.kind_of_family("toy_adder") is guide_kind.SPEC and recipes.kind_of_family("toy_sum").name == "toy"
    models = _one_small_model_per_family()
    assert {m.family for m in models} == set(recipes.families()) - {"actor_critic"}
    adder = next(m for m in models if m.family == "toy_adder")
    assert type(load_model(adder.save_pretrained(tmp_path / "adder"))) is type(adder)
