"""n > 1 through the edge's OpenAI API: n generations at once, choice i seeded seed + i.

A request with a seed is reproducible, and its choice i is the very generation a request with n = 1 and
seed + i gets; streamed, each chunk names its choice, and the texts and the usage add up to the whole
response's.
"""

from __future__ import annotations

import pytest

from cloud.server import CloudSettings
from cloud_harness import ServerThread
from edge.api.app import ApiSettings, create_app
from edge_harness import EdgeDaemonThread


@pytest.fixture(scope="module")
def client(tiny_target, tiny_draft):
    from openai import OpenAI
    with ServerThread(CloudSettings(target="tiny-random", batch_window_ms=1), tiny_target) as cloud:
        api = ApiSettings(default_mode="sd-block", model_name="tiny", max_concurrent_requests=8)
        with EdgeDaemonThread(tiny_draft, cloud.address, lambda node: create_app(node, api)) as daemon:
            yield OpenAI(base_url=daemon.base + "/v1", api_key="unused", max_retries=0)


SAMPLED = dict(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=40)


def test_choice_i_is_the_generation_seeded_seed_plus_i(client) -> None:
    several = client.completions.create(n=3, **SAMPLED)
    assert [c.index for c in several.choices] == [0, 1, 2]
    texts = [c.text for c in several.choices]
    assert len(set(texts)) > 1, "three seeds at T=1 on a random model give different texts"
    assert [c.text for c in client.completions.create(n=3, **SAMPLED).choices] == texts  # reproducible
    for i, text in enumerate(texts):
        assert client.completions.create(**{**SAMPLED, "seed": SAMPLED["seed"] + i}).choices[0].text == text
    assert several.usage.completion_tokens == sum(len(c["token_ids"]) for c in several.model_extra["sprinter"]["choices"])


def test_streamed_choices_add_up_to_the_whole_response(client) -> None:
    request = dict(model="tiny", messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=12,
                   temperature=1.0, seed=5, n=2)
    whole = client.chat.completions.create(**request)
    texts, finishes, usage = {0: "", 1: ""}, {}, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **request):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert finishes == {0: whole.choices[0].finish_reason, 1: whole.choices[1].finish_reason}
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_more_choices_than_the_daemon_runs_at_once_is_a_429(client) -> None:
    from openai import RateLimitError
    with pytest.raises(RateLimitError):
        client.completions.create(n=9, **SAMPLED)
