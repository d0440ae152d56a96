"""The engine, draft and local benches' settings and commands: `sprinter bench local|cloud|draft|prefill|prefix|
llama-cpp`, each flag a field (sim/bench/registry.py). Import-light: `sprinter --help` builds these."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from common.errors import UsageError
from common.model.devices import DEVICE_HELP
from edge.onnx_export.quantize import WEIGHT_FORMATS  # import-light: its quantisers load inside its functions
from sim.bench.prompts import PROMPTS_FILE
from sim.bench.registry import Bench, require_at_least

Dtype = Literal["bfloat16", "float32"]  # common/arguments.py DTYPE_NAMES


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
    dtype: Dtype = "bfloat16"
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
    runtime: str  # "torch", "onnx" or "llama.cpp" (the model's GGUF as shipped: no dtype, weights or ORT options)
    dtype: str = "float32"  # torch only: the onnx graph is float32
    optimization: str = "all"
    fuse: bool = True
    io_binding: bool | None = None  # None: the runtime's default (binding on CUDA only)
    threads: int | None = None  # None: --threads
    weights: str = "float32"  # onnx only: "int8", "int4" (MatMulNBits) and "w8a8" (integer GEMM) are lossy


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
    Config("onnx-int4", "onnx", weights="int4"),
    Config("onnx-w8a8", "onnx", weights="w8a8"),
    Config("llama.cpp", "llama.cpp"),
)


@dataclass(frozen=True)
class DraftBenchSettings:
    model: str = "qwen2.5-coder-0.5b"
    prompt_tokens: int = 40
    new_tokens: int = 64
    repeats: int = 2  # timed decodes per config per round
    rounds: int = 3  # passes over all configs (each rebuilds the runtime)
    threads: int | None = None  # intra-op threads (torch, ORT, llama.cpp); None: the cores ONNX Runtime may use
    # Every config but llama.cpp's, which needs llama-cpp-python (a build of its own): named, it runs beside them.
    configs: tuple[str, ...] = tuple(c.name for c in CONFIGS if c.runtime != "llama.cpp")
    side_rows: int = 3  # rows of a tree's side-by-side draft step, timed against one row where a runtime batches; 0: off
    out: Path = Path("results/bench-draft")


@dataclass(frozen=True)
class DraftAcceptanceBenchSettings:
    """`bench draft-acceptance` (sim/bench/draft_acceptance.py): greedy tokens per call of each draft weight format."""

    target: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"
    dtype: Literal["bfloat16", "float32"] = "bfloat16"  # the target's
    weights: tuple[str, ...] = ("int8", "float32", "int4", "w8a8")  # the first is what the others are held against
    prompts: Path | None = None  # None: the proposer suite
    per_category: int = 2
    skip_per_category: int = 0  # leave out the first N of each category (held out of what chose a recipe)
    max_tokens: int = 64
    k: int = 5
    out: Path = Path("results/bench-draft-acceptance")

    def __post_init__(self) -> None:
        require_at_least(self, 1, ("per_category", "max_tokens", "k"))
        unknown = [w for w in self.weights if w not in WEIGHT_FORMATS]
        if not self.weights or unknown:
            raise UsageError(f"--weights must name formats of {list(WEIGHT_FORMATS)}, got {list(self.weights)}")


@dataclass(frozen=True)
class EngineBenchSettings:
    """`bench cloud --random-weights` (sim/bench/engine.py): the resident engine in this process."""

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


BATCHINGS = {"both": (True, False), "on": (True,), "off": (False,)}


@dataclass(frozen=True)
class CloudBenchSettings:
    """`bench cloud`: a cloud process under N replaying edges; with `random_weights`, the engine in this process."""

    targets: tuple[str, ...] = ("smollm2-135m", "qwen2.5-coder-1.5b")
    edges: tuple[int, ...] | None = None  # None: 1,2,4,8,16 (--random-weights: 1,8,32,64)
    rounds: int | None = None  # verify calls per edge; None: 8 (--random-weights: 20 timed)
    k: int = 5  # draft tokens per block
    contexts: tuple[int, ...] = (0,)  # prompt lengths to pad to (0: the bench prompts as they are)
    batch_window_ms: float | None = None  # None: the cloud's own default
    max_batch: int = 16
    dtype: str = "bfloat16"
    source: Path | None = None  # run the cloud from this checkout instead of this one
    engine: Literal["resident", "vllm"] = "resident"  # the cloud's --engine
    label: str | None = None  # what its rows are called (default: the engine's name)
    batching: Literal["both", "on", "off"] = "both"
    cpus: tuple[int, ...] = ()  # pin the cloud process (and its threads) to these cores
    device: str = "auto"  # the cloud's --device (passed only when set: an older --source may predate it)
    random_weights: bool = False
    accepted: int | None = None
    warmup: int = EngineBenchSettings.warmup
    attention: tuple[str, ...] = EngineBenchSettings.attention
    out: Path | None = None  # None: results/bench-cloud (--random-weights: results/bench-engine)

    @property
    def row_label(self) -> str:
        return self.label or self.engine

    @property
    def batchings(self) -> tuple[bool, ...]:
        return BATCHINGS[self.batching]

    def with_defaults(self) -> CloudBenchSettings:
        """A cloud process's run: what None left to the bench filled in; refuses what only --random-weights takes."""
        if self.accepted is not None:
            raise UsageError("--accepted is for --random-weights (a real target decides)")
        return replace(self, edges=self.edges or (1, 2, 4, 8, 16), rounds=self.rounds or 8,
                       out=self.out or Path("results/bench-cloud"))

    def in_process(self) -> EngineBenchSettings:
        """--random-weights: the engine bench's settings; refuses the flags that need a cloud process."""
        refused = [flag for flag, given in (("--source", self.source), ("--label", self.label), ("--cpus", self.cpus),
                                            ("--batch-window-ms", self.batch_window_ms is not None),
                                            ("--engine vllm", self.engine != "resident")) if given]
        if refused:
            raise UsageError(f"{', '.join(refused)} need a cloud process; --random-weights runs the resident engine "
                             "in this one")
        engine = EngineBenchSettings()
        return EngineBenchSettings(
            targets=self.targets, device=self.device, dtype=self.dtype, edges=self.edges or engine.edges,
            contexts=engine.contexts if self.contexts == (0,) else self.contexts, k=self.k,
            rounds=self.rounds or engine.rounds, warmup=self.warmup, accepted=self.accepted, batching=self.batchings,
            attention=self.attention, out=self.out or engine.out)


@dataclass(frozen=True)
class PrefillBenchSettings:
    target: str = "smollm2-135m"
    dtype: str = "bfloat16"
    sessions: int = 8
    prompt_tokens: int = 4000
    k: int = 5  # draft tokens per verify
    quiet_s: float = 5.0  # verify alone for this long before the open
    serve_args: str = ""  # extra `cloud serve` flags, one string
    cloud_pythonpath: str | None = None
    label: str = "run"
    out: Path = Path("results/bench-prefill")


@dataclass(frozen=True)
class PrefixBenchSettings:
    target: str = "qwen2.5-coder-1.5b"
    dtype: Dtype = "bfloat16"
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
        require_at_least(self, 1, ("history_tokens", "answer_tokens", "new_tokens", "edges", "rounds", "system_tokens",
                                   "choices", "kv_budget_mb"))


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


LOCAL = Bench(
    "local", "every local decoding mode and transformers' assisted generation", LocalBenchSettings,
    "sim.bench.local:bench_local", plots=("tokens_per_s.png",),
    helps={"prompts": "JSONL with prompt, chat, category", "temperatures": "comma list",
           "verifier_threshold": "confidence verifier for sprinter",
           "assisted": "assisted-generation configs to run (comma list; empty for none)"})

CLOUD = Bench(
    "cloud", "verification throughput of one cloud process under N edges, batching on/off", CloudBenchSettings,
    "sim.bench.cloud:bench_cloud", plots=("verified_tokens_per_s.png",),
    helps={"targets": "comma list", "edges": "comma list; unset: 1,2,4,8,16 (--random-weights: 1,8,32,64)",
           "rounds": "verify calls per edge; unset: 8 (--random-weights: 20 timed)", "k": "draft tokens per block",
           "contexts": "prompt lengths in tokens, comma list (0: the bench prompts as they are)",
           "batch_window_ms": "unset: the cloud's own", "source": "run the cloud from this checkout (e.g. a worktree "
                                                                 "of an older commit)",
           "engine": "the cloud's engine (vllm: the environment `make vllm` builds)",
           "label": "name of this run's rows (unset: the engine's); rows of other labels in OUT/results.json are "
                    "kept, so runs compare engines or checkouts",
           "batching": "measure with batching on, off (--max-batch 1), or both",
           "cpus": "pin the cloud process to these cores (comma list)",
           "device": f"where the cloud's target runs (resident engine): {DEVICE_HELP.removesuffix(' (default auto)')}",
           "random_weights": "no cloud process: the engine in-process on --device, each target a real architecture "
                             "with random weights (sim/bench/architectures; no model packages needed)",
           "accepted": "--random-weights only: advance each context by this many accepted tokens per round "
                       "(unset: as the random target verifies, about 0)",
           "warmup": "--random-weights only: untimed rounds first",
           "attention": "--random-weights only: the resident engine's layouts to measure",
           "out": "unset: results/bench-cloud (--random-weights: results/bench-engine)"})

DRAFT = Bench(
    "draft", "per-token latency of the edge's draft runtime: ONNX Runtime vs llama.cpp vs torch", DraftBenchSettings,
    "sim.bench.draft:bench_draft",
    helps={"repeats": "timed decodes per config per round", "rounds": "passes over all configs (each rebuilds the "
                                                                      "runtime)",
           "threads": "intra-op threads, torch, ORT and llama.cpp (unset: the cores it may use)",
           "configs": "comma list of configs to run (llama.cpp, the draft's GGUF on llama-cpp-python, only when named)",
           "side_rows": "rows of a tree's side-by-side draft step (one batched step per token), timed against one row "
                        "where the runtime batches (torch, ONNX); 0: not timed"})

PREFILL = Bench(
    "prefill", "verify latency of busy sessions while a long prompt opens", PrefillBenchSettings,
    "sim.bench.prefill:bench_prefill",
    helps={"sessions": "busy sessions verifying in a loop", "serve_args": "extra `cloud serve` flags, one string",
           "cloud_pythonpath": "PYTHONPATH of the cloud process (another checkout)",
           "label": "the row's name in the table; rows of other labels in OUT/results.json are kept"})

PREFIX = Bench(
    "prefix", "what the cloud's prefix cache saves: conversations, shared prompts, n choices", PrefixBenchSettings,
    "sim.bench.prefix:bench_prefix", helps={"cloud_cpus": "cores the cloud is pinned to"})

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

DRAFT_ACCEPTANCE = Bench(
    "draft-acceptance", "greedy tokens per call each draft weight format keeps, along the target's own text",
    DraftAcceptanceBenchSettings, "sim.bench.draft_acceptance:bench_draft_acceptance",
    helps={"weights": "comma list of ONNX weight formats; the first is the reference",
           "dtype": "the target's dtype (the drafts run as exported)",
           "prompts": "a prompt file (JSONL with prompt, chat, category); default the proposer suite",
           "per_category": "N prompts of each category", "max_tokens": "target tokens per prompt",
           "skip_per_category": "leave out the first N prompts of each category",
           "k": "the block: draft tokens a call may keep"})

BENCHES = (LOCAL, CLOUD, DRAFT, DRAFT_ACCEPTANCE, PREFILL, PREFIX, LLAMA_CPP)
