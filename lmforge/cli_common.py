"""Pieces every command-line verb shares, at the bottom of lmforge's layers so that training kinds can
add their own verbs and options with them (``lmforge.recipes``)."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default, unless it is empty (None, []) or the help already states it."""

    def _get_help_string(self, action):
        if action.default in (None, "", [], argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def formatter(prog):
    return HelpFormatter(prog, max_help_position=32)


PRECISION_HELP = ("weight precision for generation: auto = bf16 on GPUs and CPUs with bf16 units (it halves the "
                  "memory traffic that bounds decoding), else fp32")


def add_device_args(p, precision: bool = True) -> None:
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    if precision:
        add_precision_arg(p)


def add_precision_arg(p) -> None:
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"], help=PRECISION_HELP)


QUANTIZE_HELP = ("int8: int8 weights (one scale per output channel) for CPU decoding, 1.69-1.77x the tokens/s of "
                 "bf16 on GPT-2 124M at batch 1 (measured on a 2-core CPU with bf16 units); --precision then sets "
                 "the activations' (auto: bf16 on CPUs with bf16 units, else fp32)")


def add_quantize_arg(p) -> None:
    """``--quantize`` of the verbs that generate text with a gpt-family model (``lmforge.infer.quantize``)."""
    p.add_argument("--quantize", default="none", choices=["none", "int8"], help=QUANTIZE_HELP)


def add_sampling_args(p, max_new_tokens: int) -> None:
    """How replies are sampled: the same names in `generate`, `chat` and for every kind that writes text."""
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="longest reply, in tokens")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = off")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass; 1.0 = off")
    # None = not given: each call draws from torch's global generator (a fresh sample each run); a kind that
    # wants a seed either way passes `args.seed` on only when it is not None (lmforge.infer.generate does).
    p.add_argument("--seed", type=seed_arg, default=None, help="seed for reproducible samples (0 to 2**64-1; "
                   "default: none, a different sample each run)")


def seed_arg(text: str) -> int:
    """``--seed`` of ``add_sampling_args``: an integer in [0, 2**64), the seeds torch's generators take."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer: pass e.g. --seed 0") from None
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"{value} is out of range: pass an integer from 0 to 2**64-1")
    return value


# `lmforge eval` of models that answer prompts (sft, grpo): the model before fine-tuning scored beside
# the checkpoint, under this label, and the replies' length limit.
BASELINE = "before fine-tuning"


def add_baseline_args(p) -> None:
    p.add_argument("--baseline", default=None, metavar="CKPT",
                   help="score this checkpoint too, as the model before fine-tuning (default: the run's "
                        "training.init_from, when it still exists)")
    p.add_argument("--no-baseline", action="store_true", help="score the checkpoint alone")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="reply length limit (default: sft 96; grpo the run's recipe.eval_max_new_tokens or "
                        "max_new_tokens, else 64)")


def check_reply_tokens(value: int | None) -> int | None:
    """``--max-new-tokens`` of ``add_baseline_args``: None (the kind's default) or >= 1."""
    if value is not None and value < 1:
        from lmforge.errors import LMForgeError

        raise LMForgeError(f"--max-new-tokens must be >= 1, got {value}")
    return value


def require_data(args, what: str) -> str:
    """``lmforge eval``'s ``--data``, which this kind needs: ``what`` says what to pass."""
    if not getattr(args, "data", None):
        from lmforge.errors import LMForgeError

        raise LMForgeError(f"--data is required for this checkpoint: {what}")
    return args.data


def add_batch_size_arg(p) -> None:
    p.add_argument("--batch-size", type=int, default=None, help="rows per forward pass (default: 8 windows for "
                   "language models, 256 puzzles)")


# Option sets several kinds share, named in their RecipeSpec's CLIOptions.uses (``lmforge.recipes.register``
# refuses any other name). Here, at the bottom, so that the registry can check the names.
SHARED_OPTIONS = {
    "sampling": lambda group: add_sampling_args(group, max_new_tokens=200),  # --max-new-tokens .. --seed
    "precision": add_precision_arg,  # --precision
    "baseline": add_baseline_args,  # --baseline --no-baseline --max-new-tokens
    "batch-size": add_batch_size_arg,  # --batch-size
}
