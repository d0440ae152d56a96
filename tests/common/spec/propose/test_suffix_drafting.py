"""Suffix drafting (`--proposer suffix`): matching, the cache's bound and off switch, sprinter's rule for copies from
other requests, and losslessness: greedy identity with the target in every lossless mode (locally and over a real
cloud, float32) and the target's law at T=1 (chi-square) for sd, sd-block and sprinter-exact."""

from __future__ import annotations

import asyncio
import statistics
from collections import Counter
from dataclasses import replace

import httpx
import pytest
import torch

from cloud.server import CloudSettings
from cloud_harness import ServerThread
from common.model.cached_lm import CachedLM
from common.spec.call_policy import FixedPolicy, FlagPolicy
from common.spec.cost_model import Ewma
from common.spec.propose.drafting import Drafter, LocalDraft, ModelProposer
from common.spec.propose.hybrid_proposer import ChainedRuns
from common.spec.local_decoder import LocalDecoder
from common.spec.modes import LOSSLESS_MODES, DecodeSettings
from common.spec.propose.proposals import CACHE, CONTEXT, MODEL
from common.spec.speculative_round import run_inline
from common.spec.propose.suffix_match import KEY_LENGTH, OutputCache, TokenIndex, continuation, follow
from common.spec.propose.suffix_proposer import PRIOR_RATES, SuffixCalibration, SuffixMemory, SuffixProposer, suffix_memory
from common.model.prompting import encode_prompt
from common.sampling.distributions import SamplingParams
from edge.api.app import ApiSettings, create_app
from edge.decoding.decoder import EdgeSettings
from edge.node import EdgeNode, EdgeNodeSettings
from edge_harness import EdgeDaemonThread, on_edge
from exact_distributions import chi_square_pvalue, first_tokens_distribution, near_draft

EDGE_MODES = [m for m in LOSSLESS_MODES if m in ("sd", "sd-block", "sprinter-exact")]
PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, wound the "
           "clockwork that turned the lens, and wrote the weather into a leather logbook before supper.")


# --- matching ---------------------------------------------------------------------------------


def test_the_longest_match_proposes_what_followed_it_scored_by_how_often() -> None:
    index = TokenIndex()
    #          0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 2, 3, 4, 6, 8]
    index.extend_to(tokens)
    found = continuation(index, [0, 9, 2, 3, 4], length=3)  # "9 2 3 4" matches at 5..8 only: 4 tokens long
    assert found is not None and found.match_length == 4 and found.tokens == [6, 7, 2]
    found = continuation(index, [0, 0, 2, 3, 4], length=2)  # "2 3 4": three occurrences, two go on with 6
    assert found.match_length == KEY_LENGTH and found.occurrences == 3
    assert found.tokens == [6, 8] and found.scores == pytest.approx([2 / 3, 1 / 3])  # the latest 6 followed by 8
    assert continuation(index, [7, 7, 7], length=4) is None
    assert follow([[1, 2], [1, 3], [1, 3], [4]], 2) == ([1, 3], [0.75, 0.5])


def test_matching_costs_microseconds(smollm2) -> None:
    prompt = encode_prompt(smollm2.tokenizer, f"Summarize: {PASSAGE * 6}", chat=True)  # ~250 tokens
    memory = SuffixMemory()
    for shift in range(20):  # a cache of earlier outputs to search as well
        memory.cache.add(prompt[shift * 10:shift * 10 + 120])
    proposer = SuffixProposer(ModelProposer(LocalDraft(CachedLM(smollm2.model)), SamplingParams(), torch.Generator(),
                                            smollm2.eos_token_ids), memory)
    proposer.index.extend_to(prompt)
    for end in range(len(prompt) - 200, len(prompt)):
        proposer.lookup(prompt[:end], 16)
    median_us = statistics.median(memory.match_us)
    print(f"suffix lookup: median {median_us:.1f} us over {len(memory.match_us)} lookups")
    assert median_us < 500, "a lookup must cost far less than a draft step (milliseconds)"


def test_the_copies_scores_are_calibrated_on_the_verdicts(tiny_draft) -> None:
    calibration = SuffixCalibration()
    assert calibration.rate(CONTEXT, 5) == pytest.approx(PRIOR_RATES[CONTEXT][4])  # before any verdict: the prior
    for i in range(200):  # long matches kept 9 times in 10, short ones once in 5
        calibration.observe(CONTEXT, 20, kept=i % 10 != 0, predicted=0.9)
        calibration.observe(CONTEXT, 3, kept=i % 5 == 0, predicted=0.3)
    assert calibration.rate(CONTEXT, 17) == pytest.approx(0.9, abs=0.02)
    assert calibration.rate(CONTEXT, 3) == pytest.approx(0.2, abs=0.04)
    assert calibration.rate(CACHE, 20) == pytest.approx(PRIOR_RATES[CACHE][16])  # another source learns apart
    report = {r["match_length"]: r for r in calibration.report()}
    assert report[16]["reached"] == 200 and report[16]["kept"] == pytest.approx(0.9)
    assert report[3]["predicted"] == pytest.approx(0.3)
    # through a proposer: a verdict teaches the copies the target reached, not those after a rejection
    memory = SuffixMemory(cache=None)
    proposer = _suffix(tiny_draft, memory)
    block = _drafted(proposer, [9, 10, 11, 12, 13, 14, 15, 9, 10, 11], 8)
    assert [d.source for d in block.drafted] == [CONTEXT] * len(block) and len(block) >= 3
    proposer.observe_verdict(block, 1)
    assert sum(memory.calibration.reached.values()) == 2 and sum(memory.calibration.kept.values()) == 1


# --- the cache --------------------------------------------------------------------------------


def test_the_cache_stays_within_its_bound_least_recently_used_first_out() -> None:
    cache = OutputCache(max_tokens=30)
    outputs = [[100 * i + j for j in range(10)] for i in range(5)]
    for output in outputs[:3]:
        cache.add(output)
    assert cache.held == 30 and len(cache) == 3
    assert cache.continuation([0, 1, 2], 3).tokens == [3, 4, 5]  # output 0 used: now the most recent
    cache.add(outputs[3])  # evicts output 1, the least recently used
    assert cache.held <= 30 and cache.continuation([100, 101, 102], 3) is None
    assert cache.continuation([0, 1, 2], 3) is not None
    for i in range(40):  # churn: the bound holds, and stale index entries are dropped
        cache.add([1000 + 10 * i + j for j in range(10)])
        assert cache.held <= 30
    assert sum(map(len, cache.positions.values())) <= 2 * 30
    cache.add(list(range(5000, 5100)))  # longer than the bound: its last 30 tokens
    assert cache.held == 30 and cache.continuation([5070, 5071, 5072], 2).tokens == [5073, 5074]


def test_the_cache_off_switch(tiny_draft) -> None:
    assert suffix_memory(cache=False).cache is None and suffix_memory().cache is not None
    from common.cli import build_parser
    args = build_parser().parse_args(["edge", "serve", "--draft", "tiny-random-draft", "--suffix-cache", "off",
                                      "--proposer", "suffix"])
    assert args.proposer == "suffix" and EdgeNodeSettings.from_args(args).suffix_cache is False
    earlier = list(range(150, 190))
    for cache in (True, False):
        memory = suffix_memory(cache)
        proposer = _suffix(tiny_draft, memory)
        proposer.observe_output(earlier)
        block = _drafted(proposer, [7, 8, 9, 150, 151, 152, 153], 8)
        sources = {d.source for d in block.drafted}
        assert (CACHE in sources) is cache, sources
        if cache:
            assert block.tokens[:3] == [154, 155, 156]


def _suffix(draft, memory: SuffixMemory, passes_unchecked: bool = False, model_kept: float = 0.0) -> SuffixProposer:
    """Suffix drafting over `draft`; `model_kept`: what a run must beat (0: any run worth its first token)."""
    memory.model_kept = Ewma(model_kept, 0.1)
    model = ModelProposer(LocalDraft(CachedLM(draft.model)), SamplingParams(), torch.Generator(), draft.eos_token_ids)
    return SuffixProposer(model, memory, passes_unchecked=passes_unchecked)


def test_a_run_must_promise_more_kept_tokens_than_the_drafts_own_blocks(tiny_draft) -> None:
    context = [9, 10, 11, 12, 13, 14, 15, 16, 17, 9, 10, 11]  # a 3-token match: a run of a few likely tokens
    assert {d.source for d in _drafted(_suffix(tiny_draft, SuffixMemory(cache=None), model_kept=1.0), context, 6)
            .drafted} == {CONTEXT}
    assert {d.source for d in _drafted(_suffix(tiny_draft, SuffixMemory(cache=None), model_kept=4.0), context, 6)
            .drafted} == {MODEL}
    memory = SuffixMemory(cache=None)
    proposer = _suffix(tiny_draft, memory, model_kept=2.0)
    model_block = _drafted(proposer, [3, 4, 5, 6], 4)  # no match: the draft's own block
    proposer.observe_verdict(model_block, 4)
    assert memory.model_kept.value == 4.0  # learned from the verdict on it


def _drafted(proposer, context: list[int], limit: int, policy=None, on_passed=None):
    drafter = Drafter(proposer, proposer.draft_model.eos_token_ids)
    return run_inline(drafter.draft(context, limit, policy, None, on_passed=on_passed))


def test_in_sprinter_a_copy_of_another_requests_output_is_always_sent_never_passed(tiny_draft) -> None:
    memory = SuffixMemory()
    proposer = _suffix(tiny_draft, memory, passes_unchecked=True)
    proposer.observe_output(list(range(150, 190)))
    own = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59]
    passed = []
    policy = FlagPolicy(0.0)  # a verifier that trusts everything: only the rule for copies may stop a token
    block = _drafted(proposer, own + [1, 2, 150, 151, 152], 12, policy, passed.append)
    assert block.drafted[0].source == CACHE and block.drafted[0].flagged and len(block) == 1  # sent at once
    assert not passed
    passed.clear()
    block = _drafted(proposer, own + [50, 51, 52], 12, policy, passed.append)  # this request's own text
    assert [d.source for d in block.drafted[:3]] == [CONTEXT] * 3 and block.tokens[:3] == [53, 54, 55]
    assert [p.token for p in passed] == block.tokens[:-1]  # its copies may pass, as the draft's tokens do


def test_hybrid_copies_where_a_copy_beats_the_draft_and_chains_the_drafts_tokens_after_a_run(tiny_draft) -> None:
    # two earlier occurrences agree on 12, 13 and then part (40 or 41): the third copy scores half, under the bar
    context = [9, 10, 11, 12, 13, 40, 9, 10, 11, 12, 13, 41, 9, 10, 11]
    model = ModelProposer(LocalDraft(CachedLM(tiny_draft.model)), SamplingParams(), torch.Generator(),
                          tiny_draft.eos_token_ids)
    memory = SuffixMemory(cache=None, model_estimate=Ewma(0.6, 0.1))
    block = _drafted(SuffixProposer(model, memory, rule=ChainedRuns()), context, 6, FixedPolicy(5))
    assert block.tokens[:2] == [12, 13] and [d.source for d in block.drafted[:2]] == [CONTEXT, CONTEXT]
    assert block.drafted[2].source == MODEL and len(block) == 5  # chained: the policy's k, not the run, ends it
    assert block.drafted[2].fed == len(context) + 2  # one forward fed the context and both copies
    confident = SuffixMemory(cache=None, model_estimate=Ewma(0.99, 0.1))  # a draft the target keeps 99% of
    block = _drafted(SuffixProposer(model, confident, rule=ChainedRuns()), context, 6, FixedPolicy(5))
    assert {d.source for d in block.drafted} == {MODEL}  # no copy beats it: the draft drafts every position


# --- lossless: greedy identity ----------------------------------------------------------------


def _prompts(tokenizer) -> dict[str, list[int]]:
    """A long hit (the passage is asked back) and a miss (nothing to copy)."""
    return {"hit": encode_prompt(tokenizer, f"Repeat this text word for word:\n{PASSAGE}\n", chat=True)
            + tokenizer(PASSAGE[:60])["input_ids"],
            "miss": encode_prompt(tokenizer, "Name three colours.", chat=True)}


@pytest.mark.parametrize("proposer", ["suffix", "hybrid"])
@pytest.mark.parametrize("pair", ["tiny", pytest.param("smollm2", marks=pytest.mark.smollm2)])
def test_greedy_suffix_drafting_equals_the_target_locally(pair, proposer, request) -> None:
    if pair == "tiny":
        target, draft = request.getfixturevalue("tiny_target"), request.getfixturevalue("tiny_draft")
    else:
        target, draft = request.getfixturevalue("smollm2"), request.getfixturevalue("smollm2_4_layers")
    engine = LocalDecoder(target, draft)
    copied = 0
    prompts = _prompts(target.tokenizer)
    if pair == "smollm2":  # the miss (draft-model blocks only) is the tiny pair's; SmolLM2 adds the real pair's copies
        del prompts["miss"]
    for name, prompt in prompts.items():
        reference = engine.generate(prompt, DecodeSettings(mode="target", max_new_tokens=32)).token_ids
        for mode in EDGE_MODES:
            for _ in range(2):  # the second run may also copy from the first's output (the cache)
                result = engine.generate(prompt, DecodeSettings(mode=mode, max_new_tokens=32, proposer=proposer))
                assert result.token_ids == reference, (name, mode)
                copied += result.stats.suffix_tokens
                assert result.stats.draft_forwards + result.stats.suffix_tokens >= result.stats.drafted_tokens
        lossy = engine.generate(prompt, DecodeSettings(mode="sprinter", max_new_tokens=16, proposer=proposer))
        assert lossy.stats.new_tokens == 16 or lossy.token_ids[-1] in target.eos_token_ids  # sprinter runs with it
    assert copied > 0


@pytest.mark.parametrize("proposer", ["suffix", "hybrid"])
def test_greedy_suffix_drafting_equals_the_target_over_a_cloud(tiny_target, tiny_draft, proposer) -> None:
    prompts = _prompts(tiny_target.tokenizer)
    references = {name: LocalDecoder(tiny_target, None).generate(p, DecodeSettings(mode="target", max_new_tokens=24))
                  .token_ids for name, p in prompts.items()}
    settings = CloudSettings(target="tiny-random", batch_window_ms=1)
    with ServerThread(settings, tiny_target) as cloud:
        async def work(node: EdgeNode):
            runs = [(name, mode, pipeline) for name in prompts for mode in EDGE_MODES for pipeline in ("off", "ahead")]
            results = []
            for name, mode, pipeline in runs:  # in turn: later runs copy from earlier outputs too
                results.append(await node.decoder.generate(prompts[name], EdgeSettings(
                    DecodeSettings(mode=mode, max_new_tokens=24, proposer=proposer), pipeline=pipeline)))
            return list(zip(runs, results))

        results = asyncio.run(on_edge(cloud.address, tiny_draft, work))
    for (name, mode, pipeline), result in results:
        assert not result.degraded and result.error is None
        assert result.token_ids == references[name], (name, mode, pipeline)
    assert sum(r.stats.suffix_tokens for _, r in results) > 0


@pytest.mark.smollm2
@pytest.mark.parametrize("proposer", ["suffix", "hybrid"])
def test_greedy_suffix_drafting_equals_the_target_over_a_cloud_smollm2(smollm2, smollm2_4_layers, proposer) -> None:
    prompt = _prompts(smollm2.tokenizer)["hit"]
    reference = LocalDecoder(smollm2, None).generate(prompt, DecodeSettings(mode="target", max_new_tokens=32))
    with ServerThread(CloudSettings(target="smollm2-135m", batch_window_ms=1), smollm2) as cloud:
        async def work(node: EdgeNode):
            return [await node.decoder.generate(prompt, EdgeSettings(
                DecodeSettings(mode=mode, max_new_tokens=32, proposer=proposer))) for mode in EDGE_MODES]

        results = asyncio.run(on_edge(cloud.address, smollm2_4_layers, work))
    for result in results:
        assert not result.degraded and result.token_ids == reference.token_ids
    assert all(r.stats.suffix_tokens > 0 for r in results)
    assert results[0].stats.tokens_per_call > 2  # long runs of copies: more tokens per call than k's blocks alone


# --- lossless: the target's law at T=1 ---------------------------------------------------------


@pytest.mark.parametrize("proposer, mode", [("suffix", m) for m in EDGE_MODES]
                         + [("hybrid", "sd-block"), ("hybrid", "sprinter-exact")])
def test_sampled_suffix_drafting_follows_the_target(tiny_target, proposer, mode) -> None:
    """A prompt that repeats itself, so that the copies are proposed at the first positions and often kept."""
    sampling = SamplingParams(temperature=1.0, top_k=4)
    base = tiny_target.tokenizer("Once upon a time there")["input_ids"]
    prompt = _repeating_prompt(tiny_target, base, sampling)
    exact = first_tokens_distribution(tiny_target, prompt, sampling, 3)
    engine = LocalDecoder(tiny_target, near_draft(tiny_target))
    n = 600
    results = []
    for seed in range(n):  # each from the prior: copies keep being proposed, whatever the last ones' verdicts
        # from the prior, and a draft expected to keep nothing: copies are proposed wherever they match
        engine.suffix_memory = SuffixMemory(cache=None, model_kept=Ewma(0.0, 0.1), model_estimate=Ewma(0.0, 0.1))
        results.append(engine.generate(prompt, DecodeSettings(mode=mode, max_new_tokens=3, k=2, proposer=proposer,
                                                              sampling=replace(sampling, seed=seed))))
    seen = Counter(tuple(r.token_ids) for r in results)
    assert set(seen) <= set(exact)
    p = chi_square_pvalue(seen, exact)
    kept = sum(r.stats.suffix_kept for r in results)
    print(f"{proposer} {mode}: p = {p:.3g}, copies proposed {sum(r.stats.suffix_tokens for r in results)}, kept {kept}")
    assert p > 1e-3
    assert kept > n / 10  # the copies were proposed and often kept: the check covers them


def _repeating_prompt(target, base: list[int], sampling: SamplingParams) -> list[int]:
    """base + [x] + base, with x a token the target likely gives after it (so the copy x is worth checking)."""
    best, best_p = base[0], -1.0
    for x in range(3, 60):
        prompt = base + [x] + base
        with torch.inference_mode():
            probs = torch.softmax(target.model(torch.tensor([prompt])).logits[0, -1].float(), -1)
        if float(probs[x]) > best_p:
            best, best_p = x, float(probs[x])
    return base + [best] + base


# --- the API ------------------------------------------------------------------------------------


def test_the_proposer_is_a_per_request_field_a_bad_one_refused_naming_it(tiny_target, tiny_draft) -> None:
    def post(edge: EdgeDaemonThread, **fields) -> httpx.Response:
        body = {"model": "tiny", "prompt": PASSAGE + " " + PASSAGE[:40], "max_tokens": 8, "temperature": 0,
                "mode": "sd-block", **fields}
        return httpx.post(edge.base + "/v1/completions", json=body, timeout=60)

    with ServerThread(CloudSettings(target="tiny-random", batch_window_ms=1), tiny_target) as cloud, \
            EdgeDaemonThread(tiny_draft, cloud.address, lambda node: create_app(node, ApiSettings(model_name="t"))) \
            as edge:
        refused = post(edge, proposer="psychic")
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "proposer"
        assert "unknown proposer" in refused.json()["error"]["message"]
        plain, copied = post(edge).json(), post(edge, proposer="suffix").json()
    assert copied["choices"][0]["text"] == plain["choices"][0]["text"]
    assert plain["sprinter"]["stats"]["suffix_tokens"] == 0


def test_the_model_proposer_stays_the_draft_alone(tiny_draft) -> None:
    model = ModelProposer(LocalDraft(CachedLM(tiny_draft.model)), SamplingParams(), torch.Generator(),
                          tiny_draft.eos_token_ids)
    block = _drafted(model, [5, 6, 7, 5, 6, 7, 5, 6], 5)
    assert {d.source for d in block.drafted} == {MODEL} and all(d.step is not None for d in block.drafted)
    assert [d.fed for d in block.drafted] == [8, 1, 1, 1, 1]  # the prompt, then one token a step
