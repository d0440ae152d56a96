"""Issue 12, the edge daemon's inputs are bounded: ranges, body size, concurrency, API key, stop, unknown fields.

The daemon runs in this process over a real cloud (tests/edge_harness.py); clients are the real
openai client, httpx, or a raw socket (a client that walks away).
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import replace

import httpx
import pytest

from cloud.server import CloudSettings
from cloud_harness import ServerThread
from common.cli import main
from edge.api.app import ApiSettings, create_app
from edge.node import EdgeNodeSettings
from edge.serve_command import listen_problem
from edge_harness import EdgeDaemonThread, ScriptedCloud, scripted

TINY_CLOUD = CloudSettings(target="tiny-random", dtype="float32", batch_window_ms=1)


@pytest.fixture(scope="module")
def cloud(tiny_target):
    with ServerThread(TINY_CLOUD, tiny_target) as server:
        yield server


@pytest.fixture(scope="module")
def edge(cloud, tiny_draft):
    api = ApiSettings(default_mode="sd", model_name="tiny", max_request_bytes=1 << 20)
    with EdgeDaemonThread(tiny_draft, cloud.address, lambda node: create_app(node, api)) as daemon:
        yield daemon


def post(edge: EdgeDaemonThread, body: dict, path: str = "/v1/completions", **kw) -> httpx.Response:
    defaults = {"model": "x", "temperature": 0, "max_tokens": 8, **({"prompt": "abc"} if "messages" not in body else {})}
    return httpx.post(edge.base + path, json={**defaults, **body}, timeout=60, **kw)


def metric(edge: EdgeDaemonThread, name: str) -> float:
    text = httpx.get(edge.base + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


@pytest.mark.parametrize("field, value", [("seed", -1), ("seed", 2**64), ("top_k", 2**31), ("top_k", -2),
                                          ("temperature", 3.5), ("max_tokens", 0), ("k", 99), ("n", 17), ("n", 0),
                                          ("stop", [""]), ("stop", ["a"] * 17), ("policy", "x" * 100)])
def test_out_of_range_fields_get_a_400_naming_them(edge, field, value):
    """Values that went into uint64/int32 proto fields used to fail there: HTTP 500."""
    response = post(edge, {field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].split(".")[0] == field and error["type"] == "invalid_request_error"


def test_the_largest_seed_and_top_k_are_served(edge):
    response = post(edge, {"seed": 2**64 - 1, "top_k": 2**31 - 1, "temperature": 1.0})
    assert response.status_code == 200, response.text


def test_inputs_the_fuzzer_found(edge):
    """A temperature or a top_p that rounds to 0 in float32 gave NaN probabilities; an empty prompt, no
    context: all three were 500s."""
    greedy = post(edge, {"temperature": 0, "max_tokens": 12}).json()["choices"][0]["text"]
    for mode in ("sd", "target", "draft"):
        tiny = post(edge, {"temperature": 1e-30, "max_tokens": 12, "mode": mode})
        assert tiny.status_code == 200, tiny.text
        assert mode == "draft" or tiny.json()["choices"][0]["text"] == greedy
        narrow = post(edge, {"temperature": 1.0, "top_p": 5e-324, "max_tokens": 12, "mode": mode})
        assert narrow.status_code == 200, narrow.text
        assert mode == "draft" or narrow.json()["choices"][0]["text"] == greedy  # top-p keeps the argmax alone
    empty = post(edge, {"prompt": ""})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("field, value", [("logprobs", True), ("logprobs", 21), ("echo", 1), ("best_of", 3),
                                          ("presence_penalty", 2.5), ("logit_bias", {"5": 101}),
                                          ("logit_bias", {"hello": 1}), ("logit_bias", {"999999": 1}),
                                          ("frobnicate", 1), ("tools", [{"type": "function"}])])
def test_unsupported_fields_are_refused_by_name(edge, field, value):
    """Unimplemented fields used to be dropped silently: a client asking for logprobs got a completion without
    them. Implemented ones with a value out of range are refused by name too."""
    response = post(edge, {field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field and field in response.json()["error"]["message"]


def test_fields_that_ask_for_nothing_are_accepted(edge):
    """What OpenAI clients send by default must keep working."""
    response = post(edge, {"presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": None, "user": "u-1",
                           "stream_options": None, "logit_bias": {}, "echo": False})
    assert response.status_code == 200, response.text
    chat = post(edge, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "ann"}],
                       "tool_choice": "none"}, "/v1/chat/completions")
    assert chat.status_code == 200, chat.text
    bad_message = post(edge, {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "/v1/chat/completions")
    assert bad_message.status_code == 400 and "tool_calls" in bad_message.json()["error"]["param"]


def test_a_body_over_the_limit_gets_413_before_it_is_tokenized(edge):
    response = post(edge, {"prompt": "x" * (2 << 20)})
    assert response.status_code == 413 and "bytes" in response.json()["error"]["message"]
    chunked = httpx.post(edge.base + "/v1/completions", timeout=30, headers={"content-type": "application/json"},
                         content=iter([b'{"prompt": "', b"x" * (2 << 20), b'"}']))  # no Content-Length
    assert chunked.status_code == 413


def test_a_long_prompt_is_tokenized_off_the_event_loop(edge):
    """A prompt that takes the tokenizer a second must not stall the daemon's event loop (every other request)."""
    import asyncio

    result: list[httpx.Response] = []
    big = threading.Thread(target=lambda: result.append(post(edge, {"prompt": "hello world " * 40_000})))

    async def worst_lag() -> float:
        """The event loop's longest delay in waking a 10 ms sleep while the big request is served."""
        worst = 0.0
        while big.is_alive():
            started = time.monotonic()
            await asyncio.sleep(0.01)
            worst = max(worst, time.monotonic() - started - 0.01)
        return worst

    post(edge, {})  # warm: the first request of a daemon pays for imports and caches
    big.start()
    lag = edge.call(worst_lag())
    big.join()
    assert result[0].status_code == 400 and "maximum context length" in result[0].json()["error"]["message"]
    assert lag < 0.3, f"the event loop stalled for {lag:.2f} s"


@pytest.mark.parametrize("mode", ["sd", "sprinter", "target"])
def test_stop_sequences_end_the_generation_and_are_not_returned(edge, mode):
    """`stop` used to be ignored: the text ran on to max_tokens."""
    full = post(edge, {"mode": mode, "max_tokens": 40}).json()
    text = full["choices"][0]["text"]
    stop = text[12:14]
    expected = text[: text.find(stop)]
    stopped = post(edge, {"mode": mode, "max_tokens": 40, "stop": [stop, "never-there"]}).json()
    assert stopped["choices"][0]["text"] == expected
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] < full["usage"]["completion_tokens"]
    with httpx.stream("POST", edge.base + "/v1/completions", timeout=60, json={
            "model": "x", "prompt": "abc", "temperature": 0, "max_tokens": 40, "mode": mode, "stop": stop,
            "stream": True}) as response:
        import json

        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == expected
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_over_the_concurrency_limit_a_request_gets_429_with_retry_after(tiny_draft):
    """The first request holds its slot on a cloud whose Generate stalls; its client leaving gives the slot back."""
    api = ApiSettings(default_mode="sd", max_concurrent_requests=1)
    script = scripted(tiny_draft, generate_hangs_after=1)
    with ScriptedCloud(script) as cloud, EdgeDaemonThread(tiny_draft, cloud.address, lambda node: create_app(node, api)) as edge:
        with httpx.stream("POST", edge.base + "/v1/completions", timeout=60, json={
                "model": "x", "prompt": "abc", "max_tokens": 50, "stream": True, "mode": "target"}) as stalled:
            lines = stalled.iter_lines()  # kept: a dropped iterator closes the connection
            next(lines)
            refused = post(edge, {})
        deadline = time.monotonic() + 5
        while metric(edge, "sprinter_edge_requests_in_flight") and time.monotonic() < deadline:
            time.sleep(0.05)
        again = post(edge, {})
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert "max-concurrent-requests" in refused.json()["error"]["message"]
    assert again.status_code == 200, again.text


def test_a_non_streaming_request_is_cancelled_when_its_client_leaves(edge):
    request = (b'{"model": "x", "prompt": "abc", "max_tokens": 4000, "temperature": 0}')
    before = metric(edge, "sprinter_edge_requests_cancelled_total")
    with socket.create_connection(("127.0.0.1", edge.port)) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: " + str(len(request)).encode() + b"\r\n\r\n" + request)
        time.sleep(0.5)
    assert metric(edge, "sprinter_edge_requests_in_flight") in (0, 1)
    deadline = time.monotonic() + 2
    while metric(edge, "sprinter_edge_requests_in_flight") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(edge, "sprinter_edge_requests_in_flight") == 0, "the generation ran on for nobody"
    assert metric(edge, "sprinter_edge_requests_cancelled_total") == before + 1


def test_an_api_key_guards_v1_and_leaves_probes_open(cloud, tiny_draft):
    from openai import AuthenticationError, OpenAI

    api = ApiSettings(default_mode="sd", api_key="s3cret")
    with EdgeDaemonThread(tiny_draft, cloud.address, lambda node: create_app(node, api)) as edge:
        assert post(edge, {}).status_code == 401
        assert post(edge, {}, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(edge.base + "/healthz").status_code == 200
        assert httpx.get(edge.base + "/metrics").status_code == 200
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=edge.base + "/v1", api_key="wrong", max_retries=0).models.list()
        client = OpenAI(base_url=edge.base + "/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(model="x", prompt="abc", max_tokens=4).usage.completion_tokens >= 1


# --- the command line refuses what would leak (item 7) ------------------------------------------


def test_a_cloud_token_without_tls_is_refused_unless_insecure(capsys):
    for argv in (["edge", "serve", "--cloud", "127.0.0.1:1", "--cloud-token", "t"],
                 ["generate", "--cloud", "127.0.0.1:1", "--cloud-token", "t", "--prompt", "hi"]):
        assert main(argv) == 2
        assert "--cloud-ca" in capsys.readouterr().err
    with pytest.raises(ValueError, match="in clear"):
        EdgeNodeSettings(cloud="127.0.0.1:1", cloud_token="t")
    EdgeNodeSettings(cloud="127.0.0.1:1", cloud_token="t", insecure=True)
    EdgeNodeSettings(cloud="127.0.0.1:1", cloud_token="t", cloud_ca="ca.pem")


def test_a_public_listen_address_needs_an_api_key_or_an_explicit_override(capsys):
    assert main(["edge", "serve", "--listen", "0.0.0.0:8000"]) == 2
    assert "--api-key" in capsys.readouterr().err
    assert listen_problem("0.0.0.0:8000", "k", False) is None
    assert listen_problem("0.0.0.0:8000", None, True) is None
    for loopback in ("127.0.0.1:8000", "localhost:8000", "[::1]:8000"):
        assert listen_problem(loopback, None, False) is None
    assert "HOST:PORT" in listen_problem("8000", None, False)


def test_cloud_tls_server_name_checks_the_certificate_against_that_name(tiny_target, tiny_draft, tmp_path):
    import asyncio
    import subprocess

    from edge.node import EdgeNode

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=cloud.internal", "-addext", "subjectAltName=DNS:cloud.internal"],
                   check=True, capture_output=True, timeout=60)

    async def reachable(server_name: str | None) -> bool:
        settings = EdgeNodeSettings(draft=tiny_draft.spec, cloud=address, cloud_ca=cert, cloud_token="t",
                                    cloud_tls_server_name=server_name, draft_runtime="torch", cloud_deadline_s=3)
        async with EdgeNode(settings, tiny_draft) as node:
            return await node.check_cloud()

    with ServerThread(replace(TINY_CLOUD, tls_cert=cert, tls_key=key), tiny_target) as server:
        address = server.address  # 127.0.0.1: not the certificate's name
        assert asyncio.run(reachable("cloud.internal"))
        assert not asyncio.run(reachable(None))
