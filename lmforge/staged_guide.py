"""Seed 004's training commands (``python scripts/train.py --stage language ...``) as ``lmforge train``.

The guide trains a code assistant in stages, each starting from the previous stage's checkpoint, with
flags such as ``--stage code --checkpoint models/language_model_best.pth --data-file code_train_large.npy
--model-size large --batch-size 2 --num-epochs 5 --learning-rate 5e-6 --use-rmsnorm --use-rope --use-amp``.
``lmforge train --stage S [flags] [key=value ...]`` takes those flags and runs the recipe
``code_assistant_S`` with the overrides they mean (``translate``); one line per flag says what it became,
and ``--model-size`` also prints the model's real parameter count next to the guide's table figure.

* ``--stage language|code|tools`` -> recipe ``code_assistant_S``: stages language and code are the ``lm``
  kind (pretraining, continued pretraining), tools the ``sft`` kind. Stage 4 (RLHF) is two trainings, as in
  the guide: ``--stage rlhf`` answers with the two commands (recipes ``code_assistant_reward``, ``_rlhf``).
* ``--checkpoint CKPT`` (an lmforge checkpoint or run directory) -> ``training.init_from=CKPT`` and, for
  the lm stages, ``data.tokenizer`` = its tokenizer (the ids its weights were trained on; the sft kind
  takes it from init_from itself); with ``--resume`` the run continues from CKPT instead. Without
  ``--stage`` (the guide's ``--checkpoint X --resume``) the recipe is the one the checkpoint was written
  with (its ``run_config.yaml``).
* ``--data-file PATH`` -> ``data.train_path`` (``data.path`` for a directory made by ``lmforge data
  prepare``). The guide's ``.npy`` token arrays and ``.pth`` checkpoints are refused with what to pass.
* Everything else maps to one config key each (``FLAGS``); ``key=value`` overrides after the flags win.

An argument list with none of these flags is left exactly as it is: ``lmforge train RECIPE key=value``
works as before. This module sits above ``lmforge.config`` and the model registry and below the CLI.
"""

from __future__ import annotations

import difflib
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lmforge.errors import LMForgeError

STAGES = {"language": "lm", "code": "lm", "tools": "sft"}  # the guide's stage -> lmforge's training kind
RECIPE_PREFIX = "code_assistant_"  # --stage S -> recipe code_assistant_S
SIZES = {"tiny": "10M", "medium": "150M", "large": "1.6B", "xlarge": "7B"}  # the guide's table: size -> "Params"
PRESET_PREFIX = "pipeline-"  # --model-size X -> model.preset=pipeline-X (lmforge.models.gpt.PRESETS)
GUIDE_VOCAB = 32000  # the guide's tokenizer (stage 0: --vocab-size 32000)
GUIDE_MODELS = {"language_model": "language", "code_model": "code", "tool_model": "tools"}  # models/<this>_*.pth
TOKEN_ARRAYS = (".npy", ".npz")
PICKLES = (".pth", ".pt", ".pkl", ".bin")
LMFORGE_OPTIONS = ("--resume", "--print-config")  # `lmforge train`'s own options, accepted beside the guide's


@dataclass(frozen=True)
class GuideFlag:
    name: str
    metavar: str | None  # None: a switch without a value
    help: str


FLAGS: tuple[GuideFlag, ...] = (
    GuideFlag("--stage", "S", "language | code | tools: train the recipe code_assistant_S (language, code: kind lm, "
              "pretraining and continued pretraining; tools: kind sft, fine-tuning on conversations); no RECIPE "
              "is needed. Stage 4 (rlhf) is two trainings: recipes code_assistant_reward, then code_assistant_rlhf"),
    GuideFlag("--model-size", "X", "tiny | medium | large | xlarge: model.preset=pipeline-X, the guide's sizes in the "
              "llama flavor; prints the model's real parameter count beside the guide's figure"),
    GuideFlag("--batch-size", "N", "training.micro_batch_size: sequences per forward pass"),
    GuideFlag("--num-epochs", "N", "training.epochs: passes over the training windows (sets training.max_steps)"),
    GuideFlag("--learning-rate", "LR", "training.lr: the peak learning rate, after warmup (cosine decay)"),
    GuideFlag("--warmup-steps", "N", "training.warmup_steps"),
    GuideFlag("--weight-decay", "W", "training.weight_decay (AdamW; matrices only)"),
    GuideFlag("--dropout", "P", "model.embd_pdrop, model.resid_pdrop and model.attn_pdrop"),
    GuideFlag("--grad-accumulation-steps", "N", "training.grad_accum_steps: micro-batches per optimizer step"),
    GuideFlag("--gradient-checkpointing", None, "training.activation_checkpointing=true: recompute each block's "
              "activations in the backward pass (less memory, ~30%% more compute)"),
    GuideFlag("--use-compile", None, "training.compile=true: torch.compile (slow start, faster steps on GPUs)"),
    GuideFlag("--use-amp", None, "training.precision=auto: mixed precision where the device has it: bf16 autocast on "
              "GPUs with bf16 (and CPUs with bf16 units), fp16 with loss scaling on older GPUs, fp32 on MPS and "
              "other CPUs. It is lmforge's default anyway; training.precision=fp32 turns it off"),
    GuideFlag("--use-rmsnorm", None, "with --use-rope: model.flavor=llama, which has RMSNorm, rotary positions and "
              "SwiGLU together (lmforge's flavors pair them: one flag without the other is an error)"),
    GuideFlag("--use-rope", None, "with --use-rmsnorm: model.flavor=llama"),
    GuideFlag("--checkpoint", "CKPT", "an lmforge checkpoint or run directory (e.g. runs/code_assistant_language): "
              "training.init_from=CKPT and (stages language, code) data.tokenizer = its tokenizer; with --resume, "
              "continue training from it. The guide's .pth files are not lmforge checkpoints"),
    GuideFlag("--data-file", "PATH", "data.train_path: text (a .txt of stories separated by <|endoftext|> lines is "
              "one document per story), JSONL, parquet or a directory; a directory made by `lmforge data prepare` "
              "becomes data.path; for --stage tools, conversations (a file, or a directory with train.jsonl and "
              "val.jsonl). The guide's .npy token arrays cannot be read"),
)
FLAG_NAMES = {f.name: f for f in FLAGS}


@dataclass
class Translation:
    """What a guide command means for ``lmforge train``: ``argv()`` is the equivalent argument list."""

    recipe: str
    overrides: list[str] = field(default_factory=list)
    resume: str | None = None  # None: a new run; "latest"; or a checkpoint path
    print_config: bool = False
    lines: list[str] = field(default_factory=list)  # one per guide flag: what it became, then notes

    def argv(self) -> list[str]:
        out = ["train", self.recipe, *self.overrides]
        if self.resume is not None:
            out += ["--resume"] + ([] if self.resume == "latest" else [self.resume])
        return out + (["--print-config"] if self.print_config else [])


def add_help(parser) -> None:
    """Document the guide's flags in ``lmforge train --help`` (an argument group). They never reach the
    parser: ``translate_train_argv`` rewrites them into a recipe and overrides first."""
    group = parser.add_argument_group(
        "seed 004's scripts/train.py flags",
        "lmforge train --stage S [flags] [key=value ...]: the guide's flags become a recipe and overrides; one "
        "line per flag says what it became, and key=value overrides after them win (docs/staged-guide.md)")
    for flag in FLAGS:
        if flag.metavar is None:
            group.add_argument(flag.name, action="store_true", default=None, dest=_dest(flag.name), help=flag.help)
        else:
            group.add_argument(flag.name, metavar=flag.metavar, dest=_dest(flag.name), help=flag.help)


def _dest(name: str) -> str:
    return "guide_" + name.lstrip("-").replace("-", "_")


def is_guide_command(args: list[str]) -> bool:
    """True when ``lmforge train``'s arguments hold a guide flag, or a long option that is neither
    lmforge's own nor an abbreviation of one (a mistyped guide flag: it gets a "did you mean")."""
    for token in args:
        if token == "--":
            break
        if not token.startswith("--"):
            continue
        name = token.split("=", 1)[0]
        if name in FLAG_NAMES or not any(option.startswith(name) for option in (*LMFORGE_OPTIONS, "--help")):
            return True
    return False


def translate_train_argv(argv: list[str], emit: Callable[[str], None] | None = None) -> list[str]:
    """``argv`` of ``lmforge`` (starting with ``train``) with the guide's flags turned into lmforge's
    arguments; what each flag became goes to ``emit`` (default: printed as ``# `` comment lines, by the
    first process only, so ``--print-config`` output stays valid YAML). Anything else is returned as is."""
    args = argv[1:]
    if argv[:1] != ["train"] or "-h" in args or "--help" in args or not is_guide_command(args):
        return argv
    translation = translate(args)
    if emit is None and os.environ.get("RANK", "0") == "0":
        emit = print
    for line in translation.lines if emit is not None else ():
        emit(f"# {line}")
    return translation.argv()


# ---- the translation ----------------------------------------------------------------------------
def _split(args: list[str]) -> tuple[list[tuple[str, str | None]], list[str], list[str], str | None, bool]:
    """-> (guide flags with their values in order, key=value overrides, positionals, --resume, --print-config)."""
    flags: list[tuple[str, str | None]] = []
    overrides: list[str] = []
    positionals: list[str] = []
    resume, print_config = None, False
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if token == "--":
            continue
        if not token.startswith("-"):
            (overrides if "=" in token else positionals).append(token)
            continue
        name, eq, inline = token.partition("=")
        if name == "--print-config":
            print_config = True
            continue
        if name == "--resume":
            resume = inline if eq else "latest"
            if not eq and i < len(args) and not args[i].startswith("-") and "=" not in args[i]:
                resume, i = args[i], i + 1
            continue
        flag = FLAG_NAMES.get(name)
        if flag is None:
            if not any(a == "--stage" or a.startswith("--stage=") for a in args):  # --stage: a seed 004 command
                _refuse_trainer_flag(name, inline if eq else (args[i] if i < len(args) else None))
            known = [*FLAG_NAMES, *LMFORGE_OPTIONS]
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f" Did you mean {close[0]}?" if close else ""
            raise LMForgeError(f"unknown option {name} in a seed 004 (scripts/train.py) command.{hint} The guide's "
                               f"flags lmforge takes: {', '.join(FLAG_NAMES)}; and lmforge's own --resume [CKPT], "
                               "--print-config and key=value overrides (lmforge train --help)")
        if flag.metavar is None:
            if eq:
                raise LMForgeError(f"{name} is a switch and takes no value (got {token!r})")
            flags.append((name, None))
            continue
        if eq:
            value = inline
        elif i < len(args) and not args[i].startswith("--"):
            value, i = args[i], i + 1
        else:
            raise LMForgeError(f"{name} needs a value: {name} {flag.metavar}")
        if any(seen == name for seen, _ in flags):
            raise LMForgeError(f"{name} is given twice; keep one")
        flags.append((name, value))
    return flags, overrides, positionals, resume, print_config


def _number(flag: str, raw: str, kind: type, ok: Callable[[float], bool], what: str) -> str:
    try:
        value = kind(raw)
    except ValueError:
        raise LMForgeError(f"{flag} expects {what}, got {raw!r}") from None
    if not ok(value):
        raise LMForgeError(f"{flag} expects {what}, got {raw}")
    return raw


NUMBERS: dict[str, tuple[str, type, Callable[[float], bool], str]] = {
    # flag: (config key, type, check, what it expects)
    "--batch-size": ("training.micro_batch_size", int, lambda v: v >= 1, "a whole number >= 1"),
    "--num-epochs": ("training.epochs", float, lambda v: v > 0, "a number of epochs > 0"),
    "--learning-rate": ("training.lr", float, lambda v: v > 0, "a learning rate > 0, e.g. 1e-4"),
    "--warmup-steps": ("training.warmup_steps", int, lambda v: v >= 0, "a whole number >= 0"),
    "--weight-decay": ("training.weight_decay", float, lambda v: v >= 0, "a number >= 0, e.g. 0.1"),
    "--grad-accumulation-steps": ("training.grad_accum_steps", int, lambda v: v >= 1, "a whole number >= 1"),
}
SWITCHES = {
    "--gradient-checkpointing": ("training.activation_checkpointing=true",),
    "--use-compile": ("training.compile=true",),
    "--use-amp": ("training.precision=auto",),
}


def _refuse_trainer_flag(name: str, value: str | None) -> None:
    """A Hugging Face Trainer argument or an lmforge training key written as a flag (``--learning_rate 5e-4``,
    ``--max_steps 100``): say how lmforge takes it, not that it is unknown to seed 004."""
    import dataclasses

    from lmforge.config import TRAINER_NAMES, TRAINER_SCHEDULES, TRAINER_WITHOUT_KEY, TrainingConfig

    key = name.lstrip("-").replace("-", "_")
    if value is not None and (value.startswith("-") or "=" in value):
        value = None  # the next option or an override, not this one's value
    shown = "VALUE" if value is None else shlex.quote(value)
    if key == "resume_from_checkpoint":
        raise LMForgeError(f"{name}: to continue a run from a checkpoint give --resume {shown if value else 'CKPT'} "
                           "(weights, optimizer, schedule and data position); to start a new run from its weights, "
                           f"training.init_from={shown}")
    if key in TRAINER_WITHOUT_KEY:
        raise LMForgeError(f"{name} (a Hugging Face Trainer argument) has no lmforge setting: {TRAINER_WITHOUT_KEY[key]}")
    if key in TRAINER_NAMES or key in ("fp16", "bf16"):
        switch = key in ("fp16", "bf16", "gradient_checkpointing")  # the Trainer's store_true flags
        if key == "lr_scheduler_type" and value is not None and value not in TRAINER_SCHEDULES:
            raise LMForgeError(f"{name} {shown}: lmforge has no such schedule; training.lr_scheduler_type takes "
                               f"{', '.join(TRAINER_SCHEDULES)} (training.schedule: cosine, constant, wsd)")
        given = ("true" if switch else "VALUE") if value is None else shown
        raise LMForgeError(f"{name} is a Hugging Face Trainer argument: lmforge takes its settings as key=value "
                           f"overrides, here training.{key}={given} (lmforge train --help; the Trainer's names "
                           "are read under training.*)")
    if key in {f.name for f in dataclasses.fields(TrainingConfig)}:
        raise LMForgeError(f"{name}: lmforge takes its settings as key=value overrides: training.{key}={shown}")


def translate(args: list[str]) -> Translation:
    """``lmforge train``'s arguments written with the guide's flags -> a ``Translation``."""
    flags, user_overrides, positionals, resume, print_config = _split(args)
    given = dict(flags)
    lines: list[str] = []
    overrides: list[str] = []

    def became(flag: str, shown: str) -> None:
        value = given[flag]
        lines.append(f"{flag}{'' if value is None else ' ' + shlex.quote(value)} -> {shown}")

    stage = given.get("--stage")
    if len(positionals) > 1:
        raise LMForgeError(f"more than one recipe given ({', '.join(positionals)}); overrides are written key=value")
    recipe = positionals[0] if positionals else None
    if stage is not None:
        if stage == "rlhf":
            raise LMForgeError(
                "--stage rlhf is the guide's stage 4, two trainings in lmforge as in the guide (its steps 2 and 3): "
                "`lmforge train code_assistant_reward training.init_from=runs/code_assistant_tools "
                "data.train_path=PAIRS`, then `lmforge train code_assistant_rlhf "
                "training.init_from=runs/code_assistant_tools recipe.reward_model=runs/code_assistant_reward "
                "data.train_path=PROMPTS` (PPO at the guide's lr 1e-6; docs/reward.md, docs/ppo.md). "
                "`lmforge pipeline run code_assistant_tiny` runs every stage, these two included")
        if stage not in STAGES:
            close = difflib.get_close_matches(stage, list(STAGES), n=1)
            hint = f" Did you mean {close[0]}?" if close else ""
            raise LMForgeError(f"--stage {stage}: the guide's stages lmforge trains are {', '.join(STAGES)}.{hint}")
        if recipe is not None:
            raise LMForgeError(f"give --stage {stage} or a recipe ({recipe}), not both: --stage {stage} is the recipe "
                               f"{RECIPE_PREFIX}{stage}")
        recipe = RECIPE_PREFIX + stage
        became("--stage", f"recipe {recipe} (kind {STAGES[stage]})")

    checkpoint = given.get("--checkpoint")
    if checkpoint is not None:
        _refuse_guide_checkpoint(checkpoint, resume is not None)
    if resume is not None:
        if checkpoint is not None and resume not in ("latest", checkpoint):
            raise LMForgeError(f"--checkpoint {checkpoint} and --resume {resume} name two checkpoints; keep one")
        resume = checkpoint if checkpoint is not None else resume
        if recipe is None and resume != "latest":
            recipe, resume = _recipe_of_checkpoint(resume)
        if checkpoint is not None:
            became("--checkpoint", f"resume from {checkpoint} (weights, optimizer, schedule, data position)")
        # A stage run started with init_from resumes from its own checkpoint, not from the earlier stage.
        overrides.append("training.init_from=")
    if recipe is None:
        raise LMForgeError("which stage? Seed 004's flags need --stage language, code or tools (or a recipe before "
                           "them); to continue a run give --checkpoint CKPT --resume")

    size = given.get("--model-size")
    if size is not None and size not in SIZES:
        close = difflib.get_close_matches(size, list(SIZES), n=1)
        hint = f" Did you mean {close[0]}?" if close else ""
        raise LMForgeError(f"--model-size {size}: the guide's sizes are {', '.join(SIZES)}.{hint} (lmforge's own "
                           "presets tiny/small/medium/large are GPT-2 sizes: model.preset=NAME)")
    if size is not None:
        overrides.append(f"model.preset={PRESET_PREFIX}{size}")  # its line, with the count, comes at the end
    for flag, (key, kind, ok, what) in NUMBERS.items():
        if flag in given:
            overrides.append(f"{key}={_number(flag, given[flag], kind, ok, what)}")
            became(flag, overrides[-1])
    if "--dropout" in given:
        p = _number("--dropout", given["--dropout"], float, lambda v: 0 <= v < 1, "a probability in [0, 1)")
        keys = [f"model.{k}={p}" for k in ("embd_pdrop", "resid_pdrop", "attn_pdrop")]
        overrides += keys
        became("--dropout", " ".join(keys))
    for flag, keys in SWITCHES.items():
        if flag in given:
            overrides += keys
            became(flag, " ".join(keys) + (" (bf16 where the device has it; see lmforge train --help)"
                                           if flag == "--use-amp" else ""))
    rmsnorm, rope = "--use-rmsnorm" in given, "--use-rope" in given
    if rmsnorm != rope:
        one, other = ("--use-rmsnorm", "--use-rope") if rmsnorm else ("--use-rope", "--use-rmsnorm")
        raise LMForgeError(f"{one} without {other}: lmforge's flavors pair them. model.flavor=llama has RMSNorm, "
                           "rotary positions and SwiGLU together, model.flavor=gpt2 has LayerNorm, learned positions "
                           "and GELU; give both flags (the llama flavor), or neither (the recipe's model.flavor stays)")
    if rmsnorm:
        overrides.append("model.flavor=llama")
        became("--use-rmsnorm", "model.flavor=llama (RMSNorm, with rotary positions and SwiGLU)")
        became("--use-rope", "model.flavor=llama (rotary positions, with RMSNorm and SwiGLU)")

    if checkpoint is not None and resume is None:
        overrides += [f"training.init_from={checkpoint}", f"data.tokenizer={_tokenizer_of(checkpoint)}"]
        became("--checkpoint", f"{overrides[-2]} {overrides[-1]} (its weights with a fresh optimizer and schedule, "
                               "and the tokenizer they were trained with)")
        if not print_config and not Path(checkpoint).exists():
            raise LMForgeError(f"--checkpoint {checkpoint} does not exist: pass an lmforge run directory (e.g. "
                               "runs/code_assistant_language) or one of its checkpoints/step-NNNNNN")
    elif stage in ("code", "tools") and resume is None:
        previous = RECIPE_PREFIX + ("language" if stage == "code" else "code")
        start = "random weights" if stage == "code" else "nothing (the sft kind fine-tunes a trained model)"
        lines.append(f"note: no --checkpoint: stage {stage} starts from {start}; the guide starts it from the "
                     f"previous stage's model: --checkpoint runs/{previous}")

    data_file = given.get("--data-file")
    if data_file is not None:
        key = _data_key(data_file, stage)
        overrides.append(f"{key}={data_file}")
        became("--data-file", overrides[-1])
    elif stage == "language" and resume is None:
        lines.append("note: no --data-file: the recipe's data.train_path=data/stories/train.txt (`lmforge data "
                     "stories --out data/stories`); pass --data-file TinyStoriesV2-GPT4-train.txt for TinyStories")
    if resume is not None and "--checkpoint" not in given:
        lines.append(f"--resume -> continue the run from {'its latest checkpoint' if resume == 'latest' else resume}")

    overrides = _without_superseded(overrides, user_overrides, lines) + user_overrides
    if size is not None:
        became("--model-size", f"model.preset={PRESET_PREFIX}{size}: {_size_report(recipe, overrides, size)}")
    translation = Translation(recipe=recipe, overrides=overrides, resume=resume, print_config=print_config)
    translation.lines = lines + ["= lmforge " + shlex.join(translation.argv())]
    return translation


def _without_superseded(overrides: list[str], user_overrides: list[str], lines: list[str]) -> list[str]:
    """The flags' overrides less those a key=value of the user's replaces: the same key, or one that
    switches it off (training.max_steps replaces --num-epochs' training.epochs). Both share one layer of
    overrides, where the config's rule for later layers (lmforge.config.SUPERSEDES) cannot apply."""
    from lmforge.config import SUPERSEDES, parse_overrides

    given: set[str] = set()

    def collect(node: dict, prefix: str) -> None:
        for key, value in node.items():
            given.add(prefix + key)
            if isinstance(value, dict):
                collect(value, f"{prefix}{key}.")

    collect(parse_overrides(user_overrides), "")
    kept = []
    for item in overrides:
        key = item.split("=", 1)[0]
        section, _, name = key.partition(".")
        by = [f"{section}.{plain}" for plain, others in SUPERSEDES.get(section, {}).items()
              if f"{section}.{plain}" in given and any(other == name for other, _ in others)]
        by += [key] if key in given else []
        if by:
            lines.append(f"note: {item} is left out: {by[0]} is given")
        else:
            kept.append(item)
    return kept


def _refuse_guide_checkpoint(path: str, resume: bool) -> None:
    """The guide's checkpoints are pickled .pth files; lmforge's are directories of safetensors."""
    p = Path(path)
    if p.suffix.lower() not in PICKLES or p.is_dir():
        return
    stage = next((s for prefix, s in GUIDE_MODELS.items() if p.name.startswith(prefix)), None)
    run = f"runs/{RECIPE_PREFIX}{stage}" if stage else "runs/NAME"
    instead = (f"{run}/checkpoints/step-NNNNNN (or --stage {stage or 'S'} --resume for its latest)" if resume else
               f"{run} (its best checkpoint) or {run}/checkpoints/step-NNNNNN")
    where = f"stage {stage}'s model is the run {run} here" if stage else "a run's checkpoints are in runs/NAME"
    raise LMForgeError(f"--checkpoint {path}: lmforge checkpoints are directories (model.safetensors, config.yaml, "
                       f"tokenizer), not .pth files, and lmforge never unpickles one; {where}: pass --checkpoint {instead}")


def _recipe_of_checkpoint(path: str) -> tuple[str, str]:
    """``--checkpoint X --resume`` without --stage: the config X's run was written with, and where to resume."""
    p = Path(path)
    if (p / "run_config.yaml").is_file():
        return str(p / "run_config.yaml"), path
    if (p / "config.yaml").is_file() and (p / "checkpoints").is_dir():  # a run directory: its latest checkpoint
        return str(p / "config.yaml"), "latest"
    raise LMForgeError(f"--checkpoint {path} --resume: {path} is not an lmforge training checkpoint (no "
                       "run_config.yaml) nor a run directory; pass runs/NAME/checkpoints/step-NNNNNN, or add --stage S "
                       "to say which stage's recipe to resume with")


def _tokenizer_of(checkpoint: str) -> str:
    """The tokenizer stored with a checkpoint (a model directory holds tokenizer.json) or a run (tokenizer/)."""
    p = Path(checkpoint)
    if (p / "tokenizer").is_dir() and not (p / "tokenizer.json").is_file():
        return str(p / "tokenizer")
    return checkpoint


def _data_key(path: str, stage: str | None) -> str:
    p = Path(path)
    if p.suffix.lower() in TOKEN_ARRAYS:
        what = ("the conversations file prepare_tool_calling_data.py wrote the examples from (JSONL), or a directory "
                "with train.jsonl and val.jsonl" if stage == "tools" else
                "the text it was made from: TinyStories' TinyStoriesV2-GPT4-train.txt (stories separated by "
                "<|endoftext|> lines), the code corpus (.txt, JSONL of {\"text\": ...}, parquet) or a source directory; "
                "or token shards made with `lmforge data prepare SRC --tokenizer data/tokenizer --out DIR` (--data-file DIR)")
        raise LMForgeError(f"--data-file {path}: a {p.suffix} token array from the guide's prepare scripts, tokenized with "
                           f"their tokenizer in their layout; lmforge cannot read it. Pass {what}")
    if stage != "tools" and (p / "meta.json").is_file():
        return "data.path"  # token shards from `lmforge data prepare`
    return "data.train_path"


def _size_report(recipe: str, overrides: list[str], size: str) -> str:
    """The resolved model's real parameter count (built on the meta device) beside the guide's figure."""
    from lmforge.config import deep_merge, parse_overrides, read_recipe
    from lmforge.models import count_parameters
    from lmforge.recipes import model_class
    from lmforge.typed import dataclass_from_dict

    recipe_model = read_recipe(recipe).get("model") or {}
    values = deep_merge(recipe_model if isinstance(recipe_model, dict) else {},
                        parse_overrides(overrides).get("model") or {})
    cls = model_class(values.pop("family", None) or "gpt")
    config = dataclass_from_dict(cls.config_class, values, prefix="model")
    note = ""
    if getattr(config, "vocab_size", 1) == 0:
        config.vocab_size, note = GUIDE_VOCAB, " (the guide's vocabulary; the run takes the tokenizer's)"
    n = count_parameters(config)
    shape = f"{config.n_layer} layers x {config.n_embd} x {config.n_head} heads, d_ff {config.inner_size}"
    tied = "tied" if getattr(config, "tie_word_embeddings", True) else "untied"
    return (f"{shape}: {n:,} parameters ({_human(n)}) at vocab {config.vocab_size}{note} with {tied} embeddings; "
            f"the guide's table says {SIZES[size]}")


def _human(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
