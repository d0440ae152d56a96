"""bench draft: per-token latency of the edge's draft runtime, ONNX Runtime vs llama.cpp vs torch (float32, bf16).

    sprinter bench draft --model qwen2.5-coder-0.5b --out results/bench-draft

Each configuration greedily decodes `--new-tokens` tokens after a `--prompt-tokens` prompt, one
`advance_to` per token (what drafting does), `--repeats` times from an empty cache in each of
`--rounds` passes over all configurations; the score is the median of decode time / tokens over all
of them. Besides the default ONNX runtime it measures the levers that could matter on CPU: graph
optimisation level, ORT op fusions at export, IO binding, one thread, int8 weights (lossy: a
different draft, see "greedy agreement"), llama.cpp on the model's GGUF as shipped (its own quantisation:
a different draft too; needs a GGUF preset), plus a probe of float16/bfloat16 MatMul in ONNX Runtime's
CPU provider. Where a runtime batches (torch, ONNX), it also times one step of `--side-rows` rows side by side (a
tree's branches at one point, drafted as one batched step per token) against one row's. Writes `results.json` and
`table.md` to `--out`.

The host is shared: memory bandwidth drifts by tens of percent over minutes (rounds spread that over
all configs), and other work on the cores shows as `load avg` > 2 in the table (the bench itself
keeps two threads busy).
"""

from __future__ import annotations

import gc
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from common.model.cached_lm import CachedLM
from common.model.loading import LoadedModel, gguf_file, load_model
from edge.runtime.llama_cpp_draft import LlamaCppDraftLM, LlamaCppDraftModel
from edge.runtime.onnx_draft import OnnxCachedLM
from edge.onnx_export.export import export_draft
from edge.runtime.ort_sessions import available_cores
from sim.bench.prompts import PROMPTS_FILE, PROPOSER_PROMPTS_FILE, load_bench_prompts
from sim.bench.run_folder import RunFolder
from sim.bench.settings.engines import CONFIGS, Config, DraftBenchSettings

log = logging.getLogger(__name__)


BASELINE = "torch-fp32"  # greedy agreement is measured against its tokens
BASELINES = ("torch-fp32", "torch-bf16")


@dataclass
class Result:
    config: Config
    load_s: list[float] = field(default_factory=list)  # build the runtime (session creation for ONNX)
    prefill_ms: list[float] = field(default_factory=list)
    ms_per_token: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    load_average: list[float] = field(default_factory=list)  # 1-minute load when each round started
    side_step_ms: list[float] = field(default_factory=list)  # one step of `side_rows` rows side by side

    def summary(self, reference: list[int] | None) -> dict:
        agree = None if reference is None else sum(a == b for a, b in zip(self.tokens, reference)) / len(reference)
        step = statistics.median(self.ms_per_token)
        side = statistics.median(self.side_step_ms) if self.side_step_ms else None
        return dict(config=self.config.name, runtime=self.config.runtime, ms_per_token=step,
                    ms_per_token_min=min(self.ms_per_token), prefill_ms=statistics.median(self.prefill_ms),
                    load_s=round(statistics.median(self.load_s), 2), greedy_agreement=agree,
                    load_average=round(max(self.load_average), 2), side_step_ms=side,
                    side_over_one=None if side is None else side / step)


def bench_prompt(loaded: LoadedModel, n_tokens: int) -> list[int]:
    """The first `n_tokens` tokens of the bench prompts, concatenated (code first, as drafting sees it), then of the
    proposer suite's (the bench prompts alone hold about 100 tokens)."""
    texts = [prompt["prompt"] for path in (PROMPTS_FILE, PROPOSER_PROMPTS_FILE) for prompt in load_bench_prompts(path)]
    ids = loaded.tokenizer("\n".join(texts))["input_ids"]
    if len(ids) < n_tokens:
        raise ValueError(f"the bench prompts hold only {len(ids)} tokens")
    return ids[:n_tokens]


def greedy_decode(runtime: CachedLM | OnnxCachedLM | LlamaCppDraftLM, prompt: list[int],
                  n_new: int) -> tuple[float, float, list[int]]:
    """Prefill, then `n_new` one-token steps. Returns (prefill ms, decode ms per token, new tokens)."""
    t0 = time.perf_counter()
    out = runtime.advance_to(prompt)
    t1 = time.perf_counter()
    context = list(prompt)
    for _ in range(n_new):
        context.append(int(out.logits[-1].argmax()))
        out = runtime.advance_to(context)
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3 / n_new, context[len(prompt):]


def side_by_side_step(runtime: CachedLM | OnnxCachedLM, prompt: list[int], rows: int, steps: int) -> float:
    """ms of one batched draft step of `rows` rows (a tree's branches at one point after `prompt`), median of `steps`
    steps grown in step, after the step that forks the rows."""
    contexts = [list(prompt) + [token] for token in range(1, rows + 1)]
    runtime.advance_batch(contexts)  # forks the prompt's KV into the rows: not a step of the kind timed
    times = []
    for token in range(steps):
        contexts = [c + [token] for c in contexts]
        t0 = time.perf_counter()
        runtime.advance_batch(contexts)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def export_all(spec: str, configs: list[Config]) -> dict[tuple[bool, str], Path]:
    """Every ONNX file the configs need, exported now so that no export lands inside a timing."""
    variants = sorted({(c.fuse, c.weights) for c in configs if c.runtime == "onnx"})
    if not variants:
        return {}
    loaded = load_model(spec, torch.float32)
    return {(fuse, weights): export_draft(loaded, fuse=fuse, weights=weights) for fuse, weights in variants}


def make_runtime(config: Config, spec: str, threads: int, paths: dict[tuple[bool, str], Path]
                 ) -> tuple[Callable[[], CachedLM | OnnxCachedLM | LlamaCppDraftLM], float]:
    """A factory of fresh (empty-cache) runtimes for `config`, and how long building it took."""
    t0 = time.perf_counter()
    if config.runtime == "torch":
        torch.set_num_threads(config.threads or threads)
        model = load_model(spec, getattr(torch, config.dtype)).model
        factory = lambda: CachedLM(model)  # noqa: E731
    elif config.runtime == "llama.cpp":  # the edge's way: weights loaded once, a context per LM
        gguf_model = LlamaCppDraftModel(gguf_file(spec), threads=config.threads or threads)
        factory = gguf_model.new_lm
    else:
        session_lm = OnnxCachedLM(paths[config.fuse, config.weights], threads=config.threads or threads,
                                  optimization=config.optimization, io_binding=config.io_binding)

        def factory() -> OnnxCachedLM:
            session_lm.reset()  # reuse the session: building one costs seconds and changes nothing measured
            return session_lm
    return factory, time.perf_counter() - t0


def run_config(config: Config, result: Result, prompt: list[int], settings: DraftBenchSettings,
               paths: dict[tuple[bool, str], Path]) -> None:
    """One round of `config`: build its runtime, warm up, then `repeats` timed decodes into `result`."""
    result.load_average.append(os.getloadavg()[0])
    factory, load_s = make_runtime(config, settings.model, settings.threads, paths)
    result.load_s.append(load_s)
    greedy_decode(factory(), prompt[:8], 4)  # warm-up: first runs pay for allocation and kernel choice
    times = []
    for _ in range(settings.repeats):
        prefill_ms, ms_per_token, tokens = greedy_decode(factory(), prompt, settings.new_tokens)
        result.prefill_ms.append(prefill_ms)
        times.append(ms_per_token)
        result.tokens = tokens
    result.ms_per_token.extend(times)
    runtime = factory()
    if settings.side_rows > 1 and runtime.batches:
        result.side_step_ms.append(side_by_side_step(runtime, prompt, settings.side_rows, settings.new_tokens))
    log.info("%s: %s ms/token", config.name, ", ".join(f"{x:.1f}" for x in times))


def probe_matmul_dtypes(rows: int = 896, cols: int = 65536, runs: int = 30) -> dict[str, float | str]:
    """ms of one [1, rows] x [rows, cols] MatMul per dtype in ORT's CPU provider ("unsupported" if none).

    A draft step is weight-bandwidth bound, so half-size weights would only help if the CPU kernels
    ran at memory speed on them. The weight (235 MB in float32) is larger than the last-level cache,
    as a draft model's weights are.
    """
    import ml_dtypes
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    out: dict[str, float | str] = {}
    for name, onnx_type, np_type in (("float32", TensorProto.FLOAT, np.float32), ("float16", TensorProto.FLOAT16, np.float16),
                                     ("bfloat16", TensorProto.BFLOAT16, ml_dtypes.bfloat16)):
        weight = numpy_helper.from_array((np.random.randn(rows, cols) * 0.02).astype(np_type), "W")
        graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "probe",
                                  [helper.make_tensor_value_info("x", onnx_type, [1, rows])],
                                  [helper.make_tensor_value_info("y", onnx_type, [1, cols])], [weight])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
        x = np.random.randn(1, rows).astype(np_type)
        try:
            session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
            session.run(None, {"x": x})
        except Exception as error:  # noqa: BLE001 - ORT raises its own types; any failure means "not usable"
            out[name] = f"unsupported ({type(error).__name__})"
            continue
        t0 = time.perf_counter()
        for _ in range(runs):
            session.run(None, {"x": x})
        out[name] = round((time.perf_counter() - t0) / runs * 1e3, 3)
    return out


def format_table(rows: list[dict]) -> str:
    """Markdown table; speedups against both torch baselines (bf16 is the faster one on CPUs with bf16 units)."""
    base = {r["config"]: r["ms_per_token"] for r in rows if r["runtime"] == "torch"}
    names = [name for name in BASELINES if name in base]
    lines = ["| config | ms/token (median) | min | " + "".join(f"vs {n} | " for n in names)
             + "prefill ms | greedy agreement | side-by-side step / one row | load s | load avg |",
             "|---|---|---|" + "---|" * len(names) + "---|---|---|---|---|"]
    for r in rows:
        speedups = "".join(f"{base[n] / r['ms_per_token']:.2f}x | " for n in names)
        agree = "-" if r["greedy_agreement"] is None else f"{r['greedy_agreement']:.0%}"
        side = "-" if r["side_over_one"] is None else f"{r['side_step_ms']:.3g} ms, {r['side_over_one']:.2f}x"
        lines.append(f"| {r['config']} | {r['ms_per_token']:.3g} | {r['ms_per_token_min']:.3g} | {speedups}"
                     f"{r['prefill_ms']:.0f} | {agree} | {side} | {r['load_s']:.1f} | {r['load_average']:.1f} |")
    return "\n".join(lines)


def measure(settings: DraftBenchSettings, chosen: list[Config], prompt: list[int],
            paths: dict[tuple[bool, str], Path]) -> list[Result]:
    results = {c.name: Result(c) for c in chosen}
    # Rounds over all configs rather than all repeats of one config in a row: memory bandwidth on a
    # shared host drifts over minutes, and rounds spread that drift over every config alike.
    for round_index in range(settings.rounds):
        log.info("round %d/%d", round_index + 1, settings.rounds)
        for config in chosen:
            run_config(config, results[config.name], prompt, settings, paths)
            gc.collect()  # free this runtime's weights before the next one loads its own
    return list(results.values())


@torch.no_grad()  # not torch.set_grad_enabled(False): that outlived the bench in its process (a test after it broke)
def bench_draft(settings: DraftBenchSettings) -> str:
    """Every chosen config, `rounds` times; writes OUT; returns the table and the MatMul dtype probe's line."""
    import onnxruntime as ort

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    settings = replace(settings, threads=settings.threads or available_cores())
    chosen = [c for c in CONFIGS if c.name in settings.configs]
    prompt = bench_prompt(load_model(settings.model, torch.bfloat16), settings.prompt_tokens)
    paths = export_all(settings.model, chosen)
    gc.collect()
    load_before = os.getloadavg()
    if load_before[0] > 0.5:
        log.warning("load average %.1f before the run: other processes share the cores, timings will be noisy",
                    load_before[0])
    results = measure(settings, chosen, prompt, paths)
    reference = next((r.tokens for r in results if r.config.name == BASELINE), None)
    rows = [r.summary(reference) for r in results]
    table = format_table(rows)
    probe = probe_matmul_dtypes()
    folder = RunFolder(settings.out)
    folder.write_results(
        settings, torch=torch.__version__, onnxruntime=ort.__version__,
        load_average={"before": load_before, "after": os.getloadavg()}, summary=rows, matmul_dtype_probe_ms=probe,
        runs=[dict(asdict(r.config), load_s=r.load_s, prefill_ms=r.prefill_ms, ms_per_token=r.ms_per_token,
                   side_step_ms=r.side_step_ms, load_average=r.load_average, tokens=r.tokens) for r in results])
    folder.write_table(table)
    return f"{table}\n\nONNX Runtime CPU MatMul [1,896]x[896,65536] ms by dtype: {probe}"
