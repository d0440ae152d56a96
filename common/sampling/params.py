"""How a generation samples: `SamplingParams`, importable without torch (command lines and settings build it).

The arithmetic that applies it to logits lives in common/sampling/distributions.py (temperature, top-k, top-p) and
common/sampling/logits_processing.py (a grammar's mask, logit_bias and the penalties, which read the tokens before each
position). Penalties count as vLLM does: presence and frequency over the generated tokens, repetition over the
prompt and the generated tokens. `GrammarSpec` is what structured output constrains the text to; the masks
come from common/sampling/grammar.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from common.errors import SprinterError

GRAMMAR_KINDS = ("json_object", "json_schema", "lark")


class GrammarError(SprinterError, ValueError):
    """A grammar or schema that does not compile or that the engine does not support, or a token the grammar
    does not allow: the message names what is wrong. Refuse the request (or the token)."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to; two strings, hashable (the compiled-grammar cache's key)."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}: expected one of {', '.join(GRAMMAR_KINDS)}")
        if not isinstance(self.source, str):
            raise GrammarError(f"a {self.kind} grammar's source is text, not {type(self.source).__name__}")
        if self.kind == "json_object" and self.source:
            raise GrammarError("a json_object grammar takes no source (any JSON object is allowed)")
        if self.kind != "json_object" and not self.source.strip():
            raise GrammarError(f"a {self.kind} grammar needs a source: it is empty")

    @classmethod
    def json_object(cls) -> GrammarSpec:
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return cls("json_object", "")

    @classmethod
    def json_schema(cls, schema: dict) -> GrammarSpec:
        """A JSON value that validates against `schema`. Key order is kept: it is the order properties come in."""
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema is a JSON object, not {type(schema).__name__}")
        try:
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise GrammarError(f"the JSON schema is not JSON: {err}") from err
        return cls("json_schema", text)

    @classmethod
    def lark(cls, text: str) -> GrammarSpec:
        """A Lark grammar (llguidance's dialect: `start` is the top rule; `%json{...}` embeds a JSON schema)."""
        return cls("lark", text)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k truncation
    top_p: float = 1.0
    seed: int = 0
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt and generated tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), sorted by id
    grammar: GrammarSpec | None = None  # structured output: only text the grammar allows
    # the raw log-probability of each emitted token and of the top N at its place (common/sampling/logprobs.py); None: none
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for the prompt's tokens, from the target's prefill (echo)

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name, value in (("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)):
            if not -2.0 <= value <= 2.0:  # also refuses NaN
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        for name, top in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if top is not None and not 0 <= top <= 20:
                raise ValueError(f"{name} (the top N) must be in [0, 20], got {top}")
        if not 0.01 <= self.repetition_penalty <= 100.0:  # smaller divides logits past float32's range
            raise ValueError(f"repetition_penalty must be in [0.01, 100], got {self.repetition_penalty}")
        ids = [token for token, _ in self.logit_bias]
        if ids != sorted(set(ids)) or any(not -100.0 <= bias <= 100.0 for _, bias in self.logit_bias):
            raise ValueError("logit_bias: each token id once, in increasing order, with a bias in [-100, 100]")

    @property
    def penalizes(self) -> bool:
        """Whether logit_bias or a penalty moves logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @property
    def shapes_logits(self) -> bool:
        """Whether logits are transformed before sampling (then greedy is the argmax of the transformed logits)."""
        return self.penalizes or self.grammar is not None

    @property
    def reads_logits(self) -> bool:
        """Whether a step needs the whole row of logits (else its argmax is all there is to read)."""
        return not self.greedy or self.shapes_logits or self.logprobs is not None or self.prompt_logprobs is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
