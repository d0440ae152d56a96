"""The draft on llama.cpp (`--draft-runtime llama.cpp`) against the torch reference, on SmolLM2-135M's GGUF.

The torch preset is that GGUF dequantised, so both run the same weights; llama.cpp still rounds differently
(activations quantised to 8 bits for its quantised dot products, an f16 KV cache), so its argmax may differ
where torch's top two logits are close. Hence bounds, not equality, against torch; equality where only
llama.cpp runs (a rollback against a fresh context) and where the target decides (a lossless mode).
"""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
import torch

from common.cli import main
from common.errors import UsageError
from common.model.cached_lm import CachedLM
from common.model.llama_cpp_runtime import LlamaCppUnavailable, bindings
from common.model.loading import LoadedModel
from common.model.prompting import encode_prompt
from common.spec.local_decoder import LocalDecoder
from common.spec.modes import DecodeSettings
from common.spec.verifier import ConfidenceVerifier
from edge.decoding.decoder import EdgeDecoder, EdgeSettings
from edge.node import EdgeNodeSettings
from edge.runtime import llama_cpp_draft
from edge.runtime.draft import draft_lm_factory, llama_cpp_draft as load_gguf_draft, load_draft_runtime
from edge.runtime.draft_choice import DraftWeightsNotApplicable, runtime_label
from edge.runtime.draft_reuse import DraftKVCache

try:
    bindings()
except LlamaCppUnavailable as missing:
    if os.environ.get("SPRINTER_REQUIRE_LLAMA_CPP") == "1":
        raise RuntimeError(f"SPRINTER_REQUIRE_LLAMA_CPP=1 but {missing}") from missing
    pytest.skip(str(missing), allow_module_level=True)

pytestmark = pytest.mark.smollm2
PROMPT = "Write a Python function that reverses a string."


@pytest.fixture(scope="module")
def gguf(smollm2: LoadedModel) -> llama_cpp_draft.LlamaCppDraftModel:
    return load_gguf_draft(smollm2, threads=1)


@pytest.fixture(scope="module")
def prompt(smollm2: LoadedModel) -> list[int]:
    return encode_prompt(smollm2.tokenizer, PROMPT, chat=True)


def _torch_greedy(smollm2: LoadedModel, prompt: list[int], n: int) -> list[int]:
    lm, context = CachedLM(smollm2.model), list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            context.append(int(lm.advance_to(context).logits[-1].argmax()))
    return context


def test_argmax_agrees_with_torch_on_most_of_its_greedy_continuation(smollm2, gguf, prompt):
    # Teacher-forced on torch's own 32-token continuation, so that one differing near-tie does not send the
    # rest down another path. Measured: 31 of 32 (97%). Bound 85%: room for a few more near-ties elsewhere.
    context = _torch_greedy(smollm2, prompt, 32)
    n = len(context) - len(prompt)
    ours = gguf.new_lm().advance_to(context, n + 1).logits.argmax(-1)
    with torch.inference_mode():
        reference = CachedLM(smollm2.model).advance_to(context, n + 1).logits.argmax(-1)
    assert ours.shape == reference.shape == (n + 1,)
    assert (ours == reference).float().mean() >= 0.85


def test_hidden_states_are_torchs_last_layer(smollm2, gguf, prompt):
    # The final norm's output, as torch's hidden_states[-1]: measured cosine >= 0.9992 per token. Bound 0.99.
    out = gguf.new_lm(with_hidden=True).advance_to(prompt, 6)
    with torch.inference_mode():
        reference = CachedLM(smollm2.model, with_hidden=True).advance_to(prompt, 6)
    assert out.hidden.shape == reference.hidden.shape == (6, smollm2.model.config.hidden_size)
    assert out.logits.dtype == out.hidden.dtype == torch.float32 and out.logits.shape == (6, smollm2.vocab_size)
    assert torch.nn.functional.cosine_similarity(out.hidden, reference.hidden, dim=-1).min() > 0.99


def test_a_rollback_gives_a_fresh_contexts_rows(gguf, prompt):
    lm = gguf.new_lm(with_hidden=True)
    lm.advance_to(prompt + [28, 253, 906, 314, 9985], 3)
    other = prompt + [28, 253, 1303]  # shorter, and different after two of the drafted tokens
    rolled, fresh = lm.advance_to(other, 2), gguf.new_lm(with_hidden=True).advance_to(other, 2)
    assert lm.tokens == other and lm.forward_calls == 2
    assert rolled.logits.shape[0] == 1  # one token fed after the rollback: one row, as CachedLM gives
    # Measured: equal, though the kept cells were decoded in another batch than the fresh context's.
    assert torch.equal(rolled.logits, fresh.logits[-1:]) and torch.equal(rolled.hidden, fresh.hidden[-1:])
    again = lm.advance_to(other, 1)  # nothing new: the last token is fed again, its row the same
    assert torch.equal(again.logits, fresh.logits[-1:])


def test_a_context_outgrowing_its_cells_moves_to_a_larger_one(gguf, prompt, monkeypatch):
    monkeypatch.setattr(llama_cpp_draft, "FIRST_CELLS", 16)
    monkeypatch.setattr(llama_cpp_draft, "MAX_ROWS", 4)  # rows beyond it: several decodes
    lm = gguf.new_lm(with_hidden=True)
    lm.advance_to(prompt[:10])
    grown = lm.advance_to(prompt, 6)
    assert lm.cells == 1 << (len(prompt) - 1).bit_length() and lm.tokens == prompt
    monkeypatch.undo()
    fresh = gguf.new_lm(with_hidden=True).advance_to(prompt, 6)
    assert grown.logits.shape == fresh.logits.shape and grown.hidden.shape == fresh.hidden.shape
    # Rows decoded four at a time round a little differently from rows decoded together (llama.cpp's kernels
    # depend on the batch): same argmax, close rows.
    assert torch.equal(grown.logits.argmax(-1), fresh.logits.argmax(-1))
    assert torch.nn.functional.cosine_similarity(grown.hidden, fresh.hidden, dim=-1).min() > 0.999


def test_the_draft_cache_reuses_a_conversations_cells_and_changes_no_output(smollm2, prompt):
    greedy = EdgeSettings(DecodeSettings(mode="draft", max_new_tokens=12))
    cache = DraftKVCache(64 << 20)
    cold, warm = (EdgeDecoder(smollm2, draft_lm_factory(smollm2, "llama.cpp", threads=1, cache=with_cache),
                              ConfidenceVerifier(0.5), None) for with_cache in (None, cache))

    async def turns() -> None:
        first = await warm.generate(prompt, greedy)
        assert first.token_ids == (await cold.generate(prompt, greedy)).token_ids
        # The next turn extends the first: its prompt, the answer and a new message, all but the message reused.
        second_prompt = prompt + first.token_ids + smollm2.tokenizer(" And in C?")["input_ids"]
        second = await warm.generate(second_prompt, greedy)
        assert second.token_ids == (await cold.generate(second_prompt, greedy)).token_ids
        assert second.stats.draft_reused_tokens >= len(prompt) + len(first.token_ids) - 1
        half = await warm.generate(prompt[:len(prompt) // 2] + [28] * 8, greedy)  # a snapshot cut short
        assert half.stats.draft_reused_tokens == len(prompt) // 2
        assert half.token_ids == (await cold.generate(prompt[:len(prompt) // 2] + [28] * 8, greedy)).token_ids

    asyncio.run(turns())
    assert cache.hits == 2


def test_sd_block_with_the_llama_cpp_draft_is_the_targets_greedy_output(smollm2, prompt):
    settings = DecodeSettings(mode="sd-block", k=4, max_new_tokens=24)
    target = LocalDecoder(smollm2, None).generate(prompt, DecodeSettings(mode="target", max_new_tokens=24))
    draft_lms = draft_lm_factory(smollm2, "llama.cpp", threads=1)
    speculative = LocalDecoder(smollm2, smollm2, make_draft_lm=draft_lms).generate(prompt, settings)
    assert speculative.token_ids == target.token_ids
    assert speculative.stats.target_calls < len(target.token_ids)  # the draft was accepted, not just corrected


def test_the_runtime_is_picked_by_name_and_drafts_branches_one_after_another(smollm2):
    lm = load_draft_runtime(smollm2, "llama.cpp", threads=1)
    assert isinstance(lm, llama_cpp_draft.LlamaCppDraftLM)
    assert lm.batches is False and lm.reusable is True
    assert runtime_label("llama.cpp", None) == "llama.cpp"  # what verifier collect records as draft_runtime
    assert runtime_label("onnx", None) == "onnx-int8" and runtime_label("torch", None) == "torch"


def test_without_the_bindings_the_refusal_is_one_line_saying_how_to_get_them(smollm2, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if llama-cpp-python were not installed
    with pytest.raises(LlamaCppUnavailable, match="needs llama-cpp-python .*make llama-cpp") as refused:
        draft_lm_factory(smollm2, "llama.cpp")
    assert isinstance(refused.value, UsageError) and "\n" not in str(refused.value)


def test_a_weight_format_is_refused_with_llama_cpp(smollm2, capsys, tmp_path):
    with pytest.raises(DraftWeightsNotApplicable, match="GGUF's own quantisation"):
        EdgeNodeSettings(draft="smollm2-135m", draft_runtime="llama.cpp", draft_weights="int8")
    with pytest.raises(DraftWeightsNotApplicable):
        draft_lm_factory(smollm2, "llama.cpp", weights="float32")
    # Refused on the command line before anything loads or connects (port 9: nothing listens).
    assert main(["generate", "--cloud", "127.0.0.1:9", "--draft", "smollm2-135m", "--draft-runtime", "llama.cpp",
                 "--draft-weights", "int8", "--prompt", "hi"]) == 2
    assert "--draft-weights int8 does not apply to --draft-runtime llama.cpp" in capsys.readouterr().err
    assert main(["verifier", "collect", "--data", str(tmp_path), "--draft-runtime", "llama.cpp",
                 "--draft-weights", "float32"]) == 2  # before any model loads
    assert "--draft-weights float32 does not apply" in capsys.readouterr().err
