"""The reward kind: the Bradley-Terry loss (margin, centering), the reward read at each reply's last
token, a reward model built on a chat model's trunk, a real run from the `tool_sft` checkpoint that
ranks held-out pairs far above chance, `lmforge eval --preferences`, exact resume, and bad input."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from lmforge.errors import LMForgeError
from lmforge.models import load_model
from lmforge.models.gpt import GPT, GPTConfig
from lmforge.models.reward import RewardModel, pair_loss, reward_config_from
from lmforge.posttrain.pairs import PackedPairs, render_pairs
from lmforge.posttrain.preferences import read_preferences, write_preference_dataset
from lmforge.recipes.reward.data import format_pair_report, pair_report, score_pairs
from lmforge.checkpoint import read_sharded_weights
from tests.posttrain_helpers import SEQ_LEN
from tests.train_helpers import sharded_against_replicated, torchrun


@pytest.fixture(scope="module")
def prefs(tmp_path_factory) -> Path:
    """Generated tool-calling preference pairs (train / val / test) over the prompts `tool_sft` learnt from."""
    out = tmp_path_factory.mktemp("prefs") / "prefs"
    write_preference_dataset(out, n_train=1600, n_val=120, n_test=800, seed=0)
    return out


def reward_on(trunk: GPT, seed: int = 0) -> RewardModel:
    """A reward model on ``trunk``'s weights with a fresh head drawn with ``seed``."""
    torch.manual_seed(seed)
    model = RewardModel(reward_config_from(trunk.config))
    model.load_initial_weights(trunk, "the test's trunk")
    return model.eval()


def reward_config(tmp_path: Path, data: Path, init: Path, recipe: dict | None = None, **training):
    from lmforge.config import load_config

    values = {"kind": "reward", "name": "rm", "out_dir": str(tmp_path / "runs"), "seed": 0,
              "data": {"train_path": str(data), "seq_len": SEQ_LEN}, "recipe": recipe or {},
              "training": {"init_from": str(init), "max_steps": 6, "micro_batch_size": 2, "lr": 1e-3,
                           "warmup_steps": 0, "eval_interval": 0, "save_interval": 0, "eval_batches": 0,
                           "device": "cpu", "precision": "fp32", "peak_flops": 1e12, **training},
              "logging": {"tensorboard": False, "progress_bar": False}}
    return load_config(values=values)


# ---- the loss --------------------------------------------------------------------------------------
def test_bradley_terry_loss_margin_and_metrics():
    chosen = torch.tensor([2.0, 0.5, -1.0, 3.0])
    rejected = torch.tensor([1.0, 0.5, 1.0, -1.0])
    diff = chosen - rejected  # 1, 0, -2, 4
    loss, m = pair_loss(chosen, rejected)
    assert float(loss) == pytest.approx(sum(math.log1p(math.exp(-d)) for d in diff.tolist()) / 4)
    assert float(m["accuracy"]) == pytest.approx((1 + 0.5 + 0 + 1) / 4)  # the tie counts half
    assert float(m["margin"]) == pytest.approx(0.75)
    assert float(m["chosen_reward"]) == pytest.approx(1.125) and float(m["rejected_reward"]) == pytest.approx(0.375)
    both = torch.cat([chosen, rejected])
    assert float(m["reward_mean"]) == pytest.approx(0.75) and float(m["reward_std"]) == pytest.approx(float(both.std(unbiased=False)))
    # a margin asks the chosen reply to win by that much: -logsigmoid(d - margin)
    margin = torch.tensor([0.5, 0.0, 1.0, 6.0])
    with_margin, _ = pair_loss(chosen, rejected, margin)
    assert float(with_margin) == pytest.approx(sum(math.log1p(math.exp(-(d - g))) for d, g in zip(diff.tolist(),
                                                                                           margin.tolist())) / 4)
    assert float(with_margin) > float(loss)
    # a pair that wins by 4 but was owed 6 still pulls: its gradient grows with the margin
    c = chosen.clone().requires_grad_()
    pair_loss(c, rejected)[0].backward()
    plain = float(c.grad[3])
    c.grad = None
    pair_loss(c, rejected, margin)[0].backward()
    assert float(c.grad[3]) < plain < 0
    # centering adds coef * mean((r_c + r_r)^2), and nothing else
    centred, _ = pair_loss(chosen, rejected, center_coef=0.1)
    assert float(centred) == pytest.approx(float(loss) + 0.1 * float(((chosen + rejected) ** 2).mean()))


# ---- reading the reward ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair_batch(tool_sft, prefs):
    """A packed batch of held-out pairs (several rows, some padded) and the store it came from."""
    pairs = read_preferences(prefs / "val.jsonl")
    store = render_pairs(tool_sft.tokenizer, pairs[:24], SEQ_LEN)
    batch = next(PackedPairs(store, SEQ_LEN, 4, shuffle=False).iter_eval_batches())
    return store, batch


def test_reward_is_read_at_each_sequences_last_real_token(tool_sft, pair_batch):
    store, batch = pair_batch
    model = reward_on(load_model(tool_sft.checkpoint))
    eos = tool_sft.tokenizer.eos_id
    with torch.no_grad():
        packed = model.rewards(batch)
        scores = model.scores(batch["input_ids"], batch["position_ids"], batch["document_ids"])
        alone, first_eos = [], []
        for p in batch["pair_index"].tolist():
            for side in (0, 1):
                s = 2 * p + side
                ids = torch.from_numpy(store.inputs[store.offsets[s]:store.offsets[s + 1]])
                # eos opens every sequence and closes every turn: the end is found by length, not by eos
                assert ids[-1] == eos and int((ids == eos).sum()) >= 3
                own = model.scores(ids[None])[0]
                alone.append(own[-1])
                first_eos.append(own[int((ids[1:] == eos).nonzero()[0]) + 1])
    alone, first_eos = torch.stack(alone), torch.stack(first_eos)
    # each reward is what the sequence scores alone at its last token (packing changes nothing) ...
    assert torch.allclose(packed, alone, atol=1e-5)
    # ... and not what it scores where its first turn closes
    assert (packed - first_eos).abs().min() > 1e-3
    # rows shorter than the batch are padded; their last column is not where their last reply ends
    B, T = batch["input_ids"].shape
    padded = [r for r in range(B) if batch["sequence_ids"][r, -1] < 0]
    assert padded
    last_of_row = {int(i) // T: n for n, i in enumerate(batch["last_index"].tolist())}
    for r in padded:
        assert abs(float(scores[r, -1]) - float(packed[last_of_row[r]])) > 1e-3
    # the scores of the packed rows, read at last_index, are the rewards
    assert torch.allclose(scores.view(-1)[batch["last_index"]], packed, atol=1e-6)


def test_forward_uses_the_margin_column_only_when_asked(tool_sft, pair_batch):
    _, batch = pair_batch
    model = reward_on(load_model(tool_sft.checkpoint))
    P = batch["num_examples"]
    batch = {**batch, "margin": torch.linspace(0.5, 2.0, P)}
    with torch.no_grad():
        r = model.rewards(batch)
        diff = r[0::2] - r[1::2]
        plain, metrics = model(batch)
        model.use_margin = True
        with_margin, _ = model(batch)
    assert float(plain) == pytest.approx(float(-F.logsigmoid(diff).mean()), rel=1e-5)
    assert float(with_margin) == pytest.approx(float(-F.logsigmoid(diff - batch["margin"]).mean()), rel=1e-5)
    assert float(metrics["margin"]) == pytest.approx(float(diff.mean()), rel=1e-5)


def test_centering_pulls_the_mean_reward_toward_zero(tool_sft, pair_batch):
    """The pairwise loss cannot see a shift of every reward; the centering term removes it."""
    _, batch = pair_batch
    late = {}
    for coef in (0.0, 0.1):
        model = reward_on(load_model(tool_sft.checkpoint)).train()
        model.center_rewards_coef = coef
        with torch.no_grad():
            model.head.bias.fill_(3.0)  # every reward shifted up by 3
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        means = []
        for step in range(15):
            loss, metrics = model(batch)
            opt.zero_grad()
            loss.backward()
            if step == 0:
                first_bias_grad = float(model.head.bias.grad)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # as the loop does
            opt.step()
            means.append(float(metrics["reward_mean"]))
        late[coef] = sum(abs(m) for m in means[-6:]) / 6
        if coef == 0.0:
            assert abs(first_bias_grad) < 1e-5  # a common shift costs the Bradley-Terry loss nothing
        else:
            assert first_bias_grad > 0.1  # centering pushes it down
    assert late[0.1] < 0.5 * late[0.0]


# ---- the model ---------------------------------------------------------------------------------------
def test_built_on_a_chat_models_trunk_saved_without_pickle(tool_sft, tmp_path):
    from safetensors.torch import load_file

    from lmforge.recipes.puzzles.trm import TRMConfig

    sft = load_model(tool_sft.checkpoint)
    torch.manual_seed(3)
    model = RewardModel(reward_config_from(sft.config)).eval()
    head = model.head.weight.clone()
    ids = torch.randint(0, sft.config.vocab_size, (2, 40))
    with torch.no_grad():
        assert not torch.equal(model.trunk.hidden_states(ids), sft.hidden_states(ids))
        model.load_initial_weights(sft, "the sft run")
        assert torch.equal(model.trunk.hidden_states(ids), sft.hidden_states(ids))  # the trunk is the chat model's
    assert torch.equal(model.head.weight, head)  # and the head stays fresh
    # saved as config.yaml (the gpt keys, family reward) + safetensors, without an LM head
    out = model.save_pretrained(tmp_path / "rm")
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "model.safetensors"]
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["family"] == "reward" and config["n_embd"] == sft.config.n_embd
    tensors = load_file(str(out / "model.safetensors"))
    assert "head.weight" in tensors and not any("lm_head" in k for k in tensors)
    again = load_model(out)
    assert isinstance(again, RewardModel)
    with torch.no_grad():
        assert torch.equal(again.scores(ids), model.scores(ids))
    # a reward model continues from another one, head included
    other = reward_on(sft, seed=4)
    other.load_initial_weights(again, str(out))
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), again.state_dict().values()))
    # anything else is refused with what it is
    trm = load_model(_trm_checkpoint(tmp_path, TRMConfig))
    with pytest.raises(LMForgeError, match="holds a 'trm' model; a reward model starts from a gpt-family chat model"):
        model.load_initial_weights(trm, "trm-run")
    wide = GPT(GPTConfig(flavor="llama", vocab_size=sft.config.vocab_size, n_layer=2, n_embd=96, n_head=2,
                         n_positions=SEQ_LEN))
    with pytest.raises(LMForgeError, match="another shape"):
        model.load_initial_weights(wide, "wide-run")


def _trm_checkpoint(tmp_path: Path, TRMConfig) -> Path:
    from lmforge.models import build_model

    return build_model(TRMConfig(seq_len=8, vocab_size=11, num_puzzle_identifiers=1, hidden_size=16, num_heads=2,
                                 L_layers=1, H_cycles=1, L_cycles=1, puzzle_emb_len=1)).save_pretrained(tmp_path / "trm")


# ---- a real run -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reward_run(tool_sft, prefs, tmp_path_factory):
    from lmforge.train import train

    tmp_path = tmp_path_factory.mktemp("reward")
    cfg = reward_config(tmp_path, prefs, tool_sft.run, recipe={"center_rewards_coef": 0.01}, max_steps=150,
                        micro_batch_size=8, warmup_steps=10, eval_interval=50)
    result = train(cfg)
    return tmp_path / "runs" / "rm", result


def test_reward_model_ranks_held_out_pairs_far_above_chance(tool_sft, prefs, reward_run, capsys):
    from lmforge.cli import main

    run, result = reward_run
    sft = load_model(tool_sft.checkpoint)
    test_pairs = read_preferences(prefs / "test.jsonl")
    # rows of twice the context, as `lmforge eval --preferences` scores them: each side within the context
    store = render_pairs(tool_sft.tokenizer, test_pairs, 2 * SEQ_LEN, max_sequence=SEQ_LEN)
    # before training: the chat model's trunk with a fresh head ranks the pairs at chance
    untrained = [pair_report(store, score_pairs(reward_on(sft, seed), store, 2 * SEQ_LEN, 8))["accuracy"]
                 for seed in range(3)]
    assert 0.4 < sum(untrained) / 3 < 0.6
    # after: `lmforge eval --preferences` on the run's best checkpoint, per kind of rejected reply
    assert main(["eval", str(run), "--preferences", str(prefs), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    print(format_pair_report(report))
    assert report["pairs"] == len(store) > 250 and report["skipped"] == len(test_pairs) - len(store)
    by_kind = report["by_kind"]
    assert set(by_kind) == set(store.kinds) and sum(f["pairs"] for f in by_kind.values()) == report["pairs"]
    # far above chance overall (chance: 0.5 +- 0.03 on this many pairs) ...
    assert report["accuracy"] > 0.66 and report["margin"] > 0.5
    # ... and near perfect on whether to call a tool at all; which tool and which arguments are beyond this
    # tiny trunk (the chat model itself ranks those pairs near chance by log-likelihood), see docs/reward.md
    whether = [by_kind[k] for k in ("missed_call", "false_call", "ignored_result")]
    assert sum(f["accuracy"] * f["pairs"] for f in whether) / sum(f["pairs"] for f in whether) > 0.75
    # the same figures as a table
    assert main(["eval", str(run), "--preferences", str(prefs / "test.jsonl")]) == 0
    table = capsys.readouterr().out
    assert "wrong_tool" in table and f"{report['accuracy']:.3f}" in table.splitlines()[-2]


def test_run_logs_pair_metrics_and_keeps_the_most_accurate_checkpoint(tool_sft, prefs, reward_run):
    from lmforge.tokenizer import Tokenizer

    run, result = reward_run
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "train/loss" in r]
    for key in ("accuracy", "margin", "reward_mean", "reward_std", "chosen_reward", "rejected_reward"):
        assert all(f"train/{key}" in r for r in train_rows)
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [50, 100, 150]
    best = max(r["eval/accuracy"] for r in evals)
    state = json.loads((run / "checkpoints" / "step-000150" / "trainer_state.json").read_text())
    assert state["best_metric"] == "eval/accuracy" and state["best_score"] == pytest.approx(-best)
    # best/ really scores that on the held-out split (means over pairs, not tokens)
    model = load_model(run / "checkpoints" / "best").eval()
    assert isinstance(model, RewardModel) and model.config.n_layer == 2
    val = render_pairs(tool_sft.tokenizer, read_preferences(prefs / "val.jsonl"), SEQ_LEN)
    assert pair_report(val, score_pairs(model, val, SEQ_LEN, 4))["accuracy"] == pytest.approx(best, abs=1e-6)
    assert Tokenizer.load(run / "checkpoints" / "best").sha256 == tool_sft.tokenizer.sha256
    assert result.step == 150


def test_resume_is_exact(tool_sft, prefs, tmp_path):
    """6 steps straight vs 3 + resume + 3, with dropout and the data's margins in the loss: the same weights."""
    from safetensors.torch import load_file

    from lmforge.train import train

    data = tmp_path / "pairs.jsonl"
    rows = [json.loads(line) for line in (prefs / "val.jsonl").read_text().splitlines()[:40]]
    data.write_text("".join(json.dumps({**r, "margin": 0.1 * (i % 5)}) + "\n" for i, r in enumerate(rows)))

    def config(name: str):
        cfg = reward_config(tmp_path, data, tool_sft.run, recipe={"use_margin": True, "center_rewards_coef": 0.01},
                            save_interval=3)
        cfg.model.resid_pdrop = 0.1  # dropout on: the RNG state must resume too
        cfg.name = name
        return cfg

    train(config("straight"))
    runs = tmp_path / "runs"
    (runs / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(runs / "straight" / "checkpoints" / "step-000003", runs / "resumed" / "checkpoints" / "step-000003")
    assert train(config("resumed"), resume=True).step == 6
    wa = load_file(str(runs / "straight" / "checkpoints" / "step-000006" / "model.safetensors"))
    wb = load_file(str(runs / "resumed" / "checkpoints" / "step-000006" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert yaml.safe_load((runs / "straight" / "checkpoints" / "step-000006" / "config.yaml").read_text())["resid_pdrop"] == 0.1


def test_sharded_on_two_processes_matches_replicated_and_resumes(tool_sft, prefs, tmp_path, capsys):
    """training.parallel=fsdp shards the trunk's blocks (the reward model holds them one level down):
    the same losses, held-out accuracy and weights as DDP, half the state per process; its sharded
    checkpoint resumes on two processes to the weights of the run that went straight through."""
    data = tmp_path / "pairs"
    data.mkdir()
    for split, source, n in (("train", "train", 40), ("val", "val", 12)):
        lines = (prefs / f"{source}.jsonl").read_text().splitlines(keepends=True)[:n]
        (data / f"{split}.jsonl").write_text("".join(lines))
    cfg = reward_config(tmp_path, data, tool_sft.run, max_steps=4, eval_interval=2, save_interval=2)
    recipe = tmp_path / "rm.yaml"
    recipe.write_text(yaml.safe_dump(cfg.to_dict()))
    runs = tmp_path / "runs"
    rows = sharded_against_replicated(recipe, runs)
    assert [r["step"] for r in rows["fsdp"] if "eval/accuracy" in r] == [2, 4]
    # resumed from the sharded step 2 in a run of its own: step 4's weights as the run that went on
    (runs / "again" / "checkpoints").mkdir(parents=True)
    shutil.copytree(runs / "fsdp" / "checkpoints" / "step-000002", runs / "again" / "checkpoints" / "step-000002")
    done = torchrun(["train", str(recipe), "name=again", "training.parallel=fsdp", "--resume"], runs / "again")
    assert done.returncode == 0, done.stderr[-3000:]
    want, got = (read_sharded_weights(runs / n / "checkpoints" / "step-000004") for n in ("fsdp", "again"))
    assert want.keys() == got.keys() and any(k.startswith("trunk.blocks.") for k in got)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6, msg=k)
    # `lmforge eval --preferences` reads the sharded step checkpoint as it is: DDP's figures for the same step
    from lmforge.cli import main

    capsys.readouterr()
    reports = []
    for step in (runs / "fsdp" / "checkpoints" / "step-000004", runs / "ddp" / "checkpoints" / "step-000004"):
        assert main(["eval", str(step), "--preferences", str(data / "val.jsonl"), "--json"]) == 0
        reports.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert reports[0]["pairs"] == 12 and reports[0]["accuracy"] == pytest.approx(reports[1]["accuracy"])
    assert reports[0]["margin"] == pytest.approx(reports[1]["margin"], rel=1e-4)


def test_bad_input_is_refused_before_training(tool_sft, prefs, tmp_path, capsys):
    from lmforge.config import load_config
    from lmforge.recipes.puzzles.trm import TRMConfig
    from lmforge.tokenizer import train_tokenizer
    from lmforge.train import train

    rows = (prefs / "val.jsonl").read_text().splitlines()[:20]
    no_rejected = tmp_path / "no_rejected.jsonl"
    broken = json.loads(rows[3])
    del broken["rejected"]
    no_rejected.write_text("\n".join([*rows[:3], json.dumps(broken), *rows[4:]]) + "\n")
    with pytest.raises(LMForgeError, match=r"no_rejected.jsonl:4.*rejected"):
        train(reward_config(tmp_path, no_rejected, tool_sft.run))
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(rows) + "\n")
    with pytest.raises(LMForgeError, match="holds a 'trm' model; a reward model is built on a gpt-family chat model"):
        train(reward_config(tmp_path, good, _trm_checkpoint(tmp_path, TRMConfig)))
    other_tok = train_tokenizer(["some other text entirely"] * 20, vocab_size=300, out_dir=tmp_path / "tok",
                                show_progress=False)
    cfg = reward_config(tmp_path, good, tool_sft.run)
    cfg.data.tokenizer = str(other_tok)
    with pytest.raises(LMForgeError, match="is not the tokenizer the weights of training.init_from"):
        train(cfg)
    with pytest.raises(LMForgeError, match="recipe.use_margin=true but no training pair"):
        train(reward_config(tmp_path, good, tool_sft.run, recipe={"use_margin": True}))
    with pytest.raises(LMForgeError, match="does not exist"):
        train(reward_config(tmp_path, tmp_path / "missing.jsonl", tool_sft.run))
    with pytest.raises(LMForgeError, match="recipe.center_rewards_coef must be >= 0"):
        load_config(values={"kind": "reward", "recipe": {"center_rewards_coef": -0.1}})
    assert not (tmp_path / "runs").exists()
    # `lmforge eval --preferences` takes reward models only
    from lmforge.cli import main

    assert main(["eval", str(tool_sft.run), "--preferences", str(good)]) != 0
    assert "--preferences is for reward checkpoints" in capsys.readouterr().err
