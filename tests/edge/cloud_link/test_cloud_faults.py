"""Issue 12, the edge against a cloud that refuses, limits, hangs or goes away: never a 500, never a cut stream.

The edge daemon runs in this process (tests/edge_harness.py: the real app and node, uvicorn on
loopback); the cloud is the real CloudServer (tests/cloud_harness.py) or, for faults a test cannot
cause on cue, a scripted gRPC server.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import grpc
import httpx
import pytest

from cloud.server import CloudSettings
from cloud_harness import ServerThread
from edge.api.app import ApiSettings, create_app
from edge_harness import EdgeDaemonThread, ScriptedCloud, scripted
from sim.processes import free_port
from sprinter.v1 import decoding_pb2 as pb

TINY_CLOUD = CloudSettings(target="tiny-random", dtype="float32", batch_window_ms=1, drain_s=0.2)


def app_factory(mode: str = "sd", **api):
    return lambda node: create_app(node, ApiSettings(default_mode=mode, model_name="sprinter-tiny", **api))


def sse_events(response: httpx.Response) -> tuple[list[dict], bool]:
    """The JSON chunks of a streamed response, and whether it ended with [DONE]."""
    events, done = [], False
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
        else:
            events.append(json.loads(line[len("data: "):]))
    return events, done


def post(edge: EdgeDaemonThread, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(edge.base + path, json={"model": "x", "temperature": 0, **body}, timeout=60)


@pytest.fixture(scope="module")
def small_cloud(tiny_target):
    """A cloud with small limits: blocks of at most 3 tokens, a context of 64 (byte vocabulary: 1 char = 1 token)."""
    with ServerThread(replace(TINY_CLOUD, max_block=3, max_context=64), tiny_target) as server:
        yield server


@pytest.fixture(scope="module")
def edge_on_small_cloud(small_cloud, tiny_draft):
    with EdgeDaemonThread(tiny_draft, small_cloud.address, app_factory("sd")) as edge:
        yield edge


def test_blocks_are_clamped_to_the_clouds_max_block(edge_on_small_cloud):
    """k=8 against --max-block 3: the cloud used to refuse every block (HTTP 500); now blocks fit."""
    reference = post(edge_on_small_cloud, {"prompt": "abc", "max_tokens": 20, "mode": "target"})
    response = post(edge_on_small_cloud, {"prompt": "abc", "max_tokens": 20, "mode": "sd-block", "k": 8})
    assert response.status_code == 200, response.text
    sprinter = response.json()["sprinter"]
    assert not sprinter["degraded"] and sprinter["target_calls"] >= 1
    assert sprinter["block_length_mean"] <= 3
    assert response.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]


def test_a_request_over_the_clouds_context_is_refused_up_front(edge_on_small_cloud):
    """prompt + max_tokens over the cloud's max_context: a 400 naming both numbers, as vLLM does."""
    for mode in ("sd", "target", "sprinter-exact"):
        response = post(edge_on_small_cloud, {"prompt": "x" * 40, "max_tokens": 50, "mode": mode})
        assert response.status_code == 400, (mode, response.text)
        message = response.json()["error"]["message"]
        assert "64" in message and "50" in message, message
    too_long = post(edge_on_small_cloud, {"prompt": "x" * 80, "max_tokens": 1})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] in ("prompt", "messages")


def test_without_max_tokens_the_completion_fills_the_context_and_says_length(edge_on_small_cloud):
    for mode in ("sd", "target"):
        response = post(edge_on_small_cloud, {"prompt": "x" * 40, "mode": mode})
        assert response.status_code == 200, (mode, response.text)
        body = response.json()
        assert 1 <= body["usage"]["completion_tokens"] <= 24
        if body["usage"]["completion_tokens"] < 24 and body["choices"][0]["finish_reason"] == "stop":
            continue  # the target may stop at EOS before the context is full
        assert body["choices"][0]["finish_reason"] == "length", (mode, body)


@pytest.mark.parametrize("mode", ["sd", "target"])
def test_cloud_restarted_with_a_smaller_context_ends_the_stream_cleanly(tiny_target, tiny_draft, mode):
    """Limits read at connect go stale when the cloud restarts smaller: the edge ends with what it has, as `length`."""
    port = free_port()
    with ServerThread(replace(TINY_CLOUD, port=port), tiny_target) as cloud:
        with EdgeDaemonThread(tiny_draft, cloud.address, app_factory("sd")) as edge:
            cloud.__exit__(None, None, None)
            with ServerThread(replace(TINY_CLOUD, port=port, max_context=64), tiny_target):
                with httpx.stream("POST", edge.base + "/v1/completions", timeout=60, json={
                        "model": "x", "prompt": "y" * 40, "max_tokens": 100, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}, "mode": mode}) as response:
                    assert response.status_code == 200
                    events, done = sse_events(response)
    assert done, "the stream was cut: no [DONE]"
    final, usage = events[-2], events[-1]
    assert final["choices"][0]["finish_reason"] == "length" and usage["choices"] == []
    assert 0 < usage["usage"]["completion_tokens"] <= 24
    assert "".join(e["choices"][0]["text"] for e in events[:-1])


def test_a_refusal_mid_generation_keeps_the_tokens_and_names_the_error(tiny_draft):
    """A verify the cloud refuses (a bug, a config change) ends the response with its tokens and the error."""
    refusal = pb.Error(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="verify.method is unset")
    script = scripted(tiny_draft, verify_refusals_after=2, verify_refusal=refusal)
    with ScriptedCloud(script) as cloud, EdgeDaemonThread(tiny_draft, cloud.address, app_factory("sd")) as edge:
        whole = post(edge, {"prompt": "abc", "max_tokens": 40, "k": 4})
        script.verifies = 0
        with httpx.stream("POST", edge.base + "/v1/completions", timeout=60, json={
                "model": "x", "prompt": "abc", "max_tokens": 40, "temperature": 0, "stream": True, "k": 4}) as response:
            events, done = sse_events(response)
    assert whole.status_code == 200, whole.text
    body = whole.json()
    assert body["usage"]["completion_tokens"] == 10  # two verdicts of 4 + 1
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["sprinter"]["error"]["code"] == "INVALID_ARGUMENT" and "method" in body["sprinter"]["error"]["message"]
    assert done and events[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["sprinter"]["error"]["code"] == "INVALID_ARGUMENT"
    assert "".join(e["choices"][0]["text"] for e in events) == body["choices"][0]["text"]


# --- a busy cloud, a hung cloud: retries with backoff, deadlines (items 3 and 6) --------------------


def busy(code: grpc.StatusCode, retry_after_ms: int) -> pb.Error:
    return pb.Error(code=code.value[0], message="all 1 sessions are busy; retry later", retry_after_ms=retry_after_ms)


def test_backoff_is_exponential_with_jitter():
    import random

    from edge.cloud_link.client import backoff_delay

    rng = random.Random(7)
    for attempt in range(6):
        nominal = min(1.0, 0.1 * 2 ** attempt)
        delays = [backoff_delay(attempt, 0.1, 1.0, rng) for _ in range(50)]
        assert all(0.5 * nominal <= d < 1.5 * nominal for d in delays)
        assert len(set(delays)) == 50  # edges that failed together do not retry together


def test_a_busy_cloud_is_retried_after_its_retry_after_hint(tiny_draft):
    """RESOURCE_EXHAUSTED with retry_after_ms at open used to be a CloudRefused (HTTP 500)."""
    script = scripted(tiny_draft, open_refusals=[busy(grpc.StatusCode.RESOURCE_EXHAUSTED, 600),
                                                 busy(grpc.StatusCode.UNAVAILABLE, 0)])
    with ScriptedCloud(script) as cloud, EdgeDaemonThread(tiny_draft, cloud.address, app_factory("sd")) as edge:
        started = time.monotonic()
        response = post(edge, {"prompt": "abc", "max_tokens": 10})
        elapsed = time.monotonic() - started
    assert response.status_code == 200, response.text
    assert response.json()["sprinter"]["degraded"] is False and script.opens == 3
    assert elapsed >= 0.6  # the hint was honoured, not a retry straight away


def test_a_cloud_busy_beyond_the_retries_is_waited_for_not_degraded(tiny_draft):
    """Issue 25: a busy cloud answers; a lossless request waits for it, as mode target does, and stays lossless."""
    script = scripted(tiny_draft, open_refusals=[busy(grpc.StatusCode.RESOURCE_EXHAUSTED, 50)] * 6)
    with ScriptedCloud(script) as cloud, EdgeDaemonThread(tiny_draft, cloud.address, app_factory("sd")) as edge:
        response = post(edge, {"prompt": "abc", "max_tokens": 10})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["sprinter"]["degraded"] is False and body["sprinter"]["degraded_reason"] is None
    assert body["usage"]["completion_tokens"] == 10 and script.opens == 7
    assert response.headers["x-sprinter-degraded"] == "false"


def test_mode_target_waits_for_a_busy_cloud_too(tiny_draft):
    script = scripted(tiny_draft, generate_busy=4)
    with ScriptedCloud(script) as cloud, EdgeDaemonThread(tiny_draft, cloud.address, app_factory("target")) as edge:
        response = post(edge, {"prompt": "abc", "max_tokens": 6})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["sprinter"]["degraded"] is False and body["sprinter"]["token_ids"] == [script.next_token] * 6
    assert script.generates == 5


def test_past_the_request_deadline_the_rest_is_degraded_and_says_why(tiny_draft):
    """The request's own deadline (request_deadline_s, else --request-deadline-s) is the one limit on waiting."""
    script = scripted(tiny_draft, open_refusals=[busy(grpc.StatusCode.RESOURCE_EXHAUSTED, 200)] * 1000)
    with ScriptedCloud(script) as cloud, EdgeDaemonThread(tiny_draft, cloud.address,
                                                          app_factory("sd", request_deadline_s=30)) as edge:
        started = time.monotonic()
        response = post(edge, {"prompt": "abc", "max_tokens": 10, "request_deadline_s": 1.0})
        elapsed = time.monotonic() - started
        metrics = httpx.get(edge.base + "/metrics").text
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["sprinter"]["degraded"] is True and body["sprinter"]["degraded_reason"] == "deadline"
    assert body["usage"]["completion_tokens"] == 10
    assert response.headers["x-sprinter-degraded-reason"] == "deadline"
    assert 1.0 <= elapsed < 10, elapsed
    assert 'sprinter_edge_degraded_requests_total{reason="deadline"} 1.0' in metrics


def test_a_bad_request_deadline_is_a_400_naming_it(tiny_draft):
    with EdgeDaemonThread(tiny_draft, f"127.0.0.1:{free_port()}", app_factory("sd")) as edge:
        response = post(edge, {"prompt": "abc", "max_tokens": 4, "request_deadline_s": -1})
    assert response.status_code == 400 and "request_deadline_s" in response.text


def test_a_hung_generate_is_abandoned_at_the_deadline(tiny_draft):
    """Mode target against a cloud that stops sending mid-Generate: no deadline used to mean a request held forever."""
    script = scripted(tiny_draft, generate_hangs_after=3)
    with ScriptedCloud(script) as cloud, EdgeDaemonThread(tiny_draft, cloud.address, app_factory("target", cloud_retry_s=5),
                                                          {"cloud_deadline_s": 0.5}) as edge:
        started = time.monotonic()
        response = httpx.post(edge.base + "/v1/completions", timeout=20, json={
            "model": "x", "prompt": "abc", "max_tokens": 12, "temperature": 0})
        elapsed = time.monotonic() - started
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["sprinter"]["degraded"] is True and body["usage"]["completion_tokens"] == 12
    assert body["sprinter"]["token_ids"][:3] == [script.next_token] * 3  # the cloud's, then the draft's
    assert elapsed < 5


# --- degraded output is marked where it starts (item 8) ---------------------------------------------


def stream_events(edge: EdgeDaemonThread, body: dict, on_first=None) -> tuple[httpx.Headers, list[dict], bool]:
    with httpx.stream("POST", edge.base + "/v1/completions", timeout=60, json={
            "model": "x", "temperature": 0, "stream": True, **body}) as response:
        assert response.status_code == 200
        events, done = [], False
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
                if len(events) == 1 and on_first is not None:
                    on_first()
        return response.headers, events, done


def degraded_flags(events: list[dict]) -> list[bool]:
    return [bool(e.get("sprinter", {}).get("degraded")) for e in events]


def test_without_a_cloud_every_chunk_and_the_headers_say_degraded(tiny_draft):
    with EdgeDaemonThread(tiny_draft, f"127.0.0.1:{free_port()}", app_factory("sd")) as edge:
        whole = post(edge, {"prompt": "abc", "max_tokens": 10})
        headers, events, done = stream_events(edge, {"prompt": "abc", "max_tokens": 10})
    assert whole.status_code == 200 and whole.headers["x-sprinter-degraded"] == "true"
    assert whole.headers["x-sprinter-degraded-reason"] == "cloud_unreachable"  # nothing listens there
    assert done and headers["x-sprinter-degraded"] == "true"
    assert all(degraded_flags(events)), degraded_flags(events)
    assert events[0]["sprinter"]["degraded_reason"] == "cloud_unreachable"


def test_a_cloud_lost_mid_stream_marks_every_chunk_from_that_point(tiny_target, tiny_draft):
    cloud = ServerThread(replace(TINY_CLOUD, port=free_port()), tiny_target).__enter__()
    with EdgeDaemonThread(tiny_draft, cloud.address, app_factory("sd", cloud_retry_s=30)) as edge:
        # EOS barred (logit_bias): the draft goes on after the loss, whatever point the loss lands at; a sampled
        # EOS right after it left no text to mark, now and then, on a loaded machine
        no_eos = {str(token): -100 for token in tiny_target.eos_token_ids}
        headers, events, done = stream_events(edge, {"prompt": "abc", "max_tokens": 600, "k": 4, "logit_bias": no_eos},
                                              on_first=lambda: cloud.__exit__(None, None, None))
    flags = degraded_flags(events)
    assert done and events[-1]["sprinter"]["degraded"] is True
    assert events[-1]["sprinter"]["degraded_reason"] == "cloud_unreachable"
    assert "x-sprinter-degraded" not in headers  # not known when the headers left
    first = flags.index(True)
    assert 0 < first and all(flags[first:]), "a chunk after the degradation point is not marked"
    # marked where the unverified text starts, not only in the final summary
    assert first < len(events) - 1 and any(e["choices"][0]["text"] for e in events[first:-1])


def test_target_mode_goes_back_to_the_cloud_within_a_request(tiny_target, tiny_draft):
    port = free_port()
    settings = replace(TINY_CLOUD, port=port)
    with ServerThread(settings, tiny_target) as cloud:
        address = cloud.address
    restarted = []
    with EdgeDaemonThread(tiny_draft, address, app_factory("target", cloud_retry_s=0.2)) as edge:
        def restart() -> None:
            restarted.append(ServerThread(settings, tiny_target).__enter__())

        _, events, done = stream_events(edge, {"prompt": "abc", "max_tokens": 600}, on_first=restart)
    restarted[0].__exit__(None, None, None)
    final = events[-1]["sprinter"]
    assert done and final["degraded"] is True
    assert final["target_calls"] > 0, "the cloud came back, but the request never used it again"
