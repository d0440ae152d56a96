"""Training data for the SPRINTER verifier, recorded on the pair's own decoding path.

For every prompt the draft decodes a continuation, recording per token its last hidden state and
its confidence features, and the target scores drafted tokens in as few forwards as possible:
    segment = 0 (default): the draft writes the whole continuation and the target scores it in ONE
        forward (teacher forcing). Labels after the first rejection are judged on a prefix holding
        a draft mistake, which is what sprinter's own contexts look like (its passed tokens are
        never corrected); they are marked `on_path` False.
    segment = K: lossless speculative decoding with blocks of K: one target forward per block, the
        context moves on with the accepted tokens plus the target's correction (the paper's
        procedure, "extend with the draft token if accepted, else the target's token", with the
        target's work batched). Costs a target forward per K drafted tokens.

Per drafted token x the shards hold everything any label needs:
    hidden [n, H] float16, confidence [n, 3] (token_prob, max_prob, entropy of the draft at T=1),
    runner_up_prob [n]: the draft's second-highest probability at T=1 (with max_prob, the top-2 margin),
    p_draft / p_target: both models' probability of x under the sampling settings,
    target_argmax_match: the target's greedy choice is x (the greedy label),
    on_path, position, block_position (x's index in its block: the position a per-position verifier reads), prompt_index;
(the draft's top-1 minus top-2 logit margin is log(max_prob / runner_up_prob): no column of its own);
    companion [n, 2] (S, A of common/spec/companion.py), only when a companion ran (`--companion SPEC`).
Shards of `shard_size` prompts are written atomically; a rerun skips the finished ones (resume).
A token budget (`max_tokens`, checked before each shard) stops early; `worker=(i, n)` collects every
n-th shard from the i-th, so that n processes fill one directory together.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from common.atomic_files import written_aside
from common.model.cached_lm import CachedLM, DraftLM
from common.spec.companion import Companion
from common.spec.propose.drafting import model_drafter
from common.spec.propose.proposals import PendingBlock
from common.spec.generation import Generation
from common.spec.modes import DecodeSettings
from common.spec.speculative_round import LocalTarget, Verdict, run_inline, speculative_round
from common.model.loading import LoadedModel, vocab_fingerprint
from common.lab.prompt_sets import PromptRecord
from common.model.prompting import encode_prompt
from common.sampling.distributions import SamplingParams
from common.stats import StatsRecorder
from common.spec.acceptance_rules import GREEDY
from common.spec.verifier import draft_confidence_features

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
DATA_FORMAT = "sprinter-verifier-data/1"


@dataclass(frozen=True)
class CollectSettings:
    max_new_tokens: int = 48  # per prompt
    segment: int = 0  # draft tokens per target forward; 0: the whole continuation in one forward
    temperature: float = 0.0
    seed: int = 0
    shard_size: int = 16  # prompts per shard: the unit of resumption
    draft_runtime: str = "onnx-int8"  # recorded: hidden states depend on the runtime that made them
    companion: str | None = None  # the companion model's spec, when its signals are recorded

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.segment < 0 or self.shard_size < 1:
            raise ValueError("max_new_tokens and shard_size must be >= 1, segment >= 0")


@dataclass(frozen=True)
class TokenRecord:
    hidden: np.ndarray
    confidence: tuple[float, float, float]
    p_draft: float
    p_target: float
    runner_up_prob: float
    target_argmax_match: bool
    on_path: bool
    position: int
    block_position: int = 0
    companion: tuple[float, float] | None = None


def decode_and_record(target_lm: CachedLM, draft_lm: DraftLM, prompt_ids: list[int], settings: CollectSettings,
                      eos_token_ids: frozenset[int], companion: Companion | None = None) -> list[TokenRecord]:
    """Decode one prompt (see the module docstring for `segment`), recording every drafted token."""
    sampling = SamplingParams(temperature=settings.temperature, seed=settings.seed)
    generator = torch.Generator().manual_seed(settings.seed)
    # One block per segment, judged by no verifier and sent by no policy: only its length ends it.
    decode = DecodeSettings(mode="sd", max_new_tokens=settings.max_new_tokens, sampling=sampling,
                            k=settings.segment or settings.max_new_tokens)
    generation = Generation(list(prompt_ids), decode, eos_token_ids, StatsRecorder("sd"))
    drafter = model_drafter(draft_lm, sampling, generator, eos_token_ids, companion=companion)
    # segment 0 follows the target's greedy path whatever the sampling: its labels judge the whole draft.
    target = LocalTarget(target_lm, sampling, generator, decode.verify_method if settings.segment else GREEDY)
    records: list[TokenRecord] = []
    while not generation.done:
        position = len(generation.new_tokens)
        decoded = run_inline(speculative_round(generation, drafter, target, None, None))
        records += _token_records(decoded.block, decoded.verdict, position)
        if settings.segment == 0:
            break
    return records


def _token_records(block: PendingBlock, verdict: Verdict, position: int) -> list[TokenRecord]:
    p_target = verdict.p_target  # [g + 1, V]
    greedy_match = (verdict.target_logits[: len(block)].argmax(dim=-1) == torch.tensor(block.tokens)).tolist()
    return [TokenRecord(hidden=drafted.step.hidden.float().numpy().astype(np.float16),
                        confidence=draft_confidence_features(drafted.step),
                        p_draft=drafted.probability, p_target=float(p_target[i, drafted.token]),
                        runner_up_prob=runner_up_prob(drafted.step.logits),
                        target_argmax_match=greedy_match[i], on_path=i <= verdict.n_accepted,
                        position=position + i, block_position=i, companion=drafted.step.companion)
            for i, drafted in enumerate(block.drafted)]


def runner_up_prob(logits: torch.Tensor) -> float:
    """The draft's second-highest probability at T=1."""
    return float(torch.softmax(logits.float(), dim=-1).topk(2).values[1])


def _pack(records_by_prompt: dict[int, list[TokenRecord]]) -> dict[str, np.ndarray]:
    rows = [(index, r) for index, records in records_by_prompt.items() for r in records]
    arrays = {
        "hidden": np.stack([r.hidden for _, r in rows]),
        "confidence": np.asarray([r.confidence for _, r in rows], dtype=np.float32),
        "p_draft": np.asarray([r.p_draft for _, r in rows], dtype=np.float32),
        "p_target": np.asarray([r.p_target for _, r in rows], dtype=np.float32),
        "runner_up_prob": np.asarray([r.runner_up_prob for _, r in rows], dtype=np.float32),
        "target_argmax_match": np.asarray([r.target_argmax_match for _, r in rows], dtype=bool),
        "on_path": np.asarray([r.on_path for _, r in rows], dtype=bool),
        "position": np.asarray([r.position for _, r in rows], dtype=np.int32),
        "block_position": np.asarray([r.block_position for _, r in rows], dtype=np.int32),
        "prompt_index": np.asarray([i for i, _ in rows], dtype=np.int32),
    }
    if rows[0][1].companion is not None:  # a collection records companion signals for every token or none
        arrays["companion"] = np.asarray([r.companion for _, r in rows], dtype=np.float32)
    return arrays


def _write_atomically(path: Path, arrays: dict[str, np.ndarray]) -> None:
    with written_aside(path) as partial:
        np.savez(partial, **arrays)


def _manifest(target: LoadedModel, draft: LoadedModel, prompts: list[PromptRecord], settings: CollectSettings) -> dict:
    recorded = asdict(settings)
    if recorded["companion"] is None:  # absent, not null: data collected before companions keeps resuming
        del recorded["companion"]
    return {"format": DATA_FORMAT, "target": target.spec, "draft": draft.spec,
            "vocab_fingerprint": vocab_fingerprint(draft.tokenizer), "settings": recorded,
            "prompts": [asdict(p) for p in prompts]}


def collect(target: LoadedModel, draft: LoadedModel, make_draft_lm: Callable[[bool], DraftLM],
            prompts: list[PromptRecord], out_dir: Path, settings: CollectSettings,
            make_companion: Callable[[], Companion] | None = None, max_tokens: int | None = None,
            worker: tuple[int, int] = (0, 1)) -> Path:
    """Record every prompt's drafted tokens into `out_dir`; finished shards from an earlier run are kept.

    `make_companion` (required iff `settings.companion` names one) adds the companion's signals to the data.
    `max_tokens`: start no shard once the directory holds this many tokens. `worker` (i, n): this process
    collects shards i, i + n, i + 2n, ... (n processes share the directory and the budget).
    """
    if (make_companion is None) != (settings.companion is None):
        raise ValueError("settings.companion names the companion model and make_companion runs it: give both or neither")
    index, workers = worker
    if not 0 <= index < workers:
        raise ValueError(f"worker {index} of {workers}: expected 0 <= i < n")
    _check_manifest(out_dir, _manifest(target, draft, prompts, settings))
    shards = [range(start, min(start + settings.shard_size, len(prompts)))
              for start in range(0, len(prompts), settings.shard_size)]
    todo = [(n, shard) for n, shard in enumerate(shards)
            if n % workers == index and not (out_dir / f"shard-{n:05d}.npz").exists()]
    mine = sum(1 for n in range(len(shards)) if n % workers == index)
    if len(todo) < mine:  # this worker's own shards: the others belong to the other workers
        log.info("resuming: %d of this worker's %d shards already collected in %s", mine - len(todo), mine, out_dir)
    target_lm = CachedLM(target.model)
    draft_lm = make_draft_lm(True)  # the verifier's features read the draft's hidden states
    companion = make_companion() if make_companion is not None else None
    collected = collected_tokens(out_dir)
    with tqdm(total=max_tokens or None, initial=collected, desc=f"collecting (worker {index + 1}/{workers})",
              unit="token") as progress:
        for n, shard in todo:
            collected = collected_tokens(out_dir)  # other workers add to it too
            if max_tokens is not None and collected >= max_tokens:
                log.info("%s holds %d tokens: the budget of %d is reached", out_dir, collected, max_tokens)
                break
            records_by_prompt: dict[int, list[TokenRecord]] = {}
            for i in shard:
                prompt_ids = encode_prompt(draft.tokenizer, prompts[i].prompt, prompts[i].chat)
                records_by_prompt[i] = decode_and_record(target_lm, draft_lm, prompt_ids, settings,
                                                         target.eos_token_ids | draft.eos_token_ids, companion)
                progress.update(len(records_by_prompt[i]))
            _write_atomically(out_dir / f"shard-{n:05d}.npz", _pack(records_by_prompt))
    return out_dir


def nothing_to_collect(out_dir: Path, n_prompts: int, settings: CollectSettings, max_tokens: int | None) -> bool:
    """Every shard is there, or the budget is spent: a caller can skip loading the models."""
    n_shards = -(-n_prompts // settings.shard_size)
    if all((out_dir / f"shard-{n:05d}.npz").exists() for n in range(n_shards)):
        return True
    return max_tokens is not None and out_dir.exists() and collected_tokens(out_dir) >= max_tokens


def _check_manifest(out_dir: Path, manifest: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = out_dir / MANIFEST
    if manifest_path.exists():
        if json.loads(manifest_path.read_text()) != manifest:
            raise ValueError(f"{out_dir} holds data collected with other models, prompts or settings; "
                             "use another --data directory or delete it")
    else:
        with written_aside(manifest_path) as partial:
            partial.write_text(json.dumps(manifest, indent=1))


def collected_tokens(data_dir: Path) -> int:
    """Tokens in the finished shards (an npz reads one array at a time: only the small p_draft is read)."""
    total = 0
    for path in sorted(data_dir.glob("shard-*[0-9].npz")):
        with np.load(path) as shard:
            total += len(shard["p_draft"])
    return total


@dataclass(frozen=True)
class VerifierDataset:
    """All shards of one collection, concatenated; `prompts[prompt_index[i]]` made token i."""

    manifest: dict
    arrays: dict[str, np.ndarray]

    @property
    def prompts(self) -> list[PromptRecord]:
        return [PromptRecord(**p) for p in self.manifest["prompts"]]

    def __len__(self) -> int:
        return len(self.arrays["p_draft"])


def load_dataset(data_dir: Path) -> VerifierDataset:
    manifest_path = data_dir / MANIFEST
    if not manifest_path.exists():
        raise FileNotFoundError(f"{data_dir} has no {MANIFEST}: collect data first (sprinter verifier collect)")
    manifest = json.loads(manifest_path.read_text())
    paths = sorted(data_dir.glob("shard-*[0-9].npz"))
    if not paths:
        raise FileNotFoundError(f"{data_dir} has no shards yet")
    shards = [dict(np.load(p)) for p in paths]
    # a column added later (block_position) stands only when every shard has it: a resumed collection may mix
    arrays = {key: np.concatenate([s[key] for s in shards]) for key in shards[0] if all(key in s for s in shards)}
    return VerifierDataset(manifest, arrays)
