"""The sft kind: what is rendered and learned, packing without cross-attention, the loader, a real run."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lmforge.errors import LMForgeError
from lmforge.models.gpt import GPT, GPTConfig
from lmforge.models.losses import IGNORE_INDEX
from lmforge.posttrain.packing import ExampleStore, PackedConversations, pack_rows
from lmforge.posttrain.render import (NOTHING_TO_LEARN, TOO_LONG, RenderStats, check_chat_tokenizer,
                                        render_examples, show_example)
from lmforge.tokenizer import Tokenizer, train_tokenizer
from tests.train_helpers import sharded_against_replicated

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CITIES = ["Paris", "Oslo", "Lima", "Quito", "Accra", "Hanoi", "Perth", "Cusco", "Dakar", "Tunis", "Baku", "Riga"]


def conversation(i: int, tools: bool = True) -> SimpleNamespace:
    city = CITIES[i % len(CITIES)]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
    messages = [{"role": "system", "content": "You are brief."},
                {"role": "user", "content": f"What is the weather in {city}?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": json.dumps({"city": city, "temp_c": 10 + i % 20})},
                {"role": "assistant", "content": f"It is {10 + i % 20} degrees in {city}."}]
    return SimpleNamespace(messages=messages, tools=TOOLS if tools else None, source=f"rows.jsonl:{i + 1}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    out = tmp_path_factory.mktemp("tok")
    texts = []
    for i in range(60):
        c = conversation(i)
        texts.append(json.dumps(c.messages) + json.dumps(TOOLS) + " It is degrees in the weather of")
    train_tokenizer(texts, vocab_size=400, out_dir=out, show_progress=False)
    return Tokenizer.load(out)


def server_prompt_ids(tokenizer: Tokenizer, messages: list[dict], tools) -> list[int]:
    """What `lmforge serve` feeds the model for a chat request (serve/app.py)."""
    return [tokenizer.eos_id, *tokenizer.encode(tokenizer.apply_chat_template(messages, tools=tools))]


def test_supervised_tokens_are_the_replies_and_their_eos(tokenizer):
    conv = conversation(3)
    [example] = render_examples(tokenizer, [conv], seq_len=1024)
    ids, sup = example.ids.tolist(), example.supervised.tolist()
    # the runs of supervised tokens, decoded, are exactly the two assistant bodies with their closing eos
    runs, current = [], []
    for token, flag in zip(ids, sup):
        if flag:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    texts = [tokenizer.decode(run) for run in runs]
    assert texts == ['<tool_call>{"name": "get_weather", "arguments": {"city": "Quito"}}</tool_call></s>',
                     "It is 13 degrees in Quito.</s>"]
    # each reply follows exactly the ids the server sends to ask for it
    for k, run_start in ((2, sup.index(1)), (4, len(sup) - len(runs[1]))):
        assert ids[:run_start] == server_prompt_ids(tokenizer, conv.messages[:k], TOOLS)
    # and the whole example is the server's one-pass encoding of the conversation (history included)
    text = tokenizer.apply_chat_template(conv.messages, tools=TOOLS, add_generation_prompt=False)
    assert ids == [tokenizer.eos_id, *tokenizer.encode(text.rstrip("\n"))]


def test_last_turn_only_and_skips_are_counted(tokenizer):
    conv = conversation(1)
    [last] = render_examples(tokenizer, [conv], seq_len=1024, assistant_turns="last")
    [both] = render_examples(tokenizer, [conv], seq_len=1024, assistant_turns="all")
    assert (last.ids == both.ids).all()
    assert 0 < last.supervised.sum() < both.supervised.sum()
    assert tokenizer.decode(last.ids[last.supervised > 0].tolist()) == "It is 11 degrees in Oslo.</s>"

    no_reply = SimpleNamespace(messages=[{"role": "user", "content": "hi"}], tools=None, source="x:1")
    stats = RenderStats()
    kept = render_examples(tokenizer, [conv, no_reply, conversation(2)], seq_len=len(both.ids) - 2, stats=stats)
    assert kept == [] and stats.kept == 0
    assert stats.skipped == {TOO_LONG: 2, NOTHING_TO_LEARN: 1}
    assert "raise data.seq_len" in stats.summary(10)
    # the longest kept example has exactly seq_len inputs
    assert len(render_examples(tokenizer, [conv], seq_len=len(both.ids) - 1)) == 1


def test_template_problems_are_clear(tokenizer, tmp_path):
    bad = SimpleNamespace(messages=[{"role": "assistant", "content": "hello"}, {"role": "user", "content": "x"}],
                          tools=None, source="data.jsonl:7")
    with pytest.raises(LMForgeError, match="data.jsonl:7: .*opens with an assistant turn"):
        render_examples(tokenizer, [bad], seq_len=100)
    # a foreign tokenizer without a chat template of its own cannot be fine-tuned on chats
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    backend = RustTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.train_from_iterator(["a GPT-2 style vocabulary"] * 5,
                                trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"]))
    backend.save(str(foreign / "tokenizer.json"))
    loaded = Tokenizer.load(foreign)
    assert loaded.special_tokens["eos"] == "<|endoftext|>" and not loaded.is_native
    with pytest.raises(LMForgeError, match="no chat template"):
        check_chat_tokenizer(loaded, str(foreign))
    check_chat_tokenizer(tokenizer, "native")  # lmforge's own tokenizers carry theirs


def test_show_marks_supervised_tokens(tokenizer):
    [example] = render_examples(tokenizer, [conversation(0)], seq_len=1024, assistant_turns="last")
    shown = show_example(tokenizer, example, color=False)
    assert shown.count("[[") == 1 and shown.endswith("[[It is 10 degrees in Paris.</s>]]")
    assert "\x1b[42;30mIt is 10" in show_example(tokenizer, example, color=True)


def test_best_fit_packing_fills_rows():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 60, size=300)
    rows = pack_rows(lengths, 64, rng.permutation(300))
    flat = sorted(i for row in rows for i in row)
    assert flat == list(range(300))  # every example exactly once
    fills = [int(lengths[row].sum()) for row in rows]
    assert max(fills) <= 64
    assert sum(fills) / (len(rows) * 64) > 0.95  # best-fit decreasing leaves little room


def _examples(tokenizer, n=40):
    """Conversations without the tool list (short: several fit a row of 256)."""
    return render_examples(tokenizer, [conversation(i, tools=i % 5 == 0) for i in range(n)], seq_len=256)


def test_packed_batches_carry_positions_documents_and_targets(tokenizer):
    examples = _examples(tokenizer)
    store = ExampleStore(examples)
    loader = PackedConversations(store, seq_len=256, micro_batch_size=2, seed=1)
    batch = loader.next_batch()
    docs, pos, labels, inputs = batch["document_ids"], batch["position_ids"], batch["labels"], batch["input_ids"]
    assert batch["num_examples"] == int(sum(len(set(d[d >= 0].tolist())) for d in docs))
    for r in range(docs.shape[0]):
        for d in set(docs[r].tolist()) - {-1}:
            where = (docs[r] == d).nonzero().flatten()
            assert pos[r, where].tolist() == list(range(len(where)))  # each conversation starts at position 0
            assert inputs[r, where[0]] == tokenizer.eos_id  # ... with the eos the server puts first
        pad = docs[r] < 0
        assert (labels[r, pad] == IGNORE_INDEX).all()
    # the targets are the supervised next tokens, in order
    assert (labels != IGNORE_INDEX).sum() > 0
    unpacked = PackedConversations(store, seq_len=256, micro_batch_size=8, seed=1, packing=False)
    assert unpacked.rows_per_epoch == len(examples) > loader.rows_per_epoch
    assert loader.padding_fraction() < 0.5 * unpacked.padding_fraction()
    assert unpacked.next_batch()["num_examples"] == 8


@pytest.mark.parametrize("flavor", ["llama", "gpt2"])
def test_packed_loss_equals_each_conversation_alone(tokenizer, flavor):
    torch.manual_seed(0)
    model = GPT(GPTConfig(flavor=flavor, vocab_size=tokenizer.vocab_size, n_layer=2, n_embd=32, n_head=2,
                          n_positions=512)).eval()
    examples = render_examples(tokenizer, [conversation(i, tools=False) for i in range(6)], seq_len=512)
    batch = PackedConversations(ExampleStore(examples), seq_len=512, micro_batch_size=1, shuffle=False).next_batch()
    assert batch["num_examples"] >= 3
    with torch.no_grad():
        packed_loss, _ = model(batch)
        total, count = 0.0, 0
        for d in range(int(batch["document_ids"].max()) + 1):
            where = batch["document_ids"][0] == d
            alone = {"input_ids": batch["input_ids"][:, where], "labels": batch["labels"][:, where]}
            n = int((alone["labels"] != IGNORE_INDEX).sum())
            total += float(model(alone)[0]) * n
            count += n
    assert float(packed_loss) == pytest.approx(total / count, rel=1e-5)


def test_loader_resumes_exactly_and_shards_ranks(tokenizer):
    store = ExampleStore(_examples(tokenizer, n=60))
    a = PackedConversations(store, seq_len=256, micro_batch_size=2, seed=3)
    for _ in range(5):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))
    b = PackedConversations(store, seq_len=256, micro_batch_size=2, seed=3)
    b.load_state_dict(state)
    for _ in range(a.rows_per_epoch // 2 + 1):  # across an epoch boundary too
        x, y = a.next_batch(), b.next_batch()
        assert all(torch.equal(x[k], y[k]) for k in ("input_ids", "labels", "document_ids"))
    assert a.epoch >= 1
    # two ranks draw disjoint rows of the same epoch
    r0 = PackedConversations(store, seq_len=256, micro_batch_size=1, seed=3, rank=0, world_size=2)
    r1 = PackedConversations(store, seq_len=256, micro_batch_size=1, seed=3, rank=1, world_size=2)
    rows0, rows1 = r0._rows_of(0), r1._rows_of(0)
    assert not {tuple(r) for r in rows0} & {tuple(r) for r in rows1}
    assert len(rows0) == len(rows1)
    other = PackedConversations(ExampleStore(_examples(tokenizer, n=30)), seq_len=256, micro_batch_size=2)
    with pytest.raises(LMForgeError, match="more than the rows"):
        PackedConversations(store, seq_len=64, micro_batch_size=2)
    with pytest.raises(LMForgeError, match="rows per epoch"):
        other.load_state_dict(state)


# ---- a real run ------------------------------------------------------------------------------------
def write_rows(path: Path, convs) -> None:
    path.write_text("".join(json.dumps({"messages": c.messages, "tools": c.tools}) + "\n" for c in convs))


@pytest.fixture(scope="module")
def base_checkpoint(tokenizer, tmp_path_factory) -> Path:
    """A small untrained gpt checkpoint with its tokenizer, as a pretraining stage leaves one."""
    out = tmp_path_factory.mktemp("base") / "ckpt"
    torch.manual_seed(0)
    model = GPT(GPTConfig(flavor="llama", vocab_size=tokenizer.vocab_size, n_layer=2, n_embd=64, n_head=2,
                          n_positions=256))
    model.save_pretrained(out)
    tokenizer.save(out)
    return out


def sft_config(tmp_path: Path, data: Path, init: Path, **training):
    from lmforge.config import load_config

    values = {"kind": "sft", "name": "sft", "out_dir": str(tmp_path / "runs"),
              "data": {"train_path": str(data), "seq_len": 256},
              "training": {"init_from": str(init), "max_steps": 40, "micro_batch_size": 4, "lr": 3e-3,
                           "warmup_steps": 0, "eval_interval": 0, "save_interval": 0, "device": "cpu",
                           "precision": "fp32", "peak_flops": 1e12, **training},
              "logging": {"tensorboard": False, "progress_bar": False}}
    return load_config(values=values)


def held_out_loss(model, tokenizer, convs) -> float:
    loader = PackedConversations(ExampleStore(render_examples(tokenizer, convs, 256)), 256, 8, shuffle=False)
    total = count = 0.0
    with torch.no_grad():
        for batch in loader.iter_eval_batches():
            n = int((batch["labels"] != IGNORE_INDEX).sum())
            total += float(model(batch)[0]) * n
            count += n
    return total / count


@pytest.fixture(scope="module")
def sft_run(tokenizer, base_checkpoint, tmp_path_factory):
    """A real sft run from the base checkpoint: 9 of every 12 cities in training, 3 held out."""
    from lmforge.train import train

    tmp_path = tmp_path_factory.mktemp("sft")
    data = tmp_path / "chats"
    data.mkdir()
    write_rows(data / "train.jsonl", [conversation(i) for i in range(0, 120) if i % 12 < 9])
    held = [conversation(i) for i in range(0, 120) if i % 12 >= 9]  # cities never seen in training
    write_rows(data / "val.jsonl", held)
    calls = [SimpleNamespace(messages=c.messages[:3], tools=c.tools, source=c.source) for c in held[:6]]
    write_rows(data / "test.jsonl", calls)  # scored on the call
    cfg = sft_config(tmp_path, data, base_checkpoint, micro_batch_size=4, max_steps=150)
    cfg.model.n_layer = 7  # ignored: the shape is the init checkpoint's
    result = train(cfg)
    return SimpleNamespace(run=tmp_path / "runs" / "sft", data=data, held=held, result=result)


def test_sft_run_learns_the_replies_and_keeps_the_model_shape(tokenizer, base_checkpoint, sft_run):
    from lmforge.models import load_model

    trained = load_model(sft_run.run / "checkpoints" / "best")
    assert trained.config.n_layer == 2 and trained.config.n_embd == 64
    before = held_out_loss(load_model(base_checkpoint).eval(), tokenizer, sft_run.held)
    after = held_out_loss(trained.eval(), tokenizer, sft_run.held)
    assert after < 0.5 * before
    assert sft_run.result.eval_metrics["eval/loss"] == pytest.approx(after, rel=1e-4)
    # the tokenizer (with its chat template) travels with the checkpoint, for serve and export
    assert Tokenizer.load(sft_run.run / "checkpoints" / "best").sha256 == tokenizer.sha256


def test_eval_tool_calls_scores_the_checkpoint_and_the_model_it_started_from(sft_run, base_checkpoint, capsys):
    from lmforge.cli import main

    assert main(["eval", str(sft_run.run), "--tool-calls", str(sft_run.data), "--json"]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(figures) == {"checkpoint", "before fine-tuning"}
    assert figures["checkpoint"]["rows"] == figures["before fine-tuning"]["rows"] == 6
    # the untrained start never writes a call; the fine-tuned model has learnt the format
    assert figures["before fine-tuning"]["parse_rate"] == 0.0
    assert figures["checkpoint"]["parse_rate"] > 0.5
    assert main(["eval", str(sft_run.run), "--tool-calls", str(sft_run.data), "--no-baseline", "--json",
                 "--limit", "2", "--max-new-tokens", "8"]) == 0
    assert set(json.loads(capsys.readouterr().out.strip().splitlines()[-1])) == {"checkpoint"}
    # a language-model option on the same checkpoint still goes to the lm kind, and mixing is refused
    assert main(["eval", str(sft_run.run), "--seq-len", "64"]) != 0
    assert "--data is required" in capsys.readouterr().err
    assert main(["eval", str(sft_run.run), "--tool-calls", str(sft_run.data), "--seq-len", "64"]) != 0
    assert "cannot be combined: --tool-calls (sft), --seq-len (lm)" in capsys.readouterr().err


def test_data_sft_shows_what_is_learned(sft_run, base_checkpoint, capsys):
    from lmforge.cli import main

    bad = sft_run.data.parent / "bad.jsonl"
    bad.write_text((sft_run.data / "val.jsonl").read_text() + '{"messages": [{"role": "wizard", "content": "x"}]}\n')
    assert main(["data", "sft", str(bad), "--checkpoint", str(base_checkpoint), "--show", "1", "--skip-bad-rows",
                 "--assistant-turns", "last"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- example") == 1 and "[[It is" in out
    assert "1 malformed skipped" in out and "30 of 30 conversations kept" in out
    assert main(["data", "sft", str(bad), "--checkpoint", str(base_checkpoint)]) != 0
    assert re.search(r"bad.jsonl:31 .*wizard", capsys.readouterr().err)


def test_sft_bad_input_is_refused_before_training(tokenizer, base_checkpoint, tmp_path):
    from lmforge.train import train

    data = tmp_path / "rows.jsonl"
    write_rows(data, [conversation(i) for i in range(10)])
    with pytest.raises(LMForgeError, match="does not exist"):
        train(sft_config(tmp_path, tmp_path / "missing.jsonl", base_checkpoint))
    with pytest.raises(LMForgeError, match="does not exist"):
        train(sft_config(tmp_path, data, tmp_path / "no-such-checkpoint"))
    from lmforge.models import build_model
    from lmforge.recipes.puzzles.trm import TRMConfig

    trm = build_model(TRMConfig(seq_len=81, vocab_size=11, num_puzzle_identifiers=4, hidden_size=32, num_heads=2,
                                L_layers=1, H_cycles=1, L_cycles=1, puzzle_emb_len=2)).save_pretrained(tmp_path / "trm")
    with pytest.raises(LMForgeError, match="holds a 'trm' model; the sft kind fine-tunes the 'gpt' family's models"):
        train(sft_config(tmp_path, data, trm))  # the message named a config class (GPTConfig)
    with pytest.raises(LMForgeError, match="seq_len"):
        cfg = sft_config(tmp_path, data, base_checkpoint)
        cfg.data.seq_len = 4096
        train(cfg)
    with pytest.raises(LMForgeError, match="recipe.assistant_turns"):
        from lmforge.config import load_config

        load_config(values={"kind": "sft", "recipe": {"assistant_turns": "first"}})
    with pytest.raises(LMForgeError, match=r"compile_mode=reduce-overhead \(CUDA graphs\) is built for the kinds: lm; "
                                           "the 'sft' kind"):
        sft_config(tmp_path, data, base_checkpoint, compile=True, compile_mode="reduce-overhead")
    assert not (tmp_path / "runs" / "sft" / "checkpoints").exists()


def test_sft_resume_is_exact(tokenizer, base_checkpoint, tmp_path):
    """8 steps straight vs 4 + resume + 4 (across an epoch of packed rows): identical weights."""
    import shutil

    from safetensors.torch import load_file

    from lmforge.train import train

    data = tmp_path / "rows.jsonl"
    write_rows(data, [conversation(i, tools=i % 3 == 0) for i in range(30)])
    common = {"max_steps": 8, "save_interval": 4, "micro_batch_size": 4}
    cfg = sft_config(tmp_path, data, base_checkpoint, **common)
    cfg.model.resid_pdrop = 0.1  # dropout on: the RNG state must resume too
    cfg.name = "straight"
    train(cfg)
    runs = tmp_path / "runs"
    (runs / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(runs / "straight" / "checkpoints" / "step-000004", runs / "resumed" / "checkpoints" / "step-000004")
    again = sft_config(tmp_path, data, base_checkpoint, **common)
    again.model.resid_pdrop = 0.1
    again.name = "resumed"
    assert train(again, resume=True).step == 8
    state = json.loads((runs / "straight" / "checkpoints" / "step-000004" / "trainer_state.json").read_text())
    assert "epoch" in json.dumps(state)  # the loader's position is part of the checkpoint
    wa = load_file(str(runs / "straight" / "checkpoints" / "step-000008" / "model.safetensors"))
    wb = load_file(str(runs / "resumed" / "checkpoints" / "step-000008" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_sft_under_torchrun_trains_on_both_processes(tokenizer, base_checkpoint, tmp_path):
    """Two processes (gloo) each draw their own packed rows; the run finishes with one checkpoint, and
    its evaluation weighs both processes' held-out rows."""
    import subprocess
    import sys

    import yaml

    data = tmp_path / "chats"
    data.mkdir()
    write_rows(data / "train.jsonl", [conversation(i, tools=i % 4 == 0) for i in range(40)])
    write_rows(data / "val.jsonl", [conversation(i, tools=False) for i in range(40, 48)])
    cfg = sft_config(tmp_path, data, base_checkpoint, max_steps=4, micro_batch_size=2, eval_interval=2)
    recipe = tmp_path / "sft.yaml"
    recipe.write_text(yaml.safe_dump(cfg.to_dict()))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "lmforge", "train", str(recipe)], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "sft"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/loss" in r] == [2, 4]
    assert (run / "checkpoints" / "best" / "model.safetensors").is_file()
    state = json.loads((run / "checkpoints" / "step-000004" / "trainer_state.json").read_text())
    assert state["data_per_rank"] and len(state["data_per_rank"]) == 2


def test_sft_sharded_on_two_processes_matches_replicated(tokenizer, base_checkpoint, tmp_path):
    """training.parallel=fsdp fine-tunes a chat model as DDP does (same losses, held-out losses and
    weights) with half the weights + optimizer state per process: a model too large for one GPU's
    training memory can be fine-tuned."""
    import yaml

    data = tmp_path / "chats"
    data.mkdir()
    write_rows(data / "train.jsonl", [conversation(i, tools=i % 4 == 0) for i in range(40)])
    write_rows(data / "val.jsonl", [conversation(i, tools=False) for i in range(40, 48)])
    cfg = sft_config(tmp_path, data, base_checkpoint, max_steps=4, micro_batch_size=2, eval_interval=2,
                     save_interval=2)
    recipe = tmp_path / "sft.yaml"
    recipe.write_text(yaml.safe_dump(cfg.to_dict()))
    rows = sharded_against_replicated(recipe, tmp_path / "runs")
    assert [r["step"] for r in rows["fsdp"] if "eval/loss" in r] == [2, 4]
