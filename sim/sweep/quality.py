"""Output quality of a sweep, judged after the processes stopped: the target loaded once, here.

Per result: target_nll_per_token (the target's mean NLL of the output), and under greedy decoding
agreement_with_target and exact_match against the target mode's output for the same prompt (at the
same RTT when there is one, else at any: greedy target output does not depend on the link).
NLLs are cached in OUT/quality.jsonl by (target, dtype, prompt, output), so identical outputs (the
lossless modes at T=0, every RTT) cost one forward and a resumed sweep none.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from common.spec.modes import mode_of
from common.model.loading import DTYPES, LoadedModel, load_model
from common.lab.prompt_sets import PromptRecord
from common.model.prompting import encode_prompt
from common.lab.quality import agreement, target_nll_per_token
from sim.sweep.results import ResultKey, result_key
from sim.sweep.settings import SimulateSettings, is_baseline

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Quality:
    target_nll_per_token: float | None
    agreement_with_target: float | None  # greedy only
    exact_match: bool | None  # greedy only: token for token the target mode's output


def output_ids(record: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The generated ids; a daemon that does not send them yet leaves us the text to tokenize."""
    if record.get("token_ids") is not None:
        return list(record["token_ids"])
    return list(tokenizer(record["text"], add_special_tokens=False)["input_ids"])


def _cache_key(settings: SimulateSettings, prompt_id: str, ids: list[int]) -> str:
    return hashlib.sha256(json.dumps([settings.target, settings.dtype, prompt_id, ids]).encode()).hexdigest()


def judge(settings: SimulateSettings, prompts: list[PromptRecord], records: list[dict[str, Any]],
          progress: bool = True) -> dict[ResultKey, Quality]:
    """Quality of every record, keyed like results.jsonl lines (rtt_ms, mode, pipeline, prompt_id)."""
    if not records:
        return {}
    target = load_model(settings.target, DTYPES[settings.dtype])
    by_id = {p.id: p for p in prompts}
    ids = {result_key(r): output_ids(r, target.tokenizer) for r in records}
    nll = _nlls(settings, target, by_id, records, ids, progress)
    at_rtt: dict[tuple[float, str], list[int]] = {}  # the target mode's output per (rtt, prompt)
    any_rtt: dict[str, list[int]] = {}
    for r in records:
        if not is_baseline(r["mode"]) and mode_of(r["mode"]).reference and not r["degraded"]:
            at_rtt[(r["rtt_ms"], r["prompt_id"])] = ids[result_key(r)]
            any_rtt.setdefault(r["prompt_id"], ids[result_key(r)])
    if settings.greedy and not any_rtt:
        log.warning("no target-mode outputs: agreement_with_target and exact match are not computed")
    quality = {}
    for r in records:
        key = result_key(r)
        reference = at_rtt.get((r["rtt_ms"], r["prompt_id"]), any_rtt.get(r["prompt_id"]))
        compare = settings.greedy and reference is not None
        quality[key] = Quality(nll.get(key), agreement(ids[key], reference) if compare else None,
                               ids[key] == reference if compare else None)
    return quality


def _nlls(settings: SimulateSettings, target: LoadedModel, by_id: dict[str, PromptRecord],
          records: list[dict[str, Any]], ids: dict[ResultKey, list[int]],
          progress: bool) -> dict[ResultKey, float]:
    cache_path = settings.out / "quality.jsonl"
    cache: dict[str, float] = {}
    if cache_path.exists():
        for line in cache_path.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                cache[entry["key"]] = entry["target_nll_per_token"]
    result = {}
    with open(cache_path, "a") as out:
        for r in tqdm(records, desc="target NLL", unit="output", disable=not progress):
            key = result_key(r)
            prompt = by_id.get(r["prompt_id"])
            if prompt is None:
                continue
            cache_key = _cache_key(settings, prompt.id, ids[key])
            if cache_key not in cache:
                prompt_ids = encode_prompt(target.tokenizer, prompt.prompt, prompt.chat)
                cache[cache_key] = target_nll_per_token(target, prompt_ids, ids[key])
                out.write(json.dumps({"key": cache_key, "target_nll_per_token": cache[cache_key]}) + "\n")
            result[key] = cache[cache_key]
    return result
