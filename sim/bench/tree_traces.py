"""What `sprinter bench tree-shapes` reads of the two models, computed once per prompt and cached (resumable).

Glossary
    output       the target's greedy continuation of a prompt: up to max_tokens tokens, its EOS last when it stopped
    row j        the draft teacher-forced on prompt + output[:j]: its `top` tokens (best first), their probabilities,
                 and the entropy of its distribution (T=1); what the draft proposes at output position j when the
                 chain so far is the target's text
    rejection j  a position whose row's best token is not output[j]: a chain that reaches j unrejected is rejected
                 there under greedy verification
    fork j       at a rejection j, the draft's own greedy chain after prompt + output[:j] + [its token]: up to
                 `fork_tokens` rows (token, probability, entropy), stopping at EOS; what a chain drafts past its
                 rejection (where the block ends and where the lowest estimates fall depend on it)

Under greedy decoding the output is the target's whatever the edge proposes, so these rows are everything a round
reads: a chain follows the rows until its first rejection and the fork after it, and a branch's alternative at j is
a row's next-best token whose continuation (when it is the target's) is the rows after j again.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from common.model.cached_lm import CachedLM
from common.model.loading import DTYPES, LoadedModel, load_model
from common.lab.prompt_sets import PromptRecord
from common.model.prompting import encode_prompt

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftTopTokens:
    """The draft's distribution at one position: its `top` tokens best first, their probabilities, its entropy."""

    top: list[int]
    probs: list[float]
    entropy: float

    @property
    def token(self) -> int:
        return self.top[0]

    def rank_of(self, token: int) -> int | None:
        """1-based rank of `token` among the top tokens; None when it is not among them."""
        return self.top.index(token) + 1 if token in self.top else None


@dataclass(frozen=True)
class TraceSettings:
    target: str
    draft: str
    dtype: str
    max_tokens: int
    fork_tokens: int  # rows drafted past a rejection: the longest chain a round sends, less one
    top: int  # tokens kept per teacher-forced row: the alternatives a shape may use, plus the draft's own


@dataclass
class PromptTrace:
    """One prompt's output, rows and forks (module docstring)."""

    prompt_id: str
    category: str
    prompt_tokens: int
    output: list[int]
    eos_ids: list[int]
    rows: list[DraftTopTokens]
    forks: dict[int, list[DraftTopTokens]]
    timings_ms: dict[str, float] = field(default_factory=dict)

    @property
    def ended(self) -> bool:
        """The output stopped at EOS (its last token) rather than at max_tokens."""
        return bool(self.output) and self.output[-1] in self.eos_ids

    @property
    def tokens(self) -> int:
        """Output tokens as the bench counts them: EOS not included."""
        return len(self.output) - int(self.ended)

    def rejections(self) -> list[int]:
        return [j for j, row in enumerate(self.rows) if row.token != self.output[j]]

    def to_json(self) -> dict:
        return {"prompt_id": self.prompt_id, "category": self.category, "prompt_tokens": self.prompt_tokens,
                "output": self.output, "eos_ids": self.eos_ids, "rows": [asdict(r) for r in self.rows],
                "forks": {str(j): [asdict(r) for r in rows] for j, rows in self.forks.items()},
                "timings_ms": self.timings_ms}

    @classmethod
    def from_json(cls, data: dict) -> "PromptTrace":
        return cls(data["prompt_id"], data["category"], data["prompt_tokens"], data["output"], data["eos_ids"],
                   [DraftTopTokens(**r) for r in data["rows"]],
                   {int(j): [DraftTopTokens(**r) for r in rows] for j, rows in data["forks"].items()},
                   data.get("timings_ms", {}))


def load_traces(records: list[PromptRecord], settings: TraceSettings, cache: Path) -> list[PromptTrace]:
    """Every record's trace: from `cache` when it holds one made with these settings, else computed and cached."""
    cache.mkdir(parents=True, exist_ok=True)
    traces: dict[str, PromptTrace] = {}
    missing = []
    for record in records:
        path = cache / f"{record.id}.json"
        data = json.loads(path.read_text()) if path.exists() else None
        if data is not None and data.get("settings") == asdict(settings):
            traces[record.id] = PromptTrace.from_json(data["trace"])
        else:
            missing.append(record)
    if missing:
        target = load_model(settings.target, DTYPES[settings.dtype])
        draft = load_model(settings.draft, DTYPES[settings.dtype])
        for record in missing:
            trace = build_trace(record, target, draft, settings)
            path = cache / f"{record.id}.json"
            partial = path.with_suffix(".part")
            partial.write_text(json.dumps({"settings": asdict(settings), "trace": trace.to_json()}))
            partial.replace(path)  # whole or absent: an interrupted run resumes at this prompt
            traces[record.id] = trace
    return [traces[r.id] for r in records]


def build_trace(record: PromptRecord, target: LoadedModel, draft: LoadedModel, settings: TraceSettings) -> PromptTrace:
    """One prompt's trace: the target's greedy output, then the draft's rows over it and its forks."""
    prompt = encode_prompt(draft.tokenizer, record.prompt, record.chat)
    eos = sorted(target.eos_token_ids | draft.eos_token_ids)
    started = time.perf_counter()
    output = greedy_output(CachedLM(target.model), prompt, settings.max_tokens, frozenset(eos))
    target_ms = (time.perf_counter() - started) * 1e3 / max(1, len(output))
    draft_lm = CachedLM(draft.model)
    rows = teacher_forced_rows(draft_lm, prompt, output, settings.top)
    started = time.perf_counter()
    forks, steps = {}, 0
    for j, row in enumerate(rows):
        if row.token != output[j]:
            forks[j] = fork_rows(draft_lm, prompt + output[:j] + [row.token], settings.fork_tokens, frozenset(eos))
            steps += len(forks[j])
    draft_ms = (time.perf_counter() - started) * 1e3 / max(1, steps)
    log.info("%s: %d output tokens, %d rejections, target %.0f ms/token, draft %.0f ms/step", record.id, len(output),
             len(forks), target_ms, draft_ms)
    return PromptTrace(record.id, record.category, len(prompt), output, eos, rows, forks,
                       {"target_step": target_ms, "draft_step": draft_ms})


def greedy_output(target: CachedLM, prompt: list[int], max_tokens: int, eos: frozenset[int]) -> list[int]:
    """The target's greedy continuation, one token a forward (as its KV grows on the cloud), EOS included."""
    output: list[int] = []
    while len(output) < max_tokens:
        token = int(target.advance_to(prompt + output).logits[-1].argmax())
        output.append(token)
        if token in eos:
            break
    return output


def teacher_forced_rows(draft: CachedLM, prompt: list[int], output: list[int], top: int) -> list[DraftTopTokens]:
    """Row j of the draft at each output position j: one forward over prompt + output."""
    logits = draft.advance_to(prompt + output, n_logits=len(output) + 1).logits[:len(output)]
    return [row_of(row, top) for row in logits]


def fork_rows(draft: CachedLM, context: list[int], count: int, eos: frozenset[int]) -> list[DraftTopTokens]:
    """The draft's greedy chain after `context`: `count` rows at most, the last one EOS when it stops there."""
    rows: list[DraftTopTokens] = []
    while len(rows) < count:
        row = row_of(draft.advance_to(context + [r.token for r in rows]).logits[-1], 1)
        rows.append(row)
        if row.token in eos:
            break
    return rows


def row_of(logits: torch.Tensor, top: int) -> DraftTopTokens:
    p = torch.softmax(logits.float(), dim=-1)
    entropy = float(-(p * torch.log(p.clamp_min(1e-12))).sum())
    values, indices = torch.topk(p, top)
    return DraftTopTokens([int(i) for i in indices], [float(v) for v in values], entropy)
