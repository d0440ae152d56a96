"""What `sprinter cloud serve` is told, checked before anything starts.

Every refusal names the flag to change. The one check that needs the model (does the KV budget hold
one full context?) is `check_kv_budget`, run once the model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.addresses import is_loopback
from common.spec.modes import PROPOSERS
from common.model.devices import DeviceError, resolve_device


ENGINES = ("resident", "vllm", "llama.cpp")
ATTENTIONS = ("auto", "per-session", "paged")  # the resident engine's KV layout and attention (cloud/packed_forward.py)


ON_OFF = ("suffix_cache", "cost_table")  # settings that are "on" or "off"
AUTO_ON_OFF = ("query_tiles", "cuda_graphs")  # settings that are "auto" (by device), "on" or "off"


@dataclass(frozen=True)
class CloudSettings:
    target: str = "tiny-random"
    draft: str | None = None  # the cloud's own draft (mode cloud-sd: cloud/cloud_sd.py); None: the cloud drafts nothing
    proposer: str = "model"  # cloud-sd's proposer for a Generate that names none (Speculation.proposer overrides it)
    suffix_cache: str = "on"  # cloud-sd's copying proposers also copy an edge identity's earlier outputs ("off": not)
    cost_table: str = "on"  # cloud/cost_table.py: time the target's forwards at start and report them in GetInfo
    dtype: str = "bfloat16"
    device: str = "auto"  # common/model/devices.py: where the resident engine's weights and KV live
    attention: str = "auto"  # per-session buffers, or one page pool (auto: paged on CUDA, per-session on a CPU)
    # cloud/query_tiles.py: paged forwards pad each session's rows to the fused kernel's 16-row query tile, so a tile
    # reads only its own session's pages (auto: on CUDA, where the kernel is fused; off on a CPU, where it is not)
    query_tiles: str = "auto"
    # cloud/cuda_graphs.py: paged forwards with query tiles replayed from a CUDA graph per bucket (auto: on CUDA)
    cuda_graphs: str = "auto"
    engine: str = "resident"  # cloud/engine.py: the embedded engine, vLLM (its own environment, `make vllm`) or llama.cpp
    threads: int | None = None  # llama.cpp's threads (--engine llama.cpp); None: one per core this process may use
    # vLLM's own knobs (--engine vllm only): None leaves vLLM's default
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float | None = None  # instead of --kv-budget-mb: a share of each GPU's memory
    quantization: str | None = None
    vllm_eager: bool = False  # vLLM's enforce_eager: no torch.compile warm-up at start, no CUDA graphs
    max_logprobs: int = 64  # the largest support a sampled verify may read per row (cloud/vllm_engine.py)
    kv_block_tokens: int | None = None  # vLLM's prefix-cache block; None: 32 on CPU, vLLM's default elsewhere
    draft_block: int = 5  # vLLM's draft tokens per round with --draft (its speculation is configured at start)
    host: str = "127.0.0.1"
    port: int = 50051
    tls_cert: Path | None = None
    tls_key: Path | None = None
    auth_tokens: Path | None = None
    allow_unauthenticated: bool = False  # serve a non-loopback address without tokens anyway
    max_sessions: int = 64
    kv_budget_mb: int = 2048
    max_block: int = 32
    max_tree_tokens: int = 32  # draft tokens per tree frame (resident engine only; 0: chains only); max_block's KV
    max_context: int = 4096
    # cloud/residual.py: how the token rule's residual is sampled for an edge that sends no draft distributions
    residual_candidates: int = 16
    residual_queries: int = 2
    idle_timeout_s: float = 300.0
    # A session used within this many seconds is not evicted to admit another: the newcomer waits its turn
    # (RESOURCE_EXHAUSTED with a retry hint) instead of the two evicting each other, each eviction a prefill.
    evict_grace_s: float = 2.0
    # Nor is a session older than the work admitted (seniority, cloud/sessions.py) unless idle this long: the newest
    # request waits for room instead of pushing out one that came before it, which would then wait again at reopen.
    evict_older_idle_s: float = 30.0
    # cloud/admission_queue.py: work that cannot be admitted now waits in one fair line, at most this many places
    queue_max: int = 1024
    queue_grace_s: float = 10.0  # a place outlives its edge's broken stream this long (a reconnect takes it back)
    batch_window_ms: float = 0.0  # continuous batching: a forward starts as soon as the engine is free
    max_batch: int = 8
    max_prefill_chunk: int = 256  # prompt tokens per forward; a chunk rides along with the waiting verifies
    max_forward_tokens: int = 1024  # tokens per packed forward (verifies plus at most one prefill chunk)
    # cloud/prefix_cache.py: KV reused across sessions by prompt prefix, within one edge identity unless shared
    prefix_cache: bool = True
    share_prefix_cache: bool = False
    # Per-edge quotas (an edge is an authenticated identity). None: the global limit. Whatever they are,
    # eviction takes from the edge using the largest share first, so one edge cannot evict the others.
    edge_max_sessions: int | None = None
    edge_kv_budget_mb: int | None = None
    edge_max_generate: int = 4  # concurrent Generate calls per edge
    max_streams: int = 256  # concurrent Session + Generate calls, all edges together
    keepalive_s: float = 30.0  # the server pings a silent connection this often ...
    keepalive_timeout_s: float = 10.0  # ... and drops it when a ping is not answered within this
    max_connection_idle_s: float = 900.0  # a connection without calls for this long is closed
    metrics_port: int | None = None
    metrics_read_timeout_s: float = 5.0  # a scraper must send its request within this
    drain_s: float = 30.0
    # The fleet plane (proto/mqtt.md): announce this replica's load on the broker at `mqtt`.
    mqtt: str | None = None
    mqtt_ca: Path | None = None
    mqtt_cert: Path | None = None
    mqtt_key: Path | None = None
    mqtt_keepalive: int = 10
    replica_id: str | None = None  # default: cloud-PORT
    advertise: str | None = None  # the host:port edges should dial (default: --host:--port)
    otlp_traces_endpoint: str | None = None  # common/tracing.py: off unless given

    def __post_init__(self) -> None:
        for error in self.problems():
            raise ValueError(error)

    def problems(self) -> list[str]:
        checks = [
            (self.max_sessions >= 1, f"--max-sessions must be >= 1, got {self.max_sessions}"),
            (self.kv_budget_mb >= 1, f"--kv-budget-mb must be >= 1, got {self.kv_budget_mb}"),
            (self.max_block >= 1, f"--max-block must be >= 1, got {self.max_block}"),
            (self.residual_candidates >= 1, f"--residual-candidates must be >= 1, got {self.residual_candidates}"),
            (self.residual_queries >= 0, f"--residual-queries must be >= 0 (0: ask for the whole distribution at "
                                         f"once), got {self.residual_queries}"),
            (self.max_context >= self.max_block + 2,
             f"--max-context {self.max_context} leaves no room for a block of --max-block {self.max_block} "
             f"after a prompt: it must be at least {self.max_block + 2}"),
            (self.max_batch >= 1, f"--max-batch must be >= 1 (1 turns batching off), got {self.max_batch}"),
            (self.batch_window_ms >= 0, f"--batch-window-ms must be >= 0, got {self.batch_window_ms}"),
            (self.idle_timeout_s > 0, f"--idle-timeout-s must be > 0, got {self.idle_timeout_s}"),
            (self.evict_grace_s >= 0, f"--evict-grace-s must be >= 0, got {self.evict_grace_s}"),
            (self.evict_older_idle_s >= 0, f"--evict-older-idle-s must be >= 0, got {self.evict_older_idle_s}"),
            (self.queue_max >= 1, f"--queue-max must be >= 1, got {self.queue_max}"),
            (self.queue_grace_s >= 0, f"--queue-grace-s must be >= 0, got {self.queue_grace_s}"),
            (self.max_prefill_chunk >= 1, f"--max-prefill-chunk must be >= 1, got {self.max_prefill_chunk}"),
            (self.max_tree_tokens >= 0, f"--max-tree-tokens must be >= 0 (0: chains only), got {self.max_tree_tokens}"),
            (self.max_forward_tokens >= self.max_verify_tokens + 1,
             f"--max-forward-tokens must hold one verify of --max-block {self.max_block} and --max-tree-tokens "
             f"{self.max_tree_tokens} (at least {self.max_verify_tokens + 1}), got {self.max_forward_tokens}"),
            (self.edge_max_sessions is None or 1 <= self.edge_max_sessions <= self.max_sessions,
             f"--edge-max-sessions must be in 1..--max-sessions ({self.max_sessions}), got {self.edge_max_sessions}"),
            (self.edge_kv_budget_mb is None or 1 <= self.edge_kv_budget_mb <= self.kv_budget_mb,
             f"--edge-kv-budget-mb must be in 1..--kv-budget-mb ({self.kv_budget_mb}), got {self.edge_kv_budget_mb}"),
            (self.edge_max_generate >= 0, f"--edge-max-generate must be >= 0, got {self.edge_max_generate}"),
            (self.max_streams >= 1, f"--max-streams must be >= 1, got {self.max_streams}"),
            (self.keepalive_s > 0 and self.keepalive_timeout_s > 0,
             "--keepalive-s and --keepalive-timeout-s must be > 0"),
            (self.max_connection_idle_s > 0, f"--max-connection-idle-s must be > 0, got {self.max_connection_idle_s}"),
            (self.metrics_read_timeout_s > 0, f"--metrics-read-timeout-s must be > 0, got {self.metrics_read_timeout_s}"),
            (self.drain_s >= 0, f"--drain-s must be >= 0, got {self.drain_s}"),
            (is_loopback(self.host) or self.auth_tokens is not None or self.allow_unauthenticated,
             f"--host {self.host} is reachable from other machines, and without --auth-tokens anyone there could use "
             f"this cloud: pass --auth-tokens FILE, or --allow-unauthenticated if the network is trusted"),
            (self.mqtt_keepalive >= 1, f"--mqtt-keepalive must be >= 1, got {self.mqtt_keepalive}"),
            (self.engine in ENGINES, f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}"),
            (self.attention in ATTENTIONS, f"--attention must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}"),
            (self.tensor_parallel_size >= 1, f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}"),
            (self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1,
             f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"),
            (self.max_logprobs >= 1, f"--max-logprobs must be >= 1, got {self.max_logprobs}"),
            (self.engine != "vllm" or self.draft is None or 1 <= self.draft_block <= self.max_block,
             f"--draft-block must be in 1..--max-block ({self.max_block}), got {self.draft_block}"),
            (self.kv_block_tokens is None or self.kv_block_tokens >= 1,
             f"--kv-block-tokens must be >= 1, got {self.kv_block_tokens}"),
            (self.proposer in PROPOSERS, f"--proposer must be one of {', '.join(PROPOSERS)}, got {self.proposer!r}"),
            *((getattr(self, n) in ("on", "off"), f"--{n.replace('_', '-')} must be on or off") for n in ON_OFF),
            (self.proposer == "model" or self.draft is not None,
             f"--proposer {self.proposer} proposes around the cloud's draft model: it needs --draft"),
            (self.engine == "resident" or self.max_tree_tokens in (0, CloudSettings.max_tree_tokens),
             f"--max-tree-tokens {self.max_tree_tokens} does not apply to --engine {self.engine}: it has no tree "
             "attention and verifies chains only (its limits always say 0 tree tokens)"),
            (self.proposer == "model" or self.engine != "vllm",
             f"--proposer {self.proposer} does not apply to --engine vllm: its cloud-sd is vLLM's own draft-model "
             "speculation, which proposes from the draft model alone"),
        ]
        return [message for ok, message in checks if not ok] + self._engine_problems() + self._device_problems()

    def _device_problems(self) -> list[str]:
        """Settings whose meaning depends on the device (auto ones decide by it)."""
        unknown = [f"--{n.replace('_', '-')} must be auto, on or off" for n in AUTO_ON_OFF
                   if getattr(self, n) not in ("auto", "on", "off")]
        if unknown:
            return unknown
        try:
            device = resolve_device(self.device)
        except DeviceError as err:
            return [str(err)]
        if self.engine != "resident":
            return []
        if self.query_tiles == "on" and not self.paged(device.type):
            return [f"--query-tiles on pads the rows of paged attention's forwards, and this cloud's attention on "
                    f"{device.type} is per-session: add --attention paged, or leave --query-tiles at auto"]
        if self.cuda_graphs == "on" and device.type != "cuda":
            return [f"--cuda-graphs on needs a CUDA device (a graph replays CUDA kernels), and this cloud's target is "
                    f"on {device.type}: leave --cuda-graphs at auto or off"]
        if self.cuda_graphs == "on" and not self.tiled(device.type):
            return ["--cuda-graphs on replays paged forwards with query tiles: it needs --attention paged or auto "
                    "and --query-tiles on or auto"]
        return []

    def _engine_problems(self) -> list[str]:
        """Flags that mean something to one engine only are refused on the others, never ignored."""
        defaults = CloudSettings.__dataclass_fields__
        vllm_only = {
            "tensor_parallel_size": "--tensor-parallel-size", "gpu_memory_utilization": "--gpu-memory-utilization",
            "quantization": "--quantization", "kv_block_tokens": "--kv-block-tokens", "vllm_eager": "--vllm-eager",
            "max_logprobs": f"--max-logprobs (the {self.engine} engine reads whole rows)",
            "draft_block": f"--draft-block (the {self.engine} engine drafts each request's own speculation.block)",
        }
        if self.engine == "vllm":
            not_here = {
                "batch_window_ms": "--batch-window-ms (vLLM schedules its own batches)",
                "max_prefill_chunk": "--max-prefill-chunk (vLLM chunks prefills within --max-forward-tokens)",
                "edge_kv_budget_mb": "--edge-kv-budget-mb (vLLM's KV cache is shared, not held per session)",
                "device": "--device (vLLM picks its own platform: a GPU when it sees one)",
                "attention": "--attention (vLLM has its own attention backends)",
                "query_tiles": "--query-tiles (vLLM has its own attention backends)",
                "cuda_graphs": "--cuda-graphs (vLLM captures its own; --vllm-eager turns them off)",
                "share_prefix_cache": "--share-prefix-cache (vLLM keeps each session's cache blocks its own)",
                "threads": "--threads (llama.cpp's)",
            }
        elif self.engine == "llama.cpp":
            not_here = vllm_only | {
                "device": "--device (this llama.cpp build runs on the CPU)",
                "attention": "--attention (llama.cpp has its own attention)",
                "query_tiles": "--query-tiles (llama.cpp has its own attention)",
                "cuda_graphs": "--cuda-graphs (this llama.cpp build runs on the CPU)",
                "dtype": "--dtype (llama.cpp computes in the GGUF file's own types)",
            }
        else:
            not_here = vllm_only | {"threads": "--threads (llama.cpp's; the resident engine uses torch's threads)"}
        threads = [] if self.threads is None or self.threads >= 1 else [f"--threads must be >= 1, got {self.threads}"]
        return threads + [f"{flag} does not apply to --engine {self.engine}" for name, flag in not_here.items()
                          if getattr(self, name) != defaults[name].default]

    def paged(self, device_type: str) -> bool:
        """Whether the resident engine keeps its KV in one page pool (`--attention`, auto by device)."""
        return self.attention == "paged" or (self.attention == "auto" and device_type == "cuda")

    def tiled(self, device_type: str) -> bool:
        """Whether paged forwards pad each session's rows to the kernel's query tile (`--query-tiles`, auto: on CUDA,
        where flex_attention is fused: cloud/paged_attention.py)."""
        return self.paged(device_type) and (self.query_tiles == "on" or
                                            (self.query_tiles == "auto" and device_type == "cuda"))

    def graphed(self, device_type: str) -> bool:
        """Whether the resident engine replays its tiled paged forwards from CUDA graphs (`--cuda-graphs`, auto: on
        CUDA)."""
        return device_type == "cuda" and self.tiled(device_type) and self.cuda_graphs in ("auto", "on")

    @property
    def max_verify_tokens(self) -> int:
        """The most draft tokens one verify frame writes into a session's KV: a chain's, or a whole tree's."""
        return max(self.max_block, self.max_tree_tokens)

    @property
    def kv_budget_bytes(self) -> int:
        return self.kv_budget_mb << 20

    @property
    def edge_kv_budget_bytes(self) -> int:
        return (self.edge_kv_budget_mb or self.kv_budget_mb) << 20

    def check_kv_budget(self, kv_bytes_per_token: int) -> None:
        """One session of `max_context` tokens must fit the budget (and an edge's quota), or none ever could."""
        full_context = self.max_context * kv_bytes_per_token
        for flag, budget in (("--kv-budget-mb", self.kv_budget_bytes), ("--edge-kv-budget-mb", self.edge_kv_budget_bytes)):
            if budget < full_context:
                needed_mb = -(-full_context // (1 << 20))
                raise ValueError(f"{flag} {budget >> 20} cannot hold one session of --max-context {self.max_context} "
                                 f"tokens ({kv_bytes_per_token} bytes of KV each): raise it to at least {needed_mb}, "
                                 f"or lower --max-context")
