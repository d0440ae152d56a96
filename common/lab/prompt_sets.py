"""Prompt sets: the shipped set, user JSONL prompt files, and train/validation/test splits by prompt.

A prompt file holds one JSON object per line: a required, non-empty "prompt" (str) and optional "id" (str),
"category" (str) and "chat" (bool: wrap the prompt as one user turn in the chat template, as
`common.model.prompting.encode_prompt` does). Blank lines are skipped.

The shipped set, `DEFAULT_PROMPTS` (common/lab/data/prompts.jsonl), holds 320 prompts in four categories of 80:
"code" (raw completion prefixes), "code-chat" (requests for code), "prose" (text openings to continue) and "qa"
(factual questions). It trains and evaluates the learned verifier and drives the network simulation runs.

`split_by_prompt` assigns whole prompts to splits, so no prompt's drafts and verdicts land in two splits.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "data" / "prompts.jsonl"

DEFAULT_CATEGORY = "user"


@dataclass(frozen=True)
class PromptRecord:
    id: str
    category: str
    chat: bool
    prompt: str


def load_prompts(path: Path | str | None = None) -> list[PromptRecord]:
    """The records of a prompt file, in file order; `None` loads the shipped set.

    Missing fields default to id f"p{line:04d}" (the 1-based line number), category "user" and chat False.
    Raises ValueError naming the file and line for a line that is not a JSON object, a missing, non-string or
    blank "prompt", a wrongly typed field, or an id used twice.
    """
    source = DEFAULT_PROMPTS if path is None else Path(path)
    records: list[PromptRecord] = []
    first_line: dict[str, int] = {}
    with open(source, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            record = _parse_line(line, source, number)
            if record.id in first_line:
                raise ValueError(f"{source}:{number}: duplicate id {record.id!r} (first used on line "
                                 f"{first_line[record.id]})")
            first_line[record.id] = number
            records.append(record)
    return records


def _parse_line(line: str, source: Path, number: int) -> PromptRecord:
    where = f"{source}:{number}"
    try:
        data = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not valid JSON: {error.msg} (column {error.colno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(data).__name__}")
    if "prompt" not in data:
        raise ValueError(f'{where}: missing "prompt"')
    prompt = data["prompt"]
    if not isinstance(prompt, str):
        raise ValueError(f'{where}: "prompt" must be a string, got {type(prompt).__name__}')
    if not prompt.strip():
        raise ValueError(f'{where}: "prompt" is empty')
    record_id = data.get("id", f"p{number:04d}")
    category = data.get("category", DEFAULT_CATEGORY)
    for name, value in (("id", record_id), ("category", category)):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f'{where}: "{name}" must be a non-empty string, got {value!r}')
    chat = data.get("chat", False)
    if not isinstance(chat, bool):
        raise ValueError(f'{where}: "chat" must be true or false, got {chat!r}')
    return PromptRecord(id=record_id, category=category, chat=chat, prompt=prompt)


def split_by_prompt(records: Sequence[PromptRecord], fractions: Sequence[float] = (0.7, 0.15, 0.15),
                    seed: int = 0) -> tuple[list[PromptRecord], ...]:
    """Partition `records` into len(fractions) splits (e.g. train, validation, test), whole prompts at a time.

    Stratified: each category is shuffled on its own (seeded by `seed` and the category name) and cut by
    `fractions`, with at least one prompt of every category in every split. Records with the same prompt text
    always share a split. Deterministic for given records, fractions and seed, whatever the input order; each
    split keeps the input order. Raises ValueError if the fractions are not positive and summing to 1, or a
    category has fewer distinct prompts than there are splits.
    """
    fractions = tuple(float(fraction) for fraction in fractions)
    if not fractions or any(not fraction > 0 for fraction in fractions) or abs(sum(fractions) - 1.0) > 1e-6:
        raise ValueError(f"fractions must be positive and sum to 1, got {fractions}")
    # Group identical prompt texts; a group belongs to the category of its first record.
    groups: dict[str, list[int]] = {}
    for index, record in enumerate(records):
        groups.setdefault(record.prompt, []).append(index)
    by_category: dict[str, list[str]] = {}
    for text, indices in groups.items():
        by_category.setdefault(records[indices[0]].category, []).append(text)
    assignment: dict[int, int] = {}
    for category in sorted(by_category):
        texts = sorted(by_category[category])
        if len(texts) < len(fractions):
            raise ValueError(f"category {category!r} has {len(texts)} distinct prompts, fewer than the "
                             f"{len(fractions)} splits")
        random.Random(f"{seed}:{category}").shuffle(texts)
        start = 0
        for split, count in enumerate(_allocate(len(texts), fractions)):
            for text in texts[start:start + count]:
                for index in groups[text]:
                    assignment[index] = split
            start += count
    splits: tuple[list[PromptRecord], ...] = tuple([] for _ in fractions)
    for index, record in enumerate(records):
        splits[assignment[index]].append(record)
    return splits


def _allocate(total: int, fractions: tuple[float, ...]) -> list[int]:
    """Split `total` items into counts near fraction * total (largest remainder), each at least 1."""
    ideal = [fraction * total for fraction in fractions]
    counts = [max(1, int(value)) for value in ideal]
    while sum(counts) < total:
        counts[max(range(len(counts)), key=lambda i: (ideal[i] - counts[i], -i))] += 1
    while sum(counts) > total:
        counts[max((i for i in range(len(counts)) if counts[i] > 1), key=lambda i: (counts[i] - ideal[i], -i))] -= 1
    return counts


def interleave_categories(records: Sequence[PromptRecord]) -> list[PromptRecord]:
    """One prompt of each category in turn (file order within a category): any prefix is balanced."""
    by_category: dict[str, list[PromptRecord]] = {}
    for record in records:
        by_category.setdefault(record.category, []).append(record)
    queues = list(by_category.values())
    return [queue[i] for i in range(max(map(len, queues), default=0)) for queue in queues if i < len(queue)]
