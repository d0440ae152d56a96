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


def post(edge: EdgeDaemonThread, body: dict, path: str = "/v1/completions", **kw) -> httpx.Response:
    return httpx.post(edge.base + path, json={"model": "x", "temperature": 0, **body}, timeout=60, **kw)


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
                        "mode": mode}) as response:
                    assert response.status_code == 200
                    events, done = sse_events(response)
    assert done, "the stream was cut: no [DONE]"
    final = events[-1]
    assert final["choices"][0]["finish_reason"] == "length"
    assert 0 < final["usage"]["completion_tokens"] <= 24
    assert "".join(e["choices"][0]["text"] for e in events)


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
