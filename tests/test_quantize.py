"""int8 weight-only inference (``--quantize int8``, ``lmforge.infer.quantize``): accuracy against fp32, the
guarded kernel and its fallbacks, tied embeddings, KV caches, the serving engine, the CLI and its errors.

Tolerances: a weight is off by at most half a quantization step, ``max|row| / 254``, so a matmul's output
is off by well under 1% of its scale and a few layers of that stay within 2-3% of the logits' range
(measured ~0.6% on these models); a wrong scale, a transposed table or rows of the wrong token are off
by ~100%. With bf16 activations, bf16's own rounding (2^-9 per value) comes on top: 5%. No timings.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import torch
import torch.nn.functional as F

from lmforge.cli import main
from lmforge.errors import LMForgeError
from lmforge.infer import quantize as qz
from lmforge.infer.engine import Engine, SamplingParams
from lmforge.infer.generate import generate_tokens
from lmforge.infer.loading import load_for_inference
from lmforge.infer.quantize import Int8Embedding, Int8Linear, int8_linear, quantize_int8, quantize_rows
from lmforge.models.gpt import GPT, GPTConfig

from .serve_helpers import ASK_TOOL, GREETING, HELLO, TOOLS, Server, train_chat_model

HANG = 120


def model_of(flavor="gpt2", n_embd=64, n_head=4, tied=True, vocab=300, layers=2, seed=0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(flavor=flavor, vocab_size=vocab, n_positions=64, n_embd=n_embd, n_layer=layers,
                         n_head=n_head, tie_word_embeddings=tied)).eval()


def quantized_copy(model: GPT, dtype=torch.float32) -> GPT:
    copy = GPT(model.config).eval()
    copy.load_state_dict(model.state_dict())
    return quantize_int8(copy, dtype)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.fixture()
def kernel_calls(monkeypatch):
    """Counts the calls that reach ``_weight_int8pack_mm`` (the rest took the dequantized fallback)."""
    calls = []

    def counted(x, w, s):
        calls.append((tuple(x.shape), tuple(w.shape)))
        return torch.ops.aten._weight_int8pack_mm(x, w, s)

    monkeypatch.setattr(qz, "_KERNEL", counted)
    return calls


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    return train_chat_model(tmp_path_factory.mktemp("chat"), flavor="gpt2")


def chat_ids(tokenizer, conversation, **kwargs) -> list[int]:
    return [tokenizer.eos_id, *tokenizer.encode(tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                                                              **kwargs))]


# ---- the numbers ---------------------------------------------------------------------------------
def test_rows_round_trip_within_half_a_step_with_exact_bf16_scales():
    w = torch.randn(50, 40) * torch.logspace(-3, 1, 50)[:, None]  # rows of very different magnitudes
    w[7] = 0.0  # an all-zero row must not divide by zero
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16 and int(q.abs().max()) <= 127
    step = scale.float()[:, None]
    assert bool(((q.float() * step - w).abs() <= step / 2 * (1 + 1e-6)).all())
    assert bool((q[7] == 0).all())
    assert bool((scale.float() * 127 >= w.abs().amax(1)).all())  # rounded up: nothing is clipped


@pytest.mark.parametrize("flavor", ["gpt2", "llama"])
@pytest.mark.parametrize("tied", [True, False])
def test_logits_close_to_fp32(flavor, tied):
    model = model_of(flavor, tied=tied)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model.logits(ids)
        fp32 = quantized_copy(model, torch.float32).logits(ids)
        bf16 = quantized_copy(model, torch.bfloat16).logits(ids)
    assert fp32.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    assert relative_error(fp32, ref) < 0.03
    assert relative_error(bf16, ref) < 0.05
    assert relative_error(fp32, ref) > 0  # it really is quantized


def test_tied_head_and_embedding_share_one_int8_table():
    model = model_of("gpt2", tied=True)
    embed = model.tok_embed.weight.detach().clone()
    bf16_bytes = sum(p.numel() for p in model.parameters()) * 2
    quantize_int8(model, torch.bfloat16)
    assert isinstance(model.tok_embed, Int8Embedding) and isinstance(model.lm_head, Int8Linear)
    assert model.lm_head.qweight is model.tok_embed.qweight and model.lm_head.scale is model.tok_embed.scale
    ids = torch.tensor([[0, 5, 299, 5]])
    looked_up = model.tok_embed(ids)
    assert looked_up.dtype == torch.bfloat16 and looked_up.shape == (1, 4, 64)
    assert relative_error(looked_up[0], embed[ids[0]]) < 0.01
    assert qz.quantized_bytes(model) < 0.6 * bf16_bytes  # one int8 table, not a bf16 embedding and an int8 head


def test_untied_head_and_embedding_get_their_own_tables():
    model = quantize_int8(model_of("llama", tied=False), torch.float32)
    assert model.lm_head.qweight is not model.tok_embed.qweight
    assert not torch.equal(model.lm_head.qweight, model.tok_embed.qweight)


# ---- the kernel's guard and the fallbacks ----------------------------------------------------------
def reference(x, q, scale, bias=None):
    return F.linear(x.float(), q.float() * scale.float()[:, None], None if bias is None else bias.float())


@pytest.mark.parametrize("rows,k,n,kernel", [
    (1, 64, 7, True),  # decode: the kernel, any N
    (3, 32, 5, True),  # an odd number of rows
    (qz.KERNEL_ROWS + 1, 64, 9, False),  # more rows than the kernel is worth: dequantized matmul
    (1, 24, 5, False),  # K not a multiple of 16: the kernel would read past each row
    (2, 8, 3, False),  # a tiny matrix
    (1, 1, 1, False),
])
def test_int8_linear_kernel_and_fallback_shapes(kernel_calls, rows, k, n, kernel):
    torch.manual_seed(0)
    q, scale = quantize_rows(torch.randn(n, k))
    bias = torch.randn(n)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(rows, k).to(dtype)
        kernel_calls.clear()
        out = int8_linear(x, q, scale, bias.to(dtype))
        assert out.dtype == dtype and out.shape == (rows, n)
        assert bool(kernel_calls) == kernel, (dtype, kernel_calls)
        assert relative_error(out, reference(x, q, scale, bias)) < 0.02


@pytest.mark.parametrize("tile_rows", [1, 3, 10, 64])
def test_the_fallback_dequantizes_tile_by_tile_and_equals_the_whole_matmul(monkeypatch, tile_rows):
    """Above KERNEL_ROWS rows the weight is dequantized a tile of output channels at a time: one row,
    three (the last tile partial), exactly N, and more than N (one tile) all give the same result."""
    torch.manual_seed(0)
    q, scale = quantize_rows(torch.randn(10, 32))
    bias = torch.randn(10)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(qz.KERNEL_ROWS + 3, 32).to(dtype)
        monkeypatch.setattr(qz, "TILE_BYTES", tile_rows * 32 * x.element_size())
        out = int8_linear(x, q, scale, bias.to(dtype))
        assert out.shape == (qz.KERNEL_ROWS + 3, 10) and out.is_contiguous() and out.dtype == dtype
        want = reference(x, q, scale, bias)
        assert relative_error(out, want) < (1e-5 if dtype == torch.float32 else 0.02), (dtype, tile_rows)


def test_misaligned_and_strided_inputs_are_copied_not_crashed(kernel_calls):
    torch.manual_seed(0)
    q, scale = quantize_rows(torch.randn(6, 16))
    big = torch.randn(4, 16, dtype=torch.bfloat16)
    row = big[1:2]  # 32 bytes into the allocation: the kernel's aligned loads would fault on it
    assert row.data_ptr() % qz.ALIGN
    out = int8_linear(row, q, scale)
    assert kernel_calls and relative_error(out, reference(row, q, scale)) < 0.02
    wide = torch.randn(2, 32, dtype=torch.bfloat16)[:, ::2]  # non-contiguous
    assert relative_error(int8_linear(wide, q, scale), reference(wide, q, scale)) < 0.02
    assert int8_linear(torch.randn(0, 16), q, scale).shape == (0, 6)  # no rows at all


def test_a_model_whose_widths_the_kernel_cannot_take_falls_back_and_stays_correct(kernel_calls):
    model = model_of("llama", n_embd=24, n_head=4)  # K = 24 for qkv, proj, gate_up: not a multiple of 16
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model.logits(ids)
        quantized = quantized_copy(model, torch.bfloat16)
        out = quantized.logits(ids)
        list(generate_tokens(quantized, ids[0].tolist(), 3, temperature=0))
    assert relative_error(out, ref) < 0.05
    assert kernel_calls and all(x[1] % qz.KERNEL_K == 0 for x, _ in kernel_calls)  # only the MLP's K = 64 went


# ---- caches, engine, greedy tokens -----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_decode_matches_the_full_forward(dtype):
    model = quantize_int8(model_of("llama"), dtype)
    ids = torch.randint(0, 300, (1, 14), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model.logits(ids)[0]
        cache = model.new_kv_cache(1)
        assert cache.k[0].dtype == dtype
        steps = [model.logits(ids[:, :6], kv_cache=cache, last_only=True)[0, -1]]
        for t in range(6, 14):
            steps.append(model.logits(ids[:, t:t + 1], kv_cache=cache)[0, -1])
        hidden = model.hidden_states(ids)
    # The full forward (14 rows) takes the dequantized matmul, the one-token steps the kernel (its
    # activations rounded to bf16): the same weights, different rounding.
    assert relative_error(torch.stack(steps), full[5:]) < (0.01 if dtype == torch.float32 else 0.05)
    assert hidden.shape == (1, 14, 64) and hidden.dtype == dtype


def test_greedy_tokens_of_a_trained_model_agree(chat_ckpt):
    reference_model, tokenizer, _ = load_for_inference(chat_ckpt, "cpu", "fp32")
    for precision in ("fp32", "bf16"):
        model, _, _ = load_for_inference(chat_ckpt, "cpu", precision, quantize="int8")
        assert model.quantization == "int8"
        for conversation, kwargs in ((GREETING, {}), (ASK_TOOL, {"tools": TOOLS})):
            ids = chat_ids(tokenizer, conversation, **kwargs)
            want = list(generate_tokens(reference_model, ids, 60, temperature=0))
            assert list(generate_tokens(model, ids, 60, temperature=0)) == want, precision
    assert tokenizer.decode(list(generate_tokens(model, chat_ids(tokenizer, GREETING), 60, temperature=0))) == HELLO


def test_the_batching_engine_decodes_what_generate_does(chat_ckpt):
    import time

    model, tokenizer, _ = load_for_inference(chat_ckpt, "cpu", "bf16", quantize="int8")
    prompts = [chat_ids(tokenizer, GREETING), chat_ids(tokenizer, ASK_TOOL, tools=TOOLS), [tokenizer.eos_id, 5, 6, 7]]
    want = [list(generate_tokens(model, ids, 20, temperature=0, stop_at_eos=False)) for ids in prompts]
    requests = prompts * 3  # 9 requests through 4 rows: rows join and leave mid-batch (BatchedKVCache)
    got: list[list[int]] = [[] for _ in requests]
    done = [False] * len(requests)

    def events(i):
        def on_event(event):
            if event[0] == "token":
                got[i].append(event[1])
            else:
                done[i] = True
        return on_event

    engine = Engine(model, eos_id=-1, max_batch_size=4)
    try:
        for i, ids in enumerate(requests):
            engine.submit(ids, SamplingParams(20, temperature=0), events(i))
        end = time.monotonic() + HANG
        while not all(done) and time.monotonic() < end:
            time.sleep(0.05)
    finally:
        engine.close()
    assert all(done)
    assert got == [want[i % len(prompts)] for i in range(len(requests))]


# ---- command line ----------------------------------------------------------------------------------
def test_generate_cli_with_quantize_int8(chat_ckpt, tmp_path, capsys):
    model, tokenizer, _ = load_for_inference(chat_ckpt, "cpu", "fp32")
    prompt = tokenizer.apply_chat_template(GREETING, add_generation_prompt=True)
    (tmp_path / "prompt.txt").write_text(prompt)
    assert main(["generate", str(chat_ckpt), "--prompt-file", str(tmp_path / "prompt.txt"), "--temperature", "0",
                 "--max-new-tokens", "60", "--quantize", "int8"]) == 0
    assert capsys.readouterr().out == prompt + HELLO + "\n"


def test_serve_and_chat_with_quantize_int8(chat_ckpt):
    server = Server(chat_ckpt, "--quantize", "int8", "--max-batch-size", "4")
    try:
        reply = httpx.post(server.base + "/v1/chat/completions", timeout=HANG, json={
            "model": "tiny", "messages": GREETING, "temperature": 0, "max_tokens": 60}).json()
        assert reply["choices"][0]["message"]["content"] == HELLO
        call = httpx.post(server.base + "/v1/chat/completions", timeout=HANG, json={
            "model": "tiny", "messages": ASK_TOOL, "tools": TOOLS, "temperature": 0}).json()
        assert call["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "read_file"
    finally:
        server.stop()
    assert "int8 weights, float32 activations" in server.log.read_text()
    r = subprocess.run([sys.executable, "-m", "lmforge", "chat", str(chat_ckpt), "--temperature", "0", "--quantize",
                        "int8"], input="Say hello\n/exit\n", capture_output=True, text=True, timeout=HANG)
    assert r.returncode == 0, r.stderr
    assert f"model> {HELLO}\n" in r.stdout


@pytest.mark.parametrize("argv,message", [
    (["--quantize", "int8", "--device", "cuda"], "--quantize int8 runs on CPUs only"),
    (["--quantize", "int8", "--device", "mps"], "--quantize int8 runs on CPUs only"),
    (["--quantize", "int8", "--precision", "fp16"], "not fp16"),
])
@pytest.mark.parametrize("verb", ["generate", "serve", "chat"])
def test_quantize_on_what_it_cannot_serve_is_a_clear_error(chat_ckpt, capsys, verb, argv, message):
    assert main([verb, str(chat_ckpt), *argv]) == 2
    assert message in capsys.readouterr().err


def test_unknown_quantize_values_and_non_gpt_models_are_refused(chat_ckpt, tmp_path, capsys):
    import shutil

    from lmforge.models import build_model
    from lmforge.recipes.puzzles.trm import TRMConfig

    for verb in ("generate", "serve", "chat"):
        with pytest.raises(SystemExit) as exit_:
            main([verb, str(chat_ckpt), "--quantize", "int4"])
        assert exit_.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err
    with pytest.raises(LMForgeError, match="unknown --quantize 'int4'"):
        load_for_inference(chat_ckpt, "cpu", "fp32", quantize="int4")
    build_model(TRMConfig(seq_len=81, vocab_size=11, num_puzzle_identifiers=4, hidden_size=32, num_heads=2,
                          L_layers=1, H_cycles=1, L_cycles=1, puzzle_emb_len=2)).save_pretrained(tmp_path / "trm")
    shutil.copy(chat_ckpt / "tokenizer.json", tmp_path / "trm")
    assert main(["generate", str(tmp_path / "trm"), "--quantize", "int8"]) == 2
    assert "--quantize is for lm checkpoints" in capsys.readouterr().err
    assert main(["serve", str(tmp_path / "trm"), "--quantize", "int8"]) == 2
    assert "does not generate text" in capsys.readouterr().err
    with pytest.raises(LMForgeError, match="for gpt-family models"):
        quantize_int8(torch.nn.Linear(4, 4))
    model = quantize_int8(model_of())
    with pytest.raises(LMForgeError, match="already quantized"):
        quantize_int8(model)
