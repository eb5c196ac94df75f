"""A reward model: a gpt-family transformer trunk with a scalar head, trained on preference pairs.

The trunk is ``GPT``'s own modules (token embedding, blocks, final norm), so a chat model's checkpoint
loads into it as it is; its LM head is dropped. ``scores`` gives one scalar per position (what a value
model reads); ``rewards`` reads a packed pair batch's sequences at their last real token
(``batch["last_index"]``, counted by length: in this chat template eos also closes earlier turns, so
the first eos of a sequence is not where it ends); ``forward`` is the Bradley-Terry loss of the pairs.

The reward and ppo kinds train it; grpo can use a trained one as its reward function.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.errors import LMForgeError
from lmforge.models.base import CONFIG_FILE, LMForgeModel
from lmforge.models.gpt import GPT, GPTConfig


@dataclass
class RewardConfig(GPTConfig):
    """The gpt config of the trunk, as it is. A subclass rather than a wrapper: a reward checkpoint's
    ``config.yaml`` reads like the chat model's it came from (the same flat keys, ``family: reward``),
    presets fill sizes the same way, and the trunk is built from it unchanged. Its own type keeps the
    family apart from gpt's (the registry matches config types exactly)."""


class RewardModel(LMForgeModel):
    family = "reward"
    config_class = RewardConfig

    def __init__(self, config: RewardConfig):
        super().__init__(config)
        self.trunk = GPT(config)
        del self.trunk.lm_head  # a reward model never predicts tokens; tied or not, nothing else uses it
        self.head = nn.Linear(config.n_embd, 1)
        # Small random weights (N(0, 1 / (n_embd + 1)), as in Stiennon et al. 2020): the untrained head
        # ranks pairs at chance rather than tying every pair at zero.
        nn.init.normal_(self.head.weight, 0.0, 1.0 / math.sqrt(config.n_embd + 1))
        nn.init.zeros_(self.head.bias)
        # Training settings the kind puts here (the reward kind's `recipe` section, via prepare_model).
        self.use_margin = False
        self.center_rewards_coef = 0.0

    # ---- scoring ------------------------------------------------------------------------------
    def scores(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
               document_ids: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, T]`` fp32 scalars, one per position: the reward of each prefix (a value model's output).
        ``keep`` (``[B, T]`` bool): only those positions are scored, the others are 0 (less work: see
        ``GPT.hidden_states``)."""
        hidden = self.trunk.hidden_states(input_ids, position_ids=position_ids, document_ids=document_ids,
                                          keep=keep)
        if keep is None:
            return self.head(hidden).squeeze(-1).float()
        out = torch.zeros(keep.shape, dtype=torch.float32, device=keep.device)
        out[keep] = self.head(hidden).squeeze(-1).float()
        return out

    def rewards(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[2P]`` fp32 rewards of a pair batch's sequences (chosen, rejected, chosen, ...), each read at
        its last real token: ``batch["last_index"]``, a flat index into the ``B * T`` positions."""
        ids, index = batch["input_ids"], batch["last_index"]
        if ids.device.type == "cpu":  # only the read positions' outputs (GPT.hidden_states' keep)
            keep = torch.zeros(ids.numel(), dtype=torch.bool)
            keep[index] = True
            ordered = self.trunk.hidden_states(ids, position_ids=batch.get("position_ids"),
                                               document_ids=batch.get("document_ids"), keep=keep.view_as(ids))
            last = ordered[torch.searchsorted(index.sort().values, index)]  # back to the sequences' order
        else:
            hidden = self.trunk.hidden_states(ids, position_ids=batch.get("position_ids"),
                                              document_ids=batch.get("document_ids"))
            last = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
        return self.head(last).squeeze(-1).float()

    # ---- training -----------------------------------------------------------------------------
    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        """Bradley-Terry loss ``-log sigmoid(r_chosen - r_rejected - margin)`` averaged over the pairs
        (``margin`` only with ``use_margin``), plus ``center_rewards_coef * mean((r_chosen + r_rejected)^2)``
        when that is set, which keeps the rewards near zero (the loss alone sees only differences)."""
        r = self.rewards(batch)
        chosen, rejected = r[0::2], r[1::2]
        return pair_loss(chosen, rejected, batch["margin"] if self.use_margin else None, self.center_rewards_coef)

    def load_initial_weights(self, source: LMForgeModel, where: str) -> None:
        """From a gpt model (a chat model: its trunk; the head stays freshly initialised) or from another
        reward model (everything)."""
        if isinstance(source, RewardModel):
            theirs, ours, into = source.state_dict(), self.state_dict(), self
        elif isinstance(source, GPT):
            theirs = {k: v for k, v in source.state_dict().items() if not k.startswith("lm_head.")}
            ours, into = self.trunk.state_dict(), self.trunk
        else:
            raise LMForgeError(f"training.init_from={where} holds a {source.family!r} model; a reward model starts "
                               "from a gpt-family chat model (an sft checkpoint) or from another reward model")
        differ = [k for k in ours if k not in theirs or theirs[k].shape != ours[k].shape]
        differ += [k for k in theirs if k not in ours]
        if differ:
            raise LMForgeError(f"training.init_from={where} holds a model of another shape than this run's (first "
                               f"difference: {differ[0]}); the reward model takes its shape from the checkpoint "
                               f"(see its {CONFIG_FILE}): leave the model section's sizes unset")
        into.load_state_dict(theirs)

    # ---- loop hooks ---------------------------------------------------------------------------
    def flops_per_token(self, seq_len: int) -> float:
        """The trunk's training FLOPs per token without the LM head (the scalar head is read at one
        position per sequence: nothing next to the rest)."""
        c = self.config
        return self.trunk.flops_per_token(seq_len) - 6.0 * c.n_embd * c.vocab_size

    def set_activation_checkpointing(self, enabled: bool) -> None:
        self.trunk.set_activation_checkpointing(enabled)

    def repeated_blocks(self) -> list[nn.Module]:
        return self.trunk.repeated_blocks()

    def decays(self, name: str, param: torch.Tensor) -> bool:
        return self.trunk.decays(name, param)  # the trunk's rule (mHC's static logits are not decayed)


def pair_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
              center_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The Bradley-Terry loss of ``[P]`` chosen and rejected rewards and its metrics: pair accuracy (a tie
    counts half, so chance is 0.5), mean margin ``r_chosen - r_rejected``, the rewards' mean and
    standard deviation, and the chosen and rejected means."""
    diff = chosen - rejected
    loss = -F.logsigmoid(diff if margin is None else diff - margin.to(diff.dtype)).mean()
    if center_coef:
        loss = loss + center_coef * ((chosen + rejected) ** 2).mean()
    both = torch.cat([chosen, rejected]).detach()
    metrics = {"accuracy": ((diff > 0).float() + 0.5 * (diff == 0).float()).mean().detach(),
               "margin": diff.mean().detach(), "reward_mean": both.mean(), "reward_std": both.std(unbiased=False),
               "chosen_reward": chosen.mean().detach(), "rejected_reward": rejected.mean().detach()}
    return loss, metrics


def reward_config_from(config: GPTConfig) -> RewardConfig:
    """The reward model config on the trunk a gpt (or reward) config describes."""
    return RewardConfig(**dataclasses.asdict(config))


__all__ = ["RewardConfig", "RewardModel", "pair_loss", "reward_config_from"]
