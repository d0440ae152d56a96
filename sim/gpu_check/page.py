"""`sprinter gpu page`: what a `gpu check` brought back, as a section of docs/benchmarks/gpu.md (run here).

The section: the host, the goals with their values, the owed rows, the CUDA-graphs, prefix-cache and draft-tree
rows, the full table and its plot, the CUDA tests' outcome and the top kernels. Steps that did not run say so.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from common.lab.results_page import Measurement, publish
from sim.bench.engine import EngineRow, format_table, plot


def publish_results(results: Path, page: Path, section: str, command: str) -> None:
    """The section says the GPU host, the day and the commit the check ran on, and both commands."""
    plot_path = results / "verified_tokens_per_s.png"
    table = section_text(results, plot_path)
    summary, env = _read(results / "summary.json"), _read(results / "env.json") or {}
    where = (f"{env['gpu']}, {env.get('cpu_cores', '?')} CPU cores" if "gpu" in env else
             f"{env.get('cpu', 'an unknown CPU')} (dry run)")
    measured = Measurement(table=table, command=f"make gpu-check OUT={results}\n{command}",
                           plots=(plot_path,) if plot_path.exists() else (),
                           when=datetime.date.fromisoformat(summary["date"]), machine=where,
                           commit=env.get("commit") or "unknown")
    publish(page, section, measured)


def section_text(results: Path, plot_path: Path | None = None) -> str:
    summary, env = _read(results / "summary.json"), _read(results / "env.json")
    if summary is None:
        raise FileNotFoundError(f"no summary.json in {results}: is it the folder `sprinter gpu check --out` wrote?")
    parts = [_host(env, summary), _steps(summary)]
    owed = _read(results / "owed.json")
    if owed:
        parts += ["**The owed figures** (default layout on this device):", _goals(owed["goals"]),
                  format_table([EngineRow(**row) for row in owed["rows"]])]
    features = _read(results / "features.json") or {}
    if "graphs" in features:
        parts.append("**CUDA graphs**: " + _graphs(features["graphs"]))
    if "tiles" in features:
        parts.append(tiles_text(features["tiles"]))
    if "prefix" in features:
        parts.append("**The prefix cache**: " + _prefix(features["prefix"]))
    parts.append(tree_text(features.get("tree")))
    table = _read(results / "table.json")
    if table and table["rows"]:
        rows = [EngineRow(**row) for row in table["rows"]]
        parts += ["**The full table** (random weights; k = 5 draft tokens per verify):", format_table(rows)]
        if table["not_reached"]:
            parts.append(f"Not reached within the step's budget: {json.dumps(table['not_reached'])}")
        if plot_path is not None:
            plot(rows, plot_path)
    for name, title in (("pytest.txt", "tests/cloud/test_cuda.py"), ("profile.txt", "Top kernels of one batched verify forward")):
        if (results / name).exists():
            parts += [f"**{title}**:", "```text", _tail(results / name, name), "```"]
    return "\n\n".join(parts)


def _read(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def _host(env: dict | None, summary: dict) -> str:
    if env is None:
        return f"Device {summary['device']}: the environment step did not finish."
    where = f"{env['gpu']} ({env['gpu_memory_gb']} GB, compute {env['capability']})" if "gpu" in env else env["device"]
    return (f"Host: {where}; Python {env['python']} ({env['machine']}), torch {env['torch']} (CUDA {env['torch_cuda']}), "
            f"transformers {env['transformers']}; default layout {env['default_layout']}.")


def _steps(summary: dict) -> str:
    lines = ["| step | status | seconds | budget s |", "|---|---|---|---|"]
    lines += [f"| {s['step']} | {s['status']}{': ' + s['error'] if 'error' in s else ''} | {s['seconds']} | {s['budget_s']:.0f} |"
              for s in summary["steps"]]
    return "\n".join(lines)


def _goals(goals: list[dict]) -> str:
    lines = ["| goal | value | target | met |", "|---|---|---|---|"]
    lines += [f"| {g['goal']} | {g['value'] if g['value'] is not None else 'not measured'} | {g['relation']} {g['target']} "
              f"| {'yes' if g['met'] else 'no' if g['met'] is False else '-'} |" for g in goals]
    return "\n".join(lines)


def _graphs(graphs: dict) -> str:
    if not graphs["captured"]:
        return f"not captured: {graphs['reason']}"
    return (f"{graphs['target']}, {graphs['edges']} edges x {graphs['tokens']} tokens, context {graphs['context']}: "
            f"eager p50 {graphs['eager_p50_ms']} ms, graph replay p50 {graphs['graph_p50_ms']} ms "
            f"({graphs['graph_speedup']}x)")


def tiles_text(tiles: dict) -> str:
    """Query tiles per session on and off: a row per context (attention kernel ms per layer on a GPU only)."""
    lines = ["**Query tiles per session** (paged verify forward, tiles off / on; cloud/query_tiles.py):", "",
             "| target | edges x tokens | context | forward ms off | forward ms on | on / off | attention ms/layer off "
             "| attention ms/layer on | graph bucket (on) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in tiles["rows"]:
        lines.append(f"| {r['target']} | {r['edges']} x {r['tokens']} | {r['context']} | {r['tiles_off_forward_ms']} | "
                     f"{r['tiles_on_forward_ms']} | {r['tiled_over_untiled']}x | "
                     f"{r['tiles_off_attention_ms_per_layer'] or '-'} | {r['tiles_on_attention_ms_per_layer'] or '-'} | "
                     f"{r['tiles_on_graph_bucket']} |")
    if tiles["not_reached"]:
        lines.append(f"\nNot reached within the step's budget: {json.dumps(tiles['not_reached'])}")
    return "\n".join(lines)


def _prefix(row: dict) -> str:
    if "cold_open_ms" not in row:
        return "not reached within the step's budget"
    return (f"{row['target']}, {row['attention']} (pages of {row['page_tokens']}), a {row['context']}-token prompt: "
            f"opened cold in {row['cold_open_ms']} ms, from {row['cached_tokens']} cached tokens in "
            f"{row['cached_open_ms']} ms ({row['cached_over_cold']}x; median of {row['trials']})")


def tree_text(row: dict | None) -> str:
    """The tree step's table: ms per verify forward of each block shape, and the tree's rows against each path's."""
    title = "**A draft tree in the verify forward**"
    if row is None:
        return f"{title}: not measured yet (the run had no tree step, or it failed: see the steps above)."
    head = (f"{title} ({row['target']}, {row['attention']}, context {row['context']}; each block is the pending token "
            f"and the draft tokens; tree 16 = a chain of 6 with an alternative and its next token beside each of its "
            f"first 5; parents {row['tree_parents']}; median ms of {row['reps']}):")
    lines = ["| sessions | chain 6 ms | chain 16 ms | tree 16 ms | tree 16 / chain 6 | tree 16 / chain 16 |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['sessions']} | {r['chain6_ms']} | {r['chain16_ms']} | {r['tree16_ms']} | {r['tree16_over_chain6']}x "
              f"| {r['tree16_over_chain16']}x |" for r in row["rows"]]
    parts = [head, "\n".join(lines)]
    if row["not_reached"]:
        parts.append(f"Not reached within the step's budget: {json.dumps(row['not_reached'])}")
    if "check" in row:
        c = row["check"]
        parts.append(f"The tree's rows against a chain forward of each of its {c['paths']} paths ({c['sessions']} "
                     f"sessions batched, {c.get('dtype', 'the run dtype')}): max abs diff {c['max_abs_diff']:.2g} "
                     f"(logits up to {c['max_abs_logit']}; bound {c['atol']}: "
                     f"{'within' if c['within_tolerance'] else 'NOT within'}), argmax agreeing on "
                     f"{c['argmax_agree']:.1%} of rows.")
    return "\n\n".join(parts)


def _tail(path: Path, name: str) -> str:
    """pytest: its summary lines; the profile: the whole table (15 rows)."""
    lines = path.read_text().rstrip().splitlines()
    if name == "pytest.txt":
        lines = [line for line in lines if line.startswith(("PASSED", "FAILED", "SKIPPED", "ERROR"))] + lines[-2:]
    return "\n".join(lines)
