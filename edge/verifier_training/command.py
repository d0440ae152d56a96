"""`sprinter verifier collect | train | eval | study | bound | replay | compare`: make a learned verifier for a pair, and measure it.

    sprinter verifier train --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --out verifiers/qwen
collects decoding data (resumable, in OUT/data unless --data says otherwise), trains the linear and
the MLP verifiers (with --companion SPEC also companion-mlp, on Speculative Verification's signals),
calibrates, and writes OUT/verifier.onnx + OUT/verifier.json (the edge's format), OUT/metrics.md and
OUT/reliability.png.
    sprinter verifier eval --target ... --draft ... --verifier OUT/verifier.json --out OUT/eval
decodes the held-out prompts with sprinter / sprinter-exact (learned vs confidence) and writes
eval.json, eval.md and tradeoff.png.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from common.arguments import DTYPE_NAMES, floats
from common.lab.results_page import add_page_arguments, publish_if_asked
from edge.onnx_export.quantize import WEIGHT_FORMATS
from edge.runtime.draft_choice import DEFAULT_RUNTIME, EDGE_WEIGHTS, RUNTIMES, runtime_label, runtime_weights

if TYPE_CHECKING:  # models load in the commands that run: `--help` imports no torch
    from common.model.cached_lm import DraftLM
    from common.model.loading import LoadedModel

log = logging.getLogger(__name__)


def register(subcommands: argparse._SubParsersAction) -> None:
    verifier = subcommands.add_parser("verifier", help="train and evaluate a learned SPRINTER verifier")
    commands = verifier.add_subparsers(dest="verifier_command", required=True)

    collect = commands.add_parser("collect", help="record decoding data for training (resumable)")
    _add_pair_arguments(collect), _add_collect_arguments(collect)
    collect.add_argument("--data", type=Path, required=True, help="directory for the shards")
    collect.set_defaults(run=run_collect)

    train = commands.add_parser("train", help="collect if needed, train, calibrate and export a verifier")
    _add_pair_arguments(train)
    _add_collect_arguments(train)
    train.add_argument("--data", type=Path, help="collected data (default OUT/data; collected or resumed there)")
    train.add_argument("--out", type=Path, required=True, help="directory for verifier.onnx and verifier.json")
    train.add_argument("--model", default="auto", choices=["auto", "linear", "mlp", "confidence-mlp", "context-mlp",
                                                             "companion-mlp"],
                       help="which verifier to export: linear (the paper's, on the hidden state), mlp (hidden state + "
                            "draft confidence), confidence-mlp (confidence only), context-mlp (confidence + top-2 margin + the previous "
                            "token's probability and entropy change), companion-mlp (confidence + companion "
                            "signals; needs --companion); auto: best ROC AUC on calibration prompts")
    train.add_argument("--label", default="auto", choices=["auto", "greedy", "paper", "soft"],
                       help="greedy: target argmax == draft token; paper: p_draft(x) <= p_target(x); soft: "
                            "min(1, p_target(x)/p_draft(x)), the acceptance probability (auto: greedy at T=0, else soft)")
    train.add_argument("--max-fpr", type=float, default=0.05, help="threshold: at most this false-positive rate on held-out prompts")
    train.add_argument("--epochs", type=int, default=40)
    train.add_argument("--hidden-units", type=int, default=32)
    train.set_defaults(run=run_train)

    study = commands.add_parser("study", help="learning curve (AUC vs training tokens) and free-feature ablation")
    study.add_argument("--data", type=Path, required=True, help="collected data (sprinter verifier collect)")
    study.add_argument("--out", type=Path, required=True, help="directory for study.json, study.md, learning_curve.png")
    study.add_argument("--label", default="auto", choices=["auto", "greedy", "paper", "soft"])
    study.add_argument("--epochs", type=int, default=40)
    study.add_argument("--seed", type=int, default=0)
    study.set_defaults(run=run_study)

    bound = commands.add_parser("bound", help="lossy sprinter at a quality bound: threshold chosen on calibration "
                                              "prompts, then calls per token vs sd on held-out prompts")
    _add_pair_arguments(bound)
    bound.add_argument("--verifier", type=Path, required=True, help="a learned verifier's verifier.json")
    bound.add_argument("--bound", default="agreement:0.95", help="agreement:A (greedy) or nll:R (NLL within R x the target's)")
    bound.add_argument("--out", type=Path, required=True)
    bound.add_argument("--limit", type=int, help="the first N calibration and N held-out prompts only")
    bound.add_argument("--max-new-tokens", type=int, default=48)
    bound.add_argument("--temperature", type=float, default=0.0)
    bound.set_defaults(run=run_bound)

    _add_replay(commands)
    _add_compare(commands)

    evaluate = commands.add_parser("eval", help="decode held-out prompts: learned verifier vs confidence baseline")
    _add_pair_arguments(evaluate)
    evaluate.add_argument("--verifier", type=Path, required=True, help="a learned verifier's verifier.json")
    evaluate.add_argument("--out", type=Path, required=True)
    evaluate.add_argument("--limit", type=int, help="evaluate on the first N held-out prompts only")
    evaluate.add_argument("--max-new-tokens", type=int, default=48)
    evaluate.add_argument("--temperature", type=float, default=0.0)
    evaluate.set_defaults(run=run_eval)
    for name in ("train", "study", "bound", "replay", "eval"):  # the measuring commands: their tables go into docs
        add_page_arguments(commands.choices[name], f"verifier-{name}")


def _add_replay(commands: argparse._SubParsersAction) -> None:
    replay = commands.add_parser("replay", help="call policies replayed on the held-out traces of collected data, "
                                                "against the hindsight and exact-probability oracles (no models)")
    replay.add_argument("--data", type=Path, required=True, help="the data the verifier was trained on")
    replay.add_argument("--verifier", type=Path, required=True, help="a learned verifier's verifier.json")
    replay.add_argument("--out", type=Path, required=True, help="directory for replay.json, replay.md, replay.png")
    replay.add_argument("--rtt-ms", type=floats, default="0,50,100,200", help="comma-separated round-trip times")
    replay.add_argument("--draft-ms", type=float, required=True, help="the edge's time per drafted token")
    replay.add_argument("--verify-ms", type=float, required=True, help="the cloud's verify time for an empty block")
    replay.add_argument("--verify-per-token-ms", type=float, required=True, help="the verify time each block token adds")
    replay.add_argument("--seeds", type=int, default=8, help="acceptance draws per trace")
    replay.add_argument("--limit", type=int, help="the first N held-out prompts (as `sprinter simulate --limit N` picks them)")
    replay.add_argument("--block", type=int, default=8, help="the margin-logistic estimator's training blocks, as "
                        "`verifier compare --block` (data decoded in one block per prompt is cut into blocks of this)")
    replay.set_defaults(run=run_replay)


def _add_compare(commands: argparse._SubParsersAction) -> None:
    compare = commands.add_parser("compare", help="a learned verifier against the margin-logistic estimator (fitted "
                                                  "online on the other prompts) on its held-out prompts (no models)")
    compare.add_argument("--data", type=Path, required=True, help="collected data holding the verifier's held-out prompts")
    compare.add_argument("--verifier", type=Path, required=True, help="a learned verifier's verifier.json")
    compare.add_argument("--out", type=Path, required=True, help="directory for compare.json, compare.md, calibration.png")
    compare.add_argument("--block", type=int, default=8,
                         help="block length cut from data decoded in one block per prompt (--segment 0); data collected "
                              "with --segment K keeps its own blocks")
    compare.add_argument("--label", default="auto", choices=["auto", "greedy", "paper", "soft"])
    compare.add_argument("--seed", type=int, default=0, help="the acceptance events drawn from soft labels")
    compare.set_defaults(run=run_compare)


def _add_pair_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="tiny-random")
    p.add_argument("--draft", default="tiny-random-draft")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPE_NAMES)
    p.add_argument("--prompts", type=Path, help="JSONL of prompts (default: the project's 320-prompt set)")
    p.add_argument("--draft-runtime", default=DEFAULT_RUNTIME, choices=RUNTIMES,
                   help="train on the hidden states of the runtime the edge will run")
    p.add_argument("--draft-weights", choices=WEIGHT_FORMATS,
                   help=f"ONNX draft weights (default {EDGE_WEIGHTS}); not with --draft-runtime llama.cpp")
    p.add_argument("--threads", type=int, help="the draft runtime's threads, ONNX Runtime's or llama.cpp's "
                                                "(default: every core)")


def _add_collect_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--limit", type=int, help="use N prompts only, taken from every category in turn")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens decoded per prompt")
    p.add_argument("--segment", type=int, default=0,
                   help="0: the target scores the draft's whole continuation in one forward; K: speculative "
                        "decoding with blocks of K (context follows the target's corrections)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, help="token budget: start no shard once the data holds this many "
                   "(grow it on a later run: finished shards are kept)")
    p.add_argument("--workers", type=int, default=1,
                   help="collect in N processes at once, each pinned to a core of its own when there are enough "
                        "(each loads both models: mind the memory)")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # set by --workers on the processes it starts
    p.add_argument("--companion", metavar="SPEC",
                   help="also record Speculative Verification's companion signals (S, A) from this model (same "
                        "tokenizer, draft-sized; torch runtime, one extra forward per drafted token)")


def _runtime_name(args: argparse.Namespace) -> str:
    """"onnx-int8", "torch", "llama.cpp": a --draft-weights llama.cpp cannot take is refused here, before any load."""
    return runtime_label(args.draft_runtime, args.draft_weights)


def _draft_lm_factory(draft: LoadedModel, args: argparse.Namespace) -> Callable[[bool], DraftLM]:
    """`with_hidden -> DraftLM` over the runtime the edge runs (one ONNX session shared by all caches)."""
    from edge.runtime.draft import draft_lm_factory  # ONNX Runtime loads only for the commands that draft

    return draft_lm_factory(draft, args.draft_runtime, args.threads,
                            runtime_weights(args.draft_runtime, args.draft_weights))


def _prompts(args: argparse.Namespace):
    from common.lab.prompt_sets import interleave_categories, load_prompts

    # One category in turn: a --limit or a --max-tokens budget that stops early still covers every category.
    prompts = interleave_categories(load_prompts(args.prompts))
    return prompts[: args.limit] if args.limit else prompts


def _collect(args: argparse.Namespace, data_dir: Path) -> None:
    if args.workers > 1 and args.worker is None:
        from edge.verifier_training.workers import run_workers

        run_workers(args.workers, data_dir, args.argv)
        return
    from common.spec.companion import companion_factory, load_companion
    from common.model.loading import DTYPES, load_pair
    from edge.verifier_training.collect import CollectSettings, collect, nothing_to_collect

    if args.worker is not None:  # one of --workers' processes: the target's forward keeps to its core too
        import torch

        torch.set_num_threads(args.threads or 1)
    settings = CollectSettings(max_new_tokens=args.max_new_tokens, segment=args.segment, temperature=args.temperature,
                               seed=args.seed, draft_runtime=_runtime_name(args), companion=args.companion)
    prompts = _prompts(args)
    if nothing_to_collect(data_dir, len(prompts), settings, args.max_tokens):
        log.info("%s: nothing left to collect", data_dir)  # and no models to load for it
        return
    target, draft = load_pair(args.target, args.draft, DTYPES[args.dtype])
    make_companion = None
    if args.companion:
        make_companion = companion_factory(load_companion(args.companion, draft, DTYPES[args.dtype], (target, draft)))
    new_draft_lm = _draft_lm_factory(draft, args)
    collect(target, draft, new_draft_lm, prompts, data_dir, settings, make_companion,
            args.max_tokens, (args.worker or 0, args.workers if args.worker is not None else 1))


def run_collect(args: argparse.Namespace) -> int:
    _collect(args, args.data)
    return 0


def run_train(args: argparse.Namespace) -> int:
    from edge.verifier_training.collect import load_dataset
    from edge.verifier_training.plots import plot_reliability
    from edge.verifier_training.train import TrainSettings, export, train

    data_dir = args.data or args.out / "data"
    _collect(args, data_dir)  # resumes: finished shards are kept
    if args.worker is not None:  # one of --workers' processes: it collects, the command that started it trains
        return 0
    dataset = load_dataset(data_dir)
    settings = TrainSettings(model=args.model, label=args.label, max_fpr=args.max_fpr, epochs=args.epochs,
                             hidden_units=args.hidden_units, seed=args.seed)
    report = train(dataset, settings)
    path = export(report, dataset, args.out)
    try:
        plot_reliability({kind: v.reliability for kind, v in report.verifiers.items()}, report.label,
                         args.out / "reliability.png")
    except ImportError:
        log.warning("matplotlib is not installed: no reliability plot (pip install 'sprinter[bench]')")
    chosen = (f"verifier: {path}  ({report.chosen.kind}, threshold {report.chosen.threshold:.4f} for FPR <= "
              f"{args.max_fpr:.0%} on held-out prompts; label {report.label})")
    print(f"{report.table()}\n\n{chosen}")
    publish_if_asked(args, f"{report.table()}\n\n{chosen}", (args.out / "reliability.png",))
    return 0


def run_study(args: argparse.Namespace) -> int:
    from edge.verifier_training.collect import load_dataset
    from edge.verifier_training.study import run_study as study
    from edge.verifier_training.train import TrainSettings

    table = study(load_dataset(args.data), TrainSettings(label=args.label, epochs=args.epochs, seed=args.seed), args.out)
    print(table)
    publish_if_asked(args, table, (args.out / "learning_curve.png",))
    return 0


def _prompts_of(learned, ids_key: str, args: argparse.Namespace) -> list:
    from common.lab.prompt_sets import interleave_categories, load_prompts

    wanted = set(learned.metadata["training"].get(ids_key, []))
    prompts = interleave_categories([p for p in load_prompts(args.prompts) if p.id in wanted])
    if not prompts:
        raise SystemExit(f"none of the verifier's {ids_key} are in {args.prompts or 'the default prompt set'} "
                         "(a verifier trained before they were recorded: train it again)")
    return prompts[: args.limit] if args.limit else prompts


def run_bound(args: argparse.Namespace) -> int:
    from common.model.loading import DTYPES, load_pair
    from edge.verifier_training.evaluate import EvalSettings
    from edge.verifier_training.quality_bound import QualityBound, run_bound as bound, write_report
    from edge.runtime.verifier import LearnedVerifier

    quality = QualityBound.parse(args.bound)
    learned = LearnedVerifier.load(args.verifier)
    calibration = _prompts_of(learned, "calibration_prompt_ids", args)
    held_out = _prompts_of(learned, "held_out_prompt_ids", args)
    target, draft = load_pair(args.target, args.draft, DTYPES[args.dtype])
    learned.check_pair(draft.tokenizer, args.draft, args.target)
    settings = EvalSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    report = bound(target, draft, _draft_lm_factory(draft, args), learned, calibration, held_out, settings, quality)
    write_report(report, args.out)
    print(report.tables())
    publish_if_asked(args, report.tables())
    return 0


def run_replay(args: argparse.Namespace) -> int:
    from edge.verifier_training.collect import load_dataset
    from edge.verifier_training.compare import CompareSettings, fitted_estimator, verdicts_of
    from edge.verifier_training.plots import plot_replay
    from edge.verifier_training.replay import ReplaySettings, RoundCosts, held_out_traces, replay, write_report
    from edge.runtime.verifier import LearnedVerifier

    learned, dataset = LearnedVerifier.load(args.verifier), load_dataset(args.data)
    estimator = None
    if "runner_up_prob" in dataset.arrays:  # the margin: vLLM's adaptive verification is replayed beside goodput
        fit = CompareSettings(block=args.block)
        estimator = fitted_estimator(verdicts_of(dataset, learned, fit), fit)
    else:
        log.warning("this data predates the runner-up probability: no margin-logistic policies (collect it again)")
    traces = held_out_traces(dataset, learned.metadata, learned.score_features, args.limit, estimator)
    costs = RoundCosts(args.draft_ms, args.verify_ms, args.verify_per_token_ms)
    settings = ReplaySettings(rtts_ms=args.rtt_ms, seeds=args.seeds)
    rows = replay(traces, costs, settings)
    table = write_report(rows, costs, settings, traces, args.out)
    print(table)
    plot_replay(rows, args.out / "replay.png")
    publish_if_asked(args, table, (args.out / "replay.png",))
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from common.model.loading import DTYPES, load_pair
    from common.lab.prompt_sets import interleave_categories, load_prompts
    from edge.verifier_training.evaluate import EvalSettings, evaluate, matched, table, to_dicts
    from edge.verifier_training.plots import plot_reliability, plot_tradeoff
    from edge.runtime.verifier import LearnedVerifier

    learned = LearnedVerifier.load(args.verifier)
    if learned.needs_companion:
        raise SystemExit("sprinter verifier eval does not run a companion model yet: evaluate companion verifiers "
                         "with sprinter generate --companion SPEC")
    held_out = set(learned.metadata["training"]["held_out_prompt_ids"])
    prompts = interleave_categories([p for p in load_prompts(args.prompts) if p.id in held_out])
    if not prompts:
        raise SystemExit(f"none of the verifier's held-out prompts are in {args.prompts or 'the default prompt set'}")
    prompts = prompts[: args.limit] if args.limit else prompts
    target, draft = load_pair(args.target, args.draft, DTYPES[args.dtype])
    learned.check_pair(draft.tokenizer, args.draft, args.target)
    settings = EvalSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    rows = evaluate(target, draft, _draft_lm_factory(draft, args), learned, prompts, settings)
    args.out.mkdir(parents=True, exist_ok=True)
    comparison = {q: matched(rows, "sprinter", q) for q in ("agreement_with_target", "target_nll_per_token")}
    (args.out / "eval.json").write_text(json.dumps({"prompts": len(prompts), "settings": asdict(settings), "rows": to_dicts(rows),
                                                    "matched": comparison}, indent=1, default=list))
    markdown = table(rows)
    (args.out / "eval.md").write_text(markdown + "\n")
    try:
        plot_tradeoff(rows, args.out / "tradeoff.png")
        plot_reliability({"learned": learned.metadata["reliability"]}, learned.metadata["label"],
                         args.out / "reliability.png")
    except ImportError:
        log.warning("matplotlib is not installed: no trade-off plot (pip install 'sprinter[bench]')")
    report = markdown + "\n\n" + _matched_lines(comparison)
    print(report)
    publish_if_asked(args, report, (args.out / "tradeoff.png",))
    return 0


def _matched_lines(comparison: dict[str, list[dict]]) -> str:
    lines = ["At matched target calls per token (confidence baseline interpolated on its threshold sweep):", ""]
    for quality, points in comparison.items():
        for p in points:
            baseline = p[f"confidence_{quality}"]
            lines.append(f"- {p['method']}: calls/token {p['target_calls_per_token']:.3f}, {quality} {p[quality]:.3f} "
                         f"vs confidence {'-' if baseline is None else format(baseline, '.3f')}")
    return "\n".join(lines)


def run_compare(args: argparse.Namespace) -> int:
    from edge.runtime.verifier import LearnedVerifier
    from edge.verifier_training.collect import load_dataset
    from edge.verifier_training.compare import CompareSettings, compare, table
    from edge.verifier_training.plots import plot_comparison

    result = compare(load_dataset(args.data), LearnedVerifier.load(args.verifier),
                     CompareSettings(block=args.block, label=args.label, seed=args.seed))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compare.json").write_text(json.dumps(result, indent=1))
    (args.out / "compare.md").write_text(table(result))
    try:
        plot_comparison(result, args.out / "calibration.png")
    except ImportError:
        log.warning("matplotlib is not installed: no calibration plot (pip install 'sprinter[bench]')")
    print(table(result))
    return 0
