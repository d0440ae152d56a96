"""The settings of `sprinter bench`'s benches and what their flags default to.

Apart from the modules that measure (sim/bench/local.py, cloud.py, ...), which load torch, gRPC or ONNX Runtime,
so that building `sprinter`'s parser (sim/bench/command.py) imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sim.bench.prompts import PROMPTS_FILE
from sim.bench.registry import Bench

@dataclass(frozen=True)
class AssistedConfig:
    """One setting of transformers' assisted generation (`generate(assistant_model=...)`)."""

    name: str
    num_assistant_tokens: int
    schedule: str  # "constant" or "heuristic"
    confidence_threshold: float  # the assistant stops drafting below this probability (0 disables)


ASSISTED_CONFIGS = (
    AssistedConfig("hf-assisted-k5", 5, "constant", 0.0),
    AssistedConfig("hf-assisted-default", 20, "constant", 0.4),  # transformers' defaults
    AssistedConfig("hf-assisted-heuristic", 5, "heuristic", 0.0),
)


@dataclass(frozen=True)
class LocalBenchSettings:
    target: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"
    dtype: str = "bfloat16"
    prompts: Path = PROMPTS_FILE  # JSONL with prompt, chat, category
    max_new_tokens: int = 64
    temperatures: tuple[float, ...] = (0.0, 1.0)
    k: int = 5
    verifier_threshold: float = 0.5  # the confidence verifier of sprinter mode
    assisted: tuple[str, ...] = tuple(c.name for c in ASSISTED_CONFIGS)  # names of the configs to run
    seed: int = 0
    out: Path = Path("results/bench-local")


@dataclass(frozen=True)
class Config:
    name: str
    runtime: str  # "torch" or "onnx"
    dtype: str = "float32"  # torch only: the onnx graph is float32
    optimization: str = "all"
    fuse: bool = True
    io_binding: bool | None = None  # None: the runtime's default (binding on CUDA only)
    threads: int | None = None  # None: --threads
    weights: str = "float32"  # onnx only: "int8" is a lossy weight-only quantisation (MatMulNBits)


CONFIGS = (
    Config("torch-fp32", "torch"),
    Config("torch-bf16", "torch", dtype="bfloat16"),
    Config("onnx", "onnx"),
    Config("onnx-iobinding", "onnx", io_binding=True),
    Config("onnx-opt-basic", "onnx", optimization="basic"),
    Config("onnx-opt-disable", "onnx", optimization="disable"),
    Config("onnx-unfused", "onnx", fuse=False),
    Config("onnx-1-thread", "onnx", threads=1),
    Config("onnx-int8", "onnx", weights="int8"),
)


@dataclass(frozen=True)
class DraftBenchSettings:
    model: str = "qwen2.5-coder-0.5b"
    prompt_tokens: int = 40
    new_tokens: int = 64
    repeats: int = 2  # timed decodes per config per round
    rounds: int = 3  # passes over all configs (each rebuilds the runtime)
    threads: int | None = None  # intra-op threads (torch and ORT); None: the cores ONNX Runtime may use
    configs: tuple[str, ...] = tuple(c.name for c in CONFIGS)
    out: Path = Path("results/bench-draft")


@dataclass(frozen=True)
class CloudBenchSettings:
    targets: tuple[str, ...] = ("smollm2-135m", "qwen2.5-coder-1.5b")
    edges: tuple[int, ...] = (1, 2, 4, 8, 16)
    rounds: int = 8  # verify calls per edge
    k: int = 5  # draft tokens per block
    contexts: tuple[int, ...] = (0,)  # prompt lengths to pad to (0: the bench prompts as they are)
    batch_window_ms: float | None = None  # None: the cloud's own default
    max_batch: int = 16
    dtype: str = "bfloat16"
    out: Path = Path("results/bench-cloud")
    source: Path | None = None  # run the cloud from this checkout instead of this one
    engine: str = "resident"  # the cloud's --engine
    label: str | None = None  # what its rows are called (default: the engine's name)
    batching: tuple[bool, ...] = (True, False)  # measure with batching on, off, or both
    cpus: tuple[int, ...] = ()  # pin the cloud process (and its threads) to these cores
    device: str = "auto"  # the cloud's --device (passed only when set: an older --source may predate it)

    @property
    def row_label(self) -> str:
        return self.label or self.engine

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "out": str(self.out), "source": str(self.source) if self.source else None}


@dataclass(frozen=True)
class EngineBenchSettings:
    targets: tuple[str, ...] = ("qwen2.5-1.5b",)  # architectures (sim/bench/architectures)
    device: str = "auto"
    dtype: str = "bfloat16"
    edges: tuple[int, ...] = (1, 8, 32, 64)
    contexts: tuple[int, ...] = (128, 1024, 4096)
    k: int = 5  # draft tokens per verify
    rounds: int = 20  # timed rounds per row
    warmup: int = 3  # untimed rounds first (allocator, kernels' autotuning)
    accepted: int | None = None  # advance each context by this many accepted tokens per round (None: as verified)
    batching: tuple[bool, ...] = (True, False)
    attention: tuple[str, ...] = ("per-session", "paged")  # cloud serve's --attention, each measured
    out: Path = Path("results/bench-engine")

    def to_dict(self) -> dict[str, Any]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class PrefillBenchSettings:
    target: str = "smollm2-135m"
    dtype: str = "bfloat16"
    sessions: int = 8
    prompt_tokens: int = 4000
    k: int = 5  # draft tokens per verify
    quiet_s: float = 5.0  # verify alone for this long before the open
    serve_args: tuple[str, ...] = ()
    cloud_pythonpath: str | None = None
    out: Path = Path("results/bench-prefill")


@dataclass(frozen=True)
class PrefixBenchSettings:
    target: str = "qwen2.5-coder-1.5b"
    dtype: str = "bfloat16"
    history_tokens: int = 1000  # a conversation's first turn
    answer_tokens: int = 32  # each turn's answer (Generate, greedy)
    new_tokens: int = 40  # the second turn's user message
    edges: int = 8  # clients sharing the system prompts
    rounds: int = 2  # requests per client
    system_tokens: int = 500  # each of the 2 system prompts; also the n-choices prompt
    choices: int = 4
    kv_budget_mb: int = 512
    cloud_cpus: tuple[int, ...] = (0,)
    out: Path = Path("results/bench-prefix")

    def __post_init__(self) -> None:
        for name in ("history_tokens", "answer_tokens", "new_tokens", "edges", "rounds", "system_tokens", "choices",
                     "kv_budget_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class RolloutSettings:
    real_edges: int = 3
    simulated_edges: int = 200
    rounds: int = 10
    draft: str = "smollm2-135m"
    telemetry_pairs: int = 12  # requests to the edge with telemetry, and as many to the one without
    max_tokens: int = 64
    out: Path = Path("results/bench-rollout")


@dataclass(frozen=True)
class PlacementBenchSettings:
    target: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"
    dtype: str = "bfloat16"
    rtts_ms: tuple[float, ...] = (0.0, 20.0, 50.0, 100.0, 200.0)
    load_rtts_ms: tuple[float, ...] = (50.0,)  # RTTs measured again under load; empty: no load phase
    load_streams: int = 3  # other users' concurrent cloud-sd streams while under load
    prompts: int = 3
    max_tokens: int = 48
    k: int = 4
    mode: str = "sd-block"
    warmup: int = 2  # untimed requests per placement at each RTT (auto's: its learning)
    mqtt: str = "auto"  # the fleet plane: auto (Mosquitto here), off, or a broker URL
    out: Path = Path("results/bench-placement")

    def __post_init__(self) -> None:
        for name, flag in (("prompts", "--prompts"), ("max_tokens", "--max-new-tokens"), ("k", "-k"),
                           ("load_streams", "--load-streams")):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if any(rtt < 0 for rtt in self.rtts_ms + self.load_rtts_ms):
            raise ValueError("--rtt-ms and --load-rtt-ms must be >= 0")


@dataclass(frozen=True)
class LlamaCppBenchSettings:
    """`sprinter bench llama-cpp` (sim/bench/llama_cpp.py)."""

    target: str = "qwen2.5-coder-1.5b"
    edges: int = 8
    block: int = 6
    context: int = 1024
    repeats: int = 5
    prompts: int = 6  # of sim/data/bench_prompts.jsonl, for the decode step
    max_new_tokens: int = 48
    core: int = 1  # every process measured runs pinned to this core, one thread
    steps: tuple[str, ...] = ("verify", "decode", "turns")
    out: Path = Path("results/bench-llama-cpp")


LLAMA_CPP = Bench(
    "llama-cpp", "the llama.cpp engine against llama-bench and llama-server, one core", LlamaCppBenchSettings,
    "sim.bench.llama_cpp:bench_llama_cpp", plots=("plot.png",), quiet_http=True,
    helps={"target": "a GGUF preset or a .gguf path, run as shipped",
           "edges": "sessions whose blocks verify in one forward",
           "block": "tokens per block",
           "context": "tokens each session holds before its block",
           "repeats": "timed rounds of the verify step",
           "prompts": "bench prompts for the decode step (sim/data/bench_prompts.jsonl)",
           "max_new_tokens": "tokens each decode request asks for",
           "core": "the core every measured process is pinned to",
           "steps": "verify, decode, turns (a conversation's second turn, prefix cache on and off)"})
