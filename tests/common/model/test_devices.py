"""The device seam on the CPU: --device resolution and refusals, bf16 batches, the in-process engine bench.

tests/cloud/test_cuda.py runs the same properties on a GPU where there is one.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from cloud.kv_pool import KVPool
from cloud.packed_forward import forward_packed, install
from cloud.resident_kv import KVLayout, ResidentKV
from cloud.settings import CloudSettings
from common.cli import main
from common.model.devices import DeviceError, resolve_device
from common.model.loading import load_model
from sim.bench.random_weights import architecture, architecture_names

NO_CUDA = not torch.cuda.is_available()


def test_auto_is_the_cpu_without_a_gpu_and_cpu_is_always_there():
    if NO_CUDA:
        assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a CUDA GPU")
@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_a_gpu_this_machine_lacks_is_refused_not_replaced(name):
    with pytest.raises(DeviceError, match="no CUDA GPU"):
        resolve_device(name)


@pytest.mark.parametrize("name", ["tpu", "gpu", "cuda:x"])
def test_a_device_that_is_not_one_is_refused_by_name(name):
    with pytest.raises(DeviceError, match=f"--device '{name}'"):
        resolve_device(name)


@pytest.mark.parametrize("settings, flag", [
    (dict(engine="vllm", device="cpu"), "--device"),
    (dict(engine="vllm", attention="paged"), "--attention"),
    (dict(attention="fused"), "--attention must be one of"),
])
def test_cloud_settings_refuse_what_does_not_apply(settings, flag):
    with pytest.raises(ValueError, match=flag):
        CloudSettings(**settings)


@pytest.mark.parametrize("attention, device_type, paged", [
    ("auto", "cpu", False), ("auto", "cuda", True), ("paged", "cpu", True), ("per-session", "cuda", False)])
def test_auto_attention_is_paged_on_cuda_only(attention, device_type, paged):
    assert CloudSettings(attention=attention).paged(device_type) is paged


def test_models_load_onto_the_device_asked_for():
    loaded = load_model("tiny-random", device=torch.device("cpu"))
    assert loaded.model.device == torch.device("cpu")


@pytest.mark.parametrize("kind", ["per-session", "paged"])
def test_bf16_batches_equal_the_sessions_alone_within_bf16(kind):
    """bf16 on the CPU: a GEMM over more rows rounds differently, so rows agree to bf16's precision."""
    model = load_model("tiny-random-wide", torch.bfloat16).model.to(torch.bfloat16)
    install(model)
    layout = KVLayout.of(model, page_tokens=8)
    pool = KVPool(layout, 64 * layout.bytes_per_page) if kind == "paged" else None
    rng = random.Random(2)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(n)] for n in (5, 12, 1)]
    blocks = [[rng.randrange(model.config.vocab_size) for _ in range(n)] for n in (4, 2, 6)]

    def cache() -> ResidentKV:
        return pool.session() if pool is not None else ResidentKV(layout)

    alone, batched = [], [cache() for _ in prompts]
    for prompt, block, batch_cache in zip(prompts, blocks, batched):
        own = cache()
        forward_packed(model, [own], [prompt], [1])
        alone.append(forward_packed(model, [own], [block], [len(block)])[0])
        forward_packed(model, [batch_cache], [prompt], [1])
    together = forward_packed(model, batched, blocks, [len(b) for b in blocks])
    for one, many in zip(alone, together):
        assert one.logits.dtype == torch.float32
        torch.testing.assert_close(many.logits, one.logits, atol=0.05, rtol=0.02)


def test_generate_runs_its_local_decoder_on_the_device_asked_for(capsys):
    assert main(["generate", "--target", "tiny-random", "--draft", "tiny-random-draft", "--mode", "sd-block",
                 "--device", "cpu", "--max-new-tokens", "8", "--prompt", "hello", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 8


def test_generate_refuses_device_with_cloud(capsys):
    assert main(["generate", "--cloud", "127.0.0.1:1", "--device", "cpu", "--prompt", "hi"]) == 2
    assert "--device is for the local decoder" in capsys.readouterr().err


@pytest.mark.parametrize("name", architecture_names())
def test_the_random_architectures_are_full_attention_decoders(name):
    """What the resident engine serves: every layer full attention (no sliding window), GQA shapes intact."""
    config = architecture(name)
    assert set(getattr(config, "layer_types", None) or ["full_attention"]) == {"full_attention"}
    assert config.num_attention_heads % config.num_key_value_heads == 0


def test_engine_bench_runs_in_process_on_the_cpu(tmp_path, capsys):
    """`bench cloud --random-weights`: both layouts, batching on and off, a table, JSON and a plot."""
    assert main(["bench", "cloud", "--random-weights", "--device", "cpu", "--targets", "smollm2-135m",
                 "--edges", "1,2", "--contexts", "16", "--rounds", "1", "--warmup", "0", "--k", "2",
                 "--accepted", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert {(r["attention"], r["edges"], r["batching"]) for r in rows} == {
        (a, e, b) for a in ("per-session", "paged") for e in (1, 2) for b in (True, False)}
    assert all(r["growth_per_round"] == 2.0 for r in rows)  # --accepted 1: one accepted token and the verdict's
    assert (tmp_path / "verified_tokens_per_s.png").exists() and "| smollm2-135m |" in capsys.readouterr().out


def test_engine_bench_refuses_cloud_process_flags(tmp_path, capsys):
    for argv, said in ((["--random-weights", "--source", str(tmp_path)], "--source"),
                       (["--accepted", "2"], "--accepted is for --random-weights")):
        assert main(["bench", "cloud", *argv, "--out", str(tmp_path)]) == 2  # a usage error, the flag named
        assert said in capsys.readouterr().err


def test_rows_without_logits_serve_greedy_and_refuse_sampling():
    """A forward that brought back the argmax alone cannot sample: it says so rather than fall back to greedy."""
    from cloud.engine import TargetRows
    from common.sampling.distributions import SamplingParams

    rows, generator = TargetRows(torch.tensor([5, 3]), None), torch.Generator().manual_seed(0)
    assert rows.next_token(SamplingParams(), generator) == 3
    with pytest.raises(ValueError, match="argmax only"):
        rows.next_token(SamplingParams(temperature=1.0), generator)
