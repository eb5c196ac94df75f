"""Building blocks of the recursive reasoning models (HRM, TRM) and their plain-transformer baseline.

Post-norm blocks as in HRM: ``h = rmsnorm(h + mix(h)); h = rmsnorm(h + swiglu(h))`` where ``mix`` is
non-causal self-attention (SDPA, rotary positions) or, for TRM's ``mlp_t`` variant, a SwiGLU across
the sequence axis. RMSNorm has no learned scale and runs in fp32. No biases anywhere. Weights start
from a truncated normal (±2 std) whose *actual* standard deviation is the one asked for.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

# std of a standard normal truncated to [-2, 2]; dividing by it makes the truncated draw's std exact
_TRUNC2_STD = 0.8796256610342398


def trunc_normal_(tensor: torch.Tensor, std: float) -> torch.Tensor:
    """Fill with a normal truncated at ±2 standard deviations whose std after truncation is ``std``."""
    if std == 0:
        return tensor.zero_()
    scale = std / _TRUNC2_STD
    with torch.no_grad():
        return nn.init.trunc_normal_(tensor, std=scale, a=-2 * scale, b=2 * scale)


def lecun_linear(in_features: int, out_features: int) -> nn.Linear:
    """A bias-free linear layer initialised with std 1/sqrt(fan_in), as HRM's layers are."""
    layer = nn.Linear(in_features, out_features, bias=False)
    trunc_normal_(layer.weight, 1.0 / math.sqrt(in_features))
    return layer


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a learned scale, computed in fp32 and returned in the input's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def swiglu_width(width: int, expansion: float, multiple: int = 256) -> int:
    """HRM's rule: round(expansion * width * 2/3), rounded up to a multiple of ``multiple``."""
    inner = round(expansion * width * 2 / 3)
    return multiple * math.ceil(inner / multiple)


class SwiGLU(nn.Module):
    def __init__(self, width: int, expansion: float):
        super().__init__()
        inner = swiglu_width(width, expansion)
        self.gate_up = lecun_linear(width, 2 * inner)
        self.down = lecun_linear(inner, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Rotary(nn.Module):
    """Rotary position embedding ("rotate half" layout) for ``seq_len`` positions."""

    def __init__(self, head_dim: int, seq_len: int, theta: float):
        super().__init__()
        self.head_dim, self.seq_len, self.theta = head_dim, seq_len, theta
        self.register_buffer("cos", torch.empty(seq_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(seq_len, head_dim), persistent=False)
        self.reset_buffers(self.cos.device)

    def reset_buffers(self, device: torch.device | str) -> None:
        """Compute the tables (on ``device``): at construction, and after a load onto the meta device."""
        if torch.device(device).type == "meta":
            return  # shapes only (the empty tables registered): computed once the model has a real device
        hd = self.head_dim
        inv_freq = self.theta ** (-torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd)
        freqs = torch.outer(torch.arange(self.seq_len, dtype=torch.float32, device=device), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, heads, S, head_dim]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return (x * self.cos.to(x.dtype) + rotated * self.sin.to(x.dtype))


class Attention(nn.Module):
    """Non-causal multi-head self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, hidden: int, num_heads: int, rotary: Rotary | None):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.qkv = lecun_linear(hidden, 3 * hidden)
        self.out = lecun_linear(hidden, hidden)
        self.rotary = rotary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=False)
        return self.out(y.transpose(1, 2).reshape(b, s, h))


class TokenMixer(SwiGLU):
    """TRM's ``mlp_t``: a SwiGLU across the sequence axis (MLP-Mixer style), shared by all channels.
    Its block feeds it ``[B, H, S]`` and normalises over the sequence axis too, as TRM does."""

    def __init__(self, seq_len: int, expansion: float):
        super().__init__(seq_len, expansion)


class PostNormBlock(nn.Module):
    def __init__(self, mixer: nn.Module, hidden: int, expansion: float, eps: float):
        super().__init__()
        self.mixer = mixer
        self.mlp = SwiGLU(hidden, expansion)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.mixer, TokenMixer):
            xt = x.transpose(1, 2)
            x = rms_norm(xt + self.mixer(xt), self.eps).transpose(1, 2)
        else:
            x = rms_norm(x + self.mixer(x), self.eps)
        return rms_norm(x + self.mlp(x), self.eps)


class ReasoningModule(nn.Module):
    """A stack of blocks whose input is ``state + injection`` (HRM's input injection is an addition)."""

    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.checkpointing = False

    def forward(self, state: torch.Tensor, injection: torch.Tensor) -> torch.Tensor:
        x = state + injection
        for block in self.blocks:
            if self.checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return x


def stablemax_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross-entropy under stablemax, 0 at ignored positions.

    ``s(x) = x + 1`` for ``x >= 0`` and ``1 / (1 - x)`` below; ``p_i = s(x_i) / sum_j s(x_j)``.
    Computed in float64 (float32 on Apple MPS, which has no float64), as HRM does.
    """
    dtype = torch.float32 if logits.device.type == "mps" else torch.float64
    x = logits.to(dtype)
    s = torch.where(x >= 0, x + 1, 1.0 / (1.0 - torch.clamp(x, max=0.0)))
    log_p = torch.log(s) - torch.log(s.sum(dim=-1, keepdim=True))
    valid = labels != ignore_index
    picked = log_p.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, -picked, torch.zeros_like(picked))


def softmax_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Per-token softmax cross-entropy in fp32, 0 at ignored positions."""
    flat = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=ignore_index, reduction="none")
    return flat.view(labels.shape)


LOSSES = {"stablemax": stablemax_cross_entropy, "softmax": softmax_cross_entropy}
