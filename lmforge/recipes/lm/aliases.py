"""The RLM-mHC guide's key names (seed 002) for the gpt family, Hydra-style: `lmforge train rlm_mhc_tiny
training.optimizer.lr=5e-5 training.batch_size=4 data.train_path=x.jsonl` works as written (the names it
shares with Hugging Face's Trainer, such as training.batch_size, are every kind's: ``lmforge.config.TRAINER_NAMES``). Its
model sizes (`model.hidden_dim` ...) are mapped by the gpt family's config (``lmforge.models.gpt.SEED_NAMES``);
here they only make a later layer's spelling replace an earlier layer's other spelling."""

from __future__ import annotations

import difflib
from typing import Any

from lmforge.config import DROP, TRAINER_8BIT_OPTIMS, set_dotted
from lmforge.errors import LMForgeError
from lmforge.typed import short_repr

SEED_ALIASES = {
    "model.gradient_checkpointing": "training.activation_checkpointing",
    "training.optimizer.lr": "training.lr",
    "training.optimizer.weight_decay": "training.weight_decay",
    "training.optimizer.eps": "training.eps",
    "training.scheduler.type": "training.schedule",
    "training.scheduler.warmup_steps": "training.warmup_steps",
    "training.scheduler.min_lr_ratio": "training.min_lr_ratio",
    "training.wandb.project": "logging.wandb_project",
    "training.wandb.entity": "logging.wandb_entity",
    "training.wandb.name": "logging.wandb_run_name",
    "data.max_length": "data.seq_len",
}
OPTIMIZER_TYPES = ("adamw",)
SUBSECTIONS = ("optimizer", "scheduler", "wandb")


def seed_aliases(values: dict[str, Any]) -> dict[str, Any]:
    """Move the guide's dotted keys to ours; `optimizer.betas` splits into beta1/beta2."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in values.items()}  # copies: keys are popped
    training = out.get("training") if isinstance(out.get("training"), dict) else {}
    for sub in SUBSECTIONS:
        node = training.get(sub)
        if node is not None and not isinstance(node, dict):
            raise LMForgeError(f"training.{sub} must be a mapping (e.g. training.{sub}.lr=1e-4), "
                               f"got {short_repr(node)}")
        if node is not None:
            training[sub] = dict(node)
    optimizer = training.get("optimizer") or {}
    if "type" in optimizer:
        kind = str(optimizer.pop("type")).lower()
        if kind in TRAINER_8BIT_OPTIMS or kind == "adamw8bit":
            set_dotted(out, "training.optimizer_states", "8bit", f"training.optimizer.type={kind}")
        elif kind not in OPTIMIZER_TYPES:
            raise LMForgeError(f"training.optimizer.type={short_repr(kind)} is not available; use adamw "
                               "(or adamw_8bit: training.optimizer_states=8bit)")
    if "betas" in optimizer:
        betas = optimizer.pop("betas")
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise LMForgeError(f"training.optimizer.betas must be a pair like [0.9, 0.95], got {short_repr(betas)}")
        set_dotted(out, "training.beta1", betas[0], "training.optimizer.betas")
        set_dotted(out, "training.beta2", betas[1], "training.optimizer.betas")
    for alias, target in SEED_ALIASES.items():
        section, *rest = alias.split(".")
        node = out.get(section)
        for part in rest[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and rest[-1] in node:
            set_dotted(out, target, node.pop(rest[-1]), alias)
    training = out.get("training") if isinstance(out.get("training"), dict) else {}
    for sub in SUBSECTIONS:
        leftover = training.pop(sub, None)
        if leftover:  # what no alias took: a typo
            bad = sorted(leftover)[0]
            valid = [a.split(".")[-1] for a in SEED_ALIASES if a.startswith(f"training.{sub}.")]
            valid += ["type", "betas"] if sub == "optimizer" else []
            close = difflib.get_close_matches(bad, valid, n=1, cutoff=0.5)
            hint = f" Did you mean 'training.{sub}.{close[0]}'?" if close else ""
            raise LMForgeError(f"unknown config key 'training.{sub}.{bad}'.{hint} Valid keys here: "
                               + ", ".join(f"training.{sub}.{v}" for v in sorted(valid)))
    return out


# The guide's model names and ours are synonyms; a new width or head count makes an earlier head_dim stale.
_SEED_MODEL_SYNONYMS = {"hidden_dim": "n_embd", "num_layers": "n_layer", "num_heads": "n_head",
                        "ffn_dim": "n_inner", "max_seq_len": "n_positions", "num_kv_heads": "n_kv_head"}
SUPERSEDES = {"model": {
    **{seed: [(ours, DROP)] for seed, ours in _SEED_MODEL_SYNONYMS.items()},
    **{ours: [(seed, DROP)] for seed, ours in _SEED_MODEL_SYNONYMS.items()},
}}
for _width_key in ("hidden_dim", "num_heads", "n_embd", "n_head"):
    SUPERSEDES["model"][_width_key].append(("head_dim", DROP))
