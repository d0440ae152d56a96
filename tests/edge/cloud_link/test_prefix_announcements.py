"""Replicas announce digests of the prefixes they cache, and an edge prefers the one holding the longest (issue 44,
part 3): a real Mosquitto broker, two cloud servers announcing on it, an edge daemon reading it. The announcement
stays within its bound, carries digests only, and older or malformed ones are refused."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Iterator

import pytest
import torch

from cloud.prefix_cache import PrefixCache
from cloud.resident_kv import KVLayout, ResidentKV
from cloud.server import CloudSettings
from cloud_harness import ServerThread
from common.fleet_plane.connection import BrokerSettings
from common.fleet_plane.messages import BadMessage, CloudLoad, decode, encode
from common.prefix_digests import LEADING_BLOCK_TOKENS, MAX_ANNOUNCED_PREFIXES, prefix_digests
from common.model.prompting import encode_prompt
from edge.api.app import ApiSettings, create_app
from edge.cloud_link.prefix_key import prefix_key
from edge.cloud_link.prefix_key import rendezvous_order
from edge.fleet_agent import EdgeIdentity, FleetAgent
from edge.fleet_controls import DaemonControls
from edge_harness import EdgeDaemonThread
from mosquitto_broker import broker

API = ApiSettings(default_mode="sd-block", model_name="tiny")


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)


@contextmanager
def fleet_edge(draft, clouds: str, url: str) -> Iterator[EdgeDaemonThread]:
    """An edge daemon that knows `clouds` and reads the fleet plane (its agent on the daemon's event loop)."""
    apps = []

    def make_app(node):
        apps.append(create_app(node, API))
        return apps[0]

    with EdgeDaemonThread(draft, clouds, make_app) as daemon:
        async def start() -> FleetAgent:
            identity = EdgeIdentity("e1", "g1", "test", daemon.base + "/v1")
            settings = BrokerSettings.parse(url, keepalive_s=2, reconnect_min_s=0.1, reconnect_max_s=0.5)
            return await FleetAgent(settings, identity, DaemonControls(daemon.node, apps[0].state.completions,
                                                                       identity), 0.3).__aenter__()

        agent = daemon.call(start())
        try:
            yield daemon
        finally:
            daemon.call(agent.__aexit__(None, None, None))


def _prompt(tokenizer, x_address: str, y_address: str) -> str:
    """A prompt over two leading blocks whose rendezvous order puts `x` first: only what `y` announces can
    send it to `y`."""
    class Named:
        def __init__(self, address: str) -> None:
            self.address = address

    for topic in range(64):
        prompt = f"Topic {topic}: the careful assistant answers every question in full sentences. " * 8
        tokens = encode_prompt(tokenizer, prompt, chat=False)
        assert len(tokens) > 2 * LEADING_BLOCK_TOKENS
        if rendezvous_order(prefix_key(tokens), [Named(x_address), Named(y_address)])[0].address == x_address:
            return prompt
    raise AssertionError("no prompt ranks x first")


def test_an_edge_prefers_the_replica_that_announced_the_longest_prefix(tmp_path, tiny_target, tiny_draft) -> None:
    from openai import OpenAI
    with broker(tmp_path) as running:
        settings = CloudSettings(port=0, mqtt=running.url, batch_window_ms=1)
        with ServerThread(replace(settings, replica_id="x"), tiny_target) as x, \
                ServerThread(replace(settings, replica_id="y"), tiny_target) as y, \
                EdgeDaemonThread(tiny_draft, y.address, lambda node: create_app(node, API)) as seeding, \
                fleet_edge(tiny_draft, f"{x.address},{y.address}", running.url) as edge:
            prompt = _prompt(tiny_draft.tokenizer, x.address, y.address)
            tokens = encode_prompt(tiny_draft.tokenizer, prompt, chat=False)
            body = dict(model="tiny", max_tokens=4, temperature=0)
            # The other edge, which knows only y, sends the prompt there first: y caches it and says so.
            OpenAI(base_url=seeding.base + "/v1", api_key="unused", max_retries=0).completions.create(
                prompt=prompt, **body)
            longest = prefix_digests(tokens)[-1][1]
            replica_y = edge.node.cloud.replicas[y.address]
            _wait(lambda: longest in replica_y.announced_prefixes, 10, "y's announcement of the prompt")
            assert len(replica_y.announced_prefixes) <= MAX_ANNOUNCED_PREFIXES
            assert not edge.node.cloud.replicas[x.address].announced_prefixes  # x holds nothing yet
            # The edge's own rendezvous order says x; the announcement says y holds the prompt: y it is.
            answer = OpenAI(base_url=edge.base + "/v1", api_key="unused", max_retries=0).completions.create(
                prompt=prompt + " And one more question?", **body)
            assert answer.usage.prompt_tokens_details.cached_tokens >= 2 * LEADING_BLOCK_TOKENS
            served = x.server.metrics.registry.get_sample_value("sprinter_cloud_prefix_cache_queries_total") or 0
            assert served == 0  # x was never asked


def test_what_a_replica_announces_stays_within_its_bound_and_follows_its_cache() -> None:
    """A per-session cache (tiny KV, no budget) remembering more prompts than it may announce."""
    cache = PrefixCache(KVLayout(1, 1, 4, torch.float32))
    prompts = [[topic] * (2 * LEADING_BLOCK_TOKENS) for topic in range(MAX_ANNOUNCED_PREFIXES + 8)]
    for tokens in prompts:
        kv = ResidentKV(cache.layout, len(tokens))
        kv.length = len(tokens)
        cache.remember(kv, "", tokens)
    announced = cache.announced()
    assert len(announced) == MAX_ANNOUNCED_PREFIXES
    assert all(len(digest) == 32 and int(digest, 16) >= 0 for digest in announced)  # digests, not tokens
    newest = [digest for _, digest in prefix_digests(prompts[-1])]
    assert announced[:2] == newest[::-1]  # most recently remembered first, its longest prefix first
    oldest = {digest for _, digest in prefix_digests(prompts[0])}
    assert not oldest & set(announced)
    cache.clear()
    assert cache.announced() == []  # evicted pages are no longer announced


def test_a_load_message_with_too_many_or_odd_prefixes_is_refused() -> None:
    load = CloudLoad("c1", "online", "m", "v", "127.0.0.1:1", 0, 0, 0.0, None, 0, 0, 0.0)
    assert decode(encode(load), CloudLoad).prefixes == []
    older = json.loads(encode(load))
    del older["prefixes"]
    assert decode(json.dumps(older), CloudLoad).prefixes == []  # an older replica announces none
    too_many = CloudLoad(**{**load.__dict__, "prefixes": ["0" * 32] * (MAX_ANNOUNCED_PREFIXES + 1)})
    with pytest.raises(BadMessage):
        decode(encode(too_many), CloudLoad)
    with pytest.raises(BadMessage):
        decode(encode(CloudLoad(**{**load.__dict__, "prefixes": ["not a digest"]})), CloudLoad)


def test_without_announcements_the_rendezvous_order_alone_decides() -> None:
    from edge.cloud_link.prefix_key import holders_first

    class Replica:
        def __init__(self, address: str, held: frozenset[str] = frozenset()) -> None:
            self.address, self.announced_prefixes = address, held

    tokens = list(range(3 * LEADING_BLOCK_TOKENS))
    key = prefix_key(tokens)
    replicas = [Replica(f"10.0.0.{i}:1") for i in range(4)]
    ranked = rendezvous_order(key, replicas)
    assert holders_first(key, ranked) == ranked
    last = ranked[-1]
    last.announced_prefixes = frozenset({key.digests[0]})
    ranked[1].announced_prefixes = frozenset(key.digests[:2])
    assert holders_first(key, ranked)[:2] == [ranked[1], last]  # the longest held prefix first
