"""`lmforge.files.atomic_directory`: an output directory is replaced whole or not at all."""

from __future__ import annotations

import pytest

from lmforge.files import atomic_directory


def test_a_failed_write_leaves_the_old_directory_and_no_leftovers(tmp_path):
    out = tmp_path / "data"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_directory(out) as tmp:
            (tmp / "new.txt").write_text("half")
            raise RuntimeError("interrupted")
    assert [p.name for p in tmp_path.iterdir()] == ["data"]
    assert [p.name for p in out.iterdir()] == ["old.txt"]


def test_a_finished_write_replaces_the_directory_whole(tmp_path):
    out = tmp_path / "nested" / "data"
    for content in ("first", "second"):
        with atomic_directory(out) as tmp:
            assert not out.exists() or (out / "v.txt").read_text() == "first"  # readers see the old one meanwhile
            (tmp / "v.txt").write_text(content)
    assert (out / "v.txt").read_text() == "second"
    assert [p.name for p in out.parent.iterdir()] == ["data"]
