"""End to end: a small staged pipeline (tool data -> tokenizer -> language -> tool-calling SFT -> export),
its last stage served by `lmforge serve` and called with the official `openai` client, and its exports
read by transformers and the gguf reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.serve_helpers import Server

PIPELINE = """
name: e2e
out_dir: {out}
stages:
  - name: stories
    kind: data
    generator: stories
    args: {{n_stories: 400, seed: 0}}
  - name: tool_data
    kind: data
    generator: tool-calls
    args: {{n_train: 500, n_val: 40, n_test: 40, seed: 0}}
  - name: tokenizer
    kind: tokenizer
    sources: ["${{stages.stories.out}}/train.txt", "{chats}"]
    vocab_size: 800
  - name: language
    kind: lm
    tokenizer: tokenizer
    data: {{train_path: "${{stages.stories.out}}/train.txt", seq_len: 128}}
    overrides:
      model: {{flavor: llama, n_layer: 2, n_embd: 128, n_head: 4, n_positions: 512}}
      training: {{max_steps: 40, micro_batch_size: 8, lr: 3.0e-3, warmup_steps: 5, eval_interval: 0,
                 save_interval: 0, device: cpu, precision: fp32, peak_flops: 1.0e12}}
      logging: {{tensorboard: false, progress_bar: false}}
  - name: tools
    kind: sft
    init: language
    data: {{train_path: "${{stages.tool_data.out}}", seq_len: 512}}
    overrides:
      training: {{max_steps: 220, micro_batch_size: 4, lr: 3.0e-3, warmup_steps: 10, eval_interval: 0,
                 save_interval: 0, device: cpu, precision: fp32, peak_flops: 1.0e12}}
      logging: {{tensorboard: false, progress_bar: false}}
  - name: export
    kind: export
    checkpoint: tools
    formats: [hf, gguf]
"""


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> Path:
    from lmforge.pipeline import run_pipeline

    from lmforge.chat import render_chat
    from lmforge.posttrain.toolcalls import make_rows

    base = tmp_path_factory.mktemp("e2e")
    # text for the tokenizer to learn the tool-call JSON from (other rows than the pipeline trains on)
    chats = base / "chats.txt"
    chats.write_text("\n<|endoftext|>\n".join(render_chat(r["messages"], "<s>", "</s>", tools=r["tools"],
                                                         add_generation_prompt=False)
                                             for r in make_rows("train", 300, seed=1)))
    file = base / "e2e.yaml"
    file.write_text(PIPELINE.format(out=base / "out", chats=chats))
    run_pipeline(str(file), log=lambda *a, **k: None)
    return base / "out"


def rows_of(out: Path, case: str) -> list[dict]:
    from lmforge.posttrain.toolcalls import case_of

    rows = [json.loads(line) for line in (out / "tool_data" / "train.jsonl").read_text().splitlines()]
    return [r for r in rows if case_of(r) == case]


def test_served_fine_tuned_model_calls_tools_through_the_openai_client(pipeline):
    import openai

    server = Server(pipeline / "tools")
    try:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused")
        calls = 0
        for row in rows_of(pipeline, "single_call")[:3]:
            r = client.chat.completions.create(model="tiny", messages=row["messages"][:-1], tools=row["tools"],
                                               temperature=0, max_tokens=64)
            message = r.choices[0].message
            for call in message.tool_calls or []:
                assert call.type == "function" and call.id.startswith("call_")
                assert call.function.name  # (a model this small often picks the wrong tool: tools_eval's figures)
                assert isinstance(json.loads(call.function.arguments), dict)  # parseable, an object
                calls += 1
            if message.tool_calls:
                assert r.choices[0].finish_reason == "tool_calls"
        assert calls >= 2  # the fine-tuned model calls tools; the untrained start never did (tools_eval)

        # the tool's result goes back as a `tool` message; the reply is a plain answer
        row = rows_of(pipeline, "tool_result_answer")[0]
        messages = []
        for m in row["messages"][:-1]:
            if m.get("tool_calls"):
                m = {**m, "tool_calls": [{**c, "id": f"call_{i}"} for i, c in enumerate(m["tool_calls"])]}
            if m["role"] == "tool":
                m = {**m, "tool_call_id": "call_0"}
            messages.append(m)
        r = client.chat.completions.create(model="tiny", messages=messages, tools=row["tools"], temperature=0,
                                           max_tokens=48)
        answer = r.choices[0].message
        assert not answer.tool_calls and answer.content and r.choices[0].finish_reason == "stop"
    finally:
        server.stop()


def test_exports_carry_the_chat_template_and_render_identically(pipeline):
    import gguf
    from transformers import AutoTokenizer

    from lmforge.tokenizer import Tokenizer

    ours = Tokenizer.load(pipeline / "tools" / "checkpoints" / "best")
    hf = AutoTokenizer.from_pretrained(pipeline / "export" / "hf")
    for case in ("single_call", "tool_result_answer", "no_call"):
        row = rows_of(pipeline, case)[0]
        for prompt in (True, False):
            messages = row["messages"][:-1] if prompt else row["messages"]
            expected = ours.apply_chat_template(messages, tools=row["tools"], add_generation_prompt=prompt)
            assert hf.apply_chat_template(messages, tools=row["tools"], add_generation_prompt=prompt,
                                          tokenize=False) == expected
            assert hf.encode(expected, add_special_tokens=False) == ours.encode(expected)
    [gguf_file] = (pipeline / "export").glob("*.gguf")
    reader = gguf.GGUFReader(str(gguf_file))
    field = reader.fields["tokenizer.chat_template"]
    assert bytes(field.parts[field.data[0]]).decode() == ours.chat_template
