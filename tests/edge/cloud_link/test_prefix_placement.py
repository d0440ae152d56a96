"""Replicas chosen by the prompt's leading block (issue 44, part 2): two cloud servers on loopback (gRPC, each
with its prefix cache) and two edge daemons (HTTP) that both know them. A conversation's second turn sent to the
other edge lands on the replica that served the first, and shows cached tokens there; so does the same prompt
from the other edge; different leading blocks spread over both replicas."""

from __future__ import annotations

import time

import pytest

from cloud.server import CloudSettings
from cloud_harness import ServerThread
from edge.api.app import ApiSettings, create_app
from edge.cloud_link.prefix_key import LEADING_BLOCK_TOKENS, prefix_key
from edge_harness import EdgeDaemonThread



def system(topic: str) -> str:
    """A system prompt longer than the leading block, its topic inside that block."""
    return f"You are a careful assistant who answers in full sentences, topic {topic}. " * 4
QUERIES = "sprinter_cloud_prefix_cache_queries_total"


def _queries(server: ServerThread) -> float:
    return server.server.metrics.registry.get_sample_value(QUERIES) or 0.0


def _closed(*servers: ServerThread) -> None:
    deadline = time.monotonic() + 10
    while any(len(s.server.servicer.host.store) for s in servers) and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.fixture(scope="module")
def fleet(tiny_target, tiny_draft):
    """(the two clouds, one openai client per edge): every edge lists both replicas, in opposite orders."""
    from openai import OpenAI
    api = ApiSettings(default_mode="sd-block", model_name="tiny", max_concurrent_requests=8)
    settings = CloudSettings(target="tiny-random", batch_window_ms=1)
    with ServerThread(settings, tiny_target) as a, ServerThread(settings, tiny_target) as b:
        with EdgeDaemonThread(tiny_draft, f"{a.address},{b.address}", lambda node: create_app(node, api)) as e1, \
                EdgeDaemonThread(tiny_draft, f"{b.address},{a.address}", lambda node: create_app(node, api)) as e2:
            yield (a, b), [OpenAI(base_url=e.base + "/v1", api_key="unused", max_retries=0) for e in (e1, e2)]


def _served_by(clouds: tuple[ServerThread, ServerThread], send) -> tuple[ServerThread, object]:
    """Send one request; which cloud looked its prompt up (one open each), and the response."""
    before = [_queries(c) for c in clouds]
    response = send()
    _closed(*clouds)
    grew = [c for c, n in zip(clouds, before) if _queries(c) > n]
    assert len(grew) == 1, "one request, one open, one replica"
    return grew[0], response


@pytest.mark.parametrize("mode", ["sd-block", "target"])
def test_a_second_turn_from_another_edge_lands_where_the_first_was_cached(fleet, mode) -> None:
    clouds, (edge1, edge2) = fleet
    turn = dict(model="tiny", max_tokens=12, temperature=0, extra_body={"mode": mode})
    first_messages = [{"role": "system", "content": system(mode)}, {"role": "user", "content": "Name a river."}]
    first_cloud, first = _served_by(clouds, lambda: edge1.chat.completions.create(messages=first_messages, **turn))
    assert first.usage.prompt_tokens > LEADING_BLOCK_TOKENS  # the leading block is the system prompt's
    second_messages = first_messages + [{"role": "assistant", "content": first.choices[0].message.content},
                                        {"role": "user", "content": "And a mountain?"}]
    second_cloud, second = _served_by(clouds, lambda: edge2.chat.completions.create(messages=second_messages, **turn))
    assert second_cloud is first_cloud
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    # The same prompt again from the first edge: the same replica, and its cache again.
    third_cloud, third = _served_by(clouds, lambda: edge1.chat.completions.create(messages=second_messages, **turn))
    assert third_cloud is first_cloud and third.usage.prompt_tokens_details.cached_tokens > 0
    assert third.choices[0].message.content == second.choices[0].message.content


def test_different_leading_blocks_spread_over_the_replicas(fleet) -> None:
    clouds, (edge1, edge2) = fleet
    served = set()
    for topic in range(12):  # 12 leading blocks: all on one replica of two has odds 2 / 2**12
        messages = [{"role": "system", "content": system(f"spread {topic}")}, {"role": "user", "content": "Hi"}]
        cloud, _ = _served_by(clouds, lambda: (edge1 if topic % 2 else edge2).chat.completions.create(
            messages=messages, model="tiny", max_tokens=2, temperature=0))
        served.add(cloud.address)
    assert len(served) == 2


def test_the_key_is_the_leading_block_alone() -> None:
    block = list(range(LEADING_BLOCK_TOKENS))
    assert prefix_key(block + [1, 2, 3]) == prefix_key(block + [7]) == prefix_key(block)
    assert prefix_key(block[:-1] + [0]) != prefix_key(block)
    assert prefix_key([1, 2]) != prefix_key([1, 2, 3])  # shorter than a block: all of it


def test_when_the_prefix_replica_is_gone_the_next_turn_fails_over_as_a_cache_miss(tiny_target, tiny_draft) -> None:
    """The replica that cached the first turn stops; the second turn goes to the other (the next in the same
    order), answers in full and undegraded, and finds nothing cached there: a miss, then a hit on the turn after."""
    from openai import OpenAI
    api = ApiSettings(default_mode="sd-block", model_name="tiny")
    settings = CloudSettings(target="tiny-random", batch_window_ms=1)
    a, b = ServerThread(settings, tiny_target).__enter__(), ServerThread(settings, tiny_target).__enter__()
    try:
        with EdgeDaemonThread(tiny_draft, f"{a.address},{b.address}", lambda node: create_app(node, api)) as edge:
            client = OpenAI(base_url=edge.base + "/v1", api_key="unused", max_retries=0)
            turn = dict(model="tiny", max_tokens=8, temperature=0)
            messages = [{"role": "system", "content": system("failover")}, {"role": "user", "content": "Name a river."}]
            holder, first = _served_by((a, b), lambda: client.chat.completions.create(messages=messages, **turn))
            survivor = b if holder is a else a
            holder.__exit__(None, None, None)
            messages += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "And a mountain?"}]
            second = client.chat.completions.create(messages=messages, **turn)
            assert not second.model_extra["sprinter"]["degraded"] and second.choices[0].message.content
            assert second.usage.prompt_tokens_details.cached_tokens == 0  # a miss on the replica it moved to
            third = client.chat.completions.create(messages=messages, **turn)
            assert third.usage.prompt_tokens_details.cached_tokens > 0  # and a hit there after
            assert _queries(survivor) == 2
    finally:
        for cloud in (a, b):
            if cloud._thread.is_alive():
                cloud.__exit__(None, None, None)
