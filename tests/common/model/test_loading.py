"""The model cache under concurrent fillers: two processes (two daemons, two test workers) that convert the same
model at once each write their own folder, and the second to finish keeps the first's published copy."""

from __future__ import annotations

import os
from pathlib import Path

from common.model.loading import _partial, _publish


def _written(partial: Path, text: str) -> Path:
    partial.mkdir(parents=True)
    (partial / "config.json").write_text(text)
    return partial


def test_a_second_process_publishing_the_same_model_keeps_the_first_ones_copy(tmp_path: Path) -> None:
    target = tmp_path / "models" / "saved" / "tiny-random"
    first = _written(_partial(target), "first")
    second = _written(target.with_name(target.name + ".partial-other"), "second")
    assert first.name == f"tiny-random.partial-{os.getpid()}"
    _publish(first, target)
    _publish(second, target)
    assert (target / "config.json").read_text() == "first"
    assert sorted(p.name for p in target.parent.iterdir()) == ["tiny-random"]  # no partial left behind
