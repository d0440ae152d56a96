"""The edge over a real cloud: lossless modes equal the target, the OpenAI API, and a cloud that dies."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from cloud.server import CloudSettings
from cloud_harness import ServerThread
from common.spec.local_decoder import LocalDecoder
from common.spec.modes import DecodeSettings
from common.model.prompting import encode_prompt
from edge.decoding.decoder import EdgeSettings
from edge.node import EdgeNode, EdgeNodeSettings
from sim.processes import free_port, wait_until_serving

LOSSLESS = ("sd", "sd-block", "sprinter-exact")


def _edge_generate(address: str, draft, prompt_ids: list[int], mode: str, runtime: str, max_new_tokens: int = 32):
    async def run():
        settings = EdgeNodeSettings(draft=draft.spec, cloud=address, draft_runtime=runtime, dtype="float32",
                                    verifier="confidence:0.3")
        async with EdgeNode(settings, draft) as node:
            decode = DecodeSettings(mode=mode, max_new_tokens=max_new_tokens, k=4, max_run_length=6)
            return await node.decoder.generate(prompt_ids, EdgeSettings(decode))

    return asyncio.run(run())


@pytest.fixture(scope="module")
def tiny_cloud(tiny_target):
    with ServerThread(CloudSettings(target="tiny-random", batch_window_ms=1), tiny_target) as server:
        yield server


@pytest.mark.parametrize("runtime", ["onnx", "torch"])
def test_lossless_modes_over_grpc_equal_the_target(tiny_cloud, tiny_target, tiny_draft, runtime):
    prompt_ids = tiny_target.tokenizer("The quick brown fox")["input_ids"]
    target = LocalDecoder(tiny_target, None).generate(prompt_ids, DecodeSettings(mode="target", max_new_tokens=32))
    for mode in ("target", *LOSSLESS):
        result = _edge_generate(tiny_cloud.address, tiny_draft, prompt_ids, mode, runtime)
        assert result.token_ids == target.token_ids, mode
        assert not result.degraded
        if mode != "target":
            assert result.stats.target_calls < len(result.token_ids)


def test_sprinter_over_grpc_equals_the_local_decoders_sprinter(tiny_cloud, tiny_target, tiny_draft):
    """Approximate, but deterministic under greedy: the split loop makes the same decisions as the local one."""
    from common.spec.verifier import ConfidenceVerifier

    prompt_ids = tiny_target.tokenizer("Once upon a time")["input_ids"]
    local = LocalDecoder(tiny_target, tiny_draft, ConfidenceVerifier(0.3)).generate(
        prompt_ids, DecodeSettings(mode="sprinter", max_new_tokens=40, max_run_length=6))
    remote = _edge_generate(tiny_cloud.address, tiny_draft, prompt_ids, "sprinter", "torch", 40)
    assert remote.token_ids == local.token_ids
    assert remote.stats.target_calls == local.stats.target_calls


@pytest.mark.smollm2
def test_smollm2_truncated_self_draft_over_grpc_equals_target(smollm2, smollm2_4_layers):
    with ServerThread(CloudSettings(target="smollm2-135m", batch_window_ms=1), smollm2) as server:
        prompt_ids = encode_prompt(smollm2.tokenizer, "What causes the seasons on Earth?", chat=True)
        target = LocalDecoder(smollm2, None).generate(prompt_ids, DecodeSettings(mode="target", max_new_tokens=24))
        for mode in LOSSLESS:
            result = _edge_generate(server.address, smollm2_4_layers, prompt_ids, mode, "onnx", 24)
            assert result.token_ids == target.token_ids, mode


# --- the daemon and the cloud as real processes -------------------------------------------------


def _start(args: list[str], log_path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "common.cli", *args], stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()


def _healthz(base: str) -> dict:
    with urllib.request.urlopen(f"{base}/healthz", timeout=5) as response:
        return json.loads(response.read())


def _wait_http(base: str, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("edge daemon exited early")
        try:
            _healthz(base)
            return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError("edge daemon did not answer /healthz")


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    """A cloud process and an edge daemon process on loopback, tiny models; one pair for the module (the kill test
    leaves a restarted cloud, reachable, behind it)."""
    tmp_path = tmp_path_factory.mktemp("system")
    cloud_port, edge_port = free_port(), free_port()
    cloud_args = ["cloud", "serve", "--target", "tiny-random", "--dtype", "float32", "--port", str(cloud_port),
                  "--drain-s", "1"]
    cloud = _start(cloud_args, tmp_path / "cloud.log")
    wait_until_serving(f"127.0.0.1:{cloud_port}", 120, cloud)
    edge = _start(["edge", "serve", "--draft", "tiny-random-draft", "--cloud", f"127.0.0.1:{cloud_port}",
                   "--listen", f"127.0.0.1:{edge_port}", "--mode", "sd-block", "--dtype", "float32",
                   "--model-name", "sprinter-tiny"], tmp_path / "edge.log")
    base = f"http://127.0.0.1:{edge_port}"
    _wait_http(base, edge)
    state = {"cloud": cloud, "cloud_args": cloud_args, "base": base, "tmp": tmp_path}
    yield state
    _stop(edge)
    _stop(state["cloud"])


def test_openai_client_streams_a_chat_completion(system):
    from openai import OpenAI

    client = OpenAI(base_url=f"{system['base']}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["sprinter-tiny"]
    chunks = list(client.chat.completions.create(
        model="sprinter-tiny", messages=[{"role": "user", "content": "Say hi"}], max_tokens=24, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    # as OpenAI sends it: a last chunk of its own, no choices, and `usage` null on every chunk before it
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert all(c.usage is None for c in chunks[:-1])
    final = chunks[-2].model_extra["sprinter"]
    unasked = list(client.chat.completions.create(
        model="sprinter-tiny", messages=[{"role": "user", "content": "Say hi"}], max_tokens=24, temperature=0,
        stream=True))
    assert all(c.choices and c.usage is None and "usage" not in c.model_fields_set for c in unasked)
    assert final["mode"] == "sd-block" and final["degraded"] is False and final["target_calls"] >= 1

    whole = client.chat.completions.create(model="sprinter-tiny", messages=[{"role": "user", "content": "Say hi"}],
                                           max_tokens=24, temperature=0)
    assert whole.choices[0].message.content == text  # streaming and not streaming agree
    completion = client.completions.create(model="sprinter-tiny", prompt="def f(x):", max_tokens=10, temperature=0,
                                           extra_body={"mode": "sprinter-exact"})
    assert completion.model_extra["sprinter"]["mode"] == "sprinter-exact" and completion.usage.completion_tokens >= 1


def test_malformed_requests_get_openai_style_4xx(system):
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=f"{system['base']}/v1", api_key="unused", max_retries=0)
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model="x", messages=[], max_tokens=5)
    assert err.value.status_code == 400 and "messages" in err.value.body["message"]
    with pytest.raises(BadRequestError) as err:
        client.completions.create(model="x", prompt="hi", max_tokens=5, extra_body={"mode": "warp-speed"})
    assert "unknown mode" in err.value.body["message"]
    with pytest.raises(BadRequestError) as err:  # as OpenAI: only a streamed request takes stream_options
        client.completions.create(model="x", prompt="hi", max_tokens=5, stream_options={"include_usage": True})
    assert err.value.body["param"] == "stream_options"
    with pytest.raises(BadRequestError) as err:
        client.completions.create(model="x", prompt="hi", max_tokens=5, stream=True,
                                  stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert "stream_options" in err.value.body["message"]
    request = urllib.request.Request(f"{system['base']}/v1/completions", data=b"{not json",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as http_err:
        urllib.request.urlopen(request, timeout=5)
    assert http_err.value.code == 400 and "error" in json.loads(http_err.value.read())


def test_cloud_killed_mid_generation_degrades_then_recovers(system):
    from openai import OpenAI

    client = OpenAI(base_url=f"{system['base']}/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.completions.create(model="x", prompt="Once upon a time", max_tokens=600, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = [next(stream)]
    system["cloud"].send_signal(signal.SIGKILL)  # no drain, no goodbye
    system["cloud"].wait(10)
    chunks += list(stream)
    assert chunks[-2].model_extra["sprinter"]["degraded"] is True and chunks[-1].usage.completion_tokens >= 100

    system["cloud"] = _start(system["cloud_args"], system["tmp"] / "cloud-restarted.log")
    port = system["cloud_args"][system["cloud_args"].index("--port") + 1]
    wait_until_serving(f"127.0.0.1:{port}", 120, system["cloud"])
    deadline = time.monotonic() + 30
    while _healthz(system["base"])["cloud"] != "reachable" and time.monotonic() < deadline:
        time.sleep(0.3)
    again = client.completions.create(model="x", prompt="Once upon a time", max_tokens=40, temperature=0,
                                      extra_body={"mode": "sd"})
    target = client.completions.create(model="x", prompt="Once upon a time", max_tokens=40, temperature=0,
                                       extra_body={"mode": "target"})
    assert again.model_extra["sprinter"]["degraded"] is False
    assert again.choices[0].text == target.choices[0].text


def test_edge_metrics_count_requests(system):
    from openai import OpenAI

    OpenAI(base_url=f"{system['base']}/v1", api_key="unused").completions.create(model="x", prompt="a", max_tokens=4)
    with urllib.request.urlopen(f"{system['base']}/metrics", timeout=5) as response:
        text = response.read().decode()
    assert 'sprinter_edge_requests_total{mode="sd-block"}' in text
