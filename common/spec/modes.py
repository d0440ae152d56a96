"""The decoding modes, their settings, and the one table from a mode to its verification rule.

    mode            verify method (on the wire)   rule under sampling     rule under greedy
    sd              token                         token_verify            greedy_verify
    sd-block        block                         block_verify            greedy_verify
    sprinter        sprinter                      sprinter_verify         sprinter_verify
    sprinter-exact  block                         block_verify            greedy_verify
    cloud-sd        (none: verified in the cloud) block_verify            greedy_verify

A method's name is also its rule's name in common/spec/acceptance_rules.py and, upper-cased after
`METHOD_`, its value of the `Method` enum in the .proto: the edge sends the method, and every
verdict, local or in the cloud, is decided by `common.spec.acceptance_rules.decide`, which picks the rule (`rule_for`).
Every lossless rule reduces to greedy_verify on one-hot distributions; sprinter is not lossless and
checks only the flagged last token, so it keeps its own rule under greedy too.

`cloud-sd` is speculative decoding wholly in the cloud (cloud/cloud_sd.py): the cloud's own copy of
the draft proposes k tokens per round next to the target, which block-verifies them, and the edge only
streams the tokens (a Generate call with a speculation). Where a request drafts is its placement:
`placed_mode(mode, "cloud")` moves the lossless edge-drafting modes there; lossy sprinter has no cloud form.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.spec.call_policy import CallPolicy, FlagPolicy, parse_policy
from common.spec.cost_model import CostModel
from common.sampling.params import SamplingParams

if TYPE_CHECKING:  # the verifier needs torch; the mode table must not (`sprinter --help` reads it)
    from common.spec.verifier import Verifier


@dataclass(frozen=True)
class Mode:
    """What a decoding mode is. Code asks a mode for a trait; it never compares a mode's name."""

    name: str
    verify_method: str | None  # the rule's method (the table above); None: no round verifies a block
    drafts: bool  # the edge's draft proposes tokens (all but target and cloud-sd)
    uses_cloud: bool  # the target takes part (all but draft)
    lossless: bool  # distributed as the target's output (identical to it under greedy)
    uses_verifier: bool  # the learned verifier scores the draft's tokens (the sprinter modes)
    takes_policy: bool  # a call policy decides when a block goes (sprinter's is always its verifier's flag)
    default_policy: str | None  # the policy spec of a generation that names none ("{k}": the block length); None: no rounds
    releases_passed: bool  # tokens the verifier passes reach the client at once, never checked (sprinter)
    cloud_drafts: bool = False  # the cloud drafts next to the target and verifies its own blocks (cloud-sd)

    @property
    def speculative(self) -> bool:
        """Drafts blocks that a target verifies."""
        return self.verify_method is not None

    @property
    def pipelines(self) -> bool:
        """Can draft ahead while a block is in flight (edge/decoding/pipeline.py): the lossless modes whose edge
        drafts; sprinter's blocks end at a token its verifier expects rejected, the outcome least worth drafting for."""
        return self.placeable

    @property
    def first_token_from_open(self) -> bool:
        """Takes the target's first token from the session's open, while the first block is drafted."""
        return self.placeable

    @property
    def reference(self) -> bool:
        """Its output is the target's own (the target decodes alone): what the lossless modes reproduce,
        and what agreement and exact match are measured against."""
        return self.uses_cloud and not self.drafts and not self.cloud_drafts

    @property
    def placeable(self) -> bool:
        """Its drafting can move to the cloud (cloud-sd) without changing what it outputs: the lossless modes
        whose edge drafts blocks for the target."""
        return self.speculative and self.lossless and self.drafts

    @property
    def dists_on_rejection(self) -> bool:
        """Under sampling its rule needs a draft's full distribution only at a rejection (see
        `reads_draft_dist_at_rejection_only`): it may leave them out of its verify frames (sd)."""
        return self.verify_method is not None and reads_draft_dist_at_rejection_only(self.verify_method)

    @property
    def fixed_block(self) -> bool:
        """Under its default policy a block is k tokens long (sd's papers), not capped by max_run_length."""
        return self.default_policy == "fixed:{k}"


_MODE_LIST = (
    #    name              method      drafts uses_cloud lossless verifier policy default      releases_passed
    Mode("draft",          None,       True,  False,     False,   False,   False, None,        False),
    Mode("target",         None,       False, True,      True,    False,   False, None,        False),
    Mode("sd",             "token",    True,  True,      True,    False,   True,  "fixed:{k}", False),
    Mode("sd-block",       "block",    True,  True,      True,    False,   True,  "fixed:{k}", False),
    Mode("sprinter",       "sprinter", True,  True,      False,   True,    False, "flag",      True),
    Mode("sprinter-exact", "block",    True,  True,      True,    True,    True,  "goodput",   False),
    Mode("cloud-sd",       "block",    False, True,      True,    False,   False, "fixed:{k}", False, cloud_drafts=True),
)
MODE_RECORDS: dict[str, Mode] = {m.name: m for m in _MODE_LIST}
MODES = tuple(MODE_RECORDS)
POLICY_MODES = tuple(m.name for m in _MODE_LIST if m.takes_policy)
PIPELINED_MODES = tuple(m.name for m in _MODE_LIST if m.pipelines)
LOSSLESS_MODES = tuple(m.name for m in _MODE_LIST if m.lossless)
VERIFY_METHODS = ("token", "block", "sprinter")
# How an edge overlaps its rounds with the round trip (edge/decoding/pipeline.py); the modes that `pipelines`.
PIPELINES = ("off", "ahead", "send-ahead")
# What a sampled verify frame carries of the draft's distributions: all of them, or (modes whose rule
# `dists_on_rejection`) none, the cloud asking for what it needs at a rejection (cloud/residual.py).
DRAFT_DISTS = ("full", "on-rejection")
# What proposes a block's tokens (common/spec/propose/proposals.py; kept here so that `sprinter --help` needs no torch).
PROPOSERS = ("model", "suffix", "hybrid")
# The verify methods a draft tree may name (common/spec/acceptance_rules.py TREE_METHODS, less its "greedy", which no
# mode names): block verification's multi-path form. The token rule (sd) and lossy sprinter read one path.
TREE_VERIFY_METHODS = ("block",)
# Where a request's draft runs: the edge, the cloud (cloud-sd), or chosen per request by the cost model (auto).
PLACEMENTS = ("edge", "cloud", "auto")
CLOUD_DRAFTING = next(m.name for m in _MODE_LIST if m.cloud_drafts)
TARGET_MODE = next(m.name for m in _MODE_LIST if m.uses_cloud and not m.drafts and not m.cloud_drafts)
# `--mode auto` is no mode but a choice among three, per request, by the cost model (edge/decoding/placer.py): the
# target alone (TARGET_MODE), speculating on the edge in AUTO_SPECULATION, or in the cloud (CLOUD_DRAFTING). All are
# lossless, so whatever it chooses, the output is distributed as the target's (under greedy: is the target's).
AUTO_MODE = "auto"
AUTO_SPECULATION = "sprinter-exact"
MODE_CHOICES = (*MODES, AUTO_MODE)  # what a request or the daemon's --mode may name


def chooses_mode(name: str) -> bool:
    """`name` asks the edge to choose the mode (`auto`)."""
    return name == AUTO_MODE


def needs_cloud(name: str) -> bool:
    """A request naming `name` cannot run from the draft alone: auto chooses among ways of using a cloud, and every
    mode but draft uses one."""
    return chooses_mode(name) or not mode_of(settings_mode(name)).drafts


def settings_mode(name: str) -> str:
    """The mode a request naming `name` is set up and checked in: auto's edge speculation, or the mode itself."""
    return AUTO_SPECULATION if chooses_mode(name) else name


def placed_mode(name: str, placement: str) -> str:
    """The mode a request in mode `name` runs in when its drafting is placed at `placement` ("edge" or "cloud"):
    a placeable mode moves to cloud-sd in the cloud; every other mode stays as it is (sprinter has no cloud form,
    and target, draft and cloud-sd have nothing to move)."""
    if placement not in ("edge", "cloud"):
        raise ValueError(f"placement {placement!r} is not a decided one (edge or cloud)")
    return CLOUD_DRAFTING if placement == "cloud" and mode_of(name).placeable else name


def mode_of(name: str) -> Mode:
    """The mode called `name`, which may carry a sweep's policy suffix (`sprinter-exact@goodput`)."""
    base = name.partition("@")[0]
    if base not in MODE_RECORDS:
        raise ValueError(f"unknown mode {base!r}; choose one of {', '.join(MODES)}")
    return MODE_RECORDS[base]


def reads_last_draft_only(method: str) -> bool:
    """The rule reads the draft's distribution of the block's last token only (sprinter checks only it)."""
    return method == "sprinter"


def reads_draft_dist_at_rejection_only(method: str) -> bool:
    """The rule reads a draft's full distribution only where it rejects (the token rule: the residual there), so
    the edge may send the draft's probabilities of its tokens alone and answer the cloud's residual queries
    (`dists_on_rejection`). Block verification sums over the vocabulary at every position: it needs them all."""
    return method == "token"


@dataclass(frozen=True)
class DecodeSettings:
    mode: str = "sd"
    max_new_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    k: int = 5  # block length of sd and sd-block, and of the cloud's rounds in cloud-sd
    max_run_length: int = 20  # cap on a pending block (sprinter modes, and any explicit policy)
    policy: str | None = None  # call policy spec (common/spec/call_policy.py); None: the mode's default
    max_block: int | None = None  # the verifying backend's own cap on a block (the cloud's limits.max_block)
    proposer: str = "model"  # what proposes the tokens (common/spec/propose/proposals.py PROPOSERS)
    branch_tokens: int | str = 0  # tree branch tokens per round (common/spec/tree/branching.py): N, "auto", 0 off

    def __post_init__(self) -> None:
        mode_of(self.mode)  # an unknown mode fails here
        if self.proposer not in PROPOSERS:
            raise ValueError(f"unknown proposer {self.proposer!r}; choose one of {', '.join(PROPOSERS)}")
        check_branching(self.branch_tokens, self.traits)
        if self.max_new_tokens < 1 or self.k < 1 or self.max_run_length < 1 or (self.max_block or 1) < 1:
            raise ValueError("max_new_tokens, k, max_run_length and max_block must be >= 1")
        if self.policy is not None:
            if not self.traits.takes_policy:
                raise ValueError(f"a call policy applies to modes {', '.join(POLICY_MODES)}, not {self.mode!r} "
                                 "(sprinter always calls at the verifier's flag)")
            parse_policy(self.policy)  # a bad spec fails here, before any decoding

    @property
    def block_cap(self) -> int:
        """Longest pending block: k under sd's default fixed:k (as before policies), else the run-length cap;
        never more than the backend verifies in one frame."""
        cap = self.k if self.traits.fixed_block and self.policy is None else self.max_run_length
        return min(cap, self.max_block) if self.max_block is not None else cap

    @property
    def round_cap(self) -> int:
        """Longest block a round may send: `block_cap`, or with suffix drafting, whose copied runs follow their
        match rather than k, the run-length cap (the policy still places the draft's own tokens)."""
        if self.proposer == "model":
            return self.block_cap
        cap = max(self.block_cap, self.max_run_length)
        return min(cap, self.max_block) if self.max_block is not None else cap

    @property
    def traits(self) -> Mode:
        return MODE_RECORDS[self.mode]

    @property
    def verify_method(self) -> str:
        """The verify method of a speculative mode (the table in the module docstring)."""
        if self.traits.verify_method is None:
            raise ValueError(f"mode {self.mode!r} verifies no blocks")
        return self.traits.verify_method


def parse_branch_tokens(text: str) -> int | str:
    """`--branch-tokens`: a count >= 0 or "auto"."""
    if text == "auto":
        return text
    if not text.isdigit():
        raise ValueError(f"branch tokens must be a count >= 0 or 'auto', got {text!r}")
    return int(text)


def takes_trees(mode: Mode) -> bool:
    """Its edge drafts, and its rule verifies a draft tree (branching applies)."""
    return mode.drafts and mode.verify_method in TREE_VERIFY_METHODS


def check_branching(branch_tokens: int | str, mode: Mode) -> None:
    """Branching needs a mode whose edge drafts and whose rule verifies trees (TREE_VERIFY_METHODS)."""
    if branch_tokens == 0:
        return
    if branch_tokens != "auto" and (not isinstance(branch_tokens, int) or branch_tokens < 0):
        raise ValueError(f"branch_tokens must be a count >= 0 or 'auto', got {branch_tokens!r}")
    if not takes_trees(mode):
        tree_modes = ", ".join(m.name for m in _MODE_LIST if takes_trees(m))
        raise ValueError(f"branch_tokens: mode {mode.name!r} verifies one path (its rule reads no tree); "
                         f"branching applies to {tree_modes}")


def call_policy(settings: DecodeSettings, verifier: Verifier, cost_model: CostModel | None = None) -> CallPolicy:
    """A fresh policy for one generation of a speculative mode; goodput reads (not owns) `cost_model`.

    Defaults (each mode's `default_policy`): sd and sd-block fixed:k, sprinter flag at the verifier's threshold,
    sprinter-exact goodput.
    """
    from common.spec.verifier import learns_from_verdicts  # here: the verifier's module loads torch

    traits = settings.traits
    if traits.default_policy is None:
        raise ValueError(f"mode {settings.mode!r} drafts no blocks for a target: it has no call policy")
    if traits.releases_passed and learns_from_verdicts(verifier):
        raise ValueError(f"mode {settings.mode!r} releases the tokens its verifier passes unchecked, so no verdict "
                         "judges them: a verifier that learns from verdicts (margin-logistic) needs a lossless mode")
    spec = (settings.policy if traits.takes_policy else None) or traits.default_policy.format(k=settings.k)
    if spec.strip() == "flag":  # a bare flag means the verifier's own threshold (a learned one is tuned), not 0.5
        return FlagPolicy(verifier.threshold)
    return parse_policy(spec, cost_model)
