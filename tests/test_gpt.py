"""GPT model: masking, HF parity, checkpoints, presets, config validation, training behaviour."""

from __future__ import annotations

import pytest
import torch
import yaml
from safetensors.torch import load_file

import lmforge.models.gpt as gpt_module
from lmforge.config import dataclass_from_dict
from lmforge.errors import LMForgeError
from lmforge.models import LMForgeModel, build_model
from lmforge.models.gpt import GPT, GPTConfig
from lmforge.models.hf_compat import gpt2_state_dict_for_hf, llama_state_dict_for_hf

VOCAB = 97
FLAVORS = {
    "gpt2": {"flavor": "gpt2"},
    "llama_gqa": {"flavor": "llama", "n_kv_head": 2},
}


def tiny(flavor: str = "gpt2", **overrides) -> GPT:
    values = {**FLAVORS[flavor], "vocab_size": VOCAB, "n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 4}
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**values, **overrides}))


def randomize(model: GPT) -> GPT:
    """Non-trivial values everywhere (biases and norm scales too), so layout mistakes show up."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def random_ids(batch: int = 2, length: int = 24, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("flavor", FLAVORS)
def test_future_tokens_never_change_past_logits(flavor):
    model = tiny(flavor).eval()
    ids = random_ids()
    changed = ids.clone()
    changed[:, 12:] = (changed[:, 12:] + 1) % VOCAB
    with torch.no_grad():
        a, b = model.logits(ids), model.logits(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 12:], b[:, 12:])  # the change is visible where it is allowed


@pytest.mark.parametrize("activation", ["gelu", "gelu_new"])
def test_gpt2_flavor_matches_transformers(activation):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = randomize(tiny("gpt2", activation_function=activation)).eval()
    c = model.config
    hf = GPT2LMHeadModel(GPT2Config(
        vocab_size=c.vocab_size, n_positions=c.n_positions, n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head,
        activation_function=activation, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        layer_norm_epsilon=c.layer_norm_epsilon, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )).eval()
    hf.load_state_dict(gpt2_state_dict_for_hf(model), strict=True)
    ids = random_ids(length=c.n_positions)
    with torch.no_grad():
        torch.testing.assert_close(model.logits(ids), hf(ids).logits, rtol=0, atol=1e-4)


def test_llama_flavor_matches_transformers_rope_convention():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = randomize(tiny("llama_gqa", tie_word_embeddings=False, rope_theta=500.0)).eval()
    c = model.config
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.inner_size,
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.kv_heads,
        max_position_embeddings=c.n_positions, rms_norm_eps=c.layer_norm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=3,
    )).eval()
    hf.load_state_dict(llama_state_dict_for_hf(model), strict=True)
    ids = random_ids(length=c.n_positions)
    with torch.no_grad():
        torch.testing.assert_close(model.logits(ids), hf(ids).logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_chunked_kv_cache_logits_equal_full_forward(flavor):
    model = randomize(tiny(flavor)).eval()
    ids = random_ids(batch=2, length=20)
    cache = model.new_kv_cache(2)
    with torch.no_grad():
        full = model.logits(ids)
        chunks, start = [], 0
        for size in (5, 1, 4, 7, 3):  # multi-token blocks after cached positions need the offset mask
            chunks.append(model.logits(ids[:, start:start + size], kv_cache=cache))
            start += size
    assert cache.pos == 20
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("flavor", FLAVORS)
def test_save_and_load_give_identical_logits(tmp_path, flavor, tied):
    model = randomize(tiny(flavor, tie_word_embeddings=tied)).eval()
    model.save_pretrained(tmp_path)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert ("lm_head.weight" in stored) == (not tied)
    loaded = LMForgeModel.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, GPT) and loaded.config == model.config
    assert (loaded.lm_head.weight is loaded.tok_embed.weight) == tied
    ids = random_ids()
    with torch.no_grad():
        assert torch.equal(loaded.logits(ids), model.logits(ids))


def test_corrupt_or_truncated_weights_raise_lmforge_error(tmp_path):
    tiny().save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(LMForgeError, match="corrupt or truncated"):
        LMForgeModel.from_pretrained(tmp_path)
    weights.write_bytes(b"\x00" * 64)
    with pytest.raises(LMForgeError, match="model.safetensors"):
        LMForgeModel.from_pretrained(tmp_path)


def test_from_pretrained_takes_a_run_directory(tmp_path):
    """As every verb does: a run directory means its best checkpoint (else its latest step)."""
    best = tiny()
    best.save_pretrained(tmp_path / "run" / "checkpoints" / "best")
    assert torch.equal(GPT.from_pretrained(tmp_path / "run").tok_embed.weight, best.tok_embed.weight)
    with pytest.raises(LMForgeError, match="holds no model"):
        LMForgeModel.from_pretrained(tmp_path)


def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path):
    """A model of NaN weights would serve, export or resume into NaN without saying why."""
    model = tiny()
    with torch.no_grad():
        model.blocks[0].mlp.fc.weight[0, :3] = torch.tensor([float("nan"), float("inf"), 1.0])
    model.save_pretrained(tmp_path)
    with pytest.raises(LMForgeError, match=r"non-finite weights \(NaN or inf\): 2 of [\d,]+ values of "
                                           r"'blocks.0.mlp.fc.weight'.*earlier checkpoint"):
        LMForgeModel.from_pretrained(tmp_path)
    with pytest.raises(LMForgeError, match="blocks.0.mlp.fc.weight"):  # a resume reads it the same way
        tiny().load_checkpoint_weights(tmp_path, "cpu")
    with torch.no_grad():  # huge but finite: their sum overflows, the weights are still whole
        model.blocks[0].mlp.fc.weight[0, :3] = 3e38
    model.save_pretrained(tmp_path)
    assert LMForgeModel.from_pretrained(tmp_path).blocks[0].mlp.fc.weight[0, 2] == 3e38


def test_weights_that_do_not_match_the_config_raise_lmforge_error(tmp_path):
    tiny().save_pretrained(tmp_path)
    config = yaml.safe_load((tmp_path / "config.yaml").read_text())
    config["n_embd"] = 64
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(LMForgeError, match="does not match"):
        LMForgeModel.from_pretrained(tmp_path)


# Totals with the default n_positions=1024; the same numbers are in the gpt.py docstring.
PRESET_COUNTS = {
    "tiny": (10_647_552, 30_339_456, 22_909_824),
    "small": (85_056_000, 124_439_808, 109_529_856),
    "medium": (302_311_424, 354_823_168, 336_380_928),
    "large": (1_208_602_624, 1_313_626_112, 1_279_887_360),
}


@pytest.mark.parametrize("preset", PRESET_COUNTS)
def test_presets_have_the_documented_parameter_counts(preset):
    non_embedding, gpt2_total, llama_total = PRESET_COUNTS[preset]
    with torch.device("meta"):
        gpt2 = GPT(dataclass_from_dict(GPTConfig, {"preset": preset, "vocab_size": 50257}, prefix="model"))
        llama = GPT(dataclass_from_dict(GPTConfig, {"preset": preset, "flavor": "llama", "vocab_size": 32000},
                                        prefix="model"))
    assert gpt2.num_parameters() == gpt2_total
    assert gpt2.num_parameters() - gpt2.num_parameters(exclude_embeddings=True) == 50257 * gpt2.config.n_embd + 1024 * gpt2.config.n_embd
    assert gpt2.num_parameters(exclude_embeddings=True) == non_embedding
    assert llama.num_parameters() == llama_total
    assert gpt2.tok_embed.weight.is_meta


def test_preset_fills_only_keys_not_set():
    config = dataclass_from_dict(GPTConfig, {"preset": "medium", "n_layer": 4, "vocab_size": 10}, prefix="model")
    assert (config.n_layer, config.n_embd, config.n_head) == (4, 1024, 16)


def test_from_preset_fills_the_sizes_in_python_as_a_config_does():
    config = GPTConfig.from_preset("medium", n_layer=4, vocab_size=10)
    assert (config.n_layer, config.n_embd, config.n_head, config.preset) == (4, 1024, 16, "medium")
    assert GPTConfig.from_preset("pipeline-tiny", vocab_size=10).flavor == "llama"
    with pytest.raises(LMForgeError, match="model.preset"):
        GPTConfig.from_preset("huge")


def test_flops_per_token_formula():
    with torch.device("meta"):
        model = GPT(dataclass_from_dict(GPTConfig, {"preset": "small", "vocab_size": 50257}, prefix="model"))
    expected = 6 * 85_056_000 + 12 * 12 * 768 * 1024 + 6 * 768 * 50257
    assert model.flops_per_token(1024) == expected


@pytest.mark.parametrize("values, key", [
    ({"n_embd": 30, "n_head": 4}, "model.n_embd"),
    ({"flavor": "gpt3"}, "model.flavor"),
    ({"preset": "huge"}, "model.preset"),
    ({"n_kv_head": 2, "n_head": 4, "n_embd": 32}, "model.n_kv_head"),
    ({"flavor": "llama", "n_kv_head": 3, "n_head": 4, "n_embd": 32}, "model.n_kv_head"),
    ({"n_layer": 0}, "model.n_layer"),
    ({"activation_function": "relu"}, "model.activation_function"),
])
def test_bad_config_raises_error_naming_the_key(values, key):
    with pytest.raises(LMForgeError, match=key.replace(".", r"\.")):
        dataclass_from_dict(GPTConfig, {"vocab_size": 10, **values}, prefix="model")


def test_vocab_size_zero_cannot_be_built():
    config = GPTConfig(n_embd=32, n_layer=1, n_head=4)  # valid as a config: the trainer fills vocab_size
    with pytest.raises(LMForgeError, match=r"model\.vocab_size"):
        build_model(config)


def test_sequence_longer_than_context_raises():
    model = tiny(n_positions=8)
    with pytest.raises(LMForgeError, match="n_positions"):
        model.logits(random_ids(length=9))


@pytest.mark.parametrize("flavor", FLAVORS)
def test_activation_checkpointing_gives_same_loss_and_grads(flavor, monkeypatch):
    ids = random_ids(batch=2, length=16)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}

    def loss_and_grads(model):
        torch.manual_seed(3)  # same dropout masks: checkpoint replays the RNG state on recompute
        loss, _ = model(batch)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    calls = []

    def counting_checkpoint(*args, **kwargs):
        calls.append(kwargs.get("use_reentrant"))
        return torch.utils.checkpoint.checkpoint(*args, **kwargs)

    monkeypatch.setattr(gpt_module, "checkpoint", counting_checkpoint)
    model = tiny(flavor, resid_pdrop=0.1, attn_pdrop=0.1).train()
    plain_loss, plain_grads = loss_and_grads(model)
    assert calls == []
    model.zero_grad(set_to_none=True)
    model.set_activation_checkpointing(True)
    ckpt_loss, ckpt_grads = loss_and_grads(model)
    assert calls == [False] * model.config.n_layer
    torch.testing.assert_close(ckpt_loss, plain_loss, rtol=0, atol=1e-6)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def attention_in_both_forms(flavor: str, x: torch.Tensor, positions: torch.Tensor, split, masked):
    """One attention layer of a random tiny model run on packed rows with each form of
    PackedDocuments: both forms' outputs, input gradients and weight gradients agree; returns the
    split form's outputs and a function that runs the layer on an unpacked sequence."""
    model = randomize(tiny(flavor)).train()
    attn = model.blocks[0].attn

    def rope(pos):
        return None if flavor == "gpt2" else model._rope(pos, torch.float32)

    outs = {}
    for name, docs in (("split", split), ("masked", masked)):
        h = x.clone().requires_grad_()
        model.zero_grad(set_to_none=True)
        out = attn(h, rope(positions), None, 0, docs)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs[name] = (out.detach(), h.grad, attn.qkv.weight.grad)
    for a, b in zip(outs["split"], outs["masked"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

    @torch.no_grad()
    def alone(seq: torch.Tensor) -> torch.Tensor:
        return attn(seq[None], rope(torch.arange(seq.shape[0])), None, 0, None)[0]

    return outs["split"][0], alone


@pytest.mark.parametrize("flavor", FLAVORS)
def test_packed_documents_split_and_masked_forms_agree(flavor):
    """Per-document SDPA calls (CPUs) and the block-diagonal mask (accelerators) compute the same
    attention and gradients, padding and a document that continues a row's numbering included."""
    # row 0 is one document, row 1 starts with the same number 0 (rows must not merge), row 2 ends in padding
    documents = torch.tensor([[0] * 20, [0] * 7 + [1] * 12 + [2], [0] * 5 + [1] * 9 + [-1] * 6])
    positions = torch.tensor([list(range(20)), [*range(7), *range(12), 0], [*range(5), *range(9), *range(6)]])
    split = gpt_module.PackedDocuments.split(documents)
    masked = gpt_module.PackedDocuments.masked(documents)
    assert split.lengths == [20, 7, 12, 1, 5, 9, 6] and masked.mask.shape == (3, 1, 20, 20)
    x = torch.randn(3, 20, 32)
    out, alone = attention_in_both_forms(flavor, x, positions, split, masked)
    # a document gives the same outputs inside its packed row as alone
    torch.testing.assert_close(out[1, 7:19], alone(x[1, 7:19]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_documents_with_a_shared_prefix_attend_to_it_in_both_forms(flavor):
    """A document with a prefix (prefix_ids) sees all of the prefix document and itself causally, in
    the split (CPU) and masked forms alike: the same outputs as the prefix and the document laid out
    as one sequence."""
    # row 0: prefix 0 (6 tokens) shared by documents 1 and 2, then a plain document 3; row 1: no prefixes
    documents = torch.tensor([[0] * 6 + [1] * 4 + [2] * 5 + [3] * 3 + [-1] * 2, [0] * 12 + [1] * 8])
    prefixes = torch.tensor([[-1] * 6 + [0] * 9 + [-1] * 5, [-1] * 20])
    positions = torch.tensor([[*range(6), *range(6, 10), *range(6, 11), *range(3), 0, 1], [*range(12), *range(8)]])
    split = gpt_module.PackedDocuments.split(documents, prefixes)
    masked = gpt_module.PackedDocuments.masked(documents, prefixes)
    assert split.lengths == [6, 4, 5, 3, 2, 12, 8] and split.prefixes == [-1, 0, 0, -1, -1, -1, -1]
    x = torch.randn(2, 20, 32)
    out, alone = attention_in_both_forms(flavor, x, positions, split, masked)
    whole = alone(torch.cat([x[0, :6], x[0, 10:15]]))  # document 2 = prefix + its own tokens, as one sequence
    torch.testing.assert_close(out[0, 10:15], whole[6:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[0, :6], whole[:6], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_hidden_states_at_kept_positions_equal_the_full_pass(flavor):
    """hidden_states(keep=...) is hidden_states()[keep], outputs and gradients: through the last block
    trimmed to the kept positions when they end each packed document (a prompt's reply, after a shared
    prefix or not), and through the full pass when they do not."""
    model = randomize(tiny(flavor)).train()
    model.config.resid_pdrop = model.config.attn_pdrop = 0.0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    # row 0: prefix document 0 shared by documents 1 and 2, then document 3; row 1: two documents, padding
    documents = torch.tensor([[0] * 6 + [1] * 4 + [2] * 5 + [3] * 3 + [-1] * 2, [0] * 12 + [1] * 6 + [-1] * 2])
    prefixes = torch.tensor([[-1] * 6 + [0] * 9 + [-1] * 5, [-1] * 20])
    positions = torch.tensor([[*range(6), *range(6, 10), *range(6, 11), *range(3), 0, 1],
                              [*range(12), *range(6), 0, 1]])
    ids = random_ids(batch=2, length=20)
    tails = torch.zeros(2, 20, dtype=torch.bool)
    tails[0, 8:10] = tails[0, 12:15] = tails[0, 17] = tails[1, 9:12] = tails[1, 14:18] = True
    scattered = tails.clone()
    scattered[1, 2] = True  # not at the end of its document: the full pass
    calls = []
    real = gpt_module.Block.forward_kept

    def counting(self, *args):
        calls.append(1)
        return real(self, *args)

    for keep, trimmed in ((tails, True), (scattered, False)):
        outs = {}
        for name in ("full", "kept"):
            model.zero_grad(set_to_none=True)
            calls.clear()
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(gpt_module.Block, "forward_kept", counting)
                hidden = model.hidden_states(ids, position_ids=positions, document_ids=documents, prefix_ids=prefixes,
                                             keep=keep if name == "kept" else None)
            picked = hidden if name == "kept" else hidden[keep]
            (picked * torch.linspace(-1, 1, picked.numel()).view_as(picked)).sum().backward()
            outs[name] = (picked.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, len(calls))
        assert outs["kept"][2] == (1 if trimmed else 0) and outs["full"][2] == 0
        torch.testing.assert_close(outs["kept"][0], outs["full"][0], rtol=1e-5, atol=1e-5)
        for n, g in outs["full"][1].items():
            torch.testing.assert_close(outs["kept"][1][n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_loss_ignores_masked_labels():
    model = tiny().eval()
    ids = random_ids(batch=1, length=10)
    labels = ids.clone()
    labels[:, 5:] = -100
    with torch.no_grad():
        loss, metrics = model({"input_ids": ids, "labels": labels})
        expected = torch.nn.functional.cross_entropy(model.logits(ids)[0, :5], ids[0, :5])
    assert metrics == {}
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_overfits_a_single_batch(flavor):
    model = tiny(flavor, n_embd=64).train()
    ids = random_ids(batch=4, length=17)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(100):
        loss, _ = model(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05


def test_attention_of_varying_shapes_runs_without_cudnn_on_cuda(monkeypatch):
    """Decode steps, prompts, scoring and packed documents change shape from call to call: on CUDA they run
    with cuDNN's SDPA backend switched off (it builds a plan per new shape); plain causal training keeps it.
    With a cache or without gradients one context covers all the blocks; packed documents take it per
    layer (so that checkpointed blocks recompute with the same backend)."""
    with gpt_module._varying_shape_attention("cuda"):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after
    with gpt_module._varying_shape_attention("cpu"):
        assert torch.backends.cuda.cudnn_sdp_enabled()

    seen = []
    real = gpt_module._varying_shape_attention
    monkeypatch.setattr(gpt_module, "_varying_shape_attention", lambda device_type: seen.append(device_type)
                        or real(device_type))
    model = randomize(tiny())
    ids = random_ids(batch=1, length=6)
    ids_batch = {"input_ids": ids, "labels": ids}
    model(ids_batch)[0].backward()
    assert seen == []  # plain causal training: fixed shapes
    with torch.no_grad():
        model(ids_batch)
        assert seen == ["cpu"]  # scoring, evaluation
        cache = model.new_kv_cache(1)
        model.logits(ids[:, :5], kv_cache=cache)
        model.logits(ids[:, 5:], kv_cache=cache)
    assert seen == ["cpu"] * 3
    seen.clear()
    documents = torch.tensor([[0, 0, 0, 1, 1, 1]])
    model.hidden_states(ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]), document_ids=documents)
    assert seen == ["cpu"] * model.config.n_layer


@pytest.mark.parametrize("extra,mixing_operators", [
    ({"flavor": "gpt2"}, False),
    ({"flavor": "gpt2", "lm_loss": "logits"}, False),
    ({"flavor": "llama", "mhc_enabled": True, "mhc_stream_dtype": "autocast"}, False),
    ({"flavor": "llama", "mhc_enabled": True, "mhc_stream_dtype": "autocast"}, True),
], ids=["gpt2", "gpt2-logits-loss", "llama-mhc-bf16-stream", "llama-mhc-mixing-operators"])
def test_the_training_forward_compiles_to_one_graph(extra, mixing_operators, monkeypatch):
    """A graph break inside the compiled training forward costs a second graph and the host between the two
    on every GPU step (one at the loss did, on an H200): the forward with its loss, under bf16 autocast, is
    one graph with no break, with either loss path and with mHC (its mixing as PyTorch ops, or as the
    operators CUDA uses)."""
    from lmforge.models.mhc import MHCLayer

    if mixing_operators:
        monkeypatch.setattr(MHCLayer, "uses_mixing_operators", lambda self, stream: True)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=2, **extra)).train()
    model.step_metrics = False
    ids = torch.randint(0, 300, (2, 32))
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(model)({"input_ids": ids, "labels": ids})
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_an_edited_config_is_named_with_its_file_and_the_fix(tmp_path, monkeypatch):
    """A checkpoint's config.yaml with a bad value names the file (not a key 'DIR/config.yaml.eos_token_id');
    an eos id outside the vocabulary is refused; a corrupt one relative to the working directory still names
    where earlier checkpoints are."""
    from lmforge.checkpoint import checkpoint_family

    tiny().save_pretrained(tmp_path / "m")
    config = yaml.safe_load((tmp_path / "m" / "config.yaml").read_text())
    for key, value, problem in (("eos_token_id", VOCAB + 5, f"model.eos_token_id={VOCAB + 5} is not a token of the "
                                                             f"model's vocabulary of {VOCAB}"),
                                ("eos_token_id", float("inf"), "config key 'eos_token_id' expects an integer, got inf"),
                                ("foo", 1, "unknown config key 'foo'")):
        (tmp_path / "m" / "config.yaml").write_text(yaml.safe_dump({**config, key: value}))
        with pytest.raises(LMForgeError) as e:
            LMForgeModel.from_pretrained(tmp_path / "m")
        assert f"{tmp_path / 'm' / 'config.yaml'} does not describe a valid gpt model ({problem}" in str(e.value)
        assert "the checkpoint was edited, is corrupt or was written by another lmforge version" in str(e.value)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m" / "config.yaml").write_text("vocab_size: 64\n")
    with pytest.raises(LMForgeError, match=r"names no model family .* use an earlier checkpoint of the run"):
        checkpoint_family("m", strict=True)
    run = tmp_path / "runs" / "x" / "checkpoints"
    tiny().save_pretrained(run / "step-000002")
    (run / "step-000002" / "config.yaml").write_text("vocab_size: [\n")
    monkeypatch.chdir(run)
    with pytest.raises(LMForgeError, match=f"(?s)not valid YAML .* use an earlier one in {run}$"):
        checkpoint_family("step-000002", strict=True)
