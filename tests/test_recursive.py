"""HRM, TRM and the baseline: layers, losses, optimizers, ACT, EMA, training, resume, solve and eval."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.cli import main
from lmforge.config import load_config
from lmforge.recipes.puzzles.sudoku import build_sudoku_dataset, format_grid, generate_puzzles
from lmforge.errors import LMForgeError
from lmforge.models import build_model
from lmforge.recipes.puzzles.hrm import HRMConfig
from lmforge.recipes.puzzles.model import exploration_min_steps, halt_decision
from lmforge.recipes.puzzles.layers import stablemax_cross_entropy
from lmforge.recipes.puzzles.trm import TRMConfig
from lmforge.recipes.puzzles.optimizers import AdamATan2SignSGD
from lmforge.safe_state import load_state
from tests.train_helpers import PEAK_FLOPS

SMALL = {"seq_len": 81, "vocab_size": 11, "num_puzzle_identifiers": 4, "hidden_size": 32, "num_heads": 2,
         "expansion": 2, "halt_max_steps": 4}


def hrm(**kw):
    return build_model(HRMConfig(**{**SMALL, "H_layers": 1, "L_layers": 1, **kw}))


def trm(**kw):
    return build_model(TRMConfig(**{**SMALL, "L_layers": 1, "H_cycles": 2, "L_cycles": 2, "puzzle_emb_len": 2,
                                    **kw}))


def random_batch(n=3, ids=(0, 1, 2), seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"inputs": torch.randint(1, 11, (n, 81), generator=g),
            "labels": torch.randint(2, 11, (n, 81), generator=g),
            "puzzle_identifiers": torch.tensor(ids[:n])}


@pytest.fixture(scope="module")
def sudoku_dir(tmp_path_factory) -> Path:
    puzzles = generate_puzzles(4, 30, 36, seed=3, show_progress=False, workers=1)
    out = tmp_path_factory.mktemp("sudoku") / "four"
    build_sudoku_dataset(out, puzzles, puzzles, num_aug=0, seed=0, show_progress=False)
    return out


# ---- loss and optimizers against their definitions ----------------------------------------------
def test_stablemax_cross_entropy_matches_definition():
    logits = torch.tensor([[[2.0, -1.0, 0.0, -3.5]], [[-0.25, 4.0, 1.5, 0.0]]])
    labels = torch.tensor([[1], [-100]])
    got = stablemax_cross_entropy(logits, labels)
    s = [x + 1 if x >= 0 else 1 / (1 - x) for x in [2.0, -1.0, 0.0, -3.5]]
    assert got[0, 0].item() == pytest.approx(-math.log(s[1] / sum(s)), rel=1e-12)
    assert got[1, 0].item() == 0.0  # ignored position
    assert got.dtype == torch.float64


def test_adam_atan2_update_matches_formula():
    p = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))
    opt = AdamATan2SignSGD([{"params": [p], "weight_decay": 0.1}], lr=0.01, betas=(0.9, 0.95))
    w, m, v = p.detach().clone(), torch.zeros(3), torch.zeros(3)
    for t, g in enumerate([torch.tensor([0.3, -0.2, 0.0]), torch.tensor([-1.0, 0.5, 2.0])], start=1):
        p.grad = g.clone()
        opt.step()
        m = 0.9 * m + 0.1 * g
        v = 0.95 * v + 0.05 * g * g
        w = w * (1 - 0.01 * 0.1) - 0.01 * torch.atan2(m / (1 - 0.9 ** t), (v / (1 - 0.95 ** t)).sqrt())
        assert torch.allclose(p.detach(), w, atol=1e-7)


def test_sign_sgd_touches_only_rows_in_the_batch():
    model = hrm()
    with torch.no_grad():
        model.puzzle_emb.weight.normal_()
    before = model.puzzle_emb.weight.detach().clone()
    from lmforge.recipes.puzzles.training import make_optimizer

    cfg = load_config("hrm_sudoku", ["recipe.puzzle_emb_lr=0.01", "recipe.puzzle_emb_weight_decay=0.5"])
    opt = make_optimizer(model, cfg, torch.device("cpu"))  # the puzzle kind's optimizer (its RecipeSpec's)
    emb_group = next(g for g in opt.param_groups if g["name"] == "puzzle_emb")
    assert emb_group["algorithm"] == "sign_sgd" and emb_group["lr"] == 0.01 and emb_group["weight_decay"] == 0.5
    model.train()
    loss, _ = model(random_batch(2, ids=(1, 3)))
    loss.backward()
    grad = model.puzzle_emb.weight.grad.clone()
    opt.step()
    after = model.puzzle_emb.weight.detach()
    assert torch.equal(after[[0, 2]], before[[0, 2]])  # outside the batch: not moved, not decayed
    lr, wd = 0.01, 0.5
    expect = before[[1, 3]] * (1 - lr * wd) - lr * torch.sign(grad[[1, 3]])
    assert torch.allclose(after[[1, 3]], expect)


# ---- the recursion's gradient paths -------------------------------------------------------------
def _record_grad_calls(module: torch.nn.Module, log: list, name: str):
    module.register_forward_hook(lambda m, i, o: log.append((name, o.requires_grad)))


def test_hrm_one_step_gradient():
    model = hrm(H_cycles=3, L_cycles=2, halt_max_steps=1)  # no Q target segment
    calls = []
    _record_grad_calls(model.L_level, calls, "L")
    _record_grad_calls(model.H_level, calls, "H")
    model.train()
    model(random_batch())
    # 3 x 2 L updates and 3 H updates; only the very last L and the last H carry gradient
    assert [n for n, _ in calls] == ["L", "L", "H"] * 3
    assert [g for _, g in calls] == [False] * 7 + [True, True]
    assert not model._carry.z_h.requires_grad and not model._carry.z_l.requires_grad


def test_hrm_mlp_t_mixes_tokens_with_an_mlp_in_both_modules():
    """HRM's mlp_t (TRM's token-mixing variant, what its CPU recipe uses): no attention anywhere, and
    the one-step gradient still reaches both modules' token mixers."""
    from lmforge.recipes.puzzles.layers import Attention, TokenMixer

    model = hrm(mlp_t=True, pos_encodings="none", halt_max_steps=1)
    for level in (model.H_level, model.L_level):
        assert all(isinstance(b.mixer, TokenMixer) for b in level.blocks)
    assert not any(isinstance(m, Attention) for m in model.modules())
    model.train()
    loss, _ = model(random_batch())
    loss.backward()
    for level in (model.H_level, model.L_level):
        grads = [p.grad for b in level.blocks for p in b.mixer.parameters()]
        assert all(g is not None and g.abs().sum() > 0 for g in grads)


def test_trm_full_backprop_through_last_cycle_only():
    model = trm(H_cycles=3, L_cycles=2)
    calls = []
    _record_grad_calls(model.net, calls, "net")
    model.train()
    loss, _ = model(random_batch())
    assert [g for _, g in calls] == [False] * 6 + [True] * 3  # (T-1)(n+1) without, n+1 with gradient
    loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if n.startswith("net."))


# ---- ACT ---------------------------------------------------------------------------------------
def test_halt_decision_with_fixed_q_values():
    steps = torch.tensor([1, 1, 2, 4, 3])
    q_halt = torch.tensor([1.0, -1.0, 0.5, -5.0, 2.0])
    q_cont = torch.tensor([0.0, 0.0, 1.0, 5.0, 0.0])
    assert halt_decision(steps, q_halt, q_cont, 4).tolist() == [True, False, False, True, True]
    # exploration: a drawn minimum holds a row that wants to halt, never one at the limit
    min_steps = torch.tensor([3, 0, 0, 4, 3])
    assert halt_decision(steps, q_halt, q_cont, 4, min_steps).tolist() == [False, False, False, True, True]
    # TRM: one logit, halt when > 0
    assert halt_decision(steps, q_halt, None, 4).tolist() == [True, False, True, True, True]
    # halt_max_steps=1: every row halts after one segment
    assert halt_decision(steps, q_halt, q_cont, 1).all()


def test_exploration_min_steps():
    g = torch.Generator().manual_seed(0)
    assert exploration_min_steps(100, 0.0, 8, torch.device("cpu"), g).eq(0).all()
    drawn = exploration_min_steps(1000, 1.0, 8, torch.device("cpu"), g)
    assert drawn.min() >= 2 and drawn.max() <= 8 and len(drawn.unique()) == 7
    share = (exploration_min_steps(20000, 0.1, 8, torch.device("cpu"), g) > 0).float().mean()
    assert 0.08 < share < 0.12


def test_carry_keeps_rows_until_they_halt_then_takes_fresh_examples():
    model = hrm(halt_exploration_prob=0.0, halt_max_steps=3)
    with torch.no_grad():
        model.q_head.bias.copy_(torch.tensor([-10.0, 10.0]))  # the Q head always prefers to continue
    model.train()
    batches = [random_batch(seed=s) for s in range(5)]
    model(batches[0])
    assert model._carry.steps.tolist() == [1, 1, 1] and not model._carry.halted.any()
    model(batches[1])  # rows keep working on batch 0's examples
    assert torch.equal(model._carry.data["inputs"], batches[0]["inputs"])
    model(batches[2])
    assert model._carry.steps.tolist() == [3, 3, 3] and model._carry.halted.all()  # halt_max_steps
    z_before = model._carry.z_h.clone()
    model(batches[3])  # fresh examples, state reset to H_init/L_init
    assert torch.equal(model._carry.data["inputs"], batches[3]["inputs"])
    assert model._carry.steps.tolist() == [1, 1, 1]
    fresh = hrm(halt_exploration_prob=0.0, halt_max_steps=3)
    fresh.load_state_dict(model.state_dict())
    fresh.train()
    fresh(batches[3])  # a model with no carry computes the same first segment
    assert torch.allclose(fresh._carry.z_h, model._carry.z_h, atol=1e-6)
    assert not torch.allclose(z_before, model._carry.z_h)
    with torch.no_grad():
        model.q_head.bias.copy_(torch.tensor([10.0, -10.0]))  # now it always wants to halt
    model(batches[4])
    assert model._carry.halted.all() and model._carry.steps.tolist() == [2, 2, 2]


def test_training_metrics_are_the_halted_rows_of_the_last_halt_max_steps_steps(monkeypatch):
    """The window of training metrics against a list of each step's halted rows, kept here."""
    from lmforge.recipes.puzzles import model as puzzles_model

    torch.manual_seed(0)
    model = trm(halt_max_steps=3, halt_exploration_prob=0.5)
    model.train()
    seen = []  # per step: (halted, correct, token accuracy, q right, steps) of its rows
    original = puzzles_model.PuzzleModel._act_loss

    def spy(self, logits, q_halt, q_cont, target_q_cont, labels, halted, steps):
        correct = ((logits.argmax(-1) == labels) | (labels == -100)).all(-1)
        acc = (logits.argmax(-1) == labels).float().mean(-1)
        seen.append((halted.clone(), correct, acc, (q_halt >= 0) == correct, steps.clone()))
        return original(self, logits, q_halt, q_cont, target_q_cont, labels, halted, steps)

    monkeypatch.setattr(puzzles_model.PuzzleModel, "_act_loss", spy)
    halted_any, mixed = [], 0
    for step in range(8):
        if step == 1:  # after a step without halted rows (the fresh Q head's bias, -5, halts none): a Q head that
            # halts every row it may, so rows halt at the minimum exploration drew for each (1, 2 or 3 steps)
            with torch.no_grad():
                model.q_head.bias.fill_(10.0)
        _, metrics = model(random_batch(n=3, seed=step))
        mixed += bool(0 < int(seen[-1][0].sum()) < 3)  # a step where some rows halted and others did not
        window = seen[-3:]  # the last halt_max_steps steps
        rows = sum(int(h.sum()) for h, *_ in window)
        halted_any.append(rows > 0)
        assert float(metrics["halted_rows"]) == rows
        logged = model.logged_metrics({k: float(v) for k, v in metrics.items()})
        if rows == 0:
            assert not set(puzzles_model.PuzzleModel._WINDOW_RATIOS) & set(logged)
            continue
        assert logged["steps"] == pytest.approx(sum(float(s[h].sum()) for h, *_, s in window) / rows)
        assert logged["accuracy"] == pytest.approx(sum(float(a[h].sum()) for h, _, a, *_ in window) / rows)
        assert logged["exact_accuracy"] == pytest.approx(sum(float(c[h].sum()) for h, c, *_ in window) / rows)
        assert logged["q_halt_accuracy"] == pytest.approx(sum(float(q[h].sum()) for h, _, _, q, _ in window) / rows)
    assert not halted_any[0] and all(halted_any[2:]) and mixed >= 2  # each case was checked


@pytest.mark.parametrize("build", [trm, hrm])
def test_compiled_training_step_is_one_graph_from_the_first_step_on(build):
    """The metrics' window once recompiled the step for each of its lengths, up to dynamo's limit (8) and then
    ran it eagerly, and asked the device whether a row had halted at every step (a graph break); the first step,
    without a carry yet, compiled a graph of its own. Traced with the eager backend: dynamo's graphs and guards
    are the ones Inductor would compile. The one break left is the call that picks the carry, kept out of it."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    try:
        model = build(halt_max_steps=6)
        model.train()
        model.before_compile(torch.device("cpu"))  # as the loop does before it compiles
        compiled = torch.compile(model, backend="eager")
        for step in range(10):
            loss, metrics = compiled(random_batch(n=3, seed=step))
            loss.backward()
        breaks = dict(counters["graph_break"])
        assert breaks and all("_carry_for" in reason for reason in breaks), breaks
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
        assert float(metrics["halted_rows"]) > 0
    finally:
        torch._dynamo.reset()


# ---- EMA ---------------------------------------------------------------------------------------
def test_ema_weights_swap_in_and_back():
    model = trm(ema_decay=0.5)
    model.on_optimizer_step()  # EMA starts as a copy
    raw = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.on_optimizer_step()  # ema = 0.5 old + 0.5 new = old + 0.5
    with model.averaged_weights():
        assert all(torch.allclose(p, r + 0.5) for p, r in zip(model.parameters(), raw))
    assert all(torch.allclose(p, r + 1.0) for p, r in zip(model.parameters(), raw))


# ---- configuration: seed 003's words -----------------------------------------------------------
SEED_WORDS = ["epochs=500", "eval_interval=100", "global_batch_size=4", "lr=1e-4", "puzzle_emb_lr=1e-4",
              "weight_decay=1.0", "puzzle_emb_weight_decay=1.0", "arch.hidden_size=32", "arch.H_layers=1",
              "arch.L_layers=1", "arch.num_heads=1", "arch.expansion=2"]


def test_seed_003_command_words_map_to_config():
    cfg = load_config("hrm_sudoku", ["data_path=data/x", *SEED_WORDS])
    t, m, s = cfg.training, cfg.model, cfg.recipe
    assert (cfg.data.path, t.epochs, t.eval_interval_epochs, t.global_batch_size) == ("data/x", 500, 100, 4)
    assert (t.lr, t.weight_decay, s.puzzle_emb_lr, s.puzzle_emb_weight_decay) == (1e-4, 1.0, 1e-4, 1.0)
    # lmforge 0.1's spelling (model.*) and HRM's (arch.*) reach the same training setting
    assert load_config("hrm_sudoku", ["model.puzzle_emb_lr=0.02"]).recipe.puzzle_emb_lr == 0.02
    assert load_config("hrm_sudoku", ["arch.puzzle_emb_lr=0.03"]).recipe.puzzle_emb_lr == 0.03
    assert (m.hidden_size, m.H_layers, m.L_layers, m.num_heads, m.expansion) == (32, 1, 1, 1, 2)
    assert load_config("hrm_sudoku", ["lr=3e-4"]).training.lr == 3e-4  # an alias overrides the recipe
    with pytest.raises(LMForgeError, match="model.H_layrs"):
        load_config("hrm_sudoku", ["arch.H_layrs=1"])
    with pytest.raises(LMForgeError, match="both given"):
        load_config("hrm_sudoku", ["lr=1e-4", "training.lr=2e-4"])


def test_bad_model_configs_are_clear():
    with pytest.raises(LMForgeError, match="divisible"):
        hrm(hidden_size=30, num_heads=4)
    with pytest.raises(LMForgeError, match="pos_encodings"):
        trm(pos_encodings="alibi")


# ---- training through the shared loop ----------------------------------------------------------
def test_seed_003_command_trains_and_logs_what_the_seed_watches(sudoku_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DISABLE_COMPILE", "1")
    words = [w.replace("epochs=500", "epochs=4").replace("eval_interval=100", "eval_interval=2") for w in SEED_WORDS]
    code = main(["train", "hrm_sudoku", f"data_path={sudoku_dir}", *words, f"out_dir={tmp_path}", "name=seed",
                 "arch.halt_max_steps=2",  # so that rows finish puzzles within the 4 steps
                 "training.compile=true", "training.precision=fp32", "training.device=cpu",
                 "training.log_interval=1", "logging.progress_bar=false"])
    assert code == 0
    out = capsys.readouterr().out
    assert "DISABLE_COMPILE is set" in out and "max_steps=4, eval_interval=2" in out  # 4 groups / batch 4
    rows = [json.loads(line) for line in (tmp_path / "seed" / "metrics.jsonl").read_text().splitlines()]
    keys = set().union(*rows)
    for key in ("train/lm_loss", "train/lr", "train/exact_accuracy", "train/accuracy", "train/q_halt_accuracy",
                "train/steps", "eval/exact_accuracy", "eval/accuracy", "eval/q_halt_accuracy", "eval/steps"):
        assert key in keys, key
    assert {r["step"] for r in rows if "eval/exact_accuracy" in r} == {2, 4}
    # step 1: no row has halted yet (halt_max_steps 2), so the loop logs no ratio over halted rows
    first = next(r for r in rows if r["step"] == 1 and "train/loss" in r)
    assert first["train/halted_rows"] == 0 and "train/accuracy" not in first and "train/steps" not in first


def _overfit_recipe(tmp_path: Path, data: Path, family: str, steps: int) -> list[str]:
    model = {"trm": ["model.L_layers=2", "model.H_cycles=2", "model.L_cycles=2", "model.mlp_t=true",
                     "model.pos_encodings=none", "model.puzzle_emb_len=1", "model.ema_decay=0"],
             "hrm": ["model.H_layers=1", "model.L_layers=1"]}[family]
    return [f"data.path={data}", f"out_dir={tmp_path}", f"name={family}", "model.hidden_size=64",
            "model.num_heads=2", "model.expansion=2", "model.halt_max_steps=2", *model,
            f"training.max_steps={steps}", "training.global_batch_size=4", "training.lr=3e-3",
            "training.warmup_steps=10", "training.weight_decay=0.0", "training.precision=fp32",
            "training.device=cpu", f"training.eval_interval={steps}", f"training.save_interval={steps}",
            f"training.peak_flops={PEAK_FLOPS}",
            "logging.progress_bar=false", "logging.tensorboard=false"]


@pytest.mark.slow
def test_trm_overfits_four_puzzles_to_100_percent(sudoku_dir, tmp_path):
    from lmforge.train import train

    cfg = load_config("trm_sudoku", _overfit_recipe(tmp_path, sudoku_dir, "trm", 250))
    result = train(cfg)
    assert result.eval_metrics["eval/exact_accuracy"] == 1.0
    assert result.eval_metrics["eval/accuracy"] == 1.0


# ---- resume: weights, EMA and optimizer restored; the carry starts fresh -----------------------
def test_resume_restores_ema_and_raw_weights_and_resets_carry(sudoku_dir, tmp_path):
    from safetensors.torch import load_file

    from lmforge.train import train

    words = _overfit_recipe(tmp_path, sudoku_dir, "trm", 6)
    cfg = load_config("trm_sudoku", [*words, "model.ema_decay=0.9", "training.save_interval=3"])
    train(cfg)
    ckpt = tmp_path / "trm" / "checkpoints" / "step-000006"
    ema = load_file(str(ckpt / "model.safetensors"))
    raw = load_state(ckpt / "optimizer.safetensors", "optimizer")["model_state"]["raw_weights"]
    names = [n for n, _ in build_model(cfg.model).named_parameters()]
    assert any(not torch.equal(ema[n], r) for n, r in zip(names, raw))  # the checkpoint holds the EMA

    # the Trainer is what `lmforge train --resume` builds; load the checkpoint into a fresh one
    from lmforge.device import setup_device
    from lmforge.train.distributed import DistInfo
    from lmforge.train.loop import Trainer
    from lmforge.recipes.puzzles.training import build_puzzle_data

    cfg2 = load_config("trm_sudoku", [*words, "model.ema_decay=0.9", "training.max_steps=8"])
    info = DistInfo()
    data = build_puzzle_data(cfg2, info)
    model = build_model(cfg2.model)
    trainer = Trainer(cfg2, model, data, setup_device("cpu", "fp32", 1.0), info, tmp_path / "trm")
    trainer.load_checkpoint(ckpt)
    assert trainer.step == 6 and model._carry is None
    for (n, p), r in zip(model.named_parameters(), raw):
        assert torch.equal(p.detach(), r), n
    for (n, _), e in zip(model.named_parameters(), model._ema):
        assert torch.equal(e, ema[n]), n
    trainer.model.train()
    assert math.isfinite(trainer.step_once())  # continues with fresh rows


# ---- solve and eval ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(sudoku_dir, tmp_path_factory) -> Path:
    from lmforge.train import train

    tmp = tmp_path_factory.mktemp("run")
    train(load_config("hrm_sudoku", _overfit_recipe(tmp, sudoku_dir, "hrm", 3)))
    return tmp / "hrm"


def test_solve_prints_grid_validity_and_steps(trained, sudoku_dir, capsys):
    q = np.load(sudoku_dir / "test" / "all__inputs.npy")[0].astype(int) - 1
    code = main(["solve", str(trained), "--puzzle", format_grid(q.astype(np.uint8)), "--device", "cpu"])
    out = capsys.readouterr().out
    assert "valid solution:" in out and "steps used:" in out
    assert code == (0 if "valid solution: yes" in out else 1)
    assert out.count("|") >= 18  # the 9x9 grid with box separators
    # `lmforge generate CKPT --puzzle` is the same entry point (the puzzle kind's generate); sampling options
    # belong to text kinds and are refused here, with the kinds they are for
    assert main(["generate", str(trained), "--puzzle", format_grid(q.astype(np.uint8)), "--device", "cpu"]) == code
    assert capsys.readouterr().out == out
    assert main(["generate", str(trained), "--puzzle", format_grid(q.astype(np.uint8)), "--temperature", "0"]) == 2
    assert "--temperature is for hrgc, lm checkpoints" in capsys.readouterr().err
    assert main(["generate", str(trained)]) == 2
    assert "give it a Sudoku with --puzzle" in capsys.readouterr().err


@pytest.mark.parametrize("puzzle, message", [
    ("1" * 80, "80"),
    ("11" + "." * 79, "no solution"),
    ("x" + "." * 80, "x"),
])
def test_solve_rejects_bad_puzzles(trained, puzzle, message, capsys):
    assert main(["solve", str(trained), "--puzzle", puzzle, "--device", "cpu"]) == 2
    assert message in capsys.readouterr().err


def test_solve_judges_a_puzzle_with_many_solutions_by_the_rules_alone(trained, capsys):
    main(["solve", str(trained), "--puzzle", "0" * 81, "--device", "cpu"])
    out = capsys.readouterr().out
    assert "cells differ" not in out  # no count against one arbitrary solution of the many
    assert "valid solution: yes" in out or "valid solution: no (it breaks the Sudoku rules or changes a clue)" in out
    assert "note: this puzzle has more than one solution" in out


def test_solve_refuses_max_steps_far_beyond_halt_max_steps(trained, sudoku_dir, capsys):
    q = format_grid((np.load(sudoku_dir / "test" / "all__inputs.npy")[0].astype(int) - 1).astype(np.uint8))
    assert main(["solve", str(trained), "--puzzle", q, "--max-steps", "201", "--device", "cpu"]) == 2  # 100 x 2 + 1
    err = capsys.readouterr().err
    assert "--max-steps 201 is more than 100x the model's halt_max_steps (2)" in err and "use at most 200" in err
    assert main(["solve", str(trained), "--puzzle", q, "--max-steps", "8", "--device", "cpu"]) in (0, 1)
    assert "steps used:" in capsys.readouterr().out


def test_eval_on_dataset_and_csv_agree(trained, sudoku_dir, tmp_path, capsys):
    assert main(["eval", str(trained), "--data", str(sudoku_dir), "--json", "--device", "cpu"]) == 0
    on_dir = json.loads(capsys.readouterr().out)
    q = np.load(sudoku_dir / "test" / "all__inputs.npy").astype(int) - 1
    a = np.load(sudoku_dir / "test" / "all__labels.npy").astype(int) - 1
    csv = tmp_path / "set.csv"
    csv.write_text("source,q,a,rating\n" + "".join(
        f"t,{format_grid(qi.astype(np.uint8))},{format_grid(ai.astype(np.uint8))},0\n" for qi, ai in zip(q, a)))
    assert main(["eval", str(trained), "--data", str(csv), "--json", "--device", "cpu"]) == 0
    on_csv = json.loads(capsys.readouterr().out)
    assert on_dir["puzzles"] == on_csv["puzzles"] == 4
    assert on_dir["exact_accuracy"] == on_csv["exact_accuracy"]
    assert on_dir["accuracy"] == pytest.approx(on_csv["accuracy"])
    assert 1 <= on_dir["steps"] <= 2
    main(["eval", str(trained), "--data", str(sudoku_dir), "--device", "cpu"])
    assert "exact accuracy" in capsys.readouterr().out


def test_blank_accuracy_counts_only_the_cells_a_puzzle_leaves_to_fill(trained, sudoku_dir, capsys):
    """`accuracy` counts the givens (HRM's convention), which a model copies; `blank_accuracy` is the share of
    the cells to fill that it got right: recomputed here from the model's answers."""
    from lmforge.recipes.puzzles.data import PuzzleEvalLoader, PuzzleSplit
    from lmforge.recipes.puzzles.evaluate import load_puzzle_model

    assert main(["eval", str(trained), "--data", str(sudoku_dir), "--json", "--device", "cpu"]) == 0
    got = json.loads(capsys.readouterr().out)
    model, _ = load_puzzle_model(trained, "cpu")
    per_row = []
    for batch in PuzzleEvalLoader(PuzzleSplit(sudoku_dir, "test"), batch_size=3).iter_eval_batches():
        answer = model.rollout(batch["inputs"], batch["puzzle_identifiers"])["prediction"].numpy()
        inputs, labels = batch["inputs"].numpy(), batch["labels"].numpy()
        for given, truth, said in zip(inputs, labels, answer, strict=True):
            blank = given == 1  # the layout's blank token
            per_row.append((said[blank] == truth[blank]).mean())
    assert got["blank_accuracy"] == pytest.approx(np.mean(per_row), abs=1e-6)
    assert got["blank_accuracy"] < got["accuracy"]  # 30-36 givens of 81 are (nearly) free
    main(["eval", str(trained), "--data", str(sudoku_dir), "--device", "cpu"])
    assert f"(blank cells {100 * got['blank_accuracy']:.2f}%)" in capsys.readouterr().out


def test_epochs_and_global_batch_become_steps():
    from lmforge.train import _resolve_batch, _resolve_epochs
    from lmforge.train.distributed import DistInfo
    from lmforge.recipes import TrainData

    cfg = load_config("hrm_sudoku", ["epochs=3", "eval_interval=1", "global_batch_size=8",
                                     "training.grad_accum_steps=2"])
    two_ranks = DistInfo(rank=0, local_rank=0, world_size=2)
    _resolve_batch(cfg, two_ranks)
    assert cfg.training.micro_batch_size == 2  # 8 rows = 2 ranks x 2 micro-batches x 2
    _resolve_epochs(cfg, TrainData(train=None, val=None, examples_per_epoch=100), two_ranks)
    assert (cfg.training.max_steps, cfg.training.eval_interval) == (38, 12)  # ceil(3 x 100 / 8), round(12.5)
    bad = load_config("hrm_sudoku", ["global_batch_size=6", "training.grad_accum_steps=4"])
    with pytest.raises(LMForgeError, match="not divisible"):
        _resolve_batch(bad, DistInfo())


def test_grad_accumulation_is_refused_for_act_models(sudoku_dir, tmp_path):
    from lmforge.train import train

    cfg = load_config("hrm_sudoku", [*_overfit_recipe(tmp_path, sudoku_dir, "hrm", 2), "training.grad_accum_steps=2"])
    with pytest.raises(LMForgeError, match="grad_accum_steps"):
        train(cfg)


def test_activation_checkpointing_gives_the_same_gradients():
    grads = []
    for enabled in (False, True):
        torch.manual_seed(0)
        model = trm(halt_exploration_prob=0.0, mlp_t=True, pos_encodings="none")
        model.set_activation_checkpointing(enabled)
        model.train()
        loss, _ = model(random_batch())
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))


@pytest.mark.slow
def test_hrm_overfits_four_puzzles_to_100_percent(sudoku_dir, tmp_path):
    from lmforge.train import train

    # ACT on (2 steps, exploration, Q-learning target); lr decays to 0 so the last steps settle
    words = [*_overfit_recipe(tmp_path, sudoku_dir, "hrm", 500), "training.lr=2e-3", "training.min_lr_ratio=0.0"]
    result = train(load_config("hrm_sudoku", words))
    assert result.eval_metrics["eval/exact_accuracy"] == 1.0


def test_ddp_two_processes_match_one(sudoku_dir, tmp_path):
    """Rank slices of the group sampler, the puzzle model and AdamATan2 + sign-SGD under DDP (gloo):
    two processes at micro-batch 2 take the same steps as one at 4 (no ACT, so no per-rank randomness)."""
    import sys

    from tests.train_helpers import REPO, run

    def losses(name: str) -> dict[int, float]:
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}

    words = [f"data_path={sudoku_dir}", f"out_dir={tmp_path}", "global_batch_size=4", "arch.hidden_size=32",
             "arch.num_heads=2", "arch.H_layers=1", "arch.L_layers=1", "arch.halt_max_steps=1",
             "training.max_steps=5", "training.warmup_steps=2", "training.lr=1e-3", "training.precision=fp32",
             "training.device=cpu", "training.log_interval=1", "training.eval_interval=5",
             "logging.progress_bar=false", "logging.tensorboard=false"]
    one = run([sys.executable, "-m", "lmforge", "train", "hrm_sudoku", *words, "name=one"], cwd=REPO)
    assert one.returncode == 0, one.stderr
    two = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "lmforge",
               "train", "hrm_sudoku", *words, "name=two"], cwd=REPO)
    assert two.returncode == 0, two.stderr + two.stdout
    a, b = losses("one"), losses("two")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5]
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=1e-5)


@pytest.mark.parametrize("recipe", ["hrm_sudoku_tiny", "trm_sudoku_tiny", "sudoku_baseline_tiny"])
def test_8bit_moments_are_refused_for_the_puzzle_optimizer_when_the_config_is_validated(recipe, tmp_path, capsys):
    """The puzzle kind's AdamATan2SignSGD keeps fp32 states: training.optimizer_states=8bit (or the Trainer's
    optim=adamw_8bit) is refused by load_config, before any data is read or model built (data.path is missing)."""
    refusal = (r"training.optimizer_states=8bit is AdamW's, and the puzzles kind trains with its own optimizer "
               r"\(AdamATan2SignSGD\), whose states stay fp32: drop training.optimizer_states")
    missing = [f"data.path={tmp_path / 'no-data'}", f"out_dir={tmp_path / 'runs'}"]
    for setting in ("training.optimizer_states=8bit", "training.optim=adamw_8bit"):
        with pytest.raises(LMForgeError, match=refusal):
            load_config(recipe, [*missing, setting])
    assert main(["train", recipe, *missing, "training.optimizer_states=8bit"]) == 2
    err = capsys.readouterr().err
    assert "optimizer_states=8bit is AdamW's" in err and "no-data" not in err
    assert not (tmp_path / "runs").exists()  # no run directory started
    assert load_config(recipe, missing).training.optimizer_states == "fp32"
