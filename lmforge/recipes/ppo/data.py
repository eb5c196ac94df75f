"""The ppo kind's data: prompts, and the train loader that turns them into rollouts of the live policy.

``PPORollouts`` draws ``prompts_per_rollout`` prompts (this process's share) and samples one reply to
each with the policy being trained (``lmforge.posttrain.rollout.sample``, one seed per reply). It
scores each reply (a reward model, reward functions, or both; minus ``missing_eos_penalty`` for a
reply that never ended), takes the sampling policy's log-probs from the sampler (they are kept as the
tokens are drawn), runs two no-grad passes over the rollout — the frozen reference's log-probs, the
value model's values — and turns them into per-token rewards
(``-kl_coef`` x the KL estimate on every token, the score on the last), advantages (GAE, whitened
over the rollout) and returns. It then hands the rollout out as micro-batches of
``training.micro_batch_size`` replies, ``ppo_epochs`` times in fresh orders, and draws the next one.

Its state holds the prompt order, the rollout counter and the current rollout itself (JSON-able
lists), so a run resumed in the middle of a rollout continues with exactly the batches it would have
had. The held-out loader answers held-out prompts greedily and scores them the same way:
``eval/reward`` picks ``checkpoints/best``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.errors import LMForgeError
from lmforge.models.gpt import GPTConfig
from lmforge.models.losses import IGNORE_INDEX
from lmforge.posttrain.init import (
    chat_tokenizer,
    check_reference,
    init_tokenizer_path,
    rows_path,
)
from lmforge.posttrain.rewards import REWARD_MODEL_PREFIX, Rewards, load_rewards
from lmforge.posttrain.rollout import (
    PROMPT_ROWS,
    HeldOutPrompts,
    PromptOrder,
    Prompts,
    completion_seed,
    encode_prompts,
    pack_sequences,
    per_sequence,
    read_prompt_splits,
    row_length,
    sample,
)
from lmforge.recipes import ModelHost, TrainData
from lmforge.recipes.ppo.loss import gae, token_rewards, whiten
from lmforge.recipes.ppo.model import actor_critic_config
from lmforge.train.distributed import DistInfo


@dataclass
class PPOSettings:
    """Training settings of the ppo kind (config section ``recipe``). Defaults follow TRL's PPO."""

    reward_model: str = ""  # a reward-kind checkpoint or run: each reply's score, and the value model's start
    rewards: list[Any] = field(default_factory=list)  # reward functions (names or {name, weight, label}), added
    prompts_per_rollout: int = 16  # replies per rollout and process (one per prompt)
    ppo_epochs: int = 4  # passes over each rollout (seed 004's --ppo-epochs 4)
    max_new_tokens: int = 64
    temperature: float = 1.0  # sampling temperature (the log-probs are of this distribution)
    top_p: float = 1.0
    top_k: int = 0
    kl_coef: float = 0.05  # per-token KL penalty to the frozen reference, in the reward
    reference: str = ""  # the frozen reference checkpoint; "" = training.init_from
    gamma: float = 1.0  # discount over the reply's tokens
    lam: float = 0.95  # GAE's lambda
    clip: float = 0.2  # clip range of the probability ratio
    clip_value: float = 0.2  # clip range of the value update
    vf_coef: float = 0.1  # weight of the value loss
    missing_eos_penalty: float = 1.0  # subtracted from the score of a reply that hit max_new_tokens
    generation_batch_size: int = 64  # sequences decoded at once
    eval_max_new_tokens: int = 0  # held-out replies' length limit; 0 = max_new_tokens

    def __post_init__(self) -> None:
        for key in ("prompts_per_rollout", "ppo_epochs", "max_new_tokens", "generation_batch_size"):
            if getattr(self, key) < 1:
                raise LMForgeError(f"recipe.{key} must be >= 1, got {getattr(self, key)}")
        if not self.temperature > 0:
            raise LMForgeError(f"recipe.temperature must be > 0, got {self.temperature}: PPO learns from sampled "
                               "replies and their log-probabilities")
        for key in ("kl_coef", "missing_eos_penalty", "vf_coef", "eval_max_new_tokens"):
            if getattr(self, key) < 0:
                raise LMForgeError(f"recipe.{key} must be >= 0, got {getattr(self, key)}")
        for key in ("clip", "clip_value"):
            if not getattr(self, key) > 0:
                raise LMForgeError(f"recipe.{key} must be > 0, got {getattr(self, key)}")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise LMForgeError(f"recipe.gamma and recipe.lam must be in [0, 1], got {self.gamma} and {self.lam}")


class PPORollouts:
    """The ppo kind's train loader (see the module's docstring)."""

    def __init__(self, prompts: Prompts, tokenizer: Any, rewards: Rewards, settings: PPOSettings, seq_len: int,
                 micro_batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        self.prompts, self.tokenizer, self.rewards, self.s = prompts, tokenizer, rewards, settings
        self.seq_len, self.micro_batch_size, self.seed, self.rank = seq_len, micro_batch_size, seed, rank
        self.order = PromptOrder(len(prompts.ids), seed, rank, world_size)
        self.drawn = 0  # rollouts drawn so far
        self.handed = 0  # micro-batches handed out of the current rollout (all its epochs)
        self.buffer: dict[str, Any] | None = None  # the current rollout (JSON-able)
        self.per_epoch = settings.prompts_per_rollout // micro_batch_size
        self.model = self.reference = self.devinfo = None
        self.gathered: Any = ModelHost().gathered

    def bind(self, model: Any, devinfo: Any, reference: Any, gathered: Any = None) -> None:
        """The actor-critic being trained, its device, the frozen reference, and ``ModelHost.gathered``
        (None: a single process)."""
        self.model, self.devinfo, self.reference = model, devinfo, reference
        if gathered is not None:
            self.gathered = gathered

    @property
    def row_len(self) -> int:
        return row_length(self.seq_len, self.devinfo.device if self.devinfo is not None else "cpu")

    @property
    def batches_per_rollout(self) -> int:
        return self.per_epoch * self.s.ppo_epochs

    # ---- drawing a rollout ---------------------------------------------------------------------
    @torch.no_grad()
    def _draw(self) -> None:
        s, tok = self.s, self.tokenizer
        if self.model is None:
            raise RuntimeError("the ppo loader samples from the policy being trained: bind it first")
        policy, value = self.model.policy, self.model.value
        picked = self.order.take(s.prompts_per_rollout)
        seeds = [completion_seed(self.seed, self.rank, self.drawn, j) for j in range(len(picked))]
        # One model's weights at a time (under FSDP, each gathered whole for its part of the rollout)
        with self.gathered(policy):
            done = sample(policy, [self.prompts.ids[p] for p in picked], tok.eos_id, s.max_new_tokens,
                          temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seeds=seeds,
                          batch_size=s.generation_batch_size, logprobs=True)  # the old log-probs, as sampled
        rows = [self.prompts.rows[p] for p in picked]
        raw = self.rewards.score(rows, [tok.decode(c.tokens) for c in done], self.gathered)
        ended = np.asarray([c.ended for c in done])
        scores = self.rewards.total(raw) - s.missing_eos_penalty * ~ended
        completions = [c.tokens + [tok.eos_id] if c.ended else c.tokens for c in done]
        prompts = [self.prompts.ids[p] for p in picked]

        # The two no-grad passes (the sampler kept the old log-probs), over the rollout in micro-batch-sized packs.
        per_seq: dict[str, list[np.ndarray]] = {"old_logprobs": [np.asarray(c.logprobs, np.float32) for c in done],
                                                "ref_logprobs": [], "values": []}
        packs = []
        for start in range(0, len(picked), self.micro_batch_size):
            part = slice(start, start + self.micro_batch_size)
            batch = pack_sequences(prompts[part], completions[part], self.seq_len, row_len=self.row_len)
            packs.append((batch, {k: (v.to(self.devinfo.device) if torch.is_tensor(v) else v)
                                  for k, v in batch.items()}))
        was_training = self.model.training
        self.model.eval()
        try:
            from lmforge.posttrain.logprobs import token_logprobs

            with self.devinfo.autocast():
                with self.gathered(self.reference):
                    for batch, dev in packs:
                        per_seq["ref_logprobs"] += per_sequence(
                            token_logprobs(self.reference, dev, temperature=s.temperature), batch)
                with self.gathered(value):
                    for batch, dev in packs:
                        scored = dev["labels"] != IGNORE_INDEX
                        values = value.scores(dev["input_ids"], position_ids=dev["position_ids"],
                                              document_ids=dev["document_ids"],
                                              keep=scored if scored.device.type == "cpu" else None)
                        per_seq["values"] += per_sequence(values, batch)
        finally:
            self.model.train(was_training)

        # Per-token rewards, GAE and whitening on [N, L] tensors (column j: the j-th reply token).
        lengths = [len(c) for c in completions]
        L = max(lengths)

        def grid(arrays: list[np.ndarray]) -> torch.Tensor:
            out = torch.zeros(len(arrays), L, dtype=torch.float32)
            for i, a in enumerate(arrays):
                out[i, :len(a)] = torch.from_numpy(np.asarray(a, dtype=np.float32))
            return out

        mask = grid([np.ones(n, np.float32) for n in lengths])
        old, ref, values = grid(per_seq["old_logprobs"]), grid(per_seq["ref_logprobs"]), grid(per_seq["values"])
        rewards, kl = token_rewards(torch.from_numpy(scores.astype(np.float32)), old, ref, mask, s.kl_coef)
        advantages, returns = gae(rewards, values, mask, s.gamma, s.lam)
        advantages = whiten(advantages, mask)

        def rows_of(t: torch.Tensor) -> list[list[float]]:
            return [t[i, :n].tolist() for i, n in enumerate(lengths)]

        kl_sum = kl.sum(1)
        generated = np.asarray(lengths) - ended  # the closing eos is not a generated token
        stats = {"score": float(scores.mean()), "reward": float((scores - s.kl_coef * kl_sum.numpy()).mean()),
                 "kl": float(kl_sum.mean()), "non_score_reward": float(-s.kl_coef * kl_sum.mean()),
                 "completion_len": float(generated.mean()), "completion_len_max": float(generated.max()),
                 "eos_rate": float(ended.mean()), "value_mean": float((values * mask).sum() / mask.sum()),
                 "advantage_std": float(((advantages * mask) ** 2).sum() / mask.sum()) ** 0.5}
        stats.update({f"score/{label}": float(raw[:, j].mean()) for j, label in enumerate(self.rewards.labels)})
        self.buffer = {"rollout": self.drawn, "prompts": [int(p) for p in picked], "completions": completions,
                       "old_logprobs": rows_of(old), "values": rows_of(values), "advantages": rows_of(advantages),
                       "returns": rows_of(returns), "stats": stats}
        self.drawn += 1
        self.handed = 0

    # ---- micro-batches ---------------------------------------------------------------------------
    def _micro_batch(self, index: int) -> dict[str, Any]:
        """Micro-batch ``index`` of the current rollout: epoch ``index // per_epoch``, each epoch in its
        own order (from the rollout's number and the epoch)."""
        s, buf = self.s, self.buffer
        epoch, chunk = divmod(index, self.per_epoch)
        order = np.random.default_rng([self.seed, self.rank, buf["rollout"], epoch]).permutation(len(buf["prompts"]))
        members = order[chunk * self.micro_batch_size:(chunk + 1) * self.micro_batch_size].tolist()
        values = {key: [np.asarray(buf[source][i], dtype=np.float32) for i in members]
                  for key, source in (("old_logprobs", "old_logprobs"), ("advantages", "advantages"),
                                      ("returns", "returns"), ("old_values", "values"))}
        batch = pack_sequences([self.prompts.ids[buf["prompts"][i]] for i in members],
                               [buf["completions"][i] for i in members], self.seq_len, values, row_len=self.row_len)
        batch["objective"] = {"temperature": s.temperature, "clip": s.clip, "clip_value": s.clip_value,
                              "vf_coef": s.vf_coef}
        batch["rollout_stats"] = buf["stats"]
        return batch

    def will_draw(self) -> bool:
        """The next ``next_batch()`` samples a new rollout from the policy."""
        return self.buffer is None or self.handed >= self.batches_per_rollout

    def next_batch(self) -> dict[str, Any]:
        if self.will_draw():
            self._draw()
        batch = self._micro_batch(self.handed)
        self.handed += 1
        return batch

    # ---- exact resume ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"order": self.order.state_dict(), "drawn": self.drawn, "handed": self.handed, "buffer": self.buffer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order.load_state_dict(state["order"])
        buffer = state.get("buffer")
        if buffer is not None and len(buffer["prompts"]) != self.s.prompts_per_rollout:
            raise LMForgeError(f"the checkpoint's rollout holds {len(buffer['prompts'])} replies, this run's "
                               f"recipe.prompts_per_rollout is {self.s.prompts_per_rollout}: resume with the settings "
                               "it was written with, or start a new run with training.init_from=CHECKPOINT")
        self.drawn, self.handed, self.buffer = int(state["drawn"]), int(state["handed"]), buffer


def _reward_sources(s: PPOSettings) -> Rewards:
    specs = list(s.rewards)
    if s.reward_model:
        specs.append({"name": REWARD_MODEL_PREFIX + s.reward_model, "label": "reward_model"})
    if not specs:
        raise LMForgeError("ppo needs a reward source: set recipe.reward_model to a reward-kind run (e.g. "
                           "runs/NAME_reward) and/or recipe.rewards to reward functions (e.g. [tool_call])")
    return load_rewards(specs)


def _policy_config(cfg: Any) -> tuple[GPTConfig, Path]:
    from lmforge.checkpoint import resolve_model_dir
    from lmforge.models.base import read_model_config

    init = cfg.training.init_from
    if not init:
        raise LMForgeError("the ppo kind improves a chat model that already follows its chat template: set "
                           "training.init_from to that checkpoint (e.g. the sft run, runs/NAME); it is also the "
                           "frozen KL reference unless recipe.reference names another")
    if not Path(init).exists():
        raise LMForgeError(f"training.init_from={init} does not exist: point it at the checkpoint or run directory "
                           "of the chat model to improve")
    init_dir = resolve_model_dir(init)
    klass, config = read_model_config(init_dir)
    if type(config) is not GPTConfig:
        raise LMForgeError(f"training.init_from={init} holds a {klass.family!r} model; ppo starts from a gpt chat "
                           "model (an sft checkpoint or run)")
    return config, init_dir


def _value_config(s: PPOSettings, tokenizer_file: Path) -> tuple[Any, Path | None]:
    """The reward model's config and directory (the value model starts from it), after checking it
    reads the policy's tokens."""
    if not s.reward_model:
        return None, None
    from lmforge.checkpoint import resolve_model_dir
    from lmforge.infer.loading import find_tokenizer
    from lmforge.models.base import read_model_config
    from lmforge.models.reward import RewardConfig
    from lmforge.tokenizer import require_same_tokenizer

    if not Path(s.reward_model).exists():
        raise LMForgeError(f"recipe.reward_model={s.reward_model} does not exist: point it at a reward-kind run or "
                           "checkpoint (lmforge train kind=reward ...)")
    reward_dir = resolve_model_dir(s.reward_model)
    klass, config = read_model_config(reward_dir)
    if type(config) is not RewardConfig:
        raise LMForgeError(f"recipe.reward_model={s.reward_model} holds a {klass.family!r} model, not a reward model")
    require_same_tokenizer(find_tokenizer(reward_dir), tokenizer_file, s.reward_model)
    return config, reward_dir


def build_ppo_data(cfg, distinfo: DistInfo) -> TrainData:
    """``RecipeSpec.build_data`` of the ppo kind. Prompts read and encoded, reward sources loaded and
    tried on one row, policy, reference and reward model checked — all before any model runs."""

    s: PPOSettings = cfg.recipe
    t = cfg.training
    path = rows_path(cfg, "ppo", "prompts", PROMPT_ROWS)
    rewards = _reward_sources(s)
    if s.prompts_per_rollout % (t.micro_batch_size * t.grad_accum_steps):
        raise LMForgeError(f"recipe.prompts_per_rollout={s.prompts_per_rollout} must split into whole optimizer steps "
                           f"of training.micro_batch_size x grad_accum_steps = {t.micro_batch_size} x "
                           f"{t.grad_accum_steps} replies; choose sizes that divide it")
    policy_config, init_dir = _policy_config(cfg)
    tokenizer_file = init_tokenizer_path(cfg, init_dir, "ppo")
    value_config, reward_dir = _value_config(s, tokenizer_file)
    # The model section: the policy's shape from init_from, the value model's from the reward model.
    cfg.model = actor_critic_config(policy_config, value_config)
    tokenizer = chat_tokenizer(tokenizer_file)
    seq_len = cfg.data.seq_len
    if seq_len > policy_config.n_positions:
        raise LMForgeError(f"data.seq_len={seq_len} is longer than the model's context n_positions="
                           f"{policy_config.n_positions}; lower data.seq_len")
    eval_tokens = s.eval_max_new_tokens or s.max_new_tokens
    if max(s.max_new_tokens, eval_tokens) >= seq_len:
        raise LMForgeError(f"recipe.max_new_tokens={max(s.max_new_tokens, eval_tokens)} leaves no room for a prompt "
                           f"in data.seq_len={seq_len}; raise data.seq_len or lower max_new_tokens")
    reference_dir = check_reference(s.reference or t.init_from, "recipe.reference" if s.reference else
                                    "training.init_from", policy_config, tokenizer_file, seq_len)

    train_rows, val_rows = read_prompt_splits(path, cfg.data.val_fraction, cfg.seed)
    rewards.check(train_rows)
    train, long_train = encode_prompts(tokenizer, train_rows, seq_len - s.max_new_tokens)
    val, long_val = encode_prompts(tokenizer, val_rows, seq_len - eval_tokens)
    if not train.ids:
        raise LMForgeError(f"every prompt of {path} is longer than data.seq_len - recipe.max_new_tokens = "
                           f"{seq_len - s.max_new_tokens} tokens; raise data.seq_len or lower max_new_tokens")
    loader = PPORollouts(train, tokenizer, rewards, s, seq_len, t.micro_batch_size, cfg.seed, distinfo.rank,
                         distinfo.world_size)
    held = (HeldOutPrompts(val, tokenizer, rewards, eval_tokens, s.generation_batch_size, distinfo.rank,
                           distinfo.world_size) if val.ids else None)

    def bind(model: Any, devinfo: Any, host: ModelHost) -> None:
        from lmforge.models import load_model

        # loaded on the CPU: host.frozen puts each on the device (under FSDP, shard by shard)
        reference = host.frozen(load_model(reference_dir).eval().requires_grad_(False))
        rewards.place(devinfo.device, host.frozen)
        loader.bind(model, devinfo, reference, host.gathered)
        if held is not None:
            held.bind(model.policy, host.gathered)

    if distinfo.is_main:
        for split, n in (("train", long_train), ("val", long_val)):
            if n:
                print(f"data: {split}: {n:,} prompts skipped: longer than data.seq_len - max_new_tokens")
        if held is None:
            print("note: no held-out prompts; evaluation is off")
    names = ", ".join(f"{f.label} x{f.weight:g}" for f in rewards.functions)
    value_from = f"the reward model {reward_dir}" if reward_dir else "the policy (no reward model)"
    description = (f"{path}: {len(train.ids):,} prompts, {s.prompts_per_rollout} replies per rollout and process, "
                   f"{s.ppo_epochs} epochs each; reward {names}; value model from {value_from}"
                   + (f"; {len(val.ids):,} held out" if held else ""))
    return TrainData(train=loader, val=held, description=description,
                     examples_per_epoch=len(train.ids) * s.ppo_epochs, tokenizer_path=tokenizer_file,
                     bind_model=bind, eval_loss_reads_model=False)


def prepare_model(model: Any, cfg: Any) -> None:
    """``RecipeSpec.prepare_model``: the value model starts from the reward model (a resumed run then
    loads its own value weights over these)."""
    s: PPOSettings = cfg.recipe
    if s.reward_model:
        from lmforge.checkpoint import resolve_model_dir
        from lmforge.models.reward import RewardModel

        reward_dir = resolve_model_dir(s.reward_model)
        model.init_value(RewardModel.from_pretrained(reward_dir), str(reward_dir))


__all__ = ["PPORollouts", "PPOSettings", "build_ppo_data", "prepare_model"]
