"""HRM: the Hierarchical Reasoning Model with adaptive computation time (``HierarchicalReasoningModel_ACTV1``).

Two stacks of post-norm blocks: a slow high-level module H and a fast low-level module L. One
segment runs ``H_cycles`` x ``L_cycles`` updates::

    z_L = L(z_L, z_H + x)      # every L step (input injection is an addition)
    z_H = H(z_H, z_L)          # after each sweep of L steps

All but the last L update and the last H update run without gradient (the "one-step gradient"):
backward goes through exactly one L and one H pass. The Q head's continue target comes from a second,
gradient-free segment. ACT, the carry and the losses are in ``lmforge.recipes.puzzles.model``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmforge.errors import LMForgeError
from lmforge.recipes.puzzles.model import PuzzleModel, PuzzleModelConfig
from lmforge.recipes.puzzles.layers import Attention, PostNormBlock, ReasoningModule, TokenMixer


@dataclass
class HRMConfig(PuzzleModelConfig):
    H_layers: int = 4
    L_layers: int = 4
    H_cycles: int = 2
    L_cycles: int = 2
    mlp_t: bool = False  # token-mixing MLP instead of attention in both modules (TRM's variant; Sudoku)

    def validate(self) -> None:
        super().validate()
        if min(self.H_layers, self.L_layers, self.H_cycles, self.L_cycles) < 1:
            raise LMForgeError("model config: H_layers, L_layers, H_cycles and L_cycles must be >= 1")


def attention_blocks(c: PuzzleModelConfig, n: int, rotary) -> list[PostNormBlock]:
    return [PostNormBlock(Attention(c.hidden_size, c.num_heads, rotary), c.hidden_size, c.expansion,
                          c.rms_norm_eps) for _ in range(n)]


def mixing_blocks(c: PuzzleModelConfig, n: int, rotary, seq_len: int) -> list[PostNormBlock]:
    """``n`` blocks that mix tokens by attention, or with ``c.mlp_t`` by a SwiGLU across the ``seq_len``
    positions (fixed-size grids: cheaper on a CPU, and what made TRM learn Sudoku fast there)."""
    if getattr(c, "mlp_t", False):
        return [PostNormBlock(TokenMixer(seq_len, c.expansion), c.hidden_size, c.expansion, c.rms_norm_eps)
                for _ in range(n)]
    return attention_blocks(c, n, rotary)


class HRM(PuzzleModel):
    family = "hrm"
    config_class = HRMConfig

    def __init__(self, config: HRMConfig):
        super().__init__(config)
        self.H_level = ReasoningModule(mixing_blocks(config, config.H_layers, self.rotary, self.total_len))
        self.L_level = ReasoningModule(mixing_blocks(config, config.L_layers, self.rotary, self.total_len))

    def segment(self, z_h: torch.Tensor, z_l: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        with torch.no_grad():
            for h_step in range(c.H_cycles):
                for l_step in range(c.L_cycles):
                    if not (h_step == c.H_cycles - 1 and l_step == c.L_cycles - 1):
                        z_l = self.L_level(z_l, z_h + x)
                if h_step != c.H_cycles - 1:
                    z_h = self.H_level(z_h, z_l)
        # the one-step gradient: only these two updates are differentiated
        z_l = self.L_level(z_l, z_h + x)
        z_h = self.H_level(z_h, z_l)
        return z_h, z_l

    def block_passes(self):
        c = self.config
        target = c.halt_max_steps > 1  # the Q-continue target costs one more gradient-free segment
        l_passes = c.H_cycles * c.L_cycles * (2 if target else 1)
        h_passes = c.H_cycles * (2 if target else 1)
        return [(self.L_level, l_passes, 1), (self.H_level, h_passes, 1)]
