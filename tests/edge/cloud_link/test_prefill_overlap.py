"""The cloud prefills the prompt while the edge drafts the first block (issue 15, part 1)."""

from __future__ import annotations

import asyncio
import time

from common.model.cached_lm import CachedLM, ForwardOutput
from common.spec.modes import DecodeSettings
from common.spec.verifier import ConfidenceVerifier
from edge.cloud_link.client import CloudEndpoint
from edge.cloud_link.session import CloudSession
from edge.decoding.decoder import EdgeDecoder, EdgeSettings
from edge.cloud_link.replicas import ReplicaSet
from edge_harness import ScriptedCloud, scripted

PREFILL_S = 0.5  # the cloud's open (its prefill of the prompt)
DRAFT_STEP_S = 0.1  # each draft forward


class SlowDraft:
    """The tiny draft, made as slow as a real one on a small device: each forward sleeps (off the event loop)."""

    def __init__(self, model) -> None:
        self.lm = CachedLM(model)

    def advance_to(self, context: list[int], n_logits: int = 1) -> ForwardOutput:
        time.sleep(DRAFT_STEP_S)
        return self.lm.advance_to(context, n_logits)

    def rollback(self, length: int) -> None:
        self.lm.rollback(length)


def _first_token_ms(tiny_draft, address: str) -> float:
    async def run() -> float:
        replicas = ReplicaSet([address], lambda a, _: CloudEndpoint(a), scripted(tiny_draft).tokenizer_fingerprint)
        async with replicas:
            decoder = EdgeDecoder(tiny_draft, lambda with_hidden: SlowDraft(tiny_draft.model), ConfidenceVerifier(0.5), replicas)
            prompt = tiny_draft.tokenizer("a prompt the cloud takes a while to prefill")["input_ids"]
            result = await decoder.generate(prompt, EdgeSettings(DecodeSettings(mode="sd", k=4, max_new_tokens=4)))
            assert not result.degraded
            return result.stats.ttft_ms
    return asyncio.run(run())


def test_the_first_token_pays_the_larger_of_prefill_and_drafting_not_their_sum(tiny_draft, monkeypatch) -> None:
    script = scripted(tiny_draft, open_delay_s=PREFILL_S)
    with ScriptedCloud(script) as cloud:
        overlapped = _first_token_ms(tiny_draft, cloud.address)
        monkeypatch.setattr(CloudSession, "open_ahead", lambda self, prompt_ids, first_token=False: None)
        sequential = _first_token_ms(tiny_draft, cloud.address)
    drafting_ms = 4 * DRAFT_STEP_S * 1e3  # the prompt's prefill and three more steps: the first block of 4
    assert script.opens == 2  # one open per generation: the early open was the session's open
    assert sequential >= drafting_ms + PREFILL_S * 1e3
    assert overlapped < sequential - 0.6 * min(drafting_ms, PREFILL_S * 1e3), (overlapped, sequential)


def test_closing_while_the_early_open_is_in_flight_leaves_nothing_behind(tiny_draft) -> None:
    async def run(address: str) -> None:
        replicas = ReplicaSet([address], lambda a, _: CloudEndpoint(a), scripted(tiny_draft).tokenizer_fingerprint)
        async with replicas:
            session = replicas.session(DecodeSettings().sampling)
            session.open_ahead([1, 2, 3])
            await asyncio.sleep(0.05)
            assert session.opening
            await session.close()
            assert session.stream.call is None and not session.opening
            assert sum(r["sessions"] for r in replicas.describe()) == 0

    with ScriptedCloud(scripted(tiny_draft, open_delay_s=1.0)) as cloud:
        asyncio.run(run(cloud.address))
