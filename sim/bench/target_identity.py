"""Greedy answers held against the target's own: in a lossless mode, an answer that did not degrade must be
token-identical to what mode target gives for the same request.

    identity = await check_target_identity(client, base, specs, outcomes)

The references are asked for after the load, through the same edge, one request per distinct
(prompt, chat, max_tokens), in mode target, greedy, not streamed. Answers in the lossy modes
(`sprinter`, `draft`), sampled answers and degraded answers are not held to it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httpx

from common.spec.modes import LOSSLESS_MODES
from sim.bench.load import RequestOutcome, RequestSpec, send_request

REFERENCE_CONCURRENCY = 4


@dataclass
class TargetIdentity:
    checked: int = 0  # greedy, lossless, non-degraded answers compared with a reference
    mismatches: list[int] = field(default_factory=list)  # their request indices
    references_failed: int = 0  # references that did not come back whole and non-degraded (those answers go unchecked)


def held_to_identity(spec: RequestSpec, outcome: RequestOutcome) -> bool:
    return (outcome.ok and not outcome.degraded and spec.temperature == 0 and spec.mode in LOSSLESS_MODES
            and outcome.token_ids is not None)


async def check_target_identity(client: httpx.AsyncClient, base: str, specs: list[RequestSpec],
                                outcomes: list[RequestOutcome]) -> TargetIdentity:
    by_index = {spec.index: spec for spec in specs}
    held = [(by_index[o.index], o) for o in outcomes if o.index in by_index and held_to_identity(by_index[o.index], o)]
    keys = {(s.prompt, s.chat, s.max_tokens) for s, _ in held}
    gate = asyncio.Semaphore(REFERENCE_CONCURRENCY)

    async def reference(key: tuple[str, bool, int]) -> list[int] | None:
        prompt, chat, max_tokens = key
        spec = RequestSpec(-1, prompt, chat, "target", max_tokens, stream=False)
        async with gate:
            answer = await send_request(client, base, spec)
        return answer.token_ids if answer.ok and not answer.degraded else None

    ordered = sorted(keys)
    answers = dict(zip(ordered, await asyncio.gather(*(reference(k) for k in ordered))))
    identity = TargetIdentity(references_failed=sum(a is None for a in answers.values()))
    for spec, outcome in held:
        expected = answers[(spec.prompt, spec.chat, spec.max_tokens)]
        if expected is None:
            continue
        identity.checked += 1
        if outcome.token_ids != expected:
            identity.mismatches.append(outcome.index)
    return identity
