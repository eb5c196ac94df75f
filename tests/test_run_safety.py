"""Run-directory safety: one `lmforge train` per run directory, damaged files named as damaged, output paths that
are files, out-of-range token ids, an interrupted replacement of best/ and damaged metrics lines."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lmforge import checkpoint as ck
from lmforge.config import load_config
from lmforge.errors import LMForgeError
from lmforge.train import _check_same_tokenizer, train
from lmforge.train.loggers import _truncate_after
from tests.train_helpers import REPO, lmforge_cmd, run, write_recipe


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _copy_run(trained_run, tmp_path: Path) -> tuple[Path, Path]:
    """A writable copy of the session's trained run as tmp_path/runs/t, and a recipe that resumes it."""
    run_dir = tmp_path / "runs" / "t"
    shutil.copytree(trained_run.run_dir, run_dir)
    data = Path(load_config(str(run_dir / "config.yaml")).data.path)
    recipe = write_recipe(tmp_path / "r.yaml", data, tmp_path / "runs", training={"max_steps": 30, "eval_interval": 15})
    return run_dir, recipe


# ---- 1. one run per run directory -------------------------------------------------------------------------
def test_a_run_directory_held_by_another_run_is_refused_and_left_untouched(tmp_path, go_data):
    recipe = write_recipe(tmp_path / "r.yaml", go_data, tmp_path / "runs", training={"max_steps": 2})
    run_dir = tmp_path / "runs" / "t"
    run_dir.mkdir(parents=True)
    with ck.RunDirLock(run_dir):  # the other run: the lock is per open file, so this process counts as another
        with pytest.raises(LMForgeError) as e:
            train(load_config(str(recipe)))
        assert f"pid {os.getpid()}" in str(e.value) and "name=NEW" in str(e.value)
        assert sorted(p.name for p in run_dir.iterdir()) == [ck.RUN_LOCK_FILE]  # no metrics, config or checkpoint
    result = train(load_config(str(recipe)))  # released: the run goes ahead, and releases it in turn
    assert result.step == 2
    ck.RunDirLock(run_dir).acquire().release()


def test_a_second_lmforge_train_process_is_refused_while_the_first_runs(tmp_path, go_data):
    """Two real processes: the holder is a Python process that locks the run directory as `lmforge train` does."""
    recipe = write_recipe(tmp_path / "r.yaml", go_data, tmp_path / "runs", training={"max_steps": 2})
    run_dir = tmp_path / "runs" / "t"
    run_dir.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from pathlib import Path; from lmforge import "
                               f"checkpoint as ck; ck.RunDirLock(Path({str(run_dir)!r})).acquire(); print('held', "
                               "flush=True); sys.stdin.read()"], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        result = run(lmforge_cmd("train", str(recipe)), cwd=REPO)
        assert result.returncode != 0
        assert f"another `lmforge train` (pid {holder.pid} on" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr and not (run_dir / "metrics.jsonl").exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert ck.run_in_progress(run_dir) is False  # the OS released the lock when the holder exited


def test_clean_partial_under_the_lock_removes_every_temporary_checkpoint(tmp_path):
    """Under the run's lock no other run writes there: a temporary directory whose PID is alive again (a
    container restarted, PIDs reused) is a dead writer's all the same."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / f".tmp-step-000004-{os.getpid()}").mkdir()  # a live PID
    (root / f".tmp-step-000006-{_dead_pid()}").mkdir()
    (root / ".tmp-step-000008-shards").mkdir()
    ck.clean_partial(root)
    assert list(root.iterdir()) == []


def test_a_filesystem_without_file_locks_falls_back_to_the_pid_in_the_lock_file(tmp_path, monkeypatch, capsys):
    import errno
    import fcntl
    import socket

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    lock = ck.RunDirLock(tmp_path).acquire()  # nobody holds it: taken, with a note
    assert "does not take file locks" in capsys.readouterr().err
    lock.release()
    (tmp_path / ck.RUN_LOCK_FILE).write_text(f"pid {os.getppid()} on {socket.gethostname()}")  # a live holder
    with pytest.raises(LMForgeError, match=f"another `lmforge train` .pid {os.getppid()}"):
        ck.RunDirLock(tmp_path).acquire()
    assert ck.run_in_progress(tmp_path)
    (tmp_path / ck.RUN_LOCK_FILE).write_text(f"pid {_dead_pid()} on {socket.gethostname()}")
    assert not ck.run_in_progress(tmp_path)


# ---- 2. a damaged tokenizer.json ------------------------------------------------------------------------
def test_a_truncated_checkpoint_tokenizer_is_named_damaged_not_a_different_tokenizer(tmp_path, trained_run):
    run_dir, _ = _copy_run(trained_run, tmp_path)
    step = run_dir / "checkpoints" / "step-000030"
    data_tok = Path(load_config(str(run_dir / "config.yaml")).data.path) / "tokenizer.json"
    text = (step / "tokenizer.json").read_bytes()
    (step / "tokenizer.json").write_bytes(text[: len(text) // 2])
    with pytest.raises(LMForgeError) as e:
        _check_same_tokenizer(data_tok, step)
    msg = str(e.value)
    assert f"{step / 'tokenizer.json'} is damaged" in msg and str(run_dir / "tokenizer" / "tokenizer.json") in msg
    assert "tokenized with" not in msg


def test_loading_a_truncated_checkpoint_tokenizer_says_copy_it_not_retrain(tmp_path, trained_run):
    from lmforge.tokenizer import Tokenizer

    run_dir, _ = _copy_run(trained_run, tmp_path)
    best = run_dir / "checkpoints" / "best"
    text = (best / "tokenizer.json").read_bytes()
    (best / "tokenizer.json").write_bytes(text[: len(text) // 2])
    with pytest.raises(LMForgeError) as e:
        Tokenizer.load(best)
    msg = str(e.value)
    assert "is damaged" in msg and str(run_dir / "tokenizer" / "tokenizer.json") in msg
    assert "lmforge tokenizer train" not in msg


# ---- 3. output paths that are files ---------------------------------------------------------------------
@pytest.mark.parametrize("case", ["out_dir_is_a_file", "run_dir_is_a_file"])
def test_a_run_directory_that_is_a_file_is_refused_before_the_data_is_read(tmp_path, case):
    afile = tmp_path / "afile"
    afile.write_text("")
    out_dir = afile if case == "out_dir_is_a_file" else tmp_path / "runs"
    if case == "run_dir_is_a_file":
        out_dir.mkdir()
        (out_dir / "t").write_text("")
    # data that does not exist: had the data been read first, that would be the error
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "no-data", out_dir, training={"max_steps": 2})
    with pytest.raises(LMForgeError, match="is a file, not a directory") as e:
        train(load_config(str(recipe)))
    assert str(afile if case == "out_dir_is_a_file" else out_dir / "t") in str(e.value)


def test_a_gguf_out_inside_a_file_is_refused(tmp_path, trained_run):
    from lmforge.export.gguf import export_gguf

    (tmp_path / "afile").write_text("")
    with pytest.raises(LMForgeError, match="afile is a file, not a directory"):
        export_gguf(trained_run.run_dir, tmp_path / "afile" / "x.gguf")


def test_a_data_prepare_out_inside_a_file_is_refused(tmp_path, go_data):
    from lmforge.data.prepare import prepare_data

    (tmp_path / "afile").write_text("")
    with pytest.raises(LMForgeError, match="afile is a file, not a directory"):
        prepare_data([go_data.parent / "corpus"], tmp_path / "afile" / "sub", go_data / "tokenizer.json")


# ---- 4. an out-of-range token id in a shard -------------------------------------------------------------
def test_an_out_of_range_token_id_in_a_shard_is_named_before_the_batch_is_used(tmp_path, go_data):
    from lmforge.data.loader import PackedLoader, TokenDataset, read_meta

    data = tmp_path / "data"
    shutil.copytree(go_data, data)
    meta = read_meta(data)
    shard = data / meta["splits"]["train"]["shards"][0]["file"]
    ids = np.fromfile(shard, dtype=meta["dtype"])
    ids[:] = 65000  # every window of this shard holds it
    ids.tofile(shard)
    loader = PackedLoader(TokenDataset(data, "train"), seq_len=32, micro_batch_size=4)
    with pytest.raises(LMForgeError) as e:
        loader.next_batch()
    assert f"shard {shard} has token id 65000" in str(e.value) and "lmforge data prepare" in str(e.value)
    ok = PackedLoader(TokenDataset(go_data, "train"), seq_len=32, micro_batch_size=4)
    assert int(ok.next_batch()["input_ids"].max()) < meta["vocab_size"]


# ---- 5. RunConfig.save on a full disk -------------------------------------------------------------------
def test_a_full_disk_while_saving_the_run_config_names_it_and_leaves_nothing(tmp_path, go_data, monkeypatch):
    recipe = write_recipe(tmp_path / "r.yaml", go_data, tmp_path / "runs")
    cfg = load_config(str(recipe))
    out = tmp_path / "run" / "config.yaml"
    real = Path.write_text

    def full(self, *a, **k):
        real(self, "")  # the file is created, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(LMForgeError, match=f"no space left on device while writing {out}"):
        cfg.save(out)
    monkeypatch.undo()
    assert list(out.parent.iterdir()) == []


# ---- 6. best/ after a kill between its two renames --------------------------------------------------------
def test_an_interrupted_replacement_of_best_is_put_back_not_replaced_by_the_latest_step(tmp_path, trained_run):
    run_dir, _ = _copy_run(trained_run, tmp_path)
    root = run_dir / "checkpoints"
    os.rename(root / "best", root / ".old-best")
    with ck.RunDirLock(run_dir):  # a run is replacing it right now: said so, nothing moved
        with pytest.raises(LMForgeError, match="is being replaced"):
            ck.resolve_model_dir(run_dir)
    assert ck.resolve_model_dir(run_dir) == root / "best"
    assert (root / "best" / ck.WEIGHTS_FILE).is_file() and not (root / ".old-best").exists()
    os.rename(root / "best", root / ".old-best")
    assert ck.resolve_model_dir(root / "best") == root / "best"  # best named directly


# ---- 7. a damaged latest checkpoint ---------------------------------------------------------------------
def test_a_damaged_latest_checkpoint_names_the_resume_that_works_and_that_resume_works(tmp_path, trained_run):
    run_dir, recipe = _copy_run(trained_run, tmp_path)
    root = run_dir / "checkpoints"
    (root / "step-000030" / ck.STATE_FILE).write_text("{not json")
    with pytest.raises(LMForgeError) as e:
        train(load_config(str(recipe)), resume=True)
    assert f"--resume {root / 'step-000020'}`" in str(e.value)
    result = train(load_config(str(recipe)), resume=str(root / "step-000020"))
    assert result.step == 30 and ck.read_trainer_state(root / "step-000030")["step"] == 30
    assert (root / "damaged-step-000030" / ck.STATE_FILE).read_text() == "{not json"  # kept, not deleted
    # damaged again at the same step: both kept
    (root / "step-000030" / ck.STATE_FILE).write_text("{again")
    assert train(load_config(str(recipe)), resume=str(root / "step-000020")).step == 30
    assert (root / "damaged-step-000030.2" / ck.STATE_FILE).read_text() == "{again"
    assert (root / "damaged-step-000030" / ck.STATE_FILE).read_text() == "{not json"


def _flip_last_byte(path: Path) -> None:
    """A changed byte inside the tensor data (the header still reads): what a failing disk or a bad copy leaves."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))


def _replaced_while_read(calls: list):
    """A ``checksum_mismatch`` during whose first call a run replaces the directory, as write_best does (the new
    directory renamed over the old one), so that first reading sees a mismatch; later calls check for real."""
    real = ck.checksum_mismatch

    def replaced_meanwhile(directory, **kw):
        calls.append(directory)
        if len(calls) == 1:
            shutil.copytree(directory, directory.with_name("new"))
            shutil.rmtree(directory)
            os.rename(directory.with_name("new"), directory)
            return f"{directory / ck.WEIGHTS_FILE} does not match the sha256 written with it"
        return real(directory, **kw)
    return replaced_meanwhile


def test_a_checkpoint_whose_weights_changed_after_saving_is_named_and_the_earlier_one_resumes(tmp_path, trained_run,
                                                                                                capsys):
    from lmforge.cli import main

    run_dir, recipe = _copy_run(trained_run, tmp_path)
    root = run_dir / "checkpoints"
    listed = json.loads((root / "step-000030" / ck.CHECKSUMS_FILE).read_text())["files"]
    assert {"model.safetensors", "optimizer.safetensors", "rng_state.safetensors"} <= set(listed)
    assert main(["checkpoint", "verify", str(run_dir)]) == 0
    assert capsys.readouterr().out.count(": ok") == len(ck.list_checkpoints(root)) + 1  # the steps and best/
    weights = root / "step-000030" / ck.WEIGHTS_FILE
    _flip_last_byte(weights)
    assert ck.checkpoint_damage(root / "step-000030") is not None  # headers read: only the checksum finds it
    before = weights.read_bytes()
    with pytest.raises(LMForgeError) as e:
        train(load_config(str(recipe)), resume=True)
    assert f"{weights} does not match the sha256 written with it" in str(e.value)
    assert f"--resume {root / 'step-000020'}`" in str(e.value)
    assert weights.read_bytes() == before  # nothing written over it
    assert main(["checkpoint", "verify", str(run_dir)]) == 1
    out = capsys.readouterr().out
    assert f"{root / 'step-000030'}: DAMAGED: {weights} does not match" in out and f"{root / 'step-000020'}: ok" in out
    # not a checkpoint: a clear error; a best/ that a run replaced while it was read: checked again, not "damaged"
    assert main(["checkpoint", "verify", str(tmp_path / "nowhere")]) == 2
    assert main(["checkpoint", "verify", str(weights)]) == 2
    assert "does not exist" in capsys.readouterr().err
    calls = []
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ck, "checksum_mismatch", _replaced_while_read(calls))
        assert main(["checkpoint", "verify", str(root / "best")]) == 0
    assert capsys.readouterr().out == f"{root / 'best'}: ok\n" and len(calls) == 2
    result = train(load_config(str(recipe)), resume=str(root / "step-000020"))  # the damaged one is set aside
    assert result.step == 30 and (root / "damaged-step-000030" / ck.WEIGHTS_FILE).read_bytes() == before
    assert ck.checksum_mismatch(root / "step-000030") is None  # written again, with its checksums


def test_checksums_cover_shards_and_name_a_missing_file_or_an_unreadable_record(tmp_path):
    from safetensors.torch import save_file
    import torch

    ckpt = tmp_path / "step-000001"
    (ckpt / ck.SHARDS_DIR).mkdir(parents=True)
    save_file({"a": torch.ones(3)}, str(ckpt / ck.SHARDS_DIR / "shard-00001.safetensors"))
    ck.write_checksums(ckpt)
    assert ck.checksum_mismatch(ckpt) is None
    (ckpt / ck.SHARDS_DIR / "shard-00001.safetensors").unlink()
    assert "shard-00001.safetensors is missing" in ck.checksum_mismatch(ckpt)
    (ckpt / ck.CHECKSUMS_FILE).write_text("{not json")
    assert "is unreadable" in ck.checksum_mismatch(ckpt)


def test_resume_from_an_earlier_checkpoint_is_still_refused_when_the_newer_one_reads(tmp_path, trained_run):
    run_dir, recipe = _copy_run(trained_run, tmp_path)
    root = run_dir / "checkpoints"
    with pytest.raises(LMForgeError, match="newer than step-000020 whose files read"):
        train(load_config(str(recipe)), resume=str(root / "step-000020"))
    assert (root / "step-000030").is_dir() and not (root / "damaged-step-000030").exists()


# ---- 8. a damaged line in metrics.jsonl -----------------------------------------------------------------
def test_a_damaged_metrics_line_in_the_middle_is_an_error_a_partial_last_line_is_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "train/loss": 1.0}) for s in range(1, 6)]
    path.write_text("\n".join(rows[:3]) + "\n" + rows[3][:10] + "\n" + rows[4] + "\n")
    before = path.read_text()
    with pytest.raises(LMForgeError, match=f"{path}:4 is damaged"):
        _truncate_after(path, 5)
    assert path.read_text() == before  # nothing lost
    path.write_text("\n".join(rows[:4]) + "\n" + rows[4][:10])  # a write cut off by a crash
    _truncate_after(path, 3)
    assert path.read_text() == "\n".join(rows[:3]) + "\n"
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_a_checkpoint_file_that_cannot_be_read_is_named_not_a_traceback(tmp_path, monkeypatch):
    """A failing disk's read error while checking the checksums: the file and the error, as a reason."""
    from safetensors.torch import save_file
    import torch

    save_file({"a": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    ck.write_checksums(tmp_path)

    def failing_read(path):
        raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr(ck, "sha256_file", failing_read)
    assert ck.checksum_mismatch(tmp_path) == f"{tmp_path / 'model.safetensors'} cannot be read (Input/output error)"
    with pytest.raises(OSError, match="Input/output error"):  # as a write fault, not a JSON TypeError
        ck.write_checksums(tmp_path)


# ---- checksums: what a deleted record, a changed model and several processes do ---------------------------------
def test_a_deleted_checksums_file_is_damage_where_the_trainer_state_says_it_was_written(tmp_path, trained_run,
                                                                                        capsys):
    from lmforge.cli import main

    run_dir, recipe = _copy_run(trained_run, tmp_path)
    root = run_dir / "checkpoints"
    (root / "step-000030" / ck.CHECKSUMS_FILE).unlink()
    with pytest.raises(LMForgeError, match=f"{root / 'step-000030' / ck.CHECKSUMS_FILE} is missing .* "
                                           f"--resume {root / 'step-000020'}"):
        train(load_config(str(recipe)), resume=True)
    # an older lmforge's checkpoint wrote neither the record nor its mention: unchecked, as before
    state = json.loads((root / "step-000020" / ck.STATE_FILE).read_text())
    del state["checksums"]
    (root / "step-000020" / ck.STATE_FILE).write_text(json.dumps(state))
    (root / "step-000020" / ck.CHECKSUMS_FILE).unlink()
    (root / "best" / ck.CHECKSUMS_FILE).unlink()  # best/ has no trainer state to say it had one
    assert main(["checkpoint", "verify", str(run_dir)]) == 1
    out = capsys.readouterr().out
    assert f"{root / 'step-000030'}: DAMAGED: {root / 'step-000030' / ck.CHECKSUMS_FILE} is missing" in out
    assert f"{root / 'step-000020'}: unchecked" in out and f"{root / 'best'}: unchecked" in out


def test_a_model_whose_weights_changed_is_refused_where_it_is_loaded_and_its_optimizer_state_is_not_read(
        tmp_path, trained_run, capsys):
    from lmforge.cli import main
    from lmforge.models import load_model

    run_dir, _ = _copy_run(trained_run, tmp_path)
    root = run_dir / "checkpoints"
    _flip_last_byte(root / "step-000030" / ck.OPTIMIZER_FILE)
    assert load_model(root / "step-000030") is not None  # loading a model reads its weights only
    weights = root / "best" / ck.WEIGHTS_FILE
    _flip_last_byte(weights)
    with pytest.raises(LMForgeError, match=f"{weights} does not match the sha256 .* the model is damaged"):
        load_model(run_dir)  # a run directory loads its best/
    assert main(["generate", str(run_dir), "--prompt", "func ", "--max-new-tokens", "2", "--device", "cpu"]) == 2
    assert f"{weights} does not match the sha256" in capsys.readouterr().err
    # a run that writes a new best/ while it is read (renamed over the old): read again, no damage reported
    shutil.copy(root / "step-000030" / ck.WEIGHTS_FILE, weights)
    ck.write_checksums(root / "best")
    calls = []
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ck, "checksum_mismatch", _replaced_while_read(calls))
        assert load_model(run_dir) is not None and len(calls) == 2
    # weights changed on purpose and saved with save_pretrained: the checksums follow, and it loads; the
    # optimizer state damaged above is still found
    import torch

    model = load_model(root / "step-000030")
    with torch.no_grad():
        next(model.parameters()).mul_(0.5)
    model.save_pretrained(root / "step-000030")
    assert ck.checksum_mismatch(root / "step-000030", weights_only=True) is None
    assert f"{ck.OPTIMIZER_FILE} does not match" in ck.checksum_mismatch(root / "step-000030")
    assert torch.equal(next(load_model(root / "step-000030").parameters()), next(model.parameters()))
    assert not (tmp_path / "fresh" / ck.CHECKSUMS_FILE).exists() and model.save_pretrained(tmp_path / "fresh")

def test_each_process_hashes_a_share_of_the_files_of_about_equal_bytes(tmp_path):
    for name, size in {"a.safetensors": 100, "b.safetensors": 60, "c.safetensors": 50, "d.safetensors": 10}.items():
        (tmp_path / name).write_bytes(b"x" * size)
    names = sorted(p.name for p in tmp_path.iterdir())
    shares = [ck._size_share(tmp_path, names, i, 2) for i in range(2)]
    assert shares == [["a.safetensors", "d.safetensors"], ["b.safetensors", "c.safetensors"]]  # 110 bytes each
    assert ck._size_share(tmp_path, names, 0, 1) == names
    assert sorted(sum((ck._size_share(tmp_path, names, i, 3) for i in range(3)), [])) == names
    ck.write_checksums(tmp_path)
    _flip_last_byte(tmp_path / "c.safetensors")
    found = [ck.checksum_mismatch(tmp_path, share=(i, 2)) for i in range(2)]
    assert found[0] is None and "c.safetensors does not match" in found[1]
    assert "c.safetensors does not match" in ck.checksum_mismatch(tmp_path)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_two_processes(args: list[str]) -> list[subprocess.Popen]:
    """``lmforge ARGS`` as the two processes of a job, as torchrun starts them (its environment), but each
    left to finish on its own: torchrun stops the others when one fails, which could cut their last lines."""
    from tests.train_helpers import subprocess_env

    port = _free_port()
    return [subprocess.Popen(lmforge_cmd(*args), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=subprocess_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                                                LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
            for rank in range(2)]


def test_damage_only_one_process_hashed_stops_every_process_with_the_same_message(tmp_path, trained_run):
    run_dir, recipe = _copy_run(trained_run, tmp_path)
    ckpt = run_dir / "checkpoints" / "step-000030"
    files = json.loads((ckpt / ck.CHECKSUMS_FILE).read_text())["files"]
    # the file process 1 hashes (the optimizer state, twice the weights' bytes, is process 0's)
    weights = ckpt / ck.WEIGHTS_FILE
    assert ck._size_share(ckpt, sorted(files), 0, 2) == [ck.OPTIMIZER_FILE]
    assert ck.WEIGHTS_FILE in ck._size_share(ckpt, sorted(files), 1, 2)
    _flip_last_byte(weights)
    procs = _start_two_processes(["train", str(recipe), "training.max_steps=40", "--resume"])
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 2, err
        assert f"lmforge: error: {weights} does not match the sha256 written with it" in err, err
    assert not (run_dir / "checkpoints" / "step-000040").exists()


def test_a_signal_to_one_process_stops_every_process_at_one_step_and_process_0_exits_with_it(tmp_path, go_data):
    """SIGTERM to process 1 only (a scheduler that signals one rank): process 0, which got none, learns it
    from the stop flags reduced across processes, both save one checkpoint at the same step, and process
    0 exits 143 (the status a job controller reads), process 1 0."""
    import signal
    import time

    recipe = write_recipe(tmp_path / "r.yaml", go_data, tmp_path / "runs",
                          training={"max_steps": 100000, "eval_interval": 0, "save_interval": 0})
    metrics = tmp_path / "runs" / "t" / "metrics.jsonl"
    procs = _start_two_processes(["train", str(recipe)])
    try:
        for _ in range(2400):  # until a few steps are logged: the loop (and its signal handlers) runs
            if metrics.is_file() and metrics.read_text().count("\n") >= 3 or any(p.poll() is not None for p in procs):
                break
            time.sleep(0.1)
        if any(p.poll() is not None for p in procs):  # one ended early: the other may wait on it for ever
            for p in procs:
                p.kill()
            pytest.fail(f"a process ended before the signal: {[p.communicate() for p in procs]}")
        procs[1].send_signal(signal.SIGTERM)
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [128 + signal.SIGTERM, 0], outs
    stopped = [line for line in outs[0][0].splitlines() + outs[0][1].splitlines() if "(SIGTERM)" in line]
    assert len(stopped) == 1 and stopped[0].startswith("stopping at step "), outs[0]
    step = int(stopped[0].split()[3])
    assert [p.name for _, p in ck.list_checkpoints(tmp_path / "runs" / "t" / "checkpoints")] == [ck.step_dir_name(step)]
    state = json.loads((tmp_path / "runs" / "t" / "checkpoints" / ck.step_dir_name(step) / ck.STATE_FILE).read_text())
    assert state["step"] == step and state["world_size"] == 2
