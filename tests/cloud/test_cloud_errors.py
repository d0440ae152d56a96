"""Bad input to the cloud service: each refusal has the precise status code and an actionable message.

Frame-level problems come back as an `error` CloudFrame and the stream and session stay usable, so
every test here that refuses a frame then checks that the same stream still verifies. Transport-level
problems (a message over 4 MiB) end the call with RESOURCE_EXHAUSTED, and the server keeps serving.
Finally, a healthy session running next to all of this sees exactly the verdicts it would see alone.
"""

from __future__ import annotations

import re
import socket
import threading
import urllib.request

import grpc
import pytest

from cloud.server import CloudSettings
from cloud_harness import ServerThread, SessionStream
from common.model.cached_lm import CachedLM
from common.spec.local_decoder import LocalDecoder
from common.spec.modes import DecodeSettings
from common.model.loading import LoadedModel, vocab_fingerprint
from sprinter.v1 import decoding_pb2 as pb
from sprinter.v1 import decoding_pb2_grpc as pb_grpc

VOCAB = 259  # the tiny random models
MAX_BLOCK = 4
MAX_CONTEXT = 64
GOOD = 5  # a token id every test may draft
SAMPLED = pb.SamplingSettings(temperature=1.0, seed=7)
TIMEOUT = 20.0
# A message that serializes to more than 4 MiB: int32 ids in [128, 16384) take two bytes each.
HUGE_IDS = [258] * 2_200_000

S = grpc.StatusCode


# ---------------------------------------------------------------------------------------------- helpers


def dist(token_ids: list[int], probs: list[float]) -> pb.SparseDistribution:
    return pb.SparseDistribution(token_ids=token_ids, probs=probs)


def point(token: int) -> pb.SparseDistribution:
    """The distribution of a draft that was sure of `token`."""
    return dist([token], [1.0])


def assert_refused(frame: pb.CloudFrame, code: grpc.StatusCode, *phrases: str,
                   context_length: int | None = None) -> pb.Error:
    assert frame.WhichOneof("frame") == "error", f"expected an error frame, got {frame}"
    error = frame.error
    assert error.code == code.value[0], f"expected {code.name}, got code {error.code}: {error.message!r}"
    for phrase in phrases:
        assert phrase in error.message, f"{phrase!r} not in {error.message!r}"
    if context_length is not None:
        assert error.context_length == context_length, error
    return error


def assert_call_fails(err: grpc.RpcError, code: grpc.StatusCode, *phrases: str) -> None:
    assert err.code() == code, f"expected {code.name}, got {err.code().name}: {err.details()!r}"
    for phrase in phrases:
        assert phrase in (err.details() or ""), f"{phrase!r} not in {err.details()!r}"


class Edge:
    """A SessionStream that remembers the session length, so it can prove the stream still works."""

    def __init__(self, channel: grpc.Channel, metadata: tuple[tuple[str, str], ...] | None = None) -> None:
        self.stream = SessionStream(channel, metadata)
        self.length = 0

    def send(self, frame: pb.EdgeFrame) -> pb.CloudFrame:
        return self.stream.send(frame)

    def open(self, prompt_ids: list[int], **kw) -> pb.CloudFrame:
        frame = self.stream.open(prompt_ids, **kw)
        if frame.WhichOneof("frame") == "opened":
            self.length = frame.opened.context_length
        return frame

    def opened(self, prompt_ids: list[int], **kw) -> pb.SessionOpened:
        frame = self.open(prompt_ids, **kw)
        assert frame.WhichOneof("frame") == "opened", frame
        return frame.opened

    def verify(self, draft_tokens: list[int], method: int = pb.METHOD_BLOCK, **kw) -> pb.CloudFrame:
        return self.stream.verify(self.length, draft_tokens, method, **kw)

    def still_works(self) -> pb.Verdict:
        """A good verify (valid greedy and sampled alike) returns a verdict and advances the session."""
        frame = self.stream.verify(self.length, [GOOD], pb.METHOD_BLOCK, draft_dists=[point(GOOD)])
        assert frame.WhichOneof("frame") == "verdict", f"the stream no longer works: {frame}"
        verdict = frame.verdict
        assert verdict.context_length == self.length + verdict.n_accepted + 1
        assert 0 <= verdict.next_token < VOCAB
        self.length = verdict.context_length
        return verdict

    def close(self) -> None:
        self.stream.close()

    def abandon(self) -> None:
        self.stream.abandon()


@pytest.fixture(scope="module")
def cloud(tiny_target):
    settings = CloudSettings(max_block=MAX_BLOCK, max_context=MAX_CONTEXT, batch_window_ms=1, max_tree_tokens=0)
    with ServerThread(settings, tiny_target) as server:
        yield server


@pytest.fixture()
def channel(cloud):
    with grpc.insecure_channel(cloud.address) as ch:
        yield ch


@pytest.fixture()
def edge(channel):
    """A stream with an open greedy session of 3 tokens."""
    e = Edge(channel)
    e.opened([1, 2, 3])
    yield e
    e.close()


@pytest.fixture()
def sampled_edge(channel):
    """A stream with an open sampled (temperature 1) session of 3 tokens."""
    e = Edge(channel)
    e.opened([1, 2, 3], sampling=SAMPLED)
    yield e
    e.close()


# ------------------------------------------------------------------------------- token ids and blocks


@pytest.mark.parametrize("prompt, bad", [([VOCAB], VOCAB), ([1, 2, 100_000], 100_000), ([-1], -1), ([3, -7, 4], -7)])
def test_prompt_ids_outside_the_vocabulary(channel, prompt, bad):
    edge = Edge(channel)
    assert_refused(edge.open(prompt), S.INVALID_ARGUMENT, "open.prompt_ids", f"token id {bad}",
                   "outside the vocabulary", f"[0, {VOCAB})", context_length=0)
    edge.opened([1, 2, 3])  # the same stream opens a good session and verifies
    edge.still_works()
    edge.close()


@pytest.mark.parametrize("block, bad", [([VOCAB], VOCAB), ([GOOD, 1000], 1000), ([-1], -1), ([GOOD, GOOD, -300], -300)])
def test_draft_tokens_outside_the_vocabulary(edge, block, bad):
    assert_refused(edge.verify(block), S.INVALID_ARGUMENT, "verify.draft_tokens", f"token id {bad}",
                   "outside the vocabulary", context_length=3)
    edge.still_works()


def test_a_tree_frame_is_refused_by_a_cloud_of_chains_and_says_so(edge, channel):
    """The cloud's limits say 0 tree tokens (--max-tree-tokens 0: chains only): a frame with parents is refused,
    naming the field; a chain spelled as parents is a tree frame too, and an empty parents list is the chain it always
    was."""
    limits = pb_grpc.TargetServiceStub(channel).GetInfo(pb.GetInfoRequest(), timeout=TIMEOUT).limits
    assert limits.max_tree_tokens == 0
    for parents in ([-1, -1], [-1, 0]):
        assert_refused(edge.verify([GOOD, GOOD], parents=parents), S.INVALID_ARGUMENT, "verify.parents",
                       "max_tree_tokens", context_length=3)
    edge.still_works()


@pytest.mark.parametrize("token_ids, bad", [([GOOD, VOCAB], VOCAB), ([GOOD, -1], -1)])
def test_sparse_distribution_ids_outside_the_vocabulary(sampled_edge, token_ids, bad):
    frame = sampled_edge.verify([GOOD], draft_dists=[dist(token_ids, [0.5, 0.5])])
    assert_refused(frame, S.INVALID_ARGUMENT, "verify.draft_dists[0]", f"token id {bad}", "outside the vocabulary",
                   context_length=3)
    sampled_edge.still_works()


def test_empty_block(edge):
    assert_refused(edge.verify([]), S.INVALID_ARGUMENT, "draft_tokens is empty", "at least one draft token",
                   context_length=3)
    edge.still_works()


def test_block_over_max_block(edge):
    frame = edge.verify([GOOD] * (MAX_BLOCK + 1))
    assert_refused(frame, S.INVALID_ARGUMENT, f"{MAX_BLOCK + 1} tokens", f"limit is {MAX_BLOCK}", "max_block",
                   context_length=3)
    assert edge.verify([GOOD] * MAX_BLOCK).WhichOneof("frame") == "verdict"  # exactly max_block is fine


# -------------------------------------------------------------------------------------- context limits


def test_prompt_over_max_context(channel):
    edge = Edge(channel)
    assert_refused(edge.open([GOOD] * 100), S.INVALID_ARGUMENT, "prompt has 100 tokens", f"at most {MAX_CONTEXT - 1}", f"context limit is {MAX_CONTEXT}")
    # A prompt of max_context tokens leaves no room for a single new token either.
    assert_refused(edge.open([GOOD] * MAX_CONTEXT), S.INVALID_ARGUMENT, f"at most {MAX_CONTEXT - 1}")
    edge.opened([GOOD] * (MAX_CONTEXT - 1))
    assert edge.length == MAX_CONTEXT - 1
    edge.opened([1, 2, 3])
    edge.still_works()
    edge.close()


def test_empty_prompt(channel):
    edge = Edge(channel)
    assert_refused(edge.open([]), S.INVALID_ARGUMENT, "prompt_ids is empty", "at least one token")
    edge.opened([1])
    edge.still_works()
    edge.close()


def test_verify_past_max_context_is_out_of_range(channel):
    edge = Edge(channel)
    edge.opened([GOOD] * (MAX_CONTEXT - 4))
    frame = edge.verify([GOOD] * 4)  # 60 + 4 drafted + 1 next token > 64
    assert_refused(frame, S.OUT_OF_RANGE, f"context limit of {MAX_CONTEXT}", context_length=MAX_CONTEXT - 4)
    verdict = edge.verify([GOOD] * 3).verdict  # 60 + 3 + 1 == 64 still fits
    assert verdict.context_length <= MAX_CONTEXT
    edge.close()


# ------------------------------------------------------------------------------------ frame structure


def test_verify_before_open(channel):
    edge = Edge(channel)
    assert_refused(edge.verify([GOOD]), S.FAILED_PRECONDITION, "verify before open", "send an open frame first",
                   context_length=0)
    edge.opened([1, 2])
    edge.still_works()
    edge.close()


def test_empty_edge_frame(channel):
    edge = Edge(channel)
    assert_refused(edge.send(pb.EdgeFrame()), S.INVALID_ARGUMENT, "empty frame", "open, verify, residual_answer or close")
    edge.opened([1, 2])
    assert_refused(edge.send(pb.EdgeFrame()), S.INVALID_ARGUMENT, "empty frame", context_length=2)
    edge.still_works()
    edge.close()


def test_method_unset(edge):
    frame = edge.verify([GOOD], method=pb.METHOD_UNSPECIFIED)
    assert_refused(frame, S.INVALID_ARGUMENT, "verify.method is unset", "METHOD_BLOCK", context_length=3)
    assert_refused(edge.verify([GOOD], method=17), S.INVALID_ARGUMENT, "verify.method")  # an unknown enum value
    edge.still_works()


def test_start_position_mismatch_tells_the_clouds_length(edge):
    assert_refused(edge.stream.verify(99, [GOOD]), S.FAILED_PRECONDITION, "holds 3 tokens", "resync",
                   context_length=3)
    edge.still_works()


# --------------------------------------------------------------------------------- sessions and owners


def test_resume_unknown_session_is_not_found(channel):
    edge = Edge(channel)
    frame = edge.open([], resume_session_id="0123456789abcdef01234567")
    assert_refused(frame, S.NOT_FOUND, "'0123456789abcdef01234567'", "unknown or was evicted", "reopen")
    edge.opened([1, 2, 3])
    edge.still_works()
    edge.close()


@pytest.fixture(scope="module")
def auth_cloud(tiny_target, tmp_path_factory):
    tokens = tmp_path_factory.mktemp("auth") / "tokens"
    tokens.write_text("edge-a tokenA\nedge-b tokenB\n")
    with ServerThread(CloudSettings(auth_tokens=tokens, batch_window_ms=1), tiny_target) as server:
        yield server


def test_resuming_another_edges_session_is_permission_denied(auth_cloud):
    as_a = (("authorization", "Bearer tokenA"),)
    as_b = (("authorization", "Bearer tokenB"),)
    with grpc.insecure_channel(auth_cloud.address) as channel:
        edge_a = Edge(channel, as_a)
        session_id = edge_a.opened([1, 2, 3]).session_id
        edge_a.still_works()
        edge_b = Edge(channel, as_b)
        frame = edge_b.open([], resume_session_id=session_id)
        assert_refused(frame, S.PERMISSION_DENIED, "belongs to another edge", context_length=0)
        edge_b.opened([4, 5])  # edge B's stream keeps working on a session of its own
        edge_b.still_works()
        edge_a.still_works()  # and edge A's session was not touched
        edge_b.close()
        edge_a.abandon()
        again = Edge(channel, as_a)  # the owner can resume it from another stream
        resumed = again.opened([], resume_session_id=session_id)
        assert resumed.resumed and resumed.context_length == edge_a.length
        again.close()


# ------------------------------------------------------------------------------------ sampling settings

BAD_SAMPLING = {
    "negative temperature": (pb.SamplingSettings(temperature=-1.0), "sampling.temperature"),
    "NaN temperature": (pb.SamplingSettings(temperature=float("nan")), "sampling.temperature"),
    "infinite temperature": (pb.SamplingSettings(temperature=float("inf")), "sampling.temperature"),
    "top_p 0": (pb.SamplingSettings(temperature=1.0, top_p=0.0), "sampling.top_p"),
    "top_p 1.5": (pb.SamplingSettings(temperature=1.0, top_p=1.5), "sampling.top_p"),
    "NaN top_p": (pb.SamplingSettings(temperature=1.0, top_p=float("nan")), "sampling.top_p"),
    "top_k -1": (pb.SamplingSettings(temperature=1.0, top_k=-1), "sampling.top_k"),
}


@pytest.mark.parametrize("name", BAD_SAMPLING)
def test_nonsense_sampling_on_open(channel, name):
    sampling, phrase = BAD_SAMPLING[name]
    edge = Edge(channel)
    error = assert_refused(edge.open([1, 2, 3], sampling=sampling), S.INVALID_ARGUMENT, phrase)
    assert re.search(r"must be|must lie", error.message), error.message  # says what a valid value is
    edge.opened([1, 2, 3], sampling=SAMPLED)
    edge.still_works()
    edge.close()


def test_tiny_positive_temperature_never_kills_the_stream(channel):
    """1e-40 is finite and > 0 (a float32 subnormal): the cloud must either refuse it or sample with it.

    BUG: it is accepted, then logits / temperature overflow to inf, softmax gives NaN and
    torch.multinomial raises, so the whole call dies with UNKNOWN instead of an answer frame.
    """
    edge = Edge(channel)
    frame = edge.open([1, 2, 3], sampling=pb.SamplingSettings(temperature=1e-40, seed=1))
    if frame.WhichOneof("frame") == "error":
        assert_refused(frame, S.INVALID_ARGUMENT, "sampling.temperature")
        edge.opened([1, 2, 3], sampling=SAMPLED)
        edge.still_works()
    else:
        assert frame.WhichOneof("frame") == "opened"
        edge.length = frame.opened.context_length
        try:
            answer = edge.verify([GOOD], draft_dists=[point(GOOD)])
        except grpc.RpcError as err:
            pytest.fail(f"a verify in a temperature-1e-40 session killed the stream: {err.code().name} {err.details()}")
        assert answer.WhichOneof("frame") in ("verdict", "error"), answer
    edge.close()


# ---------------------------------------------------------------------------- probabilities and dists


def test_draft_token_probs_of_the_wrong_length(edge):
    frame = edge.verify([GOOD, GOOD], draft_token_probs=[0.5])
    assert_refused(frame, S.INVALID_ARGUMENT, "draft_token_probs has 1 entries for 2 draft tokens", context_length=3)
    frame = edge.verify([GOOD], draft_token_probs=[0.5, 0.5])
    assert_refused(frame, S.INVALID_ARGUMENT, "draft_token_probs has 2 entries for 1 draft tokens")
    assert edge.verify([GOOD], draft_token_probs=[0.5]).WhichOneof("frame") == "verdict"


@pytest.mark.parametrize("p", [0.0, -0.1, 1.5, float("nan")])
def test_draft_token_probs_outside_0_1(edge, p):
    assert_refused(edge.verify([GOOD], draft_token_probs=[p]), S.INVALID_ARGUMENT, "draft_token_probs must lie in (0, 1]")
    edge.still_works()


@pytest.mark.parametrize("probs", [[0.2, 0.2], [0.9, 0.9], [1.2, -0.2], [float("nan"), 1.0]])
def test_sparse_probs_not_a_distribution(sampled_edge, probs):
    frame = sampled_edge.verify([GOOD], draft_dists=[dist([GOOD, GOOD + 1], probs)])
    assert_refused(frame, S.INVALID_ARGUMENT, "verify.draft_dists[0]", "sum to 1", context_length=3)
    sampled_edge.still_works()


@pytest.mark.parametrize("token_ids, probs", [([GOOD, 6], [1.0]), ([GOOD], [0.5, 0.5]), ([], [])])
def test_sparse_token_ids_and_probs_of_different_lengths(sampled_edge, token_ids, probs):
    frame = sampled_edge.verify([GOOD], draft_dists=[dist(token_ids, probs)])
    assert_refused(frame, S.INVALID_ARGUMENT, "verify.draft_dists[0]", "equal length")
    sampled_edge.still_works()


def test_sparse_support_over_the_limit(sampled_edge):
    ids = list(range(VOCAB)) * 16  # 4144 entries > max_sparse_support 4096
    frame = sampled_edge.verify([GOOD], draft_dists=[dist(ids, [1.0 / len(ids)] * len(ids))])
    assert_refused(frame, S.INVALID_ARGUMENT, "4144 entries", "limit is 4096")
    sampled_edge.still_works()


def test_sparse_dist_giving_the_draft_token_zero_probability(sampled_edge):
    frame = sampled_edge.verify([GOOD], draft_dists=[dist([GOOD + 1, GOOD + 2], [0.5, 0.5])])
    assert_refused(frame, S.INVALID_ARGUMENT, "verify.draft_dists[0]", f"draft token {GOOD} probability 0")
    frame = sampled_edge.verify([GOOD], draft_dists=[dist([GOOD, GOOD + 1], [0.0, 1.0])])  # listed, but with p = 0
    assert_refused(frame, S.INVALID_ARGUMENT, "probability 0")
    sampled_edge.still_works()


def test_sparse_dist_with_a_repeated_token_id_is_refused(sampled_edge):
    """The sparse probs sum to 1, but densified (index_put_, no accumulation) the row sums to 0.5.

    BUG: the cloud accepts it and verifies against a p_draft row that is not a distribution.
    """
    frame = sampled_edge.verify([GOOD], draft_dists=[dist([GOOD, GOOD], [0.5, 0.5])])
    assert_refused(frame, S.INVALID_ARGUMENT, "verify.draft_dists[0]", str(GOOD), context_length=3)
    sampled_edge.still_works()


@pytest.mark.parametrize("method, n_dists, needed", [
    (pb.METHOD_BLOCK, 0, 3), (pb.METHOD_BLOCK, 1, 3), (pb.METHOD_BLOCK, 2, 3), (pb.METHOD_BLOCK, 4, 3),
    (pb.METHOD_TOKEN, 1, 3), (pb.METHOD_SPRINTER, 0, 1), (pb.METHOD_SPRINTER, 2, 1),
])
def test_wrong_number_of_draft_dists_under_sampling(sampled_edge, method, n_dists, needed):
    frame = sampled_edge.verify([GOOD] * 3, method=method, draft_dists=[point(GOOD)] * n_dists)
    assert_refused(frame, S.INVALID_ARGUMENT, f"draft_dists has {n_dists} distributions", f"needs {needed}",
                   context_length=3)
    sampled_edge.still_works()


@pytest.mark.parametrize("n_dists", [1, 3])
def test_sprinter_under_sampling_takes_just_the_last_dist(sampled_edge, n_dists):
    block = [GOOD, GOOD + 1, GOOD + 2]
    frame = sampled_edge.verify(block, method=pb.METHOD_SPRINTER, draft_dists=[point(t) for t in block[-n_dists:]])
    assert frame.WhichOneof("frame") == "verdict", frame
    sampled_edge.length = frame.verdict.context_length
    # One dist belongs to the LAST token: a dist meant for the first token is refused.
    frame = sampled_edge.verify([GOOD + 3, GOOD + 4], method=pb.METHOD_SPRINTER, draft_dists=[point(GOOD + 3)])
    assert_refused(frame, S.INVALID_ARGUMENT, "verify.draft_dists[0]", f"draft token {GOOD + 4} probability 0")
    sampled_edge.still_works()


def test_dists_are_optional_when_greedy(edge):
    assert edge.verify([GOOD, GOOD], method=pb.METHOD_BLOCK).WhichOneof("frame") == "verdict"


# ----------------------------------------------------------------------------------------- vocabulary


def test_wrong_vocab_fingerprint_on_open(channel, tiny_target):
    edge = Edge(channel)
    frame = edge.open([1, 2, 3], vocab_fingerprint="f" * 64)
    assert_refused(frame, S.FAILED_PRECONDITION, "vocabulary fingerprint ffffffffffff", "tokenizer", "tiny-random")
    edge.opened([1, 2, 3], vocab_fingerprint=vocab_fingerprint(tiny_target.tokenizer))
    edge.still_works()
    edge.close()


# ------------------------------------------------------------------------------------ oversized messages


def _server_still_serves(channel: grpc.Channel) -> None:
    info = pb_grpc.TargetServiceStub(channel).GetInfo(pb.GetInfoRequest(), timeout=TIMEOUT)
    assert info.limits.max_message_bytes == 4 << 20
    edge = Edge(channel)
    edge.opened([1, 2, 3])
    edge.still_works()
    edge.close()


def test_oversized_open_fails_the_call_with_resource_exhausted(channel):
    edge = Edge(channel)
    frame = pb.EdgeFrame(open=pb.OpenSession(prompt_ids=HUGE_IDS))
    assert frame.ByteSize() > 4 << 20
    with pytest.raises(grpc.RpcError) as caught:
        edge.send(frame)
    assert_call_fails(caught.value, S.RESOURCE_EXHAUSTED, "larger than max")
    edge.abandon()
    _server_still_serves(channel)


def test_oversized_verify_fails_the_call_and_the_session_survives(channel):
    edge = Edge(channel)
    session_id = edge.opened([1, 2, 3], sampling=SAMPLED).session_id
    edge.still_works()
    n = 1_100_000  # 2.2 MB of ids + 4.4 MB of floats
    huge = dist([GOOD] * n, [1.0 / n] * n)
    with pytest.raises(grpc.RpcError) as caught:
        edge.verify([GOOD], draft_dists=[huge])
    assert_call_fails(caught.value, S.RESOURCE_EXHAUSTED)
    edge.abandon()
    _server_still_serves(channel)
    again = Edge(channel)  # the transport refused the frame: the session is as it was
    resumed = again.opened([], resume_session_id=session_id)
    assert resumed.resumed and resumed.context_length == edge.length
    again.still_works()
    again.close()


def test_oversized_generate_fails_with_resource_exhausted(channel):
    stub = pb_grpc.TargetServiceStub(channel)
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(pb.GenerateRequest(prompt_ids=HUGE_IDS, max_new_tokens=1), timeout=TIMEOUT))
    assert_call_fails(caught.value, S.RESOURCE_EXHAUSTED)
    _server_still_serves(channel)


# ------------------------------------------------------------------------------------------- Generate

BAD_GENERATE = {
    "OOV prompt": (pb.GenerateRequest(prompt_ids=[1, VOCAB], max_new_tokens=4), S.INVALID_ARGUMENT,
                   ["outside the vocabulary"]),
    "negative id": (pb.GenerateRequest(prompt_ids=[-3], max_new_tokens=4), S.INVALID_ARGUMENT,
                    ["token id -3", "outside the vocabulary"]),
    "empty prompt": (pb.GenerateRequest(max_new_tokens=4), S.INVALID_ARGUMENT, ["prompt_ids is empty"]),
    "prompt over max_context": (pb.GenerateRequest(prompt_ids=[GOOD] * 100, max_new_tokens=4), S.INVALID_ARGUMENT,
                                [f"at most {MAX_CONTEXT - 1}"]),
    "max_new_tokens 0": (pb.GenerateRequest(prompt_ids=[1, 2], max_new_tokens=0), S.INVALID_ARGUMENT,
                         ["max_new_tokens must be >= 1"]),
    "negative temperature": (pb.GenerateRequest(prompt_ids=[1, 2], max_new_tokens=4,
                                                sampling=pb.SamplingSettings(temperature=-0.5)),
                             S.INVALID_ARGUMENT, ["sampling.temperature"]),
    "top_p 0": (pb.GenerateRequest(prompt_ids=[1, 2], max_new_tokens=4,
                                   sampling=pb.SamplingSettings(temperature=1.0, top_p=0.0)),
                S.INVALID_ARGUMENT, ["sampling.top_p"]),
    "top_k -1": (pb.GenerateRequest(prompt_ids=[1, 2], max_new_tokens=4,
                                    sampling=pb.SamplingSettings(temperature=1.0, top_k=-1)),
                 S.INVALID_ARGUMENT, ["sampling.top_k"]),
    "wrong fingerprint": (pb.GenerateRequest(prompt_ids=[1, 2], max_new_tokens=4, vocab_fingerprint="0" * 64),
                          S.FAILED_PRECONDITION, ["fingerprint", "tokenizer"]),
}


@pytest.mark.parametrize("name", BAD_GENERATE)
def test_generate_with_bad_input_ends_with_the_status(channel, name):
    request, code, phrases = BAD_GENERATE[name]
    stub = pb_grpc.TargetServiceStub(channel)
    with pytest.raises(grpc.RpcError) as caught:
        chunks = list(stub.Generate(request, timeout=TIMEOUT))
        pytest.fail(f"Generate answered {chunks}")
    assert_call_fails(caught.value, code, *phrases)
    assert stub.GetInfo(pb.GetInfoRequest(), timeout=TIMEOUT).vocab_size == VOCAB


def test_generate_tiny_positive_temperature_never_fails_the_call(channel):
    """BUG (same as the session case): temperature 1e-40 ends Generate with UNKNOWN (NaN probabilities)."""
    stub = pb_grpc.TargetServiceStub(channel)
    request = pb.GenerateRequest(prompt_ids=[1, 2], max_new_tokens=3, sampling=pb.SamplingSettings(temperature=1e-40))
    try:
        chunks = list(stub.Generate(request, timeout=TIMEOUT))
    except grpc.RpcError as err:
        assert_call_fails(err, S.INVALID_ARGUMENT, "sampling.temperature")
    else:
        assert chunks and chunks[-1].finished


def test_good_generate_streams_the_targets_greedy_tokens(channel, tiny_target):
    prompt = [3, 1, 4, 1, 5]
    chunks = list(pb_grpc.TargetServiceStub(channel).Generate(
        pb.GenerateRequest(prompt_ids=prompt, max_new_tokens=8), timeout=TIMEOUT))
    assert chunks and chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    tokens = [t for c in chunks for t in c.token_ids]
    assert 1 <= len(tokens) <= 8 and all(0 <= t < VOCAB for t in tokens)
    assert all(c.step_ms > 0 for c in chunks if c.token_ids)
    local = LocalDecoder(tiny_target, None).generate(prompt, DecodeSettings(mode="target", max_new_tokens=8)).token_ids
    assert tokens == local


def test_generate_stops_at_max_context(channel):
    prompt = [GOOD] * (MAX_CONTEXT - 3)
    chunks = list(pb_grpc.TargetServiceStub(channel).Generate(
        pb.GenerateRequest(prompt_ids=prompt, max_new_tokens=100), timeout=TIMEOUT))
    assert chunks[-1].finished
    assert 1 <= sum(len(c.token_ids) for c in chunks) <= 3


# ---------------------------------------------------------------- isolation under concurrent bad input


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
    with opener.open(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT) as response:
        return response.read().decode()


def _sample(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


HEALTHY_PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
HEALTHY_ROUNDS = 12


def _greedy_continuation(target: LoadedModel, prompt: list[int], n: int) -> list[int]:
    lm, ids = CachedLM(target.model), list(prompt)
    for _ in range(n):
        ids.append(int(lm.advance_to(ids).logits[-1].argmax()))
    return ids[len(prompt):]


def _healthy_run(channel: grpc.Channel, continuation: list[int], verdicts: list[tuple[int, int, int]],
                 start: threading.Barrier | None = None) -> None:
    """A fixed greedy sequence: drafts from the target's own continuation, some of them spoiled on purpose."""
    edge = Edge(channel)
    edge.opened(HEALTHY_PROMPT)
    if start is not None:
        start.wait(TIMEOUT)
    for i in range(HEALTHY_ROUNDS):
        done = edge.length - len(HEALTHY_PROMPT)
        block = list(continuation[done:done + 3])
        if i % 3:  # spoil the 2nd (i % 3 == 1) or the 1st (i % 3 == 2) draft token
            block[2 - i % 3] = (block[2 - i % 3] + 1) % VOCAB
        frame = edge.verify(block)
        assert frame.WhichOneof("frame") == "verdict", frame
        v = frame.verdict
        verdicts.append((v.n_accepted, v.next_token, v.context_length))
        edge.length = v.context_length
    edge.close()


def _fire_bad_frames(channel: grpc.Channel, fired: list[str]) -> None:
    """One pass of every bad input; each answer is checked loosely (the detailed checks are above)."""
    stub = pb_grpc.TargetServiceStub(channel)

    def refused(frame: pb.CloudFrame, code: grpc.StatusCode, what: str) -> None:
        assert frame.WhichOneof("frame") == "error" and frame.error.code == code.value[0], (what, frame)
        fired.append(what)

    greedy = Edge(channel)
    refused(greedy.verify([GOOD]), S.FAILED_PRECONDITION, "verify before open")
    refused(greedy.send(pb.EdgeFrame()), S.INVALID_ARGUMENT, "empty frame")
    refused(greedy.open([VOCAB]), S.INVALID_ARGUMENT, "OOV prompt")
    refused(greedy.open([-1]), S.INVALID_ARGUMENT, "negative prompt id")
    refused(greedy.open([]), S.INVALID_ARGUMENT, "empty prompt")
    refused(greedy.open([GOOD] * 200), S.INVALID_ARGUMENT, "prompt over max_context")
    refused(greedy.open([1], vocab_fingerprint="f" * 64), S.FAILED_PRECONDITION, "fingerprint")
    refused(greedy.open([], resume_session_id="nope"), S.NOT_FOUND, "unknown session")
    for sampling, _ in BAD_SAMPLING.values():
        refused(greedy.open([1, 2], sampling=sampling), S.INVALID_ARGUMENT, "bad sampling")
    greedy.opened([1, 2, 3])  # a valid open: a prefill that may share a forward with the healthy session
    refused(greedy.verify([VOCAB]), S.INVALID_ARGUMENT, "OOV draft")
    refused(greedy.verify([-2]), S.INVALID_ARGUMENT, "negative draft")
    refused(greedy.verify([]), S.INVALID_ARGUMENT, "empty block")
    refused(greedy.verify([GOOD] * (MAX_BLOCK + 1)), S.INVALID_ARGUMENT, "oversized block")
    refused(greedy.verify([GOOD], method=pb.METHOD_UNSPECIFIED), S.INVALID_ARGUMENT, "method unset")
    refused(greedy.verify([GOOD], draft_token_probs=[0.5, 0.5]), S.INVALID_ARGUMENT, "probs length")
    refused(greedy.stream.verify(1000, [GOOD]), S.FAILED_PRECONDITION, "desync")
    greedy.close()

    full = Edge(channel)
    full.opened([GOOD] * (CHAOS_CONTEXT - 2))
    refused(full.verify([GOOD, GOOD]), S.OUT_OF_RANGE, "past max_context")
    full.abandon()  # an edge that goes away without closing

    sampled = Edge(channel)
    sampled.opened([1, 2, 3], sampling=SAMPLED)
    refused(sampled.verify([GOOD], draft_dists=[dist([VOCAB], [1.0])]), S.INVALID_ARGUMENT, "OOV dist id")
    refused(sampled.verify([GOOD], draft_dists=[dist([GOOD, 6], [0.2, 0.2])]), S.INVALID_ARGUMENT, "sum")
    refused(sampled.verify([GOOD], draft_dists=[dist([GOOD, 6], [1.0])]), S.INVALID_ARGUMENT, "lengths")
    refused(sampled.verify([GOOD], draft_dists=[dist([6], [1.0])]), S.INVALID_ARGUMENT, "zero prob")
    refused(sampled.verify([GOOD] * 3, draft_dists=[point(GOOD)]), S.INVALID_ARGUMENT, "dist count")
    sampled.close()

    for name, (request, code, _) in BAD_GENERATE.items():
        if name == "prompt over max_context":
            continue
        try:
            list(stub.Generate(request, timeout=TIMEOUT))
            raise AssertionError(f"Generate accepted {name}")
        except grpc.RpcError as err:
            assert err.code() == code, (name, err)
            fired.append(name)


CHAOS_CONTEXT = 128


def test_a_healthy_session_is_unaffected_by_concurrent_bad_input(tiny_target):
    metrics_port = _free_port()
    settings = CloudSettings(max_block=MAX_BLOCK, max_context=CHAOS_CONTEXT, batch_window_ms=1, metrics_port=metrics_port)
    with ServerThread(settings, tiny_target) as server, grpc.insecure_channel(server.address) as channel:
        continuation = _greedy_continuation(tiny_target, HEALTHY_PROMPT, 4 * HEALTHY_ROUNDS + 3)
        alone: list[tuple[int, int, int]] = []
        _healthy_run(channel, continuation, alone)  # the reference: the same sequence with nothing else going on
        assert len({n for n, _, _ in alone}) >= 2, f"the sequence should accept drafts sometimes: {alone}"
        before = _scrape(metrics_port)

        runs: list[list[tuple[int, int, int]]] = [[] for _ in range(3)]
        fired: list[str] = []
        failures: list[BaseException] = []
        start = threading.Barrier(2)
        healthy_done = threading.Event()

        def healthy() -> None:
            try:
                for i, run in enumerate(runs):  # the sequence three times over, each in a session of its own
                    _healthy_run(channel, continuation, run, start if i == 0 else None)
            except BaseException as err:  # noqa: BLE001 - reported below
                failures.append(err)
            finally:
                healthy_done.set()

        def attacker() -> None:
            try:
                with grpc.insecure_channel(server.address) as own:  # its own connection, and the shared one
                    start.wait(TIMEOUT)
                    passes = 0
                    while passes < 1 or (not healthy_done.is_set() and passes < 20):
                        _fire_bad_frames(own if passes % 2 else channel, fired)
                        passes += 1
                    try:  # one message the transport refuses
                        list(pb_grpc.TargetServiceStub(own).Generate(
                            pb.GenerateRequest(prompt_ids=HUGE_IDS, max_new_tokens=1), timeout=TIMEOUT))
                    except grpc.RpcError as err:
                        assert err.code() == S.RESOURCE_EXHAUSTED, err
            except BaseException as err:  # noqa: BLE001 - reported below
                failures.append(err)

        threads = [threading.Thread(target=healthy), threading.Thread(target=attacker)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a client thread hung"
        assert not failures, failures
        for run in runs:
            assert run == alone
        assert len(fired) >= 30

        info = pb_grpc.TargetServiceStub(channel).GetInfo(pb.GetInfoRequest(), timeout=TIMEOUT)
        assert info.vocab_size == VOCAB
        after = _scrape(metrics_port)

    errors = 'sprinter_cloud_errors_total'
    for code in ("INVALID_ARGUMENT", "FAILED_PRECONDITION", "NOT_FOUND", "OUT_OF_RANGE"):
        assert _sample(after, errors, f'{{code="{code}"}}') > _sample(before, errors, f'{{code="{code}"}}'), code
    assert _sample(after, errors, '{code="INVALID_ARGUMENT"}') > 0
    assert _sample(after, "sprinter_cloud_verify_calls_total", '{method="block"}') >= 4 * HEALTHY_ROUNDS
    assert _sample(after, "sprinter_cloud_batch_size_count") >= 4 * HEALTHY_ROUNDS
    assert 'sprinter_cloud_batch_size_bucket{le="1.0"}' in after
    assert "sprinter_cloud_tokens_verified_total" in after
