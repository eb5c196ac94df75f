"""HRGC's training-time probe: the model writes a few training functions, the parser scores them, and
its failed attempts become refinement examples."""

from __future__ import annotations

import random

from lmforge.errors import LMForgeError
from lmforge.go_syntax import ast_similarity, validate
from lmforge.recipes.hrgc.writer import Writer


class WritingProbe:
    """``validation_frequency``: write a few training functions' bodies (plan, then one attempt,
    greedy), parse them, and log the shares that parse, match the real body and plan, and the AST
    similarity. Failed
    attempts join the training loader's pool of the model's own failures (refine, or continue when
    the context cut them), so refinement also learns from the model's own mistakes."""

    def __init__(self, loader, tokenizer, parser, samples: int, seed: int, rank: int = 0):
        self.loader, self.tokenizer, self.parser, self.samples = loader, tokenizer, parser, samples
        # Every process writes its own sample and keeps its own failures (rank 0 as on one process).
        self.seed = seed if rank == 0 else f"{seed}-{rank}"

    def __call__(self, model, step: int) -> dict[str, float]:
        data = self.loader.data
        rng = random.Random(f"{self.seed}-probe-{step}")
        writer = Writer(model, self.tokenizer, self.parser, max_iterations=1)
        parsed = plan_exact = code_exact = similarity = 0.0
        picks = rng.sample(range(len(data)), min(self.samples, len(data)))
        for i in picks:
            fn = data.functions[i]
            # Room for twice the real body: enough for a right answer, bounded for a rambling one.
            try:
                written = writer.write(fn.spec, max_new_tokens=2 * len(data.code(i)) + 16)
            except LMForgeError:  # a spec the model cannot take (too long with its plan): a failure
                continue
            attempt = written.attempts[0]
            parsed += attempt.parses
            plan_exact += written.plan == fn.plan
            code_exact += attempt.code.strip() == fn.code.strip()
            similarity += ast_similarity(self.parser, fn.spec, attempt.code, fn.code)
            message = validate(self.parser, fn.spec, attempt.code, fn.plan) if model.config.hierarchical else ""
            if message or (not model.config.hierarchical and not attempt.parses):
                label = "refine" if attempt.finished else "continue"
                self.loader.add_failure(i, attempt.code, message or attempt.verdict, label)
        n = len(picks)
        out = {"probe/parse_rate": parsed / n, "probe/code_exact": code_exact / n, "probe/ast_similarity": similarity / n}
        if model.config.hierarchical:
            out["probe/plan_exact"] = plan_exact / n
        return out
