"""AdamW with 8-bit moments (``training.optimizer_states=8bit``): its rounding, its steps against PyTorch's
AdamW, and a run that saves, resumes and stops on a non-finite step with it."""

from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file

from lmforge.config import load_config
from lmforge.errors import LMForgeError
from lmforge.train import train
from lmforge.train.optim import AdamW8bit, block_size, dequantize, moment_bytes, quantize, state_bytes
from tests.train_helpers import losses, rows, write_recipe


@pytest.fixture
def data_dir(go_data):
    return go_data


def test_block_sizes_follow_rows():
    assert [block_size(n) for n in (32, 256, 768, 3072, 4100, 257, 31, 1)] == [32, 256, 256, 256, 205, None, None,
                                                                                None]


def test_rounding_to_nearest_is_within_the_grid_and_stochastic_rounding_is_exact_on_average():
    torch.manual_seed(0)
    x = (torch.rand(4, 3, 64) * 0.5 + 0.25) * torch.tensor([1.0, -1e-3, 1e3]).view(1, 3, 1)
    codes, scale = quantize(x, None)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and scale.shape == (4, 3)
    nearest = dequantize(codes, scale)
    assert ((nearest - x).abs() / x.abs()).max() <= 2 ** -4 + 1e-6  # half of e4m3's 2^-3 relative spacing
    assert torch.equal(nearest.abs().amax(-1), x.abs().amax(-1))  # each block's largest is exact
    generator = torch.Generator().manual_seed(1)
    draws = torch.stack([dequantize(*quantize(x, generator)) for _ in range(400)])
    assert ((draws - x).abs() / x.abs()).max() <= 2 ** -3 + 1e-6  # one grid step at most
    bias_stochastic = ((draws.mean(0) - x) / x.abs()).abs().mean()
    bias_nearest = ((nearest - x) / x.abs()).abs().mean()
    assert bias_stochastic < bias_nearest / 5  # unbiased: the average of the draws closes in on x
    assert torch.equal(dequantize(*quantize(torch.zeros(2, 1, 8), generator)), torch.zeros(2, 1, 8))


def _pair(weight_decay: float = 0.1):
    torch.manual_seed(3)
    a = torch.nn.Linear(128, 64)
    b = torch.nn.Linear(128, 64)
    b.load_state_dict(a.state_dict())
    kw = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": weight_decay}
    return a, torch.optim.AdamW(a.parameters(), **kw), b, AdamW8bit(b.parameters(), **kw)


@pytest.mark.parametrize("chunk", [None, 256])
def test_first_step_is_adamws_and_later_steps_follow_it(chunk, monkeypatch):
    """The first step starts from zero moments, which 8 bits hold exactly: it is AdamW's to float
    rounding. Later ones read back rounded moments and stay close to AdamW's weights. (chunk: a
    parameter stepped 2 rows at a time.)"""
    if chunk:
        monkeypatch.setattr("lmforge.train.optim._CHUNK_VALUES", chunk)
    ref_model, ref, model, opt = _pair()
    x, y = torch.randn(256, 128), torch.randn(256, 64)
    for step in range(1, 51):
        for m, o in ((ref_model, ref), (model, opt)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
        if step == 1:
            assert torch.allclose(model.weight, ref_model.weight, atol=1e-6, rtol=0)
    state = opt.state[model.weight]
    assert state["exp_avg"].dtype == torch.uint8 and state["exp_avg_scale"].shape == (64, 1)
    assert opt.state[model.bias]["exp_avg"].dtype == torch.float32  # a vector keeps fp32 moments
    moved = (ref_model.weight - _pair()[0].weight).abs().mean()
    assert (model.weight - ref_model.weight).abs().mean() < 0.05 * moved
    assert state_bytes(opt) < 0.3 * state_bytes(ref)


def test_found_inf_leaves_weights_and_moments_as_they_were(monkeypatch):
    monkeypatch.setattr("lmforge.train.optim._CHUNK_VALUES", 512)  # 4 rows at a time
    _, _, model, opt = _pair()
    x, y = torch.randn(16, 128), torch.randn(16, 64)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    before = ({k: v.clone() for k, v in model.state_dict().items()},
              {k: v.clone() for k, v in opt.state[model.weight].items()})
    opt.found_inf = torch.ones(())
    opt.step()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before[0].items())
    assert all(torch.equal(v, opt.state[model.weight][k]) for k, v in before[1].items() if k != "step")
    opt.found_inf = torch.zeros(())
    opt.step()
    assert not torch.equal(before[0]["weight"], model.weight)


def test_a_run_with_8bit_moments_resumes_exactly(tmp_path, data_dir):
    """20 steps straight vs 10 + resume + 10 (dropout on): identical losses and weights, so the moments'
    codes, scales and the rounding's random bits all come back from the checkpoint."""
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs",
                          training={"optimizer_states": "8bit", "eval_interval": 0})
    train(load_config(str(recipe), ["name=straight"]))
    straight, resumed = tmp_path / "runs" / "straight", tmp_path / "runs" / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    (resumed / "checkpoints" / "step-000010").symlink_to(straight / "checkpoints" / "step-000010")
    assert train(load_config(str(recipe), ["name=resumed"]), resume=True).step == 20
    a, b = losses(straight), losses(resumed)
    assert [a[s] for s in range(11, 21)] == [b[s] for s in range(11, 21)]
    wa = load_file(str(straight / "checkpoints" / "step-000020" / "model.safetensors"))
    wb = load_file(str(resumed / "checkpoints" / "step-000020" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # train/state_mb (weights + optimizer state) is smaller than an fp32 run's by what the moments' shapes say
    train(load_config(str(recipe), ["name=fp32", "training.optimizer_states=fp32", "training.max_steps=2"]))
    params = list(load_file(str(straight / "checkpoints" / "step-000020" / "model.safetensors")).values())
    saved = (moment_bytes(params, "fp32") - moment_bytes(params, "8bit")) / 2**20
    assert moment_bytes(params, "8bit") < 0.8 * moment_bytes(params, "fp32")  # a tiny model: many vectors stay fp32
    state_mb = {name: next(r["train/state_mb"] for r in rows(tmp_path / "runs" / name) if "train/state_mb" in r)
                for name in ("fp32", "straight")}
    assert state_mb["fp32"] - state_mb["straight"] == pytest.approx(saved, rel=1e-9)


def test_a_checkpoint_of_the_other_states_is_refused_on_resume(tmp_path, data_dir, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs",
                          training={"max_steps": 4, "save_interval": 2, "eval_interval": 0})
    train(load_config(str(recipe)))
    with pytest.raises(LMForgeError, match=r"does not fit this run.*another training.optimizer_states"):
        train(load_config(str(recipe), ["training.optimizer_states=8bit", "training.max_steps=6"]), resume=True)


def test_trainer_spelling_and_bad_settings(tmp_path, data_dir):
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs")
    assert load_config(str(recipe), ["training.optim=adamw_8bit"]).training.optimizer_states == "8bit"
    assert load_config(str(recipe), ["training.optim=adamw_torch"]).training.optimizer_states == "fp32"
    with pytest.raises(LMForgeError, match="training.optim=paged_adamw_8bit.*training.optimizer_states.*keep one"):
        load_config(str(recipe), ["training.optim=paged_adamw_8bit", "training.optimizer_states=fp32"])
    with pytest.raises(LMForgeError, match="optim=adamw_8bit is training.optimizer_states=8bit"):
        load_config(str(recipe), ["training.optim=sgd"])
    with pytest.raises(LMForgeError, match="optimizer_states must be fp32 or 8bit, got '4bit'"):
        load_config(str(recipe), ["training.optimizer_states=4bit"])
    with pytest.raises(LMForgeError, match="optimizer_states=8bit.*training.parallel=fsdp shards"):
        load_config(str(recipe), ["training.optimizer_states=8bit", "training.parallel=fsdp"])


def test_seed_002s_optimizer_type_names_the_8bit_states(tmp_path, data_dir):
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs")
    cfg = load_config(str(recipe), ["training.optimizer.type=adamw_8bit", "training.optimizer.lr=1e-3"])
    assert (cfg.training.optimizer_states, cfg.training.lr) == ("8bit", 1e-3)
    with pytest.raises(LMForgeError, match="optimizer.type='lion' is not available; use adamw .or adamw_8bit"):
        load_config(str(recipe), ["training.optimizer.type=lion"])


def test_rounding_bits_come_from_seed_step_and_parameter_not_the_global_generator():
    """What keeps DDP's replicas identical (each process steps its own copy) and a resume exact: the same
    (seed, step, parameter) draws the same bits whatever torch's global generator did before."""
    def stepped(global_seed: int, seed: int):
        _, _, model, opt = _pair()
        opt.seed = seed
        x, y = torch.randn(16, 128, generator=torch.Generator().manual_seed(5)), torch.zeros(16, 64)
        for _ in range(3):
            torch.manual_seed(global_seed)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return opt.state[model.weight]["exp_avg"]

    assert torch.equal(stepped(1, seed=0), stepped(2, seed=0))
    assert not torch.equal(stepped(1, seed=0), stepped(1, seed=1))
