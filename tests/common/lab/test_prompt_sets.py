"""Tests of common/lab/prompt_sets.py and the shipped prompt set common/lab/data/prompts.jsonl (no models, milliseconds)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from common.lab.prompt_sets import DEFAULT_PROMPTS, PromptRecord, load_prompts, split_by_prompt

CATEGORIES = {"code": False, "code-chat": True, "prose": False, "qa": True}
BENCH_PROMPTS = Path(__file__).resolve().parents[3] / "sim" / "data" / "bench_prompts.jsonl"


@pytest.fixture(scope="module")
def shipped() -> list[PromptRecord]:
    return load_prompts()


# --------------------------------------------------------------------------------------------
# The shipped set


def test_shipped_file_is_320_json_lines() -> None:
    text = DEFAULT_PROMPTS.read_text(encoding="utf-8")
    assert text.endswith("}\n")
    lines = text.split("\n")[:-1]
    assert len(lines) == 320
    assert all(set(json.loads(line)) == {"id", "category", "chat", "prompt"} for line in lines)


def test_shipped_set_has_four_categories_of_80_in_order(shipped: list[PromptRecord]) -> None:
    assert load_prompts(DEFAULT_PROMPTS) == shipped
    assert len(shipped) == 320
    assert len({record.id for record in shipped}) == 320
    assert len({record.prompt for record in shipped}) == 320
    assert Counter(record.category for record in shipped) == {category: 80 for category in CATEGORIES}
    expected_ids = [f"{category}-{n:03d}" for category in CATEGORIES for n in range(1, 81)]
    assert [record.id for record in shipped] == expected_ids
    assert all(record.chat is CATEGORIES[record.category] for record in shipped)


def test_shipped_prompts_are_new_and_of_sensible_length(shipped: list[PromptRecord]) -> None:
    bench = {json.loads(line)["prompt"] for line in BENCH_PROMPTS.read_text(encoding="utf-8").splitlines()}
    assert not bench & {record.prompt for record in shipped}
    for record in shipped:
        assert len(record.prompt) >= 10
        if record.category != "code":
            assert len(record.prompt) <= 400 and record.prompt == record.prompt.strip(), record.id


# --------------------------------------------------------------------------------------------
# Splits


def test_split_is_deterministic_disjoint_complete_and_stratified(shipped: list[PromptRecord]) -> None:
    splits = split_by_prompt(shipped)
    assert split_by_prompt(shipped) == splits
    assert split_by_prompt(list(reversed(shipped)))[0] == list(reversed(splits[0]))  # input order does not matter
    assert [len(split) for split in splits] == [224, 48, 48]
    ids = [{record.id for record in split} for split in splits]
    assert not ids[0] & ids[1] and not ids[0] & ids[2] and not ids[1] & ids[2]
    assert set().union(*ids) == {record.id for record in shipped}
    for split, size in zip(splits, (56, 12, 12)):
        assert Counter(record.category for record in split) == {category: size for category in CATEGORIES}
        order = [record.id for record in split]
        assert order == sorted(order, key=[record.id for record in shipped].index)  # keeps the input order
    assert split_by_prompt(shipped, seed=1) != splits


def test_split_keeps_identical_prompts_together_and_every_category_everywhere() -> None:
    records = [PromptRecord(f"a{i}", "a", False, f"text {i % 4}") for i in range(12)]
    records += [PromptRecord(f"b{i}", "b", True, f"other {i}") for i in range(3)]
    splits = split_by_prompt(records, fractions=(0.8, 0.1, 0.1), seed=7)
    for split in splits:
        assert {record.category for record in split} == {"a", "b"}
    where = {record.prompt: index for index, split in enumerate(splits) for record in split}
    for index, split in enumerate(splits):
        assert all(where[record.prompt] == index for record in split)
    assert sum(len(split) for split in splits) == len(records)


@pytest.mark.parametrize("fractions", [(0.5, 0.4), (0.7, 0.3, 0.0), (1.2, -0.2), ()])
def test_split_rejects_bad_fractions(shipped: list[PromptRecord], fractions: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="fractions"):
        split_by_prompt(shipped, fractions=fractions)


def test_split_rejects_a_category_smaller_than_the_number_of_splits() -> None:
    records = [PromptRecord("x1", "tiny", False, "one"), PromptRecord("x2", "tiny", False, "two")]
    with pytest.raises(ValueError, match="'tiny'"):
        split_by_prompt(records)


# --------------------------------------------------------------------------------------------
# User files


def test_user_file_defaults(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "def add(a, b):\\n    "}\n\n'
                    '{"prompt": "Hello there", "chat": true, "id": "greeting"}\n'
                    '{"prompt": "Why?", "category": "qa"}\n', encoding="utf-8")
    assert load_prompts(str(path)) == [
        PromptRecord("p0001", "user", False, "def add(a, b):\n    "),
        PromptRecord("greeting", "user", True, "Hello there"),
        PromptRecord("p0004", "qa", False, "Why?"),
    ]


@pytest.mark.parametrize(("line", "message"), [
    ('{"prompt": "ok"', "not valid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"id": "x"}', 'missing "prompt"'),
    ('{"prompt": "  \\n "}', '"prompt" is empty'),
    ('{"prompt": 3}', '"prompt" must be a string'),
    ('{"prompt": "ok", "chat": "yes"}', '"chat" must be true or false'),
    ('{"prompt": "ok", "category": ""}', '"category" must be a non-empty string'),
    ('{"prompt": "ok", "id": "first"}', "duplicate id 'first'"),
])
def test_malformed_line_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine", "id": "first"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="bad.jsonl:2: ") as caught:
        load_prompts(path)
    assert message in str(caught.value)
