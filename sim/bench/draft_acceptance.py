"""bench draft-acceptance: what each draft weight format keeps of greedy speculation, judged by acceptance.

    sprinter bench draft-acceptance --weights int8,float32,int4,w8a8 --out results/bench-draft-acceptance

A quantised draft is a slightly different draft. What matters is how many tokens a call keeps, not how far its
logits move. The target greedily continues each prompt once (`--max-tokens` tokens, cached in OUT/targets.json).
Each draft then reads prompt and continuation in one forward (teacher forcing) and proposes its top-1 at every
position. Greedy speculative decoding with blocks of `--k` keeps, per call, the proposed tokens up to the first
miss and then the target's token. So the walk along the text gives exactly the calls a greedy run would make and
its tokens per call, with no cloud and no timing. Columns: top-1 agreement with the target, tokens per call, and
both against the first format listed, with a 95% interval from a paired bootstrap over prompts (every format is
scored on the same texts, so the prompts are resampled together): a few prompts differ by several percent from
chance alone, and an interval that spans -3% does not show a format within 3%. Writes `results.json` and `table.md`
to `--out`.
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass

import torch

from common.lab.prompt_sets import load_prompts
from common.model.cached_lm import CachedLM, greedy_continuation, top1_matches
from common.model.loading import LoadedModel, load_model
from common.model.prompting import encode_prompt
from sim.bench.proposer import chosen_prompts
from sim.bench.run_folder import RunFolder
from sim.bench.settings.engines import DraftAcceptanceBenchSettings
from sim.bench.settings.sweeps import SUITE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Continuation:
    prompt_id: str
    prompt_length: int
    tokens: list[int]  # the prompt's ids, then the target's greedy continuation


def calls_along(matches: list[bool], k: int) -> int:
    """Calls greedy speculation with blocks of `k` makes along a text whose positions the draft's top-1 matches
    (`matches`): each call keeps the matched run up to `k`, then the target's own token."""
    calls, position = 0, 0
    while position < len(matches):
        run = 0
        while run < k and position + run < len(matches) and matches[position + run]:
            run += 1
        calls += 1
        position += run + 1
    return calls


def target_continuations(settings: DraftAcceptanceBenchSettings, folder: RunFolder) -> list[Continuation]:
    """The target's greedy continuation of each chosen prompt, from OUT/targets.json when an earlier run made it."""
    cached = folder.out / "targets.json"
    if cached.exists():
        saved = json.loads(cached.read_text())
        if saved["key"] == _continuations_key(settings):
            return [Continuation(**c) for c in saved["continuations"]]
    records = chosen_prompts(load_prompts(settings.prompts or SUITE), (), settings.per_category,
                             settings.skip_per_category)
    target = load_model(settings.target, getattr(torch, settings.dtype))
    continuations = []
    for number, record in enumerate(records, start=1):
        ids = encode_prompt(target.tokenizer, record.prompt, record.chat)
        tokens = greedy_continuation(CachedLM(target.model), ids, settings.max_tokens)
        continuations.append(Continuation(record.id, len(ids), tokens))
        log.info("target continuation %d/%d (%s)", number, len(records), record.id)
    cached.write_text(json.dumps(dict(key=_continuations_key(settings),
                                      continuations=[c.__dict__ for c in continuations])))
    return continuations


def _continuations_key(settings: DraftAcceptanceBenchSettings) -> list:
    """What the target's continuations depend on: a saved file made under another key is made again."""
    return [settings.target, settings.dtype, str(settings.prompts or SUITE), settings.per_category,
            settings.skip_per_category, settings.max_tokens]


def score_weights(settings: DraftAcceptanceBenchSettings, loaded_draft: LoadedModel, weights: str,
                  continuations: list[Continuation]) -> dict:
    """One draft format's agreement and tokens per call over every continuation."""
    from edge.runtime.draft import load_draft_runtime

    draft = load_draft_runtime(loaded_draft, "onnx", weights=weights)
    matched = positions = 0
    calls_per_prompt = []
    for continuation in continuations:
        draft.reset()
        matches = top1_matches(draft, continuation.tokens, continuation.prompt_length)
        matched, positions = matched + sum(matches), positions + len(matches)
        calls_per_prompt.append(calls_along(matches, settings.k))
    calls = sum(calls_per_prompt)
    return dict(weights=weights, positions=positions, agreement=matched / positions, calls=calls,
                tokens_per_call=positions / calls, calls_per_prompt=calls_per_prompt)


def paired_interval(reference_calls: list[int], calls: list[int], draws: int = 2000,
                    seed: int = 0) -> tuple[float, float]:
    """95% interval of tokens per call against the reference's, minus 1 (-0.03: 3% fewer), from `draws` resamples
    of the prompts, the same for both (each prompt's text is the same, so the ratio is the reference's calls over
    these calls)."""
    rng = random.Random(seed)
    prompts = range(len(calls))
    ratios = []
    for _ in range(draws):
        chosen = rng.choices(prompts, k=len(calls))
        ratios.append(sum(reference_calls[i] for i in chosen) / sum(calls[i] for i in chosen) - 1)
    ratios.sort()
    return ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1]


def format_table(rows: list[dict]) -> str:
    first = rows[0]
    lines = [f"| draft weights | top-1 agreement with the target | tokens per call | vs {first['weights']} | "
             "95% interval (prompts resampled) |", "| --- | --- | --- | --- | --- |"]
    for row in rows:
        low, high = row["interval"]
        lines.append(f"| {row['weights']} | {row['agreement']:.3f} | {row['tokens_per_call']:.3f} | "
                     f"{row['tokens_per_call'] / first['tokens_per_call'] - 1:+.1%} | {low:+.1%} to {high:+.1%} |")
    return "\n".join(lines)


def bench_draft_acceptance(settings: DraftAcceptanceBenchSettings) -> str:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = RunFolder(settings.out)
    continuations = target_continuations(settings, folder)
    loaded_draft = load_model(settings.draft, torch.float32)  # once: every format's export is keyed by its weights
    rows = [score_weights(settings, loaded_draft, weights, continuations) for weights in settings.weights]
    for row in rows:
        row["interval"] = paired_interval(rows[0]["calls_per_prompt"], row["calls_per_prompt"])
    table = format_table(rows)
    headline = (f"{settings.draft} drafting for {settings.target} ({settings.dtype}), greedy, blocks of {settings.k}: "
                f"{len(continuations)} prompts x {settings.max_tokens} target tokens")
    folder.write_results(settings, summary=rows)
    folder.write_table(f"{headline}\n\n{table}")
    return f"{headline}\n\n{table}"
