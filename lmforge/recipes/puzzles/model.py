"""What the puzzle models (HRM, TRM, the plain-transformer baseline) share.

- Inputs: a batch dict with ``inputs`` [B, S] (cell tokens), ``labels`` [B, S] (-100 = ignored) and
  ``puzzle_identifiers`` [B]. A learned per-puzzle vector (zero-initialised, trained with sign-SGD)
  is prepended as ``puzzle_emb_len`` tokens; ``lm_head`` reads the grid positions, ``q_head`` reads
  position 0.
- Adaptive computation time (ACT): in training the model keeps a *carry* across optimizer steps —
  the latent state of every row of the batch, its step count and the example it is working on. Each
  forward runs one segment; rows that halt are replaced by the batch's fresh example at the next
  step, with their state reset. A halted row halts when it reaches ``halt_max_steps`` or its Q head
  says so, unless exploration (prob. ``halt_exploration_prob``) drew it a larger minimum.
- Evaluation runs ``halt_max_steps`` segments from a fresh state (``rollout``) and scores the final
  answer (HRM's protocol); it also reports the step at which the Q head would have halted.
- The carry is not saved in checkpoints: after a resume every row starts a fresh example (the state
  of a half-solved row is a few segments of work, not worth a second file format).
- Optional EMA of the weights (TRM): used for evaluation and written to checkpoints; the raw weights
  travel in the checkpoint's ``optimizer.safetensors`` so a resume is exact.
"""

from __future__ import annotations

import abc
import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lmforge.errors import LMForgeError
from lmforge.models.base import LMForgeModel
from lmforge.recipes.puzzles.layers import LOSSES, Rotary, lecun_linear, trunc_normal_

IGNORE = -100
# What the training metrics' window sums per step over the rows that halted (PuzzleModel._act_loss)
_WINDOW_SUMS = ("rows", "accuracy", "exact", "q_right", "steps")
POS_ENCODINGS = ("rope", "learned", "none")


@dataclass
class PuzzleModelConfig:
    """Options every puzzle family shares; names follow HRM's ``arch.*`` keys."""

    seq_len: int = 0  # cells per puzzle; 0 = take it from the dataset (81 for Sudoku)
    vocab_size: int = 0  # 0 = take it from the dataset (11 for Sudoku)
    num_puzzle_identifiers: int = 0  # 0 = take it from the dataset
    hidden_size: int = 512
    num_heads: int = 8
    expansion: float = 4.0
    puzzle_emb_ndim: int = -1  # size of the per-puzzle vector; -1 = hidden_size, 0 = none
    puzzle_emb_len: int = 0  # prefix tokens it fills; 0 = ceil(puzzle_emb_ndim / hidden_size)
    pos_encodings: str = "rope"  # rope | learned | none
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    loss_type: str = "stablemax"  # stablemax | softmax
    halt_max_steps: int = 16  # ACT segments at most (1 = no ACT)
    halt_exploration_prob: float = 0.1
    ema_decay: float = 0.0  # EMA of the weights for eval and checkpoints; 0 = off (TRM uses 0.999)

    @classmethod
    def resolve_dict(cls, values: dict[str, Any]) -> dict[str, Any]:
        # Checkpoints of lmforge 0.1 kept the sign-SGD settings here; they are training settings now
        # (recipe.puzzle_emb_lr / recipe.puzzle_emb_weight_decay) and do not change the model.
        return {k: v for k, v in values.items() if k not in ("puzzle_emb_lr", "puzzle_emb_weight_decay")}

    def validate(self) -> None:
        checks = [
            (self.hidden_size > 0 and self.num_heads > 0, "hidden_size and num_heads must be > 0"),
            (self.hidden_size % self.num_heads == 0,
             f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}"),
            (self.expansion > 0, "expansion must be > 0"),
            (self.pos_encodings in POS_ENCODINGS, f"pos_encodings must be one of {POS_ENCODINGS}"),
            (self.loss_type in LOSSES, f"loss_type must be one of {tuple(LOSSES)}"),
            (self.halt_max_steps >= 1, "halt_max_steps must be >= 1"),
            (0.0 <= self.halt_exploration_prob <= 1.0, "halt_exploration_prob must be in [0, 1]"),
            (0.0 <= self.ema_decay < 1.0, "ema_decay must be in [0, 1)"),
            (self.puzzle_emb_ndim >= -1 and self.puzzle_emb_len >= 0, "puzzle_emb_ndim >= -1, puzzle_emb_len >= 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise LMForgeError(f"model config: {msg}")
        if self.emb_ndim > self.prefix_len * self.hidden_size:
            raise LMForgeError(f"model config: puzzle_emb_ndim={self.emb_ndim} does not fit in puzzle_emb_len="
                               f"{self.puzzle_emb_len} tokens of hidden_size={self.hidden_size}; raise "
                               "puzzle_emb_len or set it to 0 (= as many as needed)")
        if self.pos_encodings == "rope" and (self.hidden_size // self.num_heads) % 2:
            raise LMForgeError(f"model config: rotary positions need an even head size; hidden_size/num_heads "
                               f"= {self.hidden_size}/{self.num_heads} is odd")
        if min(self.seq_len, self.vocab_size, self.num_puzzle_identifiers) <= 0:
            raise LMForgeError("model.seq_len, model.vocab_size and model.num_puzzle_identifiers must be set "
                               "(lmforge train fills them from the dataset's dataset.json)")

    @property
    def emb_ndim(self) -> int:
        return self.hidden_size if self.puzzle_emb_ndim == -1 else self.puzzle_emb_ndim

    @property
    def prefix_len(self) -> int:
        if self.emb_ndim == 0:
            return 0
        return self.puzzle_emb_len or -(-self.emb_ndim // self.hidden_size)


# ---- ACT decisions (pure functions, tested with fixed Q values) -------------------------------
def exploration_min_steps(batch: int, prob: float, max_steps: int, device: torch.device,
                          generator: torch.Generator | None = None) -> torch.Tensor:
    """Per row: with probability ``prob`` a minimum of randint[2, max_steps] steps, else 0."""
    explore = torch.rand(batch, device=device, generator=generator) < prob
    minimum = torch.randint(2, max_steps + 1, (batch,), device=device, generator=generator)
    return torch.where(explore, minimum, torch.zeros_like(minimum))


def halt_decision(steps: torch.Tensor, q_halt: torch.Tensor, q_continue: torch.Tensor | None,
                  max_steps: int, min_steps: torch.Tensor | None = None) -> torch.Tensor:
    """Which rows halt after this segment. ``steps`` counts segments done, this one included.

    A row halts at ``max_steps``, or earlier when its Q head prefers halting (``q_halt > q_continue``,
    or ``q_halt > 0`` for models without a continue head), but never before its ``min_steps``.
    """
    halted = steps >= max_steps
    if max_steps > 1:
        wants = q_halt > (q_continue if q_continue is not None else 0.0)
        halted = halted | wants
        if min_steps is not None:
            halted = halted & (steps >= min_steps)
    return halted


@dataclass
class Carry:
    z_h: torch.Tensor  # [B, P+S, H]
    z_l: torch.Tensor
    steps: torch.Tensor  # [B] int32, segments done on the current example
    halted: torch.Tensor  # [B] bool: take a fresh example at the next step
    data: dict[str, torch.Tensor]  # the examples being worked on


class PuzzleModel(LMForgeModel, abc.ABC):
    """Base of the puzzle families. Subclasses build their blocks and implement ``segment``."""

    has_q_continue = True  # HRM: Q head gives (halt, continue); TRM: halt only
    uses_act = True

    def __init__(self, config: PuzzleModelConfig):
        super().__init__(config)
        config.validate()
        c = config
        h = c.hidden_size
        self.prefix_len = c.prefix_len
        self.total_len = c.seq_len + self.prefix_len
        self.embed_scale = math.sqrt(h)
        self.embed_tokens = nn.Embedding(c.vocab_size, h)
        trunc_normal_(self.embed_tokens.weight, 1.0 / math.sqrt(h))
        self.puzzle_emb = None
        if c.emb_ndim > 0:
            self.puzzle_emb = nn.Embedding(c.num_puzzle_identifiers, c.emb_ndim)
            nn.init.zeros_(self.puzzle_emb.weight)
        self.rotary = None
        self.embed_pos = None
        if c.pos_encodings == "rope":
            self.rotary = Rotary(h // c.num_heads, self.total_len, c.rope_theta)
        elif c.pos_encodings == "learned":
            self.embed_pos = nn.Parameter(trunc_normal_(torch.empty(self.total_len, h), 1.0 / math.sqrt(h)))
        self.lm_head = lecun_linear(h, c.vocab_size)
        self.q_head = None
        if self.uses_act:
            self.q_head = nn.Linear(h, 2 if self.has_q_continue else 1, bias=True)
            nn.init.zeros_(self.q_head.weight)
            nn.init.constant_(self.q_head.bias, -5.0)
            self.register_buffer("H_init", trunc_normal_(torch.empty(h), 1.0))
            self.register_buffer("L_init", trunc_normal_(torch.empty(h), 1.0))
        self.loss_fn = LOSSES[c.loss_type]
        self._carry: Carry | None = None
        # The training metrics' sums over the last halt_max_steps steps (rows, accuracy, exact, q right,
        # steps), oldest first: one tensor updated in place, so that a compiled step neither recompiles as a
        # list of them grows nor reads the device to ask whether a row has halted yet (see logged_metrics).
        self._train_window: torch.Tensor | None = None
        self._ema: list[torch.Tensor] | None = None

    # ---- the family-specific part -------------------------------------------------------------
    @abc.abstractmethod
    def segment(self, z_h: torch.Tensor, z_l: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One ACT segment: the new (z_H, z_L) from the carried state and the input embeddings ``x``."""

    def reasoning_modules(self) -> list[nn.Module]:
        return [m for m in self.modules() if hasattr(m, "checkpointing")]

    def set_activation_checkpointing(self, enabled: bool) -> None:
        for m in self.reasoning_modules():
            m.checkpointing = enabled

    # ---- embeddings and heads -----------------------------------------------------------------
    def input_embeddings(self, inputs: torch.Tensor, puzzle_ids: torch.Tensor) -> torch.Tensor:
        emb = self.embed_tokens(inputs)
        if self.puzzle_emb is not None:
            pe = self.puzzle_emb(puzzle_ids)
            pad = self.prefix_len * self.config.hidden_size - pe.shape[-1]
            if pad > 0:
                pe = nn.functional.pad(pe, (0, pad))
            emb = torch.cat([pe.view(-1, self.prefix_len, self.config.hidden_size).to(emb.dtype), emb], dim=1)
        if self.embed_pos is not None:
            emb = 0.707106781 * (emb + self.embed_pos.to(emb.dtype))
        return self.embed_scale * emb

    def heads(self, z_h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        logits = self.lm_head(z_h[:, self.prefix_len:])
        if self.q_head is None:
            return logits, torch.zeros(z_h.shape[0], device=z_h.device), None
        q = self.q_head(z_h[:, 0]).float()
        return logits, q[:, 0], (q[:, 1] if self.has_q_continue else None)

    def initial_state(self, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (batch, self.total_len, self.config.hidden_size)
        if not self.uses_act:
            z = torch.zeros(shape, device=device)
            return z, z
        return self.H_init.expand(shape).clone(), self.L_init.expand(shape).clone()

    # ---- training: one ACT segment per call, with the carry -----------------------------------
    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        if not self.training:
            return self._eval_forward(batch)
        if not self.uses_act:
            return self._direct_forward(batch)
        c = self.config
        bsz, device = batch["inputs"].shape[0], batch["inputs"].device
        carry = self._carry_for(batch)
        fresh = carry.halted
        data = {k: torch.where(fresh.view(-1, *([1] * (v.dim() - 1))), v, carry.data[k]) for k, v in batch.items()}
        init_h, init_l = self.initial_state(bsz, device)
        z_h = torch.where(fresh.view(-1, 1, 1), init_h, carry.z_h)
        z_l = torch.where(fresh.view(-1, 1, 1), init_l, carry.z_l)
        steps = torch.where(fresh, torch.zeros_like(carry.steps), carry.steps)

        x = self.input_embeddings(data["inputs"], data["puzzle_identifiers"])
        z_h, z_l = self.segment(z_h, z_l, x)
        logits, q_halt, q_cont = self.heads(z_h)

        with torch.no_grad():
            steps = steps + 1
            min_steps = None
            if c.halt_exploration_prob > 0 and c.halt_max_steps > 1:
                min_steps = exploration_min_steps(bsz, c.halt_exploration_prob, c.halt_max_steps, device)
            halted = halt_decision(steps, q_halt, q_cont, c.halt_max_steps, min_steps)
            target_q_cont = None
            if self.has_q_continue and c.halt_max_steps > 1:
                # Q-learning target for "continue": the Q values one segment further on.
                next_h, _ = self.segment(z_h, z_l, x)
                _, next_halt, next_cont = self.heads(next_h)
                is_last = steps >= c.halt_max_steps
                target_q_cont = torch.sigmoid(torch.where(is_last, next_halt, torch.maximum(next_halt, next_cont)))
        self._carry = Carry(z_h.detach().float(), z_l.detach().float(), steps, halted,
                            {k: v.detach() for k, v in data.items()})
        return self._act_loss(logits, q_halt, q_cont, target_q_cont, data["labels"], halted, steps)

    def before_compile(self, device: torch.device) -> None:
        # the carry is picked outside the compiled graph (here, not as a decorator: that would import the
        # compiler, ~2 s, with the module, for every verb that only loads a model)
        if not getattr(PuzzleModel._carry_for, "_outside_graph", False):  # once, for every puzzle model
            PuzzleModel._carry_for = torch.compiler.disable(PuzzleModel._carry_for)
            PuzzleModel._carry_for._outside_graph = True

    def _carry_for(self, batch: dict[str, torch.Tensor]) -> Carry:
        """The carry this step continues: the last step's, or at the start (or when the batch's size or device
        changed) a fresh one, every row halted, so that each takes its example from ``batch``. Outside the
        compiled graph (``before_compile``): the first step then compiles the same graph as every later one (a
        second compile of the whole step, 43 s for trm_sudoku on an H200, when this was traced). Also makes the
        metrics' window."""
        bsz, device = batch["inputs"].shape[0], batch["inputs"].device
        carry = self._carry
        if carry is None or carry.halted.shape[0] != bsz or carry.z_h.device != device:
            z_h, z_l = self.initial_state(bsz, device)
            carry = Carry(z_h, z_l, torch.zeros(bsz, dtype=torch.int32, device=device),
                          torch.ones(bsz, dtype=torch.bool, device=device), {k: v.detach() for k, v in batch.items()})
        if self._train_window is None or self._train_window.device != device:
            self._train_window = torch.zeros(max(1, self.config.halt_max_steps), len(_WINDOW_SUMS), device=device)
        return carry

    def _act_loss(self, logits, q_halt, q_cont, target_q_cont, labels, halted, steps):
        bsz = labels.shape[0]
        lm_loss, correct = self._lm_loss(logits, labels)
        bce = nn.functional.binary_cross_entropy_with_logits
        q_halt_loss = bce(q_halt, correct.float(), reduction="sum")
        total = lm_loss + 0.5 * q_halt_loss
        q_cont_loss = torch.zeros((), device=logits.device)
        if target_q_cont is not None:
            q_cont_loss = bce(q_cont, target_q_cont, reduction="sum")
            total = total + 0.5 * q_cont_loss
        with torch.no_grad():
            valid = halted & ((labels != IGNORE).sum(-1) > 0)
            acc = self._token_accuracy(logits, labels)
            sums = torch.stack([valid.sum().float(), (acc * valid).sum(), (correct & valid).sum().float(),  # _WINDOW_SUMS
                                (((q_halt >= 0) == correct) & valid).sum().float(), (steps * valid).sum().float()])
            self._train_window.copy_(torch.cat([self._train_window[1:], sums.unsqueeze(0)]))
            window = self._train_window.sum(0)
            n = window[0]
            rows = n.clamp_min(1)
        # over the rows that finished in the last halt_max_steps steps (none yet: dropped by logged_metrics)
        metrics = {"lm_loss": lm_loss.detach() / bsz, "q_halt_loss": q_halt_loss.detach() / bsz,
                   "halted_rows": n, "accuracy": window[1] / rows, "exact_accuracy": window[2] / rows,
                   "q_halt_accuracy": window[3] / rows, "steps": window[4] / rows}
        if target_q_cont is not None:
            metrics["q_continue_loss"] = q_cont_loss.detach() / bsz
        return total / bsz, metrics

    # the ratios over the rows that halted in the window: logged once a row has
    _WINDOW_RATIOS = ("accuracy", "exact_accuracy", "q_halt_accuracy", "steps")

    def logged_metrics(self, values: dict[str, float]) -> dict[str, float]:
        if values.get("halted_rows", 1) > 0:
            return values
        return {k: v for k, v in values.items() if k not in self._WINDOW_RATIOS}

    def _direct_forward(self, batch):
        """A model without ACT (the baseline): one pass, loss over every row."""
        bsz = batch["inputs"].shape[0]
        z_h, z_l = self.initial_state(bsz, batch["inputs"].device)
        z_h, _ = self.segment(z_h, z_l, self.input_embeddings(batch["inputs"], batch["puzzle_identifiers"]))
        logits, _, _ = self.heads(z_h)
        lm_loss, correct = self._lm_loss(logits, batch["labels"])
        with torch.no_grad():
            acc = self._token_accuracy(logits, batch["labels"]).mean()
        return lm_loss / bsz, {"accuracy": acc, "exact_accuracy": correct.float().mean(), "steps": 1.0}

    def _lm_loss(self, logits, labels) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum over rows of each row's mean token loss; and which rows are exactly right."""
        mask = labels != IGNORE
        counts = mask.sum(-1)
        per_token = self.loss_fn(logits, labels)
        lm_loss = (per_token / counts.clamp_min(1).unsqueeze(-1)).sum().float()
        with torch.no_grad():
            right = (logits.argmax(-1) == labels) & mask
            correct = right.sum(-1) == counts
        return lm_loss, correct

    @staticmethod
    def _token_accuracy(logits, labels) -> torch.Tensor:
        mask = labels != IGNORE
        right = ((logits.argmax(-1) == labels) & mask).sum(-1).float()
        return right / mask.sum(-1).clamp_min(1)

    # ---- evaluation and inference -------------------------------------------------------------
    @torch.no_grad()
    def rollout(self, inputs: torch.Tensor, puzzle_ids: torch.Tensor, max_steps: int | None = None) -> dict[str, torch.Tensor]:
        """Run ``max_steps`` segments (default halt_max_steps) from a fresh state.

        Returns the final ``logits`` and ``prediction``, and ``halt_step`` / ``halt_prediction``: the
        first segment at which the Q head chose to halt (the last one if it never did) and the answer
        then.
        """
        max_steps = max_steps or (self.config.halt_max_steps if self.uses_act else 1)
        bsz, device = inputs.shape[0], inputs.device
        x = self.input_embeddings(inputs, puzzle_ids)
        z_h, z_l = self.initial_state(bsz, device)
        halted = torch.zeros(bsz, dtype=torch.bool, device=device)
        halt_step = torch.full((bsz,), max_steps, dtype=torch.int32, device=device)
        halt_pred = None
        for step in range(1, max_steps + 1):
            z_h, z_l = self.segment(z_h, z_l, x)
            logits, q_halt, q_cont = self.heads(z_h)
            pred = logits.argmax(-1)
            halt_pred = pred if halt_pred is None else torch.where(halted.unsqueeze(-1), halt_pred, pred)
            halt_step = torch.where(halted, halt_step, torch.full_like(halt_step, step))
            if self.uses_act:
                halted = halted | halt_decision(torch.full_like(halt_step, step), q_halt, q_cont, max_steps)
        return {"logits": logits, "prediction": pred, "q_halt": q_halt, "halt_step": halt_step,
                "halt_prediction": halt_pred}

    def _eval_forward(self, batch):
        from lmforge.recipes.puzzles.data import DIFFICULTY_NAMES, difficulty_bucket

        labels = batch["labels"]
        out = self.rollout(batch["inputs"], batch["puzzle_identifiers"])
        lm_loss, correct = self._lm_loss(out["logits"], labels)
        bsz = labels.shape[0]
        mask = labels != IGNORE
        halt_correct = (((out["halt_prediction"] == labels) | ~mask).all(-1))
        # "accuracy" counts every cell, the givens too (HRM's convention); "blank_accuracy" only the cells the
        # puzzle leaves to fill (where its input differs from the answer): the share a solver got right.
        fill = (batch["inputs"] != labels) & mask
        right_fill = ((out["logits"].argmax(-1) == labels) & fill).sum(-1).float()
        metrics = {"accuracy": self._token_accuracy(out["logits"], labels).mean(),
                   "blank_accuracy": (right_fill / fill.sum(-1).clamp_min(1)).mean(),
                   "exact_accuracy": correct.float().mean(),
                   "steps": out["halt_step"].float().mean(),
                   "exact_accuracy_at_halt": halt_correct.float().mean()}
        if self.uses_act:
            metrics["q_halt_accuracy"] = ((out["q_halt"] >= 0) == correct).float().mean()
        ratings = batch.get("ratings")
        if ratings is not None:
            buckets = torch.as_tensor(difficulty_bucket(ratings.cpu().numpy()), device=labels.device)
            for i, name in enumerate(DIFFICULTY_NAMES):
                rows = (buckets == i) & (ratings >= 0)
                metrics[f"difficulty/{name}/n"] = rows.float().mean()
                metrics[f"difficulty/{name}/exact"] = (rows & correct).float().mean()
        return lm_loss / bsz, metrics

    @torch.no_grad()
    def solve(self, inputs: torch.Tensor, puzzle_ids: torch.Tensor, max_steps: int | None = None,
              early_halt: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Predicted cell tokens [B, S] and the segments used [B]: stop where the Q head halts
        (``early_halt``) or after ``max_steps`` segments."""
        was_training = self.training
        self.eval()
        try:
            with self.averaged_weights():
                out = self.rollout(inputs, puzzle_ids, max_steps)
        finally:
            self.train(was_training)
        if early_halt:
            return out["halt_prediction"], out["halt_step"]
        return out["prediction"], torch.full_like(out["halt_step"], max_steps or self.config.halt_max_steps)

    # ---- parameter groups: the weights (AdamATan2), the puzzle embeddings (sign-SGD) -----------
    def param_groups(self, weight_decay: float, lr: float) -> list[dict[str, Any]]:
        emb = self.puzzle_emb.weight if self.puzzle_emb is not None else None
        weights = [p for p in self.parameters() if p.requires_grad and p is not emb]
        groups = [{"params": weights, "weight_decay": weight_decay, "lr": lr, "name": "weights"}]
        if emb is not None:
            groups.append({"params": [emb], "weight_decay": weight_decay, "lr": lr, "name": "puzzle_emb"})
        return groups

    # ---- EMA of the weights -------------------------------------------------------------------
    def on_optimizer_step(self) -> None:
        decay = self.config.ema_decay
        if decay <= 0:
            return
        params = [p.detach() for p in self.parameters()]
        if self._ema is None:
            self._ema = [p.clone() for p in params]
        else:
            torch._foreach_lerp_(self._ema, params, 1.0 - decay)

    @contextlib.contextmanager
    def averaged_weights(self):
        """Swap the EMA weights in (no-op without EMA), and the raw ones back afterwards."""
        if self._ema is None:
            yield
            return
        params = [p.detach() for p in self.parameters()]
        raw = [p.clone() for p in params]
        torch._foreach_copy_(params, self._ema)
        try:
            yield
        finally:
            torch._foreach_copy_(params, raw)

    def training_state(self) -> dict[str, Any]:
        # Checkpoints hold the EMA weights in model.safetensors; the raw ones go here.
        if self._ema is None:
            return {}
        return {"raw_weights": [p.detach().cpu().clone() for p in self.parameters()]}

    def load_training_state(self, state: dict[str, Any]) -> None:
        raw = state.get("raw_weights")
        if raw is None:
            return
        params = [p.detach() for p in self.parameters()]
        # the checkpoint's model.safetensors held the EMA; keep it only if this run still averages
        self._ema = [p.clone() for p in params] if self.config.ema_decay > 0 else None
        for r, p in zip(raw, params, strict=True):  # a short or reshaped list is a damaged checkpoint
            if r.shape != p.shape:
                raise ValueError(f"raw weight of shape {tuple(r.shape)} for a parameter of shape {tuple(p.shape)}")
        torch._foreach_copy_(params, [r.to(p.device) for r, p in zip(raw, params)])

    # ---- accounting -------------------------------------------------------------------------
    @abc.abstractmethod
    def block_passes(self) -> list[tuple[nn.Module, int, int]]:
        """(module, passes per training step, of which with gradient) for each reasoning module."""

    def flops_per_token(self, seq_len: int) -> float:
        """Matmul FLOPs per grid cell of one training step (attention scores left out)."""
        from lmforge.recipes.puzzles.layers import TokenMixer

        total = 0.0
        for module, passes, with_grad in self.block_passes():
            # a token mixer's matmuls run once per channel of a row, not once per cell
            mixers = [m for m in module.modules() if isinstance(m, TokenMixer)]
            mixer_params = sum(p.numel() for m in mixers for p in m.parameters())
            dense = sum(p.numel() for p in module.parameters()) - mixer_params
            per_pass = 2.0 * (dense + mixer_params * self.config.hidden_size / self.total_len)
            total += per_pass * passes + 2 * per_pass * with_grad  # backward costs twice the forward
        return total * self.total_len / self.config.seq_len + 6.0 * self.lm_head.weight.numel()
