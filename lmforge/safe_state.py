"""Training state in files that cannot run code: tensors in safetensors, the rest as JSON.

What a resume needs beyond the weights (optimizer moments, the loss scaler, a model's extra state, every
random-number generator) is a nested structure of dicts, lists and tuples holding tensors, numpy arrays
and plain values. ``save_state`` writes it as ONE safetensors file: each tensor (and numpy array, as raw
bytes) under a generated key, and the structure, with those replaced by references, as JSON in the file's
metadata. ``load_state`` rebuilds it. Neither can execute anything: safetensors holds numbers, JSON holds
data, and the decoder accepts only the node kinds below — unlike ``torch.load``, which unpickles.

Encoding (every container is an object with one tag, so no user key can be mistaken for a tag)::

    None, bool, int, float, str -> themselves       tensor   -> {"t": KEY}
    list -> {"l": [...]}   tuple -> {"tu": [...]}    ndarray  -> {"nd": KEY, "dtype": "<u4", "shape": [...]}
    dict -> {"d": [[key, value], ...]}   (keys: None, bool, int, float or str, e.g. an optimizer's param ids)

Checkpoints written before this format held ``optimizer.pt`` / ``rng_state.pt`` (pickles).
``load_legacy_torch_file`` reads them with torch's restricted unpickler (``weights_only=True``) and an
allow-list of the three numpy names an RNG state needs: anything else in such a file is refused.
"""

from __future__ import annotations

import json
import math
import pickle  # only for its exception type: nothing here unpickles outside torch's restricted loader
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.errors import LMForgeError

FORMAT = "lmforge-state"
VERSION = 1
_SCALARS = (type(None), bool, int, float, str)
_NUMPY_KINDS = "biufc"  # numeric numpy dtypes only: no object arrays


class _Encoder:
    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self._storages: set[int] = set()

    def _add(self, tensor: torch.Tensor) -> str:
        t = tensor.detach().cpu()
        # safetensors refuses tensors that share memory (views, or state aliasing a parameter): copy those.
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        if ptr is not None and ptr in self._storages:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        if ptr is not None:
            self._storages.add(ptr)
        key = str(len(self.tensors))
        self.tensors[key] = t.contiguous()
        return key

    def encode(self, obj: Any, where: str) -> Any:
        if isinstance(obj, float) and not math.isfinite(obj):
            return {"f": repr(obj)}  # nan / inf / -inf, which strict JSON has no literal for
        if isinstance(obj, _SCALARS):
            return obj
        if isinstance(obj, torch.Tensor):
            return {"t": self._add(obj)}
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind not in _NUMPY_KINDS:
                raise TypeError(f"{where}: numpy arrays of dtype {obj.dtype} cannot be saved as training state")
            raw = torch.frombuffer(bytearray(np.ascontiguousarray(obj).tobytes()), dtype=torch.uint8)
            return {"nd": self._add(raw), "dtype": obj.dtype.str, "shape": list(obj.shape)}
        if isinstance(obj, np.generic):
            return self.encode(obj.item(), where)
        if isinstance(obj, list):
            return {"l": [self.encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
        if isinstance(obj, tuple):
            return {"tu": [self.encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
        if isinstance(obj, dict):
            items = []
            for k, v in obj.items():
                if not isinstance(k, _SCALARS):
                    raise TypeError(f"{where}: dict key {k!r} of type {type(k).__name__} cannot be saved")
                items.append([k, self.encode(v, f"{where}[{k!r}]")])
            return {"d": items}
        raise TypeError(f"{where}: values of type {type(obj).__name__} cannot be saved as training state")


def save_state(path: Path, obj: Any) -> None:
    """Write ``obj`` (nested dicts/lists/tuples of tensors, numpy arrays and plain values) to ``path``."""
    from safetensors.torch import save_file

    enc = _Encoder()
    structure = enc.encode(obj, "state")
    save_file(enc.tensors, str(path), metadata={
        "format": FORMAT, "version": str(VERSION), "structure": json.dumps(structure, allow_nan=False)})


class _Decoder:
    def __init__(self, handle, path: Path):
        self.handle, self.path = handle, path
        self.keys = set(handle.keys())
        self.used: set[str] = set()

    def _tensor(self, key: Any) -> torch.Tensor:
        # Each tensor is referenced exactly once: two references would come back as one shared buffer
        # (e.g. an optimizer's two moments aliased), which no file save_state writes holds.
        if not isinstance(key, str) or key not in self.keys:
            raise ValueError(f"reference to a missing tensor {key!r}")
        if key in self.used:
            raise ValueError(f"tensor {key!r} is referenced twice")
        self.used.add(key)
        return self.handle.get_tensor(key)

    def decode(self, node: Any) -> Any:
        if isinstance(node, _SCALARS):
            return node
        if not isinstance(node, dict) or len(node) not in (1, 3):
            raise ValueError(f"unexpected node {str(node)[:80]}")
        if "t" in node and len(node) == 1:
            return self._tensor(node["t"])
        if "f" in node and len(node) == 1 and node["f"] in ("nan", "inf", "-inf"):
            return float(node["f"])
        if "l" in node and len(node) == 1 and isinstance(node["l"], list):
            return [self.decode(v) for v in node["l"]]
        if "tu" in node and len(node) == 1 and isinstance(node["tu"], list):
            return tuple(self.decode(v) for v in node["tu"])
        if "d" in node and len(node) == 1 and isinstance(node["d"], list):
            out = {}
            for item in node["d"]:
                if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], _SCALARS)):
                    raise ValueError(f"malformed dict item {str(item)[:80]}")
                out[item[0]] = self.decode(item[1])
            return out
        if set(node) == {"nd", "dtype", "shape"}:
            dtype = np.dtype(node["dtype"]) if isinstance(node["dtype"], str) else None
            if dtype is None or dtype.kind not in _NUMPY_KINDS:
                raise ValueError(f"numpy dtype {node['dtype']!r} is not a numeric type")
            raw = self._tensor(node["nd"]).numpy().tobytes()
            return np.frombuffer(raw, dtype=dtype).reshape(node["shape"]).copy()
        raise ValueError(f"unexpected node {str(node)[:80]}")


def load_state(path: Path, what: str) -> Any:
    """Read a file written by ``save_state``; a damaged or foreign file raises LMForgeError."""
    from safetensors import safe_open

    advice = f"the checkpoint is damaged; resume from an earlier checkpoint in {path.parent.parent}"
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            meta = handle.metadata() or {}
            if meta.get("format") != FORMAT:
                raise LMForgeError(f"{path} is not an lmforge training-state file (no {FORMAT!r} header): {advice}")
            if meta.get("version") != str(VERSION):
                raise LMForgeError(f"{path} has training-state version {meta.get('version')!r}; this lmforge "
                                   f"reads version {VERSION}: upgrade lmforge to resume from it")
            decoder = _Decoder(handle, path)
            state = decoder.decode(json.loads(meta.get("structure", "null")))
            if decoder.used != decoder.keys:
                raise ValueError(f"{len(decoder.keys - decoder.used)} tensor(s) that the structure does not name")
            return state
    except LMForgeError:
        raise
    except Exception as e:  # safetensors' header errors, JSON errors, malformed structure
        raise LMForgeError(f"cannot read the {what} in {path}: {e}; {advice}") from e


def _numpy_rng_globals() -> list:
    """The numpy names a pickled ``np.random.get_state()`` refers to, under numpy 1 and numpy 2 spellings."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct
    names = [(_reconstruct, "numpy._core.multiarray._reconstruct"),
             (_reconstruct, "numpy.core.multiarray._reconstruct"), np.ndarray, np.dtype]
    names += [type(np.dtype(t)) for t in ("uint32", "int64", "float64")]  # numpy 2's per-dtype classes
    return names


def load_legacy_torch_file(path: Path, what: str) -> Any:
    """Read an ``optimizer.pt`` / ``rng_state.pt`` of an older lmforge without running code in it."""
    advice = (f"lmforge reads pickled checkpoint files only through PyTorch's restricted loader, which admits "
              f"tensors and plain data; this file holds something else, so it was not written by lmforge or "
              f"was tampered with. Do not resume from it; start a new run from its weights alone with "
              f"training.init_from={path.parent} (model.safetensors cannot run code)")
    if not zipfile.is_zipfile(path):  # torch.save has written zip archives since PyTorch 1.6: lmforge's always were
        raise LMForgeError(f"cannot read the {what} in {path}: it is not a file torch.save wrote (damaged or "
                           f"truncated, or not lmforge's); resume from an earlier checkpoint in "
                           f"{path.parent.parent}, or start a new run from its weights alone with "
                           f"training.init_from={path.parent}")
    try:
        allowed = _numpy_rng_globals()
        with warnings.catch_warnings():  # the loader's notes on a foreign pickle's protocol: the error says it all
            warnings.simplefilter("ignore")
            if not hasattr(torch.serialization, "safe_globals"):  # torch 2.4 has only the global registry
                torch.serialization.add_safe_globals(allowed)
                return torch.load(path, map_location="cpu", weights_only=True)
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # what the restricted loader raises for anything not allowed
        raise LMForgeError(f"refused to load the {what} in {path}: {advice}") from e
    except Exception as e:  # several types for truncated or damaged archives
        if "Weights only load failed" in str(e):
            raise LMForgeError(f"refused to load the {what} in {path}: {advice}") from e
        raise LMForgeError(f"cannot read the {what} in {path}: {e}. The checkpoint is corrupt; resume from "
                           f"an earlier checkpoint in {path.parent.parent}") from e
