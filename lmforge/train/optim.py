"""AdamW, the optimizer of every kind that does not bring its own, and its 8-bit form.

``training.optimizer_states`` says how AdamW keeps its two moments per weight:

- ``fp32`` (default): PyTorch's AdamW, fused where the device has a kernel; 8 bytes a weight.
- ``8bit``: ``AdamW8bit`` below, 2 bytes a weight and 8 bytes of scales per block (of up to 256 weights: at
  most 2.03 bytes a weight for rows of 256 or more): what seeds 000 and 001 ask for with the Trainer's
  ``optim="adamw_8bit"`` when a model does not fit. At 1.3B parameters the moments drop from 10.4 GB to 2.6 GB.

How ``AdamW8bit`` keeps a moment: each row of a weight matrix is cut into blocks of up to 256 values; a
block keeps its largest magnitude over 448 as a scale (fp32) and each value as an 8-bit float (e4m3: 3 bits
of mantissa, magnitudes from 448 down to 2^-9, so down to ~2^-18 of the block's largest) times the scale. The
second moment is kept as its square root, whose range is half as wide in exponent. Every step reads the
moments back to fp32, updates them and the weight exactly as AdamW does, and writes them back rounded
*stochastically* (up or down with the odds that make the rounding exact on average; below 2^-6 of the scale,
e4m3's subnormals, to nearest): with round-to-nearest, an average that moves by less than half a step of the
8-bit grid (the second moment moves 0.1-5% a step) would never move at all. Vectors (norms, biases) and
matrices under 4,096 values keep fp32 moments: they are a sliver of the memory. Blocks follow rows, so a
weight's row is never split across blocks; a matrix whose row length has no divisor between 64 and 256 keeps
fp32 moments too.

The rounding's random bits are a hash of each value's place, not draws from a ``torch.Generator``
(``random_bits``: murmur3's 32-bit finalizer of the value's flat index in its parameter plus a key that the
host mixes from the seed, the step and the parameter's index; its low 20 bits round the first moment, its high
20 the second): a resumed run and every DDP process get the same bits, whatever rows are stepped together,
for a dozen integer operations per value and no generator per parameter.

Under FSDP (``training.parallel`` fsdp / hsdp: FSDP2's parameters are DTensors split by rows, dimension 0, as
``torch.chunk`` splits them) each process keeps the moments of its own rows: the codes are a DTensor of the
parameter's shape and the scales one of shape (rows, blocks), both sharded as the parameter is, and each
process steps the local tensors of its rows (blocks never cross a row, so a block is always whole on one
process). Their random bits are those of the rows' places in the whole parameter (the key of its local values
plus the flat index of its first one), so two processes write the codes one process would, given the same
gradients. A process that holds no rows of a parameter (fewer rows than processes) skips it. Being DTensors,
the codes and scales go through ``torch.distributed.checkpoint`` like any optimizer state: a sharded checkpoint
resumes on any number of processes, and gathered (``fsdp.full_optimizer_state``) they are a single process's
state, the same entries and shapes, so checkpoints move between sharded and unsharded runs either way.
``training.fsdp_offload`` keeps them with the shards in CPU memory, where the CPU's eager step runs.

How a step runs (launch-bound on a GPU, a string of passes over memory on a CPU):

- the 8-bit parameters: with ``compile=True`` (``training.compile``), one ``torch.compile``'d function over
  all of them, in which Inductor fuses each parameter's dequantize, AdamW and quantize into a kernel or a few.
  What changes from step to step (lr, bias corrections, hash keys) goes in as data, one small tensor copied
  to the device per step, so a learning-rate schedule never recompiles it. Without compile, or where
  compiling fails (a warning, then eager), the same code runs eagerly over whole rows, ~4M values at a time
  on a GPU (bounded temporaries), 128K on a CPU (temporaries that stay in its cache).
- the fp32-moment parameters: PyTorch's fused AdamW kernel, one call per parameter group.

``found_inf`` (set by the training loop: a device scalar, 1 after a non-finite step) makes both leave weights
and moments as they were, masking their writes on the device without the host reading it (the eager step on
a CPU reads it: there that waits for nothing).
"""

from __future__ import annotations

import inspect
import math
import sys
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from lmforge.config import OPTIMIZER_STATES
from lmforge.device import adamw_kernels
from lmforge.errors import LMForgeError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
MIN_8BIT_SIZE = 4096  # smaller tensors keep fp32 moments
# Values of a parameter stepped together eagerly (whole rows): bounds the fp32 temporaries (~10 of 16 MB); on the
# CPU, whose eager step is ~40 passes over them, small enough that they stay in its cache (~1.4x faster)
_CHUNK_VALUES = 1 << 22
_CPU_CHUNK_VALUES = 1 << 17
_DROPPED_BITS = 20  # fp32 has 23 bits of mantissa, e4m3 keeps 3
_KEPT_AS_SAVED = ("exp_avg", "exp_avg_scale", "exp_avg_sq_sqrt", "exp_avg_sq_sqrt_scale", "exp_avg_sq")
_HYPER = 5  # numbers per 8-bit parameter and step (``_hyper``)
_MASK64 = (1 << 64) - 1


def block_size(row: int) -> int | None:
    """Values per block for rows of ``row`` values: the whole row up to 256, else the largest divisor of
    the row between 64 and 256; None where there is none, or rows are under 32 values (the tensor keeps fp32
    moments: an 8-byte scale per few values would cost more than fp32 itself)."""
    if row < 32:
        return None
    if row <= 256:
        return row
    return next((b for b in range(256, 63, -1) if row % b == 0), None)


def _int32(x: int) -> int:
    """The int32 whose bits are ``x``'s low 32."""
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >= 1 << 31 else x


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def rounding_key(seed: int, step: int, index: int) -> int:
    """The key (an int32) of ``random_bits`` for parameter ``index`` at ``step``: a 64-bit mix of the three on
    the host, in Python ints (the same in every process)."""
    return _int32(_splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ step) ^ index))


_M1, _M2 = _int32(0x85EBCA6B), _int32(0xC2B2AE35)  # murmur3's finalizer constants
_LOW = (1 << _DROPPED_BITS) - 1


def random_bits(index: torch.Tensor, key: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
    """``_DROPPED_BITS`` random bits (int32 in [0, 2^20)) per value of ``index`` (int32: flat indices in a
    parameter) for each moment: the low and the high 20 bits of one 32-bit hash of index + key (murmur3's
    finalizer, a bijection whose every output bit flips with odds ~1/2 when any input bit does, so neighbouring
    indices get unrelated bits). The two share 8 bits, the low ones of the second moment's: their correlation
    is 2^-12, and either alone is uniform. The int32 products wrap (eager, Triton; Inductor's C++ on a CPU in
    practice, where signed overflow is formally undefined: the compiled-against-eager test would see it); ``>>``
    is arithmetic on int32, so each shift is masked to be logical."""
    x = index + key
    x ^= (x >> 16) & 0xFFFF
    x *= _M1
    x ^= (x >> 13) & 0x7FFFF
    x *= _M2
    x ^= (x >> 16) & 0xFFFF
    return x & _LOW, (x >> (32 - _DROPPED_BITS)) & _LOW


def _round(x: torch.Tensor, bits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (rows, blocks, block) over its blocks' scales (rows, blocks), rounded to e4m3's grid but for its
    subnormals (cast to nearest later); and the scales."""
    # (a floor under the largest magnitude: 448 / a moment decayed to float's subnormals would be inf)
    amax = x.abs().amax(dim=-1).clamp_(min=2.0 ** -100)
    # x times 448 / amax rounded down (by 8 float steps: more than a division's error anywhere): no value ends
    # over 448, where e4m3 has no finite code, without a clamp (a relative bias of 2^-20, 8-bit steps are 2^-3)
    y = x * ((FP8_MAX * (1 - 2.0 ** -20)) / amax).unsqueeze(-1)
    if bits is not None:
        # Add random bits below the 3 kept ones and cut them off: rounds the magnitude up with the odds of its
        # distance to the grid point below (the sign bit is never reached by the carry, 448 is on the grid).
        y = (y.view(torch.int32) + bits).bitwise_and_(-(1 << _DROPPED_BITS)).view(torch.float32)
    return y, amax / FP8_MAX


def quantize(x: torch.Tensor, bits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` of shape (rows, blocks, block) as (e4m3 codes stored as uint8 of the same shape, fp32 scales of
    shape (rows, blocks)): value = code x scale. ``bits`` (one of ``random_bits``, of x's shape): round
    stochastically with them; None: to nearest."""
    y, scale = _round(x, bits)
    return y.to(FP8).view(torch.uint8), scale


def _code(y: torch.Tensor) -> torch.Tensor:
    """The e4m3 codes of ``y`` (magnitudes up to 448, with at most 3 bits of mantissa from 2^-6 up; below,
    e4m3's subnormals, rounded to nearest even) as PyTorch's cast gives them, but as fp32 values (0., ..., 255.)
    and from integer operations: compiled, Inductor's CPU cast to e4m3 is a scalar loop, and its casts to uint8
    from int32 or of a select are slow, from fp32 fast. (A NaN or inf gives no valid code: the training loop's
    ``found_inf`` keeps such a step from being written.)"""
    bits = y.view(torch.int32)
    magnitude = bits & 0x7FFFFFFF
    code = torch.where(magnitude >= 121 << 23,  # from 2^-6 up: fp32's exponent and top 3 bits, re-biased
                       ((magnitude >> 20) - ((127 - 7) << 3)).float(), torch.round(y.abs() * 2.0 ** 9))
    return code + torch.where(bits < 0, 128.0, 0.0)


def _store(codes: torch.Tensor, y: torch.Tensor, skip: torch.Tensor | None) -> None:
    """Writes the e4m3 codes of ``y`` (``_round``'s) into ``codes`` (uint8), unless ``skip`` (a bool)."""
    if torch.compiler.is_compiling():
        codes.copy_((_code(y) if skip is None else torch.where(skip, codes.float(), _code(y))).to(torch.uint8))
    elif skip is None:
        codes.view(FP8).copy_(y)  # cast and written in one pass
    else:
        codes.copy_(torch.where(skip, codes, y.to(FP8).view(torch.uint8)))


_FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8).float()  # each code's value


def _decode(codes: torch.Tensor) -> torch.Tensor:
    """The fp32 values of e4m3 ``codes`` (uint8), as PyTorch's cast gives them (but 480 for NaN's codes, which
    ``_code`` never gives)."""
    if torch.compiler.is_compiling():  # from the code's bits again: Inductor's CPU cast from e4m3 is slow too
        c = codes.int()
        magnitude = c & 0x7F
        normal = ((magnitude + ((127 - 7) << 3)) << 20).view(torch.float32)
        value = torch.where(magnitude >= 8, normal, magnitude.float() * 2.0 ** -9)
        return torch.where(c >= 128, -value, value)
    if codes.device.type == "cpu":  # PyTorch's eager CPU cast from e4m3 is ~3x slower than looking values up
        return _FP8_VALUES.index_select(0, codes.reshape(-1).int()).view(codes.shape)
    return codes.view(FP8).float()


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _decode(codes).mul_(scale.unsqueeze(-1))


def _set(target: torch.Tensor, value: torch.Tensor, skip: torch.Tensor | None) -> None:
    target.copy_(value if skip is None else torch.where(skip, target, value))


def _hyper(group: dict[str, Any], step: int) -> list[float]:
    """The numbers of an 8-bit parameter's ``step`` in ``group``, for ``_adamw_rows``: 1 - lr x weight decay,
    -lr x sqrt(1 - beta2^t) / (1 - beta1^t), eps x sqrt(1 - beta2^t), 1 - beta1, 1 - beta2. AdamW's
    lr / (1 - beta1^t) x m / (sqrt(v / (1 - beta2^t)) + eps) with the bias corrections moved out of the
    per-value work."""
    beta1, beta2 = group["betas"]
    lr = float(group["lr"])
    bias2_sqrt = math.sqrt(1 - beta2 ** step)
    return [1 - lr * group["weight_decay"], -lr * bias2_sqrt / (1 - beta1 ** step), group["eps"] * bias2_sqrt,
            1 - beta1, 1 - beta2]


def _adamw_rows(p: torch.Tensor, grad: torch.Tensor, m_codes: torch.Tensor, m_scale: torch.Tensor,
                r_codes: torch.Tensor, r_scale: torch.Tensor, hyper: torch.Tensor, key: torch.Tensor,
                skip: torch.Tensor | None, first: int) -> None:
    """One AdamW step of rows of an 8-bit parameter, in place: ``p``, ``grad`` and the codes of shape (rows,
    blocks, block), the scales (rows, blocks), ``hyper`` (``_HYPER`` values) and ``key`` (``rounding_key``) on
    the device. ``first``: the flat index of the rows' first value in the (local) parameter: the random bits
    follow it, not the rows stepped together (under FSDP ``key`` adds the index of the process's first value in
    the whole parameter). With ``skip`` (a bool on the device) true, everything is left as it was."""
    decay, minus_step, eps, one_minus_beta1, one_minus_beta2 = hyper.unbind()
    grad = grad.float()
    m = dequantize(m_codes, m_scale).lerp_(grad, one_minus_beta1)
    r = dequantize(r_codes, r_scale)  # the second moment's square root
    r = r.mul_(r).lerp_(grad * grad, one_minus_beta2).sqrt_()
    update = m / (r + eps)  # times -minus_step; r and eps unscaled by the bias correction (see ``_hyper``)
    if skip is None and p.dtype == torch.float32:
        p.mul_(decay).addcmul_(update, minus_step)  # what the line below computes, in place
    else:
        _set(p, torch.addcmul(p.float() * decay, update, minus_step).to(p.dtype), skip)
    index = torch.arange(first, first + p.numel(), dtype=torch.int32, device=p.device).view(p.shape)
    for codes, scale, value, bits in zip((m_codes, r_codes), (m_scale, r_scale), (m, r), random_bits(index, key)):
        y, new_scale = _round(value, bits)
        _store(codes, y, skip)
        _set(scale, new_scale, skip)


def _step_8bit(params: list[torch.Tensor], grads: list[torch.Tensor], m_codes: list[torch.Tensor],
               m_scales: list[torch.Tensor], r_codes: list[torch.Tensor], r_scales: list[torch.Tensor],
               hyper: torch.Tensor, keys: torch.Tensor, skip: torch.Tensor | None, chunk: int | None) -> None:
    """AdamW8bit's step of its 8-bit parameters: an entry of each list and of ``hyper``, ``keys`` per parameter,
    the parameters, gradients and codes viewed as (rows, blocks, block) (by the caller: compiled, views made
    here would be written back to their bases in extra passes); whole rows about ``chunk`` values at a time
    (None: each parameter at once, as compiled)."""
    for i, p in enumerate(params):
        rows = p.shape[0]
        step = rows if chunk is None else max(1, chunk // (p.numel() // rows))
        for start in range(0, rows, step):
            rows_of = (t[start:start + step] for t in (p, grads[i], m_codes[i], m_scales[i], r_codes[i], r_scales[i]))
            _adamw_rows(*rows_of, hyper[i], keys[i], skip, start * (p.numel() // rows))


def _compile_errors() -> tuple[type[BaseException], ...]:
    """What a failed compile raises: Dynamo's errors (Inductor's are wrapped in them), and hitting the recompile
    limit under fullgraph (not a TorchDynamoException in torch 2.13; named FailOnCacheLimitHit before 2.6)."""
    import torch._dynamo.exc as exc

    return (exc.TorchDynamoException, *(getattr(exc, name) for name in ("FailOnRecompileLimitHit",
                                                                        "FailOnCacheLimitHit") if hasattr(exc, name)))


def _compile(fn: Any) -> Any:
    """``fn`` compiled whole (no graph break, no dynamic shapes: one graph per set of parameter shapes), its
    recompilations counted apart from other optimizers' where torch can; None where torch.compile cannot be
    set up here."""
    isolated = {"isolate_recompiles": True} if "isolate_recompiles" in inspect.signature(torch.compile).parameters \
        else {}
    try:
        return torch.compile(fn, fullgraph=True, dynamic=False, **isolated)
    except Exception as e:  # noqa: BLE001 (e.g. a Python that Dynamo does not support)
        warnings.warn(f"AdamW8bit steps eagerly: torch.compile is unavailable ({type(e).__name__}: {e})", stacklevel=3)
        return None


def _is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (FSDP2's parameters, their gradients, their states). Without importing
    torch.distributed.tensor (seconds) where nothing has: no DTensor exists then."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of ``t``: a DTensor's local tensor (a view: written in place), else ``t``."""
    return t._local_tensor if _is_dtensor(t) else t


def _sharded_like(p: torch.Tensor, local: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``local`` (a state's rows of ``p``'s local rows) as a DTensor of global ``shape``, sharded as ``p`` is,
    where ``p`` is a DTensor; else ``local`` itself."""
    if not _is_dtensor(p):
        return local
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    # Built as FSDP2 builds its sharded parameters, not with DTensor.from_local, which would move ``local`` to the
    # mesh's device type: under training.fsdp_offload the mesh is CUDA's while the shards (and so the moments)
    # stay in CPU memory.
    stride = torch.empty(shape, device="meta").stride()
    spec = DTensorSpec(p.device_mesh, p.placements, tensor_meta=TensorMeta(torch.Size(shape), stride, local.dtype))
    return type(p)(local, spec, requires_grad=False)


def _first_index(p: torch.Tensor) -> int:
    """The flat index in ``p`` (a DTensor: in the whole parameter) of this process's first value. A DTensor
    must be split by rows only (FSDP2's Shard(0), over any mesh: hsdp's (Replicate, Shard(0)) too): the
    8-bit step works on whole rows."""
    if not _is_dtensor(p):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if tuple(shape[1:]) != tuple(p.shape[1:]) or any(offset[1:]):
        raise LMForgeError(f"training.optimizer_states=8bit steps a sharded parameter by whole rows, and this one "
                           f"(shape {tuple(p.shape)}) is split along another dimension ({p.placements}): shard "
                           "dimension 0 only (FSDP2's default), or use training.optimizer_states=fp32")
    return int(offset[0]) * (p.numel() // p.shape[0])


class AdamW8bit(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments) with 8-bit moments; see the module's text.

    State per 8-bit parameter: ``exp_avg`` and ``exp_avg_sq_sqrt`` (uint8 codes, the parameter's shape),
    ``exp_avg_scale`` and ``exp_avg_sq_sqrt_scale`` (fp32, one per block), ``step`` (a CPU tensor, read
    without waiting for the device). Others: ``exp_avg``, ``exp_avg_sq`` in fp32, as torch's AdamW. For a
    parameter FSDP shards (a DTensor), the moments are DTensors sharded as it is (see the module's text).
    ``found_inf``, when the training loop sets it (a device scalar, 1 after a non-finite step), makes
    each step leave weights and moments as they were, without the host reading it (but for the eager step of
    parameters on the CPU, where reading it waits for nothing); the step count still advances (the loop stops
    at its next check step, from the checkpoint before, so it is never used). ``compile``: step the 8-bit
    parameters with one compiled function (see the module's text); its graph follows which parameters have
    gradients, so a model whose set changes from step to step recompiles, and after torch's recompile limit
    (8) steps eagerly, with a warning."""

    takes_found_inf = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, seed: int = 0, compile: bool = False):
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise LMForgeError(f"AdamW's betas must be in [0, 1), got {betas}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.seed = int(seed)
        self.found_inf: torch.Tensor | None = None
        self._compiled = _compile(_step_8bit) if compile else None
        self._firsts: dict[torch.Tensor, int] = {}  # each sharded 8-bit parameter's ``_first_index``

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
        # the saved groups' parameter keys (numbers; names where torch.distributed.checkpoint hands the state
        # in: its values then DTensors, sharded as the parameters are) in the order of this optimizer's
        keys = [k for g in state_dict["param_groups"] for k in g["params"]]
        params = dict(zip(keys, (p for g in self.param_groups for p in g["params"]), strict=True))
        for key, entry in kept.items():
            for name, value in entry.items():
                self.state[params[key]][name] = value.to(params[key].device)

    @staticmethod
    def _layout(p: torch.Tensor) -> tuple[int, int, int] | None:
        """(rows, blocks per row, block) of an 8-bit parameter; None for fp32 moments."""
        if p.dim() < 2 or not MIN_8BIT_SIZE <= p.numel() < 2**31 or not p.is_contiguous():
            return None  # (2^31 values and up: the random bits' int32 index would overflow)
        rows = p.shape[0]
        block = block_size(p.numel() // rows)
        return None if block is None else (rows, p.numel() // rows // block, block)

    def _init_state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        state["step"] = torch.zeros((), dtype=torch.int64)
        layout = self._layout(p)
        if layout is None:  # (a DTensor's zeros_like is a DTensor sharded as it is)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
        else:
            local = _local(p)
            for name in ("exp_avg", "exp_avg_sq_sqrt"):  # code 0 is 0.0
                state[name] = _sharded_like(p, torch.zeros(local.shape, dtype=torch.uint8, device=local.device),
                                            tuple(p.shape))
                state[f"{name}_scale"] = _sharded_like(
                    p, torch.zeros((local.shape[0], layout[1]), dtype=torch.float32, device=local.device), layout[:2])
        return state

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 (torch's signature)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = []  # (group, parameter index, parameter, state)
        index = -1
        for group in self.param_groups:
            for p in group["params"]:
                index += 1  # counted over every parameter, with or without a gradient: stable across steps
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise LMForgeError("training.optimizer_states=8bit does not take sparse gradients")
                todo.append((group, index, p, self.state[p] or self._init_state(p)))
        if todo:
            steps = [state["step"] for *_, state in todo]
            torch._foreach_add_(steps, 1)
            counts = torch.stack(steps).tolist()  # one read of the CPU counters, not one per parameter
            for device in dict.fromkeys(p.device for _, _, p, _ in todo):
                here = [(*t, int(n)) for t, n in zip(todo, counts, strict=True) if t[2].device == device]
                self._step_on(device, here)
        return loss

    def _step_on(self, device: torch.device, todo: list[tuple[dict[str, Any], int, torch.Tensor, dict[str, Any], int]]
                 ) -> None:
        """The step of ``todo``'s parameters (group, index, parameter, state, step count), all on ``device``."""
        # Under FSDP each process steps its own rows (DTensors' local tensors: views, written in place), with
        # the rounding bits of their places in the whole parameter (``random_bits`` hashes index + key: the key
        # plus the flat index of the first local value is the whole parameter's key for local indices), and
        # skips a parameter it holds no rows of (fewer rows than processes).
        todo = [t for t in map(self._local_part, todo) if t[2].numel()]
        if not todo:
            return
        eight = [t for t in todo if "exp_avg_scale" in t[4]]
        small = [t for t in todo if "exp_avg_scale" not in t[4]]
        # Every number the step needs on the device, in one host-to-device copy: the 8-bit parameters'
        # hyper-parameters, the fp32 ones' step counts (read there by the fused kernel), the hash keys.
        floats, keys = [], []
        for group, index, _, _, _, step, first in eight:
            floats += _hyper(group, step)
            keys.append(_int32(rounding_key(self.seed, step, index) + first))
        floats += [float(t[5]) for t in small]
        # (as int32: the keys' bits never pass through a float copy, where some would read as NaN)
        host = torch.cat([torch.tensor(floats, dtype=torch.float32).view(torch.int32),
                          torch.tensor(keys, dtype=torch.int32)])
        if device.type == "cuda":  # pinned: copied without the host waiting (torch keeps the block until then)
            host = host.pin_memory()
        packed = host.to(device, non_blocking=True)
        numbers = packed[:len(floats)].view(torch.float32)
        hyper = numbers[:_HYPER * len(eight)].view(len(eight), _HYPER)
        small_steps = numbers[_HYPER * len(eight):].unbind()
        keys_on_device = packed[len(floats):]
        # the loop's flag, on this device (a no-op where it is already there)
        skip = None if self.found_inf is None else self.found_inf.to(device, non_blocking=True)
        if eight:
            shapes = [(*t[4]["exp_avg_scale"].shape, -1) for t in eight]  # (rows, blocks, block)
            states = [t[4] for t in eight]
            self._step_8bit([t[2].view(s) for t, s in zip(eight, shapes)],
                            [t[3].reshape(s) for t, s in zip(eight, shapes)],
                            [s["exp_avg"].view(shape) for s, shape in zip(states, shapes)],
                            [s["exp_avg_scale"] for s in states],
                            [s["exp_avg_sq_sqrt"].view(shape) for s, shape in zip(states, shapes)],
                            [s["exp_avg_sq_sqrt_scale"] for s in states], hyper, keys_on_device, skip)
        groups: dict[int, list[int]] = {}
        for k, t in enumerate(small):
            groups.setdefault(id(t[0]), []).append(k)
        for ks in groups.values():
            group = small[ks[0]][0]
            params = [small[k][2] for k in ks]
            # The fused kernel takes one dtype: other weights (bf16, ...) are stepped in an fp32 copy
            params32 = [p if p.dtype == torch.float32 else p.float() for p in params]
            torch._fused_adamw_(params32, [small[k][3].float() for k in ks], [small[k][4]["exp_avg"] for k in ks],
                                [small[k][4]["exp_avg_sq"] for k in ks], [], [small_steps[k] for k in ks],
                                lr=float(group["lr"]), beta1=group["betas"][0], beta2=group["betas"][1],
                                weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False, maximize=False,
                                grad_scale=None, found_inf=skip)
            for p, p32 in zip(params, params32, strict=True):
                if p32 is not p:
                    p.copy_(p32)

    def _local_part(self, entry: tuple[dict[str, Any], int, torch.Tensor, dict[str, Any], int]) -> tuple[Any, ...]:
        """``_step_on``'s entry (group, index, parameter, state, step count) as (group, index, parameter, gradient,
        state, step count, first): of a DTensor, this process's parts (local tensors) and the flat index of its
        first value in the whole parameter (``_first_index``, worked out once per parameter); else 0."""
        group, index, p, state, step = entry
        if not _is_dtensor(p):
            return group, index, p, p.grad, state, step, 0
        first = self._firsts.get(p)
        if first is None and "exp_avg_scale" in state:
            first = self._firsts[p] = _first_index(p)
        return group, index, _local(p), _local(p.grad), {k: _local(v) for k, v in state.items()}, step, first or 0

    def _step_8bit(self, *args: Any) -> None:
        """``_step_8bit`` of ``args`` (its arguments but ``chunk``, and ``found_inf`` for ``skip``): compiled, or
        eagerly."""
        if self._compiled is not None:
            *tensors, found_inf = args
            try:
                self._compiled(*tensors, None if found_inf is None else found_inf > 0, None)
                return
            except _compile_errors() as e:  # Dynamo's and Inductor's, raised before any kernel ran
                warnings.warn(f"AdamW8bit steps eagerly from now on: compiling its step failed ({type(e).__name__}: "
                              f"{str(e)[:500]})", stacklevel=3)
                self._compiled = None
        *args, found_inf = args
        on_cpu = args[0][0].device.type == "cpu"
        if found_inf is not None and on_cpu:
            # Read on the host, where that waits for nothing: a skipped step is not run, others need no masks
            if found_inf.item() > 0:
                return
            found_inf = None
        _step_8bit(*args, None if found_inf is None else found_inf > 0, _CPU_CHUNK_VALUES if on_cpu else _CHUNK_VALUES)


def make_adamw(groups: list[dict[str, Any]], cfg: Any, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over ``groups`` with the run's betas, eps and lr, its moments kept as
    ``training.optimizer_states`` says."""
    t = cfg.training
    if t.optimizer_states == "8bit":
        if device.type == "mps":
            raise LMForgeError("training.optimizer_states=8bit keeps its moments as 8-bit floats, which PyTorch has "
                               "no kernels for on MPS: drop it on this Mac (or train with training.device=cpu)")
        return AdamW8bit(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, seed=cfg.seed, compile=t.compile)
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, **adamw_kernels(device))


def default_optimizer(model: Any, cfg: Any, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over the model's parameter groups: the optimizer of every kind that does not name its own
    (``RecipeSpec.make_optimizer``)."""
    return make_adamw(model.param_groups(cfg.training.weight_decay, cfg.training.lr), cfg, device)


def moment_bytes(params: Iterable[torch.Tensor], optimizer_states: str) -> int:
    """Bytes AdamW's moments of ``params`` take with ``optimizer_states`` (fp32 | 8bit), from their shapes
    (meta tensors do): 8 a weight in fp32; 2 a weight plus 8 per block in 8 bits. Whole tensors: under FSDP,
    the total over the processes."""
    total = 0
    for p in params:
        layout = AdamW8bit._layout(p) if optimizer_states == "8bit" else None
        total += 8 * p.numel() if layout is None else 2 * p.numel() + 8 * layout[0] * layout[1]
    return total


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes the optimizer's state tensors hold on this process (moments, scales, steps)."""
    return sum(_local(v).numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if torch.is_tensor(v))  # (under FSDP: this process's shards)


__all__ = ["AdamW8bit", "OPTIMIZER_STATES", "block_size", "default_optimizer", "dequantize", "make_adamw",
           "moment_bytes", "quantize", "random_bits", "rounding_key", "state_bytes"]
