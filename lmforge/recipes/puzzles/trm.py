"""TRM: the Tiny Recursive Model — one small network, recursion on an answer y and a latent z.

One segment ("supervision step") with ``T = H_cycles`` and ``n = L_cycles``::

    T-1 times, without gradient:  n times z = net(z, y + x);  y = net(y, z)
    once, with full backprop:     n times z = net(z, y + x);  y = net(y, z)

(``net(a, b)`` runs the blocks on ``a + b``.) y is the carry's ``z_h`` and z its ``z_l``. Deep
supervision, ACT and the losses are shared with HRM (``lmforge.recipes.puzzles.model``); TRM's halting is
simpler: a single Q logit, halt when it is > 0, trained by BCE on "the answer is exactly right", so
there is no second forward pass. ``mlp_t`` swaps attention for a SwiGLU across the sequence axis
(Sudoku), usually with ``pos_encodings: none``. TRM keeps an EMA of the weights (``ema_decay``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmforge.errors import LMForgeError
from lmforge.recipes.puzzles.hrm import mixing_blocks
from lmforge.recipes.puzzles.model import PuzzleModel, PuzzleModelConfig
from lmforge.recipes.puzzles.layers import ReasoningModule


@dataclass
class TRMConfig(PuzzleModelConfig):
    L_layers: int = 2
    H_cycles: int = 3  # T
    L_cycles: int = 6  # n
    mlp_t: bool = False  # token-mixing MLP instead of attention
    puzzle_emb_len: int = 16
    ema_decay: float = 0.999

    def validate(self) -> None:
        super().validate()
        if min(self.L_layers, self.H_cycles, self.L_cycles) < 1:
            raise LMForgeError("model config: L_layers, H_cycles and L_cycles must be >= 1")


class TRM(PuzzleModel):
    family = "trm"
    config_class = TRMConfig
    has_q_continue = False

    def __init__(self, config: TRMConfig):
        super().__init__(config)
        c = config
        self.net = ReasoningModule(mixing_blocks(c, c.L_layers, self.rotary, self.total_len))

    def segment(self, z_h: torch.Tensor, z_l: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        y, z = z_h, z_l
        with torch.no_grad():
            for _ in range(c.H_cycles - 1):
                for _ in range(c.L_cycles):
                    z = self.net(z, y + x)
                y = self.net(y, z)
        for _ in range(c.L_cycles):
            z = self.net(z, y + x)
        y = self.net(y, z)
        return y, z

    def block_passes(self):
        c = self.config
        return [(self.net, c.H_cycles * (c.L_cycles + 1), c.L_cycles + 1)]
