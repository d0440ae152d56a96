"""The benches measured over the system under test (sim/sweep/system.py): their settings and their commands.

proposer, uplink and placement run the edge in this process behind the link at one RTT or several; features runs
it as a daemon without a link; policy is a network sweep (`sprinter simulate`) per temperature.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from common.errors import UsageError
from common.spec.modes import PROPOSERS, mode_of
from edge.onnx_export.quantize import DraftWeights  # import-light: its quantisers load inside its functions
from sim.bench.registry import Bench, require_at_least
from sim.sweep.settings import SimulateSettings

Dtype = Literal["bfloat16", "float32"]
SUITE = Path(__file__).resolve().parents[2] / "data" / "proposer_prompts.jsonl"
TREE_SUFFIX = "+tree:"  # a variant's label: the proposer, then its branch budget (common/spec/tree/branching.py)


@dataclass(frozen=True)
class ProposerBenchSettings:
    target: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"
    dtype: Dtype = "bfloat16"
    draft_runtime: Literal["torch", "onnx", "llama.cpp"] = "onnx"  # the edge's own (int8 weights)
    draft_weights: DraftWeights = "int8"  # ONNX only: the edge's default
    engine: Literal["resident", "llama.cpp"] = "resident"  # the cloud's
    baseline: Literal["llama-server", "off"] = "llama-server"  # what a user would run instead: the target's GGUF
    rtt_ms: float = 50.0
    modes: tuple[str, ...] = ("sd-block",)
    proposers: tuple[str, ...] = PROPOSERS
    branch_tokens: tuple[str, ...] = ("0",)  # of each variant: "0" (one path), a count, or "auto"
    temperature: float = 0.0  # 0: greedy; else sampled, each pass with its own seed
    skip_per_category: int = 0  # prompt 1 of each category is held out of fitting
    fit_calibration: Path | None = None  # the copies' rates measured here, shipped beside the verifier
    repeats: int = 3
    per_category: int | None = None  # None: all
    categories: tuple[str, ...] = ()  # empty: every category of the suite
    max_tokens: int = 128
    k: int = 5
    suffix_cache: Literal["on", "off"] = "on"
    prompts: Path | None = None  # None: SUITE
    out: Path = Path("results/bench-proposer")

    def __post_init__(self) -> None:
        if self.draft_runtime != "onnx" and self.draft_weights != "int8":
            raise UsageError(f"--draft-weights {self.draft_weights} is for --draft-runtime onnx, not "
                             f"{self.draft_runtime}")

    @property
    def runtime_weights(self) -> str | None:
        """The ONNX draft's weights; None for the other runtimes, whose weights are not ours to choose."""
        return self.draft_weights if self.draft_runtime == "onnx" else None

    @property
    def variants(self) -> tuple[str, ...]:
        """Each proposer with each branch budget: `model`, or `model+tree:auto` with branching on."""
        return tuple(p if b == "0" else f"{p}{TREE_SUFFIX}{b}" for p in self.proposers for b in self.branch_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class UplinkBenchSettings:
    target: str = "smollm2-135m"
    draft: str = "smollm2-135m:layers=4"
    dtype: Dtype = "float32"
    rtt_ms: tuple[float, ...] = (20.0, 100.0)
    bandwidth_mbps: float = 20.0  # each way; 0: unlimited
    prompts: int = 3
    max_tokens: int = 48
    k: int = 4
    temperature: float = 1.0
    seed: int = 0
    out: Path = Path("results/bench-uplink")


@dataclass(frozen=True)
class PlacementBenchSettings:
    target: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"
    dtype: Dtype = "bfloat16"
    rtt_ms: tuple[float, ...] = (0.0, 20.0, 50.0, 100.0, 200.0)
    load_rtt_ms: tuple[float, ...] = (50.0,)  # empty: no load phase
    load_streams: int = 3
    prompts: int = 3
    max_new_tokens: int = 48
    k: int = 4
    mode: str = "sd-block"
    warmup: int = 2  # auto's: its learning
    mqtt: str = "auto"
    out: Path = Path("results/bench-placement")

    def __post_init__(self) -> None:
        require_at_least(self, 1, ("prompts", "max_new_tokens", "k", "load_streams"))
        if self.warmup < 0:
            raise UsageError(f"--warmup must be >= 0, got {self.warmup}")
        if any(rtt < 0 for rtt in self.rtt_ms + self.load_rtt_ms):
            raise UsageError("--rtt-ms and --load-rtt-ms must be >= 0")
        if not mode_of(self.mode).placeable:
            raise UsageError(f"--mode {self.mode!r} has no cloud form to place: choose a placeable mode (e.g. sd-block)")


@dataclass(frozen=True)
class FeaturesBenchSettings:
    target: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"
    dtype: Dtype = "bfloat16"
    modes: tuple[str, ...] = ("sd-block", "sprinter-exact")
    prompts: int = 4
    repeats: int = 2
    max_tokens: int = 64
    out: Path = Path("results/bench-features")


@dataclass(frozen=True)
class PolicyBenchSettings:
    target: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"
    mode: str = "sprinter-exact"
    policies: tuple[str, ...] = ("fixed:3", "fixed:5", "fixed:8", "heuristic", "flag", "goodput")
    temperatures: tuple[float, ...] = (0.0, 1.0)
    rtt_ms: tuple[float, ...] = (0.0, 50.0, 100.0, 200.0)
    limit: int = 4
    max_new_tokens: int = 40
    fleet_validation: bool = False
    out: Path = Path("results/bench-policy")

    def sweeps(self) -> list[SimulateSettings]:
        """One sweep per temperature, into OUT/T<temperature>; the other sweep settings keep their defaults."""
        methods = tuple(f"{self.mode}@{policy}" for policy in self.policies)
        try:
            return [SimulateSettings(out=self.out / f"T{temperature:g}", target=self.target, draft=self.draft,
                                     modes=methods, rtt_ms=self.rtt_ms, temperature=temperature, limit=self.limit,
                                     max_new_tokens=self.max_new_tokens, fleet_validation=self.fleet_validation)
                    for temperature in self.temperatures]
        except ValueError as err:  # a bad policy or mode, said before any process starts
            raise UsageError(f"--mode {self.mode} with --policies {','.join(self.policies)}: {err}") from None


PROPOSER = Bench(
    "proposer", "tokens per round trip: the draft model, suffix and hybrid drafting, per category",
    ProposerBenchSettings, "sim.bench.proposer:bench_proposer", plots=("proposers.png",), quiet_http=True,
    helps={"draft_runtime": "the edge's draft runtime", "engine": "the cloud's engine",
           "draft_weights": "the ONNX draft's weights (docs/edge.md); other runtimes refuse any but the default",
           "baseline": "llama-server: llama.cpp's server alone on the cloud's core, the same prompts as the same token "
                       "ids, one more row per category (needs the target's GGUF preset); off: our variants only",
           "modes": "comma list", "proposers": "comma list",
           "branch_tokens": "comma list of branch budgets (0, a count, auto): each proposer runs with each, labelled "
                            "`model+tree:auto`; 0 is one path",
           "temperature": "0: greedy; else sampled, a seed per pass",
           "skip_per_category": "leave out the first N prompts of each category (1: hold prompt 1 out of a "
                                "calibration fit)",
           "fit_calibration": "write the copies' rates measured here to this JSON (shipped as "
                              "edge/verifiers/PAIR[__sampling]/suffix_calibration.json)",
           "repeats": "interleaved passes over the prompts (medians reported)",
           "per_category": "the first N prompts of each category (none: all)",
           "categories": "comma list (empty: every category of the suite)", "k": "sd's block length",
           "prompts": "a prompt file (JSONL: id, category, prompt, chat; none: sim/data/proposer_prompts.jsonl)"})
UPLINK = Bench(
    "uplink", "sampled sd's link bytes: full draft distributions against on-rejection", UplinkBenchSettings,
    "sim.bench.uplink:bench_uplink", quiet_http=True,
    helps={"rtt_ms": "comma list", "bandwidth_mbps": "each way; 0: unlimited", "prompts": "the first N bench prompts",
           "k": "sd's block length", "seed": "the first prompt's sampling seed (the next: seed + 1, ...)"})
PLACEMENT = Bench(
    "placement", "edge, cloud and auto placement of the draft over RTTs and under load", PlacementBenchSettings,
    "sim.bench.placement:bench_placement", plots=("tokens_per_s.png",), quiet_http=True,
    helps={"draft": "the edges' draft, and the cloud's (cloud serve --draft)", "rtt_ms": "comma list",
           "load_rtt_ms": "RTTs measured again under load, comma list (empty: no load phase)",
           "load_streams": "other users' concurrent cloud-sd streams under load",
           "prompts": "the first N bench prompts", "k": "draft tokens per round", "mode": "the placeable mode measured",
           "warmup": "untimed requests per placement at each RTT",
           "mqtt": "fleet plane: auto (Mosquitto here), off, or a broker URL"})
FEATURES = Bench(
    "features", "what structured output, logprobs and tool calls cost, against plain requests", FeaturesBenchSettings,
    "sim.bench.features:bench_features", quiet_http=True,
    helps={"modes": "comma list", "prompts": "the first N of the bench's 4 prompts",
           "repeats": "passes over the prompts"})
POLICY = Bench(
    "policy", "sprinter-exact with each call policy over the network sweep", PolicyBenchSettings,
    "sim.bench.policy:bench_policy", quiet_http=True,
    helps={"mode": "the mode whose call policy varies", "policies": "comma list",
           "temperatures": "comma list; one sweep each", "rtt_ms": "comma list", "limit": "prompts",
           "out": "each temperature's sweep goes into OUT/T<temperature>"})

@dataclass(frozen=True)
class AutoBenchSettings:
    target: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"
    dtype: Dtype = "bfloat16"
    engine: Literal["resident", "llama.cpp"] = "resident"
    draft_runtime: Literal["onnx", "torch", "llama.cpp"] = "onnx"  # the edge's own
    verifier: str = "auto"
    baseline: Literal["llama-server", "off"] = "llama-server"  # what a user would run instead: the target's GGUF
    rtt_ms: tuple[float, ...] = (0.0, 50.0, 100.0, 200.0)
    passes: int = 3
    prompts: int = 4
    max_new_tokens: int = 48
    k: int = 5
    out: Path = Path("results/bench-auto")

    def __post_init__(self) -> None:
        require_at_least(self, 1, ("passes", "prompts", "max_new_tokens", "k"))
        if not self.rtt_ms or min(self.rtt_ms) < 0:
            raise UsageError(f"--rtt-ms must be a non-empty list of values >= 0, got {self.rtt_ms}")


AUTO = Bench(
    "auto", "--mode auto against target, sprinter-exact and cloud-sd at each RTT, on one cloud engine",
    AutoBenchSettings, "sim.bench.auto:bench_auto", quiet_http=True,
    helps={"engine": "the cloud's engine", "draft_runtime": "the edge's draft runtime",
           "verifier": "the edge's verifier (auto: the one shipped for the pair)", "rtt_ms": "comma list",
           "baseline": "llama-server: llama.cpp's server alone on the cloud's core, one more method (needs the "
                       "target's GGUF preset); off: our methods only",
           "passes": "interleaved passes; each method's median is reported", "prompts": "the first N bench prompts"})

BENCHES = (POLICY, FEATURES, UPLINK, PLACEMENT, PROPOSER, AUTO)
