"""The bench prompts: a few varied prompts shipped with sim (data/bench_prompts.jsonl), one JSON object a line
with `prompt`, `chat` and `category`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PROMPTS_FILE = Path(__file__).resolve().parent.parent / "data" / "bench_prompts.jsonl"
# the proposer suite: code editing, summarization, passage QA, ... (`sprinter bench proposer`, `tree-shapes`)
PROPOSER_PROMPTS_FILE = PROMPTS_FILE.with_name("proposer_prompts.jsonl")


def load_bench_prompts(path: Path = PROMPTS_FILE) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def bench_prompt_ids(model: str) -> tuple[list[list[int]], Any]:
    """The bench prompts in `model`'s tokens, and its tokenizer (loaded alone: no weights)."""
    from transformers import AutoTokenizer

    from common.model.loading import model_dir
    from common.model.prompting import encode_prompt
    tokenizer = AutoTokenizer.from_pretrained(model_dir(model))
    return [encode_prompt(tokenizer, p["prompt"], p["chat"]) for p in load_bench_prompts()], tokenizer
