"""A file written aside and renamed in: the old copy stays whole until the new one is, and a failed write leaves none."""

from __future__ import annotations

import pytest

from common.atomic_files import written_aside


def test_the_new_copy_replaces_the_old_only_when_written(tmp_path):
    path = tmp_path / "verifier.json"
    path.write_text("old")
    with written_aside(path) as partial:
        partial.write_text("new")
        assert path.read_text() == "old" and partial.parent == tmp_path and partial.suffix == ".json"
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["verifier.json"]


def test_a_write_that_fails_leaves_the_old_copy_and_no_side_file(tmp_path):
    path = tmp_path / "shard-00000.npz"
    path.write_bytes(b"old")
    with pytest.raises(OSError), written_aside(path) as partial:
        partial.write_bytes(b"half")
        raise OSError("disk full")
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["shard-00000.npz"]
