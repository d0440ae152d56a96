"""`sprinter bench prefix-fleet`'s counting: the shareable prompt tokens of a fleet sharing system prompts, the
texts it sends, and its table. (The bench itself starts 4 + N processes: minutes even with the tiny pair.)"""

from __future__ import annotations

import pytest

from common.model.presets import build_tiny_tokenizer
from common.model.prompting import encode_chat
from sim.bench.edge_chat import ChatReply, synthetic_text
from sim.bench.prefix_fleet import (FleetRequest, PrefixFleetResult, Turn, format_result, shared_prefix,
                                    shared_share)
from sim.bench.settings.capacity import PrefixFleetSettings


def reply(cached: int = 0, reused: int = 0, ttft_ms: float = 100.0) -> ChatReply:
    return ChatReply(ttft_ms, ttft_ms + 50, "text", 600, 4, {"cached_tokens": cached, "draft_reused_tokens": reused})


def test_the_fleets_first_request_of_each_system_prompt_is_not_shareable_and_every_later_one_is():
    requests = [FleetRequest(0, 0, 0, True, reply()), FleetRequest(1, 1, 0, True, reply()),
                FleetRequest(2, 0, 0, False, reply(cached=512)),  # all its whole pages
                FleetRequest(3, 1, 0, False, reply(cached=0)),  # another replica met prompt 1 for the first time
                FleetRequest(0, 0, 1, False, reply(cached=640))]  # beyond the shared prefix: not counted
    assert shared_share(requests, [530, 460]) == (512 + 448 + 512, 512 + 0 + 512)


def test_what_requests_under_one_system_prompt_share_is_its_templated_prefix_up_to_the_question():
    tokenizer = build_tiny_tokenizer()
    system = synthetic_text(7, 120, tokenizer)
    shared = shared_prefix(tokenizer, system)
    prompt = encode_chat(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": "Question 1: a"}])
    assert tokenizer.decode(prompt[:shared]).endswith(system + "<|im_end|>\n<|im_start|>user\nQuestion ")


def test_synthetic_text_is_deterministic_and_as_long_as_asked():
    tokenizer = build_tiny_tokenizer()
    text = synthetic_text(3, 200, tokenizer)
    assert text == synthetic_text(3, 200, tokenizer) != synthetic_text(4, 200, tokenizer)
    assert abs(len(tokenizer.encode(text, add_special_tokens=False)) - 200) <= 2  # decode, encode may merge an edge


def test_the_table_says_whether_each_goal_was_met_and_by_how_much_it_was_missed():
    settings = PrefixFleetSettings(conversations=1, edges=2)
    result = PrefixFleetResult(
        turns=[Turn("cold", 0, reply(), reply(ttft_ms=1000)), Turn("cached", 0, reply(), reply(1024, 1000, 300))],
        fleet=[FleetRequest(0, 0, 0, True, reply()), FleetRequest(1, 1, 0, True, reply()),
               FleetRequest(0, 0, 1, False, reply(cached=448)), FleetRequest(1, 1, 1, False, reply(cached=448))],
        shared_prefix_tokens=[500, 500], landed={"0": [1], "1": [0]}, replica_queries=[2, 2],
        replica_cached=[448, 448], startup_s={"fleet": 60.0})
    table = format_result(result, settings)
    assert "300 / 1000 ms = 0.300x | no (1.50x the goal)" in table
    assert "896 of 896 = 100.0% | yes" in table
    assert "prompt 0: 1, prompt 1: 0" in table and "| 1024 / 0 |" in table and "| 1000 / 0 |" in table


@pytest.mark.parametrize("field, value", [("edges", 1), ("parts", ("fleet", "other")), ("history_tokens", 32),
                                          ("rounds", 0), ("cpus", ())])
def test_settings_refuse_what_the_bench_cannot_measure(field, value):
    with pytest.raises(ValueError):
        PrefixFleetSettings(**{field: value})
