"""A generation engine that serves many requests at once by continuous batching.

One thread owns the model: a background thread by default, or the caller's with ``run()`` (``lmforge
serve`` runs it on the main thread and the HTTP server beside it: PyTorch's CPU kernels ran 10-25%
slower in a secondary thread here, benchmarks/RESULTS.md). Requests wait in a queue; each is
prefilled on its own, then joins the running batch, where every step decodes one token for every
sequence in one forward (``BatchedKVCache``: each row at its own length). A sequence leaves when it
ends and a waiting request takes its place at the next step, so a long reply never holds up a short
one and no step computes padding.

Prefill is chunked: each step prefills at most ``prefill_chunk`` prompt tokens (several short
prompts, or one chunk of a long one) before it decodes, so a long prompt arriving delays the running
sequences' next tokens by one chunk's forward, not by its whole prompt's. Prompts that start in the
same step (a burst of requests, a batch of scored ones) are prefilled in one packed forward
(``PackedPrefill``), which reads the weights once for all of them. And prompts share work: the
keys and values of the last ``prefix_cache`` prefilled prompts are kept, and a new prompt starting
with the same tokens (a long system prompt or tool list, a question scored with each of its answers,
the samples of one prompt that GRPO draws) copies them and computes only the rest.

Results go to each request's ``on_event`` callback, called on the engine thread with
``("token", id)``, then ``("done", finish_reason)`` or ``("error", message)``, or for a request with a
grammar ``("grammar_error", message)``: the grammar allows no way on (a schema whose values are endless,
which ``GrammarCompiler`` could not tell at compile time). finish_reason is
``"stop"`` (the eos token), ``"length"`` (max_tokens, or the context is full) or ``"cancelled"``.
With ``SamplingParams.logprobs`` the request also keeps each sampled token's log-probability
(``Request.logprobs``, the closing eos's included), of the distribution it was drawn from: the
logits divided by the temperature (1 when greedy), in fp32, before top-k / top-p narrowed it.

Each step can be reported to ``on_step`` (``Step``: when it started, how long its prefill and its
decode took, how many prompt tokens and rows each handled), read from ``clock`` (injectable, for
tests); ``lmforge serve --trace-steps FILE`` writes them as JSON lines, to tell the engine's own
stalls from the HTTP path's.

What the HTTP API reports is the model's own distribution instead (``lmforge.infer.logprobs``):
with ``SamplingParams.top_logprobs`` = n, each ``("token", id)`` event is preceded by
``("logprob", TokenLogprob)`` (its log-probability and the n most likely tokens); with
``prompt_logprobs`` = n, the first event is ``("prompt_logprobs", [None, TokenLogprob, ...])``, one per
prompt token, computed in the prefill's forward. ``max_tokens`` 0 (only with ``prompt_logprobs``)
scores the prompt and ends with ("done", "length") without generating.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lmforge.errors import LMForgeError
from lmforge.infer.constrain import apply_bitmask, fill_bitmask, new_bitmask
from lmforge.infer.generate import check_sampling, sample_rows
from lmforge.infer.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, prompt_logprobs, sampled_logprobs

Event = tuple[str, Any]
_log = logging.getLogger("lmforge.engine")


def _shared_length(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` start with in common."""
    m = min(len(a), len(b))
    if a[:m] == b[:m]:
        return m
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class QueueFull(LMForgeError):
    """Too many requests are waiting: a retry later can succeed (HTTP 429)."""


class EngineClosed(LMForgeError):
    """The engine is shutting down (HTTP 503)."""


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: bool = False  # keep each sampled token's log-probability (Request.logprobs)
    top_logprobs: int | None = None  # report each token's log-probability and the n most likely ("logprob")
    prompt_logprobs: int | None = None  # report the prompt's log-probabilities ("prompt_logprobs")
    grammar: Any = None  # an lmforge.infer.constrain.Grammar the reply must follow (masked logits)

    def __post_init__(self) -> None:
        if self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise LMForgeError(f"max_tokens must be >= 1, got {self.max_tokens} (0 only when scoring the prompt)")
        for name in ("top_logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
                raise LMForgeError(f"{name} must be in 0..{MAX_TOP_LOGPROBS}, got {n}")
        check_sampling(self.temperature, self.top_k, self.top_p)


@dataclass
class Step:
    """One turn of the engine loop, as ``on_step`` gets it (times in seconds of the engine's clock)."""
    start: float
    prefill_seconds: float  # 0 when no prompt was being prefilled
    decode_seconds: float  # 0 when no row was decoding
    prefilled: int  # prompt positions computed (copied ones from the prefix cache not counted)
    decoded: int  # rows that got a token in the decode forward
    waiting: int  # requests queued after the step's admissions


@dataclass
class _Prefix:
    """A prefilled prompt, kept for the prompts that start like it."""
    ids: list[int]
    cache: Any  # its KVCache of one row
    logits: torch.Tensor  # at its last position
    prompt: list[TokenLogprob | None] | None  # its tokens' log-probabilities, when it was scored
    scored: int  # how many most likely tokens each of those has; -1: not scored


@dataclass
class _Filling:
    """A request whose prompt is being prefilled, chunk by chunk."""
    request: Any
    started: bool = False  # the prefix cache was looked up
    cache: Any = None  # its KVCache of one row, once some of it is computed or copied
    done: int = 0  # prompt positions in the cache
    prompt: list[TokenLogprob | None] | None = None  # the log-probabilities of prompt tokens 0 .. done
    logits: torch.Tensor | None = None  # at the last prompt position, once done


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    on_event: Callable[[Event], Any]
    cancelled: bool = False
    generated: int = 0
    logprobs: list[float] = field(default_factory=list)  # with params.logprobs: one per sampled token
    _generator: torch.Generator | None = field(default=None, repr=False)
    _matcher: Any = field(default=None, repr=False)  # its place in params.grammar

    def cancel(self) -> None:
        """Stop generating for this request; it ends with ("done", "cancelled") at the next step."""
        self.cancelled = True


class Engine:
    """Continuous-batching generation over ``model`` (a ``GPT``) in a background thread."""

    def __init__(self, model: Any, eos_id: int, max_batch_size: int = 16, max_queue: int = 1024,
                 background: bool = True, prefill_chunk: int = 512, prefix_cache: int = 4,
                 on_step: Callable[[Step], Any] | None = None, clock: Callable[[], float] = time.perf_counter,
                 max_len: int | None = None):
        if max_batch_size < 1:
            raise LMForgeError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if prefill_chunk < 1 or prefix_cache < 0:
            raise LMForgeError(f"prefill_chunk must be >= 1 and prefix_cache >= 0, got {prefill_chunk} and "
                               f"{prefix_cache}")
        self.model = model.eval()
        self.eos_id = eos_id
        # Tokens per sequence (prompt + reply) the cache holds: the model's context, or less for callers
        # that know their longest sequence (a rollout: its longest prompt + max_new_tokens).
        self.n_ctx = min(max_len or model.config.n_positions, model.config.n_positions)
        self.max_batch_size = max_batch_size
        self.device = next(model.parameters()).device
        self._queue: queue.Queue[Request | None] = queue.Queue(maxsize=max_queue)
        self._rows: list[Request] = []  # the requests in the batch, in cache row order
        self._last: list[int] = []  # each row's latest token, the next step's input
        self._seeds = itertools.count(torch.initial_seed() % 2**62)
        self.prefill_chunk = prefill_chunk
        self._bitmask: torch.Tensor | None = None  # the constrained rows' allowed tokens, refilled each step
        self._filling: list[_Filling] = []  # admitted, prompt not prefilled yet (in order)
        self._prefixes: list[_Prefix] = []  # the last prefilled prompts, most recent last
        self._prefix_cache = prefix_cache
        self.prefills = 0  # prompts prefilled (wholly reused ones are not counted)
        self.prefilled_tokens = 0  # prompt positions computed (those copied from a shared prefix are not)
        self.prefill_forwards = 0  # forwards that computed them (prompts starting together share one)
        self.on_step, self.clock = on_step, clock
        self._closed = False
        self._lock = threading.Lock()  # orders submit() against close(): no request slips past the final drain
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self.run, name="lmforge-engine", daemon=True)
            self._thread.start()

    # ---- public -------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, on_event: Callable[[Event], Any]) -> Request:
        """Queue a request; raises ``LMForgeError`` when it cannot fit (``QueueFull`` when too many wait,
        ``EngineClosed`` after ``close``)."""
        if not prompt_ids:
            raise LMForgeError("the prompt has no tokens")
        if len(prompt_ids) > self.n_ctx or len(prompt_ids) == self.n_ctx and params.max_tokens > 0:
            raise LMForgeError(f"the prompt has {len(prompt_ids)} tokens; this model's context is {self.n_ctx} "
                               "tokens and must also hold the reply")
        request = Request(list(prompt_ids), params, on_event)
        with self._lock:
            if self._closed:
                raise EngineClosed("the engine is shut down")
            try:
                self._queue.put_nowait(request)
            except queue.Full:
                raise QueueFull(f"too many requests waiting ({self._queue.maxsize}); retry later") from None
        return request

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    @property
    def running(self) -> int:
        return len(self._rows)

    def close(self) -> None:
        """Stop the loop at its next step (``run`` returns); running and waiting requests end with
        ("done", "cancelled")."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._queue.put_nowait(None)  # wakes a loop that waits for work
        except queue.Full:
            pass  # a full queue means the loop is busy: it sees _closed at its next step
        if self._thread is not None:
            self._thread.join(timeout=30)

    def cancel_all(self) -> None:
        """End every running and waiting request with ("done", "cancelled"); for a loop that was
        interrupted (Ctrl-C) and will not run again."""
        for request in [*self._rows, *(f.request for f in self._filling)]:
            self._emit(request, ("done", "cancelled"))
        self._rows, self._last, self._filling = [], [], []
        while True:
            try:
                request = self._queue.get_nowait()
            except queue.Empty:
                return
            if request is not None:
                self._emit(request, ("done", "cancelled"))

    # ---- the engine loop ------------------------------------------------------------------------
    def run(self) -> None:
        """Serve requests in this thread until ``close``; only for an engine made with background=False."""
        self._cache = self.model.new_batched_kv_cache(self.max_batch_size, self.n_ctx)
        while not self._closed:
            if not self._admit():
                break
            start = prefilled = self.clock()
            before = self.prefilled_tokens
            if self._filling:
                self._prefill_step()
                prefilled = self.clock()
            tokens, rows = self.prefilled_tokens - before, len(self._rows)
            if self._rows:
                try:
                    self._decode_step()
                except Exception as e:  # e.g. out of memory: fail these requests, keep serving
                    for request in self._rows:
                        self._emit(request, ("error", f"generation failed: {e}"))
                    self._rows, self._last, self._prefixes = [], [], []
                    self._cache = self.model.new_batched_kv_cache(self.max_batch_size, self.n_ctx)
            if self.on_step is not None:
                end = self.clock()
                self._report(Step(start, prefilled - start, end - prefilled if rows else 0.0, tokens, rows,
                                  self._queue.qsize()))
        self.cancel_all()

    def _report(self, step: Step) -> None:
        try:
            self.on_step(step)
        except Exception:  # a failing observer (a full disk) must not stop the engine: stop observing
            self.on_step = None

    def _admit(self) -> bool:
        """Take waiting requests while there are free rows (blocking while there is nothing to do).
        Returns False when the engine is closing."""
        while len(self._rows) + len(self._filling) < self.max_batch_size:
            try:
                request = self._queue.get(block=not (self._rows or self._filling))
            except queue.Empty:
                return True
            if request is None or self._closed:
                if request is not None:
                    self._emit(request, ("done", "cancelled"))
                return False
            if request.cancelled:
                self._emit(request, ("done", "cancelled"))
                continue
            seed = request.params.seed if request.params.seed is not None else next(self._seeds)
            request._generator = torch.Generator().manual_seed(seed)
            if request.params.grammar is not None:
                request._matcher = request.params.grammar.matcher()
            self._filling.append(_Filling(request))
        return True

    def _prefill_step(self) -> None:
        """Prefill up to ``prefill_chunk`` prompt positions, oldest request first; a request whose
        prompt is done gets its first token and joins the batch. The prompts that start in this step
        (nothing of them computed or copied yet) share one packed forward."""
        budget = self.prefill_chunk
        fresh: list[tuple[_Filling, int]] = []
        for filling in list(self._filling):
            if budget <= 0:
                break
            if filling.request.cancelled:
                self._filling.remove(filling)
                self._emit(filling.request, ("done", "cancelled"))
                continue
            ids = filling.request.prompt_ids
            if not filling.started and self._prefix_cache and any(
                    2 * _shared_length(f.request.prompt_ids, ids) >= len(ids) for f, _ in fresh):
                continue  # wait a step and copy the half or more it shares with a prompt computed now
            try:
                if not filling.started:
                    filling.started = True
                    if self._reuse(filling):
                        continue  # the very same prompt was kept: nothing to compute
                n = min(budget, len(ids) - filling.done)
                budget -= n
                if filling.cache is None:
                    fresh.append((filling, n))
                else:
                    self._prefill_chunk(filling, n)
            except Exception as e:
                self._fail(filling, e)
        if len(fresh) == 1:
            filling, n = fresh[0]
            filling.cache = self.model.new_kv_cache(1, max_len=len(filling.request.prompt_ids))
            try:
                self._prefill_chunk(filling, n)
            except Exception as e:
                self._fail(filling, e)
        elif fresh:
            try:
                self._prefill_packed(fresh)
            except Exception as e:
                for filling, _ in fresh:
                    self._fail(filling, e)
        for filling in [f for f in self._filling if f.logits is not None]:
            self._filling.remove(filling)
            self._join(filling)

    def _fail(self, filling: _Filling, e: Exception) -> None:
        if filling in self._filling:
            self._filling.remove(filling)
        self._emit(filling.request, ("error", f"generation failed: {e}"))

    @torch.inference_mode()
    def _prefill_chunk(self, filling: _Filling, n: int) -> None:
        """Compute the next ``n`` positions of ``filling``'s prompt in its own forward."""
        ids, start = filling.request.prompt_ids, filling.done
        hidden = self.model.hidden_states(torch.tensor([ids[start:start + n]], device=self.device),
                                          kv_cache=filling.cache)[0]
        self.prefill_forwards += 1
        self._prefilled(filling, hidden, n)

    @torch.inference_mode()
    def _prefill_packed(self, fresh: list[tuple[_Filling, int]]) -> None:
        """Compute the first positions of several prompts in one packed forward (``PackedPrefill``)."""
        lengths = [n for _, n in fresh]
        packed = self.model.new_packed_prefill(lengths)
        ids = [t for filling, n in fresh for t in filling.request.prompt_ids[:n]]
        hidden = self.model.hidden_states(torch.tensor([ids], device=self.device), kv_cache=packed)[0]
        self.prefill_forwards += 1
        caches = packed.split([len(filling.request.prompt_ids) for filling, _ in fresh])
        for (filling, n), cache, part in zip(fresh, caches, hidden.split(lengths)):
            filling.cache = cache
            self._prefilled(filling, part, n)

    def _prefilled(self, filling: _Filling, hidden: torch.Tensor, n: int) -> None:
        """``hidden``: the final-norm outputs of ``filling``'s next ``n`` prompt positions, now cached."""
        ids, scored, start = filling.request.prompt_ids, filling.request.params.prompt_logprobs, filling.done
        if scored is not None:
            filling.prompt.extend(prompt_logprobs(self.model, hidden, ids[start + 1:start + n + 1], scored))
        filling.done += n
        self.prefilled_tokens += n
        if filling.done == len(ids):
            filling.logits = self.model.lm_head(hidden[-1:])[None]
            self.prefills += 1
            self._remember(filling)

    def _reuse(self, filling: _Filling) -> bool:
        """Start ``filling`` from the kept prompt sharing the longest beginning with it; returns True
        when that prompt is the very same (its logits are reused: nothing to compute). Leaves
        ``filling.cache`` None when nothing is shared."""
        ids, scored = filling.request.prompt_ids, filling.request.params.prompt_logprobs
        best, shared = None, 0
        for prefix in self._prefixes:
            if scored is not None and prefix.scored < scored:
                continue  # its prompt log-probabilities have fewer alternatives than asked
            n = _shared_length(prefix.ids, ids)
            if n > shared:
                best, shared = prefix, n
        filling.prompt = [None]
        if best is None:
            return False
        if shared == len(ids) == len(best.ids):
            filling.cache, filling.logits, filling.done = best.cache, best.logits, len(ids)  # add_row copies it
            filling.prompt = best.prompt
            self._prefixes.remove(best)
            self._prefixes.append(best)
            return True
        # Keep at least one position to compute (its logits are needed); when scoring, recompute the
        # last shared position too: the next token's log-probability is read from it.
        keep = min(shared, len(ids) - 1) - (scored is not None and shared <= len(ids) - 1)
        if keep <= 0:
            return False
        filling.cache = self.model.new_kv_cache(1, max_len=len(ids))
        for layer in range(len(best.cache.k)):
            filling.cache.k[layer][:, :, :keep] = best.cache.k[layer][:, :, :keep]
            filling.cache.v[layer][:, :, :keep] = best.cache.v[layer][:, :, :keep]
        filling.cache.pos = filling.done = keep
        if scored is not None:
            filling.prompt = best.prompt[:keep + 1]
        return False

    def _remember(self, filling: _Filling) -> None:
        if not self._prefix_cache:
            return
        scored = filling.request.params.prompt_logprobs
        self._prefixes.append(_Prefix(list(filling.request.prompt_ids), filling.cache, filling.logits,
                                      filling.prompt if scored is not None else None,
                                      -1 if scored is None else scored))
        del self._prefixes[:-self._prefix_cache]

    def _join(self, filling: _Filling) -> None:
        """The prompt is prefilled: report its scores, sample the first token, take a batch row."""
        request = filling.request
        scored = request.params.prompt_logprobs
        if scored is not None:
            self._emit(request, ("prompt_logprobs", [p if p is None else p._replace(top=p.top[:scored])
                                                     for p in filling.prompt]))
            if request.params.max_tokens == 0:
                self._emit(request, ("done", "length"))
                return
        tokens, logprobs, reported = self._sample(filling.logits[:, -1], [request])
        self._cache.add_row(filling.cache)
        self._rows.append(request)
        self._last.append(int(tokens[0]))
        self._deliver(len(self._rows) - 1, int(tokens[0]), None if logprobs is None else logprobs[0],
                      None if reported is None else reported[0])

    @torch.inference_mode()
    def _decode_step(self) -> None:
        inputs = torch.tensor(self._last, device=self.device)[:, None]
        logits = self.model.logits(inputs, kv_cache=self._cache)[:, -1]
        tokens, logprobs, reported = self._sample(logits, self._rows)
        tokens = tokens.tolist()
        # Deliver from the last row down: a removed row's place is taken by the (already handled) last one.
        for row in range(len(self._rows) - 1, -1, -1):
            self._last[row] = tokens[row]
            self._deliver(row, tokens[row], None if logprobs is None else logprobs[row],
                          None if reported is None else reported[row])

    @torch.inference_mode()
    def _sample(self, logits: torch.Tensor, requests: list[Request]
                ) -> tuple[torch.Tensor, list[float] | None, list[TokenLogprob] | None]:
        """The next token of each row (on the CPU); when any request keeps them, each one's
        log-probability under its row's temperature (1 when greedy); when any reports them, each
        one's ``TokenLogprob`` under the model's own distribution."""
        params = [r.params for r in requests]
        dev = logits.device
        wanted = [p.top_logprobs for p in params if p.top_logprobs is not None]
        raw = logits
        constrained = [row for row, r in enumerate(requests) if r._matcher is not None]
        if constrained:
            # Masked on a copy: the caller's logits may be a kept prompt's (the prefix cache), and what
            # is reported is the model's own distribution, before the mask.
            logits = logits.clone()
            if self._bitmask is None:
                self._bitmask = new_bitmask(self.max_batch_size, logits.size(-1))
            fill_bitmask([(requests[row]._matcher, row) for row in constrained], self._bitmask)
            apply_bitmask(logits, self._bitmask, constrained)
        temperature = torch.tensor([p.temperature for p in params], device=dev)
        if all(p.temperature == 0 for p in params):
            tokens = logits.argmax(dim=-1)
        else:
            uniform = torch.tensor([float(torch.rand((), generator=r._generator)) for r in requests])
            tokens = sample_rows(logits, temperature, torch.tensor([p.top_k for p in params], device=dev),
                                 torch.tensor([p.top_p for p in params], device=dev), uniform.to(dev))
        logprobs = None
        if any(p.logprobs for p in params):
            scaled = logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None]
            logprobs = (scaled.gather(-1, tokens[:, None]).squeeze(-1) - scaled.logsumexp(-1)).tolist()
        reported = sampled_logprobs(raw, tokens, max(wanted)) if wanted else None
        return tokens.cpu(), logprobs, reported

    def _deliver(self, row: int, token: int, logprob: float | None = None,
                 reported: TokenLogprob | None = None) -> None:
        """Hand ``token`` to its request, or end the request (eos, limits, cancel) and free its row."""
        request = self._rows[row]
        if logprob is not None and request.params.logprobs and not request.cancelled:
            request.logprobs.append(logprob)
        if request.cancelled:
            reason = "cancelled"
        elif request._matcher is not None and (not request._matcher.accept(token) or request._matcher.error):
            # End the request rather than break its format. A matcher in error (in its mask, then only eos was
            # allowed, or on this token) is the grammar's doing; its message is the parser's state: logged here,
            # not sent to clients. A token refused without one means the mask was not applied: the engine's bug.
            error = request._matcher.error
            if error:
                _log.warning("a grammar failed after %d tokens: %s", request.generated, error)
            self._emit(request, ("grammar_error", f"the reply's grammar allows no way on after {request.generated} "
                                                  "tokens") if error else
                       ("error", f"token {token} is outside the reply's grammar (the mask was not applied)"))
            self._free(row)
            return
        elif token == self.eos_id:
            reason = "stop"
        else:
            request.generated += 1
            n = request.params.top_logprobs
            if n is not None and reported is not None:
                self._emit(request, ("logprob", reported._replace(top=reported.top[:n])))
            self._emit(request, ("token", token))
            full = self._cache.lengths[row] + 1 >= self.n_ctx  # the next step would not fit
            reason = "length" if request.generated >= request.params.max_tokens or full else None
        if reason is None:
            return
        self._emit(request, ("done", reason))
        self._free(row)

    def _free(self, row: int) -> None:
        self._cache.remove_row(row)
        last = len(self._rows) - 1
        self._rows[row], self._last[row] = self._rows[last], self._last[last]
        self._rows.pop()
        self._last.pop()

    @staticmethod
    def _emit(request: Request, event: Event) -> None:
        try:
            request.on_event(event)
        except Exception:  # a callback that fails (a closed connection) must not stop the engine
            request.cancelled = True
