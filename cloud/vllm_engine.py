"""The vllm engine: the target on vLLM (v1 `AsyncLLM`, in this process), for users who outgrow one device.

vLLM batches and caches by itself, so the cloud's batcher stays out of its way and a session holds
no KV of ours. A verify is one request whose prompt is the session's context plus the new tokens,
with the context served from vLLM's prefix cache; vLLM's eviction just costs a session a prefill.

Glossary
    row r           the target's logits at prompt position r; they score the token at r + 1
    rows the rule   the last n_logits rows: the one before the first new draft token, one per draft
    reads           token (the last row is the one after the block)
    prompt rows     every row but the last, returned as `prompt_logprobs`; vLLM computes only the rows
                    from `num_cached_tokens` on and leaves cached rows uninitialised (vLLM issue
                    42019), so the rows the rule reads must not be served from the cache
    last row        the row after the whole prompt: the logprobs of the one token the request samples
    support K       how many of each row's largest logprobs are read: 1 when greedy (the argmax),
                    top_k when sampling with top-k, the whole vocabulary otherwise

Within a session the first row the rule reads is never cached: it follows the context's last
token, which no earlier request of the session had at that place (a verdict's next token differs
from the draft token it replaced, or follows the whole block). Another session may have computed the
very same context (two edges with one prompt, greedy; a replayed request), and its blocks would
serve those rows uninitialised; so each session's requests carry a cache salt of its own and never
meet another session's blocks (a shared system prompt is prefilled once per session, where the
resident engine's prefix cache shares it). Should a cached prefix still cover a row the rule reads,
the session takes a new salt and the request runs again over a full prefill (counted:
sprinter_cloud_engine_cache_bypasses).
Sharing blocks until a collision and salting then was measured: one 4k-token collision stalled
every verify in vLLM's batch for 13 s on this machine's CPU.

Why not a salt per identity for the prompt and per session beyond (vLLM 0.32, v1/core/kv_cache_utils.py):
the salt is an extra key of the first block's hash only, but every block's hash chains its parent's, so
a request's salt keys all of its blocks, and a session cannot read blocks of one salt and write blocks
of another. A request reads every cached full block up to its last token (kv_cache_manager.py:
max_cache_hit_length = num_tokens - 1; `skip_reading_prefix_cache` is all or nothing), so sessions
sharing one salt that hold the same context (twin greedy sessions, a replayed request) serve each
other the rows the rule reads. docs/vllm-engine.md has the measurement.

Exactness: vLLM's logprobs are of the raw logits, so each row becomes dense logits with -inf outside
the K read, and the session's temperature, top-k and top-p are applied to them by the same function
the resident engine uses (common/sampling/distributions.py). With K >= top_k that is the target's distribution
exactly, so every verify method (token, block, sprinter) runs its own rule unchanged. Building K
Python objects per row is vLLM's cost; a session whose K exceeds `--max-logprobs` is refused at open,
never truncated.

Shapes: a forward's logits are [n_logits, V] float32.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import grpc
import torch

from cloud.engine import Abandoned, ExternalKV, ForwardResult, ForwardStats, GeneratedToken, EngineSession, TargetInfo, TargetRows
from cloud.errors import CloudError
from cloud.metrics import CloudMetrics
from cloud.settings import CloudSettings
from cloud.cloud_sd import SpeculationRequest
from common.sampling.logits_processing import LogitsProcessor
from common.sampling.logprobs import TokenLogprob
from common.model.loading import eos_token_ids, model_dir, vocab_fingerprint
from common.sampling.distributions import SamplingParams

log = logging.getLogger(__name__)


def check_vllm_speculation(speculation: SpeculationRequest, draft_block: int) -> None:
    """A cloud-sd request vLLM's own speculation (draft model, `draft_block` tokens, both fixed at start) serves
    as asked; anything else is refused, naming the field, never approximated."""
    if speculation.proposer != "model":
        raise CloudError(grpc.StatusCode.INVALID_ARGUMENT,
                         f"speculation.proposer {speculation.proposer!r}: this cloud's vllm engine speculates with "
                         "vLLM's own draft-model speculation, which proposes from the draft model alone; ask for "
                         "proposer model, draft on the edge (--placement edge) or use a cloud with --engine resident")
    if speculation.block != draft_block:
        raise CloudError(grpc.StatusCode.INVALID_ARGUMENT,
                         f"speculation.block {speculation.block}: this cloud's vllm engine speculates {draft_block} "
                         "tokens a round, fixed when it started (--draft-block); ask for that block (k)")


@dataclass(frozen=True)
class VllmOptions:
    """How vLLM is started: the service's limits mapped onto vLLM's settings, and its own knobs."""

    model_dir: str  # a checkpoint directory (common/model/loading.py:model_dir) or a Hugging Face id
    dtype: str = "bfloat16"
    max_model_len: int = 4097  # --max-context + 1: the longest prompt plus the one token a request samples
    kv_cache_bytes: int = 2 << 30  # --kv-budget-mb
    max_num_seqs: int = 8  # --max-batch
    max_num_batched_tokens: int = 1024  # --max-forward-tokens
    max_logprobs: int = 64  # --max-logprobs: the largest support K a session may need
    block_size: int | None = None  # prefix-cache granularity; None: 32 on CPU, vLLM's default elsewhere
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float | None = None
    quantization: str | None = None
    enforce_eager: bool = False  # --vllm-eager
    seed: int = 0
    draft_spec: str | None = None  # --draft: vLLM's own draft-model speculative decoding (mode cloud-sd)
    draft_dir: str | None = None
    draft_block: int = 5  # --draft-block: its num_speculative_tokens

    @classmethod
    def of(cls, settings: CloudSettings) -> "VllmOptions":
        """The service's settings in vLLM's terms; the target as a directory vLLM can load (converted once)."""
        return cls(model_dir=str(model_dir(settings.target)), dtype=settings.dtype,
                   max_model_len=settings.max_context + 1, kv_cache_bytes=settings.kv_budget_bytes,
                   max_num_seqs=settings.max_batch, max_num_batched_tokens=settings.max_forward_tokens,
                   max_logprobs=settings.max_logprobs, block_size=settings.kv_block_tokens,
                   tensor_parallel_size=settings.tensor_parallel_size,
                   gpu_memory_utilization=settings.gpu_memory_utilization, quantization=settings.quantization,
                   enforce_eager=settings.vllm_eager,
                   draft_spec=settings.draft, draft_dir=str(model_dir(settings.draft)) if settings.draft else None,
                   draft_block=settings.draft_block)

    def engine_args(self) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform

        extra: dict[str, Any] = {}
        if self.gpu_memory_utilization is not None:
            extra["gpu_memory_utilization"] = self.gpu_memory_utilization
        else:  # the budget sizes the cache; vLLM's own default would take a share of the device instead
            extra["kv_cache_memory_bytes"] = self.kv_cache_bytes
        block_size = self.block_size or (32 if current_platform.is_cpu() else None)
        if block_size:
            extra["block_size"] = block_size
        if self.draft_dir is not None:  # vLLM verifies the draft's proposals with its own rejection sampler
            extra["speculative_config"] = {"method": "draft_model", "model": self.draft_dir,
                                           "num_speculative_tokens": self.draft_block}
        return AsyncEngineArgs(
            model=self.model_dir, dtype=self.dtype, max_model_len=self.max_model_len, enable_prefix_caching=True,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=max(self.max_num_batched_tokens, self.max_model_len),
            max_logprobs=self.max_logprobs, tensor_parallel_size=self.tensor_parallel_size,
            quantization=self.quantization, enforce_eager=self.enforce_eager, seed=self.seed, disable_log_stats=True,
            **extra)


class VllmEngine:
    """`TargetEngine` over an `AsyncLLM`: `VllmEngine.start` loads the target, `shutdown` ends vLLM's processes."""

    name = "vllm"
    prefix_cache = None  # vLLM caches prefixes by itself (per session: cache_salt)
    kv_bytes_per_token = 0  # vLLM sizes and evicts its own cache (--kv-budget-mb sets its size)
    kv_bytes_per_page = 0
    tree_attention = False  # a tree's tokens cannot see only their ancestors here: the open's limits say 0 tree tokens

    def __init__(self, llm: Any, info: TargetInfo, options: VllmOptions, metrics: CloudMetrics,
                 on_batch: Callable[[ForwardStats], None] | None = None, tokenizer: Any = None) -> None:
        self.llm = llm
        self.info = info
        self.tokenizer = tokenizer
        self.options = options
        self.metrics = metrics
        self.on_batch = on_batch  # every verify's ForwardStats, as the resident batcher reports its forwards
        self._request_ids = itertools.count()
        self._in_flight = 0

    @classmethod
    def start(cls, spec: str, options: VllmOptions, metrics: CloudMetrics,
              on_batch: Callable[[ForwardStats], None] | None = None) -> "VllmEngine":
        """Load the target into vLLM (blocking: tens of seconds; call it from a thread)."""
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig
        from vllm.v1.engine.async_llm import AsyncLLM

        tokenizer = AutoTokenizer.from_pretrained(options.model_dir)
        config = AutoConfig.from_pretrained(options.model_dir)
        try:
            configured = GenerationConfig.from_pretrained(options.model_dir).eos_token_id
        except OSError:  # no generation_config.json
            configured = None
        info = TargetInfo(spec, config.get_text_config().vocab_size, eos_token_ids(configured, tokenizer),
                          vocab_fingerprint(tokenizer))
        llm = AsyncLLM.from_engine_args(options.engine_args())
        return cls(llm, info, options, metrics, on_batch, tokenizer)

    def shutdown(self) -> None:
        self.llm.shutdown()

    @property
    def draft_spec(self) -> str | None:
        return self.options.draft_spec

    async def speculate(self, context: list[int], max_new: int, sampling: SamplingParams,
                        processors: tuple[LogitsProcessor | None, LogitsProcessor | None],
                        speculation: SpeculationRequest,
                        prefix_scope: str | None = None) -> AsyncIterator[GeneratedToken]:
        """cloud-sd on vLLM: its own draft-model speculative decoding (configured at start: `--draft`,
        `--draft-block`), so the tokens come as vLLM's Generate gives them."""
        check_vllm_speculation(speculation, self.options.draft_block)
        if sampling.logit_bias:  # vLLM's own warning: "min_p and logit_bias parameters won't work with speculative decoding"
            raise CloudError(grpc.StatusCode.INVALID_ARGUMENT,
                             "this cloud's vllm engine cannot speculate with logit_bias (vLLM's speculative decoding "
                             "ignores it); draft on the edge (--placement edge) or use a cloud with --engine resident")
        async with contextlib.aclosing(self.generate(context, max_new, sampling, processors[0])) as steps:
            async for step in steps:
                yield step

    @property
    def queue_depth(self) -> int:
        return self._in_flight

    def new_session_kv(self) -> ExternalKV:
        return ExternalKV(cache_salt=secrets.token_hex(8))

    def kv_bytes_in_use(self) -> None:
        """vLLM sizes and evicts its own KV cache: no budget of ours to hold."""
        return None

    def support(self, sampling: SamplingParams) -> int:
        """K: how many logprobs per row make the session's distribution exact (module docstring)."""
        if sampling.shapes_logits or sampling.logprobs is not None or sampling.prompt_logprobs is not None:
            # a bias or a penalty can lift any token, and a kept token's logprob may lie outside any top K
            return self.info.vocab_size
        if sampling.greedy:
            return 1
        return min(sampling.top_k, self.info.vocab_size) if sampling.top_k > 0 else self.info.vocab_size

    def check_sampling(self, sampling: SamplingParams) -> None:
        if sampling.repetition_penalty != 1.0:
            raise CloudError(grpc.StatusCode.INVALID_ARGUMENT,
                             "this cloud's vllm engine cannot verify with repetition_penalty exactly: it scales the raw "
                             "logits, and vLLM returns logprobs (the logits less a per-row constant); use a cloud with "
                             "--engine resident")
        k = self.support(sampling)
        if k > self.options.max_logprobs:
            what = ("logit_bias, penalties, a grammar or logprobs (the whole vocabulary)"
                    if sampling.shapes_logits or sampling.logprobs is not None
                    or sampling.prompt_logprobs is not None else
                    f"top_k {sampling.top_k}" if sampling.top_k else "no top_k (the whole vocabulary)")
            # INVALID_ARGUMENT, not FAILED_PRECONDITION: edges read that as a lost context and reopen
            raise CloudError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"this cloud's vllm engine verifies sampling exactly from each row's {k} largest target "
                             f"logprobs ({what}), more than its --max-logprobs {self.options.max_logprobs}: sample with "
                             f"top_k <= {self.options.max_logprobs}, or use a cloud with --engine resident")

    async def prefill(self, session: EngineSession, tokens: list[int], abandoned: Abandoned | None = None) -> None:
        """Put the context into vLLM's prefix cache, so the first verify computes only its block."""
        prompt = session.tokens[:session.cached_tokens] + tokens
        await self._request(prompt, self._params(1, logprobs=None), abandoned, session.cache.cache_salt)

    async def forward(self, session: EngineSession, new_tokens: list[int], n_logits: int,
                      abandoned: Abandoned | None = None, tree: list[int] | None = None) -> ForwardResult:
        if tree is not None:  # never reached: the frame checks refuse trees while max_tree_tokens is 0
            raise ValueError("the vllm engine has no tree attention: it verifies chains only")
        prompt = session.tokens[:session.cached_tokens] + new_tokens
        first_row = len(prompt) - n_logits
        k = self.support(session.sampling)
        started = time.perf_counter()
        batch = self._in_flight + 1
        params = self._params(1, logprobs=k, prompt_logprobs=k if n_logits > 1 else None)
        output = await self._request(prompt, params, abandoned, session.cache.cache_salt)
        if output.num_cached_tokens > first_row:  # a cached block covers a row the rule reads (unset): never expected
            self.metrics.engine_cache_bypasses.inc()
            session.cache.cache_salt = secrets.token_hex(8)
            output = await self._request(prompt, params, abandoned, session.cache.cache_salt)
        self.metrics.engine_cached_tokens.inc(output.num_cached_tokens)
        self.metrics.engine_recomputed_tokens.inc(max(0, session.cached_tokens - output.num_cached_tokens))
        rows = (output.prompt_logprobs or [])[first_row + 1:] + [output.outputs[0].logprobs[0]]
        forward_s = time.perf_counter() - started
        if self.on_batch:
            self.on_batch(ForwardStats(1, len(prompt) - output.num_cached_tokens, forward_s, 0))
        logits = _dense_logits(rows, self.info.vocab_size)
        return ForwardResult(TargetRows(logits.argmax(-1), logits), batch, 0.0, forward_s * 1e3)

    def rollback(self, session: EngineSession, keep: int) -> None:
        """Nothing to do: the next request's prompt is the kept context, and vLLM's cache matches it by content."""

    def keep_path(self, session: EngineSession, start: int, node_indices: list[int]) -> None:
        raise ValueError("the vllm engine has no tree attention: it verifies chains only")

    async def generate(self, context: list[int], max_new: int, sampling: SamplingParams,
                       processor: LogitsProcessor | None,
                       prefix_scope: str | None = None) -> AsyncIterator[GeneratedToken]:
        """vLLM's own sampler, seeded per request by `sampling.seed` (a different stream from the resident engine's);
        `prefix_scope` is the resident engine's: a Generate carries no cache salt, so vLLM's cache serves its
        prompt by content, except when prompt logprobs are asked for (cached rows come back unset: it reads none)."""
        from vllm.sampling_params import RequestOutputKind

        if sampling.grammar is not None:
            raise CloudError(grpc.StatusCode.INVALID_ARGUMENT,
                             "this cloud's vllm engine does not run mode target with structured output: vLLM's own "
                             "grammar engine is not the one the speculative modes verify with; use a speculative mode "
                             "or a cloud with --engine resident")
        if processor is not None and processor.output_start < len(context):
            raise CloudError(grpc.StatusCode.INVALID_ARGUMENT,
                             "this cloud's vllm engine counts penalties over what it generates itself, and this "
                             "Generate continues earlier output: use a cloud with --engine resident")

        # vLLM leaves the prompt-logprob rows of cached blocks unset, and Generate carries no salt: echo computes all
        params = self._params(max_new, logprobs=sampling.logprobs, prompt_logprobs=sampling.prompt_logprobs,
                              sampling=sampling, read_cache=sampling.prompt_logprobs is None)
        params.output_kind = RequestOutputKind.DELTA
        params.stop_token_ids = sorted(self.info.eos_token_ids)
        started, first = time.perf_counter(), True
        async for output in self.llm.generate({"prompt_token_ids": context}, params, request_id=self._next_id()):
            now = time.perf_counter()
            rows = output.outputs[0].logprobs or [None] * len(output.outputs[0].token_ids)
            for token, row in zip(output.outputs[0].token_ids, rows):
                prompt = _prompt_logprobs(context, output, sampling.prompt_logprobs) if first else ()
                yield GeneratedToken(token, (now - started) * 1e3, _token_logprob(token, row, sampling.logprobs), prompt)
                started, first = now, False  # the prompt's logprobs come with the first token only

    def _params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                sampling: SamplingParams | None = None, read_cache: bool = True) -> Any:
        from vllm import SamplingParams as VllmSampling

        sampling = sampling or SamplingParams()  # a verify reads logprobs; what it samples is never used
        # Penalties and logit_bias count as ours do (common/sampling/logits_processing.py follows vLLM): Generate runs them natively.
        return VllmSampling(max_tokens=max_tokens, temperature=sampling.temperature, top_k=sampling.top_k,
                            top_p=sampling.top_p, seed=sampling.seed if not sampling.greedy else None,
                            presence_penalty=sampling.presence_penalty, frequency_penalty=sampling.frequency_penalty,
                            repetition_penalty=sampling.repetition_penalty,
                            logit_bias=dict(sampling.logit_bias) or None,
                            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                            # Token ids only: detokenizing prompt-logprob rows crashes on negative ids.
                            detokenize=False, skip_reading_prefix_cache=not read_cache)

    async def _request(self, prompt: list[int], params: Any, abandoned: Abandoned | None,
                       cache_salt: str | None = None) -> Any:
        if abandoned is not None and abandoned():
            raise CloudError(grpc.StatusCode.CANCELLED, "the caller left before its forward")
        inputs: dict[str, Any] = {"prompt_token_ids": prompt}
        if cache_salt is not None:
            inputs["cache_salt"] = cache_salt
        self._in_flight += 1
        try:
            final = None
            async for output in self.llm.generate(inputs, params, request_id=self._next_id()):
                final = output
            return final
        finally:
            self._in_flight -= 1

    def _next_id(self) -> str:
        return f"sprinter-{next(self._request_ids)}"


def _token_logprob(token: int, row: dict[int, Any] | None, top_n: int | None) -> TokenLogprob | None:
    """vLLM's logprobs of a sampled token (raw, its default) as ours: the token's, then its top N by rank."""
    if row is None or top_n is None:
        return None
    ranked = sorted((entry.rank, token_id, entry.logprob) for token_id, entry in row.items())
    return TokenLogprob(token, row[token].logprob, tuple((t, lp) for rank, t, lp in ranked if rank <= top_n))


def _prompt_logprobs(context: list[int], output: Any, top_n: int | None) -> tuple[TokenLogprob, ...]:
    """vLLM's prompt logprobs (the first position has none) as ours, for prompt tokens 2..n."""
    rows = getattr(output, "prompt_logprobs", None)
    if not rows or top_n is None:
        return ()
    return tuple(_token_logprob(token, row, top_n) for token, row in zip(context[1:], rows[1:]))


def _dense_logits(rows: list[dict[int, Any]], vocab_size: int) -> torch.Tensor:
    """[len(rows), V] float32: each row's logprobs where it has them, -inf elsewhere (softmax-equivalent to the
    raw logits on that support, since a logprob is the logit less the row's log-normaliser)."""
    logits = torch.full((len(rows), vocab_size), float("-inf"))
    for i, row in enumerate(rows):
        ids = torch.tensor(list(row.keys()), dtype=torch.long)
        logits[i, ids] = torch.tensor([entry.logprob for entry in row.values()], dtype=torch.float32)
    return logits
