"""Faults while writing: a full disk, a permission error or a kill -9 never costs what was written before.

A full disk is simulated by making the function that writes a file raise ENOSPC part-way; a read-only
directory is real (chmod, or as root, which chmod does not stop, the immutable attribute); kill -9 hits a
real `lmforge` subprocess paused at a known point of its write.
"""

from __future__ import annotations

import errno
import io
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from lmforge.cli import main
from lmforge.models.gpt import GPT, GPTConfig
from lmforge.tokenizer import Tokenizer
from tests.train_helpers import (REPO, lmforge_cmd, make_prepared_data, run, subprocess_env, write_go_corpus,
                                 write_recipe)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """BASE with corpus/, tokenizer/ and data/ (a `data prepare` output)."""
    return make_prepared_data(tmp_path_factory.mktemp("faults")).parent


@pytest.fixture(scope="module")
def model_dir(prepared) -> Path:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=Tokenizer.load(prepared / "tokenizer").vocab_size, n_positions=32,
                          n_embd=32, n_layer=1, n_head=2))
    ckpt = model.save_pretrained(prepared / "ckpt")
    Tokenizer.load(prepared / "tokenizer").save(ckpt)
    return ckpt


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (or ``root`` itself) with its bytes."""
    if root.is_file():
        return {root.name: root.read_bytes()}
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def full_disk(path: str | Path | None = None) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), *([str(path)] if path else []))


def fail_on_call(monkeypatch, owner, name: str, n: int, error) -> None:
    """Make the n-th call of ``owner.name`` raise ``error(args)`` after half its work: the earlier calls
    run as usual (so the output is part-written when the fault strikes)."""
    original = getattr(owner, name)
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise error(*args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)


def disk_with_room(room: int):
    """An ``open`` onto a disk with ``room`` bytes left: a binary write past them fails with ENOSPC (no file
    name, as the kernel's). ``ndarray.tofile`` writes to the descriptor and would not meet it."""
    left = [room]

    class File(io.FileIO):
        def write(self, data) -> int:
            if memoryview(data).nbytes > left[0]:
                raise full_disk()
            left[0] -= memoryview(data).nbytes
            return super().write(data)

    return lambda path, mode="r", *a, **kw: File(path, mode) if mode == "wb" else open(path, mode, *a, **kw)


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("lmforge: error: ")
    return err


@contextmanager
def read_only(directory: Path):
    """Make ``directory`` refuse new entries for real: chmod for users; as root (whom chmod does not stop),
    the immutable attribute."""
    root = os.geteuid() == 0
    if root:
        try:
            subprocess.run(["chattr", "+i", str(directory)], check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError) as e:  # no chattr, or a file system without it (tmpfs)
            pytest.skip(f"running as root where the immutable attribute is not available ({e}): no directory "
                        "refuses root's writes here; the patched-writer tests still cover the error path")
    else:
        directory.chmod(0o555)
    try:
        yield
    finally:
        if root:
            subprocess.run(["chattr", "-i", str(directory)], check=True)
        else:
            directory.chmod(0o755)


# ---- training: checkpoints ---------------------------------------------------------------------------
def test_a_full_disk_during_a_checkpoint_stops_training_and_keeps_the_earlier_ones(tmp_path, prepared,
                                                                                      monkeypatch, capsys):
    from lmforge import checkpoint as ck

    recipe = write_recipe(tmp_path / "r.yaml", prepared / "data", tmp_path / "runs",
                          training={"max_steps": 6, "save_interval": 2, "eval_interval": 0})
    ckpts = tmp_path / "runs" / "t" / "checkpoints"

    def half_written_state(path, data):  # the checkpoint's last file: everything else is already there
        path.write_text('{"step": ')
        raise full_disk(path)

    # each checkpoint's save_json calls: its trainer_state.json, then its checksums.json; the third is step 4's state
    fail_on_call(monkeypatch, ck, "save_json", 3, half_written_state)
    assert main(["train", str(recipe)]) == 2
    err = one_line_error(capsys)
    assert f"no space left on device while writing {ckpts / 'step-000004' / ck.STATE_FILE}: free space" in err
    assert "--resume" in err
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000002"]  # no .tmp-*, the earlier one kept
    steps = [line for line in (tmp_path / "runs" / "t" / "metrics.jsonl").read_text().splitlines()]
    assert '"step": 4' in steps[-1]  # training stopped at the failed checkpoint
    monkeypatch.undo()
    assert main(["train", str(recipe), "--resume"]) == 0
    assert "(step 2)" in capsys.readouterr().out
    assert ck.read_trainer_state(ckpts / "step-000006")["step"] == 6


def test_a_read_only_checkpoint_directory_ends_training_with_the_path(tmp_path, prepared, capsys):
    from lmforge import checkpoint as ck

    recipe = write_recipe(tmp_path / "r.yaml", prepared / "data", tmp_path / "runs",
                          training={"max_steps": 2, "save_interval": 2, "eval_interval": 0})
    assert main(["train", str(recipe)]) == 0
    ckpts = tmp_path / "runs" / "t" / "checkpoints"
    before = snapshot(ckpts)
    capsys.readouterr()
    with read_only(ckpts):
        assert main(["train", str(recipe), "training.max_steps=4", "--resume"]) == 2
    err = one_line_error(capsys)
    # the last step's evaluation writes best/ first: that write meets the read-only directory
    assert f"while writing {ckpts / 'best'}: make it writable then continue the run" in err
    assert "permission denied" in err or "operation not permitted" in err
    assert snapshot(ckpts) == before
    assert ck.read_trainer_state(ckpts / "step-000002")["step"] == 2


# ---- datasets and tokenizers: a full disk or a permission error --------------------------------------
def test_a_full_disk_during_data_prepare_keeps_the_previous_data(tmp_path, prepared, monkeypatch, capsys):
    from lmforge.data import prepare

    out = tmp_path / "data"
    shutil.copytree(prepared / "data", out)
    before = snapshot(out)
    # the first shard is written, the next write finds the disk full (a plain write() names no file)
    fail_on_call(monkeypatch, prepare.ShardWriter, "write", 2, lambda *a: full_disk())
    assert main(["data", "prepare", str(prepared / "corpus"), "--tokenizer", str(prepared / "tokenizer"),
                 "--out", str(out), "--overwrite", "--shard-tokens", "64", "--no-progress"]) == 2
    err = one_line_error(capsys)
    assert err.endswith(f"no space left on device while writing {out}: free space or choose another --out")
    assert snapshot(out) == before and leftovers(tmp_path) == []


def test_a_full_disk_during_tokenizer_train_keeps_the_previous_tokenizer(tmp_path, prepared, monkeypatch, capsys):
    out = tmp_path / "tok"
    shutil.copytree(prepared / "tokenizer", out)
    before = snapshot(out)
    write_text = Path.write_text

    def second_file_fails(path, *args, **kwargs):  # tokenizer.json's new copy is written, then the disk is full
        if path.name.startswith(".tokenizer_config.json.tmp-"):
            raise full_disk(path)
        return write_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", second_file_fails)
    assert main(["tokenizer", "train", str(prepared / "corpus"), "--out", str(out), "--vocab-size", "300",
                 "--overwrite", "--no-progress"]) == 2
    err = one_line_error(capsys)
    assert err.endswith(f"no space left on device while writing {out / 'tokenizer_config.json'}: "
                        "free space or choose another --out")
    assert snapshot(out) == before  # the three files still belong together; no hidden temporaries


def test_a_full_disk_during_data_sudoku_keeps_the_previous_dataset(tmp_path, monkeypatch, capsys):
    from lmforge.recipes.puzzles import sudoku

    out = tmp_path / "sudoku"
    args = ["data", "sudoku", "--out", str(out), "--generate", "6", "--workers", "1", "--no-progress"]
    assert main(args) == 0
    before = snapshot(out)
    fail_on_call(monkeypatch, sudoku, "_save", 3, lambda path, array: full_disk(path))
    assert main([*args, "--seed", "1", "--overwrite"]) == 2
    err = one_line_error(capsys)
    assert f"no space left on device while writing {out / 'train' / 'all__puzzle_identifiers.npy'}" in err
    assert snapshot(out) == before and leftovers(tmp_path) == []


def test_a_disk_that_fills_inside_a_sudoku_array_is_reported_as_full(tmp_path, monkeypatch, capsys):
    """np.save writes the data with tofile, whose short write is an OSError without errno: _save must not."""
    from lmforge.recipes.puzzles import sudoku

    out = tmp_path / "sudoku"
    args = ["data", "sudoku", "--out", str(out), "--generate", "6", "--num-aug", "3", "--workers", "1",
            "--no-progress"]
    assert main(args) == 0
    before = snapshot(out)
    assert len(before["train/all__inputs.npy"]) > 1700  # 20 puzzles of 81 bytes
    # room for the 12 .npy headers (128 bytes each) but not for the first array's data
    monkeypatch.setattr(sudoku, "open", disk_with_room(12 * 128 + 64), raising=False)
    assert main([*args, "--seed", "1", "--overwrite"]) == 2
    assert one_line_error(capsys).endswith(f"no space left on device while writing {out}: free space or choose "
                                           "another --out")
    assert snapshot(out) == before and leftovers(tmp_path) == []


def test_permission_denied_during_data_go_functions_keeps_the_previous_dataset(tmp_path, monkeypatch, capsys):
    from lmforge.recipes.hrgc import functions as go_functions

    src = write_go_corpus(tmp_path / "src", n_files=6)
    out = tmp_path / "fns"
    args = ["data", "go-functions", str(src), "--out", str(out), "--no-progress"]
    assert main(args) == 0
    before = snapshot(out)

    def refuse_test_split(path, *a, **kw):  # train.jsonl and val.jsonl are opened, test.jsonl is refused
        if Path(path).name == "test.jsonl":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return open(path, *a, **kw)

    monkeypatch.setattr(go_functions, "open", refuse_test_split, raising=False)
    assert main([*args, "--overwrite"]) == 2
    err = one_line_error(capsys)
    assert err.endswith(f"permission denied while writing {out / 'test.jsonl'}: make it writable or choose "
                        "another --out")
    assert snapshot(out) == before and leftovers(tmp_path) == []


# ---- exports: a full disk or a read-only directory --------------------------------------------------
def test_a_full_disk_during_an_hf_export_keeps_the_previous_export(tmp_path, model_dir, monkeypatch, capsys):
    from safetensors import SafetensorError

    from lmforge.export import hf

    out = tmp_path / "hf"
    assert main(["export", str(model_dir), "--format", "hf", "--out", str(out)]) == 0
    before = snapshot(out)

    def rust_full_disk(tensors, filename, metadata=None):  # what safetensors raises: the errno is in the text
        Path(filename).write_bytes(b"\0" * 100)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(hf, "save_file", rust_full_disk)
    assert main(["export", str(model_dir), "--format", "hf", "--out", str(out), "--overwrite"]) == 2
    assert one_line_error(capsys).endswith(f"no space left on device while writing {out}: free space or "
                                           "choose another --out")
    assert snapshot(out) == before and leftovers(tmp_path) == []


def test_a_full_disk_during_a_gguf_export_keeps_the_previous_file(tmp_path, model_dir, monkeypatch, capsys):
    import gguf

    out = tmp_path / "model.gguf"
    assert main(["export", str(model_dir), "--format", "gguf", "--out", str(out)]) == 0
    before = snapshot(out)
    # header and metadata are on disk, then the tensors find the disk full
    fail_on_call(monkeypatch, gguf.GGUFWriter, "write_tensors_to_file", 1, lambda *a, **k: full_disk())
    assert main(["export", str(model_dir), "--format", "gguf", "--out", str(out), "--overwrite"]) == 2
    assert one_line_error(capsys).endswith(f"no space left on device while writing {out}: free space or "
                                           "choose another --out")
    assert snapshot(out) == before and leftovers(tmp_path) == []


def test_a_disk_that_fills_inside_the_gguf_tensors_is_reported_as_full(tmp_path, model_dir, monkeypatch, capsys):
    """GGUFWriter writes tensors with ndarray.tofile (a short write: an OSError without errno): not any more."""
    import gguf.gguf_writer

    out = tmp_path / "model.gguf"
    assert main(["export", str(model_dir), "--format", "gguf", "--out", str(out)]) == 0
    before = snapshot(out)
    monkeypatch.setattr(gguf.gguf_writer, "open", disk_with_room(len(before[out.name]) // 2), raising=False)
    assert main(["export", str(model_dir), "--format", "gguf", "--out", str(out), "--overwrite"]) == 2
    assert one_line_error(capsys).endswith(f"no space left on device while writing {out}: free space or "
                                           "choose another --out")
    assert snapshot(out) == before and leftovers(tmp_path) == []


def test_a_read_only_export_directory_keeps_the_previous_export(tmp_path, model_dir, capsys):
    parent = tmp_path / "exports"
    out = parent / "hf"
    assert main(["export", str(model_dir), "--format", "hf", "--out", str(out)]) == 0
    before = snapshot(out)
    with read_only(parent):
        assert main(["export", str(model_dir), "--format", "hf", "--out", str(out), "--overwrite"]) == 2
        assert main(["export", str(model_dir), "--format", "gguf", "--out", str(parent / "m.gguf")]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and "Traceback" not in str(errors)
    for line, path in zip(errors, (out, parent / "m.gguf"), strict=True):
        assert f"while writing {path}: make it writable or choose another --out" in line, line
        assert "permission denied" in line or "operation not permitted" in line
    assert snapshot(out) == before and sorted(p.name for p in parent.iterdir()) == ["hf"]


def test_a_real_file_size_limit_during_an_export_keeps_the_previous_export(tmp_path, model_dir):
    """No patching: the kernel refuses the write (EFBIG past RLIMIT_FSIZE) inside safetensors' Rust code."""
    out = tmp_path / "hf"
    args = ["export", str(model_dir), "--format", "hf", "--out", str(out)]
    assert main(args) == 0
    before = snapshot(out)

    def small_file_limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # ignored, the kernel fails the write instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # the weights are ~50 KB

    result = run(lmforge_cmd(*args, "--overwrite"), cwd=REPO, preexec_fn=small_file_limit)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"lmforge: error: file too large while writing {out}: raise the file size "
                                     "limit (ulimit -f) or choose another --out")
    assert snapshot(out) == before and leftovers(tmp_path) == []


def test_a_real_file_size_limit_inside_the_gguf_tensors_keeps_the_previous_file(tmp_path, model_dir):
    """No patching: the kernel cuts the tensors' write short (header and metadata fit in the limit)."""
    out = tmp_path / "model.gguf"
    args = ["export", str(model_dir), "--format", "gguf", "--out", str(out)]
    assert main(args) == 0
    before = snapshot(out)
    assert len(before[out.name]) > 64 << 10  # the tensors are ~100 KB, the header and metadata ~10 KB

    def small_file_limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (32 << 10, 32 << 10))

    result = run(lmforge_cmd(*args, "--overwrite"), cwd=REPO, preexec_fn=small_file_limit)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (f"lmforge: error: file too large while writing {out}: raise the file size "
                                     "limit (ulimit -f) or choose another --out")
    assert snapshot(out) == before and leftovers(tmp_path) == []


# ---- kill -9 part-way ----------------------------------------------------------------------------------
# Runs `lmforge ARGS...` with TARGET (module:attribute) wrapped so that its N-th call prints PAUSED and
# waits, BEFORE or AFTER doing its work: a known point in the middle of the write, where the test kills it.
PAUSING_LMFORGE = textwrap.dedent("""
    import importlib, sys, time
    target, when, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    module, _, attribute = target.partition(":")
    owner = importlib.import_module(module)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    original, calls = getattr(owner, name), []

    def pause():
        print("PAUSED", flush=True)
        time.sleep(300)

    def wrapper(*args, **kwargs):
        calls.append(1)
        if when == "before" and len(calls) == n:
            pause()
        result = original(*args, **kwargs)
        if when == "after" and len(calls) == n:
            pause()
        return result

    setattr(owner, name, wrapper)
    from lmforge.cli import main
    sys.exit(main(sys.argv[4:]))
""")


def kill_9_at(tmp_path: Path, target: str, when: str, n: int, *args: str) -> None:
    script = tmp_path / "pausing_lmforge.py"
    script.write_text(PAUSING_LMFORGE)
    proc = subprocess.Popen([sys.executable, str(script), target, when, str(n), *args], env=subprocess_env(),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output = []
        for line in proc.stdout:
            output.append(line)
            if "PAUSED" in line:
                break
        else:
            pytest.fail(f"the writer finished without reaching {target}:\n{''.join(output)}")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_kill_9_during_data_prepare_leaves_no_data_that_train_would_take(tmp_path, prepared, capsys):
    out = tmp_path / "data"
    args = ["data", "prepare", str(prepared / "corpus"), "--tokenizer", str(prepared / "tokenizer"), "--out",
            str(out), "--no-progress"]
    kill_9_at(tmp_path, "lmforge.tokenizer:Tokenizer.save", "after", 1, *args)  # shards written, no meta.json
    assert not out.exists() and [name.split("-")[0] for name in leftovers(tmp_path)] == [".data.tmp"]
    half = tmp_path / leftovers(tmp_path)[0]
    assert any(half.glob("train_*.bin")) and not (half / "meta.json").exists()
    recipe = write_recipe(tmp_path / "r.yaml", out, tmp_path / "runs", training={"max_steps": 1, "save_interval": 0})
    assert main(["train", str(recipe)]) == 2
    assert f"data.path={out} does not exist" in one_line_error(capsys)
    assert main(["train", str(recipe), f"data.path={half}"]) == 2  # even pointed at the leftover, train refuses it
    assert "is not a prepared data directory" in one_line_error(capsys)
    assert main(args) == 0  # the re-run cleans the dead run's temporary directory
    assert leftovers(tmp_path) == [] and (out / "meta.json").is_file()
    assert main(["train", str(recipe)]) == 0


def test_kill_9_between_the_renames_of_an_overwrite_keeps_the_previous_data(tmp_path, prepared, capsys):
    out = tmp_path / "data"
    shutil.copytree(prepared / "data", out)
    before = snapshot(out)
    args = ["data", "prepare", str(prepared / "corpus"), "--tokenizer", str(prepared / "tokenizer"), "--out",
            str(out), "--overwrite", "--seed", "5", "--no-progress"]
    kill_9_at(tmp_path, "os:rename", "after", 1, *args)  # the previous data moved aside, the new not yet in
    assert not out.exists() and any(p.name.startswith(".data.old-") for p in tmp_path.iterdir())
    # the next writer puts the previous data back before it looks at --out: without --overwrite it refuses
    assert main(args[:-4] + ["--no-progress"]) == 2
    assert "already exists" in one_line_error(capsys)
    assert snapshot(out) == before and leftovers(tmp_path) == []


def test_kill_9_during_data_sudoku_keeps_the_previous_dataset(tmp_path):
    out = tmp_path / "sudoku"
    args = ["data", "sudoku", "--out", str(out), "--generate", "6", "--workers", "1", "--no-progress"]
    assert main(args) == 0
    before = snapshot(out)
    kill_9_at(tmp_path, "lmforge.recipes.puzzles.sudoku:_write_split", "after", 1, *args, "--seed", "1", "--overwrite")
    assert snapshot(out) == before and len(leftovers(tmp_path)) == 1  # train/ of the new one, not test/
    assert main([*args, "--seed", "1", "--overwrite"]) == 0
    assert snapshot(out) != before and leftovers(tmp_path) == []


def test_kill_9_during_data_go_functions_publishes_nothing(tmp_path):
    src = write_go_corpus(tmp_path / "src", n_files=6)
    out = tmp_path / "fns"
    args = ["data", "go-functions", str(src), "--out", str(out), "--no-progress"]
    kill_9_at(tmp_path, "lmforge.files:move_into_place", "before", 1, *args)  # complete, but not yet in place
    assert not out.exists() and len(leftovers(tmp_path)) == 1
    assert main(args) == 0
    assert leftovers(tmp_path) == [] and (out / "meta.json").is_file()


@pytest.mark.parametrize("fmt, target", [
    ("hf", "lmforge.tokenizer:Tokenizer.save"),  # weights and config written, tokenizer files not
    ("gguf", "gguf:GGUFWriter.write_tensors_to_file"),  # header and metadata written, tensors not
])
def test_kill_9_during_an_export_keeps_the_previous_export(tmp_path, model_dir, fmt, target):
    out = tmp_path / ("hf" if fmt == "hf" else "model.gguf")
    args = ["export", str(model_dir), "--format", fmt, "--out", str(out)]
    assert main(args) == 0
    before = snapshot(out)
    kill_9_at(tmp_path, target, "before", 1, *args, "--overwrite")
    assert snapshot(out) == before and len(leftovers(tmp_path)) == 1
    assert main([*args, "--overwrite"]) == 0
    assert leftovers(tmp_path) == []


def test_a_write_fault_no_verb_reported_is_still_one_line(tmp_path, monkeypatch, capsys):
    """cli.main's safety net: e.g. a full disk while a training run appends to metrics.jsonl."""
    import lmforge.cli as cli

    def full_disk(args):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "runs" / "t" / "metrics.jsonl"))

    monkeypatch.setattr(cli, "_cmd_plot", full_disk)
    assert cli.main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"lmforge: error: no space left on device while writing {tmp_path}/runs/t/metrics.jsonl: " \
                  "free space and run the command again\n"

    def unreadable(args):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "ckpt" / "config.yaml"))

    monkeypatch.setattr(cli, "_cmd_plot", unreadable)
    assert cli.main(["plot", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"lmforge: error: Permission denied: {tmp_path}/ckpt/config.yaml: check its "
                                       "permissions and run the command again\n")

    def other(args):
        raise OSError(errno.ECONNRESET, "reset")

    monkeypatch.setattr(cli, "_cmd_plot", other)
    with pytest.raises(ConnectionResetError):  # not a write fault: the traceback stays, for a bug report
        cli.main(["plot", str(tmp_path)])


def test_a_checkpoint_that_rank_0_cannot_write_stops_every_rank_of_a_torchrun_job(tmp_path, prepared):
    """Rank 0 hits a real write fault (EFBIG past RLIMIT_FSIZE) at its first checkpoint: the other rank
    learns of it at the checkpoint's sync point and stops too, instead of waiting at a barrier forever."""
    recipe = write_recipe(tmp_path / "r.yaml", prepared / "data", tmp_path / "runs",
                          training={"max_steps": 4, "save_interval": 2, "eval_interval": 0, "micro_batch_size": 2})

    def small_file_limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # inherited by both ranks: the write fails, no signal kills
        resource.setrlimit(resource.RLIMIT_FSIZE, (32 << 10, 32 << 10))  # the weights are ~160 KB

    result = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                  "lmforge", "train", str(recipe)], cwd=REPO, preexec_fn=small_file_limit)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "lmforge: error: file too large while writing" in output and "step-000002" in output
    assert "lmforge: error: rank 0 could not write a checkpoint" in output  # rank 1's own message
    assert leftovers(tmp_path / "runs" / "t" / "checkpoints") == []


# ---- data stories: written as made, with a progress bar, and a bound on --n ------------------------------
def test_data_stories_streams_with_progress_keeps_its_bytes_and_refuses_an_absurd_n(tmp_path, monkeypatch, capsys):
    from lmforge.data import stories

    out = tmp_path / "stories"
    assert main(["data", "stories", "--out", str(out), "--n", "50", "--no-progress"]) == 0
    assert "writing" not in capsys.readouterr().err
    first = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    assert sorted(first) == ["stories.json", "train.txt", "val.txt"] and all(first.values())
    assert main(["data", "stories", "--out", str(out), "--n", "50", "--overwrite"]) == 0
    assert "50/50" in capsys.readouterr().err  # the progress bar, on by default
    assert {p.name: p.read_bytes() for p in sorted(out.iterdir())} == first  # the same seed, the same bytes
    monkeypatch.setattr(stories, "MAX_STORIES", 40, raising=False)
    assert main(["data", "stories", "--out", str(tmp_path / "big"), "--n", "41", "--no-progress"]) == 2
    err = one_line_error(capsys)
    assert "--n 41 is more than 40, the most this writes" in err and err.endswith("ask for at most 40")
    assert not (tmp_path / "big").exists()
