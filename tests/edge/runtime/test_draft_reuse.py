"""The edge draft's prompt KV reused across requests (issue 44, part 1): greedy output token-identical with the
cache on and off, on both runtimes, over a conversation's second turn, a prompt that diverges mid-way and the
`n` choices of one request; what it saved in the stats; the memory bound."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from common.spec.modes import DecodeSettings
from common.model.loading import LoadedModel
from common.sampling.distributions import SamplingParams
from common.spec.verifier import ConfidenceVerifier
from edge.decoding.decoder import EdgeDecoder, EdgeResult, EdgeSettings
from edge.runtime.draft import draft_lm_factory
from edge.runtime.draft_reuse import MIN_REUSE_TOKENS, DraftKVCache

NEW_TOKENS = 16
GREEDY = EdgeSettings(DecodeSettings(mode="draft", max_new_tokens=NEW_TOKENS, sampling=SamplingParams(temperature=0.0)))


@pytest.fixture(scope="module")
def export_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sprinter-cache")


@pytest.fixture(params=["torch", "onnx"])
def runtime(request: pytest.FixtureRequest, export_cache: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("SPRINTER_CACHE", str(export_cache))  # the tiny export goes to a temporary place
    return request.param


def decoders(draft: LoadedModel, runtime: str, cache: DraftKVCache) -> tuple[EdgeDecoder, EdgeDecoder]:
    """(cache off, cache on) over one model and runtime, float32 weights on both."""
    def decoder(with_cache: DraftKVCache | None) -> EdgeDecoder:
        factory = draft_lm_factory(draft, runtime, threads=1, weights="float32", cache=with_cache)
        return EdgeDecoder(draft, factory, ConfidenceVerifier(0.5), None)
    return decoder(None), decoder(cache)


def prompt_of(draft: LoadedModel, text: str) -> list[int]:
    return draft.tokenizer(text)["input_ids"]


async def both(cold: EdgeDecoder, warm: EdgeDecoder, prompt: list[int]) -> EdgeResult:
    """Generate with each; the outputs must be the same tokens. Returns the cached decoder's result."""
    expected = await cold.generate(prompt, GREEDY)
    got = await warm.generate(prompt, GREEDY)
    assert got.token_ids == expected.token_ids
    assert expected.stats.draft_reused_tokens == 0
    return got


def test_greedy_output_is_the_same_with_the_cache_over_turns_and_divergence(tiny_draft: LoadedModel,
                                                                            runtime: str) -> None:
    cache = DraftKVCache(64 << 20)
    cold, warm = decoders(tiny_draft, runtime, cache)
    first = prompt_of(tiny_draft, "The system prompt says: answer briefly and politely, in English. User: what is "
                                  "the tallest mountain on the moon, and how was it measured?")

    async def run() -> None:
        one = await both(cold, warm, first)
        assert one.stats.draft_reused_tokens == 0  # nothing cached yet
        # The next turn extends the first: its prompt, the answer, and a new message.
        second = first + one.token_ids + prompt_of(tiny_draft, " User: and on Mars?")
        two = await both(cold, warm, second)
        assert two.stats.draft_reused_tokens >= len(first) + len(one.token_ids) - 1
        # A prompt that diverges mid-way reuses exactly the prefix it shares.
        half = len(first) // 2
        diverged = first[:half] + [(t + 1) % tiny_draft.model.config.vocab_size for t in first[half:]]
        three = await both(cold, warm, diverged)
        assert three.stats.draft_reused_tokens == half
        # The very same prompt again: all but its last token, which is fed for its logits.
        again = await both(cold, warm, first)
        assert again.stats.draft_reused_tokens == len(first) - 1

    asyncio.run(run())
    assert cache.hits == 3 and cache.nbytes <= cache.max_bytes


def test_the_n_choices_of_one_request_prefill_the_prompt_once(tiny_draft: LoadedModel, runtime: str) -> None:
    cache = DraftKVCache(64 << 20)
    cold, warm = decoders(tiny_draft, runtime, cache)
    prompt = prompt_of(tiny_draft, "Write three names for a small grey cat that sleeps all day on the window sill.")

    async def run() -> list[EdgeResult]:
        expected = await cold.generate(prompt, GREEDY)
        results = await asyncio.gather(*(warm.generate(prompt, GREEDY) for _ in range(3)))
        assert all(result.token_ids == expected.token_ids for result in results)
        return results

    reused = sorted(result.stats.draft_reused_tokens for result in asyncio.run(run()))
    assert reused == [0, len(prompt) - 1, len(prompt) - 1]  # the first prefilled; the others waited for it
    assert cache.prefill_s_per_token is not None


def test_the_cache_stays_within_its_bytes_least_recently_used_out(tiny_draft: LoadedModel) -> None:
    probe = DraftKVCache(64 << 20)
    _, warm = decoders(tiny_draft, "torch", probe)
    prompts = [prompt_of(tiny_draft, f"Conversation number {i} is about topic {i * 7}, and it goes on for a while "
                                     f"with words that differ: {'x' * i}") for i in range(4)]
    asyncio.run(warm.generate(prompts[0], GREEDY))
    per_entry = max(entry.nbytes for entry in probe.entries.values())
    cache = DraftKVCache(int(per_entry * 2.5))  # room for two entries of this size
    _, warm = decoders(tiny_draft, "torch", cache)

    async def run() -> None:
        for prompt in prompts:
            await warm.generate(prompt, GREEDY)
            assert cache.nbytes <= cache.max_bytes
        # The latest conversation is held (one entry: its answer extended its prompt). The first is too: each
        # later prompt reused its leading words ("Conversation number "), which kept it recent; the two between
        # were evicted, and reuse only those words now.
        assert (await warm.generate(prompts[-1], GREEDY)).stats.draft_reused_tokens == len(prompts[-1]) - 1
        assert (await warm.generate(prompts[0], GREEDY)).stats.draft_reused_tokens == len(prompts[0]) - 1
        shared = next(i for i, (a, b) in enumerate(zip(prompts[1], prompts[0])) if a != b)
        assert (await warm.generate(prompts[1], GREEDY)).stats.draft_reused_tokens == shared

    asyncio.run(run())
    assert cache.evictions >= 2 and len(cache.entries) <= 2


def test_a_zero_budget_caches_nothing(tiny_draft: LoadedModel) -> None:
    cache = DraftKVCache(0)
    _, warm = decoders(tiny_draft, "torch", cache)
    prompt = prompt_of(tiny_draft, "the same prompt twice, with a zero budget for the draft's cache")

    async def run() -> None:
        for _ in range(2):
            assert (await warm.generate(prompt, GREEDY)).stats.draft_reused_tokens == 0

    asyncio.run(run())
    assert not cache.entries and cache.nbytes == 0


@pytest.mark.parametrize("runtime_name", ["torch", "onnx"])
def test_smollm2_second_turn_is_the_same_with_the_cache(smollm2: LoadedModel, runtime_name: str) -> None:
    """A real model's logits (float32; the ONNX export lives in the machine's cache, made once)."""
    cache = DraftKVCache(64 << 20)
    cold, warm = decoders(smollm2, runtime_name, cache)
    first = prompt_of(smollm2, "You are a helpful assistant. Answer in one sentence.\nQuestion: why is the sky blue?\n"
                               "Answer:")

    async def run() -> None:
        one = await both(cold, warm, first)
        second = first + one.token_ids + prompt_of(smollm2, "\nQuestion: and why are sunsets red?\nAnswer:")
        two = await both(cold, warm, second)
        assert two.stats.draft_reused_tokens >= len(first) + len(one.token_ids) - 1
        diverged = first[:len(first) // 2] + prompt_of(smollm2, " Tell me about whales instead.\nAnswer:")
        await both(cold, warm, diverged)

    asyncio.run(run())


def test_the_daemon_reports_what_the_draft_reused_in_the_response_and_its_metrics(tiny_draft: LoadedModel) -> None:
    """`edge serve --draft-cache-mb` (parsed as the daemon parses it), through HTTP: a chat's second turn."""
    import argparse

    import httpx

    from edge.api.app import ApiSettings, create_app
    from edge.node import EdgeNodeSettings
    from edge.serve_command import register
    from edge_harness import EdgeDaemonThread

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["edge", "serve"])
    assert EdgeNodeSettings.from_args(args).draft_cache_mb == 256  # on by default in the daemon
    assert parser.parse_args(["edge", "serve", "--draft-cache-mb", "0"]).draft_cache_mb == 0
    api = ApiSettings(default_mode="draft", model_name="tiny")
    with EdgeDaemonThread(tiny_draft, None, lambda node: create_app(node, api), {"draft_cache_mb": 16}) as daemon:
        turn = {"model": "tiny", "max_tokens": 8, "temperature": 0}
        messages = [{"role": "system", "content": "Be brief. " * 6}, {"role": "user", "content": "Name a river."}]
        first = httpx.post(daemon.base + "/v1/chat/completions", json={**turn, "messages": messages}).json()
        messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "And a lake?"}]
        second = httpx.post(daemon.base + "/v1/chat/completions", json={**turn, "messages": messages}).json()
        reused = second["sprinter"]["stats"]["draft_reused_tokens"]
        assert first["sprinter"]["stats"]["draft_reused_tokens"] == 0 and reused >= MIN_REUSE_TOKENS
        assert second["sprinter"]["stats"]["draft_prefill_saved_ms"] > 0
        scraped = httpx.get(daemon.base + "/metrics").text
        assert f"sprinter_edge_draft_reused_tokens_total {float(reused)}" in scraped
        assert "sprinter_edge_draft_prefill_saved_seconds_total" in scraped


@pytest.mark.parametrize("io_binding", [False, True])
def test_an_onnx_snapshot_restores_the_rows_it_holds(tiny_draft: LoadedModel, export_cache: Path, io_binding: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ONNX cache forms (numpy; OrtValues through the slice graph, as on CUDA): a runtime started from a cut
    snapshot gives a fresh runtime's logits, and growing it leaves the snapshot as it was."""
    import numpy as np
    import torch

    from edge.onnx_export.export import export_draft
    from edge.runtime.onnx_draft import OnnxDraftModel

    monkeypatch.setenv("SPRINTER_CACHE", str(export_cache))
    model = OnnxDraftModel(export_draft(tiny_draft), threads=1, io_binding=io_binding)
    context = list(range(5, 45))
    donor = model.new_lm()
    donor.advance_to(context)
    kv, nbytes = donor.kv_snapshot()
    assert nbytes > 0
    before = [np.array(v.numpy() if io_binding else v, copy=True) for v in kv]
    diverged = context[:25] + [7, 8, 9]
    started, fresh = model.new_lm(), model.new_lm()
    started.start_from(diverged[:25], kv)
    got, want = started.advance_to(diverged, 3), fresh.advance_to(diverged, 3)
    assert torch.allclose(got.logits, want.logits, atol=1e-5)
    started.advance_to(diverged + [1, 2, 3])
    assert all(np.array_equal(b, v.numpy() if io_binding else v) for b, v in zip(before, kv))
