"""What the ppo kind trains: a policy (a gpt-family chat model) and a value model beside it.

The value model is a ``RewardModel`` (a gpt trunk with a scalar head) read at every position: the
expected return from that state on. It starts from the reward model when there is one (it already
knows what scores well), else from the policy's own weights with a fresh head.

A checkpoint of this model is the policy as an ordinary gpt model directory (``config.yaml`` +
``model.safetensors``: every other verb — serve, export, eval, generate, a later pipeline stage — reads
it as it reads an sft checkpoint) with the value model in its ``value/`` subdirectory, which only a
resumed ppo run reads.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmforge.checkpoint import WEIGHTS_FILE, refresh_checksums
from lmforge.errors import LMForgeError
from lmforge.models.base import LMForgeModel
from lmforge.models.gpt import GPT, GPTConfig
from lmforge.models.reward import RewardConfig, RewardModel, reward_config_from

VALUE_DIR = "value"


@dataclass
class ActorCriticConfig:
    """The policy's gpt config and the value model's; the ppo kind fills both from the checkpoints it
    starts from (``training.init_from`` and ``recipe.reward_model``)."""

    policy: GPTConfig = field(default_factory=GPTConfig)
    value: RewardConfig = field(default_factory=RewardConfig)


class ActorCritic(LMForgeModel):
    family = "actor_critic"
    config_class = ActorCriticConfig

    def __init__(self, config: ActorCriticConfig):
        super().__init__(config)
        self.policy = GPT(config.policy)
        self.value = RewardModel(config.value)

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        from lmforge.recipes.ppo.loss import ppo_loss

        return ppo_loss(self, batch)

    # ---- on disk: the policy as a gpt model, the value model beside it ---------------------------
    # Two model directories, where a sharded checkpoint has one set of shards: under FSDP a ppo run
    # writes its step checkpoints gathered (lmforge.train.fsdp).
    one_weights_file = False

    def save_pretrained(self, directory: str | os.PathLike, state_dict: dict[str, torch.Tensor] | None = None,
                        weights: bool = True) -> Path:
        parts: dict[str, Any] = {"policy": None, "value": None}
        if state_dict is not None:  # the full weights gathered from FSDP's shards, keyed policy.* / value.*
            parts = {part: {k[len(part) + 1:]: v for k, v in state_dict.items() if k.startswith(part + ".")}
                     for part in parts}
        directory = self.policy.save_pretrained(directory, parts["policy"], weights)
        self.value.save_pretrained(directory / VALUE_DIR, parts["value"], weights)
        refresh_checksums(directory, [f"{VALUE_DIR}/{WEIGHTS_FILE}"])  # listed in the checkpoint's own
        return directory

    def _check_checkpoint(self, directory: Path) -> None:
        if not (Path(directory) / VALUE_DIR).is_dir():
            raise LMForgeError(f"{directory} has no {VALUE_DIR}/ directory (a ppo checkpoint holds the value model "
                               "there): if it is a ppo run's checkpoint, it is incomplete, so resume from an earlier "
                               "one (--resume runs/NAME/checkpoints/step-NNNNNN); if it is another kind's, start a "
                               "ppo run from it with training.init_from")

    def load_checkpoint_weights(self, directory: Path, device: torch.device | str) -> None:
        self._check_checkpoint(directory)
        self.policy.load_checkpoint_weights(directory, device)
        self.value.load_checkpoint_weights(Path(directory) / VALUE_DIR, device)

    def checkpoint_state(self, directory: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        self._check_checkpoint(directory)
        value = self.value.checkpoint_state(Path(directory) / VALUE_DIR, device)
        return {**{f"policy.{k}": v for k, v in self.policy.checkpoint_state(directory, device).items()},
                **{f"value.{k}": v for k, v in value.items()}}

    def repeated_blocks(self) -> list[torch.nn.Module]:
        return self.policy.repeated_blocks() + self.value.repeated_blocks()

    def load_initial_weights(self, source: LMForgeModel, where: str) -> None:
        """``training.init_from`` is the policy's start (a gpt chat model); the value model starts from
        the policy too, with a fresh head, until ``init_value`` gives it the reward model's weights."""
        if not isinstance(source, GPT):
            raise LMForgeError(f"training.init_from={where} holds a {source.family!r} model; ppo starts from a gpt "
                               "chat model (an sft checkpoint or run)")
        self.policy.load_initial_weights(source, where)
        self.value.load_initial_weights(source, where)

    def init_value(self, reward_model: RewardModel, where: str) -> None:
        self.value.load_initial_weights(reward_model, where)

    # ---- loop hooks --------------------------------------------------------------------------
    def flops_per_token(self, seq_len: int) -> float:
        return self.policy.flops_per_token(seq_len) + self.value.flops_per_token(seq_len)

    def set_activation_checkpointing(self, enabled: bool) -> None:
        self.policy.set_activation_checkpointing(enabled)
        self.value.set_activation_checkpointing(enabled)

    def decays(self, name: str, param: torch.Tensor) -> bool:
        part, _, rest = name.partition(".")
        return (self.policy if part == "policy" else self.value).decays(rest, param)


def actor_critic_config(policy: GPTConfig, value: GPTConfig | RewardConfig | None) -> ActorCriticConfig:
    """The config of a policy with this gpt config, and a value model shaped like ``value`` (the reward
    model's config) or, without one, like the policy. Dropout is off in both: PPO compares the
    log-probs and values of the same tokens before and after an update, and dropout noise would
    read as a change of policy."""
    no_dropout = {"embd_pdrop": 0.0, "resid_pdrop": 0.0, "attn_pdrop": 0.0}
    policy = dataclasses.replace(policy, **no_dropout)
    value_config = reward_config_from(value if value is not None else policy)
    return ActorCriticConfig(policy=policy, value=dataclasses.replace(value_config, **no_dropout))
