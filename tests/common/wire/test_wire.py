"""The wire codec (common/wire/): what it encodes decodes back, and its frames are the messages once built by hand."""

from __future__ import annotations

import grpc
import pytest
import torch

from common import wire
from common.spec.modes import VERIFY_METHODS
from common.sampling.distributions import FLOAT32_TINY, SamplingParams, SparseDistribution
from sprinter.v1 import decoding_pb2 as pb


def test_every_verify_method_has_a_wire_value_and_back() -> None:
    assert wire.method_value("block") == pb.METHOD_BLOCK
    assert [wire.method_name(wire.method_value(m)) for m in VERIFY_METHODS] == list(VERIFY_METHODS)
    assert wire.method_name(pb.METHOD_UNSPECIFIED) is None and wire.method_name(99) is None


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(0.7, 40, 0.9, 7), SamplingParams(1.0, 0, 1e-45, 3)])
def test_sampling_settings_survive_the_wire(sampling: SamplingParams) -> None:
    settings = pb.SamplingSettings.FromString(wire.sampling_to_proto(sampling).SerializeToString())
    decoded = wire.sampling_from_proto(settings)
    assert (decoded.temperature, decoded.top_k, decoded.seed) == pytest.approx((sampling.temperature, sampling.top_k,
                                                                                 sampling.seed))
    assert decoded.top_p == pytest.approx(max(sampling.top_p, FLOAT32_TINY), rel=1e-6)  # float32 on the wire
    assert wire.top_p_of(pb.SamplingSettings()) == 1.0  # unset: off


def test_a_sparse_distribution_survives_the_wire() -> None:
    dist = SparseDistribution(torch.tensor([3, 9]), torch.tensor([0.25, 0.75]))
    back = wire.sparse_from_proto(wire.sparse_to_proto(dist))
    assert torch.equal(back.token_ids, dist.token_ids) and torch.equal(back.probs, dist.probs)


def test_edge_frames_are_the_messages_once_built_by_hand() -> None:
    assert wire.open_frame([1, 2]) == pb.EdgeFrame(open=pb.OpenSession(prompt_ids=[1, 2]))
    assert wire.close_frame() == pb.EdgeFrame(close=pb.CloseSession())
    assert wire.verify_frame(wire.verify_block(5, [7, 8], "block")) == pb.EdgeFrame(
        verify=pb.VerifyBlock(start_position=5, draft_tokens=[7, 8], method=pb.METHOD_BLOCK))
    after = wire.after_verdict(4, 1, 6)
    candidate = wire.verify_block(6, [9], "sprinter", [0.5], [SparseDistribution(torch.tensor([9]), torch.tensor([1.0]))],
                                  after)
    assert wire.candidate_after(candidate) == (4, 1, 6)
    ordinary = wire.ordinary_verify_frame(candidate).verify
    assert wire.candidate_after(ordinary) is None
    candidate.ClearField("after")
    assert ordinary.SerializeToString() == candidate.SerializeToString()


def test_cloud_frames_decode_to_what_they_carry() -> None:
    limits = wire.limits_message(32, 4096, 4 << 20, 0, 2)
    opened = wire.opened_frame("s1", 3, limits, resumed=False, first_token=11).opened
    assert wire.opened_first_token(opened) == 11 and wire.opened_limits(opened) == wire.CloudLimits(32, 4096, None, 2)
    resumed = pb.SessionOpened.FromString(wire.opened_frame("s1", 3, limits, resumed=True).opened.SerializeToString())
    assert wire.opened_first_token(resumed) is None and wire.opened_limits(pb.SessionOpened()) is None
    error = wire.error_frame(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", 250).error
    assert (wire.error_status(error), error.retry_after_ms, error.context_length) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                                                      250, 0)
    assert wire.error_status(pb.Error(code=1234)) == grpc.StatusCode.UNKNOWN
    last = wire.generate_chunk(finish_reason="length")
    assert last == pb.GenerateChunk(finished=True, finish_reason="length")
    assert wire.generate_chunk([5], 1.5) == pb.GenerateChunk(token_ids=[5], step_ms=1.5)
