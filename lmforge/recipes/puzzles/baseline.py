"""The "direct prediction" baseline: a plain, non-recurrent transformer of HRM's blocks.

One pass of ``num_layers`` post-norm attention blocks over the embedded puzzle, no carry, no ACT,
no Q head: the model the HRM and TRM papers compare against (same width, same data, same loss).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmforge.errors import LMForgeError
from lmforge.recipes.puzzles.hrm import attention_blocks
from lmforge.recipes.puzzles.model import PuzzleModel, PuzzleModelConfig
from lmforge.recipes.puzzles.layers import ReasoningModule


@dataclass
class PuzzleTransformerConfig(PuzzleModelConfig):
    num_layers: int = 8
    halt_max_steps: int = 1

    def validate(self) -> None:
        super().validate()
        if self.num_layers < 1:
            raise LMForgeError("model config: num_layers must be >= 1")
        if self.halt_max_steps != 1:
            raise LMForgeError("model config: the puzzle_transformer baseline has no ACT; halt_max_steps must be 1")


class PuzzleTransformer(PuzzleModel):
    family = "puzzle_transformer"
    config_class = PuzzleTransformerConfig
    uses_act = False

    def __init__(self, config: PuzzleTransformerConfig):
        super().__init__(config)
        self.layers = ReasoningModule(attention_blocks(config, config.num_layers, self.rotary))

    def segment(self, z_h: torch.Tensor, z_l: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers(x, 0.0), z_l

    def block_passes(self):
        return [(self.layers, 1, 1)]
