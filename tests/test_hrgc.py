"""HRGC (seed 000): the model, its training sequences, training through the shared loop, the
plan -> code -> validate -> head -> refine loop, and its metrics."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from lmforge.cli import main
from lmforge.config import load_config
from lmforge.go_syntax import ast_similarity, go_parser
from lmforge.recipes.hrgc.functions import extract_go_functions, read_go_functions
from lmforge.recipes.hrgc.sequences import (EncodedFunctions, HRGCEvalLoader, HRGCTrainLoader, SequenceFormat,
                                    bucketed_batches)
from lmforge.errors import LMForgeError
from lmforge.recipes.hrgc.evaluate import GoBuildCheck, evaluate_hrgc, token_accuracy
from lmforge.recipes.hrgc.writer import Writer, check_spec
from lmforge.models import build_model, load_model
from lmforge.recipes.hrgc.model import HEAD_LABELS, HRGC, HRGCConfig, ModuleConfig
from lmforge.models.losses import IGNORE_INDEX
from lmforge.tokenizer import Tokenizer, train_tokenizer
from lmforge.safe_state import load_state
from tests.train_helpers import PEAK_FLOPS, torchrun

# Small Go packages of our own: each function is written from a template with its own names, so the
# corpus has enough functions to batch, several statement kinds, and packages to split by.
TEMPLATES = [
    '''// {Name}Sum adds up the values of xs.
func {Name}Sum(xs []int) int {{
	total := 0
	for _, x := range xs {{
		total += x
	}}
	return total
}}
''',
    '''// {Name}Find returns the index of want in xs, or -1.
func {Name}Find(xs []string, want string) int {{
	for i, x := range xs {{
		if x == want {{
			return i
		}}
	}}
	return -1
}}
''',
    '''// {Name}Clamp keeps v inside [lo, hi].
func {Name}Clamp(v, lo, hi int) int {{
	if v < lo {{
		return lo
	}}
	if v > hi {{
		return hi
	}}
	return v
}}
''',
    '''// {Name}Keys returns the keys of m.
func {Name}Keys(m map[string]int) []string {{
	keys := make([]string, 0, len(m))
	for k := range m {{
		keys = append(keys, k)
	}}
	return keys
}}
''',
    '''// {Name}Max returns the largest of a and b.
func {Name}Max(a, b int) int {{
	if a > b {{
		return a
	}}
	return b
}}
''',
]
PACKAGES = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]


def write_module(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "go.mod").write_text("module example.com/fx\n\ngo 1.19\n")
    for p, package in enumerate(PACKAGES):
        (root / package).mkdir()
        for f in range(2):
            names = [f"{package.capitalize()}{f}{t}" for t in range(len(TEMPLATES))]
            body = "\n".join(t.format(Name=n) for t, n in zip(TEMPLATES, names))
            (root / package / f"f{f}.go").write_text(f"package {package}\n\n{body}")
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("hrgc")
    src = write_module(base / "src")
    data = base / "data"
    extract_go_functions(src, data, val_fraction=0.15, test_fraction=0.15, show_progress=False)
    functions = list(read_go_functions(data / "train.jsonl"))
    train_tokenizer((f"{f.spec}\n{f.plan}\n{f.code}" for f in functions), 400, base / "tok", show_progress=False)
    return {"src": src, "data": data, "tokenizer": base / "tok" / "tokenizer.json", "base": base}


def tiny_config(**extra) -> HRGCConfig:
    values = dict(vocab_size=400, planner_config=ModuleConfig(n_positions=128, n_embd=32, n_layer=1, n_head=2, dropout=0.0),
                  generator_config=ModuleConfig(n_positions=384, n_embd=48, n_layer=1, n_head=2, dropout=0.0))
    values.update(extra)
    return HRGCConfig(**values)


def loader_for(corpus, hierarchical=True, warmup=0, batch=4, split="train"):
    tok = Tokenizer.load(corpus["tokenizer"])
    fmt = SequenceFormat(tok, hierarchical)
    data = EncodedFunctions(list(read_go_functions(corpus["data"] / f"{split}.jsonl")), fmt, 128, 384)
    return HRGCTrainLoader(data, go_parser(), batch, 0, 0, 1, warmup, 0.25), tok


def train_cli(corpus, out: Path, *overrides: str, resume: bool = False) -> Path:
    assert main(hrgc_args(corpus, out, *overrides) + (["--resume"] if resume else [])) == 0
    return out / "r"


def hrgc_args(corpus, out: Path, *overrides: str) -> list[str]:
    return ["train", "hrgc_go_tiny", f"data.path={corpus['data']}", f"data.tokenizer={corpus['tokenizer']}",
            f"out_dir={out}", "name=r", "training.max_steps=6", "training.micro_batch_size=4",
            "training.eval_interval=3", "training.eval_batches=2", "training.log_interval=1",
            "training.precision=fp32", "logging.progress_bar=false", "logging.tensorboard=false",
            f"training.peak_flops={PEAK_FLOPS}",
            "model.planner_config.n_embd=32", "model.planner_config.n_layer=1", "model.planner_config.n_head=2",
            "model.planner_config.n_positions=128", "model.generator_config.n_embd=48",
            "model.generator_config.n_layer=1", "model.generator_config.n_head=2",
            "model.generator_config.n_positions=384", "model.vocab_size=0", *overrides]


# ---- sequences and batches -------------------------------------------------------------------------
def test_sequences_put_the_loss_on_plan_code_and_target_only(corpus):
    tok = Tokenizer.load(corpus["tokenizer"])
    fmt = SequenceFormat(tok)
    spec, plan, code = tok.encode("func f() int"), tok.encode("return 1"), tok.encode("{\n\treturn 1\n}")
    row = fmt.planner_row(spec, plan)
    targets = [t for t in row.labels.tolist() if t != IGNORE_INDEX]
    assert targets == plan + [tok.eos_id] and row.ids == spec + fmt.marker["plan"] + plan
    prefix = fmt.prefix(spec, plan)
    row = fmt.code_row(prefix, code)
    assert [t for t in row.labels.tolist() if t != IGNORE_INDEX] == code + [tok.eos_id]
    assert row.ids[:len(prefix)] == prefix  # the planner's positions are the generator's too
    attempt, message = tok.encode("{\n\treturn\n"), tok.encode("syntax error")
    row, judge = fmt.refine_row(prefix, attempt, message, code)
    assert [t for t in row.labels.tolist() if t != IGNORE_INDEX] == code + [tok.eos_id]
    assert row.ids[judge] == fmt.marker["judge"][-1] and row.ids[:judge + 1] == fmt.judge_prompt(prefix, attempt)
    head_only, judge_only = fmt.refine_row(prefix, code, None, None)
    assert (head_only.labels == IGNORE_INDEX).all() and judge_only == judge - len(attempt) + len(code)
    plain = SequenceFormat(tok, hierarchical=False)
    assert plain.prefix(spec, plan) == spec  # the baseline never sees a plan


def test_bucketed_batches_cover_every_function_once_and_split_ranks():
    lengths = torch.randint(5, 500, (103,)).numpy()
    batches = bucketed_batches(lengths, 8, seed=3, epoch=0)
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(103))
    assert bucketed_batches(lengths, 8, seed=3, epoch=0) == batches  # reproducible
    assert bucketed_batches(lengths, 8, seed=3, epoch=1) != batches  # a new order each epoch
    ranks = [bucketed_batches(lengths, 8, 3, 0, rank, 2) for rank in (0, 1)]
    assert not {i for b in ranks[0] for i in b} & {i for b in ranks[1] for i in b}
    # Length bucketing: far less padding than batching in random order.
    padded = sum(len(b) * lengths[b].max() for b in batches)
    random_order = torch.randperm(103).tolist()
    unsorted = sum(len(random_order[i:i + 8]) * lengths[random_order[i:i + 8]].max() for i in range(0, 103, 8))
    assert padded < 0.8 * unsorted


def test_refinement_rows_join_after_the_warmup_and_carry_right_labels(corpus):
    loader, tok = loader_for(corpus, warmup=2)
    first = []
    for step in (0, 1):
        loader.set_step(step)
        first.append(loader.next_batch())
    assert all("refine_ids" not in b for b in first)
    loader.set_step(2)
    batch = loader.next_batch()
    assert {"refine_ids", "refine_labels", "judge_pos", "head_labels"} <= set(batch)
    fmt = loader.fmt
    labels = batch["head_labels"].tolist()
    assert all(0 <= label < len(HEAD_LABELS) for label in labels)
    for row, (label, pos) in enumerate(zip(labels, batch["judge_pos"].tolist())):
        ids = batch["refine_ids"][row].tolist()
        assert ids[pos] == fmt.marker["judge"][-1]
        has_target = (batch["refine_labels"][row] != IGNORE_INDEX).any().item()
        assert has_target == (HEAD_LABELS[label] != "done")  # done rows have no corrected copy to learn
    state = loader.state_dict()
    again, _ = loader_for(corpus, warmup=2)
    again.load_state_dict(json.loads(json.dumps(state)))  # it survives the JSON of trainer_state.json
    again.set_step(3)  # as the loop does on resume
    loader.set_step(3)
    a, b = loader.next_batch(), again.next_batch()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_own_failures_join_as_extra_refine_rows(corpus):
    loader, tok = loader_for(corpus, warmup=0)
    loader.own_failure_share = 1.0
    loader.add_failure(0, "{\n\treturn\n", "syntax error: line 2 of the function: missing }", "refine")
    batch = loader.next_batch()
    rows = batch["code_ids"].shape[0]
    assert rows == 8 and batch["head_labels"].shape == (8,)  # 4 functions + 4 failure rows
    assert batch["head_labels"][4:].tolist() == [HEAD_LABELS.index("refine")] * 4
    # The failure rows only condition their refinement row: no plan or code loss on them ...
    assert (batch["plan_labels"][4:] == IGNORE_INDEX).all() and (batch["code_labels"][4:] == IGNORE_INDEX).all()
    assert (batch["code_labels"][:4] != IGNORE_INDEX).any(dim=1).all()  # ... and the sampled functions keep theirs
    prefix = loader.data.prefix(0)  # the failure's own function, in all three rows
    assert batch["plan_ids"][4, :len(prefix)].tolist() == prefix and batch["prefix_len"][4] == len(prefix)
    row = batch["refine_ids"][4].tolist()
    attempt = tok.encode("{\n\treturn\n")
    assert row[:len(prefix)] == prefix and row[len(prefix) + len(loader.fmt.marker["attempt"]):][:len(attempt)] == attempt
    target = [t for t in batch["refine_labels"][4].tolist() if t != IGNORE_INDEX]
    assert target == loader.data.code(0) + [tok.eos_id]
    for r, i in enumerate(loader._batches[0]):  # every row's prefix_len is its own prefix
        assert batch["prefix_len"][r] == len(loader.data.prefix(i))
    # A failure longer than the batch's rows would pad all of them: it waits for a batch of its size.
    loader.failures.clear()
    loader.add_failure(0, "{\n" + "\tx := 1\n" * 200, "does not follow the plan", "refine")
    assert loader.next_batch()["code_ids"].shape[0] == 4


def test_warmup_counts_the_optimizer_steps_the_loop_gives(corpus):
    tok = Tokenizer.load(corpus["tokenizer"])
    data = EncodedFunctions(list(read_go_functions(corpus["data"] / "train.jsonl")), SequenceFormat(tok), 128, 384)
    loader = HRGCTrainLoader(data, go_parser(), 2, 0, 0, 1, refinement_warmup=2, own_failure_share=0.0)
    has_refine = []
    for step in (0, 0, 1, 1, 2, 2):  # the loop says which optimizer step the micro-batches are for
        loader.set_step(step)
        has_refine.append("refine_ids" in loader.next_batch())
    assert has_refine == [False, False, False, False, True, True]


# ---- the model ----------------------------------------------------------------------------------
def test_loss_is_the_weighted_sum_and_weights_steer_the_gradients(corpus):
    loader, _ = loader_for(corpus, warmup=0)
    batch = loader.next_batch()
    torch.manual_seed(0)
    model = HRGC(tiny_config())
    model.loss_weights = {"plan": 0.3, "code": 0.5, "refinement": 0.2}
    loss, m = model(batch)
    expected = 0.3 * m["plan_loss"] + 0.5 * m["code_loss"] + 0.2 * (m["head_loss"] + m["refine_loss"])
    assert torch.allclose(loss, expected, atol=1e-5)
    model.loss_weights["plan"] = 0.0  # the bridge starts at zero: no gradient reaches the planner
    model(batch)[0].backward()
    assert all(p.grad is None or p.grad.abs().max() == 0 for p in model.planner.parameters())
    model.zero_grad()
    model.loss_weights.update(plan=0.4, refinement=0.0)
    model(batch)[0].backward()
    assert model.head.weight.grad is None or model.head.weight.grad.abs().max() == 0
    assert model.planner.tok_embed.weight.grad.abs().max() > 0


def test_generator_is_conditioned_on_the_planner_states(corpus):
    loader, _ = loader_for(corpus)
    batch = loader.next_batch()
    torch.manual_seed(0)
    model = HRGC(tiny_config()).eval()
    code_loss = lambda: model(batch)[1]["code_loss"].item()  # noqa: E731
    before = code_loss()
    with torch.no_grad():
        model.planner.blocks[0].mlp.fc.weight.mul_(3.0)
    assert code_loss() == pytest.approx(before)  # a zero bridge: the planner does not reach the generator
    with torch.no_grad():
        model.bridge.weight.normal_(0, 0.5)
    bridged = code_loss()
    with torch.no_grad():
        model.planner.blocks[0].mlp.fc.weight.mul_(3.0)
    assert bridged != pytest.approx(before) and code_loss() != pytest.approx(bridged)
    # Only the spec <plan> plan positions are conditioned.
    hidden = torch.randn(2, 7, 32)
    extra = model.condition(hidden, torch.tensor([3, 7]), 10)
    assert extra.shape == (2, 10, 48) and extra[0, 3:].abs().max() == 0 and extra[1, :7].abs().max() > 0


def test_inference_builds_what_training_scored(corpus):
    """The writer's conditioning, code logits and head read the same layouts the training rows hold:
    teacher-forcing the reference plan and body through the writer's pieces gives the batch's losses."""
    loader, tok = loader_for(corpus, warmup=0, batch=1)
    batch = loader.next_batch()
    i = loader._batches[0][0]
    torch.manual_seed(0)
    model = HRGC(tiny_config()).eval()
    with torch.no_grad():
        model.bridge.weight.normal_(0, 0.5)  # make the conditioning matter
        _, m = model(batch)
        writer = Writer(model, tok, max_iterations=1)
        d, fmt = loader.data, loader.fmt
        prefix = d.prefix(i)
        planner_hidden = model.planner.hidden_states(torch.tensor([prefix]))
        ids = fmt.code_prompt(prefix) + d.code(i) + [fmt.eos]
        logits = model.generator.logits(torch.tensor([ids[:-1]]), extra_embeds=writer._extra(planner_hidden, len(prefix),
                                                                                               len(ids) - 1))
        start = len(fmt.code_prompt(prefix)) - 1
        loss = torch.nn.functional.cross_entropy(logits[0, start:], torch.tensor(ids[start + 1:]))
        assert loss.item() == pytest.approx(m["code_loss"].item(), rel=1e-4)
        label = batch["head_labels"][0].item()
        judge_len = batch["judge_pos"][0].item() + 1
        attempt = batch["refine_ids"][0, len(prefix) + len(fmt.marker["attempt"]):judge_len - len(fmt.marker["judge"])]
        _, probs = writer._judge(prefix, planner_hidden, attempt.tolist())
        assert probs[label] == pytest.approx(torch.exp(-m["head_loss"]).item(), rel=1e-4)


def test_module_learning_rates_and_loss_weights_reach_the_optimizer(corpus, tmp_path):
    # model.* is lmforge 0.1's spelling of these training settings (recipe.* now): both work
    run = train_cli(corpus, tmp_path, "model.planner_lr=0.0036", "recipe.generator_lr=0.0024",
                    "model.refinement_lr=0.003", "training.lr=0.001", "recipe.refinement_warmup=3",
                    "training.grad_accum_steps=2",  # the warmup counts optimizer steps, not micro-batches
                    "model.plan_loss_weight=0.5", "recipe.validation_frequency=0")
    state = load_state(run / "checkpoints" / "step-000006" / "optimizer.safetensors", "optimizer")
    groups = {g["name"]: g for g in state["optimizer"]["param_groups"]}
    assert set(groups) == {f"{m}/{d}" for m in ("planner", "generator", "refinement") for d in ("decay", "no_decay")}
    for module, lr in (("planner", 0.0036), ("generator", 0.0024), ("refinement", 0.003)):
        assert groups[f"{module}/decay"]["base_lr"] == pytest.approx(lr)
        assert groups[f"{module}/no_decay"]["weight_decay"] == 0.0
    model = load_model(run / "checkpoints" / "best")
    assert isinstance(model, HRGC) and "plan_loss_weight" not in (run / "checkpoints" / "best" / "config.yaml").read_text()
    run_config = (run / "config.yaml").read_text()
    assert "plan_loss_weight: 0.5" in run_config and "recipe:" in run_config  # a training setting of the run
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/head_loss" in r]
    assert trained and min(r["step"] for r in trained) == 4  # refinement joins after 3 steps
    assert any("eval/head_accuracy" in r for r in rows)


def test_save_and_load_round_trip_with_tied_heads(tmp_path):
    torch.manual_seed(0)
    model = HRGC(tiny_config())
    model.save_pretrained(tmp_path / "m")
    again = load_model(tmp_path / "m")
    for (k, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k
    assert again.generator.lm_head.weight is again.generator.tok_embed.weight
    plain = HRGC(tiny_config(hierarchical=False))
    assert plain.planner is None and plain.head is None
    assert plain.num_parameters() < model.num_parameters()


def test_config_errors_name_the_key():
    with pytest.raises(LMForgeError, match="generator_config.n_embd"):
        load_config("hrgc_go_tiny", ["model.generator_config.n_embd=50"])
    with pytest.raises(LMForgeError, match="planner_config.vocab_size"):
        load_config("hrgc_go_tiny", ["model.planner_config.vocab_size=10"])
    with pytest.raises(LMForgeError, match="unknown config key 'model.planner_config.n_layers'"):
        load_config("hrgc_go_tiny", ["model.planner_config.n_layers=2"])
    with pytest.raises(LMForgeError, match="model.lm_loss must be one of auto, chunked, logits"):
        load_config("hrgc_go_tiny", ["model.lm_loss=fused"])
    chunked = load_config("hrgc_go_tiny", ["model.lm_loss=chunked", "model.vocab_size=64"]).model
    assert {m.config.lm_loss for m in (HRGC(chunked).planner, HRGC(chunked).generator)} == {"chunked"}
    cfg = load_config("hrgc_go")
    assert (cfg.model.planner_config.n_positions, cfg.model.generator_config.n_positions) == (512, 1024)
    assert 20e6 < build_model(cfg.model).num_parameters() < 35e6  # the seed's ~20-30M (+ embeddings)


# ---- inference ----------------------------------------------------------------------------------
def biased(label: str, **config) -> HRGC:
    """An untrained model whose head always says ``label``."""
    torch.manual_seed(0)
    model = HRGC(tiny_config(**config)).eval()
    with torch.no_grad():
        model.head.weight.zero_()
        model.head.bias.copy_(torch.tensor([10.0 if n == label else 0.0 for n in HEAD_LABELS]))
    return model


SPEC = "// Max returns the larger of a and b.\nfunc Max(a, b int) int"


def test_loop_stops_at_done(corpus):
    tok = Tokenizer.load(corpus["tokenizer"])
    written = Writer(biased("done", enable_validation=False), tok, max_iterations=4).write(SPEC, max_new_tokens=12)
    assert written.iterations == 1 and written.stopped == "done"
    assert written.attempts[0].head == "done" and written.attempts[0].action == "done"


def test_parser_vetoes_done_and_the_cap_stops_the_loop(corpus):
    tok = Tokenizer.load(corpus["tokenizer"])
    # An untrained model writes code that does not parse: "done" is overruled and refined, up to the cap.
    written = Writer(biased("done"), tok, max_iterations=3).write(SPEC, max_new_tokens=12)
    assert written.iterations == 3 and written.stopped == "iteration cap"
    assert all(a.verdict for a in written.attempts)
    assert [a.action for a in written.attempts] == ["refine", "refine", "stop"]
    written = Writer(biased("refine", enable_validation=False), tok, max_iterations=2).write(SPEC, max_new_tokens=12)
    assert written.iterations == 2 and written.stopped == "iteration cap"


def test_continue_extends_the_attempt(corpus):
    tok = Tokenizer.load(corpus["tokenizer"])
    writer = Writer(biased("continue"), tok, max_iterations=3)
    writer._sample_real = writer._sample
    calls = []

    def sample(gpt, ids, extra, max_new):  # the first attempt is cut short, as a full context would
        calls.append(ids)  # calls: the plan, the first attempt, the continuation
        out, finished = writer._sample_real(gpt, ids, extra, max_new)
        return (out[:3], False) if len(calls) == 2 else (out or [tok.encode("x")[0]], finished)

    writer._sample = sample
    written = writer.write(SPEC, max_new_tokens=8)
    first, second = written.attempts[:2]
    assert first.head == "continue" and first.action == "continue"
    assert second.code.startswith(first.code) and len(second.code) > len(first.code)
    # the continuation was sampled right after the attempt, in the code context (not a refine prompt)
    assert calls[2] == calls[1] + tok.encode(first.code)


def test_refinement_is_conditioned_on_the_validator_message(corpus):
    tok = Tokenizer.load(corpus["tokenizer"])
    writer = Writer(biased("refine"), tok, max_iterations=2)
    contexts = []
    real = writer._sample
    writer._sample = lambda gpt, ids, extra, max_new: contexts.append(ids) or real(gpt, ids, extra, max_new)
    written = writer.write(SPEC, max_new_tokens=6)
    verdict = written.attempts[0].verdict
    assert verdict.startswith("syntax error") and written.attempts[0].action == "refine"
    refine_context = contexts[2]  # plan, first attempt, then the refinement
    message = tok.encode(verdict)
    assert any(refine_context[k:k + len(message)] == message for k in range(len(refine_context)))
    assert refine_context[-len(writer.fmt.marker["code"]):] == writer.fmt.marker["code"]


def test_the_answer_prefers_an_accepted_attempt():
    from lmforge.recipes.hrgc.writer import Attempt, Written

    w = Written(spec=SPEC, plan="return a", attempts=[Attempt("{", "syntax error", False, True),
                                                      Attempt("{ return a }", "", True, True),
                                                      Attempt("{ retur", "syntax error", False, False)])
    assert w.answer.code == "{ return a }"
    w.attempts[1].verdict = "does not follow the plan"
    assert w.answer.code == "{ return a }"  # parses beats does not parse
    w.attempts[1].parses = False
    assert w.answer.code == "{ retur"  # nothing parses: the last attempt


def test_plain_model_makes_one_attempt(corpus):
    tok = Tokenizer.load(corpus["tokenizer"])
    torch.manual_seed(0)
    written = Writer(HRGC(tiny_config(hierarchical=False)).eval(), tok).write(SPEC, max_new_tokens=8)
    assert written.iterations == 1 and written.plan == "" and written.stopped.startswith("one attempt")


def test_specs_without_a_signature_are_refused():
    for good in ("// doc\nfunc f(x int) (int, error)", "func f(v interface{}) chan struct{}",
                 "/* Keys lists m. */\nfunc (m *M) Keys() map[string]struct{}", "func Map[T, U any](xs []T) []U"):
        check_spec(good)  # braces of types and block comments are part of real signatures
    for bad, words in (("// just a comment", "no Go signature"), ("", "empty"),
                       ("type T struct{}", "no Go signature"), ("func f() { return }", "holds a body")):
        with pytest.raises(LMForgeError, match=words):
            check_spec(bad)


def test_validator_refuses_code_after_the_body():
    from lmforge.go_syntax import validate

    parser = go_parser()
    assert validate(parser, "func f() int", "{\n\treturn 1\n}\n", "return 1") == ""
    message = validate(parser, "func f() int", "{\n\treturn 1\n}\n\nfunc g() {}\nvar x = 3", "return 1")
    assert message.startswith("syntax error: text after the function's closing brace")


# ---- metrics and the CLI --------------------------------------------------------------------------
def test_ast_similarity_and_token_accuracy():
    parser = go_parser()
    spec = "func f(xs []int) int"
    a = "{\n\tn := 0\n\tfor _, x := range xs {\n\t\tn += x\n\t}\n\treturn n\n}"
    renamed = re.sub(r"\bn\b", "total", a)
    assert ast_similarity(parser, spec, renamed, a) == 1.0  # same shape, other names
    other = "{\n\treturn len(xs)\n}"
    assert 0 < ast_similarity(parser, spec, other, a) < 0.7
    assert token_accuracy([1, 2, 3], [1, 2, 3]) == 1.0 and token_accuracy([1, 9], [1, 2, 3]) == pytest.approx(1 / 3)


def test_go_build_check(corpus, tmp_path):
    if not shutil.which("go"):  # without Go the check is off: eval reports no compile_rate (tested below)
        assert GoBuildCheck.__init__ is not None
        return
    from lmforge.recipes.hrgc.functions import GoFunction

    fn = next(f for f in read_go_functions(corpus["data"] / "train.jsonl") if f.name.endswith("Max"))
    check = GoBuildCheck(corpus["src"], shutil.which("go"))
    try:
        source = (corpus["src"] / fn.file).read_text()
        assert check.check(fn, fn.code) is True
        assert check.check(fn, "{\n\treturn undefinedName\n}") is False
        assert check.check(fn, "{", parses=False) is False
        assert (corpus["src"] / fn.file).read_text() == source  # the tree is never touched
    finally:
        check.close()
    # A main package builds to the null device (no binary in the tree); a file this platform does not
    # build (a build tag) cannot be checked: any body would "compile" there.
    mod = tmp_path / "mod"
    (mod / "tool").mkdir(parents=True)
    (mod / "go.mod").write_text("module example.com/m\n\ngo 1.19\n")
    (mod / "tool" / "main.go").write_text("package main\n\nfunc main() {\n\tprintln(double(2))\n}\n\n"
                                          "func double(x int) int {\n\treturn 2 * x\n}\n")
    (mod / "tool" / "other.go").write_text("//go:build ignore\n\npackage main\n\nfunc skipped() int {\n\treturn 1\n}\n")
    before = sorted(p.name for p in mod.rglob("*"))
    check = GoBuildCheck(mod, shutil.which("go"))
    try:
        double = GoFunction("tool", "tool/main.go", "double", "func double(x int) int", "return", "{\n\treturn 2 * x\n}")
        assert check.check(double, double.code) is True and check.check(double, "{\n\treturn y\n}") is False
        skipped = GoFunction("tool", "tool/other.go", "skipped", "func skipped() int", "return", "{\n\treturn 1\n}")
        assert check.check(skipped, "{\n\treturn undefinedName\n}") is None
    finally:
        check.close()
    assert sorted(p.name for p in mod.rglob("*")) == before


def test_head_accuracy_counts_the_labelled_states(corpus):
    from lmforge.recipes.hrgc.evaluate import head_accuracy

    tok = Tokenizer.load(corpus["tokenizer"])
    functions = list(read_go_functions(corpus["data"] / "val.jsonl"))
    data = EncodedFunctions(functions, SequenceFormat(tok), 128, 384)
    labels = [b["head_labels"] for b in HRGCEvalLoader(data, go_parser(), 16, 0, 0, 1).iter_eval_batches()]
    labels = torch.cat(labels)
    for name in HEAD_LABELS:  # a head that always says `name` is right on exactly the states labelled so
        accuracy, n = head_accuracy(biased(name), tok, go_parser(), functions)
        assert n == int((labels >= 0).sum())
        assert accuracy == pytest.approx(float((labels == HEAD_LABELS.index(name)).sum()) / n)


def test_generate_and_eval_through_the_cli(corpus, tmp_path, capsys):
    run = train_cli(corpus, tmp_path, "recipe.refinement_warmup=2", "recipe.validation_frequency=3",
                    "recipe.validation_samples=2", "model.max_refinement_iterations=2")
    out = capsys.readouterr().out
    assert "probe/parse_rate" in out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "probe/parse_rate" in r] == [3, 6]
    state = json.loads((run / "checkpoints" / "step-000006" / "trainer_state.json").read_text())
    failures = state["data"]["failures"]  # an untrained model fails: its attempts are kept for refinement
    assert failures and all(f["label"] in ("refine", "continue") and f["message"] for f in failures)

    assert main(["generate", str(run), "--spec", "// Max returns the larger.\\nfunc Max(a, b int) int",
                 "--max-new-tokens", "10", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert "plan:" in out and "--- attempt 1 ---" in out and "validator:" in out and "head:" in out
    assert "iterations used:" in out and "func Max(a, b int) int" in out

    assert main(["generate", str(run), "--spec", "// no signature here"]) == 2
    assert "no Go signature" in capsys.readouterr().err
    assert main(["generate", str(run)]) == 2
    assert "--spec" in capsys.readouterr().err

    assert main(["eval", str(run), "--data", str(corpus["data"]), "--split", "test", "--limit", "3", "--json"]) == 0
    m = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("parse_rate", "first_attempt_parse_rate", "code_exact", "ast_similarity", "plan_exact",
                "plan_token_accuracy", "plan_follow_rate", "head_accuracy"):
        assert 0.0 <= m[key] <= 1.0, key
    assert m["avg_iterations"] == 2.0 and m["functions"] == 3  # an untrained model's code never passes: the cap
    assert ("compile_rate" in m) == bool(shutil.which("go"))
    assert m.get("compile_rate", 0.0) <= m["parse_rate"] and m["first_attempt_parse_rate"] <= m["parse_rate"]
    assert main(["eval", str(run), "--data", str(tmp_path / "nowhere")]) == 2
    assert main(["eval", str(run), "--data", str(corpus["data"]), "--batch-size", "4"]) == 2  # lm and puzzles only


def test_plain_baseline_trains_and_evaluates(corpus, tmp_path, capsys):
    run = train_cli(corpus, tmp_path, "model.hierarchical=false", "recipe.validation_frequency=3",
                    "recipe.validation_samples=2")
    m = evaluate_hrgc(run, corpus["data"], split="test", limit=2, progress=False)
    assert m["hierarchical"] is False and m["avg_iterations"] == 1.0 and "plan_exact" not in m
    assert "head_accuracy" not in m


def test_bad_data_gets_a_clear_error(corpus, tmp_path):
    from lmforge.train import train

    cfg = load_config("hrgc_go_tiny", [f"data.path={tmp_path / 'missing'}", f"out_dir={tmp_path}"])
    with pytest.raises(LMForgeError, match="go-functions"):
        train(cfg)
    cfg = load_config("hrgc_go_tiny", [f"data.path={corpus['data']}", f"data.tokenizer={corpus['tokenizer']}",
                                       "model.vocab_size=300", f"out_dir={tmp_path}"])
    with pytest.raises(LMForgeError, match="model.vocab_size=300"):
        train(cfg)
    from lmforge.bench import run_bench  # random token windows mean nothing to HRGC: refused, not crashed

    with pytest.raises(LMForgeError, match="kind 'hrgc', which cannot"):
        run_bench("hrgc_go_tiny", [], steps=1, show=False)


def test_eval_loader_is_fixed_and_labels_every_state(corpus):
    tok = Tokenizer.load(corpus["tokenizer"])
    fmt = SequenceFormat(tok)
    data = EncodedFunctions(list(read_go_functions(corpus["data"] / "val.jsonl")), fmt, 128, 384)
    loader = HRGCEvalLoader(data, go_parser(), 4, 0, 0, 1)
    a = list(loader.iter_eval_batches())
    b = list(loader.iter_eval_batches())
    assert len(a) >= 1 and all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)
    assert all((batch["head_labels"] >= 0).all() for batch in a)


def test_an_interrupted_run_resumes(corpus, tmp_path):
    run = train_cli(corpus, tmp_path, "training.max_steps=3", "training.save_interval=3", "recipe.refinement_warmup=2",
                    "recipe.validation_frequency=2", "recipe.validation_samples=2")
    train_cli(corpus, tmp_path, "training.max_steps=5", "training.save_interval=3", "recipe.refinement_warmup=2",
              "recipe.validation_frequency=2", "recipe.validation_samples=2", resume=True)
    state = json.loads((run / "checkpoints" / "step-000005" / "trainer_state.json").read_text())
    assert state["step"] == 5 and state["data"]["drawn"] == 5


def test_overrides_may_follow_options(capsys):
    # `lmforge bench RECIPE --steps 1 key=value` (an H100 session tripped on this order)
    assert main(["bench", "go_coder_tiny", "--steps", "1", "--warmup", "0", "--vocab-size", "300",
                 "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "training.micro_batch_size=1",
                 "data.seq_len=16", "training.precision=fp32"]) == 0
    assert "1 timed steps" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "go_coder_tiny", "--no-such-option"])


def test_plain_model_resamples_until_it_parses_when_asked(corpus):
    tok = Tokenizer.load(corpus["tokenizer"])
    torch.manual_seed(0)
    writer = Writer(HRGC(tiny_config(hierarchical=False)).eval(), tok, max_iterations=3, seed=0)
    written = writer.write(SPEC, max_new_tokens=8)  # an untrained model: nothing parses, so 3 samples
    assert written.iterations == 3 and written.stopped == "iteration cap"
    assert [a.action for a in written.attempts] == ["resample", "resample", "stop"]
    assert len({a.code for a in written.attempts}) > 1  # resamples are sampled, not greedy copies


def test_two_processes_run_the_probe_on_every_rank(corpus, tmp_path):
    """Under torchrun each process writes its own sample of functions and keeps its own failures; the
    logged probe metrics are the mean over both (the probe ran on rank 0 alone before, and fed rank 0's
    loader only)."""
    args = hrgc_args(corpus, tmp_path, "training.max_steps=4", "training.device=cpu", "training.log_interval=2",
                     "training.eval_interval=4", "recipe.refinement_warmup=2", "recipe.validation_frequency=2",
                     "recipe.validation_samples=1")
    two = torchrun(args, tmp_path / "r")
    assert two.returncode == 0, two.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    probes = [r for r in rows if "probe/parse_rate" in r]
    assert [r["step"] for r in probes] == [2, 4]
    assert all(r["probe/parse_rate"] in (0.0, 0.5, 1.0) for r in probes)  # one function per rank, averaged
    tokens = [r["train/tokens"] for r in rows if "train/tokens" in r]
    assert tokens == sorted(tokens) and tokens[0] > 0
    # each process's loader (its own failures) is in the checkpoint, for an exact resume on 2 processes
    state = json.loads((tmp_path / "r" / "checkpoints" / "step-000004" / "trainer_state.json").read_text())
    assert len(state["data_per_rank"]) == 2 and state["data"] == state["data_per_rank"][0]
    assert all("failures" in s for s in state["data_per_rank"])


def test_8bit_moments_keep_the_module_learning_rates(corpus, tmp_path):
    """training.optimizer_states=8bit (seed 000's optim="adamw_8bit") is HRGC's AdamW with its per-module groups."""
    run = train_cli(corpus, tmp_path, "training.optim=adamw_8bit", "model.planner_lr=0.0036",
                    "recipe.validation_frequency=0")
    state = load_state(run / "checkpoints" / "step-000006" / "optimizer.safetensors", "optimizer")
    groups = {g["name"]: g for g in state["optimizer"]["param_groups"]}
    assert groups["planner/decay"]["base_lr"] == pytest.approx(0.0036)
    codes = [entry["exp_avg"] for entry in state["optimizer"]["state"].values() if "exp_avg_scale" in entry]
    assert codes and all(c.dtype == torch.uint8 for c in codes)
