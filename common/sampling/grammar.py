"""Structured output: token masks from a JSON schema or a Lark grammar (llguidance), the same on both sides.

Under speculative decoding the edge masks the draft's proposals and the cloud masks the target's distribution
at every row of a drafted block; the verification rules stay lossless with respect to the masked target only
if both sides compute the same masks, position by position. They do: the same spec compiled for the same
tokenizer by the same deterministic engine gives the same masks.

Glossary:

- spec (`GrammarSpec`): what a request asks for, two strings that travel on the wire: `kind`
  ("json_object", "json_schema" or "lark") and `source` (the schema's JSON text, the Lark text, "" for
  json_object). Lark text may embed JSON schemas (`%json{...}`).
- V: the model's logits width; it may exceed len(tokenizer), and the ids past the tokenizer are never allowed.
- grammar (`CompiledGrammar`): a spec compiled for one tokenizer and one V; it starts matchers.
  `GrammarCompiler` keeps the tokenizer's conversion (slow for 150k vocabularies) and the recent grammars.
- matcher (`GrammarMatcher`): one generation's position in its grammar: the tokens accepted so far.
- mask: a bool tensor [V], True where a token may come next. Special tokens other than EOS never are.
- EOS: the tokenizer's `eos_token_id`. Allowed exactly where the text so far is complete; the only token
  allowed once the grammar takes nothing more (`finished`). After an EOS only EOS is allowed, so a mask
  is never empty in a well-formed state: a masked row (common/sampling/logits_processing.py) keeps a token.
- block rows (`masks_along`): for a block of g tokens, the g + 1 masks before each token and after the
  whole block, the rows a verification rule reads (common/spec/acceptance_rules.py: p_target [g + 1, V]). The rows
  stop at the first token its row does not allow: that row is the last one returned (a verification rule
  gives such a token probability 0 under the masked target, so it never reads past it).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import llguidance
import llguidance.hf
import numpy as np
import torch

from common.sampling.params import GrammarError, GrammarSpec

log = logging.getLogger(__name__)

ANY_JSON_OBJECT = '{"type":"object"}'
# JSON laid out one way: ", " between items, ": " after keys, no other whitespace. Flexible whitespace lets a
# small model pad its JSON with newlines without end; a schema may choose otherwise with its own "x-guidance".
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
BITS_PER_WORD = 32


@dataclass(frozen=True)
class _MaskLayout:
    """How a bitmask of int32 words maps to tokens, shared by every matcher of one compiler."""

    vocab_size: int
    eos_token_id: int

    @property
    def n_words(self) -> int:
        return (self.vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD

    def unpack(self, words: torch.Tensor) -> torch.Tensor:
        """[rows, n_words] int32 bitmask -> [rows, V] bool. Token t is bit t % 32 of word t // 32; on a
        little-endian machine that is bit t % 8 of byte t // 8, what numpy's little-endian unpackbits reads
        (6 us for 49k tokens, 3 to 10 times faster than torch shifts or a byte table)."""
        bits = np.unpackbits(words.numpy().view(np.uint8), axis=-1, bitorder="little")
        return torch.from_numpy(bits).view(torch.bool)[:, : self.vocab_size]

    def eos_only(self, row: torch.Tensor) -> None:
        row.zero_()
        row[self.eos_token_id // BITS_PER_WORD] = _word_bit(self.eos_token_id % BITS_PER_WORD)


def _word_bit(bit: int) -> int:
    """The int32 value with only `bit` set (bit 31 is the sign bit)."""
    return (1 << bit) - (1 << 32 if bit == BITS_PER_WORD - 1 else 0)


def _grammar_text(spec: GrammarSpec) -> str:
    """The spec in llguidance's grammar format (not yet checked: constructing a matcher compiles it)."""
    try:
        if spec.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(spec.source)
        schema = json.loads(ANY_JSON_OBJECT if spec.kind == "json_object" else spec.source)
        if isinstance(schema, dict):
            schema.setdefault("x-guidance", JSON_LAYOUT)
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    except ValueError as err:
        raise GrammarError(f"the {spec.kind} grammar is not valid: {err}") from err


class GrammarCompiler:
    """Compiles specs for one tokenizer and logits width; keep one per model. Holds the tokenizer's conversion
    and an LRU of the `cache_size` most recent grammars (a grammar is immutable, so sharing one is safe)."""

    def __init__(self, tokenizer: object, vocab_size: int, cache_size: int = 32) -> None:
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise GrammarError("the tokenizer has no eos_token_id: a grammar needs EOS to end the output")
        if vocab_size < len(tokenizer):  # type: ignore[arg-type]
            raise GrammarError(f"logits width {vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
        try:
            self._lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        except ValueError as err:  # a slow (Python) tokenizer: llguidance reads the Rust one
            raise GrammarError(f"structured output needs a fast tokenizer: {err}") from err
        if sys.byteorder != "little":
            raise GrammarError("structured output reads token bitmasks as little-endian bytes: this machine is not")
        self.layout = _MaskLayout(vocab_size=vocab_size, eos_token_id=int(eos))
        self._cache_size = cache_size
        self._compiled: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar of `spec`, from the cache when it was compiled recently."""
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
        compiled = self._compile_uncached(spec)
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        return compiled

    def _compile_uncached(self, spec: GrammarSpec) -> CompiledGrammar:
        start = llguidance.LLMatcher(self._lltokenizer, _grammar_text(spec), log_level=0)
        if start.is_error():
            raise GrammarError(f"the {spec.kind} grammar does not compile: {start.get_error().strip()}")
        for warning in start.get_grammar_warnings():
            log.warning("%s grammar: %s", spec.kind, warning)
        return CompiledGrammar(spec=spec, layout=self.layout, start=start)


@dataclass(frozen=True)
class CompiledGrammar:
    """A spec compiled for one tokenizer and V; `matcher()` starts a generation (a copy, microseconds)."""

    spec: GrammarSpec
    layout: _MaskLayout = field(repr=False)
    start: llguidance.LLMatcher = field(repr=False)  # never advanced: matchers are copies of it

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self.start.deep_copy(), self.layout)


class GrammarMatcher:
    """One generation's state in its grammar (see the module's glossary). Not thread-safe: one per generation,
    `fork()` for another choice or for drafting ahead.

    EOS is counted here, not given to llguidance: the engine does not record an EOS that follows a stopped
    state, so its rollback count would drift from ours."""

    def __init__(self, engine: llguidance.LLMatcher, layout: _MaskLayout, n_eos: int = 0) -> None:
        self._engine = engine
        self._layout = layout
        self._n_eos = n_eos  # EOS tokens accepted; they come last (after an EOS only EOS is allowed)
        self._n_engine = 0  # tokens the engine consumed
        self._bitmask = torch.zeros((1, layout.n_words), dtype=torch.int32)
        self._mask: torch.Tensor | None = None  # allowed() of the current state, computed on demand

    @property
    def vocab_size(self) -> int:
        return self._layout.vocab_size

    @property
    def n_tokens(self) -> int:
        """Tokens accepted since the start (what `rollback` can undo)."""
        return self._n_engine + self._n_eos

    @property
    def finished(self) -> bool:
        """True once EOS was accepted or only EOS remains (the grammar takes nothing more, or stopped)."""
        return self._n_eos > 0 or self._engine.is_stopped()

    def allowed(self) -> torch.Tensor:
        """Bool [V]: the tokens that may come next. Shared until the state changes: do not modify it."""
        if self._mask is None:
            self._fill(self._bitmask[0])
            self._mask = self._layout.unpack(self._bitmask)[0]
        return self._mask

    def accept(self, token: int) -> None:
        """Advance by `token`; GrammarError (state unchanged) if the grammar does not allow it here."""
        self.accept_all([token])

    def accept_all(self, tokens: Iterable[int]) -> None:
        """Advance by every token, or by none: GrammarError names the first token not allowed."""
        tokens = [int(t) for t in tokens]
        n_allowed = self._count_allowed(tokens)
        if n_allowed < len(tokens):
            bad = tokens[n_allowed]
            where = f" (token {n_allowed} of {len(tokens)})" if len(tokens) > 1 else ""
            raise GrammarError(f"token {bad}{where} is not allowed by the grammar {self._state_words()}")
        n_engine = tokens.index(self._layout.eos_token_id) if self._layout.eos_token_id in tokens else len(tokens)
        if n_engine:
            if not self._engine.consume_tokens(tokens[:n_engine]):
                raise GrammarError(f"the grammar engine failed: {self._engine.get_error().strip()}")
            self._n_engine += n_engine
        self._n_eos += len(tokens) - n_engine
        self._mask = None

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens (GrammarError, state unchanged, if fewer were accepted)."""
        if not 0 <= n <= self.n_tokens:
            raise GrammarError(f"cannot roll back {n} tokens: {self.n_tokens} were accepted")
        undo_eos = min(n, self._n_eos)
        self._n_eos -= undo_eos
        undo_engine = n - undo_eos
        if undo_engine:
            if not self._engine.rollback(undo_engine):
                raise GrammarError(f"the grammar engine cannot roll back: {self._engine.get_error().strip()}")
            self._n_engine -= undo_engine
        if n:
            self._mask = None

    def fork(self) -> GrammarMatcher:
        """An independent matcher at the same state (rolling it back stops at this state)."""
        twin = GrammarMatcher(self._engine.deep_copy(), self._layout, n_eos=self._n_eos)
        twin._n_engine = self._n_engine
        twin._mask = self._mask
        return twin

    def masks_along(self, tokens: Sequence[int]) -> torch.Tensor:
        """Bool [len(tokens) + 1, V]: the mask before each token of a block and after the whole block, the state
        left as it was. If a token is not allowed by its row, that row is the last one: [i + 1, V] for the
        first disallowed token i (nothing raised)."""
        tokens = [int(t) for t in tokens]
        rows = torch.zeros((len(tokens) + 1, self._layout.n_words), dtype=torch.int32)
        words = rows.numpy()
        n_rows, advanced, mask = len(tokens) + 1, 0, self._mask
        try:
            for i, token in enumerate(tokens):
                self._fill(rows[i])
                if not (0 <= token < self.vocab_size and (int(words[i, token >> 5]) >> (token & 31)) & 1):
                    n_rows = i + 1
                    break
                self._advance(token)
                advanced += 1
            else:
                self._fill(rows[len(tokens)])
        finally:
            self.rollback(advanced)
            self._mask = mask
        return self._layout.unpack(rows[:n_rows])

    def _advance(self, token: int) -> None:
        """Accept a token already known to be allowed (no check: the mask said so)."""
        if token == self._layout.eos_token_id or self._n_eos:
            self._n_eos += 1
        else:
            if not self._engine.consume_token(token):
                raise GrammarError(f"the grammar engine refused an allowed token: {self._engine.get_error().strip()}")
            self._n_engine += 1
        self._mask = None

    def _fill(self, row: torch.Tensor) -> None:
        """Write the current state's bitmask into `row` (contiguous int32 [n_words])."""
        if self._n_eos:
            self._layout.eos_only(row)
            return
        self._engine.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        if self._engine.is_error():
            raise GrammarError(f"the grammar engine failed: {self._engine.get_error().strip()}")

    def _count_allowed(self, tokens: list[int]) -> int:
        """How many leading tokens the grammar allows from the current state (the state unchanged)."""
        eos = self._layout.eos_token_id
        in_range = next((i for i, t in enumerate(tokens) if not 0 <= t < self.vocab_size), len(tokens))
        only_eos = self._n_eos > 0 or self._engine.is_stopped()  # the engine validates no EOS once stopped
        n = 0 if only_eos else self._engine.validate_tokens(tokens[:in_range])
        if only_eos or (n and tokens[n - 1] == eos):
            while n < in_range and tokens[n] == eos:  # the engine counts one EOS: the rest follow it
                n += 1
        return n

    def _state_words(self) -> str:
        """Where the matcher is, for a message."""
        if self.finished:
            return f"after {self.n_tokens} tokens (the output is complete: only EOS may follow)"
        return f"after {self.n_tokens} tokens"
