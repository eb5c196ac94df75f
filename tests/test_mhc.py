"""Manifold-constrained hyper-connections (seed 002): the layer, its metrics, and the guide's surface."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from safetensors.torch import load_file

from lmforge.config import load_config
from lmforge.errors import LMForgeError
from lmforge.models.gpt import GPT, GPTConfig, RLMModel
from lmforge.models.mhc import MHCLayer, amax_gains, gain_tensors, sinkhorn_log
from lmforge.train import train
from tests.train_helpers import (rows, PEAK_FLOPS, REPO, check_under_triton_interpreter, lmforge_cmd, run, torchrun,
                                 write_go_corpus)

SIZES = dict(flavor="llama", vocab_size=97, n_positions=32, n_embd=32, n_layer=3, n_head=4)


def mhc_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**SIZES, "mhc_enabled": True, **overrides}))


def perturb(model: GPT, seed: int = 1) -> None:
    """Random dynamic projections and static terms: a model that has trained for a while."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.mhc_layers():
            layer.phi.copy_(0.05 * torch.randn(layer.phi.shape, generator=g))
            layer.alpha.copy_(0.5 + torch.rand(3, generator=g))
            for b in (layer.b_pre, layer.b_post, layer.b_res):
                b.add_(0.5 * torch.randn(b.shape, generator=g))


def col_row_error(p: torch.Tensor) -> tuple[float, float]:
    return (p.sum(-1) - 1).abs().max().item(), (p.sum(-2) - 1).abs().max().item()


# ---- Sinkhorn ---------------------------------------------------------------------------------
def test_sinkhorn_is_doubly_stochastic_for_random_logits():
    """Standard-normal logits, 20 rounds, n = 4 (the default) and 8. (Columns converge more slowly the
    more peaked the logits: see the very-peaked test below.)"""
    torch.manual_seed(0)
    for shape in [(2000, 4, 4), (200, 8, 8)]:
        p = sinkhorn_log(torch.randn(shape), 20)
        assert torch.isfinite(p).all() and (p >= 0).all()
        rows, cols = col_row_error(p)
        assert rows < 1e-5 and cols < 1e-3, (shape, rows, cols)


def test_sinkhorn_is_stable_for_extreme_logits():
    """Magnitudes a linear-domain Sinkhorn would overflow on: the log domain keeps them finite and exact."""
    torch.manual_seed(0)
    base = torch.randn(300, 4, 4)
    # Column offsets (exp(±300) overflows fp32) are removed exactly by the first column step: the same
    # answer. (Much larger ones round the logits themselves in fp32: another matrix, not another method.)
    shifts = 100 * torch.randn(300, 1, 4)
    cases = {
        "offsets of 100s": base + shifts,
        "constant 1e30": torch.full((3, 4, 4), 1e30),
        "diagonal 1e5": 1e5 * torch.eye(4).expand(3, 4, 4),
        "off-diagonal 1e5": -1e5 * torch.eye(4).expand(3, 4, 4),
    }
    for name, logits in cases.items():
        p = sinkhorn_log(logits, 20)
        assert torch.isfinite(p).all(), name
        rows, cols = col_row_error(p)
        assert rows < 1e-5 and cols < 1e-3, (name, rows, cols)
    torch.testing.assert_close(sinkhorn_log(base + shifts, 20), sinkhorn_log(base, 20), atol=1e-4, rtol=0)
    assert torch.isfinite(sinkhorn_log(torch.tensor([[3e38, -3e38], [-3e38, 3e38]]), 20)).all()
    torch.testing.assert_close(sinkhorn_log(1e5 * torch.eye(4), 20), torch.eye(4))


def test_sinkhorn_on_very_peaked_logits_stays_finite_and_converges_with_more_rounds():
    torch.manual_seed(0)
    logits = 100 * torch.randn(200, 4, 4)
    errors = []
    for iters in (1, 20, 200):
        p = sinkhorn_log(logits, iters)
        assert torch.isfinite(p).all()
        rows, cols = col_row_error(p)
        assert rows < 1e-5
        errors.append((p.sum(-2) - 1).abs().mean().item())
    assert errors[0] > errors[1] > errors[2]


def test_sinkhorn_gradient_is_exact():
    """The hand-written backward against finite differences (float64) and against autograd through
    the unrolled rounds."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: sinkhorn_log(t, 7), (x,))

    def unrolled(t, iters):
        for _ in range(iters):
            t = t - torch.logsumexp(t, -2, keepdim=True)
            t = t - torch.logsumexp(t, -1, keepdim=True)
        return t.exp()

    w = torch.randn(3, 4, 4, dtype=torch.float64)
    ours, = torch.autograd.grad((sinkhorn_log(x, 20) * w).sum(), x)
    ref, = torch.autograd.grad((unrolled(x, 20) * w).sum(), x)
    torch.testing.assert_close(ours, ref)


# ---- Amax ------------------------------------------------------------------------------------
def test_amax_gains_match_a_hand_computation():
    m = torch.tensor([[0.5, -1.5], [2.0, 0.25]])
    fwd, bwd = amax_gains(m)
    assert fwd.item() == 2.25  # rows: |0.5| + |-1.5| = 2, |2| + |0.25| = 2.25
    assert bwd.item() == 2.5  # columns: 0.5 + 2 = 2.5, 1.5 + 0.25 = 1.75


def test_gain_tensors_per_layer_and_composite_by_hand():
    """Two sub-layers, two tokens. Composite = H_res(2) @ H_res(1) per token, then averaged."""
    a = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[0.5, 0.5], [0.5, 0.5]]])  # token 0: identity, 1: uniform
    b = torch.tensor([[[2.0, 0.0], [1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]]])
    pre = torch.tensor([[0.25, 0.5], [1.0, 1.0]])
    post = torch.tensor([[1.5, 0.5], [1.0, 2.0]])
    gains = gain_tensors([(pre, post, a), (pre, post, b)])
    # pre as a 1 x n matrix: forward = sum (0.75, 2.0 -> mean 1.375), backward = max (0.5, 1.0 -> 0.75)
    # post as n x 1: forward = max (1.5, 2.0 -> 1.75), backward = sum (2.0, 3.0 -> 2.5)
    torch.testing.assert_close(gains[0, :4], torch.tensor([1.375, 0.75, 1.75, 2.5]))
    # b: token 0 rows (2, 1), columns (3, 0) -> fwd 2, bwd 3; token 1 identity -> 1, 1
    torch.testing.assert_close(gains[1, 4:6], torch.tensor([1.5, 2.0]))
    # composite: token 0 b @ I = b -> (2, 3); token 1 I @ uniform = uniform -> (1, 1)
    torch.testing.assert_close(gains[2, :2], torch.tensor([1.5, 2.0]))


def test_model_metrics_api_as_in_the_guide():
    model = mhc_model()
    ids = torch.randint(0, 97, (2, 16))
    with pytest.raises(LMForgeError, match="no forward pass"):
        model.get_mhc_metrics()
    model.train()
    loss, metrics = model({"input_ids": ids, "labels": ids})
    assert set(metrics) == {"mhc/amax_pre", "mhc/amax_post", "mhc/amax_res", "mhc/amax_composite"}
    report = model.get_mhc_metrics()
    assert len(report) == 2 * SIZES["n_layer"]  # attention and MLP sub-layers
    pairs = [(pre, post) for pre, post in report]  # the guide's loop
    # at initialisation: H_pre sums to 1, H_post is 1, H_res doubly stochastic
    for pre, post in pairs:
        assert pre == pytest.approx(1.0, abs=1e-5) and post == pytest.approx(1.0, abs=1e-5)
    assert report.composite_fwd == pytest.approx(1.0, abs=1e-4)
    assert float(metrics["mhc/amax_composite"]) == pytest.approx(1.0, abs=1e-4)
    perturb(model)
    fresh = model.get_mhc_metrics(ids)  # from the given ids, not the last forward
    assert fresh.layers[0].pre_fwd != pytest.approx(1.0, abs=1e-3)
    with pytest.raises(LMForgeError, match="mhc_enabled"):
        GPT(GPTConfig(**SIZES)).get_mhc_metrics(ids)


def test_warning_above_two():
    model = mhc_model()
    assert model.metric_warnings({"mhc/amax_composite": 1.9, "train/loss": 5.0}) == {}
    warnings = model.metric_warnings({"mhc/amax_composite": 2.4, "mhc/amax_pre": 1.0})
    assert list(warnings) == ["mhc/amax_composite"]
    assert warnings["mhc/amax_composite"].startswith("mhc/amax_composite = 2.400 exceeds 2.0")


def test_connection_matrix_is_doubly_stochastic():
    layer = MHCLayer(hidden_dim=64, num_flows=4)
    p = layer.get_connection_matrix()
    assert p.shape == (4, 4)
    torch.testing.assert_close(p.sum(0), torch.ones(4), atol=1e-3, rtol=0)
    torch.testing.assert_close(p.sum(1), torch.ones(4), atol=1e-3, rtol=0)
    assert (p.diagonal() > 0.6).all()  # identity-like
    per_token = layer.get_connection_matrix(torch.randn(5, 4, 64))
    assert per_token.shape == (5, 4, 4)


# ---- the layer -------------------------------------------------------------------------------
def plain_twin(model: GPT) -> GPT:
    twin = GPT(GPTConfig(**{**SIZES, "mhc_enabled": False}))
    twin.load_state_dict({k: v for k, v in model.state_dict().items() if ".hc_" not in k})
    return twin.eval()


def test_initial_block_is_the_plain_residual_network():
    """Dynamic part zeroed (phi = 0) and the documented static terms: logits equal the plain model's
    with the same weights. The flows stay equal copies, so any doubly stochastic H_res leaves them be."""
    model = mhc_model().eval()
    ids = torch.randint(0, 97, (2, 20))
    torch.testing.assert_close(model.logits(ids), plain_twin(model).logits(ids), atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # any static mixing, and dynamic weights switched off by alpha = 0
        for layer in model.mhc_layers():
            layer.b_res.normal_()
            layer.phi.normal_()
            layer.alpha.zero_()
    torch.testing.assert_close(model.logits(ids), plain_twin(model).logits(ids), atol=1e-5, rtol=1e-5)
    perturb(model)  # and the test can fail: a trained mixing is not the plain network
    assert not torch.allclose(model.logits(ids), plain_twin(model).logits(ids), atol=1e-3)


def test_gradients_reach_every_coefficient_parameter():
    model = mhc_model()
    perturb(model)
    ids = torch.randint(0, 97, (2, 16))
    loss, _ = model({"input_ids": ids, "labels": ids})
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert sum(1 for n, _ in model.named_parameters() if ".hc_" in n) == 2 * SIZES["n_layer"] * 5


def test_mhc_off_is_exactly_the_plain_model():
    plain = GPT(GPTConfig(**SIZES))
    off = GPT(GPTConfig(**SIZES, mhc_enabled=False, mhc_flows=8))
    assert off.num_parameters() == plain.num_parameters()
    assert list(off.state_dict()) == list(plain.state_dict())
    n, c, sub = 4, SIZES["n_embd"], 2 * SIZES["n_layer"]
    extra = sub * (n * c * (n * n + 2 * n) + 3 + 2 * n + n * n)  # phi, alpha, b_pre, b_post, b_res
    assert mhc_model().num_parameters() == plain.num_parameters() + extra


def test_save_load_round_trip_gives_identical_logits(tmp_path):
    model = mhc_model()
    perturb(model)
    model.eval()
    ids = torch.randint(0, 97, (2, 16))
    model.save_pretrained(tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["config.yaml", "model.safetensors"]
    loaded = RLMModel.from_pretrained(tmp_path / "m").eval()
    assert loaded.config == model.config
    assert torch.equal(loaded.logits(ids), model.logits(ids))


@pytest.mark.parametrize("operators", [False, True], ids=["pytorch-ops", "mhc-operators"])
def test_activation_checkpointing_covers_the_stream_and_keeps_gradients(operators, monkeypatch):
    """Recomputing each block in the backward gives the same gradients, with the mixing as PyTorch ops and as the
    operators CUDA uses (their PyTorch implementations here)."""
    monkeypatch.setattr(MHCLayer, "uses_mixing_operators", lambda self, stream: operators)
    model = mhc_model()
    perturb(model)
    ids = torch.randint(0, 97, (2, 16))
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        model.set_activation_checkpointing(ckpt)
        loss, _ = model({"input_ids": ids, "labels": ids})
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("operators", [False, True], ids=["pytorch-ops", "mhc-operators"])
def test_kv_cache_decoding_matches_full_forward(operators, monkeypatch):
    monkeypatch.setattr(MHCLayer, "uses_mixing_operators", lambda self, stream: operators)
    model = mhc_model()
    perturb(model)
    model.eval()
    ids = torch.randint(0, 97, (2, 12))
    full = model.logits(ids)
    cache = model.new_kv_cache(2)
    steps = [model.logits(ids[:, :5], kv_cache=cache)] + [model.logits(ids[:, t:t + 1], kv_cache=cache)
                                                            for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("key,value,message", [
    ("mhc_flows", 0, "mhc_flows must be >= 1"),
    ("mhc_flows", -2, "mhc_flows must be >= 1"),
    ("mhc_sinkhorn_iters", 0, "mhc_sinkhorn_iters must be >= 1"),
    ("mhc_kernels", "cuda", "mhc_kernels must be one of auto, torch, triton"),
    ("hidden_dim", 30, r"n_embd \(30\) must be divisible by model.n_head \(4\)"),
    ("head_dim", 16, r"head_dim=16 but hidden_dim / num_heads = 32 / 4"),
])
def test_bad_model_config_is_a_clear_error(key, value, message):
    values = ["model.hidden_dim=32", "model.num_heads=4", "model.vocab_size=64", f"model.{key}={value}"]
    with pytest.raises(LMForgeError, match=message):
        load_config("rlm_mhc_tiny", values)


def test_the_guides_config_names_map_to_lmforge():
    cfg = load_config("rlm_mhc_tiny", [
        "model.hidden_dim=64", "model.num_layers=3", "model.num_heads=2", "model.head_dim=32",
        "model.ffn_dim=100", "model.max_seq_len=128", "model.gradient_checkpointing=true",
        "model.mhc_flows=2", "model.mhc_sinkhorn_iters=10",
        "training.optimizer.lr=5e-5", "training.optimizer.betas=[0.8,0.9]", "training.scheduler.warmup_steps=7",
        "training.scheduler.min_lr_ratio=0.2", "training.batch_size=3", "training.gradient_accumulation_steps=2",
        "training.max_steps=11", "training.mixed_precision=fp32", "training.save_steps=5",
        "training.logging_steps=2", "training.max_grad_norm=0.5", "training.wandb.project=rlm",
        "data.train_path=x.jsonl", "+resume_from_checkpoint=ck"])
    m, t = cfg.model, cfg.training
    assert (m.n_embd, m.n_layer, m.n_head, m.n_inner, m.n_positions) == (64, 3, 2, 100, 128)
    assert (m.mhc_enabled, m.mhc_flows, m.mhc_sinkhorn_iters) == (True, 2, 10)
    assert t.activation_checkpointing and (t.lr, t.beta1, t.beta2) == (5e-5, 0.8, 0.9)
    assert (t.warmup_steps, t.min_lr_ratio, t.micro_batch_size, t.grad_accum_steps) == (7, 0.2, 3, 2)
    assert (t.max_steps, t.precision, t.save_interval, t.log_interval, t.grad_clip) == (11, "fp32", 5, 2, 0.5)
    assert cfg.logging.wandb_project == "rlm" and cfg.data.train_path == "x.jsonl"
    assert cfg.resume_from_checkpoint == "ck"
    with pytest.raises(LMForgeError, match="unknown config key 'training.optimizer.lrr'.*training.optimizer.lr'"):
        load_config("rlm_mhc_tiny", ["training.optimizer.lrr=1e-4"])
    with pytest.raises(LMForgeError, match="optimizer.type='sgd' is not available"):
        load_config("rlm_mhc_tiny", ["training.optimizer.type=sgd"])
    with pytest.raises(LMForgeError, match="hidden_dim=64 and model.n_embd=32 are both given"):
        load_config("rlm_mhc_tiny", ["model.hidden_dim=64", "model.n_embd=32"])
    big = load_config("rlm_mhc_1b")
    assert (big.model.n_embd, big.model.n_layer, big.model.n_head, big.model.n_inner, big.model.vocab_size,
            big.model.n_positions) == (2048, 24, 16, 5461, 32000, 8192)
    assert big.training.activation_checkpointing and big.model.mhc_enabled


def test_presets_sizes():
    """The 1.3B and 125M presets build with the documented parameter counts (on the meta device)."""
    for recipe, low, high in (("rlm_mhc_1b", 1.28e9, 1.29e9), ("rlm_mhc_125m", 1.11e8, 1.12e8)):
        cfg = load_config(recipe)
        with torch.device("meta"):
            n = GPT(cfg.model).num_parameters()
        assert low < n < high, (recipe, n)


# ---- training, as the guide runs it -----------------------------------------------------------
@pytest.fixture(scope="module")
def jsonl(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("rlm")
    corpus = write_go_corpus(base / "go", n_files=30)
    path = base / "train.jsonl"
    with path.open("w") as f:
        for file in sorted(corpus.rglob("*.go")):
            f.write(json.dumps({"text": file.read_text()}) + "\n")
    return path


TINY = ["model.hidden_dim=32", "model.num_layers=2", "model.num_heads=2", "model.head_dim=16", "model.ffn_dim=64",
        "model.max_seq_len=32", "data.max_length=32", "model.vocab_size=300", "training.batch_size=4",
        "training.mixed_precision=fp32", "training.device=cpu", f"training.peak_flops={PEAK_FLOPS}",
        "training.logging_steps=1",
        "training.eval_interval=3", "training.eval_batches=2", "training.scheduler.warmup_steps=2",
        "data.val_fraction=0.2", "logging.tensorboard=false", "logging.progress_bar=false"]


def test_train_on_jsonl_with_a_trained_tokenizer_then_resume_as_the_guide_does(tmp_path, jsonl):
    args = [f"out_dir={tmp_path / 'runs'}", f"data.train_path={jsonl}", *TINY]
    first = run(lmforge_cmd("train", "rlm_mhc_tiny", *args, "training.max_steps=6", "training.save_steps=3"),
                cwd=tmp_path)
    assert first.returncode == 0, first.stderr + first.stdout
    run_dir = tmp_path / "runs" / "rlm_mhc_tiny"
    assert "training a 300-token byte-level BPE" in first.stdout
    log = rows(run_dir)
    train_rows = [r for r in log if "train/loss" in r]
    assert [r["step"] for r in train_rows] == list(range(1, 7))
    for r in train_rows:
        for key in ("mhc/amax_pre", "mhc/amax_post", "mhc/amax_res", "mhc/amax_composite"):
            assert 0.5 < r[key] < 2.0, (key, r)
    ckpt = run_dir / "checkpoints" / "step-000006"
    assert {"config.yaml", "model.safetensors", "optimizer.safetensors", "tokenizer.json"} <= {p.name for p in ckpt.iterdir()}
    model = RLMModel.from_pretrained(ckpt)
    assert model.config.mhc_enabled and model.config.vocab_size == 300

    second = run(lmforge_cmd("train", "rlm_mhc_tiny", *args, "training.max_steps=9",
                             f"+resume_from_checkpoint={ckpt}"), cwd=tmp_path)
    assert second.returncode == 0, second.stderr + second.stdout
    assert f"resuming from {ckpt} (step 6)" in second.stdout and "data: reusing" in second.stdout
    assert [r["step"] for r in rows(run_dir) if "train/loss" in r] == list(range(1, 10))


def test_local_hugging_face_tokenizer_directory(tmp_path, jsonl):
    """A foreign tokenizer (its own special-token ids, named in tokenizer_config.json) is used as is."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok_dir = tmp_path / "hf-tok"
    tok_dir.mkdir()
    backend = RustTokenizer(models.BPE(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    texts = [json.loads(line)["text"] for line in jsonl.read_text().splitlines()]
    backend.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=350, special_tokens=["[UNK]", "[PAD]", "<|begin|>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    backend.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin|>", "eos_token": {"content": "<|end|>"}, "unk_token": "[UNK]"}))
    cfg = load_config("rlm_mhc_tiny", [f"out_dir={tmp_path / 'runs'}", f"data.train_path={jsonl}",
                                       f"data.tokenizer={tok_dir}", *TINY, "model.vocab_size=0",
                                       "training.max_steps=3"])
    result = train(cfg)
    assert result.step == 3
    model = GPT.from_pretrained(result.last_checkpoint)
    assert (model.config.vocab_size, model.config.eos_token_id, model.config.bos_token_id,
            model.config.pad_token_id) == (backend.get_vocab_size(), 3, 2, 1)  # pad: found by its usual name
    meta = json.loads((tmp_path / "runs" / "rlm_mhc_tiny" / "data" / "meta.json").read_text())
    assert meta["eos_id"] == 3 and meta["document_separator"] == "<|end|>"


def test_init_from_fine_tunes_other_data_and_resume_refuses_it(tmp_path, jsonl):
    base = [f"out_dir={tmp_path / 'runs'}", *TINY, "training.max_steps=3"]
    pre = train(load_config("rlm_mhc_tiny", [*base, "name=pre", f"data.train_path={jsonl}"]))
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"text": f"func f{i}() int {{ return {i} }}\n" * 20}) + "\n"
                             for i in range(40)))
    tok = tmp_path / "runs" / "pre" / "tokenizer"
    ft = [*base, "name=ft", f"data.train_path={other}", f"data.tokenizer={tok}", "training.optimizer.lr=1e-5"]
    with pytest.raises(LMForgeError, match="training.init_from"):
        train(load_config("rlm_mhc_tiny", [*ft, f"+resume_from_checkpoint={pre.last_checkpoint}"]))
    result = train(load_config("rlm_mhc_tiny", [*ft, "name=ft2", f"training.init_from={pre.run_dir}"]))
    assert result.step == 3
    start = load_file(str(pre.last_checkpoint / "model.safetensors"))
    end = load_file(str(result.last_checkpoint / "model.safetensors"))
    assert start.keys() == end.keys()
    changes = [float((end[k] - start[k]).abs().max()) for k in start]
    assert 0 < max(changes) < 1e-3  # started from the weights, moved by a small learning rate
    with pytest.raises(LMForgeError, match="different architecture"):
        train(load_config("rlm_mhc_tiny", [*ft, "name=ft3", f"training.init_from={pre.run_dir}",
                                           "model.mhc_enabled=false"]))


def test_missing_data_and_bad_jsonl_are_clear_errors(tmp_path):
    with pytest.raises(LMForgeError, match="no training data: set data.train_path.*`lmforge data stories --out DIR`"):
        train(load_config("rlm_mhc_tiny", [f"out_dir={tmp_path}", *TINY]))
    with pytest.raises(LMForgeError, match="data.train_path=.*nope.jsonl does not exist"):
        train(load_config("rlm_mhc_tiny", [f"out_dir={tmp_path}", f"data.train_path={tmp_path / 'nope.jsonl'}",
                                           *TINY]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "package a"}\n{"text": oops}\n')
    with pytest.raises(LMForgeError, match=r"bad.jsonl:2: not valid JSON"):
        train(load_config("rlm_mhc_tiny", [f"out_dir={tmp_path}", f"data.train_path={bad}", *TINY]))
    run_dir = tmp_path / "rlm_mhc_tiny"
    assert not (run_dir / "data").exists() and not (run_dir / ".tokenizer-training").exists()  # nothing half-written


def test_torchrun_two_processes_match_one(tmp_path, jsonl):
    """mHC under DDP (gloo): the same global batch on 1 and 2 processes gives the same losses."""
    args = [f"data.train_path={jsonl}", *TINY, "training.max_steps=4", "training.save_steps=0",
            "model.vocab_size=300"]
    one = run(lmforge_cmd("train", "rlm_mhc_tiny", *args, "name=one", f"out_dir={tmp_path}",
                          "training.batch_size=4"), cwd=REPO)
    assert one.returncode == 0, one.stderr + one.stdout
    # the second run reuses the first's tokenizer so both see the same tokens
    two = torchrun(["train", "rlm_mhc_tiny", *args, "name=two", f"out_dir={tmp_path}", "training.batch_size=2",
                    f"data.tokenizer={tmp_path / 'one' / 'tokenizer'}"], tmp_path / "two")
    assert two.returncode == 0, two.stderr + two.stdout
    a = {r["step"]: r["train/loss"] for r in rows(tmp_path / "one") if "train/loss" in r}
    b = {r["step"]: r["train/loss"] for r in rows(tmp_path / "two") if "train/loss" in r}
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for s in a:
        assert a[s] == pytest.approx(b[s], rel=1e-5, abs=1e-6)


def test_mixing_stays_at_the_streams_precision_under_bf16_autocast():
    """Under autocast the coefficients and the mixing must not drop to bf16: the stream keeps the plain
    model's fp32 residual and the composite gain stays 1 to fp32 rounding (bf16 would give ~0.996)."""
    model = mhc_model()
    ids = torch.randint(0, 97, (2, 16))
    seen = []
    model.blocks[1].register_forward_hook(lambda mod, inp, out: seen.append(out[0].dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, metrics = model({"input_ids": ids, "labels": ids})
    assert seen == [torch.float32]
    assert abs(float(metrics["mhc/amax_composite"]) - 1.0) < 1e-5


def test_training_warns_when_a_gain_exceeds_the_threshold(tmp_path, jsonl, monkeypatch, capsys):
    """The loop prints the model's warnings, at most once per key per 100 logging steps. (Healthy gains
    are ~1, so the threshold is lowered to make them fire.)"""
    import lmforge.models.gpt as gpt

    monkeypatch.setattr(gpt, "UNHEALTHY_GAIN", 0.5)
    train(load_config("rlm_mhc_tiny", [f"out_dir={tmp_path}", f"data.train_path={jsonl}", *TINY,
                                       "training.max_steps=4"]))
    out = capsys.readouterr().out
    for key in ("mhc/amax_pre", "mhc/amax_post", "mhc/amax_res", "mhc/amax_composite"):
        assert out.count(f"{key} = ") == 1, out  # logged every step, warned once
    assert "warning (step 1): mhc/amax_pre = 1.000 exceeds 0.5" in out


def test_gpt2_flavor_takes_mhc_too_and_starts_as_the_plain_model():
    sizes = {**SIZES, "flavor": "gpt2"}
    torch.manual_seed(0)
    model = GPT(GPTConfig(**sizes, mhc_enabled=True)).eval()
    plain = GPT(GPTConfig(**sizes))
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if ".hc_" not in k})
    ids = torch.randint(0, 97, (2, 20))
    torch.testing.assert_close(model.logits(ids), plain.eval().logits(ids), atol=1e-5, rtol=1e-5)
    from lmforge.models.hf_compat import gpt2_state_dict_for_hf
    with pytest.raises(LMForgeError, match="no transformers equivalent"):
        gpt2_state_dict_for_hf(model)


# ---- the fused operator, the mixing, the stream dtype and the logged-steps-only metrics (issue 19) ------
def reference_sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """Today's math, independently: unrolled log-domain rounds, differentiated by autograd."""
    y = logits.double() if logits.dtype == torch.float64 else logits.float()
    for _ in range(iters):
        y = y - torch.logsumexp(y, -2, keepdim=True)
        y = y - torch.logsumexp(y, -1, keepdim=True)
    return y.exp()


def reference_mhc(layer: MHCLayer, stream: torch.Tensor, sublayer) -> tuple[torch.Tensor, tuple]:
    """The mHC sub-layer as first implemented: fp32 coefficients with autocast off, batched-matmul mixing
    at the stream's precision."""
    n, dev = layer.flows, stream.device.type
    with torch.autocast(dev, enabled=False):
        flat = stream.flatten(-2).float()
        inv_rms = torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + layer.eps)
        d_pre, d_post, d_res = (torch.nn.functional.linear(flat, layer.phi) * inv_rms).split([n, n, n * n], -1)
        h_pre = torch.sigmoid(layer.alpha[0] * d_pre + layer.b_pre)
        h_post = 2 * torch.sigmoid(layer.alpha[1] * d_post + layer.b_post)
        h_res = reference_sinkhorn(layer.alpha[2] * d_res.unflatten(-1, (n, n)) + layer.b_res, layer.sinkhorn_iters)
        x_in = torch.bmm(h_pre.to(stream.dtype).reshape(-1, 1, n), stream.reshape(-1, n, stream.shape[-1]))
    y = sublayer(x_in.reshape(stream.shape[:-2] + stream.shape[-1:]))
    with torch.autocast(dev, enabled=False):
        mixed = torch.bmm(h_res.to(stream.dtype).reshape(-1, n, n), stream.reshape(-1, n, stream.shape[-1]))
        out = mixed.reshape(stream.shape) + h_post.to(stream.dtype).unsqueeze(-1) * y.to(stream.dtype).unsqueeze(-2)
    return out, (h_pre[0].detach(), h_post[0].detach(), h_res[0].detach())


def reference_loss(model: GPT, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss (labels = ids) and Amax gains of a llama-flavor mHC model, through reference_mhc."""
    c = model.config
    x = model.tok_embed(ids)
    rope = model._rope(torch.arange(ids.shape[1]), x.dtype)
    stream = x.unsqueeze(-2).expand(*x.shape[:-1], c.mhc_flows, c.n_embd)
    coeffs = []
    for i, b in enumerate(model.blocks):
        stream, ca = reference_mhc(b.hc_attn, stream, lambda h: b.attn(b.norm_1(h), rope, None, i, None))
        stream, cm = reference_mhc(b.hc_mlp, stream, lambda h: b.mlp(b.norm_2(h)))
        coeffs += [ca, cm]
    logits = model.lm_head(model.norm_f(stream.mean(-2))).float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()), gain_tensors(coeffs)


def grads_of(model: GPT, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_loss_gradients_and_metrics_equal_the_first_implementation(precision):
    """The fused operator and the new mixing change no number: loss, Amax gains and every parameter's
    gradient against the reference (tight in fp32; bf16 autocast rounds the sub-layers differently)."""
    model = mhc_model()
    perturb(model)
    ids = torch.randint(0, 97, (2, 16))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    with autocast:
        loss, metrics = model({"input_ids": ids, "labels": ids})
    ours = grads_of(model, loss)
    with autocast:
        ref_loss, ref_gains = reference_loss(model, ids)
    ref = grads_of(model, ref_loss)
    tol = dict(atol=1e-5, rtol=1e-5) if precision == "fp32" else dict(atol=2e-2, rtol=5e-2)
    torch.testing.assert_close(loss, ref_loss, **tol)
    torch.testing.assert_close(model._mhc_gains, ref_gains, **tol)
    assert float(metrics["mhc/amax_res"]) == pytest.approx(float(ref_gains[:-1, 4:6].max()), abs=tol["atol"])
    assert len(ours) == len(ref) > 20
    # Each gradient relative to its own size, or to 1e-3 of the largest where it is ~0 (block 0's H_res
    # acts on equal flows: only rounding reaches b_res there).
    floor = 1e-3 * max(g.abs().max() for g in ref.values())
    for name in ref:
        scale = torch.maximum(ref[name].abs().max(), floor)
        torch.testing.assert_close(ours[name] / scale, ref[name] / scale, **tol, msg=name)


def test_the_normed_projections_written_out_backward_equals_autograd():
    """The eager coefficients' (flat @ phi.T) / RMS(flat) with its hand-written backward: gradcheck in fp64,
    and against autograd of the same forward for a bf16 stream (mhc_stream_dtype=autocast) and leading
    dimensions of any number, none included."""
    from lmforge.models.mhc import _NormedProjection, _normed_projection

    torch.manual_seed(0)
    flat = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    phi = (0.3 * torch.randn(24, 16, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda f, p: _NormedProjection.apply(f, p, 1e-6), (flat, phi))
    for shape, dtype, tol in (((2, 3, 64), torch.bfloat16, 2e-2), ((64,), torch.float32, 1e-5)):
        x = torch.randn(shape).to(dtype)
        p = 0.1 * torch.randn(24, 64)
        g = torch.randn(*shape[:-1], 24)
        grads = []
        for fn in (lambda a, b: _NormedProjection.apply(a, b, 1e-6),
                   lambda a, b: (lambda proj, inv: proj * inv)(*_normed_projection(a, b, 1e-6))):
            a, b = x.clone().requires_grad_(), p.clone().requires_grad_()
            out = fn(a, b)
            out.backward(g)
            grads.append((out.detach(), a.grad.float(), b.grad))
        for mine, ref in zip(*grads):
            torch.testing.assert_close(mine, ref, rtol=tol, atol=tol)


def test_an_mhc_layer_takes_a_stream_without_batch_dimensions():
    """``[n, C]`` (one token) gives what ``[1, n, C]`` gives, forward and backward, in eager mode."""
    torch.manual_seed(0)
    layer = MHCLayer(hidden_dim=8, num_flows=4, index=1)
    with torch.no_grad():
        layer.phi.normal_(0, 0.1)
    stream = torch.randn(4, 8)
    results = []
    for x in (stream.clone().requires_grad_(), stream.clone().unsqueeze(0).requires_grad_()):
        out, _ = layer(x, lambda h: 2 * h)
        out.sum().backward()
        results.append((out.reshape(4, 8).detach(), x.grad.reshape(4, 8), layer.phi.grad.clone()))
        layer.zero_grad()
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def test_sinkhorn_operator_checks_and_matches_unrolled_autograd():
    """opcheck (schema, fake tensor, autograd registration, AOT dispatch), fp64 gradcheck through the
    operator, and values and gradients equal to autograd through the unrolled rounds, peaked logits
    included (where the backward's exp(normaliser) products are longest)."""
    torch.manual_seed(0)
    for args in [(torch.randn(5, 4, 4, requires_grad=True), 20),
                 (torch.randn(2, 3, 4, 4, dtype=torch.bfloat16, requires_grad=True), 5),
                 (torch.randn(3, 2, 2, dtype=torch.float64, requires_grad=True), 1)]:
        torch.library.opcheck(torch.ops.lmforge.sinkhorn.default, args)
    x = torch.randn(3, 4, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: torch.ops.lmforge.sinkhorn(t, 6), (x,))
    for scale in (1.0, 10.0):
        x = (scale * torch.randn(300, 4, 4)).requires_grad_()
        w = torch.randn(300, 4, 4)
        torch.testing.assert_close(sinkhorn_log(x, 20), reference_sinkhorn(x, 20), atol=1e-6, rtol=0)
        ours, = torch.autograd.grad((sinkhorn_log(x, 20) * w).sum(), x)
        ref, = torch.autograd.grad((reference_sinkhorn(x, 20) * w).sum(), x)
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)


def test_sinkhorn_is_one_node_for_torch_compile():
    """Dynamo hands the backend one operator call, not the unrolled rounds."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(lambda t: sinkhorn_log(t, 20), backend=backend, fullgraph=True)
    x = torch.randn(8, 4, 4)
    torch.testing.assert_close(fn(x), sinkhorn_log(x, 20))
    calls = [node for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert [node.target for node in calls] == [torch.ops.lmforge.sinkhorn.default]


def test_step_metrics_switch_off_the_amax_metrics_and_nothing_else():
    model = mhc_model()
    perturb(model)
    ids = torch.randint(0, 97, (2, 16))
    model.step_metrics = False
    loss_off, metrics_off = model({"input_ids": ids, "labels": ids})
    assert metrics_off == {}
    with pytest.raises(LMForgeError, match="no forward pass"):  # nothing was collected
        model.get_mhc_metrics()
    model.step_metrics = True
    loss_on, metrics_on = model({"input_ids": ids, "labels": ids})
    assert set(metrics_on) == {"mhc/amax_pre", "mhc/amax_post", "mhc/amax_res", "mhc/amax_composite"}
    assert torch.equal(loss_on, loss_off)
    torch.testing.assert_close(model._mhc_gains, reference_loss(model, ids)[1])


def test_compiled_model_equals_eager_and_follows_step_metrics():
    """torch.compile: the whole model in one graph (fullgraph: no break) with the compiled form of the
    mixing gives eager's loss, metrics and gradients; flipping step_metrics recompiles (a guard on the
    attribute). The AOT-eager backend keeps this quick: Inductor's code for the mixing is checked below."""
    model = mhc_model(n_layer=2)
    perturb(model)
    ids = torch.randint(0, 97, (2, 16))
    eager_loss, eager_metrics = model({"input_ids": ids, "labels": ids})
    eager = grads_of(model, eager_loss)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss, metrics = compiled({"input_ids": ids, "labels": ids})
    torch.testing.assert_close(loss, eager_loss, atol=1e-5, rtol=1e-5)
    assert metrics.keys() == eager_metrics.keys()
    for key, value in eager_metrics.items():
        torch.testing.assert_close(metrics[key], value, atol=1e-5, rtol=1e-5)
    for name, grad in grads_of(model, loss).items():
        torch.testing.assert_close(grad, eager[name], atol=1e-5, rtol=1e-4, msg=name)
    model.step_metrics = False
    loss, metrics = compiled({"input_ids": ids, "labels": ids})
    assert metrics == {}
    torch.testing.assert_close(loss, eager_loss, atol=1e-5, rtol=1e-5)


def test_inductor_compiled_mhc_layer_equals_eager():
    """One mHC sub-layer around a linear map, compiled by Inductor (the fused mixing, the operator as an
    extern call): values and every gradient equal eager's."""
    torch.manual_seed(0)
    layer = MHCLayer(hidden_dim=16, num_flows=4, index=1)
    inner = torch.nn.Linear(16, 16)
    with torch.no_grad():
        layer.phi.normal_(0, 0.1)
        layer.alpha.fill_(1.0)

    def step(stream):
        out, _ = layer(stream, inner)
        return (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum()

    stream = torch.randn(2, 8, 4, 16, requires_grad=True)
    params = [stream, *layer.parameters(), *inner.parameters()]
    eager = torch.autograd.grad(step(stream), params)
    compiled = torch.autograd.grad(torch.compile(step, fullgraph=True)(stream), params)
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


class _RecordLinear(torch.overrides.TorchFunctionMode):
    """Records the input dtype of every F.linear call made inside it."""

    def __init__(self, seen: list):
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            self.seen.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


class _RecordFp32(TorchDispatchMode):
    """Records every operator inside it that makes an fp32 tensor of at least ``size`` elements."""

    def __init__(self, seen: list, size: int):
        super().__init__()
        self.seen, self.size = seen, size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.numel() >= self.size:
            self.seen.append(str(func))
        return out


def test_stream_in_the_training_precision_when_asked():
    """model.mhc_stream_dtype=autocast: the flows are bf16 under bf16 autocast (coefficients still fp32)
    and the loss stays near the fp32 stream's; fp32 (the default) keeps them fp32; a typo is an error."""
    ids = torch.randint(0, 97, (2, 16))
    losses = {}
    for choice, expected in (("fp32", torch.float32), ("autocast", torch.bfloat16)):
        model = mhc_model(mhc_stream_dtype=choice)
        perturb(model)
        seen = []
        model.blocks[0].register_forward_hook(lambda mod, inp, out: seen.append(out[0].dtype))
        model.blocks[0].hc_attn.register_forward_hook(lambda mod, inp, out: seen.append(out[1][2].dtype))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses[choice], _ = model({"input_ids": ids, "labels": ids})
        assert seen == [torch.float32, expected], choice  # H_res in fp32, then the block's stream
    assert float(losses["autocast"]) == pytest.approx(float(losses["fp32"]), rel=2e-2)
    # The bf16 stream is projected without an fp32 copy of it: the phi matmul takes bf16 operands, and the
    # coefficients stay within bf16 rounding of an fp32 projection of the same stream.
    layer = model.blocks[0].hc_attn
    stream = torch.randn(2, 16, 4, model.config.n_embd).bfloat16()
    matmuls, fp32_stream_sized = [], []
    with _RecordLinear(matmuls), _RecordFp32(fp32_stream_sized, stream.numel()):
        coeffs = layer.coefficients(stream)
    assert matmuls == [torch.bfloat16] and fp32_stream_sized == []
    ref = layer.coefficients(stream.float())
    for a, b in zip(coeffs, ref):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    with pytest.raises(LMForgeError, match="mhc_stream_dtype must be fp32 or autocast"):
        load_config("rlm_mhc_tiny", ["model.vocab_size=64", "model.mhc_stream_dtype=bf16"])


def test_triton_kernels_match_the_vectorised_operator_under_the_interpreter(tmp_path):
    """The CUDA kernels, run by Triton's interpreter on CPU tensors (no GPU needed): values and
    gradients equal the vectorised implementation's for n = 2, 4, 8 and a token count that leaves a
    partial block."""
    check_under_triton_interpreter(
        tmp_path,
        "import torch\n"
        "from lmforge.models import mhc_triton\n"
        "from lmforge.models.mhc import sinkhorn_log\n"
        "torch.manual_seed(0)\n"
        "for shape, iters, scale in [((3, 37, 4, 4), 20, 3.0), ((70, 2, 2), 5, 1.0), ((65, 8, 8), 3, 10.0)]:\n"
        "    x = (scale * torch.randn(shape)).requires_grad_()\n"
        "    w = torch.randn(shape)\n"
        "    ref = sinkhorn_log(x, iters)\n"
        "    ref_grad, = torch.autograd.grad((ref * w).sum(), x)\n"
        "    p = mhc_triton.sinkhorn_forward(x.detach(), iters)\n"
        "    torch.testing.assert_close(p, ref, atol=1e-6, rtol=1e-5)\n"
        "    torch.testing.assert_close(mhc_triton.sinkhorn_backward(w, x.detach(), iters), ref_grad,\n"
        "                               atol=1e-5, rtol=1e-4)\n"
        "print('kernels match')\n")


# ---- The mixing as operators (Triton kernels on CUDA) -------------------------------------------

def test_mhc_kernels_match_pytorch_under_the_interpreter(tmp_path):
    """The CUDA kernels of a sub-layer's mHC work, run by Triton's interpreter on CPU tensors, against the
    PyTorch implementations of the same operators: mhc_pre (projection, RMS, coefficients, H_pre x) and its
    backward (every gradient: the stream's, phi's and the static terms'), mix_out and its backward; for n = 1, 2,
    4, 8, fp32 / bf16 / fp16 streams, a sub-layer output in another dtype, token counts that leave partial blocks,
    widths that are not a multiple of the channel blocks, the first layer's expanded stream (flow stride 0) and a
    stream sliced out of a wider one. Outputs start NaN-filled, so a value the kernels fail to write shows."""
    check_under_triton_interpreter(
        tmp_path,
        "import torch\n"
        "_empty = torch.empty\n"
        "torch.empty = lambda *a, **k: _empty(*a, **k).fill_(float('nan'))\n"
        "from lmforge.models import mhc_triton\n"
        "from lmforge.models.mhc import _mix_out_backward_torch, _mix_out_torch, _pre, _pre_backward\n"
        "torch.manual_seed(0)\n"
        "def close(a, b, loose):  # loose: 3% of the largest value for bf16 (8 bits), 0.4% for fp16 (11 bits)\n"
        "    assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous(), (a.dtype, b.dtype, a.shape)\n"
        "    scale, rel = b.float().abs().max().item(), 3e-2 if loose == torch.bfloat16 else 4e-3\n"
        "    tol = dict(atol=rel * scale, rtol=rel) if loose else dict(atol=2e-5 * max(scale, 1), rtol=1e-5)\n"
        "    torch.testing.assert_close(a.float(), b.float(), **tol)\n"
        "def check(x, y_dtype=torch.bfloat16, mix_out=True, accumulate=True):\n"
        "    lead, (n, width) = x.shape[:-2], x.shape[-2:]\n"
        "    loose = x.dtype if x.dtype != torch.float32 else None\n"
        "    assert mhc_triton.mix_supported(x)\n"
        "    statics = (torch.randn(n * n + 2 * n, n * width) / width ** 0.5, 0.5 + torch.rand(3), torch.randn(n),\n"
        "               torch.randn(n), torch.randn(n, n))\n"
        "    ref = _pre(x, *statics, 20, 1e-6, None)\n"
        "    for a, b in zip(_pre(x, *statics, 20, 1e-6, mhc_triton), ref):\n"
        "        close(a, b, loose)\n"
        "    grads = [torch.randn(t.shape).to(t.dtype) for t in ref[:4]]\n"
        "    grads.append(torch.randn(x.shape).to(x.dtype) if accumulate else None)  # mix_out's stream gradient\n"
        "    saved = (x, *statics, ref[4], ref[5], ref[1], 20)\n"
        "    for a, b in zip(_pre_backward(*grads, *saved, mhc_triton), _pre_backward(*grads, *saved, None)):\n"
        "        close(a, b, loose)\n"
        "    if not mix_out:\n"
        "        return\n"
        "    h_post, h_res = ref[2], ref[3]\n"
        "    y = torch.randn(*lead, width).to(y_dtype)\n"
        "    close(mhc_triton.mix_out(h_res, x, h_post, y), _mix_out_torch(h_res, x, h_post, y), loose)\n"
        "    g = torch.randn(*lead, n, width).to(x.dtype)\n"
        "    for a, b in zip(mhc_triton.mix_out_backward(g, h_res, x, h_post, y),\n"
        "                    _mix_out_backward_torch(g, h_res, x, h_post, y)):\n"
        "        close(a, b, torch.bfloat16 if torch.bfloat16 in (a.dtype, y.dtype) else loose)\n"
        "for lead, n, width, dtype in [((3, 5), 4, 200, torch.float32), ((37,), 2, 128, torch.bfloat16),\n"
        "                              ((9,), 8, 70, torch.float16), ((2, 3), 1, 33, torch.float32),\n"
        "                              ((1, 70), 4, 300, torch.bfloat16)]:\n"
        "    check(torch.randn(*lead, n, width).to(dtype))\n"
        "check(torch.randn(3, 7, 4, 96), y_dtype=torch.float32, accumulate=False)\n"
        "check(torch.randn(2, 6, 96).unsqueeze(-2).expand(2, 6, 4, 96))  # the first layer's stream\n"
        "check(torch.randn(2, 6, 4, 160)[..., 16:144])  # channels contiguous, rows 160 apart\n"
        "for dtype in (torch.float32, torch.float16):  # phi's gradient: 64 token groups, 5 with 2 blocks\n"
        "    check(torch.randn(1100, 4, 32).to(dtype), mix_out=False)\n"
        "assert not mhc_triton.mix_supported(torch.randn(2, 3, 4, 8).transpose(0, 1))  # tokens do not flatten\n"
        "assert not mhc_triton.mix_supported(torch.randn(2, 3, 8, dtype=torch.float64))\n"
        "assert not mhc_triton.mix_supported(torch.randn(2, 3, 8))  # n = 3\n"
        "assert not mhc_triton.mix_supported(torch.randn(2, 16, 8))  # n = 16: more shared memory than a GPU has\n"
        "print('kernels match')\n")


def test_a_model_on_the_triton_kernels_equals_the_pytorch_path_under_the_interpreter(tmp_path):
    """End to end: a perturbed 2-layer mHC model whose operators run the Triton kernels (Triton's interpreter, on
    CPU tensors: the operators' CPU implementations swapped for the CUDA ones) gives the PyTorch path's loss and
    every gradient, with the first layer's expanded stream, mix_out's stream gradient added inside mhc_pre's
    backward, and activation checkpointing."""
    check_under_triton_interpreter(
        tmp_path,
        "import torch\n"
        "from lmforge.models import mhc, mhc_triton\n"
        "from tests.test_mhc import grads_of, mhc_model, perturb\n"
        "mhc.mhc_pre.register_kernel('cpu')(lambda *a: mhc._pre(*a, mhc_triton))\n"
        "mhc.mhc_pre_backward.register_kernel('cpu')(lambda *a: mhc._pre_backward(*a, mhc_triton))\n"
        "mhc.mhc_mix_out.register_kernel('cpu')(mhc_triton.mix_out)\n"
        "mhc.mhc_mix_out_backward.register_kernel('cpu')(mhc_triton.mix_out_backward)\n"
        "model = mhc_model(n_layer=2)\n"
        "perturb(model)\n"
        "ids = torch.randint(0, 97, (2, 16))\n"
        "results = []\n"
        "for operators, checkpointing in ((False, False), (True, False), (True, True)):\n"
        "    mhc.MHCLayer.uses_mixing_operators = lambda self, stream: operators\n"
        "    model.set_activation_checkpointing(checkpointing)\n"
        "    loss, _ = model({'input_ids': ids, 'labels': ids})\n"
        "    results.append((loss, grads_of(model, loss)))\n"
        "(ref_loss, ref), *others = results\n"
        "for loss, grads in others:\n"
        "    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)\n"
        "    for name, grad in grads.items():\n"
        "        torch.testing.assert_close(grad, ref[name], atol=1e-5, rtol=1e-4, msg=name)\n"
        "print('kernels match')\n")


def test_mhc_kernels_build_for_hopper_with_wide_loads():
    """Triton compiles the six kernels of a sub-layer's mHC work for an H100/H200 (sm_90) here, without a GPU,
    with the launch settings lmforge uses, for a bf16 stream: at n = 4 each reads the stream 16 bytes at a time
    (vector loads, or asynchronous 16-byte copies where Triton pipelines the loop) and the small products over
    the channels run on tensor cores; at every n the kernels take (n = 1, 2, 4, 8) the shared memory fits sm_90's
    227 KB, and at n = 4 (the most they take there) sm_75's 64 KB in fp16."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lmforge.models import mhc_triton as m

    geometry = ["i32"] * 4  # tokens, C, stride_t, stride_f
    mix = {"BLOCK_T": m.MIX_BLOCK_T, "BLOCK_C": m.MIX_BLOCK_C}
    mma = r"\bw?gmma\.mma_async\S*bf16|\bmma\.sync\S*bf16"  # Hopper's warpgroup MMA, or the warp-level one

    def kernels(n, s):  # kernel, argument types (s: the stream's), constexprs, launch options, uses tensor cores
        mp = m.projection_width(n * n + 2 * n)
        return [
            (m._mix_in_kernel, ["*fp32", s, s, *geometry], mix, {}, False),
            (m._mix_in_grad_h_kernel, [s, s, "*fp32", *geometry], mix, {}, False),
            (m._mix_out_kernel, ["*fp32", s, "*fp32", s, s, *geometry], mix, {}, False),
            (m._mix_out_backward_kernel, [s, "*fp32", s, "*fp32", s, "*fp32", s, "*fp32", s, *geometry],
             {"BLOCK_T": max(1, 16 // n), "BLOCK_C": m.MIX_BLOCK_C}, {}, True),
            (m._projection_kernel, [s, "*fp32", "*fp32", "*fp32", *geometry, "i32", "fp32"],
             {"MP": mp, "BLOCK_T": m.PROJ_BLOCK_T, "BLOCK_C": m.PROJ_BLOCK_C}, {"num_warps": m.PROJ_WARPS}, True),
            (m._pre_backward_kernel, [s, s, "*fp32", "*fp32", "*fp32", "*fp32", s, s, "*fp32", *geometry, "i32"],
             {"MP": mp, "BLOCK_T": m.PRE_BACKWARD_BLOCK_T, "BLOCK_C": m.PRE_BACKWARD_BLOCK_C},
             {"num_warps": m.PRE_BACKWARD_WARPS, "num_stages": m.PRE_BACKWARD_STAGES}, True),
        ]

    def build(kernel, types, sizes, options, n, capability):
        names = kernel.arg_names
        flags = {"EXACT_DOT": False, "ACCUMULATE": True}  # tensor cores; mix_out's stream gradient added (the layer's)
        constexprs = {"N": n, **sizes, **{flag: value for flag, value in flags.items() if flag in names}}
        signature = dict(zip(names, types + ["constexpr"] * len(constexprs), strict=True))
        # what the launcher specialises for a [tokens, n, 768] stream: pointers, C and the strides divisible by 16
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
                 if name not in ("tokens", "M", "eps", *constexprs)}
        return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", capability, 32), options={"num_warps": 4, **options})

    for kernel, types, sizes, options, tensor_cores in kernels(4, "*bf16"):
        compiled = build(kernel, types, sizes, options, 4, 90)
        ptx = compiled.asm["ptx"]
        wide = re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32|"
                          r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx)
        assert wide, kernel.fn.__name__
        assert bool(re.search(mma, ptx)) == tensor_cores, kernel.fn.__name__
    for n, stream, capability, limit in [(1, "*bf16", 90, 227 << 10), (2, "*bf16", 90, 227 << 10),
                                         (m.MAX_FLOWS, "*bf16", 90, 227 << 10), (m.MAX_FLOWS, "*fp32", 90, 227 << 10),
                                         (m.MAX_FLOWS_BEFORE_AMPERE, "*fp16", 75, 64 << 10)]:
        for kernel, types, sizes, options, _ in kernels(n, stream):
            shared = build(kernel, types, sizes, options, n, capability).metadata.shared
            assert shared <= limit, (kernel.fn.__name__, n, stream, capability, shared)


def test_mhc_operators_pass_opcheck_and_gradcheck():
    """opcheck (schemas, fake kernels, autograd registration) of mhc_pre, mhc_mix_out and their backwards, and an
    fp64 gradcheck through both forwards with respect to every input (the stream, phi, alpha, the static terms,
    the coefficients, the sub-layer's output)."""
    from lmforge.models.mhc import mhc_mix_out, mhc_mix_out_backward, mhc_pre, mhc_pre_backward

    torch.manual_seed(0)

    def statics(n, width, dtype=torch.float32):
        return [t.to(dtype).requires_grad_() for t in (0.1 * torch.randn(n * n + 2 * n, n * width),
                                                        0.5 + torch.rand(3), torch.randn(n), torch.randn(n),
                                                        torch.randn(n, n))]

    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 3, 4, 8, dtype=dtype)
        pre_args = (x.requires_grad_(), *statics(4, 8), 5, 1e-6)
        torch.library.opcheck(mhc_pre, pre_args)
        out = mhc_pre(*pre_args)
        grads = [torch.randn_like(t) for t in out[:4]]
        for d_stream in (torch.randn_like(x), None):  # mhc_mix_out's gradient of the stream, added; or none
            torch.library.opcheck(mhc_pre_backward, (*grads, d_stream, x.detach(), *(t.detach() for t in pre_args[1:6]),
                                                     out[4].detach(), out[5].detach(), out[1].detach(), 5))
        h_post, h_res = out[2].detach().requires_grad_(), out[3].detach().requires_grad_()
        y = torch.randn(2, 3, 8, dtype=dtype, requires_grad=True)
        torch.library.opcheck(mhc_mix_out, (h_res, x, h_post, y))
        torch.library.opcheck(mhc_mix_out_backward, (torch.randn(2, 3, 4, 8, dtype=dtype), h_res.detach(),
                                                     x.detach(), h_post.detach(), y.detach()))
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    params = statics(4, 5, torch.float64)
    assert torch.autograd.gradcheck(lambda *t: mhc_pre(*t, 4, 1e-6)[:4], (x, *params))
    h = [torch.rand(*s, dtype=torch.float64, requires_grad=True) for s in ((3, 4, 4), (3, 4))]
    y = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(mhc_mix_out, (h[0], x, h[1], y))


def test_the_layer_on_the_mixing_operators_equals_the_pytorch_path(monkeypatch):
    """With the operators switched on (what CUDA with Triton does; here their PyTorch implementations run), a
    perturbed mHC model gives the PyTorch path's loss, metrics and every gradient: eager, under bf16 autocast
    (the operators keep the fp32 stream in fp32), and compiled (one graph, each sub-layer two operator nodes; the
    Inductor-compiled forward and backward too); the fp32 coefficients reach the operators as they are, mhc_mix_out's gradient of the
    stream reaches mhc_pre's backward (which adds it), a bf16 stream comes back bf16, and a stream without batch
    dimensions goes through forward and backward."""
    from lmforge.models import mhc

    operators = [False]
    monkeypatch.setattr(MHCLayer, "uses_mixing_operators", lambda self, stream: operators[0])
    model = mhc_model(n_layer=2)
    perturb(model)
    ids = torch.randint(0, 97, (2, 16))

    def run(ops, autocast=False, compiled=None):
        operators[0] = ops
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, metrics = (model if compiled is None else compiled)({"input_ids": ids, "labels": ids})
        return loss, metrics, grads_of(model, loss)

    ref_loss, ref_metrics, ref = run(False)
    seen = []
    real_mix_out = mhc.mhc_mix_out

    def recording_mix_out(h_res, stream, h_post, y):
        seen.append((h_res.dtype, h_post.dtype, stream.dtype))
        return real_mix_out(h_res, stream, h_post, y)

    real_pre_backward = mhc.mhc_pre_backward
    added = []

    def recording_pre_backward(*args):
        added.append(args[4] is not None)  # mhc_mix_out's gradient of the stream, added in the same pass
        return real_pre_backward(*args)

    monkeypatch.setattr(mhc, "mhc_mix_out", recording_mix_out)
    monkeypatch.setattr(mhc, "mhc_pre_backward", recording_pre_backward)
    loss, metrics, grads = run(True)
    assert len(seen) == 4 and set(seen) == {(torch.float32, torch.float32, torch.float32)}
    assert added == [True] * 4
    monkeypatch.setattr(mhc, "mhc_mix_out", real_mix_out)
    monkeypatch.setattr(mhc, "mhc_pre_backward", real_pre_backward)
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    for key, value in ref_metrics.items():
        torch.testing.assert_close(metrics[key], value, atol=1e-6, rtol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref[name], atol=1e-5, rtol=1e-4, msg=name)
    auto_loss, _, auto_ref = run(False, autocast=True)
    loss, _, grads = run(True, autocast=True)
    torch.testing.assert_close(loss, auto_loss, atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, auto_ref[name], atol=1e-4, rtol=1e-3, msg=name)

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    loss, _, _ = run(True, compiled=torch.compile(model, backend=backend, fullgraph=True))
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    targets = [node.target for graph in graphs[0].modules() if isinstance(graph, torch.fx.GraphModule)
               for node in graph.graph.nodes if node.op == "call_function"]  # mhc_pre: in its Function's graph
    assert targets.count(torch.ops.lmforge.mhc_pre.default) == 4
    assert targets.count(torch.ops.lmforge.mhc_mix_out.default) == 4
    torch._dynamo.reset()
    loss, _, grads = run(True, compiled=torch.compile(model, fullgraph=True))
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref[name], atol=1e-5, rtol=1e-4, msg=name)

    operators[0] = True
    layer = model.blocks[0].hc_mlp
    out, _ = layer(torch.randn(2, 5, 4, 32).bfloat16(), lambda x: x * 2)
    assert out.dtype == torch.bfloat16
    results = []
    for ops in (True, False):
        operators[0] = ops
        stream = torch.randn(4, 32, generator=torch.Generator().manual_seed(3)).requires_grad_()
        out, _ = layer(stream, torch.tanh)
        results.append((out, *torch.autograd.grad((out * out).sum(), [stream, *layer.parameters()])))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_the_mixing_operators_run_only_when_asked_for_on_cuda_with_triton(monkeypatch):
    from types import SimpleNamespace

    from lmforge.models import mhc

    cuda, cpu = SimpleNamespace(device=torch.device("cuda")), SimpleNamespace(device=torch.device("cpu"))
    monkeypatch.setattr(mhc, "can_build_triton_kernels", lambda: True)
    assert MHCLayer(8, kernels="triton").uses_mixing_operators(cuda)
    # auto is the fastest measured on an H200: PyTorch ops, as torch names them
    assert not MHCLayer(8).uses_mixing_operators(cuda)
    assert not MHCLayer(8, kernels="torch").uses_mixing_operators(cuda)
    assert not MHCLayer(8, kernels="triton").uses_mixing_operators(cpu)
    assert mhc_model(mhc_kernels="triton").blocks[1].hc_attn.kernels == "triton"
    monkeypatch.setattr(mhc, "can_build_triton_kernels", lambda: False)  # no Triton or no C compiler
    assert not MHCLayer(8, kernels="triton").uses_mixing_operators(cuda)
    with pytest.raises(ValueError, match="kernels must be one of auto, torch, triton"):
        MHCLayer(8, kernels="cuda")
