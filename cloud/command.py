"""`sprinter cloud serve`: the gRPC target service."""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import fields
from pathlib import Path

from cloud.settings import ATTENTIONS, ENGINES, CloudSettings
from common.spec.modes import PROPOSERS
from common.arguments import DTYPE_NAMES, host_port, port
from common.model.devices import add_device_argument
from common.fleet_plane.command import add_broker_arguments
from common.tracing import add_tracing_argument, enable_from_flag, tracer

# The settings' defaults as declared: building a CloudSettings would validate its device, which needs torch.
DEFAULTS = argparse.Namespace(**{f.name: f.default for f in fields(CloudSettings)})


def register(subcommands: argparse._SubParsersAction) -> None:
    cloud = subcommands.add_parser("cloud", help="the cloud target service").add_subparsers(dest="cloud_command", required=True)
    p = cloud.add_parser("serve", help="serve the target model over gRPC",
                         description="Host the target model; verify blocks that edges send.")
    p.add_argument("--target", default=DEFAULTS.target, help="preset, Hugging Face id or directory")
    _add_engine_arguments(p)
    p.add_argument("--host", default=DEFAULTS.host, help="a non-loopback address needs --auth-tokens "
                                                          "(or --allow-unauthenticated)")
    p.add_argument("--port", type=port, default=DEFAULTS.port)
    p.add_argument("--tls-cert", type=Path, help="PEM certificate chain; with --tls-key serves TLS")
    p.add_argument("--tls-key", type=Path, help="PEM private key")
    p.add_argument("--auth-tokens", type=Path, help="file of 'EDGE_ID TOKEN' lines; without it, no authentication")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve a non-loopback --host without --auth-tokens (a trusted network only)")
    p.add_argument("--max-sessions", type=int, default=DEFAULTS.max_sessions)
    p.add_argument("--kv-budget-mb", type=int, default=DEFAULTS.kv_budget_mb,
                   help="KV cache of all sessions and Generate calls; must hold one --max-context session")
    _add_frame_limit_arguments(p)
    p.add_argument("--max-context", type=int, default=DEFAULTS.max_context)
    p.add_argument("--idle-timeout-s", type=float, default=DEFAULTS.idle_timeout_s)
    p.add_argument("--evict-grace-s", type=float, default=DEFAULTS.evict_grace_s,
                   help="a session used within this many seconds is not evicted to admit another; the newcomer "
                        "waits in line instead of thrashing (0: evict any idle one)")
    p.add_argument("--evict-older-idle-s", type=float, default=DEFAULTS.evict_older_idle_s,
                   help="nor is a session of an earlier request, unless idle this long: newer work waits for room "
                        "instead of pushing out older work (0: seniority off)")
    p.add_argument("--batch-window-ms", type=float, default=DEFAULTS.batch_window_ms,
                   help="hold a forward this long for more verifies (default 0: continuous batching, a forward "
                        "starts as soon as the engine is free and takes everything waiting)")
    p.add_argument("--max-batch", type=int, default=DEFAULTS.max_batch, help="requests per forward; 1 turns batching off")
    p.add_argument("--max-prefill-chunk", type=int, default=DEFAULTS.max_prefill_chunk,
                   help="prompt tokens per forward; a chunk rides along with the waiting verifies")
    p.add_argument("--max-forward-tokens", type=int, default=DEFAULTS.max_forward_tokens,
                   help="tokens per packed forward (verifies plus at most one prefill chunk)")
    _add_prefix_cache_arguments(p)
    _add_queue_arguments(p)
    p.add_argument("--edge-max-sessions", type=int, help="sessions per edge (default: --max-sessions)")
    p.add_argument("--edge-kv-budget-mb", type=int, help="KV cache per edge (default: --kv-budget-mb); "
                                                         "eviction takes from the edge using most of its quota first")
    p.add_argument("--edge-max-generate", type=int, default=DEFAULTS.edge_max_generate,
                   help="concurrent Generate calls per edge")
    p.add_argument("--max-streams", type=int, default=DEFAULTS.max_streams,
                   help="concurrent Session and Generate calls; beyond: RESOURCE_EXHAUSTED with a retry hint")
    _add_operations_arguments(p)
    _add_drafting_arguments(p)
    _add_vllm_arguments(p)
    _add_residual_arguments(p)
    add_broker_arguments(p)
    p.add_argument("--replica-id", help="this replica's name on the fleet plane (default: cloud-PORT)")
    p.add_argument("--advertise", type=host_port, metavar="HOST:PORT", help="the address edges should dial (default: --host:--port)")
    p.set_defaults(run=run)


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Which engine runs the target, and how."""
    p.add_argument("--dtype", default=DEFAULTS.dtype, choices=DTYPE_NAMES)
    add_device_argument(p, "the target's weights and its sessions' KV live (resident engine)")
    p.add_argument("--attention", default=DEFAULTS.attention, choices=ATTENTIONS,
                   help="resident engine: per-session (each session's KV in its own buffers, one attention call per "
                        "session per layer) or paged (one page pool, one flex_attention call per layer for all "
                        "sessions); auto: paged on CUDA, per-session on a CPU (default)")
    p.add_argument("--query-tiles", default=DEFAULTS.query_tiles, choices=["auto", "on", "off"],
                   help="paged attention: pad each session's rows in a forward to the fused kernel's 16-row query tile, "
                        "so each tile reads only its own session's pages instead of every session's (forwards of up "
                        "to 128 padded rows: verifies and decodes; larger ones are not padded). The rows are the same "
                        "either way. auto: on CUDA, off on a CPU, where attention is not fused (default)")
    p.add_argument("--cuda-graphs", default=DEFAULTS.cuda_graphs, choices=["auto", "on", "off"],
                   help="replay paged forwards with query tiles (verifies and decodes of up to 8 sessions and 128 "
                        "padded rows) from CUDA graphs, one per bucket of sessions x rows, captured on first use: one "
                        "launch instead of hundreds; other forwards run eagerly. auto: on CUDA (default); on: refused "
                        "on any other device")
    p.add_argument("--engine", default=DEFAULTS.engine, choices=ENGINES,
                   help="resident: the embedded engine (default); vllm: vLLM in this process, from the environment "
                        "`make vllm` builds (.venv-vllm; this command moves there by itself); llama.cpp: the GGUF "
                        "as shipped on llama.cpp's CPU kernels (`make llama-cpp` builds it for this CPU)")
    p.add_argument("--threads", type=int, default=DEFAULTS.threads,
                   help="llama.cpp engine: its threads (default: one per core this process may run on)")


def _add_frame_limit_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-block", type=int, default=DEFAULTS.max_block, help="draft tokens per verify frame")
    p.add_argument("--max-tree-tokens", type=int, default=DEFAULTS.max_tree_tokens,
                   help="draft tokens per tree verify frame, where an edge sends several candidate paths in one "
                        "verify, the chain included (default 32, --max-block's default: a tree costs no more KV than "
                        "a longest chain; the forward grows with the tree's tokens as a chain's does; 0: chains "
                        "only). The resident engine only: vllm always reports 0")


def _add_drafting_arguments(p: argparse.ArgumentParser) -> None:
    """Mode cloud-sd (cloud/cloud_sd.py): the cloud's own draft, and what proposes around it."""
    p.add_argument("--draft", metavar="SPEC", help="a draft model beside the target (preset, Hugging Face id or "
                   "directory; the target's tokenizer): edges may then ask the cloud to speculate by itself (mode "
                   "cloud-sd, --placement cloud)")
    p.add_argument("--proposer", default=DEFAULTS.proposer, choices=PROPOSERS,
                   help="with --draft: what proposes cloud-sd's tokens for a request that names none (its "
                        "speculation.proposer overrides it): the draft model, or suffix: text the request (its prompt, "
                        "its output so far) or the same edge identity's earlier outputs on this replica hold where "
                        "the context matches it, the draft model elsewhere; exact either way. --engine vllm: model "
                        "only")
    p.add_argument("--suffix-cache", default=DEFAULTS.suffix_cache, choices=["on", "off"],
                   help="cloud-sd's copying proposers also copy from the same edge identity's earlier outputs on this "
                        "replica (off: each request from its own text alone)")
    p.add_argument("--cost-table", default=DEFAULTS.cost_table, choices=["on", "off"],
                   help="time the target's forwards at start (a decode step; blocks alone and beside other sessions) "
                        "and report them in GetInfo, for edges choosing how to decode (--mode auto); off: start "
                        "sooner, edges learn the costs from their verdicts alone")


def _add_prefix_cache_arguments(p: argparse.ArgumentParser) -> None:
    """cloud/prefix_cache.py (cloud/llama_cpp_prefix.py): KV reused across sessions by prompt prefix."""
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="reuse no KV across sessions (by default a prompt starts from the longest prefix an earlier "
                        "session of the same edge identity computed: whole KV pages on the resident engine, any "
                        "length on llama.cpp's)")
    p.add_argument("--share-prefix-cache", action="store_true",
                   help="let every edge identity reuse every other's cached prefixes (by default reuse stays within "
                        "one --auth-tokens identity; without --auth-tokens all edges are one identity)")


def _add_queue_arguments(p: argparse.ArgumentParser) -> None:
    """cloud/admission_queue.py: the one fair line for work the cloud cannot take at once."""
    p.add_argument("--queue-max", type=int, default=DEFAULTS.queue_max,
                   help="places in the admission queue, every edge's; past it a request is refused "
                        "(RESOURCE_EXHAUSTED naming the queue's length)")
    p.add_argument("--queue-grace-s", type=float, default=DEFAULTS.queue_grace_s,
                   help="how long a queued request's place is kept after its edge's stream broke (a reconnect "
                        "with its ticket takes it back)")


def _add_operations_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keepalive-s", type=float, default=DEFAULTS.keepalive_s, help="ping a silent connection this often")
    p.add_argument("--keepalive-timeout-s", type=float, default=DEFAULTS.keepalive_timeout_s,
                   help="drop a connection whose ping is not answered within this")
    p.add_argument("--max-connection-idle-s", type=float, default=DEFAULTS.max_connection_idle_s,
                   help="close a connection without calls after this long")
    p.add_argument("--metrics-port", type=port, help="serve Prometheus metrics on this port")
    p.add_argument("--metrics-read-timeout-s", type=float, default=DEFAULTS.metrics_read_timeout_s)
    p.add_argument("--drain-s", type=float, default=DEFAULTS.drain_s, help="SIGTERM: wait this long for open streams")
    add_tracing_argument(p)


def _add_residual_arguments(p: argparse.ArgumentParser) -> None:
    """cloud/residual.py: the residual of an edge that sends no draft distributions (--draft-dists on-rejection)."""
    p.add_argument("--residual-candidates", type=int, default=DEFAULTS.residual_candidates,
                   help="candidate tokens per residual query at a rejection, for edges that send no draft "
                        "distributions (--draft-dists on-rejection)")
    p.add_argument("--residual-queries", type=int, default=DEFAULTS.residual_queries,
                   help="residual queries of candidates before the whole draft distribution is asked for (exact "
                        "either way)")


def _add_vllm_arguments(p: argparse.ArgumentParser) -> None:
    vllm = p.add_argument_group("vllm engine", "passed to vLLM; --kv-budget-mb sizes its KV cache, --max-context "
                                               "its max_model_len, --max-batch its max_num_seqs, --max-forward-tokens "
                                               "its max_num_batched_tokens")
    vllm.add_argument("--tensor-parallel-size", type=int, default=DEFAULTS.tensor_parallel_size,
                      help="GPUs to shard the target over")
    vllm.add_argument("--gpu-memory-utilization", type=float, help="size the KV cache as this share of each GPU's "
                                                                  "memory instead of by --kv-budget-mb")
    vllm.add_argument("--quantization", help="vLLM's quantization method (e.g. fp8, awq)")
    vllm.add_argument("--vllm-eager", action="store_true",
                      help="run the model eagerly (vLLM's enforce_eager): no compile warm-up at start (about a "
                           "minute on a CPU), no CUDA graphs; slower steps, for short-lived clouds such as tests")
    vllm.add_argument("--max-logprobs", type=int, default=DEFAULTS.max_logprobs,
                      help="sampled verifies read each row's top_k target logprobs (the whole vocabulary without "
                           "top_k); sessions that need more are refused")
    vllm.add_argument("--draft-block", type=int, default=DEFAULTS.draft_block,
                      help="with --draft: vLLM's draft tokens per speculation round (fixed when vLLM starts; a "
                           "cloud-sd request must ask for this block)")
    vllm.add_argument("--kv-block-tokens", type=int, help="prefix-cache block size (default: 32 on CPU, vLLM's "
                                                          "default on GPUs)")


def run(args: argparse.Namespace) -> int:
    from cloud.server import run_until_signalled
    from cloud.vllm_launch import relaunch_under_vllm, vllm_importable

    try:  # a bad flag is refused before anything loads, with the flag's name; the KV budget once the model is known
        settings = CloudSettings(**{f.name: getattr(args, f.name) for f in fields(CloudSettings)})
        if settings.engine == "vllm" and not vllm_importable():
            relaunch_under_vllm(args.argv, settings.target)
        enable_from_flag(settings.otlp_traces_endpoint, "sprinter-cloud", settings.replica_id or f"cloud-{settings.port}")
        asyncio.run(run_until_signalled(settings))
    except ValueError as err:
        raise SystemExit(f"sprinter cloud serve: {err}") from None
    finally:
        tracer.shutdown()  # the spans still buffered go out before the process ends
    return 0
