"""Streamed text (edge/api/sse.py:IncrementalText): linear decode work, and exactly the non-streamed text.

The non-streamed text is the whole token list decoded at once and cut before the first stop string;
a stream must send a prefix of it at every point (never a stop string, even in part) and all of it
once `finish` has run, whatever the chunking, multi-byte characters split across tokens included.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.spec.generation import StopSequences
from edge.api.sse import IncrementalText


def _chunks(tokens: list[int], rng: random.Random, largest: int = 6) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(tokens):
        n = rng.randint(1, largest)
        chunks.append(tokens[i:i + n])
        i += n
    return chunks


def _stream(tokenizer, tokens: list[int], stop: tuple[str, ...], rng: random.Random) -> tuple[str, IncrementalText]:
    """What a client sees: every delta, checked against the final text as it goes, then the tail."""
    whole = tokenizer.decode(tokens, skip_special_tokens=True)
    final = StopSequences(stop, None).cut(whole) if stop else whole
    text, seen = IncrementalText(tokenizer, stop), ""
    for chunk in _chunks(tokens, rng):
        seen += text.push(chunk)
        assert final.startswith(seen), (seen[-40:], final[len(seen) - 40:len(seen) + 10])
    seen += text.finish(final)
    assert seen == final
    return seen, text


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    """SmolLM2's byte-level BPE: random ids include pieces of multi-byte characters."""
    return smollm2.tokenizer


@pytest.mark.smollm2
def test_decode_work_grows_linearly_with_the_stream(tokenizer):
    rng = random.Random(0)
    work = {}
    for n in (1000, 4000):
        tokens = [rng.randrange(tokenizer.vocab_size) for _ in range(n)]
        _, text = _stream(tokenizer, tokens, (), random.Random(n))
        work[n] = text.decoded_tokens
    assert work[4000] < 12 * 4000, work  # about three tokens decoded per token streamed, never the whole list
    assert work[4000] / work[1000] < 4.8, work  # 4x the tokens, about 4x the work (quadratic would be 16x)


@pytest.mark.smollm2
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 49151), min_size=1, max_size=120), st.integers(0, 2 ** 16), st.booleans())
def test_streamed_text_is_the_whole_decoding_for_random_tokens(tokenizer, tokens, seed, with_stop):
    rng = random.Random(seed)
    stop = ()
    whole = tokenizer.decode(tokens, skip_special_tokens=True)
    if with_stop and len(whole) > 4:  # a stop string taken from the text itself: it spans chunks often
        start = rng.randrange(len(whole) - 2)
        stop = (whole[start:start + rng.randint(2, 6)], "never-in-the-text-\u2603")
    _stream(tokenizer, tokens, stop, rng)


@pytest.mark.smollm2
def test_multi_byte_characters_and_a_stop_string_split_across_chunks(tokenizer):
    text = "caf\u00e9 \u65e5\u672c\u8a9e \U0001f600 and then STOP here, never sent"
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
    for seed in range(20):
        seen, _ = _stream(tokenizer, tokens, ("STOP",), random.Random(seed))
        assert seen == "caf\u00e9 \u65e5\u672c\u8a9e \U0001f600 and then "
    chunks = IncrementalText(tokenizer)  # one token at a time: every byte piece of the emoji arrives alone
    pieces = [chunks.push([t]) for t in tokens]
    assert "\ufffd" not in "".join(pieces) and "".join(pieces) + chunks.finish(text) == text
