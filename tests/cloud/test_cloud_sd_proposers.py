"""cloud-sd with a proposer (Speculation.proposer, `cloud serve --proposer`): the cloud's drafter copies text where it
matches, as the edge's does, over a real cloud on loopback.

Lossless with every proposer: greedy output equals the target's own (float32), and sampled output follows the
target's law (chi-square at T=1, copies proposed and kept). The suffix memory is per edge identity: one identity's
output is never copied for another. An unknown proposer is refused naming the field; vLLM's cloud-sd, which is
vLLM's own draft-model speculation, refuses any proposer but the model.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace

import grpc
import pytest

from cloud.auth import ANONYMOUS
from cloud.errors import CloudError
from cloud.server import CloudSettings
from cloud.cloud_sd import SpeculationRequest
from cloud.suffix_memories import SuffixMemories
from cloud.vllm_engine import check_vllm_speculation
from cloud_harness import ServerThread
from common import wire
from common.spec.cost_model import Ewma
from common.spec.local_decoder import LocalDecoder
from common.spec.modes import PROPOSERS, DecodeSettings
from common.spec.propose.suffix_proposer import SuffixCalibration
from common.sampling.distributions import SamplingParams
from edge.decoding.decoder import EdgeSettings
from edge.node import EdgeNode
from edge_harness import on_edge
from exact_distributions import chi_square_pvalue, first_tokens_distribution, near_draft, seeded_generations
from sprinter.v1 import decoding_pb2_grpc as pb_grpc
from tests.common.spec.propose.test_suffix_drafting import _prompts, _repeating_prompt

COPIED = "sprinter_cloud_draft_copied_tokens_total"
COPIED_KEPT = "sprinter_cloud_draft_copied_tokens_accepted_total"


def metric(cloud: ServerThread, name: str) -> float:
    return cloud.server.metrics.registry.get_sample_value(name) or 0.0


def always_copy(cloud: ServerThread, identity: str) -> None:
    """The identity's memory as if the draft's own blocks kept nothing: every match worth a copy is copied (a run
    then needs only its first token's score), so the checks below see copies from the first round."""
    cloud.server.servicer.host.suffix_memories.of(identity).model_kept = Ewma(0.0, 0.0, n=1)


class PriorRates(SuffixCalibration):
    """Rates that stay at their prior: every request of a long run proposes its copies as the first did (the rule's
    exactness holds whatever the rates are; the chi-square needs copies in every request to have power)."""

    def observe(self, source: str, match_length: int, kept: bool, predicted: float | None = None) -> None:
        pass


def generate(stub: pb_grpc.TargetServiceStub, prompt: list[int], max_new: int, proposer: str | None, k: int = 3,
             metadata: tuple[tuple[str, str], ...] | None = None) -> list[int]:
    chunks = stub.Generate(wire.generate_request(prompt, SamplingParams(), max_new, speculate_block=k,
                                                 proposer=proposer), metadata=metadata)
    return [t for chunk in chunks for t in chunk.token_ids]


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_cloud_sd_greedy_equals_the_target_with_every_proposer(tiny_target, tiny_draft, proposer) -> None:
    """Through the edge (which sends the request's proposer), twice per prompt: the second also finds the first's
    output in the identity's cache."""
    prompts = _prompts(tiny_target.tokenizer)
    references = {name: LocalDecoder(tiny_target, None).generate(p, DecodeSettings(mode="target", max_new_tokens=24))
                  .token_ids for name, p in prompts.items()}
    settings = CloudSettings(target="tiny-random", draft="tiny-random-draft", batch_window_ms=1)
    with ServerThread(settings, tiny_target, draft=tiny_draft) as cloud:
        async def work(node: EdgeNode):
            return [(name, await node.decoder.generate(prompts[name], EdgeSettings(DecodeSettings(
                mode="cloud-sd", max_new_tokens=24, k=k, proposer=proposer))))
                for name in prompts for k in (1, 4) for _ in range(2)]

        results = asyncio.run(on_edge(cloud.address, tiny_draft, work))
        copied = metric(cloud, COPIED)
    for name, result in results:
        assert not result.degraded and result.error is None
        assert result.token_ids == references[name], (name, proposer)
    assert (copied > 0) == (proposer != "model")  # the model proposes no copies; the others did here
    assert sum(r.stats.suffix_tokens for _, r in results) == copied  # the chunks tell the edge of them


def test_the_clouds_default_proposer_serves_a_request_that_names_none(tiny_target, tiny_draft) -> None:
    """`--proposer suffix`: a Generate with no proposer copies; one that names model does not (its field wins)."""
    prompt = _prompts(tiny_target.tokenizer)["hit"]
    reference = LocalDecoder(tiny_target, None).generate(prompt, DecodeSettings(mode="target", max_new_tokens=16))
    settings = CloudSettings(target="tiny-random", draft="tiny-random-draft", proposer="suffix")
    with ServerThread(settings, tiny_target, draft=tiny_draft) as cloud:
        stub = pb_grpc.TargetServiceStub(grpc.insecure_channel(cloud.address))
        always_copy(cloud, ANONYMOUS)
        assert generate(stub, prompt, 16, "model") == reference.token_ids
        assert metric(cloud, COPIED) == 0
        assert generate(stub, prompt, 16, None) == reference.token_ids
        assert metric(cloud, COPIED) > 0


@pytest.mark.smollm2
def test_cloud_sd_greedy_with_suffix_equals_the_target_smollm2(smollm2, smollm2_4_layers) -> None:
    prompt = _prompts(smollm2.tokenizer)["hit"]
    reference = LocalDecoder(smollm2, None).generate(prompt, DecodeSettings(mode="target", max_new_tokens=32))
    settings = CloudSettings(target="smollm2-135m", draft="smollm2-135m:layers=4", batch_window_ms=1)
    with ServerThread(settings, smollm2, draft=smollm2_4_layers) as cloud:
        stub = pb_grpc.TargetServiceStub(grpc.insecure_channel(cloud.address))
        for proposer in PROPOSERS:
            assert generate(stub, prompt, 32, proposer, k=5) == reference.token_ids, proposer
        assert metric(cloud, COPIED_KEPT) > 8  # the passage asked back: long runs copied and kept


def test_cloud_sd_sampled_output_with_suffix_follows_the_target(tiny_target) -> None:
    """A prompt that repeats itself, so that copies are proposed at the first positions and often kept."""
    sampling = SamplingParams(temperature=1.0, top_k=4)
    base = tiny_target.tokenizer("Once upon a time there")["input_ids"]
    prompt = _repeating_prompt(tiny_target, base, sampling)
    exact = first_tokens_distribution(tiny_target, prompt, sampling, 3)
    n = 500
    settings = CloudSettings(target="tiny-random", draft="tiny-random", batch_window_ms=1, edge_max_generate=16)
    with ServerThread(settings, tiny_target, draft=near_draft(tiny_target)) as cloud:
        always_copy(cloud, ANONYMOUS)
        memory = cloud.server.servicer.host.suffix_memories.of(ANONYMOUS)
        memory.calibration = memory.sampled = PriorRates()  # greedy's higher prior: copies at every first position

        def settings_for(seed: int) -> EdgeSettings:
            return EdgeSettings(DecodeSettings(mode="cloud-sd", max_new_tokens=3, k=2, proposer="suffix",
                                               sampling=replace(sampling, seed=seed)))

        results = asyncio.run(on_edge(cloud.address, tiny_target, lambda node: seeded_generations(
            node, prompt, n, settings_for, at_once=16)))
        copied, kept = metric(cloud, COPIED), metric(cloud, COPIED_KEPT)
    assert not any(r.degraded or r.error for r in results)
    seen = Counter(tuple(r.token_ids) for r in results)
    assert set(seen) <= set(exact)
    p = chi_square_pvalue(seen, exact)
    print(f"cloud-sd suffix: p = {p:.3g}, copies proposed {copied:g}, kept {kept:g}")
    assert p > 1e-3
    assert kept > n / 10  # copies were proposed and often kept: the check covers them


def test_identities_do_not_share_a_suffix_memory(tiny_target, tiny_draft, tmp_path) -> None:
    """Edge A's output is in A's cache: A copies it into a prompt that ends where it began; B, asking the same,
    copies nothing (its memory never saw it)."""
    tokens = tmp_path / "tokens"
    tokens.write_text("edge-a token-a\nedge-b token-b\n")
    as_a, as_b = (("authorization", "Bearer token-a"),), (("authorization", "Bearer token-b"),)
    first = tiny_target.tokenizer("Name three colours of the rainbow.")["input_ids"]
    settings = CloudSettings(target="tiny-random", draft="tiny-random-draft", auth_tokens=tokens)
    with ServerThread(settings, tiny_target, draft=tiny_draft) as cloud:
        stub = pb_grpc.TargetServiceStub(grpc.insecure_channel(cloud.address))
        for identity in ("edge-a", "edge-b"):
            always_copy(cloud, identity)
        output = generate(stub, first, 24, "suffix", metadata=as_a)
        echo = _prompts(tiny_target.tokenizer)["miss"] + output[:6]  # ends where A's output began
        before = metric(cloud, COPIED)
        generate(stub, echo, 8, "suffix", metadata=as_b)
        assert metric(cloud, COPIED) == before  # nothing of A's reached B's proposals
        generate(stub, echo, 8, "suffix", metadata=as_a)
        assert metric(cloud, COPIED) > before  # while A itself copies its own output there
        memories = cloud.server.servicer.host.suffix_memories
        assert ANONYMOUS not in memories and len(memories) == 2


def test_suffix_memories_keep_the_most_recently_used_identities() -> None:
    memories = SuffixMemories(max_identities=2)
    a = memories.of("a")
    memories.of("b")
    assert memories.of("a") is a  # a is now the most recently used: b goes first
    memories.of("c")
    assert "b" not in memories and "a" in memories and "c" in memories and len(memories) == 2
    with pytest.raises(ValueError):
        SuffixMemories(max_identities=0)
    assert SuffixMemories().of("a").cache is not None and SuffixMemories(cache=False).of("a").cache is None  # off


def test_an_unknown_proposer_is_refused_naming_the_field(tiny_target, tiny_draft) -> None:
    settings = CloudSettings(target="tiny-random", draft="tiny-random-draft")
    with ServerThread(settings, tiny_target, draft=tiny_draft) as cloud:
        stub = pb_grpc.TargetServiceStub(grpc.insecure_channel(cloud.address))
        with pytest.raises(grpc.RpcError) as refused:
            generate(stub, [1, 2, 3], 4, "psychic")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "speculation.proposer" in refused.value.details() and "psychic" in refused.value.details()


def test_cloud_serve_proposer_flags_are_checked_at_start() -> None:
    with pytest.raises(ValueError, match="--proposer"):
        CloudSettings(proposer="psychic", draft="tiny-random")
    with pytest.raises(ValueError, match="needs --draft"):
        CloudSettings(proposer="suffix")
    with pytest.raises(ValueError, match="--engine vllm"):
        CloudSettings(engine="vllm", draft="tiny-random", proposer="suffix")
    assert CloudSettings(draft="tiny-random", proposer="suffix").proposer == "suffix"


def test_vllm_cloud_sd_refuses_any_proposer_but_the_model() -> None:
    """vLLM's cloud-sd is its own draft-model speculation: a copying proposer cannot run there, and is not
    approximated by the model alone."""
    check_vllm_speculation(SpeculationRequest(5, "model"), draft_block=5)
    for proposer in PROPOSERS[1:]:
        with pytest.raises(CloudError) as refused:
            check_vllm_speculation(SpeculationRequest(5, proposer), draft_block=5)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "speculation.proposer" in str(refused.value)
    with pytest.raises(CloudError, match="speculation.block"):
        check_vllm_speculation(SpeculationRequest(4, "model"), draft_block=5)
