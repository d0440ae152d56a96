"""Suffix matching: where the text at hand was seen before, and what followed it there.

Pure data structures over token ids (no model, no I/O): the suffix proposer
(common/spec/propose/suffix_proposer.py) asks them for a continuation of the context.

Glossary
    key          the last KEY_LENGTH tokens of the context: what the index looks up
    occurrence   an earlier position whose KEY_LENGTH tokens equal the key; its match length is how far back
                 the context and the text before it agree (the key included), up to MAX_MATCH
    continuation the tokens after the longest-matching occurrences, as a path: at each depth the token
                 most of them continue with; its score there is the share of those occurrences that
                 continue along the path so far (SuffixDecoding's frequency score, arXiv 2411.04975)

Costs: an index update is one dict append per token; a lookup is one dict lookup, then a backward
comparison over at most MAX_OCCURRENCES occurrences (the most recent): microseconds, not a draft step.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Sequence

KEY_LENGTH = 3  # shortest match that proposes: shorter ones are mostly coincidences in a long passage
MAX_MATCH = 32  # how far back a match is measured (longer ones are no more informative)
MAX_OCCURRENCES = 32  # occurrences of a key examined per lookup, most recent first


@dataclass(frozen=True)
class Continuation:
    """What followed the longest match: tokens with a score each (see the module docstring)."""

    tokens: list[int]
    scores: list[float]
    match_length: int
    occurrences: int  # how many earlier positions matched that long


def match_length(text: Sequence[int], end: int, context: Sequence[int], limit: int = MAX_MATCH) -> int:
    """How many tokens text[:end] and `context` agree on, counted back from their ends (at most `limit`)."""
    # Agreement over n tokens implies it over fewer: a binary search of slice comparisons (which run in C).
    low, high = 0, min(limit, end, len(context))
    while low < high:
        n = (low + high + 1) // 2
        if text[end - n:end] == context[len(context) - n:]:
            low = n
        else:
            high = n - 1
    return low


def follow(paths: list[Sequence[int]], length: int) -> tuple[list[int], list[float]]:
    """The most followed path through `paths` (continuations after equally long matches), up to `length`
    tokens: at each depth the token most surviving paths take (ties: the earlier path, the most recent
    occurrence), with the share of all paths that took the whole path so far."""
    weights = Counter(tuple(p[:length]) for p in paths if p)  # equal paths (a repeated passage) counted once
    total = sum(weights.values())
    alive = list(weights.items())
    tokens: list[int] = []
    scores: list[float] = []
    for depth in range(length):
        if len(alive) == 1:  # one path left: the rest of it, at the share it has
            path, n = alive[0]
            tokens += path[depth:]
            scores += [n / total] * (len(path) - depth)
            break
        counts: dict[int, int] = {}
        for path, n in alive:
            if len(path) > depth:
                counts[path[depth]] = counts.get(path[depth], 0) + n
        if not counts:
            break
        best = max(counts.values())
        token = next(path[depth] for path, _ in alive if len(path) > depth and counts[path[depth]] == best)
        alive = [(path, n) for path, n in alive if len(path) > depth and path[depth] == token]
        tokens.append(token)
        scores.append(best / total)
    return tokens, scores


class TokenIndex:
    """Where each KEY_LENGTH-gram of one growing token sequence occurs (positions of its last token)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.positions: dict[tuple[int, ...], list[int]] = {}

    def extend_to(self, tokens: Sequence[int]) -> None:
        """Index `tokens`, which extend what is indexed (else the index restarts from them). Only the last indexed
        token is compared: a stale index could only propose worse, never wrongly (proposals are verified)."""
        n = len(self.tokens)
        if n > len(tokens) or (n and tokens[n - 1] != self.tokens[-1]):
            self.tokens, self.positions, n = [], {}, 0
        self.tokens.extend(tokens[n:])
        for end in range(max(n, KEY_LENGTH - 1), len(self.tokens)):
            key = tuple(self.tokens[end - KEY_LENGTH + 1:end + 1])
            self.positions.setdefault(key, []).append(end)

    def paths(self, context: Sequence[int], length: int) -> tuple[int, list[Sequence[int]]]:
        """(match length, the continuations after the longest-matching occurrences of `context`'s key)."""
        found = self.positions.get(tuple(context[-KEY_LENGTH:])) if len(context) >= KEY_LENGTH else None
        if not found:
            return 0, []
        best, paths = 0, []
        for end in reversed(found[-MAX_OCCURRENCES:]):
            if end + 1 >= len(self.tokens):
                continue  # the sequence's own end: nothing follows it yet
            n = match_length(self.tokens, end + 1, context)
            if n > best:
                best, paths = n, []
            if n == best:
                paths.append(self.tokens[end + 1:end + 1 + length])
        return best, paths


def continuation(index: TokenIndex, context: Sequence[int], length: int) -> Continuation | None:
    """The continuation of `context` that `index` proposes, up to `length` tokens; None without a match."""
    best, paths = index.paths(context, length)
    if best < KEY_LENGTH or not paths:
        return None
    tokens, scores = follow(paths, length)
    return Continuation(tokens, scores, best, len(paths)) if tokens else None


class OutputCache:
    """Earlier outputs, least recently used first out, bounded by the tokens held; one index over all of them.

    The index keeps a reference per token; an evicted output's references go when the index is rebuilt,
    once the stale ones outnumber the live ones, so the memory stays within about twice the bound.
    """

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"the suffix cache holds at least one token, got {max_tokens}")
        self.max_tokens = max_tokens
        self.outputs: OrderedDict[int, list[int]] = OrderedDict()
        self.held = 0
        self.stale = 0
        self.next_id = 0
        self.positions: dict[tuple[int, ...], list[tuple[int, int]]] = {}

    def __len__(self) -> int:
        return len(self.outputs)

    def add(self, output: Sequence[int]) -> None:
        """Remember `output` (cut to the bound), evicting the least recently used outputs to make room."""
        tokens = list(output[-self.max_tokens:])
        if len(tokens) < KEY_LENGTH + 1:
            return  # too short to match and continue
        while self.outputs and self.held + len(tokens) > self.max_tokens:
            _, evicted = self.outputs.popitem(last=False)
            self.held -= len(evicted)
            self.stale += len(evicted)
        entry, self.next_id = self.next_id, self.next_id + 1
        self.outputs[entry] = tokens
        self.held += len(tokens)
        if self.stale > self.held:
            self._reindex()
        else:
            self._index(entry, tokens)

    def _index(self, entry: int, tokens: list[int]) -> None:
        for end in range(KEY_LENGTH - 1, len(tokens)):
            self.positions.setdefault(tuple(tokens[end - KEY_LENGTH + 1:end + 1]), []).append((entry, end))

    def _reindex(self) -> None:
        self.positions, self.stale = {}, 0
        for entry, tokens in self.outputs.items():
            self._index(entry, tokens)

    def continuation(self, context: Sequence[int], length: int) -> Continuation | None:
        """As `continuation` over every cached output; the outputs it drew from count as used."""
        found = self.positions.get(tuple(context[-KEY_LENGTH:])) if len(context) >= KEY_LENGTH else None
        if not found:
            return None
        best, paths, used = 0, [], set()
        for entry, end in reversed(found[-MAX_OCCURRENCES:]):
            tokens = self.outputs.get(entry)
            if tokens is None or end + 1 >= len(tokens):
                continue
            n = match_length(tokens, end + 1, context)
            if n > best:
                best, paths, used = n, [], set()
            if n == best:
                paths.append(tokens[end + 1:end + 1 + length])
                used.add(entry)
        if best < KEY_LENGTH or not paths:
            return None
        for entry in used:
            self.outputs.move_to_end(entry)
        tokens, scores = follow(paths, length)
        return Continuation(tokens, scores, best, len(paths)) if tokens else None
