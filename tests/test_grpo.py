"""The grpo kind: its loss against a hand computation, the rollout loader against direct forwards and
across a resume, a real run from the tiny sft model that raises the held-out reward, exact resume in
the middle of a rollout through the training loop, and its `lmforge eval`."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

from lmforge.errors import LMForgeError
from lmforge.models.losses import IGNORE_INDEX
from lmforge.posttrain.logprobs import token_logprobs
from lmforge.posttrain.rewards import load_rewards
from lmforge.posttrain.rollout import encode_prompts, group_advantages, read_prompt_rows
from lmforge.recipes.grpo.data import GRPOSettings, Rollouts
from lmforge.recipes.grpo.loss import grpo_loss, policy_loss
from tests.train_helpers import sharded_against_replicated, weight_mb

EPS = 0.2
BETA = 0.1


def hand_batch() -> dict:
    """One row: a prompt position, then three completion tokens."""
    logp = torch.log(torch.tensor([[0.0 + 1.0, 0.5, 0.3, 0.2]]))  # position 0 is the prompt's (unscored)
    return {
        "labels": torch.tensor([[IGNORE_INDEX, 7, 8, 9]]),
        "logp": logp,
        "old_logprobs": torch.log(torch.tensor([[1.0, 0.4, 0.5, 0.2]])),
        "ref_logprobs": torch.log(torch.tensor([[1.0, 0.25, 0.3, 0.4]])),
        "advantages": torch.tensor([[0.0, 1.0, -2.0, 0.5]]),
        "loss_weights": torch.tensor([[0.0, 1 / 3, 1 / 3, 1 / 3]]),
    }


def test_grpo_loss_equals_the_formula_by_hand():
    b = hand_batch()
    logp = b["logp"].clone().requires_grad_(True)
    loss, metrics = policy_loss(logp, b, {"epsilon": EPS, "epsilon_high": EPS, "beta": BETA})
    # token 1: ratio 0.5 / 0.4 = 1.25 > 1.2 with A = 1: clipped, -1.2
    # token 2: ratio 0.3 / 0.5 = 0.6 < 0.8 with A = -2: clipped, -(0.8 x -2) = 1.6
    # token 3: ratio 1, A = 0.5: -0.5
    # k3 = exp(r) - r - 1, r = log(ref / p): 0.5 - ln 0.5 - 1, 0, 2 - ln 2 - 1
    k3 = [0.5 - math.log(0.5) - 1, 0.0, 2 - math.log(2) - 1]
    want = (-1.2 + BETA * k3[0] + 1.6 + BETA * k3[1] - 0.5 + BETA * k3[2]) / 3
    assert loss.item() == pytest.approx(want, abs=1e-6)
    assert float(metrics["clip_frac"]) == pytest.approx(2 / 3)
    assert float(metrics["kl"]) == pytest.approx(sum(k3) / 3, abs=1e-6)
    loss.backward()
    # clipped tokens get no policy gradient, only the KL's: beta * (1 - ref / p) * weight
    kl_grad = [BETA * (1 - 0.25 / 0.5) / 3, BETA * (1 - 1.0) / 3, BETA * (1 - 0.4 / 0.2) / 3]
    assert logp.grad[0, 1:].tolist() == pytest.approx([kl_grad[0], kl_grad[1], -0.5 / 3 + kl_grad[2]], abs=1e-6)
    assert float(logp.grad[0, 0]) == 0.0
    # on-policy (no old log-probs in the batch): ratio 1, the gradient of -A log p (weighted)
    del b["old_logprobs"]
    logp = b["logp"].clone().requires_grad_(True)
    loss, metrics = policy_loss(logp, b, {"epsilon": EPS, "epsilon_high": EPS, "beta": 0.0})
    assert loss.item() == pytest.approx((-1.0 + 2.0 - 0.5) / 3) and "kl" not in metrics
    loss.backward()
    assert logp.grad[0, 1:].tolist() == pytest.approx([-1 / 3, 2 / 3, -0.5 / 3])
    # DAPO's clip-higher lets token 1's ratio reach 1.25 before clipping
    loss, metrics = policy_loss(b["logp"], {**b, "old_logprobs": hand_batch()["old_logprobs"]},
                                {"epsilon": EPS, "epsilon_high": 0.3, "beta": 0.0})
    assert float(loss) == pytest.approx((-1.25 + 1.6 - 0.5) / 3) and float(metrics["clip_frac"]) == pytest.approx(1 / 3)


@pytest.fixture(scope="module")
def setup(tool_sft):
    from lmforge.device import setup_device
    from lmforge.models import load_model

    policy = load_model(tool_sft.checkpoint).train()
    reference = load_model(tool_sft.base).eval()  # another model than the policy: its log-probs differ
    rows = read_prompt_rows(tool_sft.data / "train.jsonl")[:24]
    prompts, _ = encode_prompts(tool_sft.tokenizer, rows, 512 - 24)
    return policy, reference, prompts, setup_device("cpu", "fp32", 1e12)


def make_loader(tool_sft, setup, **overrides):
    policy, reference, prompts, devinfo = setup
    settings = GRPOSettings(**{"group_size": 4, "prompts_per_rollout": 3, "max_new_tokens": 24, "temperature": 0.8,
                               "beta": 0.1, "iterations": 2, **overrides})
    loader = Rollouts(prompts, tool_sft.tokenizer, load_rewards(["tool_call"]), settings, seq_len=512,
                      micro_batch_size=4, grad_accum_steps=1, seed=5)
    loader.bind(policy, devinfo, reference)
    return loader


def alone(model, prompt, completion, temperature):
    """A sequence's completion log-probs from a forward over it alone (no packing)."""
    ids = torch.tensor([prompt + completion])
    batch = {"input_ids": ids[:, :-1], "labels": torch.tensor([[IGNORE_INDEX] * (len(prompt) - 1) + completion])}
    with torch.no_grad():
        return token_logprobs(model.eval(), batch, temperature=temperature)[0, len(prompt) - 1:]


def test_rollout_batches_carry_old_and_reference_logprobs_and_advantages(tool_sft, setup):
    policy, reference, prompts, _ = setup
    loader = make_loader(tool_sft, setup)
    batch = loader.next_batch()
    assert policy.training  # sampling and scoring left the model as the loop had it
    buf = loader.buffer
    assert loader.batches_per_rollout == 3 and len(buf["completions"]) == 12
    for i, completion in enumerate(buf["completions"]):  # the rollout's log-probs are direct forwards'
        prompt = prompts.ids[buf["prompts"][i]]
        assert buf["old_logprobs"][i] == pytest.approx(alone(policy, prompt, completion, 0.8).tolist(), abs=1e-5)
        assert buf["ref_logprobs"][i] == pytest.approx(alone(reference, prompt, completion, 0.8).tolist(), abs=1e-5)
        assert completion[-1] == tool_sft.tokenizer.eos_id if buf["ended"][i] else len(completion) == 24
    policy.train()
    # advantages: each completion's tool_call reward against its group of 4 (same prompt)
    texts = [tool_sft.tokenizer.decode([t for t in c if t != tool_sft.tokenizer.eos_id]) for c in buf["completions"]]
    rewards = load_rewards(["tool_call"]).score([prompts.rows[p] for p in buf["prompts"]], texts)[:, 0]
    assert rewards.tolist() == pytest.approx([r[0] for r in buf["rewards"]])
    advantages = group_advantages(rewards, 4)
    batches = [batch] + [loader.next_batch() for _ in range(5)]  # 3 micro-batches, twice (iterations=2)
    assert loader.drawn == 1
    for b in batches[:3]:
        scored = b["labels"] != IGNORE_INDEX
        for s in range(b["num_examples"]):
            where = scored & (b["sequence_ids"] == s)
            i = int(np.flatnonzero([c == b["labels"][where].tolist() for c in buf["completions"]])[0])
            assert torch.allclose(b["advantages"][where], torch.tensor(float(advantages[i])))
            assert b["old_logprobs"][where].tolist() == pytest.approx(buf["old_logprobs"][i])
        # token aggregation: a step's weights add up to one mean over its completion tokens
        assert float((b["loss_weights"] * scored).sum()) == pytest.approx(1.0)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(batches[:3], batches[3:]))
    loss, metrics = grpo_loss(policy, batches[0])
    assert torch.isfinite(loss) and float(metrics["clip_frac"]) == 0.0 and float(metrics["kl"]) > 0
    assert {"reward", "reward_std", "frac_zero_std", "reward/tool_call", "entropy", "eos_rate",
            "completion_len", "completion_len_max"} <= set(metrics)
    loader.next_batch()
    assert loader.drawn == 2  # the seventh micro-batch comes from a new rollout


def test_loader_resumes_in_the_middle_of_a_rollout(tool_sft, setup):
    a = make_loader(tool_sft, setup, iterations=1)
    a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))  # what the trainer_state.json holds
    b = make_loader(tool_sft, setup, iterations=1)
    b.load_state_dict(state)
    for _ in range(4):  # the rest of the rollout, then the next one (sampled again, the same)
        x, y = a.next_batch(), b.next_batch()
        for key in ("input_ids", "labels", "advantages", "loss_weights", "ref_logprobs"):
            assert torch.equal(x[key], y[key]), key
        assert "old_logprobs" in x  # the rollout spans 3 optimizer steps: the later ones are off-policy
    with pytest.raises(LMForgeError, match="3 prompts x 4 completions, this run's .* is 2 x 6"):
        make_loader(tool_sft, setup, prompts_per_rollout=2, group_size=6).load_state_dict(state)


def grpo_config(tool_sft, out, name, **training):
    from lmforge.config import load_config

    return load_config(values={
        "kind": "grpo", "name": name, "out_dir": str(out), "seed": 0,
        "data": {"train_path": str(tool_sft.data), "seq_len": 512},
        "recipe": {"rewards": [{"name": "tool_call"}], "group_size": 8, "prompts_per_rollout": 4,
                   "max_new_tokens": 48, "temperature": 0.7, "beta": 0.04},
        "training": {"init_from": str(tool_sft.checkpoint), "max_steps": 30, "micro_batch_size": 32, "lr": 1e-4,
                     "warmup_steps": 0, "schedule": "constant", "weight_decay": 0.0, "eval_interval": 0,
                     "eval_batches": 0, "save_interval": 0, "log_interval": 5, "device": "cpu", "precision": "fp32",
                     "peak_flops": 1e12, **training},
        "logging": {"tensorboard": False, "progress_bar": False}})


@pytest.fixture(scope="module")
def grpo_run(tool_sft, tmp_path_factory):
    from lmforge.train import train

    out = tmp_path_factory.mktemp("grpo")
    result = train(grpo_config(tool_sft, out, "grpo"))
    return out / "grpo", result


def test_grpo_raises_the_held_out_reward_of_the_sft_model(tool_sft, grpo_run):
    """The reward of greedy replies to test.jsonl's prompts (never trained on; val.jsonl is the run's own
    held-out set), before and after 30 GRPO steps. Measured: 0.123 before, 0.22-0.245 after (seeds 0-2)."""
    from lmforge.recipes.grpo.cli import score_checkpoint

    run, result = grpo_run
    rows = read_prompt_rows(tool_sft.data / "test.jsonl")
    rewards = load_rewards(["tool_call"])
    before = score_checkpoint(str(tool_sft.checkpoint), rows, rewards, 48, 64, "cpu")
    after = score_checkpoint(str(run / "checkpoints" / "best"), rows, rewards, 48, 64, "cpu")
    print(f"held-out tool_call reward: sft {before['reward']:.3f}, grpo {after['reward']:.3f}")
    assert after["reward"] > before["reward"] + 0.05
    assert after["eos_rate"] > before["eos_rate"]  # it learnt to close its calls
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in logged if "train/reward" in r]
    for key in ("train/kl", "train/clip_frac", "train/entropy", "train/reward_std", "train/frac_zero_std",
                "train/reward/tool_call", "train/eos_rate", "train/completion_len", "train/completion_len_max"):
        assert all(math.isfinite(r[key]) for r in train_rows), key
    assert train_rows[-1]["train/kl"] > 0
    assert result.eval_metrics["eval/reward"] == pytest.approx(result.eval_metrics["eval/reward/tool_call"])
    assert result.eval_metrics["eval/loss"] == pytest.approx(-result.eval_metrics["eval/reward"])


def test_eval_cli_scores_a_checkpoint_against_the_model_before_fine_tuning(tool_sft, grpo_run, capsys):
    """The same options as the sft kind's eval: the run's init_from is the baseline unless --baseline
    names another or --no-baseline; --max-new-tokens bounds the replies."""
    from lmforge.cli import main

    run, _ = grpo_run
    common = ["--rewards", "tool_call,exact_match", "--prompts", str(tool_sft.data), "--limit", "12", "--json",
              "--device", "cpu"]
    assert main(["eval", str(run), *common]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(figures) == {"checkpoint", "before fine-tuning"}  # the run's training.init_from, found alone
    assert figures["checkpoint"]["rows"] == 12
    assert set(figures["checkpoint"]) >= {"reward", "reward/tool_call", "reward/exact_match", "eos_rate"}
    assert main(["eval", str(run), *common, "--baseline", str(run), "--max-new-tokens", "1"]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert figures["checkpoint"] == figures["before fine-tuning"]  # the same model, scored twice
    assert figures["checkpoint"]["eos_rate"] < 1  # one token: no room for a reply and its eos
    assert main(["eval", str(run), *common, "--no-baseline"]) == 0
    assert set(json.loads(capsys.readouterr().out.strip().splitlines()[-1])) == {"checkpoint"}
    assert main(["eval", str(run), *common, "--max-new-tokens", "0"]) != 0
    assert "--max-new-tokens must be >= 1, got 0" in capsys.readouterr().err
    assert main(["eval", str(run), "--rewards", "no_such_reward", "--prompts", str(tool_sft.data)]) != 0
    assert "unknown reward function 'no_such_reward'" in capsys.readouterr().err


def test_grpo_resume_in_the_middle_of_a_rollout_is_exact(tool_sft, tmp_path):
    """A rollout of 16 completions in micro-batches of 8, used twice: 4 steps per rollout. 6 steps straight
    vs 3 (mid-rollout) + resume + 3: identical weights."""
    from safetensors.torch import load_file

    from lmforge.train import train

    common = {"max_steps": 6, "save_interval": 3, "micro_batch_size": 8}
    recipe = {"prompts_per_rollout": 2, "group_size": 8, "iterations": 2, "max_new_tokens": 16}
    cfg = grpo_config(tool_sft, tmp_path, "straight", **common)
    cfg.recipe = GRPOSettings(**{**cfg.recipe.__dict__, **recipe})
    cfg.model.resid_pdrop = 0.1  # dropout on: the RNG must resume too
    train(cfg)
    runs = tmp_path
    state = json.loads((runs / "straight" / "checkpoints" / "step-000003" / "trainer_state.json").read_text())
    assert state["data"]["handed"] == 3 and state["data"]["buffer"]["old_logprobs"]  # mid-rollout, buffer saved
    (runs / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(runs / "straight" / "checkpoints" / "step-000003", runs / "resumed" / "checkpoints" / "step-000003")
    again = grpo_config(tool_sft, tmp_path, "resumed", **common)
    again.recipe = GRPOSettings(**{**again.recipe.__dict__, **recipe})
    again.model.resid_pdrop = 0.1
    assert train(again, resume=True).step == 6
    wa = load_file(str(runs / "straight" / "checkpoints" / "step-000006" / "model.safetensors"))
    wb = load_file(str(runs / "resumed" / "checkpoints" / "step-000006" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    start = load_file(str(tool_sft.checkpoint / "model.safetensors"))
    assert any(not torch.equal(wa[k], start[k]) for k in wa)  # and training moved them


def test_sharded_on_two_processes_draws_rollouts_as_replicated(tool_sft, tmp_path):
    """training.parallel=fsdp: each rollout (the first before any training step, the second after two
    updates) is sampled on the weights gathered on every process, so both processes draw what DDP's
    draw: the same rewards, losses, held-out rewards and weights, with half the state per process. The
    reward is a reward model's score (a random head on the sft trunk), so it varies within each group
    and the policy moves between the two rollouts."""
    import yaml

    from lmforge.models import load_model
    from lmforge.models.reward import RewardModel, reward_config_from

    torch.manual_seed(0)
    policy = load_model(tool_sft.checkpoint)
    scorer = RewardModel(reward_config_from(policy.config))
    scorer.load_initial_weights(policy, "the sft model")
    scorer.save_pretrained(tmp_path / "rm")
    tool_sft.tokenizer.save(tmp_path / "rm")
    cfg = grpo_config(tool_sft, tmp_path / "runs", "grpo", max_steps=4, micro_batch_size=4, eval_interval=2,
                      eval_batches=1, save_interval=2, log_interval=1, lr=1e-3)
    cfg.recipe = GRPOSettings(**{**cfg.recipe.__dict__, "prompts_per_rollout": 2, "group_size": 4,
                                 "max_new_tokens": 16, "eval_max_new_tokens": 16,
                                 "rewards": [f"reward_model:{tmp_path / 'rm'}"]})
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text(yaml.safe_dump(cfg.to_dict()))
    rows = sharded_against_replicated(recipe, tmp_path / "runs", frozen=True)  # the reference, the reward model
    logged = {n: [r for r in rows[n] if "train/reward" in r] for n in ("ddp", "fsdp")}
    assert [r["step"] for r in logged["fsdp"]] == [1, 2, 3, 4]
    for key in ("train/reward", "train/reward_std", "train/completion_len", "train/grad_norm"):
        assert [r[key] for r in logged["fsdp"]] == pytest.approx([r[key] for r in logged["ddp"]], rel=1e-4), key
    first, second = logged["fsdp"][0], logged["fsdp"][2]  # steps 1-2 train on rollout 1, steps 3-4 on rollout 2
    assert first["train/reward_std"] > 0 and first["train/grad_norm"] > 0  # the policy moved before rollout 2
    assert second["train/reward"] != first["train/reward"]
    assert [r["step"] for r in rows["fsdp"] if "eval/reward" in r] == [2, 4]
    # A rollout gathers one model at a time (the policy to sample, the reward model, the reference), not all
    models = [weight_mb(tmp_path / "runs" / "fsdp" / "checkpoints" / "best"), weight_mb(tmp_path / "rm"),
              weight_mb(tool_sft.checkpoint)]
    gathered = [r["train/gathered_mb"] for r in rows["fsdp"] if "train/gathered_mb" in r]
    assert gathered and gathered[-1] == pytest.approx(max(models), rel=1e-6), (gathered, models)


def test_grpo_settings_are_checked_before_compute(tool_sft, tmp_path):
    from lmforge.config import load_config
    from lmforge.train import train

    with pytest.raises(LMForgeError, match="recipe.group_size must be >= 2"):
        load_config(values={"kind": "grpo", "recipe": {"group_size": 1}})
    with pytest.raises(LMForgeError, match="recipe.temperature must be > 0"):
        load_config(values={"kind": "grpo", "recipe": {"temperature": 0}})
    with pytest.raises(LMForgeError, match="loss_aggregation"):
        load_config(values={"kind": "grpo", "recipe": {"loss_aggregation": "mean"}})
    with pytest.raises(LMForgeError, match="whole optimizer steps"):
        train(grpo_config(tool_sft, tmp_path, "odd", micro_batch_size=12))
    with pytest.raises(LMForgeError, match="training.init_from"):
        train(grpo_config(tool_sft, tmp_path, "scratch", init_from=""))
    assert not tmp_path.joinpath("odd").exists() and not tmp_path.joinpath("scratch").exists()
