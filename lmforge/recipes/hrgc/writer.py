"""HRGC inference: spec -> plan -> code -> validate -> head -> (continue | refine | done), repeated.

One iteration is one attempt. After each attempt the validator (the real Go parser, and the plan)
gives its verdict and the head its label:

* **done** ends the loop — unless validation is on and the validator rejects the attempt, in which
  case the parser's word wins and the attempt is refined;
* **continue** samples more code after the attempt (an unfinished body); if the model adds nothing
  the attempt is refined instead;
* **refine** writes a new attempt from ``spec, plan, attempt, validator message``.

The answer is the latest attempt the validator accepts, else the latest that parses, else the last.
The plain baseline (``hierarchical: false``) makes one attempt; given ``max_iterations`` > 1 it
resamples until the parser accepts one (the control for what the loop's parser alone buys).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lmforge.go_syntax import go_parser, parse_body, validate
from lmforge.recipes.hrgc.sequences import SequenceFormat
from lmforge.errors import LMForgeError
from lmforge.infer.generate import check_sampling, sample_next
from lmforge.recipes.hrgc.model import HEAD_LABELS

HEAD_SAYS_WRONG = "the refinement head judged the attempt wrong"
RETRY_TEMPERATURE = 0.8  # the plain model's resamples when it decodes greedily


@dataclass
class Attempt:
    code: str
    verdict: str  # the validator's message; "" = accepted
    parses: bool
    finished: bool  # ended with </s> (not cut by the context)
    head: str = ""  # the head's label ("" for the plain model)
    head_probs: tuple[float, ...] = ()
    action: str = ""  # what the loop did next: done | refine | continue | stop


@dataclass
class Written:
    spec: str
    plan: str
    attempts: list[Attempt] = field(default_factory=list)
    stopped: str = ""  # done | iteration cap | context full | one attempt (plain model)

    @property
    def iterations(self) -> int:
        return len(self.attempts)

    @property
    def answer(self) -> Attempt:
        for accept in (lambda a: not a.verdict, lambda a: a.parses, lambda a: True):
            for a in reversed(self.attempts):
                if accept(a):
                    return a
        raise LMForgeError("no attempt was made")


class SpecDoesNotFit(LMForgeError):
    """The spec (with its plan) is too long for the model's contexts."""


def check_spec(spec: str, parser=None) -> None:
    """A spec is a Go signature (``func name(...) results`` or a method), optionally after its doc
    comment, and nothing else: checked with the real parser."""
    parser = parser or go_parser()
    example = ("e.g. --spec '// readFile reads a file.\\nfunc readFile(path string) ([]byte, error)'")
    if not spec.strip():
        raise LMForgeError(f"the spec is empty: give the function's doc comment (optional) and signature, {example}")
    tree, body, _ = parse_body(parser, spec, "{}")
    if body is not None and not tree.root_node.has_error:
        return
    whole = parser.parse(("package p\n\n" + spec).encode("utf-8")).root_node
    if any(n.type in ("function_declaration", "method_declaration") and n.child_by_field_name("body") is not None
           for n in whole.named_children):
        raise LMForgeError("the spec holds a body: give only the doc comment and the signature; the model writes "
                           "the body")
    raise LMForgeError(f"the spec has no Go signature the parser accepts: give the doc comment (optional) and the "
                       f"function's signature, {example}")


class Writer:
    """Writes Go function bodies with a trained HRGC (or plain baseline) model."""

    def __init__(self, model, tokenizer, parser=None, max_iterations: int | None = None,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None):
        check_sampling(temperature, top_k, top_p)
        self.model, self.tokenizer = model, tokenizer
        self.cfg = model.config
        self.fmt = SequenceFormat(tokenizer, self.cfg.hierarchical)
        self.parser = parser or go_parser()
        # The plain model makes one attempt unless asked for more: then it resamples (at
        # RETRY_TEMPERATURE when greedy) until the parser accepts, the control for HRGC's loop.
        self.max_iterations = max_iterations or (self.cfg.max_refinement_iterations if self.cfg.hierarchical else 1)
        if self.max_iterations < 1:
            raise LMForgeError(f"max iterations must be >= 1, got {self.max_iterations}")
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device="cpu")
        if seed is not None:
            self.generator.manual_seed(seed)

    # ---- sampling -------------------------------------------------------------------------
    @torch.no_grad()
    def _sample(self, gpt, ids: list[int], extra: torch.Tensor | None, max_new: int) -> tuple[list[int], bool]:
        """Tokens after ``ids`` until </s> (finished) or the context / ``max_new`` runs out."""
        room = min(max_new, gpt.config.n_positions - len(ids))
        if room <= 0:
            return [], False
        cache = gpt.new_kv_cache(1)
        logits = gpt.logits(torch.tensor([ids], device=self.device), kv_cache=cache, last_only=True,
                            extra_embeds=extra)
        out: list[int] = []
        while True:
            token = int(sample_next(logits[:, -1], self.temperature, self.top_k, self.top_p, self.generator))
            if token == self.fmt.eos:
                return out, True
            out.append(token)
            if len(out) >= room:
                return out, False
            logits = gpt.logits(torch.tensor([[token]], device=self.device), kv_cache=cache, last_only=True)

    def _extra(self, planner_hidden, prefix_len: int, length: int) -> torch.Tensor | None:
        if planner_hidden is None:
            return None
        return self.model.condition(planner_hidden, torch.tensor([prefix_len], device=self.device), length)

    @torch.no_grad()
    def _judge(self, prefix: list[int], planner_hidden, attempt: list[int]) -> tuple[str, tuple[float, ...]]:
        ids = self.fmt.judge_prompt(prefix, attempt)
        if len(ids) > self.model.generator.config.n_positions:
            return "", ()
        hidden = self.model.generator.hidden_states(torch.tensor([ids], device=self.device),
                                                    extra_embeds=self._extra(planner_hidden, len(prefix), len(ids)))
        probs = self.model.judge(hidden[:, -1]).softmax(-1)[0].tolist()
        return HEAD_LABELS[max(range(len(probs)), key=probs.__getitem__)], tuple(probs)

    def _attempt(self, spec: str, plan: str, ids: list[int], finished: bool) -> Attempt:
        code = self.tokenizer.decode(ids)
        syntax = validate(self.parser, spec, code)
        verdict = syntax or (validate(self.parser, spec, code, plan) if self.cfg.hierarchical else "")
        return Attempt(code=code, verdict=verdict, parses=not syntax, finished=finished)

    # ---- the loop ---------------------------------------------------------------------------
    def write(self, spec: str, max_new_tokens: int = 0,
              on_event: Callable[[str, object], None] | None = None) -> Written:
        """Run the loop on one spec; ``on_event("plan" | "attempt", value)`` reports progress.
        ``max_new_tokens`` caps each sampled plan and body (0 = as much as the context holds)."""
        spec = spec.strip()
        check_spec(spec, self.parser)
        cap = max_new_tokens or 1 << 30
        model, fmt = self.model, self.fmt
        spec_ids = fmt.encode(spec)
        planner_hidden, plan_ids, plan = None, [], ""
        if self.cfg.hierarchical:
            plan_prompt = spec_ids + fmt.marker["plan"]
            if len(plan_prompt) >= model.planner.config.n_positions:
                raise SpecDoesNotFit(f"the spec is {len(spec_ids)} tokens, too long for the planner's "
                                   f"{model.planner.config.n_positions}-token context; shorten its doc comment")
            plan_ids, _ = self._sample(model.planner, plan_prompt, None, cap)
            plan = self.tokenizer.decode(plan_ids)
            with torch.no_grad():
                planner_hidden = model.planner.hidden_states(torch.tensor([plan_prompt + plan_ids], device=self.device))
        if on_event:
            on_event("plan", plan)
        prefix = fmt.prefix(spec_ids, plan_ids)
        code_prompt = fmt.code_prompt(prefix)
        if len(code_prompt) >= model.generator.config.n_positions:
            raise SpecDoesNotFit("the spec and plan fill the generator's context; shorten the spec's doc comment")
        result = Written(spec=spec, plan=plan)
        ids, finished = self._sample(model.generator, code_prompt,
                                     self._extra(planner_hidden, len(prefix), len(code_prompt)), cap)
        while True:
            attempt = self._attempt(spec, plan, ids, finished)
            result.attempts.append(attempt)
            if not self.cfg.hierarchical:
                if attempt.parses or len(result.attempts) >= self.max_iterations:
                    attempt.action = "stop"
                    result.stopped = ("one attempt (plain model)" if self.max_iterations == 1 else
                                      "parses" if attempt.parses else "iteration cap")
                    break
                attempt.action = "resample"
                if on_event:
                    on_event("attempt", attempt)
                saved = self.temperature
                self.temperature = saved or RETRY_TEMPERATURE
                try:
                    ids, finished = self._sample(model.generator, code_prompt, None, cap)
                finally:
                    self.temperature = saved
                continue
            attempt.head, attempt.head_probs = self._judge(prefix, planner_hidden, fmt.encode(attempt.code))
            action = attempt.head or "refine"
            if action == "done" and attempt.verdict and self.cfg.enable_validation:
                action = "refine"  # the parser (and the plan) outrank the head
            if action == "done":
                attempt.action, result.stopped = "done", "done"
                break
            if len(result.attempts) >= self.max_iterations:
                attempt.action, result.stopped = "stop", "iteration cap"
                break
            if action == "continue":
                context = code_prompt + fmt.encode(attempt.code)
                more, more_finished = self._sample(model.generator, context,
                                                   self._extra(planner_hidden, len(prefix), len(context)), cap)
                if more:
                    attempt.action = "continue"
                    if on_event:
                        on_event("attempt", attempt)
                    ids, finished = fmt.encode(attempt.code) + more, more_finished
                    continue
                action = "refine"
            message = fmt.encode(attempt.verdict or HEAD_SAYS_WRONG)
            context = fmt.refine_prompt(prefix, fmt.encode(attempt.code), message)
            if len(context) >= model.generator.config.n_positions:
                attempt.action, result.stopped = "stop", "context full"
                break
            attempt.action = "refine"
            if on_event:
                on_event("attempt", attempt)
            ids, finished = self._sample(model.generator, context,
                                         self._extra(planner_hidden, len(prefix), len(context)), cap)
        if on_event:
            on_event("attempt", result.attempts[-1])
        return result


__all__ = ["Writer", "Written", "Attempt", "SpecDoesNotFit", "check_spec", "HEAD_SAYS_WRONG"]
