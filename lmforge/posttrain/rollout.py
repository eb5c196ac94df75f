"""Rollouts: completions sampled from the policy being trained, laid out for the update that learns
from them. What the reinforcement-learning kinds (grpo, ppo) share.

- **Prompts** (``read_prompt_splits``, ``encode_prompt``): rows of JSONL with ``messages`` (and
  optional ``tools`` / ``answer``). A row whose last message is an assistant turn is a prompt (every
  message before it) plus its reference reply (that turn), as ``lmforge data tool-calls`` writes them;
  any other row is all prompt. Prompts are encoded exactly as ``lmforge serve`` prompts.
- **Sampling** (``sample``): completions of many prompts at once through the server's
  continuous-batching, KV-cached ``Engine``, run in the caller's thread, at a temperature / top-p /
  top-k, each completion with its own seed (``completion_seed``: a rollout seed and counters), so a
  rollout is reproducible and a resumed run samples what the uninterrupted one would have.
- **Layout** (``pack_sequences``): prompt + completion sequences packed several to a row as
  documents (no attention between them), with the targets on the completion tokens (its closing eos
  included) and any per-token values (old / reference log-probs, advantages, loss weights) aligned
  with the targets; ``sequence_logprobs`` reads each sequence's completion log-probs back out of a
  no-grad forward.
- **Held-out evaluation** (``HeldOutPrompts``, ``held_out_figures``): greedy replies to held-out
  prompts scored by the run's reward functions; ``eval/reward`` picks ``checkpoints/best``.
- **Objective pieces**: ``group_advantages`` (GRPO's group-normalised rewards), ``loss_weights`` (how
  per-token losses are averaged), ``clipped_surrogate`` (the PPO-clip policy term) and ``k3_kl`` (the
  unbiased, always-positive KL estimate of Schulman's "Approximating KL divergence").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.errors import LMForgeError
from lmforge.models.losses import IGNORE_INDEX
from lmforge.posttrain.formats import RowError, _jsonl_rows, _messages, _Problem, _tools
from lmforge.posttrain.packing import PAD_DOCUMENT, ROUND_TO, pack_rows
from lmforge.recipes import ModelHost

AGGREGATIONS = ("token", "sequence", "fixed")
# What data.train_path holds for the kinds that sample (for their messages).
PROMPT_ROWS = ("a JSONL file of rows with 'messages' (and optional 'tools', 'answer'), or a directory with train.jsonl "
               "(and val.jsonl), e.g. one written by `lmforge data tool-calls --out DIR`")


# ---- prompts ---------------------------------------------------------------------------------------
def read_message_rows(file: str | Path, fix: str, check: Callable[[dict[str, Any]], Any] | None = None
                      ) -> list[dict[str, Any]]:
    """The rows of a JSONL file, each an object with a ``messages`` list (OpenAI form), optional
    ``tools`` (a list) and any other fields (``answer`` ...) the reward functions read; ``check(row)``
    raises ``LMForgeError`` for anything else the caller requires. A bad row is refused as
    ``FILE:LINE: what is wrong``; a missing file with ``fix`` (what to give instead). Messages and
    tools come out as the sft reader (``lmforge.posttrain.formats``) reads them."""
    from lmforge.chat import check_messages

    file = Path(file)
    if not file.is_file():
        raise LMForgeError(f"{file} does not exist; {fix}")
    rows = []
    for where, row in _jsonl_rows(file):
        if isinstance(row, RowError):  # not JSON
            raise row
        if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
            raise LMForgeError(f"{where}: a row must be an object with a 'messages' list")
        if row.get("tools") is not None and not isinstance(row["tools"], list):
            raise LMForgeError(f"{where}: 'tools' must be a list of tool definitions")
        try:
            check_messages(row["messages"])  # before check, which reads the messages as given
            if check is not None:
                check(row)
            row = {**row, "messages": _messages(row["messages"], "messages")}
            if row.get("tools"):
                row["tools"] = _tools(row["tools"])
        except (LMForgeError, _Problem) as e:
            raise LMForgeError(f"{where}: {e}") from None
        rows.append(row)
    if not rows:
        raise LMForgeError(f"{file} holds no rows")
    return rows


def read_prompt_rows(file: str | Path) -> list[dict[str, Any]]:
    """Prompt rows (``read_message_rows``) for the kinds that sample: each must leave a prompt."""
    return read_message_rows(file, "give a JSONL file of rows with 'messages', or a directory with train.jsonl (and "
                             "val.jsonl), e.g. one written by `lmforge data tool-calls`", prompt_messages)


def read_prompt_splits(path: str | Path, val_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Training and held-out prompt rows: ``DIR/train.jsonl`` and ``DIR/val.jsonl`` of a directory
    (val optional), or one JSONL file of which ``val_fraction`` of the rows (chosen by ``seed``) are
    held out."""
    path = Path(path)
    if path.is_dir():
        if not (path / "train.jsonl").is_file():
            raise LMForgeError(f"{path} has no train.jsonl; give a directory written by `lmforge data tool-calls` "
                               "or a JSONL file of rows with 'messages'")
        val = path / "val.jsonl"
        return read_prompt_rows(path / "train.jsonl"), read_prompt_rows(val) if val.is_file() else []
    rows = read_prompt_rows(path)
    held = np.random.default_rng(seed).random(len(rows)) < val_fraction
    if val_fraction > 0 and len(rows) > 1 and not held.any():
        held[-1] = True
    return [r for r, h in zip(rows, held) if not h], [r for r, h in zip(rows, held) if h]


def prompt_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation a row prompts with: all its messages but a closing assistant turn."""
    messages = row["messages"]
    prompt = messages[:-1] if messages[-1].get("role") == "assistant" else messages
    if not prompt or prompt[-1].get("role") == "assistant":
        raise LMForgeError("a prompt row needs a user or tool message for the model to reply to (its last "
                           "message, or the one before a closing assistant turn)")
    return prompt


def reference_message(row: dict[str, Any]) -> dict[str, Any] | None:
    """The row's reference reply (its closing assistant turn), or None."""
    last = row["messages"][-1]
    return last if last.get("role") == "assistant" else None


def encode_prompt(tokenizer: Any, row: dict[str, Any]) -> list[int]:
    """The ids ``lmforge serve`` feeds the model for the row's prompt: ``[eos] + encode(template)``."""
    return [tokenizer.eos_id, *tokenizer.encode_chat(prompt_messages(row), tools=row.get("tools") or None)]


@dataclass
class Prompts:
    """Prompt rows and their ids (``encode_prompt``)."""

    rows: list[dict[str, Any]]
    ids: list[list[int]]


def encode_prompts(tokenizer: Any, rows: list[dict[str, Any]], longest: int) -> tuple[Prompts, int]:
    """The rows whose prompt has at most ``longest`` ids, encoded; and how many were too long."""
    kept_rows, kept_ids = [], []
    for row in rows:
        ids = encode_prompt(tokenizer, row)
        if len(ids) <= longest:
            kept_rows.append(row)
            kept_ids.append(ids)
    return Prompts(kept_rows, kept_ids), len(rows) - len(kept_rows)


class PromptOrder:
    """The order prompts are drawn in: endless epochs, each a permutation of the ``n`` prompts drawn
    from ``(seed, epoch)``; under DDP rank ``r`` takes the epoch's places ``r, r + world, ...`` (the
    last ``n % world`` are dropped, so every rank draws as many). Its state is ``(epoch, position)``."""

    def __init__(self, n: int, seed: int, rank: int = 0, world_size: int = 1):
        if n < world_size:
            raise LMForgeError(f"{n} prompts for {world_size} processes: every process needs its own prompts; use "
                               "more prompts or fewer processes")
        self.n, self.seed, self.rank, self.world_size = n, seed, rank, world_size
        self.epoch, self.position = 0, 0

    def _mine(self, epoch: int) -> np.ndarray:
        order = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return order[self.rank:self.n - self.n % self.world_size:self.world_size]

    def take(self, k: int) -> list[int]:
        """The next ``k`` prompt indices of this rank (crossing into the next epoch when needed)."""
        out: list[int] = []
        while len(out) < k:
            mine = self._mine(self.epoch)
            picked = mine[self.position:self.position + k - len(out)]
            out += picked.tolist()
            self.position += len(picked)
            if self.position >= len(mine):
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "prompts": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["prompts"]) != self.n:
            raise LMForgeError(f"the checkpoint was drawing from {state['prompts']} prompts, this data has {self.n}: "
                               "resume with the same prompts, or start a new run (name=NEW) with "
                               "training.init_from=CHECKPOINT")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


# ---- sampling --------------------------------------------------------------------------------------
def completion_seed(seed: int, *counters: int) -> int:
    """A 63-bit sampling seed from a run's seed and counters (rank, rollout, completion ...): distinct
    streams for distinct counters, the same for the same ones."""
    words = np.random.SeedSequence([seed % 2**63, *counters]).generate_state(2, dtype=np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


@dataclass
class Completion:
    tokens: list[int]  # the generated ids, the eos that ended it not included
    ended: bool  # it ended with the eos token (False: it hit max_new_tokens or filled the context)
    # sample(logprobs=True): the log-probability of each id the update scores (the tokens, then the
    # closing eos when it ended) under the sampling distribution (logits / temperature), in fp32
    logprobs: list[float] | None = None


def sample(model: Any, prompts: list[list[int]], eos_id: int, max_new_tokens: int, temperature: float = 1.0,
           top_p: float = 1.0, top_k: int = 0, seeds: list[int] | None = None, batch_size: int = 64,
           on_done: Callable[[], None] | None = None, logprobs: bool = False) -> list[Completion]:
    """One completion per prompt (pass a prompt several times for several completions), decoded by the
    continuous-batching ``Engine`` in this thread. ``seeds`` (one per prompt) make sampling reproducible:
    a completion's randomness is its own, whatever else is in the batch; temperature 0 is greedy. The
    model is left in the train / eval mode it was in. ``on_done()`` is called as each one ends.
    ``logprobs``: each completion also carries its ids' log-probabilities as sampled (``Completion``),
    what the update's ratio compares with: no forward pass is spent on them afterwards."""
    from lmforge.infer.engine import Engine, SamplingParams

    if not prompts:
        return []
    if max_new_tokens < 1:
        raise LMForgeError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if seeds is not None and len(seeds) != len(prompts):
        raise LMForgeError(f"{len(seeds)} seeds for {len(prompts)} prompts: give one seed per prompt")
    n_ctx = model.config.n_positions
    too_long = [len(p) for p in prompts if len(p) >= n_ctx]
    if too_long:
        raise LMForgeError(f"{len(too_long)} of {len(prompts)} prompts do not fit the model's context of {n_ctx} "
                           f"tokens (the longest has {max(too_long)}); use a model with a longer context "
                           "(model.n_positions) or rows with fewer tools")
    was_training = model.training
    # The cache holds as many rows as are decoded at once and each as long as the longest prompt plus
    # its reply (+ 2: the engine stops a row one step before its cache is full), not the model's whole
    # context: at 7B and 64 x 2,048 tokens that would be 69 GB of keys and values.
    engine = Engine(model, eos_id=eos_id, max_batch_size=max(1, min(batch_size, len(prompts))),
                    max_queue=len(prompts) + 1, background=False,
                    max_len=max(len(p) for p in prompts) + max_new_tokens + 2)
    tokens: list[list[int]] = [[] for _ in prompts]
    ended = [False] * len(prompts)
    errors: list[str] = []
    left = [len(prompts)]

    def on_event(i: int, event: tuple[str, Any]) -> None:
        kind, value = event
        if kind == "token":
            tokens[i].append(value)
            return
        if kind == "error":
            errors.append(str(value))
        ended[i] = kind == "done" and value == "stop"
        left[0] -= 1
        if on_done is not None:
            on_done()
        if left[0] == 0:
            engine.close()  # run() returns after this step

    requests = []
    try:
        for i, ids in enumerate(prompts):
            params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                    seed=None if seeds is None else seeds[i], logprobs=logprobs)
            requests.append(engine.submit(ids, params, lambda e, i=i: on_event(i, e)))
        engine.run()
    finally:
        if was_training:
            model.train()
    if errors:
        raise LMForgeError(f"generation failed for {len(errors)} prompts: {errors[0]}")
    return [Completion(t, e, r.logprobs if logprobs else None) for t, e, r in zip(tokens, ended, requests)]


# ---- layout ----------------------------------------------------------------------------------------
def pack_sequences(prompts: list[list[int]], completions: list[list[int]], seq_len: int,
                   values: dict[str, list[np.ndarray]] | None = None,
                   with_last_token: bool = False, share_prompts: bool = False,
                   row_len: int | None = None) -> dict[str, Any]:
    """Prompt + completion sequences packed into rows of at most ``row_len`` positions (default
    ``seq_len``; best-fit decreasing), each its own document of at most ``seq_len`` positions:
    positions restart at 0, no attention between documents. ``row_len``: see ``row_length``.

    ``completions[i]`` holds the ids the model is to be scored on (a generated reply and its closing
    eos when it has one). Returns ``input_ids``, ``labels`` (the completion ids at the positions that
    predict them, ``-100`` elsewhere), ``position_ids``, ``document_ids`` (``-1`` on padding),
    ``sequence_ids`` (the sequence's index in the lists, ``-1`` on padding and shared prompts),
    ``last_index`` (each sequence's last input position as a flat index into the ``B * T``
    positions), ``num_examples``, and for each ``values[key]`` (one float array per sequence, one
    value per completion id) a ``[B, T]`` fp32 tensor of the values at their ids' label positions
    (0 elsewhere).

    By default a sequence's last id is only a target (training); ``with_last_token`` feeds it as an
    input too (a reward model reads the whole reply, its closing eos included, at ``last_index``).

    ``share_prompts``: sequences with the same prompt (GRPO's group) that fit one row share one copy
    of it: the prompt but its last token is a document of its own, and each completion is a document
    that starts with that last token and sees the whole shared part (``prefix_ids``: the number of the
    document a token also attends to, ``-1`` for none). A group of 8 completions of a 300-token
    prompt is then ~700 positions instead of ~2,800; every log-prob is the same as unshared."""
    values = values or {}
    n = len(prompts)
    if len(completions) != n or any(len(v) != n for v in values.values()):
        raise ValueError("one completion (and one array per value) for each prompt")
    drop = 0 if with_last_token else 1
    lengths = [len(p) + len(c) - drop for p, c in zip(prompts, completions)]
    if n and max(lengths) > seq_len:
        raise LMForgeError(f"a prompt and its completion take {max(lengths)} positions, more than the rows' "
                           f"{seq_len}; raise data.seq_len or lower the completion length")
    capacity = max(seq_len, row_len or seq_len)
    units = _layout_units(prompts, completions, lengths, drop, capacity, share_prompts)
    unit_lengths = np.asarray([size for _, _, size in units], dtype=np.int64)
    rows = pack_rows(unit_lengths, capacity, np.arange(len(units))) if units else []
    longest = max((int(unit_lengths[r].sum()) for r in rows), default=1)
    shape = (len(rows), min(capacity, -(-longest // ROUND_TO) * ROUND_TO))
    inputs = np.zeros(shape, dtype=np.int64)
    labels = np.full(shape, IGNORE_INDEX, dtype=np.int64)
    positions = np.zeros(shape, dtype=np.int64)
    documents = np.full(shape, PAD_DOCUMENT, dtype=np.int64)
    prefixes = np.full(shape, -1, dtype=np.int64)
    sequences = np.full(shape, -1, dtype=np.int64)
    tensors = {key: np.zeros(shape, dtype=np.float32) for key in values}
    last = np.zeros(n, dtype=np.int64)
    for r, row in enumerate(rows):
        at = doc = 0
        for u in row:
            shared, members, _ = units[u]
            prefix_doc, start = -1, 0  # the shared prompt's document, and where the members' own ids begin
            if shared:
                head = prompts[members[0]][:-1]
                inputs[r, at:at + len(head)] = head
                positions[r, at:at + len(head)] = np.arange(len(head))
                documents[r, at:at + len(head)] = prefix_doc = doc
                at, doc, start = at + len(head), doc + 1, len(head)
            for i in members:
                prompt, completion = prompts[i], completions[i]
                length = lengths[i] - start
                span = slice(at, at + length)
                inputs[r, span] = np.asarray([*prompt, *completion], dtype=np.int64)[start:start + length]
                positions[r, span] = np.arange(start, start + length)
                documents[r, span] = doc
                prefixes[r, span] = prefix_doc
                sequences[r, span] = i
                # position p predicts ids[p + 1]: the completion's ids are predicted from len(prompt) - 1 on
                first, count = at + len(prompt) - 1 - start, len(completion)
                labels[r, first:first + count] = completion
                for key, per_sequence in values.items():
                    if len(per_sequence[i]) != count:
                        raise ValueError(f"values[{key!r}][{i}] has {len(per_sequence[i])} entries for {count} ids")
                    tensors[key][r, first:first + count] = per_sequence[i]
                last[i] = r * shape[1] + at + length - 1
                at, doc = at + length, doc + 1
    batch = {"input_ids": torch.from_numpy(inputs), "labels": torch.from_numpy(labels),
             "position_ids": torch.from_numpy(positions), "document_ids": torch.from_numpy(documents),
             "sequence_ids": torch.from_numpy(sequences), "last_index": torch.from_numpy(last), "num_examples": n}
    if share_prompts:
        batch["prefix_ids"] = torch.from_numpy(prefixes)
    batch.update({key: torch.from_numpy(t) for key, t in tensors.items()})
    return batch


def row_length(seq_len: int, device: Any) -> int:
    """How long the packed rows of an update may be on ``device``. On CPUs attention runs one document
    at a time (``lmforge.models.gpt.PackedDocuments``), so one long row costs what several short ones
    do, without their padding: a micro-batch becomes one row (measured: a PPO rollout of 16 ~280-token
    sequences lost 27% of its update positions to padding in rows of 512, benchmarks/RESULTS.md).
    Elsewhere the mask is ``T x T`` per row: rows stay ``seq_len`` long."""
    device = torch.device(device) if not isinstance(device, torch.device) else device
    return 1 << 30 if device.type == "cpu" else seq_len


def _layout_units(prompts: list[list[int]], completions: list[list[int]], lengths: list[int], drop: int,
                  seq_len: int, share: bool) -> list[tuple[bool, list[int], int]]:
    """What ``pack_sequences`` places in rows, as ``(shares a prompt, sequence indices, positions)``:
    one sequence alone, or (``share``) sequences with one prompt that fit one row together."""
    if not share:
        return [(False, [i], lengths[i]) for i in range(len(prompts))]
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(tuple(prompt), []).append(i)
    units = []
    for key, members in groups.items():
        head = len(key) - 1  # the shared part: all of the prompt but its last token
        if len(members) < 2 or head < 1:
            units.extend((False, [i], lengths[i]) for i in members)
            continue
        part, size = [], head
        for i in members:
            own = 1 + len(completions[i]) - drop
            if part and size + own > seq_len:
                units.append((len(part) > 1, part, size) if len(part) > 1 else (False, part, lengths[part[0]]))
                part, size = [], head
            part.append(i)
            size += own
        units.append((True, part, size) if len(part) > 1 else (False, part, lengths[part[0]]))
    return units


def per_sequence(values: torch.Tensor, batch: dict[str, Any]) -> list[np.ndarray]:
    """A ``[B, T]`` tensor aligned with ``batch["labels"]`` read back as one fp32 array per sequence
    (its completion ids' values, in order): the inverse of ``pack_sequences``'s ``values``."""
    scored = batch["labels"] != IGNORE_INDEX
    owner = batch["sequence_ids"][scored].cpu()
    flat = values.detach()[scored].float().cpu()
    order = torch.argsort(owner, stable=True)  # a sequence's ids lie in order within its row
    counts = torch.bincount(owner, minlength=int(batch["num_examples"])).tolist()
    return [chunk.numpy() for chunk in torch.split(flat[order], counts)]


@torch.no_grad()
def sequence_logprobs(model: Any, batch: dict[str, Any], temperature: float = 1.0) -> list[np.ndarray]:
    """Each sequence's completion log-probs (fp32, one per completion id) under ``model`` at
    ``temperature``: the distribution a sampler at that temperature drew from. No gradient; the
    model's train / eval mode is the caller's to set."""
    from lmforge.posttrain.logprobs import token_logprobs

    device = next(model.parameters()).device
    on_device = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}
    return per_sequence(token_logprobs(model, on_device, temperature=temperature), batch)


# ---- held-out evaluation ---------------------------------------------------------------------------
class HeldOutPrompts:
    """A val loader for the RL kinds: greedy replies to held-out prompts, scored by the run's reward
    functions (a ``lmforge.posttrain.rewards.Rewards``). Each batch holds the scores of up to
    ``batch_size`` prompts of this process's share (``rank``, ``rank + world_size``, ...); the kind's
    loss turns it into figures with ``held_out_figures``. ``bind(model, gathered)`` before the first batch."""

    def __init__(self, prompts: Prompts, tokenizer: Any, rewards: Any, max_new_tokens: int, batch_size: int,
                 rank: int = 0, world_size: int = 1):
        self.prompts, self.tokenizer, self.rewards = prompts, tokenizer, rewards
        self.max_new_tokens, self.batch_size = max_new_tokens, batch_size
        self.mine = list(range(rank, len(prompts.ids), world_size))
        self.model = None
        self.gathered: Callable[..., Any] = ModelHost().gathered

    def bind(self, model: Any, gathered: Callable[..., Any] | None = None) -> None:
        """``model``: the policy that answers; ``gathered``: ``ModelHost.gathered`` (None: a single process)."""
        self.model, self.gathered = model, gathered or ModelHost().gathered

    @torch.no_grad()
    def iter_eval_batches(self, max_batches: int | None = None) -> Iterator[dict[str, Any]]:
        tok = self.tokenizer
        starts = list(range(0, len(self.mine), self.batch_size))[:max_batches]
        parts = [self.mine[start:start + self.batch_size] for start in starts]
        # All replies first, then all scores: each model is gathered once (under FSDP every process
        # enters each gathering, whatever its share, even none).
        with self.gathered(self.model):
            done = [sample(self.model, [self.prompts.ids[i] for i in picked], tok.eos_id, self.max_new_tokens,
                           temperature=0, batch_size=self.batch_size) for picked in parts]
        # (each reward model is gathered once, for every part's replies together)
        rows = [self.prompts.rows[i] for picked in parts for i in picked]
        flat = self.rewards.score(rows, [tok.decode(c.tokens) for d in done for c in d], self.gathered)
        bounds = np.cumsum([0] + [len(picked) for picked in parts])
        scores = [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        for d, s in zip(done, scores):
            yield {"eval_rewards": torch.from_numpy(s.astype(np.float32)),
                   "eval_total": torch.from_numpy(self.rewards.total(s).astype(np.float32)),
                   "eval_ended": torch.tensor([float(c.ended) for c in d]),
                   "eval_len": torch.tensor([float(len(c.tokens)) for c in d]),
                   "reward_labels": self.rewards.labels}


def held_out_figures(batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A ``HeldOutPrompts`` batch's figures (means over its prompts): ``reward`` (the weighted sum of
    the reward functions), ``reward/LABEL`` per function, ``eos_rate`` and ``completion_len``. Its loss
    is ``-reward``: lower is better, like every loss."""
    total = batch["eval_total"].float()
    metrics = {"reward": total.mean(), "eos_rate": batch["eval_ended"].float().mean(),
               "completion_len": batch["eval_len"].float().mean()}
    for j, label in enumerate(batch["reward_labels"]):
        metrics[f"reward/{label}"] = batch["eval_rewards"][:, j].float().mean()
    return -total.mean(), metrics


# ---- objective pieces ------------------------------------------------------------------------------
def group_advantages(rewards: np.ndarray, group_size: int, scale: bool = True, eps: float = 1e-4) -> np.ndarray:
    """GRPO's advantages: each completion's reward minus the mean of its group (the ``group_size``
    completions of the same prompt, consecutive in ``rewards``), divided by the group's standard
    deviation (population, so a group's advantages have unit variance) when ``scale``. A group whose
    rewards are all equal teaches nothing: its advantages are 0."""
    r = np.asarray(rewards, dtype=np.float64).reshape(-1, group_size)
    centred = r - r.mean(axis=1, keepdims=True)
    if scale:
        centred = centred / (r.std(axis=1, keepdims=True) + eps)
    return centred.reshape(-1).astype(np.float32)


def loss_weights(lengths: list[int], aggregation: str, max_new_tokens: int) -> np.ndarray:
    """One weight per sequence, given to each of its completion tokens, so that the weighted sum of
    per-token losses over ``lengths``' sequences is their mean as ``aggregation`` says:

    - ``token``: over all their tokens (DAPO; every token counts the same, whatever its reply's length);
    - ``sequence``: per sequence first, then over sequences (the original GRPO; a long reply's
      tokens count less);
    - ``fixed``: the sum divided by ``len(lengths) * max_new_tokens``, a constant (Dr. GRPO; no
      length bias at all)."""
    n = np.asarray(lengths, dtype=np.float64)
    if aggregation == "token":
        w = np.full_like(n, 1.0 / max(n.sum(), 1.0))
    elif aggregation == "sequence":
        w = 1.0 / (len(n) * np.maximum(n, 1.0))
    elif aggregation == "fixed":
        w = np.full_like(n, 1.0 / (len(n) * max_new_tokens))
    else:
        raise LMForgeError(f"unknown loss aggregation {aggregation!r}; use one of {', '.join(AGGREGATIONS)}")
    return w.astype(np.float32)


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, eps_low: float,
                      eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped policy term per token, ``-min(ρA, clip(ρ, 1 - eps_low, 1 + eps_high) A)`` with
    ``ρ = exp(logp - old_logp)``, and where the clipped branch is the smaller one (those tokens get no
    gradient: the update has already moved them as far as the clip allows)."""
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate ``exp(r) - r - 1`` with ``r = ref_logp - logp``:
    unbiased for tokens sampled from the policy, and never negative."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0


__all__ = ["AGGREGATIONS", "PROMPT_ROWS", "Completion", "HeldOutPrompts", "PromptOrder", "Prompts",
           "clipped_surrogate", "completion_seed", "encode_prompt", "encode_prompts", "group_advantages",
           "held_out_figures", "k3_kl", "loss_weights", "pack_sequences", "per_sequence", "prompt_messages",
           "read_message_rows", "read_prompt_rows", "read_prompt_splits", "reference_message", "row_length", "sample",
           "sequence_logprobs"]
