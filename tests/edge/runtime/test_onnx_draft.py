"""The ONNX draft runtime against the torch reference: export, cache, logits, hidden states, rollback.

The tiny model exports into a temporary SPRINTER_CACHE (a few seconds); SmolLM2 uses the real cache,
so its export (about a minute) happens once per machine.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from common.model.cached_lm import CachedLM
from common.model.loading import LoadedModel
from edge.onnx_export import export as onnx_export
from edge.runtime.draft import exported_draft, load_draft_runtime
from edge.runtime.kv_slice import KvSlicer
from edge.runtime.onnx_draft import OnnxCachedLM, OnnxDraftModel
from edge.onnx_export.export import export_draft, model_fingerprint, read_export_info
from edge.onnx_export.quantize import INT4_RECIPE, INT4_RECIPE_VERSION, kept_at_int8
from edge.onnx_export.verify import (QUANTISED_CHECKS, DraftExportError, ExportCheck, check_quantised, greedy_agreement,
                                      verify_export)

GREEDY_STEPS = 32


def relative_error(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """Largest absolute difference over the largest reference magnitude: scale-free, so one tolerance fits all."""
    assert reference.shape == candidate.shape, (reference.shape, candidate.shape)
    return float((reference.float() - candidate.float()).abs().max() / reference.float().abs().max())


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sprinter-cache")


@pytest.fixture
def isolated_cache(tiny_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPRINTER_CACHE", str(tiny_cache))
    return tiny_cache


@pytest.fixture
def tiny_onnx(tiny_target: LoadedModel, isolated_cache: Path) -> Path:
    return export_draft(tiny_target)


def greedy_compare(loaded: LoadedModel, onnx_lm: OnnxCachedLM, prompt: list[int], tolerance: float) -> list[int]:
    """Decode greedily with both runtimes; every step's logits and hidden states must agree."""
    torch_lm = CachedLM(loaded.model, with_hidden=True)
    context = list(prompt)
    for step in range(GREEDY_STEPS):
        ref, got = torch_lm.advance_to(context), onnx_lm.advance_to(context)
        assert got.logits.dtype == torch.float32 and got.hidden is not None
        assert relative_error(ref.logits, got.logits) < tolerance, f"logits differ at step {step}"
        assert relative_error(ref.hidden, got.hidden) < tolerance, f"hidden states differ at step {step}"
        token = int(ref.logits[-1].argmax())
        assert int(got.logits[-1].argmax()) == token, f"greedy token differs at step {step}"
        context.append(token)
    assert onnx_lm.tokens == torch_lm.tokens == context[:-1]
    assert onnx_lm.forward_calls == torch_lm.forward_calls == GREEDY_STEPS
    return context[len(prompt):]


def rollback_compare(loaded: LoadedModel, onnx_lm: OnnxCachedLM, base: list[int], tolerance: float) -> None:
    """Long context, then a shorter one, then a divergent one: both runtimes and a cold start agree."""
    torch_lm = CachedLM(loaded.model, with_hidden=True)
    diverged = base[:-4] + [base[-1], base[-2], base[0]]
    for context, n_logits in ((base, 3), (base[:-5], 1), (diverged, 2), (diverged[:-1], 1)):
        ref, got = torch_lm.advance_to(context, n_logits), onnx_lm.advance_to(context, n_logits)
        assert onnx_lm.tokens == torch_lm.tokens == context
        assert got.logits.shape == ref.logits.shape == (n_logits, ref.logits.shape[-1])
        assert relative_error(ref.logits, got.logits) < tolerance
        assert relative_error(ref.hidden, got.hidden) < tolerance
    # A rolled-back cache must give what a cache that never saw the longer context gives.
    cold = OnnxCachedLM(onnx_lm.onnx_path, with_hidden=True)
    cold_out, warm_out = cold.advance_to(diverged), onnx_lm.advance_to(diverged)
    assert onnx_lm.forward_calls == 5 and cold.forward_calls == 1
    assert relative_error(cold_out.logits, warm_out.logits) < tolerance
    assert relative_error(cold_out.hidden, warm_out.hidden) < tolerance


# --- tiny random model: export, cache, agreement -------------------------------------------------


def test_export_layout_and_cache_location(tiny_target: LoadedModel, tiny_onnx: Path, isolated_cache: Path) -> None:
    assert tiny_onnx == isolated_cache / "onnx" / model_fingerprint(tiny_target.model) / "model.onnx"
    assert (tiny_onnx.parent / "model.onnx.data").exists()
    assert not [p for p in tiny_onnx.parent.parent.iterdir() if ".partial" in p.name]
    graph = onnx.load(str(tiny_onnx), load_external_data=False).graph
    n_layers = tiny_target.model.config.num_hidden_layers
    assert [i.name for i in graph.input] == onnx_export.input_names(n_layers)
    assert [o.name for o in graph.output] == onnx_export.output_names(n_layers)
    ops = {node.op_type for node in graph.node}  # the tiny model has grouped-query attention, as Qwen2.5 does
    assert "MultiHeadAttention" not in ops and "Expand" not in ops  # grouped MatMuls: no KV head is repeated
    past_dims = [d.dim_param or d.dim_value for d in graph.input[2].type.tensor_type.shape.dim]
    assert isinstance(past_dims[0], str) and isinstance(past_dims[2], str)  # batch and past length are symbolic
    info = read_export_info(tiny_onnx)
    assert info["dtype"] == "float32" and info["n_layers"] == n_layers and info["verify"]["logits"] < 1e-3


def test_second_export_reuses_cache(tiny_target: LoadedModel, tiny_onnx: Path, monkeypatch: pytest.MonkeyPatch,
                                    caplog: pytest.LogCaptureFixture) -> None:
    mtime = tiny_onnx.stat().st_mtime_ns

    def must_not_export(*_: object, **__: object) -> None:
        raise AssertionError("exported again although the cache holds this model")

    monkeypatch.setattr(onnx_export, "_export_to", must_not_export)
    with caplog.at_level(logging.INFO, logger="edge.onnx_export.export"):
        assert export_draft(tiny_target) == tiny_onnx
    assert tiny_onnx.stat().st_mtime_ns == mtime
    assert "cached at" in caplog.text


def test_fingerprint_follows_weights_and_config(tiny_target: LoadedModel) -> None:
    model = tiny_target.model
    assert model_fingerprint(model) == model_fingerprint(model)
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-3
    assert model_fingerprint(changed) != model_fingerprint(model)
    reconfigured = copy.deepcopy(model)
    reconfigured.config.rms_norm_eps = 1e-3
    assert model_fingerprint(reconfigured) != model_fingerprint(model)
    assert model_fingerprint(model, fuse=False) != model_fingerprint(model)


def test_bf16_and_float32_loads_share_one_export(tiny_target: LoadedModel, isolated_cache: Path) -> None:
    """A bf16 model exports as float32 and verifies against its float32 copy, not its bf16 self."""
    bf16 = copy.deepcopy(tiny_target.model).to(torch.bfloat16)
    widened = copy.deepcopy(bf16).float()  # float32 holding exactly the bf16 values
    assert model_fingerprint(bf16) == model_fingerprint(widened) != model_fingerprint(tiny_target.model)
    path = export_draft(LoadedModel("tiny-random-bf16", bf16, tiny_target.tokenizer))
    assert export_draft(LoadedModel("tiny-random-widened", widened, tiny_target.tokenizer)) == path
    assert read_export_info(path)["verify"]["logits"] < 1e-3


def test_tiny_greedy_logits_and_hidden_match_torch(tiny_target: LoadedModel, tiny_onnx: Path) -> None:
    onnx_lm = OnnxCachedLM(tiny_onnx, with_hidden=True)
    tokens = greedy_compare(tiny_target, onnx_lm, [5, 17, 99, 3, 42], tolerance=1e-4)
    assert len(set(tokens)) > 1  # a constant sequence would prove little


def test_tiny_rollback_matches_torch(tiny_target: LoadedModel, tiny_onnx: Path) -> None:
    rollback_compare(tiny_target, OnnxCachedLM(tiny_onnx, with_hidden=True), list(range(40, 72)), tolerance=1e-4)


def test_n_logits_semantics_match_torch(tiny_target: LoadedModel, tiny_onnx: Path) -> None:
    """More logits than fed tokens gives all fed positions, and 0 means all, as in CachedLM."""
    context = list(range(60, 70))
    for n_logits, rows in ((4, 4), (25, 10), (0, 10)):
        ref = CachedLM(tiny_target.model, with_hidden=True).advance_to(context, n_logits)
        got = OnnxCachedLM(tiny_onnx, with_hidden=True).advance_to(context, n_logits)
        assert got.logits.shape[0] == ref.logits.shape[0] == rows
        assert relative_error(ref.logits, got.logits) < 1e-4 and relative_error(ref.hidden, got.hidden) < 1e-4


def test_io_binding_path_matches_plain_run(tiny_onnx: Path) -> None:
    bound, plain = OnnxCachedLM(tiny_onnx, threads=1, io_binding=True), OnnxCachedLM(tiny_onnx, threads=1)
    assert bound.io_binding and not plain.io_binding  # CPU default: plain session.run
    for context in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9]):
        a, b = bound.advance_to(context, 2), plain.advance_to(context, 2)
        assert a.hidden is None and b.hidden is None
        assert torch.equal(a.logits, b.logits)


def test_verify_export_rejects_a_graph_of_other_weights(tiny_target: LoadedModel, tiny_onnx: Path) -> None:
    other = copy.deepcopy(tiny_target.model)
    with torch.no_grad():
        other.lm_head.weight.mul_(1.5)
    with pytest.raises(DraftExportError, match="disagrees"):
        verify_export(other, tiny_onnx)


def test_int8_weights_are_a_separate_close_export(tiny_target: LoadedModel, tiny_onnx: Path) -> None:
    path = export_draft(tiny_target, weights="int8")
    assert path.parent.name == tiny_onnx.parent.name + "-int8"
    ops = {node.op_type for node in onnx.load(str(path), load_external_data=False).graph.node}
    assert "MatMulNBits" in ops
    context = list(range(30, 50))
    ref = CachedLM(tiny_target.model).advance_to(context, 4)
    got = OnnxCachedLM(path).advance_to(context, 4)
    assert 0 < relative_error(ref.logits, got.logits) < 0.1  # lossy: int8 weights and activations


def _matmul_bits(path: Path) -> dict[str, int]:
    """MatMulNBits node name -> its bits attribute."""
    graph = onnx.load(str(path), load_external_data=False).graph
    return {node.name: next(a.i for a in node.attribute if a.name == "bits")
            for node in graph.node if node.op_type == "MatMulNBits"}


def test_int4_weights_are_a_separate_export_checked_by_agreement(tiny_target: LoadedModel, tiny_onnx: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # Random weights are far from a trained model's (tiny-random agrees ~0.5 at int4, see the next test): the check
    # is lowered here to see the recipe's parts; the refusal at the real bound is the next test.
    monkeypatch.setitem(QUANTISED_CHECKS, "int4", ExportCheck(min_agreement=0.4))
    path = export_draft(tiny_target, weights="int4")
    assert path.parent.name == tiny_onnx.parent.name + f"-int4-r{INT4_RECIPE_VERSION}"
    kept = set(kept_at_int8(onnx.load(str(tiny_onnx), load_external_data=False)))
    assert len(kept) == 3 * tiny_target.model.config.num_hidden_layers  # each layer's down, key and value
    bits = {name.rsplit("_Q", 1)[0]: b for name, b in _matmul_bits(path).items()}
    assert {name for name, b in bits.items() if b == 8} == kept and 4 in bits.values()  # the rest is int4
    info = read_export_info(path)
    assert info["weights"] == "int4" and info["recipe"] == INT4_RECIPE
    assert 0.4 <= info["verify"]["greedy_agreement"] <= 1 and info["verify"]["logits"] > 0
    context = list(range(30, 50))
    got = OnnxCachedLM(path).advance_to(context, 4).logits
    assert got.shape == CachedLM(tiny_target.model).advance_to(context, 4).logits.shape


def test_quantised_exports_are_refused_below_the_agreement_bound(tiny_target: LoadedModel, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPRINTER_CACHE", str(tmp_path))  # a cache of its own: the test above may have made an int4
    with pytest.raises(DraftExportError, match="int4 export disagrees with torch: greedy top-1 agreement"):
        export_draft(tiny_target, weights="int4")
    assert [p.name for p in (tmp_path / "onnx").iterdir() if not p.name.startswith(".")] == [
        export_draft(tiny_target).parent.name]  # the float32 source only: nothing was cached as int4
    # int8 agrees with torch; a graph whose every logit row moved to its neighbour does not.
    int8 = export_draft(tiny_target, weights="int8")
    assert greedy_agreement(tiny_target.model, tiny_target.tokenizer, int8) >= QUANTISED_CHECKS["int8"].min_agreement
    other = copy.deepcopy(tiny_target.model)
    with torch.no_grad():
        other.lm_head.weight.copy_(other.lm_head.weight.roll(1, dims=0))
    with pytest.raises(DraftExportError, match="greedy top-1 agreement"):
        check_quantised(other, tiny_target.tokenizer, int8, "int8")


def test_unknown_weights_are_refused_by_name(tiny_target: LoadedModel) -> None:
    with pytest.raises(ValueError, match="weights must be one of"):
        export_draft(tiny_target, weights="int3")


def test_load_draft_runtime_picks_runtime(tiny_target: LoadedModel, tiny_onnx: Path) -> None:
    assert isinstance(load_draft_runtime(tiny_target, "torch", with_hidden=True), CachedLM)
    onnx_lm = load_draft_runtime(tiny_target, "onnx", threads=1, with_hidden=True)
    assert isinstance(onnx_lm, OnnxCachedLM) and onnx_lm.onnx_path == tiny_onnx and onnx_lm.with_hidden
    assert onnx_lm.session.get_session_options().intra_op_num_threads == 1
    with pytest.raises(ValueError, match="unknown draft runtime"):
        load_draft_runtime(tiny_target, "tflite")


def test_caches_sharing_one_session_stay_independent(tiny_target: LoadedModel, tiny_onnx: Path) -> None:
    shared = exported_draft(tiny_target, threads=1)
    first, second = shared.new_lm(with_hidden=True), shared.new_lm()
    assert first.session is second.session
    a_context, b_context = list(range(10, 30)), list(range(90, 95))
    first.advance_to(a_context)
    b_out = second.advance_to(b_context)
    a_out = first.advance_to(a_context + [7])
    assert first.tokens == a_context + [7] and second.tokens == b_context
    torch_a = CachedLM(tiny_target.model).advance_to(a_context + [7])
    torch_b = CachedLM(tiny_target.model).advance_to(b_context)
    assert relative_error(torch_a.logits, a_out.logits) < 1e-4 and relative_error(torch_b.logits, b_out.logits) < 1e-4
    assert a_out.hidden is not None and b_out.hidden is None


# --- SmolLM2-135M in float32 (real cache: exported once per machine) -----------------------------


@pytest.fixture(scope="module")
def smollm2_onnx(smollm2: LoadedModel) -> Path:
    return export_draft(smollm2)


def test_smollm2_greedy_logits_and_hidden_match_torch(smollm2: LoadedModel, smollm2_onnx: Path) -> None:
    prompt = smollm2.tokenizer("def fibonacci(n: int) -> int:\n    ")["input_ids"]
    onnx_lm = OnnxCachedLM(smollm2_onnx, with_hidden=True)
    tokens = greedy_compare(smollm2, onnx_lm, prompt, tolerance=1e-3)
    assert len(set(tokens)) > 3


def test_smollm2_rollback_matches_torch(smollm2: LoadedModel, smollm2_onnx: Path) -> None:
    base = smollm2.tokenizer("The quick brown fox jumps over the lazy dog, and then it runs away.")["input_ids"]
    rollback_compare(smollm2, OnnxCachedLM(smollm2_onnx, with_hidden=True), base, tolerance=1e-3)


# --- rollback: the slice graph (CUDA's path, run here on CPU) and exactness -----------------------


def test_kv_slicer_cuts_ortvalues_exactly() -> None:
    past = [np.random.default_rng(i).standard_normal((1, 2, 9, 16), dtype=np.float32) for i in range(4)]
    slicer = KvSlicer(4, 2, 16, ["CPUExecutionProvider"], "cpu")
    values = [ort.OrtValue.ortvalue_from_numpy(p, "cpu") for p in past]
    for length in (0, 1, 5, 9):
        kept = slicer.bound(values, length)
        assert all(isinstance(k, ort.OrtValue) and k.device_name() == "cpu" for k in kept)
        assert all(np.array_equal(k.numpy(), p[:, :, :length]) for k, p in zip(kept, past))


def rejected_then_accepted(lm: OnnxCachedLM, prompt: list[int], drafted: list[int], kept: int) -> torch.Tensor:
    """A round of speculative decoding: draft one token a forward, keep `kept` of them plus a correction."""
    lm.advance_to(prompt)
    for i in range(1, len(drafted)):
        lm.advance_to(prompt + drafted[:i])
    return lm.advance_to(prompt + drafted[:kept] + [250]).logits


@pytest.mark.parametrize("io_binding", [False, True], ids=["numpy", "io-binding"])
def test_rolled_back_cache_gives_a_fresh_caches_logits(tiny_onnx: Path, io_binding: bool) -> None:
    """Rollback then advance must equal, bit for bit, a cache that never saw the rejected tokens."""
    model = OnnxDraftModel(tiny_onnx, threads=1, io_binding=io_binding)
    prompt, drafted = list(range(40, 70)), [7, 8, 9, 10, 11, 12]
    for kept in (0, 2, 5):
        rolled = model.new_lm()
        got = rejected_then_accepted(rolled, prompt, drafted, kept)
        assert rolled.forward_calls == len(drafted) + 1 and rolled.tokens == prompt + drafted[:kept] + [250]
        fresh = model.new_lm()
        fresh.advance_to(prompt)
        for i in range(1, kept + 1):  # the same forwards, less the rejected ones: same arithmetic, same bits
            fresh.advance_to(prompt + drafted[:i])
        assert torch.equal(got, fresh.advance_to(prompt + drafted[:kept] + [250]).logits)
        cold = model.new_lm().advance_to(prompt + drafted[:kept] + [250]).logits
        assert relative_error(cold, got) < 1e-5  # one forward over everything: another summation order


def test_io_binding_rolls_back_through_the_slice_graph(tiny_onnx: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With binding, the cache stays in OrtValues and never passes through numpy (what keeps CUDA's on the device)."""
    model = OnnxDraftModel(tiny_onnx, threads=1, io_binding=True)
    bound, plain = model.new_lm(), OnnxDraftModel(tiny_onnx, threads=1).new_lm()
    assert bound._slicer is model.slicer is not None and plain._slicer is None  # CPU default: numpy, no slicer
    prompt, drafted = list(range(10, 40)), [3, 4, 5, 6, 7]
    plain_logits = rejected_then_accepted(plain, prompt, drafted, 1)
    monkeypatch.setattr(np, "ascontiguousarray", lambda *_: pytest.fail("the bound cache went through numpy"))
    bound_logits = rejected_then_accepted(bound, prompt, drafted, 1)
    assert all(isinstance(p, ort.OrtValue) for p in bound._past)
    assert torch.equal(bound_logits, plain_logits)


@pytest.mark.parametrize("io_binding", [False, True], ids=["numpy", "io-binding"])
def test_branches_side_by_side_match_each_branch_alone(tiny_target: LoadedModel, tiny_onnx: Path,
                                                       io_binding: bool) -> None:
    """`advance_batch`: rows that share a prefix, grown in step, give each row's logits as torch's cache alone does;
    the cache keeps the prefix, and the next single forward goes on from it."""
    lm = OnnxDraftModel(tiny_onnx, threads=1, io_binding=io_binding).new_lm()
    prefix = list(range(30, 50))
    rows = [prefix + [7], prefix + [8], prefix + [9]]
    lm.advance_to(prefix + [1, 2])  # the chain, drafted past the branch point first
    for grown in ([], [11, 12, 13], [21, 22, 23]):
        rows = [row + [token] for row, token in zip(rows, grown)] if grown else rows
        got = lm.advance_batch(rows)
        assert got.shape == (3, tiny_target.model.config.vocab_size)
        for row, logits in zip(rows, got):
            assert relative_error(CachedLM(tiny_target.model).advance_to(row).logits[-1], logits) < 1e-4
    assert lm.tokens == prefix and lm.forward_calls == 1 + 1 + 3  # the chain, the prefix's refeed, three steps
    assert relative_error(CachedLM(tiny_target.model).advance_to(prefix + [4]).logits[-1],
                          lm.advance_to(prefix + [4]).logits[-1]) < 1e-4


@pytest.mark.parametrize("io_binding", [False, True], ids=["numpy", "io-binding"])
def test_branches_fed_several_tokens_at_once(tiny_target: LoadedModel, tiny_onnx: Path, io_binding: bool) -> None:
    """Rows that differ in more than their last token at the fork, then grow by two tokens a call: several new tokens
    over a past in several rows go through the causal bias of the grouped attention (edge/onnx_export/gqa.py)."""
    lm = OnnxDraftModel(tiny_onnx, threads=1, io_binding=io_binding).new_lm()
    prefix = list(range(30, 50))
    rows = [prefix + [7, 1, 2], prefix + [8, 3, 4], prefix + [9, 5, 6]]
    for grown in ([], [11, 12], [21, 22]):
        rows = [row + [token + i for token in grown] for i, row in enumerate(rows)]
        for row, logits in zip(rows, lm.advance_batch(rows)):
            assert relative_error(CachedLM(tiny_target.model).advance_to(row).logits[-1], logits) < 1e-4
    assert lm.tokens == prefix


def test_a_batched_step_is_each_row_alone_bit_for_bit(tiny_onnx: Path) -> None:
    """One step of 3 rows over a shared past gives each row exactly the logits and presents it gets alone."""
    lm = OnnxDraftModel(tiny_onnx, threads=1).new_lm()
    lm.advance_to(list(range(30, 60)))
    feed = lambda ids, past: lm._run(np.asarray(ids, dtype=np.int64), np.zeros(1, dtype=np.int64), past)  # noqa: E731
    logits, _, presents = feed([[7], [8], [9]], [np.repeat(p, 3, axis=0) for p in lm._past])
    for row, token in enumerate((7, 8, 9)):
        alone_logits, _, alone_presents = feed([[token]], lm._past)
        assert np.array_equal(alone_logits[0], logits[row])
        assert all(np.array_equal(a[0], p[row]) for a, p in zip(alone_presents, presents))
