"""AdamW, the optimizer of every kind that does not bring its own, and its 8-bit form.

``training.optimizer_states`` says how AdamW keeps its two moments per weight:

- ``fp32`` (default): PyTorch's AdamW, fused where the device has a kernel; 8 bytes a weight.
- ``8bit``: ``AdamW8bit`` below, 2 bytes a weight and 8 bytes of scales per block (of up to 256 weights: at
  most 2.03 bytes a weight for rows of 256 or more): what seeds 000 and 001 ask for with the Trainer's ``optim="adamw_8bit"`` when a model does not fit. At 1.3B parameters
  the moments drop from 10.4 GB to 2.6 GB.

How ``AdamW8bit`` keeps a moment: each row of a weight matrix is cut into blocks of up to 256 values; a
block keeps its largest magnitude over 448 as a scale (fp32) and each value as an 8-bit float (e4m3: 3 bits
of mantissa, magnitudes from 448 down to 2^-9, so down to ~2^-18 of the block's largest) times the scale. The second moment is kept as its
square root, whose range is half as wide in exponent. Every step reads the moments back to fp32,
updates them and the weight exactly as AdamW does, and writes them back rounded *stochastically* (up
or down with the odds that make the rounding exact on average; below 2^-6 of the scale, e4m3's subnormals,
to nearest): with round-to-nearest, an average that
moves by less than half a step of the 8-bit grid (the second moment moves 0.1-5% a step) would never
move at all. The rounding's random bits come from (seed, step, parameter), so a resumed run and every
DDP process draw the same ones. Vectors (norms, biases) and matrices under 4,096 values keep fp32
moments: they are a sliver of the memory. Blocks follow rows, so a weight's row is never split across
blocks; a matrix whose row length has no divisor between 64 and 256 keeps fp32 moments too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from lmforge.config import OPTIMIZER_STATES
from lmforge.device import adamw_kernels
from lmforge.errors import LMForgeError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
MIN_8BIT_SIZE = 4096  # smaller tensors keep fp32 moments
_CHUNK_VALUES = 1 << 22  # rows of a parameter stepped together: bounds the fp32 temporaries (~7 x 16 MB)
_DROPPED_BITS = 20  # fp32 has 23 bits of mantissa, e4m3 keeps 3
_KEPT_AS_SAVED = ("exp_avg", "exp_avg_scale", "exp_avg_sq_sqrt", "exp_avg_sq_sqrt_scale", "exp_avg_sq")


def block_size(row: int) -> int | None:
    """Values per block for rows of ``row`` values: the whole row up to 256, else the largest divisor of
    the row between 64 and 256; None where there is none, or rows are under 32 values (the tensor keeps fp32
    moments: an 8-byte scale per few values would cost more than fp32 itself)."""
    if row < 32:
        return None
    if row <= 256:
        return row
    return next((b for b in range(256, 63, -1) if row % b == 0), None)


def quantize(x: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` of shape (rows, blocks, block) as (e4m3 codes stored as uint8 of the same shape, fp32 scales of
    shape (rows, blocks)): value = code x scale. ``generator``: round stochastically with its bits; None:
    to nearest."""
    scale = x.abs().amax(dim=-1) / FP8_MAX
    y = x / torch.where(scale > 0, scale, 1.0).unsqueeze(-1)
    if generator is not None:
        # Add random bits below the 3 kept ones and cut them off: rounds the magnitude up with the odds of
        # its distance to the grid point below (the sign bit is never reached by the carry).
        noise = torch.randint(0, 1 << _DROPPED_BITS, y.shape, dtype=torch.int32, device=y.device,
                              generator=generator)
        y = ((y.view(torch.int32) + noise) & -(1 << _DROPPED_BITS)).view(torch.float32)
    return y.clamp_(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.view(FP8).float() * scale.unsqueeze(-1)


class AdamW8bit(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments) with 8-bit moments; see the module's text.

    State per 8-bit parameter: ``exp_avg`` and ``exp_avg_sq_sqrt`` (uint8 codes, the parameter's shape),
    ``exp_avg_scale`` and ``exp_avg_sq_sqrt_scale`` (fp32, one per block), ``step`` (a CPU tensor, read
    without waiting for the device). Others: ``exp_avg``, ``exp_avg_sq`` in fp32, as torch's AdamW.
    ``found_inf``, when the training loop sets it (a device scalar, 1 after a non-finite step), makes
    each step leave weights and moments as they were, without the host reading it; the step count still
    advances (the loop stops at its next check step, from the checkpoint before, so it is never used)."""

    takes_found_inf = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, seed: int = 0):
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise LMForgeError(f"AdamW's betas must be in [0, 1), got {betas}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.seed = int(seed)
        self.found_inf: torch.Tensor | None = None

    def state_shapes(self, p: torch.Tensor) -> dict[str, tuple[int, ...]]:
        """The shape of each tensor of ``p``'s state (checked when a checkpoint's state is loaded)."""
        layout = self._layout(p)
        if layout is None:
            return {"exp_avg": tuple(p.shape), "exp_avg_sq": tuple(p.shape)}
        rows, blocks, _ = layout
        return {"exp_avg": tuple(p.shape), "exp_avg_sq_sqrt": tuple(p.shape), "exp_avg_scale": (rows, blocks),
                "exp_avg_sq_sqrt_scale": (rows, blocks)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch's loader casts every state tensor but `step` to the parameter's dtype: codes and scales are
        # put back as saved (only moved to the parameter's device).
        # (handed to torch without them: its cast of every code to fp32 at once would cost fp32's memory)
        kept = {index: {k: v for k, v in entry.items() if k in _KEPT_AS_SAVED}
                for index, entry in state_dict["state"].items()}
        rest = {index: {k: v for k, v in entry.items() if k not in _KEPT_AS_SAVED}
                for index, entry in state_dict["state"].items()}
        super().load_state_dict({**state_dict, "state": rest})
        params = [p for g in self.param_groups for p in g["params"]]
        for index, entry in kept.items():
            for name, value in entry.items():
                self.state[params[index]][name] = value.to(params[index].device)

    @staticmethod
    def _layout(p: torch.Tensor) -> tuple[int, int, int] | None:
        """(rows, blocks per row, block) of an 8-bit parameter; None for fp32 moments."""
        if p.dim() < 2 or p.numel() < MIN_8BIT_SIZE or not p.is_contiguous():
            return None
        rows = p.shape[0]
        block = block_size(p.numel() // rows)
        return None if block is None else (rows, p.numel() // rows // block, block)

    def _init_state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        state["step"] = torch.zeros((), dtype=torch.int64)
        layout = self._layout(p)
        if layout is None:
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
        else:
            for name in ("exp_avg", "exp_avg_sq_sqrt"):
                state[name] = torch.zeros(p.shape, dtype=torch.uint8, device=p.device)  # code 0 is 0.0
                state[f"{name}_scale"] = torch.zeros(layout[:2], dtype=torch.float32, device=p.device)
        return state

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 (torch's signature)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = -1
        for group in self.param_groups:
            for p in group["params"]:
                index += 1  # counted over every parameter, with or without a gradient: stable across steps
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise LMForgeError("training.optimizer_states=8bit does not take sparse gradients")
                state = self.state[p] if self.state[p] else self._init_state(p)
                state["step"] += 1
                step = int(state["step"])
                layout = self._layout(p)
                if layout is None:
                    m, v = state["exp_avg"], state["exp_avg_sq"]
                    new_m, new_v = self._update(group, step, p, p.grad, m, v)
                    self._set(m, new_m, self.found_inf)
                    self._set(v, new_v, self.found_inf)
                    continue
                rows, blocks, block = layout
                chunk = max(1, _CHUNK_VALUES // (blocks * block))  # whole rows, a few million values at a time
                grad = p.grad.reshape(rows, blocks, block)
                weight = p.view(rows, blocks, block)
                names = ("exp_avg", "exp_avg_scale", "exp_avg_sq_sqrt", "exp_avg_sq_sqrt_scale")
                views = [state[n].view(rows, blocks, block) if "scale" not in n else state[n] for n in names]
                for start in range(0, rows, chunk):
                    part = slice(start, start + chunk)
                    m_codes, m_scale, r_codes, r_scale = (v[part] for v in views)
                    m = dequantize(m_codes, m_scale)
                    r = dequantize(r_codes, r_scale)
                    m, v = self._update(group, step, weight[part], grad[part], m, r.mul_(r))
                    generator = self._generator(p.device, step, index, start)
                    for codes, scale, value in ((m_codes, m_scale, m), (r_codes, r_scale, v.sqrt_())):
                        new_codes, new_scale = quantize(value, generator)
                        self._set(codes, new_codes, self.found_inf)
                        self._set(scale, new_scale, self.found_inf)
        return loss

    def _update(self, group: dict[str, Any], step: int, p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor,
                v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One AdamW step of ``p`` (a parameter or rows of one) from moments ``m``, ``v`` (fp32): returns the
        new moments for the caller to keep. With ``found_inf`` set, ``p`` is left as it was (and the caller
        keeps the old moments)."""
        beta1, beta2 = group["betas"]
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        grad = grad.float()
        skip = self.found_inf
        new_m = torch.lerp(m, grad, 1 - beta1)
        new_v = (v * beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (new_v.sqrt() / math.sqrt(1 - beta2 ** step)).add_(group["eps"])
        update = (new_m / denom).mul_(lr / (1 - beta1 ** step))
        if skip is None and p.dtype == torch.float32:
            p.mul_(1 - lr * wd).sub_(update)
        else:
            self._set(p, (p.float() * (1 - lr * wd) - update).to(p.dtype), skip)
        return new_m, new_v

    @staticmethod
    def _set(target: torch.Tensor, value: torch.Tensor, skip: torch.Tensor | None) -> None:
        target.copy_(value if skip is None else torch.where(skip > 0, target, value))

    def _generator(self, device: torch.device, step: int, index: int, row: int) -> torch.Generator:
        generator = torch.Generator(device=device)
        generator.manual_seed(hash((self.seed, step, index, row)) & (2**63 - 1))  # ints hash alike in every process
        return generator


def make_adamw(groups: list[dict[str, Any]], cfg: Any, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over ``groups`` with the run's betas, eps and lr, its moments kept as
    ``training.optimizer_states`` says."""
    t = cfg.training
    if t.optimizer_states == "8bit":
        if device.type == "mps":
            raise LMForgeError("training.optimizer_states=8bit keeps its moments as 8-bit floats, which PyTorch has "
                               "no kernels for on MPS: drop it on this Mac (or train with training.device=cpu)")
        return AdamW8bit(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, seed=cfg.seed)
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, **adamw_kernels(device))


def default_optimizer(model: Any, cfg: Any, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over the model's parameter groups: the optimizer of every kind that does not name its own
    (``RecipeSpec.make_optimizer``)."""
    return make_adamw(model.param_groups(cfg.training.weight_decay, cfg.training.lr), cfg, device)


def moment_bytes(params: Iterable[torch.Tensor], optimizer_states: str) -> int:
    """Bytes AdamW's moments of ``params`` take with ``optimizer_states`` (fp32 | 8bit), from their shapes
    (meta tensors do): 8 a weight in fp32; 2 a weight plus 8 per block in 8 bits."""
    total = 0
    for p in params:
        layout = AdamW8bit._layout(p) if optimizer_states == "8bit" else None
        total += 8 * p.numel() if layout is None else 2 * p.numel() + 8 * layout[0] * layout[1]
    return total


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes the optimizer's state tensors hold on this process (moments, scales, steps)."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if torch.is_tensor(v))


__all__ = ["AdamW8bit", "OPTIMIZER_STATES", "block_size", "default_optimizer", "dequantize", "make_adamw",
           "moment_bytes", "quantize", "state_bytes"]
