"""`sprinter generate`: one generation with both models in this process (the local engine)."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from common.local_engine import MODES, DecodeSettings, LocalEngine
from common.models import load_model
from common.sampling import SamplingParams
from common.verifier import parse_verifier

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def register(subcommands: argparse._SubParsersAction) -> None:
    p = subcommands.add_parser("generate", help="generate text in one of the decoding modes",
                               description="Generate text with a draft/target pair in one of the decoding modes.")
    p.add_argument("--target", default="tiny-random", help="preset, Hugging Face id or directory (':layers=N' truncates)")
    p.add_argument("--draft", default="tiny-random-draft", help="same forms as --target; must share its vocabulary")
    p.add_argument("--mode", default="sd", choices=MODES)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--k", type=int, default=5, help="block length of sd and sd-block")
    p.add_argument("--max-run-length", type=int, default=20, help="sprinter modes: cap on the pending block")
    p.add_argument("--verifier", default="confidence:0.5", help="sprinter modes: 'confidence:THRESHOLD'")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, mode, stats")
    p.set_defaults(run=run)


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return tokenizer(prompt)["input_ids"]


def run(args: argparse.Namespace) -> int:
    try:
        settings = DecodeSettings(
            mode=args.mode, max_new_tokens=args.max_new_tokens, k=args.k, max_run_length=args.max_run_length,
            sampling=SamplingParams(args.temperature, args.top_k, args.top_p, args.seed),
        )
        verifier = parse_verifier(args.verifier)
    except ValueError as err:
        print(f"sprinter generate: {err}", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    target = load_model(args.target, dtype) if args.mode != "draft" else None
    draft = None
    if args.mode != "target":
        draft = target if args.draft == args.target and target is not None else load_model(args.draft, dtype)
    engine = LocalEngine(target, draft, verifier)
    prompt_ids = encode_prompt((target or draft).tokenizer, args.prompt, args.chat)
    result = engine.generate(prompt_ids, settings)
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "mode": result.mode,
                          "stats": result.stats.to_dict()}))
    else:
        print(result.text)
        s = result.stats
        print(f"\n[{s.mode}] {s.new_tokens} tokens in {s.wall_s:.2f} s ({s.tokens_per_s:.1f} tok/s), "
              f"target calls {s.target_calls} ({s.target_calls_per_token:.3f} per token), "
              f"tokens per call {s.tokens_per_call if s.tokens_per_call is None else round(s.tokens_per_call, 2)}",
              file=sys.stderr)
    return 0
