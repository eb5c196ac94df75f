"""lm-evaluation-harness in-process: ``lmforge eval CKPT --tasks NAME[,NAME]``.

``LMForgeLM`` is an ``lm_eval`` model (registered as ``lmforge``) over a gpt-family checkpoint, with
lmforge's tokenizer, and ``run_tasks`` runs lm_eval's ``simple_evaluate`` with it: the harness's own
task configs, few-shot contexts, metrics, ``--limit`` and response cache (sqlite, in the run directory).

Tokenization: the requests are tokenized exactly as lm_eval's own ``hf`` backend tokenizes them on
``lmforge export --format hf`` of the same checkpoint with ``prefix_token_id=<eos>`` (the class inherits
lm_eval's ``TemplateLM``, which does the splitting): trailing spaces of a context move to the front of
the continuation; the continuation's tokens are what encoding context + continuation adds after the
context's tokens; no special token is added to a non-empty context (lmforge's tokenizer adds none, nor
does the export's); an empty context, and the first window of a rolling (perplexity) request, is the
document separator, eos, the token every training document follows. docs/eval.md has the details.

Scoring (``loglikelihood``) packs requests into rows of the model's context: a context is computed once
for all of its continuations (the choices of a multiple-choice question attend to one copy of it, as
GRPO's completions attend to one copy of their prompt), and the LM head runs only where a continuation
token is predicted, in fp32. Generation (``generate_until``) runs on the batching engine of ``lmforge
serve`` (``lmforge.infer.engine``): greedy by default, stopped at the task's ``until`` strings.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lmforge.errors import LMForgeError

LM_EVAL_REQUIREMENT = "lm_eval>=0.4.13,<0.5"
INSTALL_HINT = "pip install 'lmforge[eval]'"
CONVENTION = "lmforge-harness-1"  # bump when the way requests become tokens changes: old caches then miss
HEAD_SLICE_BYTES = 2**28  # the fp32 [positions, vocab] log-probabilities computed at a time


def require_lm_eval():
    """The ``lm_eval`` module, or an error that says how to install it."""
    try:
        import lm_eval
        from lm_eval.api.model import TemplateLM  # noqa: F401
    except ImportError as e:
        raise LMForgeError(f"`lmforge eval --tasks` runs EleutherAI's lm-evaluation-harness, which is not installed "
                           f"({e}); install it with: {INSTALL_HINT}  (or pip install '{LM_EVAL_REQUIREMENT}')") from e
    return lm_eval


try:  # the model class derives from lm_eval's; without lm_eval it exists, and refuses to be made
    from lm_eval.api.model import TemplateLM as _Base
except ImportError:
    _Base = object


# ---- the model --------------------------------------------------------------------------------------
@dataclass
class _Unit:
    """One context and the distinct continuations scored after it, laid out as documents of a row: the
    context (its last position predicts every continuation's first token), then each continuation but
    its last token, attending to the context's copy."""

    context: list[int]
    continuations: list[tuple[int, ...]]
    length: int = 0

    def __post_init__(self) -> None:
        self.length = len(self.context) + sum(len(c) - 1 for c in self.continuations)


@dataclass
class _Row:
    units: list[_Unit] = field(default_factory=list)
    length: int = 0


class LMForgeLM(_Base):
    """An lm_eval model over a gpt-family lmforge checkpoint (``lm_eval`` name: ``lmforge``).

    ``checkpoint``: any path ``lmforge eval`` takes; or pass a loaded ``model`` and ``tokenizer``.
    ``batch_size``: rows of the model's context per scoring forward pass, and sequences decoded together.
    ``max_length``: the context (default the model's ``n_positions``); ``max_gen_toks``: the default
    generation length of tasks that set none (lm_eval's ``hf`` default, 256)."""

    def __init__(self, checkpoint: str | os.PathLike | None = None, model: Any = None, tokenizer: Any = None,
                 device: str | None = "auto", batch_size: int | str | None = 8, max_batch_size: int | None = None,
                 max_length: int | None = None, max_gen_toks: int = 256, progress: bool = True, **unused: Any):
        if _Base is object:
            require_lm_eval()
        super().__init__()
        if model is None:
            if checkpoint is None:
                raise LMForgeError("LMForgeLM needs a checkpoint (or a loaded model and tokenizer)")
            model, tokenizer, _ = load_language_model(checkpoint, device or "auto")
        elif tokenizer is None:
            raise LMForgeError("LMForgeLM(model=...) needs the model's tokenizer too")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.checkpoint = None if checkpoint is None else str(checkpoint)
        self._device = next(model.parameters()).device
        context = model.config.n_positions
        self._max_length = int(max_length) if max_length else context
        if self._max_length > context:
            raise LMForgeError(f"max_length={self._max_length} exceeds the model's context of {context} tokens")
        try:
            self._batch_size = max(1, int(batch_size)) if batch_size not in (None, "auto") else 8
        except (TypeError, ValueError) as e:
            raise LMForgeError(f"batch_size must be a number of rows, got {batch_size!r}") from e
        self._max_gen_toks = int(max_gen_toks)
        self.progress = progress
        self.computed = {"loglikelihood": 0, "loglikelihood_rolling": 0, "generate_until": 0}

    # --- what lm_eval asks of a model ---------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context becomes: the document separator, which every training document follows."""
        return self.tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return f"lmforge-{self.tokenizer.sha256[:16]}"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """lmforge's tokenizer never adds a special token (the export's does not either)."""
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def get_model_info(self) -> dict[str, Any]:
        return {"model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "model_dtype": str(next(self.model.parameters()).dtype), "lmforge_checkpoint": self.checkpoint,
                "lmforge_convention": CONVENTION}

    # --- log-likelihoods --------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """``requests``: ``(cache key or None, context ids, continuation ids)`` as lm_eval's ``TemplateLM``
        makes them. The same left truncation as lm_eval's ``hf`` backend: context + continuation keep
        their last ``max_length + 1`` tokens."""
        from tqdm.auto import tqdm

        L = self.max_length
        groups: dict[tuple[int, ...], dict[tuple[int, ...], list[int]]] = {}
        for i, (_, context, continuation) in enumerate(requests):
            if not continuation:
                raise LMForgeError("lm_eval asked for the log-likelihood of an empty continuation")
            if len(continuation) > L:
                raise LMForgeError(f"a continuation of {len(continuation)} tokens does not fit the model's context "
                                   f"of {L} tokens")
            whole = list(context) + list(continuation)
            context = whole[-(L + 1):][:-len(continuation)]  # at least one token: len(continuation) <= L
            groups.setdefault(tuple(context), {}).setdefault(tuple(continuation), []).append(i)
        units: list[_Unit] = []
        for context, continuations in groups.items():
            unit = _Unit(list(context), [])
            for cont in sorted(continuations, key=len, reverse=True):
                if unit.continuations and unit.length + len(cont) - 1 > L:
                    units.append(unit)
                    unit = _Unit(list(context), [])
                unit.continuations.append(cont)
                unit.length += len(cont) - 1
            units.append(unit)
        units.sort(key=lambda u: u.length, reverse=True)

        results: list[tuple[float, bool] | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="lmforge loglikelihood", disable=disable_tqdm or not self.progress)
        for rows in self._batches(units):
            scored = self._score_rows(rows)
            for (context, cont), answer in scored.items():
                for i in groups[context][cont]:
                    results[i] = answer
                    key = requests[i][0]
                    if key is not None:  # rolling windows have none: their sums are cached per document
                        self.cache_hook.add_partial("loglikelihood", key, answer)
                bar.update(len(groups[context][cont]))
        bar.close()
        self.computed["loglikelihood"] += sum(1 for r in requests if r[0] is not None)
        return results  # type: ignore[return-value]

    def _batches(self, units: list[_Unit]) -> Iterator[list[_Row]]:
        """Units (longest first) packed into at most ``batch_size`` rows of ``max_length`` tokens: each goes
        into the first open row it fits, or a new one; a batch is scored when no row can take the next."""
        rows: list[_Row] = []
        for unit in units:
            row = next((r for r in rows if r.length + unit.length <= self.max_length), None)
            if row is None:
                if len(rows) == self.batch_size:
                    yield rows
                    rows = []
                row = _Row()
                rows.append(row)
            row.units.append(unit)
            row.length += unit.length
        if rows:
            yield rows

    @torch.inference_mode()
    def _score_rows(self, rows: list[_Row]) -> dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[float, bool]]:
        """One forward pass over packed rows -> (log-likelihood, is greedy) of each (context, continuation)."""
        T = max(r.length for r in rows)
        pad = self.tokenizer.pad_id
        ids, positions, documents, prefixes, keep = [], [], [], [], []
        # per scored continuation: the kept positions that predict its tokens, and its key
        picks: list[tuple[tuple[tuple[int, ...], tuple[int, ...]], list[int]]] = []
        kept = 0
        for row in rows:
            r_ids, r_pos, r_doc, r_pre, r_keep = [], [], [], [], []
            doc = 0
            for unit in row.units:
                c = len(unit.context)
                r_ids += unit.context
                r_pos += range(c)
                r_doc += [doc] * c
                r_pre += [-1] * c
                r_keep += [False] * (c - 1) + [True]
                context_pick = kept
                kept += 1
                context_doc = doc
                doc += 1
                for cont in unit.continuations:
                    n = len(cont) - 1
                    if n:
                        r_ids += cont[:-1]
                        r_pos += range(c, c + n)
                        r_doc += [doc] * n
                        r_pre += [context_doc] * n
                        r_keep += [True] * n
                        doc += 1
                    picks.append(((tuple(unit.context), cont), [context_pick, *range(kept, kept + n)]))
                    kept += n
            rest = T - len(r_ids)
            r_ids += [pad] * rest
            r_pos += range(rest)
            r_doc += [doc] * rest
            r_pre += [-1] * rest
            r_keep += [False] * rest
            for dst, src in ((ids, r_ids), (positions, r_pos), (documents, r_doc), (prefixes, r_pre), (keep, r_keep)):
                dst.append(src)
        dev = self.device
        ids_t = torch.tensor(ids, device=dev)
        prefix_t = torch.tensor(prefixes, device=dev)
        hidden = self.model.hidden_states(
            ids_t, position_ids=torch.tensor(positions, device=dev), document_ids=torch.tensor(documents, device=dev),
            prefix_ids=prefix_t if bool((prefix_t >= 0).any()) else None, keep=torch.tensor(keep, device=dev))
        flat_rows = torch.tensor([p for _, positions_ in picks for p in positions_], device=dev)
        flat_targets = torch.tensor([t for (_, cont), _ in picks for t in cont], device=dev)
        segment = torch.repeat_interleave(torch.arange(len(picks), device=dev),
                                          torch.tensor([len(cont) for (_, cont), _ in picks], device=dev))
        # The LM head and log-softmax (fp32) a slice of positions at a time (HEAD_SLICE_BYTES of log-probabilities).
        token_lp = torch.empty(len(flat_rows), dtype=torch.float32, device=dev)
        greedy = torch.empty(kept, dtype=torch.long, device=dev)
        step = max(1, HEAD_SLICE_BYTES // (4 * self.model.config.vocab_size))
        for start in range(0, kept, step):
            logprobs = F.log_softmax(self.model.lm_head(hidden[start:start + step]).float(), dim=-1)
            greedy[start:start + step] = logprobs.argmax(dim=-1)
            inside = (flat_rows >= start) & (flat_rows < start + step)
            token_lp[inside] = logprobs[flat_rows[inside] - start, flat_targets[inside]]
        sums = torch.zeros(len(picks), dtype=torch.float64, device=dev).index_add_(0, segment, token_lp.double())
        misses = torch.zeros(len(picks), dtype=torch.long, device=dev).index_add_(
            0, segment, (greedy[flat_rows] != flat_targets).long())
        return {key: (float(s), bool(m == 0)) for (key, _), s, m in zip(picks, sums.tolist(), misses.tolist())}

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over disjoint windows of the context, the first one after the
        separator (lm_eval's ``get_rolling_token_windows``, as its ``hf`` backend calls it)."""
        from lm_eval import utils

        windows, owners = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                    context_len=1)):
                windows.append((None, context, continuation))
                owners.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm) if windows else []
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, scores):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        self.computed["loglikelihood_rolling"] += len(requests)
        return totals

    # --- generation -------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context continued on lmforge's batching engine until a stop string of the task, eos or
        its ``max_gen_toks``; the text before the first stop string (lm_eval's post-processing)."""
        from tqdm.auto import tqdm

        from lmforge.infer.engine import Engine, SamplingParams
        from lmforge.infer.generate import StreamingDecoder

        eos_text = self.tokenizer.decode([self.eot_token_id])
        jobs = []
        clamped = 0
        for context, gen_kwargs in (req.args for req in requests):
            until, max_gen, sampling = _generation_settings(gen_kwargs, self.max_gen_toks, eos_text)
            ids = self.tok_encode(context)
            room = self.max_length - max_gen  # as lm_eval's hf backend: the context keeps its last `room` tokens
            if room <= 0:  # where the hf backend stops with an error: the prompt keeps half the context
                ids = ids[-(self.max_length // 2):]
                max_gen = self.max_length - max(len(ids), 1)
                clamped += 1
            else:
                ids = ids[-room:]
            ids = ids or [self.prefix_token_id]
            jobs.append({"context": context, "kwargs": gen_kwargs, "until": until, "ids": ids, "max": max_gen,
                         "sampling": sampling, "tokens": [], "text": "", "checked": 0, "error": None})
        if clamped:
            warnings.warn(f"{clamped} generation request(s) asked for at least the model's whole context "
                          f"({self.max_length} tokens) of new tokens: their prompts keep their last "
                          f"{self.max_length // 2} tokens and generation stops when the context is full",
                          stacklevel=2)
        order = sorted(range(len(jobs)), key=lambda j: -len(jobs[j]["ids"]))
        engine = Engine(self.model, self.eot_token_id, max_batch_size=self.batch_size, max_queue=len(jobs) + 1,
                        background=False)
        bar = tqdm(total=len(jobs), desc="lmforge generate_until", disable=disable_tqdm or not self.progress)
        state = {"done": 0}
        longest_stop = max((len(s) for job in jobs for s in job["until"]), default=0)

        def listener(job: dict[str, Any], decoder: StreamingDecoder):
            def on_event(event) -> None:
                kind, value = event
                if kind == "token":
                    job["tokens"].append(value)
                    job["text"] += decoder.push(value)
                    start = max(0, job["checked"] - longest_stop)
                    if any(s and s in job["text"][start:] for s in job["until"]):
                        job["request"].cancel()  # what follows a stop string is cut off anyway
                    job["checked"] = len(job["text"])
                    return
                if kind == "error":
                    job["error"] = value
                state["done"] += 1
                bar.update(1)
                if state["done"] == len(jobs):
                    engine.close()
            return on_event

        for j in order:
            job = jobs[j]
            if job["max"] < 1:
                state["done"] += 1
                bar.update(1)
                continue
            params = SamplingParams(max_tokens=job["max"], **job["sampling"])
            job["request"] = engine.submit(job["ids"], params, listener(job, StreamingDecoder(self.tokenizer)))
        if state["done"] < len(jobs):
            engine.run()
        bar.close()
        out = []
        for job in jobs:
            if job["error"]:
                raise LMForgeError(f"generation failed: {job['error']}")
            text = self.tokenizer.decode(job["tokens"], skip_special_tokens=True)
            for stop in job["until"]:
                if stop:
                    text = text.split(stop)[0]
            self.cache_hook.add_partial("generate_until", (job["context"], job["kwargs"]), text)
            out.append(text)
        self.computed["generate_until"] += len(jobs)
        return out


def _generation_settings(gen_kwargs: dict[str, Any], default_max: int, eos_text: str):
    """lm_eval's generation kwargs -> (stop strings with eos's text, max new tokens, SamplingParams fields)."""
    kwargs = dict(gen_kwargs or {})
    until = kwargs.pop("until", None)
    until = [until] if isinstance(until, str) else list(until or [])
    if eos_text not in until:
        until.append(eos_text)
    max_gen = default_max
    for alias in ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens"):  # lm_eval's priority
        if kwargs.get(alias) is not None:
            max_gen = int(kwargs[alias])
            break
    temperature = float(kwargs.get("temperature") or 0.0)
    if not kwargs.get("do_sample", temperature > 0):
        temperature = 0.0
    sampling = {"temperature": temperature, "top_p": float(kwargs.get("top_p") or 1.0),
                "top_k": int(kwargs.get("top_k") or 0)}
    if kwargs.get("seed") is not None:
        sampling["seed"] = int(kwargs["seed"])
    return until, max_gen, sampling


def _register() -> None:
    if _Base is object:
        return
    import lm_eval.models  # noqa: F401  (lm_eval fills its registry lazily only while it is empty)
    from lm_eval.api.registry import register_model

    try:
        register_model("lmforge")(LMForgeLM)
    except (AssertionError, ValueError, KeyError):  # already registered (a reloaded module)
        pass


_register()


# ---- loading, tasks, errors -----------------------------------------------------------------------------
def check_language_model(checkpoint: str | os.PathLike) -> None:
    """Refuse a checkpoint that is not a gpt-family language model, saying how it is evaluated instead
    (reads its config only)."""
    from lmforge.checkpoint import checkpoint_family
    from lmforge.models.gpt import GPT
    from lmforge.recipes import kind_of_family, kinds, model_class

    family = checkpoint_family(checkpoint, strict=True)
    # What LMForgeLM drives is GPT's interface (load_language_model loads with model_class=GPT): the test
    # is on the family's model class, so a kind of another package that trains a GPT passes it too.
    if not issubclass(model_class(family), GPT):
        kind = kind_of_family(family)
        text = [spec for spec in kinds() if any(issubclass(cls, GPT) for cls in spec.model_classes())]
        text_families = sorted({cls.family for spec in text for cls in spec.model_classes() if issubclass(cls, GPT)})
        raise LMForgeError(f"`lmforge eval --tasks` runs lm-evaluation-harness on language models (the "
                           f"{', '.join(text_families)} famil{'y' if len(text_families) == 1 else 'ies'}: kinds "
                           f"{', '.join(spec.name for spec in text)}); {checkpoint} holds a {family!r} model (kind "
                           f"{kind.name}), which does not model text. `lmforge eval {checkpoint}` without --tasks "
                           f"scores it ({kind.eval.help if kind.eval else 'no evaluation'})")


def load_language_model(checkpoint: str | os.PathLike, device: str = "auto"):
    """``(model, tokenizer, device)`` of a gpt-family checkpoint in fp32 (``check_language_model``)."""
    from lmforge.infer.loading import load_for_inference
    from lmforge.models.gpt import GPT

    check_language_model(checkpoint)
    return load_for_inference(checkpoint, device, precision="fp32", model_class=GPT)


def split_task_names(tasks: str | Sequence[str]) -> list[str]:
    names = [t.strip() for part in ([tasks] if isinstance(tasks, str) else tasks) for t in str(part).split(",")]
    names = [t for t in names if t]
    if not names:
        raise LMForgeError("--tasks is empty: name one or more lm-evaluation-harness tasks, e.g. "
                           "--tasks hellaswag,arc_easy")
    return names


def make_task_manager(names: Sequence[str], include_path: Sequence[str | os.PathLike] | str | None = None):
    """lm_eval's TaskManager for ``names``. When every name is a task (not a group or tag) of
    ``include_path``, only those directories are indexed (lm_eval's ~15,000 built-in task configs take
    seconds to index); otherwise the built-in tasks too. An unknown name is an error that suggests close
    names."""
    from lm_eval.tasks import TaskManager

    paths = [str(Path(p)) for p in ([include_path] if isinstance(include_path, (str, os.PathLike)) else
                                     (include_path or []))]
    for p in paths:
        if not Path(p).is_dir():
            raise LMForgeError(f"--include-path {p} is not a directory (it should hold lm_eval task YAML files)")
    wanted = [n for n in names if not Path(n).is_file()]  # a task YAML's path is a task too
    if paths:
        local = TaskManager(include_path=paths, include_defaults=False)
        if all(n in local.all_subtasks for n in wanted):  # plain tasks: a group may name built-in ones
            return local
    manager = TaskManager(include_path=paths or None)
    unknown = [n for n in wanted if n not in manager.all_tasks]
    if unknown:
        lines = []
        for name in unknown:
            close = difflib.get_close_matches(name, manager.all_tasks, n=5, cutoff=0.6)
            if not close:
                lowered = name.lower()
                close = [t for t in manager.all_tasks if lowered in t.lower()][:5]
            lines.append(f"{name!r}" + (f" (did you mean: {', '.join(close)}?)" if close else ""))
        where = f" and --include-path {', '.join(paths)}" if paths else ""
        raise LMForgeError(f"unknown lm-evaluation-harness task {'; '.join(lines)}: no such task, group or tag among "
                           f"the {len(manager.all_tasks)} names of lm_eval{where}. List them with `lm-eval ls tasks`; "
                           "a task of your own is a YAML file in a directory given to --include-path")
    return manager


@contextmanager
def _naming_missing_datasets(names: Sequence[str]) -> Iterator[None]:
    """A task whose data `datasets` cannot load (not in the local cache, and offline or unreachable)
    becomes an error that names the dataset and says how to fetch it."""
    import datasets

    original = datasets.load_dataset
    failed: list[tuple[Any, Any, BaseException]] = []

    def load_dataset(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except Exception as e:
            path = kwargs.get("path", args[0] if args else None)
            failed.append((path, kwargs.get("name", args[1] if len(args) > 1 else None), e))
            raise

    datasets.load_dataset = load_dataset  # lm_eval's tasks call it through the module
    try:
        yield
    except Exception as e:
        if not failed or isinstance(e, LMForgeError):
            raise
        path, name, cause = failed[-1]
        call = f"datasets.load_dataset({path!r}" + (f", {name!r}" if name else "") + ")"
        offline = [v for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
                   if os.environ.get(v, "").lower() in ("1", "true", "yes", "on")]
        why = (f"this process is offline ({', '.join(f'{v}=1' for v in offline)}) and it is not in the local "
               "datasets cache" if offline else "it is not in the local datasets cache and could not be downloaded")
        cache = getattr(datasets.config, "HF_DATASETS_CACHE", "~/.cache/huggingface/datasets")
        raise LMForgeError(
            f"the data of task(s) {', '.join(names)} could not be loaded: they need the Hugging Face dataset {path!r}"
            + (f" (subset {name!r})" if name else "") + f", and {why} ({type(cause).__name__}: {cause}). Fetch it "
            f"where there is network access: python -c \"import datasets; {call}\" (it lands in the datasets cache, "
            f"{cache}; on another machine, copy that directory here), then run offline with HF_DATASETS_OFFLINE=1"
        ) from e
    finally:
        datasets.load_dataset = original


# ---- run directory, cache, results ------------------------------------------------------------------------
def run_directory(model_dir: Path) -> Path:
    """The run a checkpoint belongs to (runs/NAME for runs/NAME/checkpoints/step-N or best); a checkpoint
    outside a run is its own directory."""
    return model_dir.parent.parent if model_dir.parent.name == "checkpoints" else model_dir


def checkpoint_fingerprint(model_dir: Path, tokenizer, max_length: int) -> str:
    """What the cached answers depend on: the weights file (size and modification time: ``best/`` is
    rewritten while a run trains), the tokenizer, the context, and how requests become tokens."""
    from lmforge.checkpoint import weight_files

    files = "|".join(f"{w.resolve()}|{w.stat().st_size}|{w.stat().st_mtime_ns}" for w in weight_files(model_dir))
    text = f"{files}|{tokenizer.sha256}|{max_length}|{CONVENTION}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class HarnessResult:
    results: dict[str, Any]  # lm_eval's results dict (JSON-ready), with an "lmforge" section
    path: Path | None  # the JSON file written
    table: str


def run_tasks(checkpoint: str | os.PathLike, tasks: str | Sequence[str], limit: float | None = None,
              device: str = "auto", batch_size: int | None = None, num_fewshot: int | None = None,
              include_path: Sequence[str | os.PathLike] | str | None = None, use_cache: bool = True,
              cache_dir: str | os.PathLike | None = None, output_dir: str | os.PathLike | None = None,
              log_samples: bool = False, bootstrap_iters: int = 100_000, confirm_run_unsafe_code: bool = False,
              progress: bool = True, seed: int = 0) -> HarnessResult:
    """Run lm-evaluation-harness ``tasks`` on a gpt-family checkpoint in this process.

    Results (lm_eval's dict; per-sample records too with ``log_samples``) are written as JSON to
    ``RUN_DIR/eval/harness-<checkpoint>-<time>.json`` (``output_dir`` instead of ``RUN_DIR/eval``);
    model answers are cached in ``RUN_DIR/eval/lm_eval_cache/`` (``cache_dir``), one sqlite file per
    checkpoint state, so a second run of the same tasks computes nothing it has answered before."""
    lm_eval = require_lm_eval()
    from lm_eval.utils import handle_non_serializable, make_table

    from lmforge.checkpoint import resolve_model_dir
    from lmforge.files import atomic_file, reporting_write_faults

    names = split_task_names(tasks)
    if limit is not None and limit <= 0:
        limit = None
    if batch_size is not None and batch_size < 1:
        raise LMForgeError("--batch-size must be >= 1")
    model_dir = resolve_model_dir(checkpoint)
    check_language_model(checkpoint)
    manager = make_task_manager(names, include_path)  # an unknown task name fails before the model loads
    model, tokenizer, dev = load_language_model(checkpoint, device)
    if batch_size is None:
        batch_size = 8 if dev.type == "cpu" else 32
    lm = LMForgeLM(model=model, tokenizer=tokenizer, batch_size=batch_size, progress=progress)
    lm.checkpoint = str(model_dir)
    run_dir = run_directory(model_dir)
    out_dir = Path(output_dir) if output_dir else run_dir / "eval"
    cache_path = None
    if use_cache:
        cache_root = Path(cache_dir) if cache_dir else run_dir / "eval" / "lm_eval_cache"
        cache_path = cache_root / f"{model_dir.name}-{checkpoint_fingerprint(model_dir, tokenizer, lm.max_length)}"
    started = time.perf_counter()
    faults = reporting_write_faults(cache_path or out_dir, fix="and run the command again")
    with _naming_missing_datasets(names), faults:
        results = lm_eval.simple_evaluate(
            model=lm, tasks=names, task_manager=manager, num_fewshot=num_fewshot, limit=limit,
            use_cache=None if cache_path is None else str(cache_path), log_samples=log_samples,
            bootstrap_iters=bootstrap_iters, confirm_run_unsafe_code=confirm_run_unsafe_code, random_seed=seed,
            numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
    wall = time.perf_counter() - started
    results = json.loads(json.dumps(results, default=handle_non_serializable))  # numpy scalars -> JSON
    results["lmforge"] = {
        "checkpoint": str(model_dir), "tasks": names, "limit": limit, "num_fewshot": num_fewshot,
        "device": str(dev), "batch_size": batch_size, "max_length": lm.max_length, "convention": CONVENTION,
        "cache": None if cache_path is None else f"{cache_path}_rank0.db", "computed_requests": dict(lm.computed),
        "wall_s": round(wall, 3)}
    table = make_table(results)
    if results.get("groups"):
        table += "\n" + make_table(results, "groups")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"harness-{model_dir.name}-{stamp}.json"
    n = 1
    while path.exists():  # two runs in one second
        n += 1
        path = out_dir / f"harness-{model_dir.name}-{stamp}-{n}.json"
    with reporting_write_faults(path, fix="and run the command again"):
        out_dir.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as tmp:
            tmp.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    return HarnessResult(results, path, table)
