"""`sprinter generate`: one generation, with both models in this process or against a cloud service.

Without `--cloud` the local decoder runs draft and target here (the reference). With
`--cloud HOST:PORT` this process is an edge: it runs the draft (and verifier) and asks the cloud's
target to verify, exactly as the edge daemon does for each request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from common.arguments import DTYPE_NAMES, host_port_list
from common.spec.call_policy import POLICY_FORMS, parse_policy
from common.spec.modes import (DRAFT_DISTS, MODES, PIPELINES, PLACEMENTS, POLICY_MODES, PROPOSERS, DecodeSettings,
                                   parse_branch_tokens)
from common.model.devices import DeviceError, add_device_argument, resolve_device
from common.sampling.params import SamplingParams
from common.stats import DecodeStats
from edge.onnx_export.quantize import WEIGHT_FORMATS as DRAFT_WEIGHTS
from edge.runtime.draft_choice import DEFAULT_RUNTIME, EDGE_WEIGHTS, RUNTIMES


def add_decoding_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--k", type=int, default=5, help="block length of sd and sd-block")
    p.add_argument("--max-run-length", type=int, default=20,
                   help="cap on the pending block (sprinter modes, and sd modes under --policy)")
    p.add_argument("--verifier", default="auto",
                   help="sprinter modes and the call policy's acceptance estimates: 'auto' (the verifier shipped for this pair, else confidence:0.5), "
                        "'confidence:THRESHOLD', 'margin-logistic[:THRESHOLD]' (fitted online from the verdicts) or a learned "
                        "verifier's .json metadata file")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPE_NAMES)
    add_device_argument(p, "the local decoder's torch models run (not with --cloud: the edge's draft is ONNX)")


def add_companion_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--companion", metavar="SPEC",
                   help="a companion model (same tokenizer, draft-sized) for a learned verifier trained on its signals "
                        "(Speculative Verification); runs on torch, one extra forward per drafted token")


def policy_spec(spec: str) -> str:
    """argparse type of --policy: a bad spec is a usage error now, not a failure mid-request."""
    try:
        parse_policy(spec)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    return spec


def add_policy_argument(p: argparse.ArgumentParser, scope: str = "") -> None:
    p.add_argument("--policy", type=policy_spec, metavar="SPEC",
                   help=f"call policy{scope} of modes {', '.join(POLICY_MODES)}: when to send the pending block "
                        f"({' | '.join(POLICY_FORMS)}; 'flag' alone uses the verifier's threshold). "
                        "Default: fixed:K for sd modes, goodput for sprinter-exact")


def add_proposer_arguments(p: argparse.ArgumentParser, scope: str = "") -> None:
    p.add_argument("--proposer", default="model", choices=PROPOSERS,
                   help=f"what proposes the tokens a block sends{scope}: the draft model; suffix: text the "
                        "request (its prompt, its output so far) or this edge's earlier outputs hold where the "
                        "context matches it, each copied run ending its block, the draft model elsewhere; hybrid: "
                        "copies and the draft's tokens chained in one block, each position from the source the "
                        "target is likelier to keep. Lossless modes stay exact with each")
    p.add_argument("--suffix-cache", default="on", choices=["on", "off"],
                   help="with --proposer suffix or hybrid: also copy from this edge's earlier outputs (a bounded, least "
                        "recently used cache), or only from each request's own text")


def _branch_tokens(text: str) -> int | str:
    try:
        return parse_branch_tokens(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_branch_argument(p: argparse.ArgumentParser, scope: str = "") -> None:
    p.add_argument("--branch-tokens", type=_branch_tokens, default=0, metavar="N|auto",
                   help=f"draft a tree{scope}: up to N extra tokens a round, alternatives where the target is likeliest "
                        "to reject the draft's token, all verified in one call (modes sd-block and sprinter-exact; "
                        "auto: as many as the measured draft, verify and round-trip costs make worth it; 0: off). "
                        "Exact: the output stays the target's. A cloud that verifies chains only gets chains")


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not 0 < value <= 86400:
        raise argparse.ArgumentTypeError(f"expected seconds in (0, 86400], got {text}")
    return value


def _non_negative_mbps(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: unlimited), got {text}")
    return value


def add_cloud_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cloud", type=host_port_list, metavar="HOST:PORT", help="verify on this cloud service instead of a local target")
    p.add_argument("--cloud-ca", type=Path, help="PEM root certificate: speak TLS to the cloud")
    p.add_argument("--cloud-token", help="bearer token of this edge (or env SPRINTER_CLOUD_TOKEN); needs --cloud-ca")
    p.add_argument("--cloud-tls-server-name", metavar="NAME",
                   help="check the cloud's certificate against NAME instead of the host in --cloud")
    p.add_argument("--insecure", action="store_true",
                   help="allow --cloud-token without TLS (it travels in clear: only on a private link)")
    p.add_argument("--cloud-deadline-s", type=float, default=30.0,
                   help="longest wait for one verdict or one Generate token before the cloud counts as unavailable")
    p.add_argument("--request-deadline-s", type=_positive_seconds, metavar="S",
                   help="how long one request may wait for the cloud in all (a busy cloud is waited for; past this "
                        "the rest comes from the draft, degraded with reason 'deadline'). Default: no limit; a "
                        "request may set its own (request_deadline_s)")
    p.add_argument("--draft-runtime", default=DEFAULT_RUNTIME, choices=RUNTIMES,
                   help="with --cloud: the draft on ONNX Runtime, on llama.cpp (its GGUF as shipped; no side-by-side "
                        "tree branches) or on torch (the reference)")
    p.add_argument("--draft-weights", choices=DRAFT_WEIGHTS,
                   help=f"ONNX draft weights (default {EDGE_WEIGHTS}): int8 is about 2x faster than float32 on CPU, "
                        "int4 faster again with a slightly different draft, w8a8 (for CPUs) prefills faster and drafts "
                        "tree branches side by side more cheaply (docs/edge.md); lossless modes stay exact either way. "
                        "Not with --draft-runtime llama.cpp (the GGUF's own quantisation)")
    p.add_argument("--threads", type=int, help="the draft runtime's threads (ONNX Runtime's intra-op pool, "
                                                "llama.cpp's; default: all cores)")
    p.add_argument("--pipeline", default="off", choices=PIPELINES,
                   help="with --cloud, modes sd, sd-block and sprinter-exact: while a block is in flight draft the next one "
                        "for the likeliest verdict (ahead), or for the few likeliest and send them along (send-ahead); "
                        "lossless either way")
    p.add_argument("--placement", default="edge", choices=PLACEMENTS,
                   help="with --cloud: where modes sd, sd-block and sprinter-exact draft: on the edge, in the cloud "
                        "(mode cloud-sd, on a cloud served with --draft), or auto (per request, by predicted tokens/s "
                        "and the cloud's announced load)")
    p.add_argument("--uplink-mbps", type=_non_negative_mbps, default=0.0, metavar="MBPS",
                   help="the uplink's bandwidth, which placement auto charges a round's bytes against (0: unlimited)")
    p.add_argument("--draft-dists", default="full", choices=DRAFT_DISTS,
                   help="with --cloud under sampling, mode sd only: send every draft distribution the tokens were drawn "
                        "from (full), or only each token's draft probability, the cloud asking for what it needs at a "
                        "rejection, one more round trip there (on-rejection: ~30x less uplink; exact either way; "
                        "not with --pipeline send-ahead)")
    p.add_argument("--no-pipeline-adapt", dest="pipeline_adapts", action="store_false",
                   help="draft ahead every round, even while the measured hit rate says it does not pay "
                        "(by default a pipeline runs rounds as off then, probing now and then)")


def register(subcommands: argparse._SubParsersAction) -> None:
    p = subcommands.add_parser("generate", help="generate text in one of the decoding modes",
                               description="Generate text with a draft/target pair in one of the decoding modes.")
    p.add_argument("--target", default="tiny-random", help="preset, Hugging Face id or directory (':layers=N' truncates)")
    p.add_argument("--draft", default="tiny-random-draft", help="same forms as --target; must share its vocabulary")
    p.add_argument("--mode", default="sd", choices=MODES)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, mode and stats")
    add_decoding_arguments(p)
    add_proposer_arguments(p)
    add_branch_argument(p)
    add_companion_argument(p)
    add_policy_argument(p)
    add_cloud_arguments(p)
    p.set_defaults(run=run)


def decode_settings(args: argparse.Namespace) -> DecodeSettings:
    return DecodeSettings(mode=args.mode, max_new_tokens=args.max_new_tokens, k=args.k,
                          max_run_length=args.max_run_length, policy=args.policy, proposer=args.proposer,
                          branch_tokens=args.branch_tokens,
                          sampling=SamplingParams(args.temperature, args.top_k, args.top_p, args.seed))


def print_result(args: argparse.Namespace, text: str, token_ids: list[int], stats: DecodeStats, **extra: object) -> None:
    if args.json:
        print(json.dumps({"text": text, "token_ids": token_ids, "mode": args.mode, "stats": stats.to_dict(), **extra}))
        return
    print(text)
    calls = "-" if stats.tokens_per_call is None else f"{stats.tokens_per_call:.2f}"
    if stats.block_length_mean is not None:
        extra = {"block length mean": f"{stats.block_length_mean:.2f}", **extra}
    notes = "".join(f", {k} {v}" for k, v in extra.items())
    policy = f" {stats.policy}" if stats.policy else ""
    print(f"\n[{stats.mode}{policy}] {stats.new_tokens} tokens in {stats.wall_s:.2f} s ({stats.tokens_per_s:.1f} tok/s), "
          f"target calls {stats.target_calls} ({stats.target_calls_per_token:.3f} per token), "
          f"tokens per call {calls}{notes}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from common.spec.companion import companion_for
    from common.spec.local_decoder import LocalDecoder
    from common.spec.propose.suffix_proposer import suffix_memory
    from common.model.loading import DTYPES, load_model
    from common.model.prompting import encode_prompt
    from edge.runtime.verifier import load_verifier, shipped_suffix_priors

    try:
        settings = decode_settings(args)
    except ValueError as err:
        print(f"sprinter generate: {err}", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    if args.placement != "edge" and not args.cloud:
        print(f"sprinter generate: --placement {args.placement} needs --cloud (a cloud to draft in)", file=sys.stderr)
        return 2
    if args.cloud:
        if args.device != "auto":
            print("sprinter generate: --device is for the local decoder; with --cloud the target runs where the "
                  "cloud put it (sprinter cloud serve --device)", file=sys.stderr)
            return 2
        return asyncio.run(_run_on_cloud(args, settings))
    try:
        device = resolve_device(args.device)
    except DeviceError as err:
        print(f"sprinter generate: {err}", file=sys.stderr)
        return 2
    traits = settings.traits  # load the target if it takes part (uses_cloud: here, locally), the draft if it drafts
    target = load_model(args.target, dtype, device) if traits.uses_cloud else None
    draft = None
    if traits.drafts:
        draft = (target if args.draft == args.target and target is not None
                 else load_model(args.draft, dtype, device))
    model = target or draft
    verifier = load_verifier(args.verifier, model.tokenizer, args.draft, args.target, args.companion)
    make_companion = None
    if draft is not None and target is not None:  # the verifier runs in speculative modes only
        make_companion = companion_for(verifier, args.companion, draft, dtype, (target, draft))
    engine = LocalDecoder(target, draft, verifier, make_companion=make_companion,
                         suffix_memory=suffix_memory(args.suffix_cache == "on",
                                                     priors=shipped_suffix_priors(args.draft, args.target)))
    result = engine.generate(encode_prompt(model.tokenizer, args.prompt, args.chat), settings)
    print_result(args, result.text, result.token_ids, result.stats)
    return 0


_DEGRADED_BECAUSE = {
    "cloud_unreachable": "the cloud at --cloud is unreachable",
    "deadline": "--request-deadline-s passed while waiting for the cloud",
    "loading": "--request-deadline-s passed while the cloud at --cloud was still loading its model",
    "no_cloud": "no cloud is available",
}


def _say_degraded(reason: str) -> None:
    """Said at once, before the text: the rest of the output is the draft's alone, verified by no target."""
    print(f"sprinter generate: {_DEGRADED_BECAUSE.get(reason, reason)}; the output from here on is the draft's "
          f"alone, not verified (degraded: {reason})", file=sys.stderr, flush=True)


async def _run_on_cloud(args: argparse.Namespace, settings: DecodeSettings) -> int:
    from edge.decoding.decoder import EdgeSettings
    from common.model.prompting import encode_prompt
    from edge.decoding.placer import PlacementRefused
    from edge.node import EdgeNode, EdgeNodeSettings

    try:
        node_settings = EdgeNodeSettings.from_args(args)
    except ValueError as err:
        print(f"sprinter generate: {err}", file=sys.stderr)
        return 2
    try:
        edge_settings = EdgeSettings(decode=settings, pipeline=args.pipeline, request_deadline_s=args.request_deadline_s,
                                     pipeline_adapts=args.pipeline_adapts, draft_dists=args.draft_dists,
                                     placement=args.placement)
    except ValueError as err:
        print(f"sprinter generate: {err}", file=sys.stderr)
        return 2
    async with EdgeNode(node_settings) as node:
        prompt_ids = encode_prompt(node.draft.tokenizer, args.prompt, args.chat)
        try:
            result = await node.decoder.generate(prompt_ids, edge_settings, on_degraded=_say_degraded)
        except PlacementRefused as err:
            print(f"sprinter generate: --placement: {err}", file=sys.stderr)
            return 2
    extra = {"degraded": result.degraded_reason or False}
    if result.placed is not None and args.placement != "edge":
        extra["placement"] = result.placed.describe()
    if result.stats.ahead_rounds:
        extra["pipeline"] = f"{args.pipeline} (hit rate {result.stats.ahead_hit_rate:.2f})"
    print_result(args, result.text, result.token_ids, result.stats, **extra)
    return 0
