"""A verify frame that carries a tree (VerifyBlock.parents): what the cloud's frame checks refuse, naming the field,
and how the codec carries it. The checks are pure (cloud/frames.py); the real cloud's refusal of a tree while it
verifies chains only is in tests/cloud/test_cloud_errors.py."""

from __future__ import annotations

import grpc
import pytest

from cloud.errors import CloudError
from cloud.frames import ServiceLimits, check_verify
from common import wire
from common.sampling.distributions import SamplingParams

VOCAB = 100
GREEDY = SamplingParams()
TREES = ServiceLimits(max_block=4, max_context=32, max_tree_tokens=8)


def _block(tokens: list[int], parents: list[int] | None, start: int = 5):
    return wire.verify_block(start, tokens, "block", parents=parents)


def _refused(block, limits: ServiceLimits = TREES, length: int = 5) -> CloudError:
    with pytest.raises(CloudError) as caught:
        check_verify(block, length, GREEDY, VOCAB, limits)
    return caught.value


def test_the_codec_carries_a_tree_and_an_empty_parents_list_is_a_chain():
    tree = _block([1, 2, 3], [-1, -1, 1])
    assert wire.tree_parents(tree) == [-1, -1, 1] and wire.tree_parents(_block([1, 2], None)) is None
    assert wire.tree_parents(wire.ordinary_verify_frame(tree).verify) == [-1, -1, 1]
    limits = wire.CloudLimits.from_proto(TREES.to_proto())
    assert limits.max_tree_tokens == 8 and wire.CloudLimits.from_proto(ServiceLimits().to_proto()).max_tree_tokens is None


def test_a_good_tree_passes_and_may_hold_more_tokens_than_a_chain():
    check_verify(_block([1, 2, 3, 4, 5, 6], [-1, 0, 1, -1, 3, -1]), 5, GREEDY, VOCAB, TREES)
    check_verify(_block([1, 2], None), 5, GREEDY, VOCAB, TREES)


@pytest.mark.parametrize("parents, phrase", [
    ([-1, 1, 0], "verify.parents[1] is 1"),  # a parent after (or at) its child
    ([-1, 0, 3], "verify.parents[2] is 3"),  # out of range
    ([-2, 0, 1], "verify.parents[0] is -2"),
    ([-1, 0], "verify.parents has 2 entries for 3 draft tokens"),
])
def test_bad_parents_are_refused_naming_the_field(parents, phrase):
    error = _refused(_block([1, 2, 3], parents))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and phrase in str(error)


def test_a_tree_over_the_limit_or_to_a_cloud_of_chains_is_refused():
    error = _refused(_block(list(range(9)), [-1] * 9))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "limit is 8 (ServiceInfo.limits.max_tree_tokens)" in str(error)
    error = _refused(_block([1, 2], [-1, -1]), ServiceLimits())
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "chains only" in str(error)


def test_the_context_limit_counts_the_longest_path_not_the_whole_tree():
    wide = _block([1, 2, 3, 4, 5, 6], [-1] * 6)  # depth 1: fits a session of 29 (29 + 1 + 1 <= 32)
    check_verify(_block([1, 2, 3, 4, 5, 6], [-1] * 6, start=29), 29, GREEDY, VOCAB, TREES)
    deep = _block([1, 2, 3], [-1, 0, 1], start=29)
    assert _refused(deep, length=29).code == grpc.StatusCode.OUT_OF_RANGE
    assert wire.tree_parents(wide) == [-1] * 6
