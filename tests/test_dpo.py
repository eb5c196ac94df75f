"""The dpo kind: the loss against a hand computation, precomputed vs live reference, the checks on its
input, exact resume, and a real run from the tiny tool-calling sft model that ranks held-out pairs better."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.device import DeviceInfo
from lmforge.errors import LMForgeError
from lmforge.models import load_model
from lmforge.models.losses import IGNORE_INDEX
from lmforge.posttrain.pairs import PackedPairs, render_pairs
from lmforge.posttrain.preferences import read_preferences, write_preference_dataset
from lmforge.recipes.dpo import SPEC
from lmforge.recipes.dpo.loss import bind, dpo_loss, pair_logps
from lmforge.recipes.dpo.reference import score_share
from lmforge.tokenizer import Tokenizer, train_tokenizer
from tests.train_helpers import sharded_against_replicated, weight_mb

SEQ_LEN = 512  # the tool_sft model's context
CPU = DeviceInfo(device=torch.device("cpu"), precision="fp32", peak_flops=1e12, peak_source="test")


@pytest.fixture(scope="module")
def prefs(tmp_path_factory) -> Path:
    """Generated preference pairs on the tool_sft prompts (train), with val and test pairs of held-out
    argument values: chosen = the reference turn, rejected = a wrong tool, wrong arguments, a missed or
    a needless call, or an answer that ignores the tool's result."""
    out = tmp_path_factory.mktemp("prefs") / "pairs"
    write_preference_dataset(out, n_train=400, n_val=100, n_test=200, seed=0)
    return out


def dpo_config(tmp_path: Path, data: Path, init: Path | str, recipe: dict | None = None, **training):
    from lmforge.config import load_config

    values = {"kind": "dpo", "name": "dpo", "out_dir": str(tmp_path / "runs"), "seed": 0,
              "data": {"train_path": str(data), "seq_len": SEQ_LEN},
              "recipe": recipe or {},
              "training": {"init_from": str(init), "max_steps": 6, "micro_batch_size": 4, "lr": 3e-4,
                           "warmup_steps": 5, "eval_interval": 0, "save_interval": 0, "device": "cpu",
                           "precision": "fp32", "peak_flops": 1e12, **training},
              "logging": {"tensorboard": False, "progress_bar": False}}
    return load_config(values=values)


def pair_store(prefs, tool_sft, n: int):
    """The ``n`` shortest held-out pairs, rendered: several fit one row."""
    every = render_pairs(tool_sft.tokenizer, read_preferences(prefs / "test.jsonl"), SEQ_LEN)
    shortest = np.argsort(every.pair_lengths, kind="stable")[:n]
    return render_pairs(tool_sft.tokenizer, [every.pairs[i] for i in shortest], SEQ_LEN)


def sequence_logp_alone(model, ids: np.ndarray, targets: np.ndarray) -> tuple[float, int]:
    """Sum of log p(target) over one sequence run on its own (no packing), in float64; and the count."""
    with torch.no_grad():
        logits = model.lm_head(model.hidden_states(torch.from_numpy(ids)[None]))[0].double()
    logp = torch.log_softmax(logits, -1)
    where = torch.from_numpy(targets != IGNORE_INDEX)
    picked = logp[where].gather(-1, torch.from_numpy(targets)[where][:, None])
    return float(picked.sum()), int(where.sum())


@pytest.mark.parametrize("label_smoothing,rpo_alpha", [(0.0, 0.0), (0.2, 0.0), (0.0, 0.5)])
def test_loss_is_the_dpo_formula(tool_sft, prefs, label_smoothing, rpo_alpha):
    """A packed batch of 5 pairs vs each sequence scored alone and the formula written out by hand."""
    beta = 0.3
    store = pair_store(prefs, tool_sft, 6)
    policy = load_model(tool_sft.base).eval()  # far from the reference: rewards of many sizes and both signs
    reference = load_model(tool_sft.checkpoint).eval()
    batch = next(PackedPairs(store, SEQ_LEN, 3, shuffle=False).iter_eval_batches())
    assert batch["input_ids"].shape[0] > 1 and batch["num_examples"] >= 3  # several rows, pairs share them

    losses, rewards, chosen_logp, chosen_tokens = [], [], 0.0, 0
    for k in batch["pair_index"].tolist():
        ratio = []
        for side in (0, 1):
            i = 2 * k + side
            span = slice(int(store.offsets[i]), int(store.offsets[i] + store.lengths[i]))
            pi, n = sequence_logp_alone(policy, store.inputs[span], store.targets[span])
            ref, _ = sequence_logp_alone(reference, store.inputs[span], store.targets[span])
            ratio.append(pi - ref)
            if side == 0:
                chosen_logp, chosen_tokens = chosen_logp + pi, chosen_tokens + n
        h = beta * (ratio[0] - ratio[1])
        log_sigmoid = lambda x: -math.log1p(math.exp(-x)) if x > 0 else x - math.log1p(math.exp(x))  # noqa: E731
        losses.append(-(1 - label_smoothing) * log_sigmoid(h) - label_smoothing * log_sigmoid(-h))
        rewards.append((beta * ratio[0], beta * ratio[1]))
    expected = sum(losses) / len(losses) - rpo_alpha * chosen_logp / chosen_tokens
    assert {r[0] > r[1] for r in rewards} == {True, False}  # the example has pairs ranked both ways

    bind(policy, beta, label_smoothing, reference=reference, rpo_alpha=rpo_alpha)
    loss, metrics = dpo_loss(policy, batch)
    assert float(loss.detach()) == pytest.approx(expected, abs=2e-4)
    chosen, rejected = np.array(rewards).T
    assert float(metrics["rewards/chosen"]) == pytest.approx(chosen.mean(), abs=2e-4)
    assert float(metrics["rewards/rejected"]) == pytest.approx(rejected.mean(), abs=2e-4)
    assert float(metrics["rewards/margin"]) == pytest.approx((chosen - rejected).mean(), abs=2e-4)
    assert float(metrics["rewards/accuracy"]) == pytest.approx((chosen > rejected).mean())


def test_precomputed_and_live_reference_give_the_same_loss_and_gradients(tool_sft, prefs):
    store = pair_store(prefs, tool_sft, 12)
    reference = load_model(tool_sft.checkpoint).eval()
    policy = load_model(tool_sft.base)
    n_params, keys = len(list(policy.parameters())), set(policy.state_dict())

    # The table, scored on its own (unshuffled) layout; the batch is a shuffled training one.
    table, seen = score_share(reference, store, SEQ_LEN, 4, CPU, rank=0, world_size=1)
    assert (seen == 1).all()
    batch = PackedPairs(store, SEQ_LEN, 2, seed=5).next_batch()

    def loss_and_grads(batch):
        policy.zero_grad(set_to_none=True)
        loss, metrics = dpo_loss(policy, batch)
        loss.backward()
        return loss.detach(), metrics, [p.grad.clone() for p in policy.parameters()]

    live_reference = load_model(tool_sft.checkpoint)
    bind(policy, 0.1, 0.1, reference=live_reference)
    live = loss_and_grads(batch)
    # the live reference is held beside the policy: not one of its parameters or saved tensors, and frozen
    assert len(list(policy.parameters())) == n_params and set(policy.state_dict()) == keys
    assert not live_reference.training
    assert all(not p.requires_grad and p.grad is None for p in live_reference.parameters())
    bind(policy, 0.1, 0.1)  # no live reference: the batch must carry the log-probs
    with pytest.raises(LMForgeError, match="no reference log-probs"):
        dpo_loss(policy, batch)
    store.ref_logps = table.numpy()
    same_batch = PackedPairs(store, SEQ_LEN, 2, seed=5).next_batch()
    precomputed = loss_and_grads(same_batch)
    # throughput counts: real tokens, pairs, and a reference forward (a third more) only when live
    counts, live_counts = SPEC.count(policy, same_batch), SPEC.count(policy, batch)
    assert counts.tokens == live_counts.tokens == int((batch["sequence_ids"] >= 0).sum()) < batch["input_ids"].numel()
    assert counts.examples == batch["num_examples"] and live_counts.flops == pytest.approx(4 / 3 * counts.flops)

    assert float(live[0]) != pytest.approx(math.log(2), abs=1e-3)  # the policy is not the reference
    assert float(precomputed[0]) == pytest.approx(float(live[0]), rel=1e-5)
    for key in live[1]:
        assert float(precomputed[1][key]) == pytest.approx(float(live[1][key]), rel=1e-4, abs=1e-4)
    for a, b in zip(live[2], precomputed[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_precompute_shards_cover_every_pair_once(tool_sft, prefs):
    """Under DDP each process scores its own rows; the shares summed are the one-process table."""
    store = pair_store(prefs, tool_sft, 20)
    reference = load_model(tool_sft.checkpoint).eval()
    whole, _ = score_share(reference, store, SEQ_LEN, 2, CPU, rank=0, world_size=1)
    shares = [score_share(reference, store, SEQ_LEN, 2, CPU, rank=r, world_size=2) for r in (0, 1)]
    assert all(0 < int(seen.sum()) < len(store) for _, seen in shares)  # each process did part of it
    assert torch.equal(shares[0][1] + shares[1][1], torch.ones(len(store)))
    torch.testing.assert_close(shares[0][0] + shares[1][0], whole, rtol=1e-5, atol=1e-4)
    assert (whole < 0).all()


def test_settings_are_checked_when_the_config_loads():
    from lmforge.config import load_config

    for recipe, message in (({"beta": 0}, "recipe.beta must be > 0.*nothing is learnt"),
                            ({"beta": -0.1}, "recipe.beta must be > 0"),
                            ({"label_smoothing": 0.5}, "recipe.label_smoothing must be >= 0 and < 0.5"),
                            ({"rpo_alpha": -1}, "recipe.rpo_alpha must be >= 0"),
                            ({"reference": "online"}, "recipe.reference must be precompute or live"),
                            ({"format": "csv"}, "recipe.format must be auto or one of plain")):
        with pytest.raises(LMForgeError, match=message):
            load_config(values={"kind": "dpo", "recipe": recipe})


def test_bad_input_is_refused_before_any_compute(tool_sft, prefs, tmp_path):
    from lmforge.train import train

    with pytest.raises(LMForgeError, match="set training.init_from"):
        train(dpo_config(tmp_path, prefs, ""))
    with pytest.raises(LMForgeError, match="data.train_path=.*missing.jsonl does not exist"):
        train(dpo_config(tmp_path, tmp_path / "missing.jsonl", tool_sft.checkpoint))
    no_rejected = tmp_path / "no_rejected.jsonl"
    rows = (prefs / "val.jsonl").read_text().splitlines()[:3]
    broken = json.loads(rows[1])
    del broken["rejected"]
    no_rejected.write_text("\n".join([rows[0], json.dumps(broken), rows[2]]) + "\n")
    with pytest.raises(LMForgeError, match="no_rejected.jsonl:2.*no 'rejected' field"):
        train(dpo_config(tmp_path, no_rejected, tool_sft.checkpoint))

    # a reference with another vocabulary: another tokenizer, and a model sized for it
    other_tok = tmp_path / "other_tok"
    train_tokenizer(["another corpus entirely, with other merges"] * 20, vocab_size=300, out_dir=other_tok,
                    show_progress=False)
    sft_model = load_model(tool_sft.checkpoint)
    other = tmp_path / "other_vocab"
    from lmforge.models.gpt import GPT

    config = sft_model.config
    config.vocab_size = Tokenizer.load(other_tok).vocab_size
    GPT(config).save_pretrained(other)
    Tokenizer.load(other_tok).save(other)
    with pytest.raises(LMForgeError, match=r"recipe.reference_path=.*other_vocab has a vocabulary of \d+ tokens, the "
                                           r"policy 1024.*policy's tokenizer"):
        train(dpo_config(tmp_path, prefs, tool_sft.checkpoint, {"reference_path": str(other)}))
    # the same vocabulary size, another tokenizer: the ids would mean other tokens
    retokenized = tmp_path / "retokenized"
    load_model(tool_sft.checkpoint).save_pretrained(retokenized)
    Tokenizer.load(other_tok).save(retokenized)
    with pytest.raises(LMForgeError, match="retokenized was trained with another tokenizer"):
        train(dpo_config(tmp_path, prefs, tool_sft.checkpoint, {"reference_path": str(retokenized)}))
    assert not (tmp_path / "runs").exists()  # nothing was started


def test_reference_path_names_the_reference(tool_sft, prefs, tmp_path):
    """Rewards are measured against recipe.reference_path (here the untrained base model, far below the
    sft model on every reply), else against training.init_from; the same in both reference modes."""
    from lmforge.train import train

    data = tmp_path / "pairs"
    data.mkdir()
    lines = (prefs / "train.jsonl").read_text().splitlines(keepends=True)
    (data / "train.jsonl").write_text("".join(lines[:16]))
    (data / "val.jsonl").write_text("".join(lines[16:24]))
    figures = {}
    for name, recipe in (("init", {}), ("base_live", {"reference": "live", "reference_path": str(tool_sft.base)}),
                         ("base_precompute", {"reference_path": str(tool_sft.base)})):
        cfg = dpo_config(tmp_path, data, tool_sft.checkpoint, recipe, max_steps=1, eval_interval=1, lr=1e-5)
        cfg.name = name
        figures[name] = train(cfg).eval_metrics
    assert abs(figures["init"]["eval/rewards/chosen"]) < 0.1  # one tiny step from its own reference
    assert figures["base_live"]["eval/rewards/chosen"] > 5  # beta x the nats the sft model gained over base
    for key, value in figures["base_live"].items():
        assert figures["base_precompute"][key] == pytest.approx(value, rel=1e-4, abs=1e-4), key


@pytest.mark.parametrize("reference", ["precompute", "live"])
def test_resume_is_exact(tool_sft, prefs, tmp_path, reference):
    """6 steps straight vs 3 + resume + 3: identical weights, with either kind of reference."""
    from safetensors.torch import load_file

    from lmforge.train import train

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join((prefs / "train.jsonl").read_text().splitlines(keepends=True)[:40]))
    common = {"max_steps": 6, "save_interval": 3, "micro_batch_size": 2}
    straight = dpo_config(tmp_path, data, tool_sft.checkpoint, {"reference": reference}, **common)
    straight.name = "straight"
    train(straight)
    runs = tmp_path / "runs"
    (runs / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(runs / "straight" / "checkpoints" / "step-000003", runs / "resumed" / "checkpoints" / "step-000003")
    again = dpo_config(tmp_path, data, tool_sft.checkpoint, {"reference": reference}, **common)
    again.name = "resumed"
    assert train(again, resume=True).step == 6
    wa = load_file(str(runs / "straight" / "checkpoints" / "step-000006" / "model.safetensors"))
    wb = load_file(str(runs / "resumed" / "checkpoints" / "step-000006" / "model.safetensors"))
    assert set(wa) == set(load_file(str(Path(tool_sft.checkpoint) / "model.safetensors")))  # no reference inside
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], v) for k, v in load_file(str(Path(tool_sft.checkpoint) / "model.safetensors")).items())


@pytest.mark.parametrize("reference", ["precompute", "live"])
def test_sharded_on_two_processes_matches_replicated(tool_sft, prefs, tmp_path, reference):
    """training.parallel=fsdp: the policy sharded, and the reference too (live, called in each micro-batch's
    loss) or only its log-probs (precompute); the same losses, held-out DPO figures and weights as DDP, half
    the state (and of the live reference) per process. Never more than one model's full weights at once:
    the reference whole before training (scoring every pair, or the held-out ones when live), then the
    policy alone for evaluation."""
    import yaml

    data = tmp_path / "pairs"
    data.mkdir()
    for split, n in (("train", 40), ("val", 10)):
        lines = (prefs / f"{split}.jsonl").read_text().splitlines(keepends=True)[:n]
        (data / f"{split}.jsonl").write_text("".join(lines))
    cfg = dpo_config(tmp_path, data, tool_sft.checkpoint, {"reference": reference}, max_steps=4, micro_batch_size=2,
                     eval_interval=2, save_interval=2, log_interval=1)
    recipe = tmp_path / "dpo.yaml"
    recipe.write_text(yaml.safe_dump(cfg.to_dict()))
    rows = sharded_against_replicated(recipe, tmp_path / "runs", frozen=reference == "live")
    evals = [r for r in rows["fsdp"] if "eval/rewards/accuracy" in r]
    assert [r["step"] for r in evals] == [2, 4] and evals[-1]["eval/rewards/margin"] != 0
    # the policy and its reference have the same shape: each is one model's weights (fp32 on the CPU)
    one_model = weight_mb(tool_sft.checkpoint)
    gathered = [(r["step"], r.get("train/gathered_mb")) for r in rows["fsdp"] if "train/loss" in r]
    assert gathered[0][0] == 1 and all(mb == pytest.approx(one_model, rel=1e-6) for _, mb in gathered), gathered


# ---- a real run ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dpo_run(tool_sft, prefs, tmp_path_factory):
    from lmforge.train import train

    tmp_path = tmp_path_factory.mktemp("dpo")
    cfg = dpo_config(tmp_path, prefs, tool_sft.checkpoint, max_steps=80, eval_interval=40, log_interval=10)
    result = train(cfg)
    return result


def preference_accuracy(policy, reference, store) -> float:
    """Held-out implicit-reward accuracy: the share of pairs whose chosen reply gained more log-prob
    over the reference than the rejected one (a tie counts half)."""
    gains = torch.zeros(len(store), 2)
    with torch.no_grad():
        for batch in PackedPairs(store, SEQ_LEN, 8, shuffle=False).iter_eval_batches():
            gains[batch["pair_index"]] = pair_logps(policy, batch) - pair_logps(reference, batch)
    margin = gains[:, 0] - gains[:, 1]
    return float(((margin > 0).float() + 0.5 * (margin == 0).float()).mean())


def test_dpo_run_ranks_held_out_pairs_better(dpo_run, tool_sft, prefs):
    store = render_pairs(tool_sft.tokenizer, read_preferences(prefs / "test.jsonl"), SEQ_LEN)
    assert len(store) >= 80
    reference = load_model(tool_sft.checkpoint).eval()
    assert preference_accuracy(load_model(tool_sft.checkpoint).eval(), reference, store) == 0.5  # the start
    after = preference_accuracy(load_model(dpo_run.best_checkpoint).eval(), reference, store)
    assert after >= 0.62, after

    rows = [json.loads(line) for line in (dpo_run.run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in evals] == [40, 80]
    for key in ("eval/rewards/chosen", "eval/rewards/rejected", "eval/rewards/margin", "eval/rewards/accuracy",
                "eval/logps/chosen", "eval/logps/rejected"):
        assert all(math.isfinite(r[key]) for r in evals), key
    assert evals[-1]["eval/rewards/margin"] > 0 and evals[-1]["eval/loss"] < math.log(2)
    train_rows = [r for r in rows if "train/loss" in r]
    assert len(train_rows) == 8 and all("train/logps/chosen" in r and "train/rewards/accuracy" in r for r in train_rows)
    # the tokenizer (with its chat template) travels with the checkpoint, for serve and export
    assert Tokenizer.load(dpo_run.best_checkpoint).sha256 == tool_sft.tokenizer.sha256
