"""The decoding modes, their settings, and the one table from a mode to its verification rule.

    mode            verify method (on the wire)   rule under sampling     rule under greedy
    sd              token                         token_verify            greedy_verify
    sd-block        block                         block_verify            greedy_verify
    sprinter        sprinter                      sprinter_verify         sprinter_verify
    sprinter-exact  block                         block_verify            greedy_verify

A method's name is also its rule's name in common/verification.py and, upper-cased after
`METHOD_`, its value of the `Method` enum in the .proto: the edge sends the method, the cloud
applies `verify_rule(method, sampling)`, and the local engine applies the same function here.
Every lossless rule reduces to greedy_verify on one-hot distributions; sprinter is not lossless and
checks only the flagged last token, so it keeps its own rule under greedy too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.call_policy import CallPolicy, CostModel, FlagPolicy, parse_policy
from common.sampling import SamplingParams
from common.verification import VERIFY_RULES, VerifyRule
from common.verifier import Verifier

MODES = ("draft", "target", "sd", "sd-block", "sprinter", "sprinter-exact")
VERIFY_METHOD = {"sd": "token", "sd-block": "block", "sprinter": "sprinter", "sprinter-exact": "block"}
SPECULATIVE_MODES = tuple(VERIFY_METHOD)
VERIFY_METHODS = ("token", "block", "sprinter")
# sprinter is the paper's loop: it calls at the verifier's flag, and its output depends on that rule.
POLICY_MODES = ("sd", "sd-block", "sprinter-exact")
# How an edge overlaps its rounds with the round trip (edge/decoding/pipeline.py); modes sd, sd-block and sprinter-exact.
PIPELINES = ("off", "ahead", "send-ahead")


def verify_rule(method: str, sampling: SamplingParams) -> VerifyRule:
    """The rule a verify `method` applies under these sampling settings (see the table above)."""
    if method not in VERIFY_METHODS:
        raise ValueError(f"unknown verify method {method!r}; expected one of {', '.join(VERIFY_METHODS)}")
    if sampling.greedy and method != "sprinter":
        return VERIFY_RULES["greedy"]  # every lossless rule reduces to it on one-hot distributions
    return VERIFY_RULES[method]


@dataclass(frozen=True)
class DecodeSettings:
    mode: str = "sd"
    max_new_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    k: int = 5  # block length of sd and sd-block
    max_run_length: int = 20  # cap on a pending block (sprinter modes, and any explicit policy)
    policy: str | None = None  # call policy spec (common/call_policy.py); None: the mode's default
    max_block: int | None = None  # the verifying backend's own cap on a block (the cloud's limits.max_block)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.max_new_tokens < 1 or self.k < 1 or self.max_run_length < 1 or (self.max_block or 1) < 1:
            raise ValueError("max_new_tokens, k, max_run_length and max_block must be >= 1")
        if self.policy is not None:
            if self.mode not in POLICY_MODES:
                raise ValueError(f"a call policy applies to modes {', '.join(POLICY_MODES)}, not {self.mode!r} "
                                 "(sprinter always calls at the verifier's flag)")
            parse_policy(self.policy)  # a bad spec fails here, before any decoding

    @property
    def block_cap(self) -> int:
        """Longest pending block: k under sd's default fixed:k (as before policies), else the run-length cap;
        never more than the backend verifies in one frame."""
        cap = self.k if self.mode in ("sd", "sd-block") and self.policy is None else self.max_run_length
        return min(cap, self.max_block) if self.max_block is not None else cap

    @property
    def verify_method(self) -> str:
        """The verify method of a speculative mode (the table in the module docstring)."""
        return VERIFY_METHOD[self.mode]

    def rule(self) -> VerifyRule:
        return verify_rule(self.verify_method, self.sampling)


def call_policy(settings: DecodeSettings, verifier: Verifier, cost_model: CostModel | None = None) -> CallPolicy:
    """A fresh policy for one generation of a speculative mode; goodput reads (not owns) `cost_model`.

    Defaults: sd and sd-block fixed:k, sprinter flag at the verifier's threshold, sprinter-exact goodput.
    """
    if settings.mode == "sprinter":
        return FlagPolicy(verifier.threshold)
    spec = settings.policy or ("goodput" if settings.mode == "sprinter-exact" else f"fixed:{settings.k}")
    if spec.strip() == "flag":  # a bare flag means the verifier's own threshold (a learned one is tuned), not 0.5
        return FlagPolicy(verifier.threshold)
    return parse_policy(spec, cost_model)
