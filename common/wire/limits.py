"""The wire codec's limits and service info (proto Limits, ServiceInfo, GetInfoRequest): what the cloud accepts,
as it says it and as the edge reads it. Part of the codec (common/wire/__init__.py re-exports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from common.spec.round_cost import CloudCosts
from sprinter.v1 import decoding_pb2 as pb


def limits_message(max_block: int, max_context: int, max_message_bytes: int, max_sparse_support: int,
                   max_generate: int, max_tree_tokens: int = 0) -> pb.Limits:
    return pb.Limits(max_block=max_block, max_context=max_context, max_message_bytes=max_message_bytes,
                     max_sparse_support=max_sparse_support, max_generate=max_generate, max_tree_tokens=max_tree_tokens)


@dataclass(frozen=True)
class CloudLimits:
    """The cloud's ServiceInfo.limits (None: the cloud did not say). The edge shapes its frames to fit them."""

    max_block: int | None = None  # draft tokens per verify frame
    max_context: int | None = None  # prompt + generated tokens per session (and per Generate)
    max_sparse_support: int | None = None  # entries per sparse draft distribution
    max_generate: int | None = None  # concurrent Generate calls this edge may run there
    max_tree_tokens: int | None = None  # draft tokens per tree frame; None: the cloud verifies chains only

    @classmethod
    def from_proto(cls, limits: pb.Limits) -> "CloudLimits":
        return cls(*(getattr(limits, f) or None for f in ("max_block", "max_context", "max_sparse_support", "max_generate",
                                                          "max_tree_tokens")))


def info_request() -> pb.GetInfoRequest:
    return pb.GetInfoRequest()


def service_info(model_id: str, vocab_fingerprint: str, vocab_size: int, limits: pb.Limits,
                 eos_token_ids: Sequence[int], draft_model_id: str = "", costs: CloudCosts | None = None) -> pb.ServiceInfo:
    return pb.ServiceInfo(model_id=model_id, vocab_fingerprint=vocab_fingerprint, vocab_size=vocab_size,
                          limits=limits, eos_token_ids=eos_token_ids, draft_model_id=draft_model_id,
                          costs=cost_table(costs) if costs else None)


def cost_table(costs: CloudCosts) -> pb.CostTable:
    return pb.CostTable(context_tokens=costs.context_tokens,
                        forwards=[pb.ForwardCost(sessions=s, tokens=t, ms=ms)
                                  for (s, t), ms in sorted(costs.forward_ms.items())])


def cloud_costs(info: pb.ServiceInfo) -> CloudCosts:
    """The cost table a GetInfo answer carries; empty (falsy) from a cloud that timed none."""
    table = info.costs
    return CloudCosts(table.context_tokens, {(f.sessions, f.tokens): f.ms for f in table.forwards})
