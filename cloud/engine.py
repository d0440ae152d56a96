"""The verify-engine seam: what the target backend (cloud/target_host.py) asks of whatever runs the target.

Two engines sit behind it (either may also speculate with a draft of its own: mode cloud-sd):
    resident  cloud/resident_engine.py, the embedded default: each session's KV stays where the
              forward writes it; concurrent sessions share one packed forward (cloud/batcher.py).
    vllm      cloud/vllm_engine.py: vLLM in-process, which batches and caches by itself; a session
              holds no KV of ours, its context is served from vLLM's prefix cache.

Glossary
    session.tokens          the context the edge and the cloud agree on
    session.cached_tokens   how much of it the engine has seen (its KV, or vLLM's cached prefix)
    forward                 append new tokens after the cached context; return the target's rows at
                            the last n_logits positions (TargetRows): the argmax, and the logits
                            [n_logits, V] unless the session is greedy (then the argmax is all a rule reads)
    rollback                forget the KV past `keep` tokens (rejected draft tokens)

An engine that cannot give the rule exactly what it needs for a session's sampling settings refuses
the session in `check_sampling`, before anything is computed; it never approximates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Protocol

import torch

from common.sampling.logits_processing import LogitsProcessor
from common.sampling.logprobs import TokenLogprob, logprobs_of
from common.sampling.distributions import SamplingParams, logits_to_probs, sample

if TYPE_CHECKING:
    from cloud.prefix_cache import PrefixCache

Abandoned = Callable[[], bool]  # true once nobody waits for the answer: the work is skipped
PROMPT_LOGPROB_CHUNK = 256  # prompt tokens per forward when their logprobs are read (echo): [chunk, V] logits at a time


class EngineSession(Protocol):
    """What an engine reads of a session (cloud/sessions.py)."""

    tokens: list[int]
    cached_tokens: int
    cache: Any  # the engine's own handle, from new_session_kv
    sampling: SamplingParams


@dataclass(frozen=True)
class TargetInfo:
    """What the service tells edges about its target (GetInfo, the fleet plane)."""

    spec: str  # the model spec it was started with (preset, Hugging Face id or directory)
    vocab_size: int  # logits per row
    eos_token_ids: frozenset[int]
    vocab_fingerprint: str


@dataclass
class ExternalKV:
    """EngineSession.cache for an engine that keeps the KV itself (vllm): nothing is held or granted here."""

    capacity: int = 0
    granted: int = 0
    shared_tokens: int = 0  # none of it is the resident prefix cache's (cloud/prefix_cache.py)
    cache_salt: str | None = None  # vllm: keeps the session's prefix-cache blocks its own

    def release(self) -> None:
        """Nothing is held here."""


@dataclass(frozen=True)
class TargetRows:
    """The target's rows a rule reads, on the host: the argmax always, the logits unless greedy."""

    argmax: torch.Tensor  # [n_logits] int64: the target's most likely token after each position
    logits: torch.Tensor | None  # [n_logits, V] float32, -inf outside the support asked for; None: greedy

    def logprobs(self, sampling: SamplingParams, tokens: list[int]) -> tuple[TokenLogprob, ...]:
        """The raw rows' logprobs of `tokens` (row i scored tokens[i]) and their top N, when the sampling asks
        for logprobs (the engine then returned full logits: `reads_logits`); else none."""
        if sampling.logprobs is None:
            return ()
        return tuple(logprobs_of(self.logits, tokens, sampling.logprobs))

    def shaped(self, processor: LogitsProcessor | None, context: list[int], block: list[int]) -> TargetRows:
        """The rows after the request's logit_bias and penalties (row i after context + block[:i]): what the rule
        and the sampler read. The engine returned full logits: the session's sampling `reads_logits`."""
        if processor is None or not processor.active:
            return self
        logits = processor.rows(self.logits, context, block)
        return TargetRows(logits.argmax(dim=-1), logits)

    def next_token(self, sampling: SamplingParams, generator: torch.Generator) -> int:
        """The token after the last row: its argmax when greedy, else sampled with the session's generator."""
        if sampling.greedy:
            return int(self.argmax[-1])
        if self.logits is None:
            raise ValueError("a sampled token needs the target's logits, and this forward brought back the argmax only")
        return sample(logits_to_probs(self.logits[-1], sampling), generator)


async def scored_prefill(forward: Callable[[list[int]], Awaitable[TargetRows]], prompt_ids: list[int],
                         top_n: int) -> list[TokenLogprob]:
    """Feed prompt_ids[:-1] through `forward` (which appends a chunk to the cache and returns its rows) chunk by chunk,
    each chunk's rows scoring the prompt tokens after it: their raw logprobs and top N (echo). Only a chunk's logits
    are held at a time, not the whole prompt's."""
    scored: list[TokenLogprob] = []
    for start in range(0, len(prompt_ids) - 1, PROMPT_LOGPROB_CHUNK):
        chunk = prompt_ids[start:min(start + PROMPT_LOGPROB_CHUNK, len(prompt_ids) - 1)]
        rows = await forward(chunk)
        scored += logprobs_of(rows.logits, prompt_ids[start + 1:start + 1 + len(chunk)], top_n)
    return scored


@dataclass(frozen=True)
class ForwardResult:
    rows: TargetRows
    batch_size: int  # requests in the same forward (vllm: verifies in flight at once)
    queue_ms: float
    forward_ms: float


@dataclass(frozen=True)
class ForwardStats:
    """What one forward did, for the metrics (vllm: one request, whatever vLLM batched it with)."""

    requests: int
    tokens: int
    seconds: float
    copied_bytes: int  # past KV entries moved by cache growth (0 unless a cache ran out of pages)


@dataclass(frozen=True)
class GeneratedToken:
    """One step of target-alone decoding (Generate)."""

    token: int
    step_ms: float  # the prefill is counted in the first step
    logprob: TokenLogprob | None = None  # when the sampling asked for logprobs
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # the first step's, when the sampling asked for them (echo)
    cached_tokens: int = 0  # the first step's: prompt tokens whose KV came from the prefix cache
    drafted = 0  # as a cloud-sd round (cloud/cloud_sd.py) reads: no draft proposed this token
    draft_ms = 0.0
    copied = 0  # nor copied any
    copied_kept = 0

    @property
    def tokens(self) -> list[int]:
        return [self.token]

    @property
    def logprobs(self) -> tuple[TokenLogprob, ...]:
        return (self.logprob,) if self.logprob is not None else ()


class TargetEngine(Protocol):
    """The target behind the service: sessions' forwards, rollbacks and target-alone decoding."""

    name: str
    info: TargetInfo
    tokenizer: Any  # the target's (transformers): what a grammar is compiled for
    # KV accounting for admission: what the session store charges per context token, and the unit it
    # allocates in; both 0 for an engine that sizes and evicts its own KV cache (vllm).
    kv_bytes_per_token: int
    kv_bytes_per_page: int
    prefix_cache: PrefixCache | None  # KV reusable across sessions by prefix (resident); None: none of ours
    tree_attention: bool  # verifies a draft tree in one forward (ServiceInfo.limits.max_tree_tokens > 0 only then)

    @property
    def queue_depth(self) -> int:
        """Forwards waiting for the target."""

    def new_session_kv(self) -> Any:
        """A fresh session's KV handle (EngineSession.cache)."""

    def kv_bytes_in_use(self) -> int | None:
        """Bytes of KV this engine holds right now, measured, not from the store's ledger: the budget invariant
        (cloud/sessions.py) is checked against it. None: the engine sizes its own cache (vllm)."""

    def check_sampling(self, sampling: SamplingParams) -> None:
        """Refuse (CloudError) a session whose verification this engine cannot do exactly with these settings."""

    async def prefill(self, session: EngineSession, tokens: list[int], abandoned: Abandoned | None = None) -> None:
        """Make `tokens`, which follow the session's cached context, part of it."""

    async def forward(self, session: EngineSession, new_tokens: list[int], n_logits: int,
                      abandoned: Abandoned | None = None, tree: list[int] | None = None) -> ForwardResult:
        """Append `new_tokens` after the cached context; the logits of the last `n_logits` positions. `tree`: the
        new tokens' parents (common/spec/tree/draft_tree.py), only where `tree_attention`."""

    def rollback(self, session: EngineSession, keep: int) -> None:
        """Keep the KV of the first `keep` context tokens only."""

    def keep_path(self, session: EngineSession, start: int, node_indices: list[int]) -> None:
        """After a tree's forward: keep the KV of one root-to-node path of it, from entry `start`, nothing after."""

    def generate(self, context: list[int], max_new: int, sampling: SamplingParams,
                 processor: LogitsProcessor | None, prefix_scope: str | None = None) -> AsyncIterator[GeneratedToken]:
        """Target-alone decoding of up to `max_new` tokens after `context` (stops after an end-of-sequence token);
        `prefix_scope`: whose cached prefixes its KV may start from (cloud/prefix_cache.py; None: none)."""

    @property
    def draft_spec(self) -> str | None:
        """The cloud's own draft (`--draft`), which `speculate` drafts with; None: this engine drafts nothing."""

    def speculate(self, context: list[int], max_new: int, sampling: SamplingParams,
                  processors: tuple[LogitsProcessor | None, LogitsProcessor | None],
                  speculation: Any, prefix_scope: str | None = None) -> AsyncIterator[Any]:
        """cloud-sd (cloud/cloud_sd.py): rounds of `speculation.block` tokens (SpeculationRequest) proposed by its
        proposer over the cloud's draft and block-verified by the target (SpeculatedRound); `processors`: the
        request's, one for the target's logits, one for the draft's."""


def whole_pages(engine: TargetEngine, tokens: int) -> int:
    """`tokens` rounded up to the engine's pages: what a Generate's cache allocates, so what it is charged."""
    if not engine.kv_bytes_per_page:
        return tokens
    page = engine.kv_bytes_per_page // engine.kv_bytes_per_token
    return -(-tokens // page) * page
