"""No file lmforge reads can run code: training state without pickle, and every verb on planted payloads.

The payloads create a marker file when unpickled (or when YAML's python tags are honoured). Each file of
a real checkpoint other than the weights is replaced by one, and then every verb that reads checkpoints
runs on it: the marker must never appear, and each verb either works or stops with lmforge's one-line
error (exit code 2), never a traceback.
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import math
import pickle
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.cli import main
from lmforge.errors import LMForgeError
from lmforge.checkpoint import (CHECKSUMS_FILE, LEGACY_FILES, OPTIMIZER_FILE, RNG_FILE, checksum_mismatch,
                                convert_legacy, load_training_file, write_checksums)
from lmforge.safe_state import load_legacy_torch_file, load_state, save_state
from tests.train_helpers import PEAK_FLOPS, write_recipe


class _Payload:
    """Unpickling this opens (so creates) ``marker``: what a crafted checkpoint would do, harmlessly."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.open, (self.marker, "w")


def _pickle_payload(marker: Path) -> bytes:
    return pickle.dumps({"optimizer": _Payload(marker)})


def _torch_payload(path: Path, marker: Path) -> None:
    """A legacy ``.pt`` file (torch's zip format) whose pickle carries the payload."""
    torch.save({"per_rank": [_Payload(marker)], "optimizer": _Payload(marker)}, path)


def _yaml_payload(marker: Path) -> str:
    return f"!!python/object/apply:builtins.open [{str(marker)!r}, w]\n"


# ---- the format itself --------------------------------------------------------------------------
def test_training_state_round_trips_every_kind_of_value(tmp_path):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))], lr=0.1)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    opt.step()
    state = {
        "optimizer": opt.state_dict(),  # int keys, tuples (betas), 0-d step tensors, None (foreach/fused)
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        "odd": [float("nan"), math.inf, -math.inf, True, None, "text", 2**40, (1, (2.5, "x"))],
        "bf16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "view": torch.arange(10)[2:5],  # a view of a larger tensor: saved on its own
        "empty": torch.zeros(0, 4),
        1: "an int key", 2.5: "a float key", None: "a None key",
    }
    state["alias"] = state["bf16"]  # two references to one tensor
    save_state(tmp_path / "s.safetensors", state)
    back = load_state(tmp_path / "s.safetensors", "state")

    assert set(back) == set(state)
    assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert isinstance(back["optimizer"]["param_groups"][0]["betas"], tuple)
    for idx, moments in state["optimizer"]["state"].items():
        for name, value in moments.items():
            assert torch.equal(back["optimizer"]["state"][idx][name], value), (idx, name)
    assert back["rng"]["python"] == state["rng"]["python"]
    np_back, np_ref = back["rng"]["numpy"], state["rng"]["numpy"]
    assert np_back[0] == np_ref[0] and np.array_equal(np_back[1], np_ref[1]) and np_back[1].dtype == np.uint32
    assert np_back[2:] == np_ref[2:]
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"])
    assert math.isnan(back["odd"][0]) and back["odd"][1:] == state["odd"][1:]
    assert back["bf16"].dtype == torch.bfloat16 and torch.equal(back["bf16"], state["bf16"])
    assert torch.equal(back["alias"], state["bf16"]) and torch.equal(back["view"], torch.tensor([2, 3, 4]))
    assert back["empty"].shape == (0, 4)
    assert back[1] == "an int key" and back[2.5] == "a float key" and back[None] == "a None key"

    # restoring the RNG state from the file continues the same random streams
    random.setstate(back["rng"]["python"]), np.random.set_state(back["rng"]["numpy"])
    torch.set_rng_state(back["rng"]["torch"])
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    random.setstate(state["rng"]["python"]), np.random.set_state(state["rng"]["numpy"])
    torch.set_rng_state(state["rng"]["torch"])
    assert a == (random.random(), np.random.rand(), torch.rand(1).item())


def test_values_that_are_not_data_are_refused_when_saving(tmp_path):
    with pytest.raises(TypeError, match=r"state\['bad'\].*_Payload"):
        save_state(tmp_path / "s.safetensors", {"bad": _Payload(tmp_path / "m")})
    with pytest.raises(TypeError, match="dtype object"):
        save_state(tmp_path / "s.safetensors", {"bad": np.array([object()])})


def test_damaged_or_foreign_state_files_are_clear_errors(tmp_path):
    from safetensors.torch import save_file

    good = tmp_path / "good.safetensors"
    save_state(good, {"w": torch.ones(3)})
    cases = {
        "truncated": (good.read_bytes()[:40], "cannot read"),
        "pickle": (_pickle_payload(tmp_path / "marker"), "cannot read"),
        "empty": (b"", "cannot read"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(content)
        with pytest.raises(LMForgeError, match=message):
            load_state(path, "optimizer state")
    plain = tmp_path / "plain.safetensors"  # a safetensors file of something else (e.g. model weights)
    save_file({"w": torch.ones(2)}, str(plain))
    with pytest.raises(LMForgeError, match="not an lmforge training-state file"):
        load_state(plain, "optimizer state")
    forged = tmp_path / "forged.safetensors"  # a structure that names things the decoder does not know
    save_file({"0": torch.ones(1)}, str(forged), metadata={
        "format": "lmforge-state", "version": "1", "structure": '{"py": "os.system"}'})
    with pytest.raises(LMForgeError, match="unexpected node"):
        load_state(forged, "optimizer state")
    objects = tmp_path / "objects.safetensors"  # an object-dtype numpy array would unpickle its items
    save_file({"0": torch.ones(1, dtype=torch.uint8)}, str(objects), metadata={
        "format": "lmforge-state", "version": "1", "structure": '{"nd": "0", "dtype": "|O", "shape": [1]}'})
    with pytest.raises(LMForgeError, match="not a numeric type"):
        load_state(objects, "optimizer state")
    assert not (tmp_path / "marker").exists()


def test_legacy_pickles_load_through_the_restricted_loader_and_convert(tmp_path):
    """Checkpoints of lmforge <= 0.1: plain optimizer/RNG pickles still resume; payloads are refused."""
    ckpt = tmp_path / "step-000002"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text("{}")
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    opt = {"optimizer": {"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.ones(3)}},
                         "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0]}]},
           "scaler": {}, "model_state": {}}
    torch.save(opt, ckpt / "optimizer.pt")  # exactly what lmforge 0.1 wrote
    torch.save({"per_rank": [rng]}, ckpt / "rng_state.pt")

    loaded = load_training_file(ckpt, OPTIMIZER_FILE, "optimizer state")
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], torch.ones(3))
    assert np.array_equal(load_training_file(ckpt, RNG_FILE, "rng")["per_rank"][0]["numpy"][1], rng["numpy"][1])

    assert main(["checkpoint", "convert", str(tmp_path)]) == 0
    assert sorted(p.name for p in ckpt.iterdir()) == sorted([OPTIMIZER_FILE, RNG_FILE, "trainer_state.json",
                                                             CHECKSUMS_FILE])  # the new files' checksums
    assert checksum_mismatch(ckpt) is None
    again = load_training_file(ckpt, OPTIMIZER_FILE, "optimizer state")
    assert again["optimizer"]["param_groups"] == opt["optimizer"]["param_groups"]
    assert load_state(ckpt / RNG_FILE, "rng")["per_rank"][0]["python"] == rng["python"]
    assert convert_legacy(ckpt) == []  # nothing left to convert

    marker = tmp_path / "marker"
    for name in LEGACY_FILES.values():
        evil = tmp_path / name
        _torch_payload(evil, marker)
        with pytest.raises(LMForgeError, match="refused to load.*training.init_from"):
            load_legacy_torch_file(evil, name)
    bad = tmp_path / "bad" / "step-000004"
    bad.mkdir(parents=True)
    (bad / "trainer_state.json").write_text("{}")
    _torch_payload(bad / "optimizer.pt", marker)
    assert main(["checkpoint", "convert", str(bad)]) == 2
    assert (bad / "optimizer.pt").is_file() and not (bad / OPTIMIZER_FILE).exists()  # nothing was lost
    assert not marker.exists()
    assert main(["checkpoint", "convert", str(tmp_path / "nowhere")]) == 2
    # not an archive torch.save wrote (damaged, or a bare pickle): named so, and never unpickled
    (bad / "optimizer.pt").write_bytes(b"\x80\x04garbage")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no loader notes either
        with pytest.raises(LMForgeError, match="not a file torch.save wrote .*damaged or truncated"):
            load_legacy_torch_file(bad / "optimizer.pt", "optimizer state")
    (bad / "optimizer.pt").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(LMForgeError, match="not a file torch.save wrote"):
        load_legacy_torch_file(bad / "optimizer.pt", "optimizer state")
    assert not marker.exists()


# ---- every verb on a checkpoint with a payload in each of its files -----------------------------
@pytest.fixture(scope="module")
def lm_run(tmp_path_factory, go_data) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("safety")
    data = go_data
    recipe = write_recipe(base / "recipe.yaml", data, base / "runs",
                          training={"max_steps": 2, "save_interval": 2, "eval_interval": 2})
    assert main(["train", str(recipe)]) == 0
    return base / "runs" / "t", data


def _run(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err
    return code, err


def _plant(ckpt: Path, name: str, marker: Path) -> None:
    """Replace ``name`` by a payload; a pickled legacy file replaces its safe successor."""
    path = ckpt / name
    if name in LEGACY_FILES.values():
        new = next(k for k, v in LEGACY_FILES.items() if v == name)
        (ckpt / new).unlink()
        _torch_payload(path, marker)
    elif name.endswith(".yaml"):
        path.write_text(_yaml_payload(marker))
    else:
        path.write_bytes(_pickle_payload(marker))


def _verbs(recipe: Path, run: Path, ckpt: Path, data: Path, out: Path) -> dict[str, list[str]]:
    return {
        "resume": ["train", str(recipe), f"out_dir={run.parent}", "training.max_steps=3", "--resume", str(ckpt)],
        "init_from": ["train", str(recipe), f"out_dir={out}", "name=fine", "training.max_steps=1",
                      f"training.init_from={ckpt}"],
        "eval": ["eval", str(ckpt), "--data", str(data), "--max-tokens", "256", "--device", "cpu"],
        "generate": ["generate", str(ckpt), "--prompt", "func ", "--max-new-tokens", "2", "--device", "cpu"],
        "export_hf": ["export", str(ckpt), "--format", "hf", "--out", str(out / "hf")],
        "export_gguf": ["export", str(ckpt), "--format", "gguf", "--out", str(out / "m.gguf")],
    }


def _non_weight_files(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir() if p.is_file() and p.name != "model.safetensors")


def test_every_verb_on_a_checkpoint_with_a_payload_in_each_file(lm_run, tmp_path, capsys):
    from lmforge.serve.server import load_engine

    run, data = lm_run
    pristine = run / "checkpoints" / "step-000002"
    names = _non_weight_files(pristine)
    assert {OPTIMIZER_FILE, RNG_FILE, "trainer_state.json", "config.yaml", "run_config.yaml",
            "tokenizer.json"} <= set(names)
    outcomes, problems = {}, []
    for name in [*names, *LEGACY_FILES.values()]:
        case = tmp_path / name
        shutil.copytree(run, case / "run")
        ckpt = case / "run" / "checkpoints" / "step-000002"
        marker = case / "marker"
        _plant(ckpt, name, marker)
        for verb, argv in _verbs(run.parent.parent / "recipe.yaml", case / "run", ckpt, data, case / "out").items():
            try:
                outcomes[name, verb] = _run(argv, capsys)
            except BaseException as e:  # noqa: BLE001 - a traceback is what this test looks for
                outcomes[name, verb] = (-1, repr(e))
        try:  # what `lmforge serve` loads before it binds its port
            engine, _, _ = load_engine(ckpt, device="cpu", precision="fp32", background=False)
            engine.close()
            outcomes[name, "serve"] = 0, ""
        except LMForgeError as e:
            outcomes[name, "serve"] = 2, f"lmforge: error: {e}"
        except Exception as e:  # noqa: BLE001
            outcomes[name, "serve"] = (-1, repr(e))
        if marker.exists():
            problems.append(f"a payload in {name} ran")
    for (name, verb), (code, err) in outcomes.items():
        if code not in (0, 2) or (code == 2 and not err.startswith("lmforge: error:")):
            problems.append(f"{verb} with a payload in {name}: exit {code}: {err.strip()[:300]}")
    assert problems == []
    # resume reads the training state: a payload in any of it stops the resume, with an error
    for name in (OPTIMIZER_FILE, RNG_FILE, "trainer_state.json", *LEGACY_FILES.values()):
        assert outcomes[name, "resume"][0] == 2, name
    # the weights and config are intact there, so everything that only needs the model works from them
    for verb in ("init_from", "eval", "generate", "export_hf", "export_gguf", "serve"):
        assert outcomes[OPTIMIZER_FILE, verb][0] == 0, (verb, outcomes[OPTIMIZER_FILE, verb])
    for verb in ("init_from", "eval", "generate", "serve"):
        assert outcomes["config.yaml", verb][0] == 2, verb  # the model cannot be built without its config
    assert outcomes["config.yaml", "resume"][0] == 0  # resume builds the model from the recipe instead


def test_serve_process_on_a_checkpoint_full_of_payloads(lm_run, tmp_path):
    """The real `lmforge serve` on a checkpoint whose every non-weight file holds a payload."""
    import subprocess

    from tests.train_helpers import lmforge_cmd

    run, _ = lm_run
    ckpt = tmp_path / "ckpt"
    shutil.copytree(run / "checkpoints" / "step-000002", ckpt)
    marker = tmp_path / "marker"
    for name in _non_weight_files(ckpt):
        _plant(ckpt, name, marker)
    proc = subprocess.run(lmforge_cmd("serve", str(ckpt), "--port", "0", "--device", "cpu"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.startswith("lmforge: error:"), proc.stderr
    assert "Traceback" not in proc.stderr and not marker.exists()


@pytest.fixture(scope="module")
def puzzle_run(tmp_path_factory) -> Path:
    from lmforge.config import load_config
    from lmforge.recipes.puzzles.sudoku import build_sudoku_dataset, generate_puzzles
    from lmforge.train import train

    base = tmp_path_factory.mktemp("puzzle")
    puzzles = generate_puzzles(4, 30, 36, seed=3, show_progress=False, workers=1)
    build_sudoku_dataset(base / "data", puzzles, puzzles, num_aug=0, seed=0, show_progress=False)
    words = [f"data.path={base / 'data'}", f"out_dir={base}", "name=trm", "model.hidden_size=32",
             "model.num_heads=2", "model.expansion=2", "model.halt_max_steps=2", "model.L_layers=1",
             "model.H_cycles=1", "model.L_cycles=1", "model.ema_decay=0.9", "training.max_steps=2",
             "training.global_batch_size=4", "training.precision=fp32", "training.device=cpu",
             "training.eval_interval=2", "training.save_interval=2", f"training.peak_flops={PEAK_FLOPS}",
             "logging.progress_bar=false",
             "logging.tensorboard=false"]
    train(load_config("trm_sudoku", words))
    (base / "words.txt").write_text("\n".join(words))
    return base


def test_puzzle_verbs_on_a_checkpoint_with_a_payload_in_each_file(puzzle_run, tmp_path, capsys):
    """A puzzle model's extra training state (its raw weights under EMA) travels the same safe way."""
    pristine = puzzle_run / "trm" / "checkpoints" / "step-000002"
    assert "raw_weights" in load_state(pristine / OPTIMIZER_FILE, "optimizer")["model_state"]
    words = (puzzle_run / "words.txt").read_text().split("\n")
    puzzle = "1" + "." * 80
    for name in [*_non_weight_files(pristine), *LEGACY_FILES.values()]:
        case = tmp_path / name
        shutil.copytree(puzzle_run / "trm", case / "trm")
        ckpt = case / "trm" / "checkpoints" / "step-000002"
        marker = case / "marker"
        _plant(ckpt, name, marker)
        resume = ["train", "trm_sudoku", *[w.replace(str(puzzle_run), str(case)) if w.startswith("out_dir") else w
                                            for w in words], "training.max_steps=3", "--resume", str(ckpt)]
        for verb, argv in {"solve": ["solve", str(ckpt), "--puzzle", puzzle, "--device", "cpu"],
                           "resume": resume}.items():
            code, err = _run(argv, capsys)
            assert code in (0, 1, 2), (name, verb, code, err)  # solve: 1 = answered, not a valid solution
            if code == 2:
                assert err.startswith("lmforge: error:") and "Traceback" not in err, (name, verb, err)
            if verb == "resume" and name in (OPTIMIZER_FILE, RNG_FILE, "trainer_state.json",
                                             *LEGACY_FILES.values()):
                assert code == 2, name
        assert not marker.exists(), f"a payload in {name} ran"


def test_well_formed_state_files_of_the_wrong_shape_are_refused_on_resume(lm_run, tmp_path, capsys):
    """Files that parse but hold the wrong structure (damaged, or crafted to corrupt a run) stop the resume
    with lmforge's error before anything uses them."""
    from safetensors.torch import save_file

    run, data = lm_run
    pristine = run / "checkpoints" / "step-000002"
    opt = load_state(pristine / OPTIMIZER_FILE, "optimizer")
    rng = load_state(pristine / RNG_FILE, "rng")
    first = next(iter(opt["optimizer"]["state"]))
    wrong_shape = {**opt, "optimizer": {**opt["optimizer"], "state": {
        **opt["optimizer"]["state"], first: {**opt["optimizer"]["state"][first], "exp_avg": torch.zeros(7)}}}}
    unknown_param = {**opt, "optimizer": {**opt["optimizer"], "state": {
        10**6: opt["optimizer"]["state"][first]}}}
    cases = {
        "a list": (OPTIMIZER_FILE, [1, 2]),
        "moments of another shape": (OPTIMIZER_FILE, wrong_shape),
        "a parameter that does not exist": (OPTIMIZER_FILE, unknown_param),
        "per_rank a number": (RNG_FILE, {"per_rank": 5}),
        "a python RNG state that is text": (RNG_FILE, {"per_rank": [{**rng["per_rank"][0], "python": "x"}]}),
        "a torch RNG state of the wrong size": (RNG_FILE, {"per_rank": [{**rng["per_rank"][0],
                                                                          "torch": torch.zeros(3, dtype=torch.uint8)}]}),
    }
    recipe = run.parent.parent / "recipe.yaml"
    for i, (what, (name, content)) in enumerate(cases.items()):
        case = tmp_path / str(i)
        shutil.copytree(run, case)
        save_state(case / "checkpoints" / "step-000002" / name, content)
        write_checksums(case / "checkpoints" / "step-000002")  # crafted with its checksums: the content is refused
        code = main(["train", str(recipe), f"out_dir={tmp_path}", f"name={i}", "training.max_steps=3", "--resume",
                     str(case / "checkpoints" / "step-000002")])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("lmforge: error:") and "does not fit this run" in err, (what, err)
    # NaN moments would turn the first update's weights into NaN: refused, naming the tensor
    nan_moment = opt["optimizer"]["state"][first]["exp_avg_sq"].clone()
    nan_moment.view(-1)[1] = float("nan")
    poisoned = {**opt, "optimizer": {**opt["optimizer"], "state": {
        **opt["optimizer"]["state"], first: {**opt["optimizer"]["state"][first], "exp_avg_sq": nan_moment}}}}
    shutil.copytree(run, tmp_path / "nan")
    save_state(tmp_path / "nan" / "checkpoints" / "step-000002" / OPTIMIZER_FILE, poisoned)
    write_checksums(tmp_path / "nan" / "checkpoints" / "step-000002")  # as a run whose moments went NaN writes it
    code = main(["train", str(recipe), f"out_dir={tmp_path}", "name=nan", "training.max_steps=3", "--resume",
                 str(tmp_path / "nan" / "checkpoints" / "step-000002")])
    err = capsys.readouterr().err
    assert code == 2 and f"non-finite optimizer state (NaN or inf): 1 of {nan_moment.numel():,} values of " \
        f"\"parameter {first}'s exp_avg_sq\"" in err, err
    # a structure naming one tensor twice would alias two moments: refused when reading
    aliased = tmp_path / "aliased.safetensors"
    save_file({"0": torch.zeros(2)}, str(aliased), metadata={
        "format": "lmforge-state", "version": "1", "structure": '{"l": [{"t": "0"}, {"t": "0"}]}'})
    with pytest.raises(LMForgeError, match="referenced twice"):
        load_state(aliased, "optimizer state")
    extra = tmp_path / "extra.safetensors"
    save_file({"0": torch.zeros(2), "1": torch.zeros(2)}, str(extra), metadata={
        "format": "lmforge-state", "version": "1", "structure": '{"t": "0"}'})
    with pytest.raises(LMForgeError, match="does not name"):
        load_state(extra, "optimizer state")


def _no_unpickling(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a pickle was read")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)


def test_a_sharded_checkpoint_is_read_without_pickle_and_consolidates(lm_run, tmp_path, monkeypatch, capsys):
    """A sharded checkpoint (torch.distributed.checkpoint's safetensors shards + shards.json) of an
    ordinary one, written on one process: every reader gets the same tensors back without unpickling
    anything (torch's DCP reader, and lmforge's own, which puts the full tensors together for the verbs),
    ``lmforge checkpoint consolidate`` turns it back into the ordinary files, and damage is a clear error."""
    from lmforge.checkpoint import SHARDS_DIR, SHARDS_FILE, consolidate, read_shards_manifest
    from lmforge.models.base import LMForgeModel
    from lmforge.train import fsdp

    run, _ = lm_run
    ordinary = run / "checkpoints" / "step-000002"
    saved = load_training_file(ordinary, OPTIMIZER_FILE, "optimizer state")

    def model_and_optimizer(directory: Path):
        model = LMForgeModel.from_pretrained(directory)
        optimizer = torch.optim.AdamW(model.param_groups(0.1, 1e-3))
        return model, optimizer

    model, optimizer = model_and_optimizer(ordinary)
    optimizer.load_state_dict(saved["optimizer"])
    sharded = tmp_path / "sharded"
    shutil.copytree(ordinary, sharded)
    (sharded / "model.safetensors").unlink()
    (sharded / OPTIMIZER_FILE).unlink()
    fsdp.save_sharded(model, optimizer, sharded, {"scaler": {}, "model_state": {}}, world_size=1, is_main=True)
    write_checksums(sharded)  # as publishing a checkpoint does
    assert (sharded / SHARDS_FILE).is_file() and len(list((sharded / SHARDS_DIR).iterdir())) == 1
    for f in sharded.rglob("*"):
        assert not f.is_file() or f.read_bytes()[:1] != b"\x80", f  # no pickle (DCP's .metadata is one)

    def same_optimizer_state(a: dict, b: dict) -> None:
        assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
        for i, entries in a["state"].items():
            assert entries.keys() == b["state"][i].keys()
            for name, value in entries.items():
                assert torch.equal(value, b["state"][i][name]), (i, name)

    want = model.state_dict()
    _no_unpickling(monkeypatch)
    # lmforge's reader: what every verb loads, and resume on one process / under DDP
    got = LMForgeModel.from_pretrained(sharded).state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    same_optimizer_state(load_training_file(sharded, OPTIMIZER_FILE, "optimizer state")["optimizer"], saved["optimizer"])
    assert main(["generate", str(sharded), "--prompt", "func ", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    # torch's DCP reader (HuggingFaceStorageReader): what resume under FSDP runs on each process
    fresh, fresh_optimizer = model_and_optimizer(ordinary)
    for p in fresh.parameters():
        p.data.zero_()
    loaded = fsdp.load_sharded(fresh, fresh_optimizer, sharded)
    assert all(torch.equal(v, want[k]) for k, v in fresh.state_dict().items())
    same_optimizer_state(loaded["optimizer"], saved["optimizer"])
    # consolidated: the ordinary files again, the same tensors
    assert main(["checkpoint", "consolidate", str(sharded), str(tmp_path / "whole")]) == 0
    whole = tmp_path / "whole"
    assert not (whole / SHARDS_FILE).exists() and not (whole / SHARDS_DIR).exists()
    from safetensors.torch import load_file

    consolidated = load_file(str(whole / "model.safetensors"))
    assert consolidated.keys() == load_file(str(ordinary / "model.safetensors")).keys()
    assert all(torch.equal(v, want[k]) for k, v in consolidated.items())
    same_optimizer_state(load_state(whole / OPTIMIZER_FILE, "optimizer state")["optimizer"], saved["optimizer"])
    # its checksums are of its own files (the copied record named the shards' and the removed files)
    listed = json.loads((whole / CHECKSUMS_FILE).read_text())["files"]
    assert set(listed) == {"model.safetensors", OPTIMIZER_FILE, RNG_FILE} and checksum_mismatch(whole) is None
    monkeypatch.undo()

    # what pipelines and the harness cache fingerprint: the shards, so a rewritten shard changes both
    from lmforge.eval.harness import checkpoint_fingerprint
    from lmforge.pipeline.state import HashCache
    from lmforge.tokenizer import Tokenizer

    shard = next((sharded / SHARDS_DIR).iterdir())
    tokenizer = Tokenizer.load(sharded)
    before = HashCache().model(sharded), checkpoint_fingerprint(sharded, tokenizer, 32)
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    after = HashCache().model(sharded), checkpoint_fingerprint(sharded, tokenizer, 32)
    assert before[0] != after[0] and before[1] != after[1]
    shard.write_bytes(data)

    # damage: a shard cut short, a shard missing, a model of other shapes, not a checkpoint at all
    shard.write_bytes(data[:-100])
    with pytest.raises(LMForgeError, match=f"cannot read the shard {shard}.*use an earlier checkpoint"):
        read_shards_manifest(sharded)
    with pytest.raises(LMForgeError, match=f"{shard} does not match the sha256 .* the model is damaged"):
        LMForgeModel.from_pretrained(sharded)  # its checksum, before safetensors reads the header
    with pytest.raises(LMForgeError, match=f"{shard} does not match the sha256 .* consolidate an earlier one"):
        consolidate(sharded, tmp_path / "again")  # checked against its checksums before it is read
    shard.unlink()
    with pytest.raises(LMForgeError, match="cannot read the shard .*damaged or incomplete"):
        load_training_file(sharded, OPTIMIZER_FILE, "optimizer state")
    shard.write_bytes(data)
    wider = LMForgeModel.from_pretrained(ordinary)
    config = dataclasses.replace(wider.config, n_embd=2 * wider.config.n_embd)
    other = type(wider)(config)
    with pytest.raises(LMForgeError, match=f"the checkpoint {sharded} does not fit this model .*resume with the config"):
        fsdp.load_sharded(other, torch.optim.AdamW(other.param_groups(0.1, 1e-3)), sharded)
    assert main(["checkpoint", "consolidate", str(tmp_path / "whole")]) == 2
    assert "is an ordinary checkpoint already" in capsys.readouterr().err
    weights_only = tmp_path / "best"  # as a run's best/: the model's files, no trainer state
    weights_only.mkdir()
    for name in ("config.yaml", "model.safetensors"):
        shutil.copy(whole / name, weights_only / name)
    assert main(["checkpoint", "consolidate", str(weights_only)]) == 2
    assert "is an ordinary checkpoint already" in capsys.readouterr().err
    (tmp_path / "nothing").mkdir()
    assert main(["checkpoint", "consolidate", str(tmp_path / "nothing")]) == 2
    assert "holds no sharded checkpoint" in capsys.readouterr().err
    assert main(["checkpoint", "consolidate", str(tmp_path / "not-there")]) == 2
    assert "not-there does not exist" in capsys.readouterr().err
    (tmp_path / "rows.jsonl").write_text("{}\n")  # a probe's: "does not exist" was said of a file
    assert main(["checkpoint", "consolidate", str(tmp_path / "rows.jsonl")]) == 2
    assert "rows.jsonl is a file, not a checkpoint directory" in capsys.readouterr().err
    before = sorted(p.relative_to(sharded) for p in sharded.rglob("*"))
    assert main(["checkpoint", "consolidate", str(sharded), str(sharded / "inner")]) == 2  # was written inside
    assert "lies inside" in capsys.readouterr().err
    assert sorted(p.relative_to(sharded) for p in sharded.rglob("*")) == before


def test_shards_that_overlap_and_leave_a_gap_are_refused(tmp_path):
    """Two pieces over the same half of a tensor hold as many values as the tensor: the count alone
    would accept them and leave the other half unset."""
    import json

    from safetensors.torch import save_file

    from lmforge.checkpoint import SHARDS_DIR, SHARDS_FILE, SHARDS_FORMAT, SHARDS_VERSION, read_shards_manifest

    (tmp_path / SHARDS_DIR).mkdir()
    offsets = {"DCP_SHARDING_INFO": json.dumps({"model.w": {"saved_offsets": [0]}})}
    for name in ("a.safetensors", "b.safetensors"):
        save_file({"model.w": torch.ones(2)}, str(tmp_path / SHARDS_DIR / name), metadata=offsets)
    manifest = {"format": SHARDS_FORMAT, "version": SHARDS_VERSION, "tensors": {"model.w": [4]},
                "files": ["a.safetensors", "b.safetensors"]}
    (tmp_path / SHARDS_FILE).write_text(json.dumps(manifest))
    with pytest.raises(LMForgeError, match="a shard file is missing or damaged"):
        read_shards_manifest(tmp_path)
    # the same pieces at offsets 0 and 2 cover the tensor exactly once: accepted
    save_file({"model.w": torch.ones(2)}, str(tmp_path / SHARDS_DIR / "b.safetensors"),
              metadata={"DCP_SHARDING_INFO": json.dumps({"model.w": {"saved_offsets": [2]}})})
    assert read_shards_manifest(tmp_path)["tensors"] == {"model.w": [4]}
