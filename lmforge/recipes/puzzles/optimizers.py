"""Optimizers beyond AdamW, in pure PyTorch (no CUDA extension to build): AdamATan2 and sign-SGD.

``AdamATan2SignSGD`` is one optimizer whose parameter groups each name their algorithm
(``group["algorithm"]``), so a model that wants AdamATan2 for its weights and sign-SGD for a sparse
embedding table (HRM, TRM) hands the training loop a single optimizer, with one lr/wd per group.

AdamATan2 (Everett et al., 2024): Adam with ``atan2(m_hat, sqrt(v_hat))`` in place of
``m_hat / (sqrt(v_hat) + eps)``: bounded, scale-invariant, and with no epsilon to tune::

    m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
    p = p (1 - lr wd) - lr atan2(m / (1 - b1^t), sqrt(v / (1 - b2^t)))

Sign-SGD for embedding tables: ``p = p (1 - lr wd) - lr sign(g)``, applied only to the rows whose
gradient is non-zero, i.e. the rows the batch used (an embedding's backward writes nothing into the
others). Rows outside the batch are neither moved nor decayed. Under DDP the gradient is averaged
before the step, so every rank updates the same rows.
"""

from __future__ import annotations

from typing import Any

import torch

ALGORITHMS = ("adam_atan2", "sign_sgd")


class AdamATan2SignSGD(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.95),
                 weight_decay: float = 0.0, algorithm: str = "adam_atan2"):
        if lr < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid lr={lr}, weight_decay={weight_decay} or betas={betas}")
        defaults = {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay, "algorithm": algorithm}
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["algorithm"] not in ALGORITHMS:
                raise ValueError(f"unknown algorithm {group['algorithm']!r}; choose from {ALGORITHMS}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["algorithm"] == "sign_sgd":
                self._sign_sgd(group)
            else:
                self._adam_atan2(group)
        return loss

    def _adam_atan2(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        beta1, beta2 = group["betas"]
        lr, wd = group["lr"], group["weight_decay"]
        grads, exp_avgs, exp_avg_sqs = [], [], []
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError("AdamATan2 does not take sparse gradients; use sign_sgd for that group")
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        if wd != 0:
            torch._foreach_mul_(params, 1 - lr * wd)
        for p, m, v in zip(params, exp_avgs, exp_avg_sqs):
            t = float(self.state[p]["step"])
            m_hat = m / (1 - beta1 ** t)
            v_hat = v / (1 - beta2 ** t)
            p.add_(torch.atan2(m_hat, v_hat.sqrt()), alpha=-lr)

    @staticmethod
    def _sign_sgd(group: dict[str, Any]) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                g = g.coalesce().to_dense()
            used = (g != 0).reshape(g.shape[0], -1).any(dim=1) if g.dim() > 1 else g != 0
            rows = used.nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            p[rows] = p[rows] * (1 - lr * wd) - lr * torch.sign(g[rows])


__all__ = ["AdamATan2SignSGD", "ALGORITHMS"]
