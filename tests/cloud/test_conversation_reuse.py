"""Conversations and shared prompts through real processes: a cloud on loopback (gRPC), the edge daemon (HTTP)
and the openai client.

A second turn starts from the first turn's cached KV: it prefills only what the first turn did not compute (up
to the part of a page), reports what it reused as usage.prompt_tokens_details.cached_tokens (streamed and not)
and in the `sprinter` object, and answers as a cloud with no prefix cache does (greedy, float32). The n choices
of a request compute their prompt once. Reuse stays within one edge identity unless the operator shares it.
"""

from __future__ import annotations

import time
from dataclasses import replace

import grpc
import pytest

from cloud.server import CloudSettings
from cloud_harness import ServerThread, SessionStream
from edge.api.app import ApiSettings, create_app
from edge_harness import EdgeDaemonThread

PAGES = {"per-session": 64, "paged": 128}  # a layout's page: the prefix cache's block
SYSTEM = "You are a careful assistant who answers in full sentences. " * 4


def _counter(server: ServerThread, name: str) -> float:
    return server.server.metrics.registry.get_sample_value(name) or 0.0


def _closed(server: ServerThread) -> None:
    """Until the cloud has closed every session (the edge's close frame is not answered)."""
    deadline = time.monotonic() + 10
    while len(server.server.servicer.host.store) and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.fixture(scope="module", params=list(PAGES))
def clouds(request, tiny_target, tiny_draft):
    """(cloud with the prefix cache, its edge's client, a cloud without, its edge's client, the page) for one
    attention layout (paged: CUDA's default, unfused here)."""
    from openai import OpenAI
    api = ApiSettings(default_mode="sd-block", model_name="tiny", max_concurrent_requests=8)
    settings = CloudSettings(target="tiny-random", batch_window_ms=1, attention=request.param)
    with ServerThread(settings, tiny_target) as warm, \
            ServerThread(replace(settings, prefix_cache=False), tiny_target) as cold, \
            EdgeDaemonThread(tiny_draft, warm.address, lambda node: create_app(node, api)) as warm_edge, \
            EdgeDaemonThread(tiny_draft, cold.address, lambda node: create_app(node, api)) as cold_edge:
        yield (warm, OpenAI(base_url=warm_edge.base + "/v1", api_key="unused", max_retries=0),
               OpenAI(base_url=cold_edge.base + "/v1", api_key="unused", max_retries=0), PAGES[request.param])


@pytest.mark.parametrize("mode", ["sd-block", "target"])
def test_a_second_turn_prefills_only_its_new_tokens_and_answers_as_cold(clouds, mode):
    warm, client, cold_client, page = clouds
    turn = dict(model="tiny", max_tokens=16, temperature=0, extra_body={"mode": mode})
    first_messages = [{"role": "system", "content": SYSTEM + mode}, {"role": "user", "content": "Name three rivers."}]
    first = client.chat.completions.create(messages=first_messages, **turn)
    _closed(warm)
    second_messages = first_messages + [{"role": "assistant", "content": first.choices[0].message.content},
                                        {"role": "user", "content": "And three lakes?"}]
    cached_before = _counter(warm, "sprinter_cloud_prefix_cache_cached_tokens_total")
    second = client.chat.completions.create(messages=second_messages, **turn)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached % page == 0 and cached == second.model_extra["sprinter"]["cached_tokens"]
    assert _counter(warm, "sprinter_cloud_prefix_cache_cached_tokens_total") - cached_before == cached
    # what the first turn computed (its prompt and answer) is reused but the last part page
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 2 * page > 0
    cold = cold_client.chat.completions.create(messages=second_messages, **turn)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert second.choices[0].message.content == cold.choices[0].message.content
    _closed(warm)
    usage = None
    for chunk in client.chat.completions.create(messages=second_messages, stream=True,
                                                stream_options={"include_usage": True}, **turn):
        usage = chunk.usage or usage
    assert usage.prompt_tokens_details.cached_tokens >= cached


def test_the_n_choices_of_a_request_compute_their_prompt_once(clouds):
    warm, client, _, page = clouds
    prompt = SYSTEM + "Four choices, please: "
    hits_before = _counter(warm, "sprinter_cloud_prefix_cache_hits_total")
    several = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=1.0, seed=3, n=4)
    per_choice = sorted(c["cached_tokens"] for c in several.model_extra["sprinter"]["choices"])
    whole_pages = (several.usage.prompt_tokens - 1) // page * page
    assert per_choice == [0] + [whole_pages] * 3  # the first computed it, the others waited for its pages
    assert several.usage.prompt_tokens_details.cached_tokens == 0  # nothing was cached before this request
    assert _counter(warm, "sprinter_cloud_prefix_cache_hits_total") - hits_before == 3


@pytest.mark.parametrize("share", [False, True], ids=["own-identity", "shared"])
def test_reuse_crosses_edge_identities_only_when_shared(tiny_target, tmp_path, share):
    tokens = tmp_path / "tokens"
    tokens.write_text("alice alice-token\nbob bob-token\n")
    page = PAGES["per-session"]
    prompt = list(range(3, 3 + 2 * page + 5))
    settings = CloudSettings(auth_tokens=tokens, batch_window_ms=1, share_prefix_cache=share)
    with ServerThread(settings, tiny_target) as server, grpc.insecure_channel(server.address) as channel:
        def open_as(edge: str) -> int:
            stream = SessionStream(channel, metadata=(("authorization", f"Bearer {edge}-token"),))
            cached = stream.open(prompt).opened.cached_tokens
            stream.close()
            return cached

        assert open_as("alice") == 0
        assert open_as("bob") == (2 * page if share else 0)
        assert open_as("alice") == 2 * page
