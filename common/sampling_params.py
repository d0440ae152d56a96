"""How a generation samples: `SamplingParams`, importable without torch (command lines and settings build it).

The arithmetic that applies it to logits lives in common/sampling.py (temperature, top-k, top-p) and
common/logits_processing.py (logit_bias and the penalties, which read the tokens before each position).
Penalties count as vLLM does: presence and frequency over the generated tokens, repetition over the prompt
and the generated tokens.
"""

from __future__ import annotations

from dataclasses import dataclass


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
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise ValueError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}")
        ids = [token for token, _ in self.logit_bias]
        if ids != sorted(set(ids)) or any(not -100.0 <= bias <= 100.0 for _, bias in self.logit_bias):
            raise ValueError("logit_bias: each token id once, in increasing order, with a bias in [-100, 100]")

    @property
    def shapes_logits(self) -> bool:
        """Whether logits are transformed before sampling (then greedy is the argmax of the transformed logits)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @property
    def reads_logits(self) -> bool:
        """Whether picking a token needs the whole row of logits (else its argmax is all there is to read)."""
        return not self.greedy or self.shapes_logits

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
