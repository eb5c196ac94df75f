"""AdamW with 8-bit moments (``training.optimizer_states=8bit``): its rounding, its steps against PyTorch's
AdamW, and a run that saves, resumes and stops on a non-finite step with it."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from lmforge.config import load_config
from lmforge.errors import LMForgeError
from lmforge.train import train
from lmforge.train.optim import (AdamW8bit, block_size, dequantize, make_adamw, moment_bytes, quantize, random_bits,
                                 rounding_key, state_bytes)
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
    index = torch.arange(x.numel(), dtype=torch.int32).view(x.shape)
    # 200 steps' bits, each of the two sets (first moment's, second's)
    bits = [b for step in range(200) for b in random_bits(index, rounding_key(0, step, 0))]
    draws = torch.stack([dequantize(*quantize(x, b)) for b in bits])
    assert ((draws - x).abs() / x.abs()).max() <= 2 ** -3 + 1e-6  # one grid step at most
    bias_stochastic = ((draws.mean(0) - x) / x.abs()).abs().mean()
    bias_nearest = ((nearest - x) / x.abs()).abs().mean()
    assert bias_stochastic < bias_nearest / 5  # unbiased: the average of the draws closes in on x
    assert torch.equal(dequantize(*quantize(torch.zeros(2, 1, 8), bits[0][:2, :1, :8])), torch.zeros(2, 1, 8))
    # a moment decayed to float's subnormals (a weight without gradients for a few hundred steps), and a huge one
    extremes = torch.tensor([[[1e-39, -3e-40, 0.0, 1e-41]], [[3e30, -1e30, 1.0, 2e30]]])
    for b in (None, bits[0][:2, :1, :4]):
        codes, scale = quantize(extremes, b)
        assert torch.isfinite(dequantize(codes, scale)).all() and not ((codes & 0x7F) == 0x7F).any()  # no NaN code


def _correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.corrcoef(torch.stack([a.double(), b.double()]))[0, 1].item()


def test_random_bits_are_uniform_and_unrelated_between_neighbours_and_between_the_moments():
    n = 1 << 18
    first, second = random_bits(torch.arange(n, dtype=torch.int32), rounding_key(3, 10, 2))
    for bits in (first, second):
        assert bits.dtype == torch.int32 and bits.min() >= 0 and bits.max() < 1 << 20
        ones = torch.stack([(bits >> k) & 1 for k in range(20)]).double().mean(1)
        assert (ones - 0.5).abs().max() < 5 * 0.5 / n ** 0.5  # each bit a fair coin (5 sigma)
        for lag in (1, 2, 3, 64, 256):  # values side by side, in a block, in the next rows
            assert abs(_correlation(bits[:-lag], bits[lag:])) < 5 / n ** 0.5
        # neighbours' top 4 bits fill a 16 x 16 grid evenly (chi-square of 255 degrees: 255 +- 23)
        cells = torch.bincount((bits[:-1] >> 16) * 16 + (bits[1:] >> 16), minlength=256).double()
        expected = (n - 1) / 256
        assert ((cells - expected) ** 2 / expected).sum() < 350
    assert abs(_correlation(first, second)) < 5 / n ** 0.5  # the two sets share 8 bits: 2^-12


def test_rounding_bits_depend_on_seed_step_and_parameter():
    keys = {rounding_key(seed, step, index) for seed in (0, 1) for step in (1, 2) for index in (0, 1)}
    assert len(keys) == 8 and all(-2 ** 31 <= k < 2 ** 31 for k in keys)
    index = torch.arange(4096, dtype=torch.int32)
    base = random_bits(index, rounding_key(0, 1, 0))[0]
    for other in (rounding_key(1, 1, 0), rounding_key(0, 2, 0), rounding_key(0, 1, 1)):
        assert (random_bits(index, other)[0] != base).float().mean() > 0.99
    # In a step: two parameters alike in values and gradients, but not in their place, round apart
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.zeros(64, 128))
    b.data.copy_(a)
    opt = AdamW8bit([a, b], lr=1e-2)
    for _ in range(3):
        a.grad = torch.randn(64, 128)
        b.grad = a.grad.clone()
        opt.step()
    assert not torch.equal(opt.state[a]["exp_avg"], opt.state[b]["exp_avg"])
    assert not torch.equal(opt.state[a]["exp_avg_sq_sqrt"], opt.state[b]["exp_avg_sq_sqrt"])


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
        monkeypatch.setattr("lmforge.train.optim._CPU_CHUNK_VALUES", chunk)
    ref_model, ref, model, opt = _pair()
    x, y = torch.randn(256, 128), torch.randn(256, 64)
    for step in range(1, 51):
        for m, o in ((ref_model, ref), (model, opt)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
        if step == 1:
            assert torch.allclose(model.weight, ref_model.weight, atol=1e-6, rtol=0)
        if step <= 2:  # the bias (fp32 moments, the fused kernel fed its step count): AdamW's, bias corrections too
            assert torch.allclose(model.bias, ref_model.bias, atol=1e-6 if step == 1 else 1e-5, rtol=0)
    state = opt.state[model.weight]
    assert state["exp_avg"].dtype == torch.uint8 and state["exp_avg_scale"].shape == (64, 1)
    assert opt.state[model.bias]["exp_avg"].dtype == torch.float32  # a vector keeps fp32 moments
    moved = (ref_model.weight - _pair()[0].weight).abs().mean()
    assert (model.weight - ref_model.weight).abs().mean() < 0.05 * moved
    assert state_bytes(opt) < 0.3 * state_bytes(ref)


def test_found_inf_leaves_weights_and_moments_as_they_were(monkeypatch):
    monkeypatch.setattr("lmforge.train.optim._CPU_CHUNK_VALUES", 512)  # 4 rows at a time
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


def _states(opt: AdamW8bit) -> list[torch.Tensor]:
    return [v.clone() for s in opt.state.values() for k, v in sorted(s.items()) if k != "step"]


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int, lr: float = 1e-2) -> None:
    """``n`` steps on fixed data, the learning rate changing at each (as a schedule changes it)."""
    x, y = torch.randn(32, 128, generator=torch.Generator().manual_seed(1)), torch.randn(32, 64)
    for step in range(n):
        for g in opt.param_groups:
            g["lr"] = lr * (step + 1) / n
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def test_rows_stepped_together_never_change_a_step(monkeypatch):
    """The random bits follow each value's place in its parameter: 2 rows at a time or the whole parameter
    gives the same weights, codes and scales, bit for bit."""
    results = []
    for chunk in (1 << 22, 256):
        monkeypatch.setattr("lmforge.train.optim._CPU_CHUNK_VALUES", chunk)
        _, _, model, opt = _pair()
        _steps(model, opt, 5)
        results.append((model.weight.clone(), _states(opt)))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))


def _mlp() -> torch.nn.Module:
    torch.manual_seed(4)
    return torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))


@pytest.fixture(scope="module")
def eager_and_compiled():
    """A small MLP (two 8-bit matrices, two fp32 biases) stepped 6 times by AdamW8bit eagerly and compiled, the
    learning rate changing at every step, with the training loop's found_inf flag; the unique graphs compiled."""
    from torch._dynamo.utils import counters

    counters.clear()  # (another test's compile of the same shapes in this process would hide a recompile)
    graphs = counters["stats"]["unique_graphs"]
    runs = []
    for compile in (False, True):
        model = _mlp()
        opt = AdamW8bit(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, compile=compile)
        opt.found_inf = torch.zeros(())
        _steps(model, opt, 6)
        runs.append((model, opt))
    return runs, counters["stats"]["unique_graphs"] - graphs


def test_the_compiled_step_is_the_eager_one(eager_and_compiled):
    """Compiled (one graph over every 8-bit parameter), the step computes what the eager one does: the same
    random bits, the same codes but where a float rounding differs right at a rounding boundary."""
    ((eager, eager_opt), (compiled, compiled_opt)), _ = eager_and_compiled
    assert compiled_opt._compiled is not None  # it did not fall back to eager
    for name, p in eager.named_parameters():
        q = dict(compiled.named_parameters())[name]
        assert (p - q).abs().max() < 1e-3 and (p - q).abs().mean() < 1e-6, name  # a code a step apart at most
        for key, value in eager_opt.state[p].items():
            other = compiled_opt.state[q][key]
            if value.dtype == torch.uint8:
                assert (value != other).float().mean() < 1e-3, (name, key)
            else:
                torch.testing.assert_close(other, value, rtol=1e-3, atol=1e-9)
    # the state a checkpoint holds, as before: names, dtypes, shapes
    assert {k: (v.dtype, tuple(v.shape)) for k, v in compiled_opt.state[compiled[0].weight].items()} == {
        "step": (torch.int64, ()), "exp_avg": (torch.uint8, (128, 128)), "exp_avg_scale": (torch.float32, (128, 1)),
        "exp_avg_sq_sqrt": (torch.uint8, (128, 128)), "exp_avg_sq_sqrt_scale": (torch.float32, (128, 1))}
    assert {k: v.dtype for k, v in compiled_opt.state[compiled[0].bias].items()} == {
        "step": torch.int64, "exp_avg": torch.float32, "exp_avg_sq": torch.float32}


def test_a_learning_rate_schedule_does_not_recompile_the_step(eager_and_compiled):
    """The learning rate (a new one at each of the 6 steps), bias corrections and rounding keys go in as data
    on the device: one graph for the whole run."""
    assert eager_and_compiled[1] == 1


def test_found_inf_leaves_weights_and_moments_as_they_were_compiled():
    model = _mlp()
    opt = AdamW8bit(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, compile=True)
    opt.found_inf = torch.zeros(())
    _steps(model, opt, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}, _states(opt)
    opt.found_inf.fill_(1)  # in place, as the training loop sets it
    _steps(model, opt, 2)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before[0].items())
    assert all(torch.equal(a, b) for a, b in zip(before[1], _states(opt), strict=True))
    opt.found_inf.fill_(0)
    _steps(model, opt, 1)
    assert not torch.equal(before[0]["0.weight"], model[0].weight)
    assert opt._compiled is not None


def test_the_compiled_step_resumes_exactly():
    """6 steps straight, or 3 + a new optimizer from the first's state_dict + 3: the same weights and state, bit
    for bit (the step counts, hence bias corrections and random bits, come back with the state)."""
    runs = []
    for resumed in (False, True):
        model = _mlp()
        opt = AdamW8bit(model.parameters(), lr=1e-2, compile=True)
        opt.found_inf = torch.zeros(())
        _steps(model, opt, 3)
        if resumed:
            saved = copy.deepcopy(opt.state_dict())
            opt = AdamW8bit(model.parameters(), lr=1e-2, compile=True)
            opt.found_inf = torch.zeros(())
            opt.load_state_dict(saved)
        _steps(model, opt, 3)
        runs.append(([p.clone() for p in model.parameters()], _states(opt)))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1], strict=True))


def test_a_state_keyed_by_parameter_names_loads_as_saved():
    """Under FSDP, torch.distributed.checkpoint hands load_state_dict the state keyed by parameter names (and
    the groups' "params" as names): the codes and scales go back to their parameters as saved."""
    _, _, model, opt = _pair()
    _steps(model, opt, 2)
    saved = opt.state_dict()
    names = [n for n, _ in model.named_parameters()]
    by_name = {"state": {names[i]: v for i, v in saved["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]}
    fresh = AdamW8bit(model.parameters(), lr=1e-2)
    fresh.load_state_dict(copy.deepcopy(by_name))
    assert fresh.state[model.weight]["exp_avg"].dtype == torch.uint8
    assert all(torch.equal(a, b) for a, b in zip(_states(opt), _states(fresh), strict=True))


def test_the_eager_step_honours_a_found_inf_on_the_device():
    """On a GPU the eager step masks its writes with the flag (on the CPU it reads it): that path, run here."""
    from lmforge.train.optim import _step_8bit

    _, _, model, opt = _pair()
    _steps(model, opt, 1)
    state = opt.state[model.weight]
    shape = (*state["exp_avg_scale"].shape, -1)

    def step(skip):
        p, codes = model.weight.detach().clone(), {k: v.clone() for k, v in state.items()}
        grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(2))
        hyper = torch.tensor([[0.999, -1e-2, 1e-8, 0.1, 0.05]])
        _step_8bit([p.view(shape)], [grad.view(shape)], [codes["exp_avg"].view(shape)], [codes["exp_avg_scale"]],
                   [codes["exp_avg_sq_sqrt"].view(shape)], [codes["exp_avg_sq_sqrt_scale"]], hyper,
                   torch.tensor([rounding_key(0, 2, 0)], dtype=torch.int32), skip, 256)
        return [p, *codes.values()]

    unmasked = step(None)
    assert all(torch.equal(a, b) for a, b in zip(step(torch.tensor(False)), unmasked, strict=True))
    before = [model.weight, *state.values()]
    assert all(torch.equal(a, b) for a, b in zip(step(torch.tensor(True)), before, strict=True))
    assert not torch.equal(unmasked[0], model.weight)


def test_a_compile_that_fails_falls_back_to_the_eager_step(monkeypatch):
    """Where Inductor cannot compile (no C++ compiler, no Triton, ...) the step warns once and runs eagerly."""
    compile = torch.compile

    def no_backend(gm, example_inputs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile(fn, **{**kw, "backend": no_backend}))
    _, _, model, opt = _pair()
    opt = AdamW8bit(model.parameters(), lr=1e-2, compile=True)
    opt.found_inf = torch.zeros(())
    with pytest.warns(UserWarning, match="AdamW8bit steps eagerly from now on: compiling its step failed"):
        _steps(model, opt, 3)
    assert opt._compiled is None
    _, _, eager_model, eager_opt = _pair()
    eager_opt = AdamW8bit(eager_model.parameters(), lr=1e-2)
    _steps(eager_model, eager_opt, 3)
    assert torch.equal(model.weight, eager_model.weight)
    assert all(torch.equal(a, b) for a, b in zip(_states(opt), _states(eager_opt), strict=True))


def test_make_adamw_compiles_the_8bit_step_when_the_run_compiles(tmp_path, data_dir):
    recipe = write_recipe(tmp_path / "r.yaml", data_dir, tmp_path / "runs", training={"optimizer_states": "8bit"})
    params = [{"params": [torch.nn.Parameter(torch.zeros(64, 64))]}]
    for compile in (False, True):
        cfg = load_config(str(recipe), [f"training.compile={str(compile).lower()}"])
        assert (make_adamw(params, cfg, torch.device("cpu"))._compiled is not None) == compile


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
    for parallel in ("fsdp", "hsdp"):  # each process keeps its rows' 8-bit moments (tests/test_fsdp.py runs them)
        cfg = load_config(str(recipe), ["training.optimizer_states=8bit", f"training.parallel={parallel}"])
        assert (cfg.training.optimizer_states, cfg.training.parallel) == ("8bit", parallel)


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


def test_sharded_8bit_moments_equal_one_process_and_stay_with_offloaded_shards(tmp_path):
    """Over three processes (FSDP2 on gloo: rows split unevenly, a 4-row weight leaving one process none):
    the codes, scales and weights one process writes, bit for bit, after steps, after loading a single
    process's full state by names and after a torch.distributed.checkpoint round trip; and offloaded shards
    (a CUDA mesh, shards in CPU memory) keep their moments in CPU memory (tests/fsdp_8bit_worker.py)."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).parent.parent
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
                           str(repo / "tests" / "fsdp_8bit_worker.py"), str(tmp_path / "checkpoint")],
                          cwd=repo, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("the same codes, scales and weights as one process; offloaded moments in CPU memory") \
        == 3, done.stdout
