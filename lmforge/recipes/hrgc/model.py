"""HRGC, the hierarchical recursive Go coder (seed 000): a planner, a generator and a refinement head.

* **planner** — a GPT over ``spec <plan> plan</s>``: writes the outline of a function body;
* **generator** — a GPT over ``spec <plan> plan <code> code</s>``, conditioned on the planner: the
  planner's final hidden states at the ``spec <plan> plan`` positions go through ``bridge`` (a linear
  map, zero at initialisation) and are added to the generator's token embeddings there, so the code
  loss trains the planner's states too;
* **head** — a 3-way classifier (continue / refine / done) on the generator's state at the ``<judge>``
  marker after a candidate: ``spec <plan> plan <attempt> candidate <judge>``;
* **refinement generation** — the same generator continuing that sequence with
  ``<verdict> validator message <code> corrected body</s>``.

The sequence layout lives in ``lmforge.recipes.hrgc.sequences``; the inference loop in ``lmforge.recipes.hrgc.writer``.
With ``hierarchical: false`` the model is the plain baseline: one generator over ``spec <code> code``,
no planner, no head (what HRGC is measured against).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.errors import LMForgeError
from lmforge.models.base import LMForgeModel
from lmforge.models.gpt import FLAVORS, GPT, GPTConfig
from lmforge.models.losses import IGNORE_INDEX, linear_cross_entropy, lm_loss_problem

HEAD_LABELS = ("continue", "refine", "done")  # the head's classes, in this order
# The seed's training settings: the hrgc kind's `recipe.*` (lmforge.recipes.hrgc.training.HRGCSettings).
DEFAULT_LOSS_WEIGHTS = {"plan": 0.4, "code": 0.4, "refinement": 0.2}  # the seed's; HRGCSettings starts from these
TRAINING_KEYS = ("plan_loss_weight", "code_loss_weight", "refinement_loss_weight", "planner_lr", "generator_lr",
                 "refinement_lr", "refinement_warmup", "validation_frequency", "validation_samples",
                 "own_failure_share")


@dataclass
class ModuleConfig:
    """One decoder's sizes (the seed's ``planner_config`` / ``generator_config``)."""

    n_positions: int = 512
    n_embd: int = 256
    n_layer: int = 3
    n_head: int = 8
    dropout: float = 0.1  # embedding, residual and attention dropout
    vocab_size: int = 0  # the seed repeats it per module: 0 or the model's vocab_size


@dataclass
class HRGCConfig:
    vocab_size: int = 0  # 0 = taken from the tokenizer by the trainer
    flavor: str = "gpt2"  # both decoders: gpt2 | llama
    lm_loss: str = "auto"  # both decoders' LM loss: auto | chunked | logits (see lmforge.models.losses)
    hierarchical: bool = True  # false: the plain spec -> code baseline (generator only)
    planner_config: ModuleConfig = field(default_factory=lambda: ModuleConfig(n_positions=512))
    generator_config: ModuleConfig = field(default_factory=lambda: ModuleConfig(n_positions=1024))
    # Inference defaults of this checkpoint (training settings are the kind's: lmforge.recipes.hrgc.training).
    max_refinement_iterations: int = 5  # attempts at most in `lmforge generate` / `lmforge eval`
    enable_validation: bool = True  # inference: the parser vetoes "done" on code it rejects
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 3

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise LMForgeError(message)

        check(self.flavor in FLAVORS, f"unknown model.flavor {self.flavor!r}; use one of: {', '.join(FLAVORS)}")
        check(self.vocab_size >= 0, f"model.vocab_size must be >= 0 (0 = from the tokenizer), got {self.vocab_size}")
        check(lm_loss_problem(self.lm_loss) is None, lm_loss_problem(self.lm_loss) or "")
        given = {m.vocab_size for m in (self.planner_config, self.generator_config) if m.vocab_size}
        check(len(given) <= 1 and given <= {self.vocab_size or next(iter(given), 0)},
              f"model.planner_config.vocab_size, model.generator_config.vocab_size and model.vocab_size differ "
              f"({self.planner_config.vocab_size}, {self.generator_config.vocab_size}, {self.vocab_size}); both "
              "decoders share the tokenizer: set model.vocab_size alone (0 = from the tokenizer)")
        if not self.vocab_size and given:  # the seed's per-module vocab_size
            self.vocab_size = given.pop()
        for name in ("planner_config", "generator_config"):
            m = getattr(self, name)
            for key in ("n_positions", "n_embd", "n_layer", "n_head"):
                check(getattr(m, key) > 0, f"model.{name}.{key} must be > 0, got {getattr(m, key)}")
            check(m.n_embd % m.n_head == 0, f"model.{name}.n_embd ({m.n_embd}) must be divisible by "
                                            f"model.{name}.n_head ({m.n_head})")
            check(0.0 <= m.dropout < 1.0, f"model.{name}.dropout must be in [0, 1), got {m.dropout}")
        check(self.max_refinement_iterations >= 1,
              f"model.max_refinement_iterations must be >= 1, got {self.max_refinement_iterations}")

    @classmethod
    def resolve_dict(cls, values: dict[str, Any]) -> dict[str, Any]:
        # Checkpoints of lmforge 0.1 kept the training settings here; they do not change the model.
        values = {k: v for k, v in values.items() if k not in TRAINING_KEYS}
        for name in ("planner_config", "generator_config"):  # YAML nulls would otherwise become None
            if values.get(name) is None:
                values.pop(name, None)
        return values


def _decoder_config(c: HRGCConfig, m: ModuleConfig) -> GPTConfig:
    return GPTConfig(flavor=c.flavor, vocab_size=c.vocab_size, n_positions=m.n_positions, n_embd=m.n_embd,
                     n_layer=m.n_layer, n_head=m.n_head, embd_pdrop=m.dropout, resid_pdrop=m.dropout,
                     attn_pdrop=m.dropout, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
                     pad_token_id=c.pad_token_id, lm_loss=c.lm_loss)


class HRGC(LMForgeModel):
    family = "hrgc"
    config_class = HRGCConfig

    def __init__(self, config: HRGCConfig):
        super().__init__(config)
        c = config
        if c.vocab_size <= 0:
            raise LMForgeError("model.vocab_size is 0, so the model cannot be built: set it to the tokenizer's "
                               "vocabulary size (the trainer does this from the tokenizer)")
        self.generator = GPT(_decoder_config(c, c.generator_config))
        if c.hierarchical:
            self.planner = GPT(_decoder_config(c, c.planner_config))
            self.bridge = nn.Linear(c.planner_config.n_embd, c.generator_config.n_embd, bias=False)
            nn.init.zeros_(self.bridge.weight)  # at initialisation the generator sees only tokens
            self.head = nn.Linear(c.generator_config.n_embd, len(HEAD_LABELS))
            nn.init.normal_(self.head.weight, 0.0, 0.02)
            nn.init.zeros_(self.head.bias)
        else:
            self.planner = self.bridge = self.head = None
        # The weights of the plan, code and refinement losses: training settings (HRGCSettings), set by
        # the kind before training; these are the seed's defaults.
        self.loss_weights = dict(DEFAULT_LOSS_WEIGHTS)

    # ---- pieces the inference loop uses ------------------------------------------------
    def condition(self, planner_hidden: torch.Tensor, prefix_len: torch.Tensor, length: int) -> torch.Tensor:
        """``[B, Tp, dp]`` planner states -> ``[B, length, dg]`` additions to the generator's embeddings:
        the bridged states at positions ``< prefix_len`` (the shared ``spec <plan> plan`` prefix), 0 after."""
        extra = self.bridge(planner_hidden)
        keep = torch.arange(extra.size(1), device=extra.device)[None, :] < prefix_len[:, None]
        extra = extra * keep[..., None].to(extra.dtype)
        if extra.size(1) >= length:
            return extra[:, :length]
        return F.pad(extra, (0, 0, 0, length - extra.size(1)))

    def judge(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, dg]`` generator states at ``<judge>`` -> ``[B, 3]`` logits over ``HEAD_LABELS``."""
        return self.head(hidden).float()

    # ---- training interface -------------------------------------------------------------
    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        c, gen = self.config, self.generator
        planner_hidden = plan_loss = None
        if c.hierarchical:
            planner_hidden = self.planner.hidden_states(batch["plan_ids"])
            plan_loss = linear_cross_entropy(planner_hidden, self.planner.lm_head.weight, batch["plan_labels"],
                                             path=self.planner.config.lm_loss)

        def extra(ids: torch.Tensor) -> torch.Tensor | None:
            if planner_hidden is None:
                return None
            return self.condition(planner_hidden, batch["prefix_len"], ids.size(1))

        code_ids = batch["code_ids"]
        hidden = gen.hidden_states(code_ids, extra_embeds=extra(code_ids))
        code_loss = linear_cross_entropy(hidden, gen.lm_head.weight, batch["code_labels"], path=gen.config.lm_loss)
        if not c.hierarchical:
            return code_loss, {"code_loss": code_loss.detach()}
        w = self.loss_weights
        loss = w["plan"] * plan_loss + w["code"] * code_loss
        metrics: dict[str, Any] = {"plan_loss": plan_loss.detach(), "code_loss": code_loss.detach()}
        if "refine_ids" in batch:  # after refinement_warmup (and always in evaluation)
            refine_ids = batch["refine_ids"]
            hidden = gen.hidden_states(refine_ids, extra_embeds=extra(refine_ids))
            refine_loss = linear_cross_entropy(hidden, gen.lm_head.weight, batch["refine_labels"],
                                               path=gen.config.lm_loss)
            labels = batch["head_labels"]
            rows = torch.arange(hidden.size(0), device=hidden.device)
            logits = self.judge(hidden[rows, batch["judge_pos"]])
            valid = labels != IGNORE_INDEX
            count = valid.sum().clamp(min=1)
            head_loss = (F.cross_entropy(logits, labels.clamp(min=0), reduction="none") * valid).sum() / count
            loss = loss + w["refinement"] * (head_loss + refine_loss)
            metrics.update(head_loss=head_loss.detach(), refine_loss=refine_loss.detach(),
                           head_accuracy=((logits.argmax(-1) == labels) & valid).sum() / count)
        return loss, metrics

    def set_activation_checkpointing(self, enabled: bool) -> None:
        for part in (self.planner, self.generator):
            if part is not None:
                part.set_activation_checkpointing(enabled)

    # ---- tied weights -------------------------------------------------------------------
    def is_tied_key(self, key: str) -> bool:
        module, _, rest = key.partition(".")
        part = getattr(self, module, None)
        return isinstance(part, GPT) and part.is_tied_key(rest)

    def tie_weights(self) -> None:
        for part in (self.planner, self.generator):
            if part is not None:
                part.tie_weights()


__all__ = ["HRGC", "HRGCConfig", "ModuleConfig", "HEAD_LABELS"]
