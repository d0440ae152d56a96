"""The engine, draft and local benches (`sprinter bench cloud|draft|local|prefill|prefix`) on their smallest
scenarios with the tiny-random presets (bench draft's llama.cpp config on SmolLM2-135M's GGUF): the rows and the
results.json each writes, never their timings.
bench cloud --random-weights is tests/test_devices.py's; bench llama-cpp's verify step tests/test_llama_cpp_engine.py's."""

from __future__ import annotations

import asyncio
import functools
import json
from pathlib import Path

import httpx
import pytest

from common.cli import main
from sim.bench.load import RequestOutcome, RequestSpec
from sim.bench.prompts import PROMPTS_FILE
from sim.bench.target_identity import check_target_identity

STAMP = {"date", "machine", "commit", "settings"}


def _results(out: Path) -> dict:
    results = json.loads((out / "results.json").read_text())
    assert STAMP <= set(results), results.keys()
    return results


def test_bench_cloud_replays_edges_against_a_cloud_process(tmp_path, capsys):
    assert main(["bench", "cloud", "--targets", "tiny-random", "--edges", "1,2", "--rounds", "2", "--k", "2",
                 "--batching", "on", "--out", str(tmp_path)]) == 0
    rows = _results(tmp_path)["rows"]
    assert [(r["target"], r["engine"], r["edges"], r["batching"], r["verify_calls"]) for r in rows] == [
        ("tiny-random", "resident", 1, True, 2), ("tiny-random", "resident", 2, True, 4)]
    assert "| tiny-random | resident | 0 | 2 | on |" in capsys.readouterr().out
    assert (tmp_path / "table.md").exists() and (tmp_path / "verified_tokens_per_s.png").exists()


@pytest.mark.parametrize(("argv", "said"), [(["--random-weights", "--cpus", "0"], "--cpus need a cloud process"),
                                            (["--accepted", "2"], "--accepted is for --random-weights")])
def test_bench_cloud_refuses_flags_of_the_other_path(tmp_path, capsys, argv, said):
    assert main(["bench", "cloud", *argv, "--out", str(tmp_path)]) == 2  # a usage error, the flags named
    assert said in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_bench_draft_times_a_runtime_and_probes_matmul_dtypes(tmp_path, capsys, monkeypatch):
    from sim.bench import draft

    monkeypatch.setattr(draft, "probe_matmul_dtypes", functools.partial(draft.probe_matmul_dtypes, 8, 64, 1))
    assert main(["bench", "draft", "--model", "tiny-random", "--configs", "torch-fp32", "--rounds", "1",
                 "--repeats", "1", "--prompt-tokens", "8", "--new-tokens", "4", "--out", str(tmp_path)]) == 0
    results = _results(tmp_path)
    assert [(r["config"], r["greedy_agreement"]) for r in results["summary"]] == [("torch-fp32", 1.0)]
    assert len(results["runs"][0]["tokens"]) == 4 and "float32" in results["matmul_dtype_probe_ms"]
    # torch batches: one step of 3 rows side by side is timed beside one row's
    summary = results["summary"][0]
    assert summary["side_step_ms"] > 0 and summary["side_over_one"] == pytest.approx(
        summary["side_step_ms"] / summary["ms_per_token"])
    assert "ONNX Runtime CPU MatMul" in capsys.readouterr().out


@pytest.mark.smollm2
def test_bench_draft_times_the_llama_cpp_draft_beside_torch(smollm2, tmp_path, monkeypatch):
    from common.model.llama_cpp_runtime import LlamaCppUnavailable, bindings
    from sim.bench import draft

    try:
        bindings()
    except LlamaCppUnavailable as missing:
        pytest.skip(str(missing))
    monkeypatch.setattr(draft, "probe_matmul_dtypes", functools.partial(draft.probe_matmul_dtypes, 8, 64, 1))
    assert main(["bench", "draft", "--model", "smollm2-135m", "--configs", "torch-fp32,llama.cpp", "--rounds", "1",
                 "--repeats", "1", "--prompt-tokens", "16", "--new-tokens", "4", "--threads", "1",
                 "--out", str(tmp_path)]) == 0
    summary = {r["config"]: r for r in _results(tmp_path)["summary"]}
    assert summary["llama.cpp"]["runtime"] == "llama.cpp" and summary["llama.cpp"]["ms_per_token"] > 0
    assert summary["llama.cpp"]["greedy_agreement"] is not None  # against torch-fp32's tokens


def test_bench_local_runs_every_mode_and_assisted_generation(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(PROMPTS_FILE.read_text().splitlines()[0] + "\n")
    assert main(["bench", "local", "--target", "tiny-random", "--draft", "tiny-random-draft", "--prompts",
                 str(prompts), "--max-new-tokens", "4", "--temperatures", "0", "--assisted", "hf-assisted-k5",
                 "--out", str(tmp_path / "out")]) == 0
    results = _results(tmp_path / "out")
    assert [r["method"] for r in results["summary"]] == ["target", "sd", "sd-block", "sprinter", "hf-assisted-k5"]
    lossless = [r for r in results["summary"] if r["method"] in ("target", "sd", "sd-block")]
    assert all(r["agreement_with_target"] == 1.0 for r in lossless)  # greedy identity of the lossless modes
    assert "| 0.000 | hf-assisted-k5 |" in capsys.readouterr().out


def test_bench_prefill_keeps_the_rows_of_other_labels(tmp_path, capsys):
    (tmp_path / "results.json").write_text(json.dumps({"rows": [{"label": "before"}, {"label": "after"}]}))
    assert main(["bench", "prefill", "--target", "tiny-random", "--dtype", "float32", "--sessions", "1",
                 "--prompt-tokens", "64", "--quiet-s", "0.2", "--label", "after", "--out", str(tmp_path)]) == 0
    rows = _results(tmp_path)["rows"]
    # Not `quiet_verifies > 0`: on a loaded machine the first verify can outlast the 0.2 s quiet window (CI-seen).
    assert [row["label"] for row in rows] == ["before", "after"] and rows[1]["quiet_verifies"] >= 0
    assert rows[1]["settings"]["label"] == "after" and "| after |" in capsys.readouterr().out


def test_bench_prefix_serves_a_second_turn_from_the_cache(tmp_path, capsys):
    assert main(["bench", "prefix", "--target", "tiny-random", "--dtype", "float32", "--history-tokens", "70",
                 "--answer-tokens", "2", "--new-tokens", "2", "--edges", "2", "--rounds", "1", "--system-tokens",
                 "64", "--choices", "2", "--kv-budget-mb", "64", "--out", str(tmp_path)]) == 0
    results = _results(tmp_path)
    assert results["turn2_cached_tokens"] == 64 and results["turn2_prompt_tokens"] == 74  # the history's whole page
    assert results["shared_over_budget"] == 0
    assert "| conversation: turn 2 prompt tokens cached | 64 of 74 |" in capsys.readouterr().out


def test_bench_prefix_refuses_a_count_below_one(capsys):
    assert main(["bench", "prefix", "--choices", "0"]) == 2
    assert "--choices must be >= 1" in capsys.readouterr().err


def _answering(token_ids: dict[str, list[int]]) -> httpx.AsyncClient:
    """An edge whose mode-target answer to a prompt is `token_ids[prompt]`."""
    def answer(request: httpx.Request) -> httpx.Response:
        prompt = json.loads(request.content)["prompt"]
        return httpx.Response(200, json={"choices": [{"text": "", "finish_reason": "length"}],
                                         "usage": {"prompt_tokens": 2, "completion_tokens": 3},
                                         "sprinter": {"degraded": False, "token_ids": token_ids[prompt]}})
    return httpx.AsyncClient(transport=httpx.MockTransport(answer))


def test_target_identity_holds_greedy_lossless_answers_to_the_target():
    specs = [RequestSpec(0, "a", False, "sd", 3, False), RequestSpec(1, "b", False, "sd-block", 3, False),
             RequestSpec(2, "a", False, "sprinter", 3, False), RequestSpec(3, "a", False, "sd", 3, False, 1.0)]
    outcomes = [RequestOutcome(s.index, s.mode, False, True, 200, None, 0.0, 0.1, None, 3, token_ids=ids)
                for s, ids in zip(specs, ([1, 2, 3], [4, 5, 0], [9, 9, 9], [9, 9, 9]))]

    async def check():
        async with _answering({"a": [1, 2, 3], "b": [4, 5, 6]}) as client:
            return await check_target_identity(client, "http://edge", specs, outcomes)

    identity = asyncio.run(check())
    # lossy sprinter and the sampled request are not held to it; request 1 differs from its reference
    assert (identity.checked, identity.mismatches, identity.references_failed) == (2, [1], 0)
