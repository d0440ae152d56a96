"""Small prompt files for tests that train verifiers: short prompts from every category of the shipped set."""

from __future__ import annotations

import json
from pathlib import Path

from common.lab.prompt_sets import interleave_categories, load_prompts


def short_prompt_file(directory: Path, n: int) -> Path:
    """The first `n` shipped prompts taken from each category in turn, cut to 60 characters, as plain text."""
    path = directory / "prompts.jsonl"
    picked = interleave_categories(load_prompts())[:n]  # every category in turn: each split gets one of each
    path.write_text("".join(json.dumps({"id": p.id, "category": p.category, "chat": False, "prompt": p.prompt[:60]}) + "\n"
                            for p in picked))
    return path
