"""The grpo kind's data: prompts read from the user's rows, and the loaders that turn them into batches
by sampling from the model being trained.

``Rollouts`` (the train loader) draws ``prompts_per_rollout`` prompts (this process's share), samples
``group_size`` completions of each with the live model (``lmforge.posttrain.rollout.sample``, one
seed per completion), scores them with the reward functions, turns the rewards into group-normalised
advantages, computes the log-probs the update compares against (the sampling policy's when the rollout
is reused, the frozen reference's when ``beta > 0``) and hands the rollout out as micro-batches of
``training.micro_batch_size`` completions, each micro-batch ``iterations`` times; then it draws the
next rollout. Its state holds the prompt order, the rollout counter and the current rollout itself,
so a run resumed in the middle of a rollout continues with exactly the batches it would have had.

The val loader (``lmforge.posttrain.rollout.HeldOutPrompts``) answers held-out prompts greedily with
the same model and scores them with the same reward functions: ``eval/reward`` picks
``checkpoints/best``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lmforge.errors import LMForgeError
from lmforge.posttrain.init import (
    chat_tokenizer,
    check_reference,
    init_model_config,
    init_tokenizer_path,
    rows_path,
)
from lmforge.posttrain.rewards import Rewards, load_rewards
from lmforge.posttrain.rollout import (
    AGGREGATIONS,
    PROMPT_ROWS,
    HeldOutPrompts,
    PromptOrder,
    Prompts,
    completion_seed,
    encode_prompts,
    group_advantages,
    loss_weights,
    pack_sequences,
    read_prompt_splits,
    row_length,
    sample,
    sequence_logprobs,
)
from lmforge.recipes import ModelHost, TrainData
from lmforge.train.distributed import DistInfo


@dataclass
class GRPOSettings:
    """Training settings of the grpo kind (config section ``recipe``)."""

    rewards: list[Any] = field(default_factory=lambda: ["tool_call"])  # names or {name, weight, label}
    group_size: int = 8  # completions sampled per prompt; advantages are relative to the group
    prompts_per_rollout: int = 8  # prompts per rollout, per process
    max_new_tokens: int = 64  # completion length limit
    temperature: float = 1.0  # sampling temperature (the log-probs are of this distribution)
    top_p: float = 1.0
    top_k: int = 0
    beta: float = 0.04  # weight of the KL penalty to the frozen reference; 0 = no reference model at all
    reference: str = ""  # the frozen reference checkpoint; "" = training.init_from
    epsilon: float = 0.2  # clip range of the probability ratio: [1 - epsilon, 1 + epsilon_high]
    epsilon_high: float = 0.0  # 0 = epsilon; larger = DAPO's clip-higher
    iterations: int = 1  # updates per rollout (mu); 1 = on-policy
    scale_rewards: bool = True  # divide advantages by the group's reward std (false = Dr. GRPO)
    loss_aggregation: str = "token"  # token (DAPO) | sequence (original GRPO) | fixed (Dr. GRPO)
    truncation_penalty: float = 0.0  # subtracted from the reward of a completion that never ended (no eos)
    generation_batch_size: int = 64  # sequences decoded at once
    eval_max_new_tokens: int = 0  # held-out replies' length limit; 0 = max_new_tokens

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise LMForgeError(f"recipe.group_size must be >= 2, got {self.group_size}: advantages compare the "
                               "completions of one prompt with each other")
        for key in ("prompts_per_rollout", "max_new_tokens", "iterations", "generation_batch_size"):
            if getattr(self, key) < 1:
                raise LMForgeError(f"recipe.{key} must be >= 1, got {getattr(self, key)}")
        if self.eval_max_new_tokens < 0:
            raise LMForgeError(f"recipe.eval_max_new_tokens must be >= 0, got {self.eval_max_new_tokens}")
        if not self.temperature > 0:
            raise LMForgeError(f"recipe.temperature must be > 0, got {self.temperature}: a group of greedy "
                               "completions would all be the same, and teach nothing")
        if self.beta < 0 or self.epsilon <= 0 or self.epsilon_high < 0 or self.truncation_penalty < 0:
            raise LMForgeError("recipe.beta, truncation_penalty and epsilon_high must be >= 0 and recipe.epsilon > 0 "
                               f"(got beta={self.beta}, epsilon={self.epsilon}, epsilon_high={self.epsilon_high}, "
                               f"truncation_penalty={self.truncation_penalty})")
        if self.loss_aggregation not in AGGREGATIONS:
            raise LMForgeError(f"recipe.loss_aggregation must be one of {', '.join(AGGREGATIONS)}, "
                               f"got {self.loss_aggregation!r}")


class Rollouts:
    """The grpo kind's train loader (see the module's docstring)."""

    def __init__(self, prompts: Prompts, tokenizer: Any, rewards: Rewards, settings: GRPOSettings, seq_len: int,
                 micro_batch_size: int, grad_accum_steps: int, seed: int, rank: int = 0, world_size: int = 1):
        self.prompts, self.tokenizer, self.rewards, self.s = prompts, tokenizer, rewards, settings
        self.seq_len, self.micro_batch_size, self.accum = seq_len, micro_batch_size, grad_accum_steps
        self.seed, self.rank = seed, rank
        self.order = PromptOrder(len(prompts.ids), seed, rank, world_size)
        self.drawn = 0  # rollouts drawn so far
        self.handed = 0  # micro-batches handed out of the current rollout (iterations included)
        self.buffer: dict[str, Any] | None = None  # the current rollout (JSON-able)
        self._batches: list[dict[str, Any]] | None = None  # its micro-batches, built from it
        self.model = self.reference = self.devinfo = None
        self.gathered: Any = ModelHost().gathered
        self.batches_per_rollout = settings.prompts_per_rollout * settings.group_size // micro_batch_size

    def bind(self, model: Any, devinfo: Any, reference: Any = None, gathered: Any = None) -> None:
        """The model being trained, its device, the frozen reference (None: none) and ``ModelHost.gathered``
        (None: a single process)."""
        self.model, self.devinfo, self.reference = model, devinfo, reference
        if gathered is not None:
            self.gathered = gathered

    @property
    def row_len(self) -> int:
        return row_length(self.seq_len, self.devinfo.device if self.devinfo is not None else "cpu")

    # ---- drawing a rollout ---------------------------------------------------------------------
    def _draw(self) -> None:
        s, tok = self.s, self.tokenizer
        if self.model is None:
            raise RuntimeError("the grpo loader samples from the model being trained: bind it first")
        picked = self.order.take(s.prompts_per_rollout)
        prompt_of = [p for p in picked for _ in range(s.group_size)]
        seeds = [completion_seed(self.seed, self.rank, self.drawn, j) for j in range(len(prompt_of))]
        # The sampling policy's log-probs are needed once the policy has moved (a second iteration, or a
        # later optimizer step of the same rollout): the sampler keeps them as it draws.
        needs_old = s.iterations > 1 or self.batches_per_rollout > self.accum
        # One model's weights at a time (under FSDP, each gathered whole for its part of the rollout)
        with self.gathered(self.model):
            done = sample(self.model, [self.prompts.ids[p] for p in prompt_of], tok.eos_id, s.max_new_tokens,
                          temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seeds=seeds,
                          batch_size=s.generation_batch_size, logprobs=needs_old)
        texts = [tok.decode(c.tokens) for c in done]
        scores = self.rewards.score([self.prompts.rows[p] for p in prompt_of], texts, self.gathered)
        self.buffer = {"rollout": self.drawn, "group_size": s.group_size, "prompts": prompt_of,
                       "completions": [c.tokens + [tok.eos_id] if c.ended else c.tokens for c in done],
                       "ended": [c.ended for c in done], "rewards": scores.tolist()}
        if needs_old:
            self.buffer["old_logprobs"] = [c.logprobs for c in done]
        self.drawn += 1
        self.handed = 0
        self._batches = None
        if s.beta > 0:  # the frozen reference's log-probs, on the micro-batches the update will see
            per_seq: list[Any] = [None] * len(prompt_of)
            with self.devinfo.autocast(), self.gathered(self.reference):
                for batch, members in self._build():
                    for i, values in zip(members, sequence_logprobs(self.reference, batch, s.temperature)):
                        per_seq[i] = values.tolist()
            self.buffer["ref_logprobs"] = per_seq

    # ---- micro-batches ---------------------------------------------------------------------------
    def _build(self) -> list[tuple[dict[str, Any], list[int]]]:
        """The current rollout's micro-batches (and the rollout indices of each one's sequences)."""
        s, buf = self.s, self.buffer
        n = len(buf["prompts"])
        rewards = np.asarray(buf["rewards"], dtype=np.float64).reshape(n, -1)
        total = self.rewards.total(rewards) - s.truncation_penalty * ~np.asarray(buf["ended"])
        advantages = group_advantages(total, s.group_size, s.scale_rewards)
        # The groups in a fresh order (from the rollout's number), each group's completions side by
        # side: those in one micro-batch are scored against one copy of their prompt (share_prompts).
        groups = np.random.default_rng([self.seed, self.rank, buf["rollout"]]).permutation(n // s.group_size)
        order = (groups[:, None] * s.group_size + np.arange(s.group_size)).reshape(-1)
        lengths = [len(buf["completions"][i]) for i in range(n)]
        step_size = self.micro_batch_size * self.accum
        weights = np.zeros(n, dtype=np.float32)
        for start in range(0, n, step_size):  # the sequences of one optimizer step share a normaliser
            members = order[start:start + step_size]
            weights[members] = self.accum * loss_weights([lengths[i] for i in members], s.loss_aggregation,
                                                         s.max_new_tokens)
        stats = self._stats(rewards, total, lengths)
        out = []
        for start in range(0, n, self.micro_batch_size):
            members = order[start:start + self.micro_batch_size].tolist()
            values = {"advantages": [np.full(lengths[i], advantages[i], np.float32) for i in members],
                      "loss_weights": [np.full(lengths[i], weights[i], np.float32) for i in members]}
            for key in ("old_logprobs", "ref_logprobs"):
                if key in buf:
                    values[key] = [np.asarray(buf[key][i], dtype=np.float32) for i in members]
            batch = pack_sequences([self.prompts.ids[buf["prompts"][i]] for i in members],
                                   [buf["completions"][i] for i in members], self.seq_len, values,
                                   share_prompts=True, row_len=self.row_len)
            batch["objective"] = {"temperature": s.temperature, "epsilon": s.epsilon,
                                  "epsilon_high": s.epsilon_high or s.epsilon, "beta": s.beta}
            batch["rollout_stats"] = stats
            out.append((batch, members))
        return out

    def _stats(self, rewards: np.ndarray, total: np.ndarray, lengths: list[int]) -> dict[str, float]:
        """What the rollout was like (logged with every step of it): TRL's GRPO figures."""
        groups = total.reshape(-1, self.s.group_size)
        ended = np.asarray(self.buffer["ended"])
        generated = np.asarray(lengths) - ended  # the eos is not counted as a generated token
        stats = {"reward": float(total.mean()), "reward_std": float(groups.std(axis=1).mean()),
                 "frac_zero_std": float((groups.std(axis=1) < 1e-6).mean()),
                 "completion_len": float(generated.mean()), "completion_len_max": float(generated.max()),
                 "eos_rate": float(ended.mean())}
        stats.update({f"reward/{label}": float(rewards[:, j].mean()) for j, label in enumerate(self.rewards.labels)})
        return stats

    def will_draw(self) -> bool:
        """The next ``next_batch()`` samples a new rollout from the model."""
        return self.buffer is None or self.handed >= self.batches_per_rollout * self.s.iterations

    def next_batch(self) -> dict[str, Any]:
        if self.will_draw():
            self._draw()
        if self._batches is None:
            self._batches = [batch for batch, _ in self._build()]
        batch = self._batches[self.handed % self.batches_per_rollout]
        self.handed += 1
        return batch

    # ---- exact resume ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"order": self.order.state_dict(), "drawn": self.drawn, "handed": self.handed, "buffer": self.buffer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order.load_state_dict(state["order"])
        self.drawn, self.handed = int(state["drawn"]), int(state["handed"])
        buffer = state.get("buffer")
        shape = (self.s.prompts_per_rollout, self.s.group_size)
        if buffer is not None and (len(buffer["prompts"]) // buffer["group_size"], buffer["group_size"]) != shape:
            raise LMForgeError(f"the checkpoint's rollout holds {len(buffer['prompts']) // buffer['group_size']} "
                               f"prompts x {buffer['group_size']} completions, this run's recipe.prompts_per_rollout x "
                               f"group_size is {shape[0]} x {shape[1]}: resume with the settings it was written "
                               "with, or start a new run with training.init_from=CHECKPOINT")
        self.buffer, self._batches = buffer, None


def build_grpo_data(cfg, distinfo: DistInfo) -> TrainData:
    """``RecipeSpec.build_data`` of the grpo kind. The rows are read and encoded, the reward functions
    imported and tried on one row, the model, tokenizer and reference checked, all before any model runs."""

    s: GRPOSettings = cfg.recipe
    t = cfg.training
    path = rows_path(cfg, "grpo", "prompts", PROMPT_ROWS)
    if not t.init_from:
        raise LMForgeError("the grpo kind improves a chat model that already follows its chat template: set "
                           "training.init_from to that checkpoint (e.g. the sft run, runs/NAME); it is also the "
                           "frozen KL reference unless recipe.reference names another")
    rewards = load_rewards(s.rewards)
    completions = s.prompts_per_rollout * s.group_size
    if completions % t.micro_batch_size or (completions // t.micro_batch_size) % t.grad_accum_steps:
        raise LMForgeError(f"a rollout of recipe.prompts_per_rollout x group_size = {completions} completions must "
                           f"split into whole optimizer steps of training.micro_batch_size x grad_accum_steps = "
                           f"{t.micro_batch_size} x {t.grad_accum_steps} completions; choose sizes that divide it")
    init_dir = init_model_config(cfg, "grpo")
    tokenizer_file = init_tokenizer_path(cfg, init_dir, "grpo")
    tokenizer = chat_tokenizer(tokenizer_file)
    seq_len = cfg.data.seq_len
    if seq_len > cfg.model.n_positions:
        raise LMForgeError(f"data.seq_len={seq_len} is longer than the model's context model.n_positions="
                           f"{cfg.model.n_positions}; lower data.seq_len")
    eval_tokens = s.eval_max_new_tokens or s.max_new_tokens
    if max(s.max_new_tokens, eval_tokens) >= seq_len:
        raise LMForgeError(f"recipe.max_new_tokens={max(s.max_new_tokens, eval_tokens)} leaves no room for a prompt "
                           f"in data.seq_len={seq_len}; raise data.seq_len or lower max_new_tokens")
    reference_dir = None
    if s.beta > 0:
        reference_dir = check_reference(s.reference or t.init_from, "recipe.reference" if s.reference else
                                        "training.init_from", cfg.model, tokenizer_file, seq_len)

    train_rows, val_rows = read_prompt_splits(path, cfg.data.val_fraction, cfg.seed)
    rewards.check(train_rows)
    train, long_train = encode_prompts(tokenizer, train_rows, seq_len - s.max_new_tokens)
    val, long_val = encode_prompts(tokenizer, val_rows, seq_len - eval_tokens)
    if not train.ids:
        raise LMForgeError(f"every prompt of {path} is longer than data.seq_len - recipe.max_new_tokens = "
                           f"{seq_len - s.max_new_tokens} tokens; raise data.seq_len or lower max_new_tokens")
    loader = Rollouts(train, tokenizer, rewards, s, seq_len, t.micro_batch_size, t.grad_accum_steps, cfg.seed,
                      distinfo.rank, distinfo.world_size)
    held = (HeldOutPrompts(val, tokenizer, rewards, eval_tokens, s.generation_batch_size, distinfo.rank,
                           distinfo.world_size) if val.ids else None)

    def bind(model: Any, devinfo: Any, host: ModelHost) -> None:
        reference = None
        if reference_dir is not None:
            from lmforge.models import load_model

            # loaded on the CPU: host.frozen puts each on the device (under FSDP, shard by shard)
            reference = host.frozen(load_model(reference_dir).eval().requires_grad_(False))
        rewards.place(devinfo.device, host.frozen)
        loader.bind(model, devinfo, reference, host.gathered)
        if held is not None:
            held.bind(model, host.gathered)

    if distinfo.is_main:
        for split, n in (("train", long_train), ("val", long_val)):
            if n:
                print(f"data: {split}: {n:,} prompts skipped: longer than data.seq_len - max_new_tokens")
        if held is None:
            print("note: no held-out prompts; evaluation is off")
    names = ", ".join(f"{f.label} x{f.weight:g}" for f in rewards.functions)
    description = (f"{path}: {len(train.ids):,} prompts, {s.prompts_per_rollout} x {s.group_size} completions per "
                   f"rollout and process, rewards {names}" + (f"; {len(val.ids):,} held out" if held else ""))
    return TrainData(train=loader, val=held, description=description,
                     examples_per_epoch=len(train.ids) * s.group_size * s.iterations,
                     tokenizer_path=tokenizer_file, bind_model=bind,
                     eval_loss_reads_model=False)
