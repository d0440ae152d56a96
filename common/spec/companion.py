"""Speculative Verification's companion signals (Kim et al., arXiv 2509.24328; research.md section 3).

A companion is a second draft-sized model with the draft's tokenizer. Where it agrees with the draft,
the target tends to agree too. Per drafted token x, both distributions taken at T=1 over the full
vocabulary at the position that produced x:
    S = sum_v min(P_draft(v), P_companion(v))      the overlap of the two distributions
    A = min(1, P_companion(x) / P_draft(x))         speculative sampling's acceptance of x, companion as judge
The learned verifier takes (S, A) as two more input features ("companion_overlap", "companion_ratio").

Cost: one companion forward per drafted token, on its own KV cache. With a companion as large as the
draft that doubles the edge's drafting compute (on this CPU the Qwen 0.5B draft step is ~100 ms);
the paper's 1.3-5.3% overhead is for a GPU server at large batch, not a CPU edge.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from common.model.cached_lm import CachedLM, DraftLM
from common.errors import PairMismatch
from common.model.loading import LoadedModel, load_model, vocab_fingerprint
from common.spec.verifier import Verifier, needs_companion

log = logging.getLogger(__name__)


def companion_features(p_draft: torch.Tensor, p_companion: torch.Tensor, token: int) -> tuple[float, float]:
    """(S, A) of token `token` for the draft's and the companion's distributions [V] (see the module docstring)."""
    if p_draft.shape != p_companion.shape:
        raise ValueError("draft and companion distributions differ in shape: "
                         f"{tuple(p_draft.shape)} vs {tuple(p_companion.shape)}")
    overlap = torch.minimum(p_draft, p_companion).sum().item()
    p_d, p_c = p_draft[token].item(), p_companion[token].item()
    # p_draft(x) is never 0 for a token the draft proposed, short of underflow; then any companion mass accepts.
    ratio = min(1.0, p_c / p_d) if p_d > 0 else float(p_c > 0)
    return min(1.0, overlap), ratio  # the sum of mins can exceed 1 by rounding only


class Companion:
    """A companion model on its own KV cache; one per generation, like the draft runtime."""

    def __init__(self, lm: DraftLM) -> None:
        self.lm = lm

    def features(self, context: list[int], step_logits: torch.Tensor, token: int) -> tuple[float, float]:
        """(S, A) for `token`, drafted after `context` by a draft whose raw logits there were `step_logits`."""
        p_companion = torch.softmax(self.lm.advance_to(context).logits[-1].float(), dim=-1)
        p_draft = torch.softmax(step_logits.float(), dim=-1)
        return companion_features(p_draft, p_companion, token)


def load_companion(spec: str, draft: LoadedModel, dtype: torch.dtype = torch.bfloat16,
                   loaded: Sequence[LoadedModel | None] = ()) -> LoadedModel:
    """The companion model named by `spec`, checked against the draft's vocabulary.

    A spec naming one of the `loaded` models shares its weights (a companion gets its own cache anyway).
    """
    model = next((m for m in loaded if m is not None and m.spec == spec), None) or load_model(spec, dtype)
    if vocab_fingerprint(model.tokenizer) != vocab_fingerprint(draft.tokenizer) or model.vocab_size != draft.vocab_size:
        raise PairMismatch(f"companion {spec!r} and draft {draft.spec!r} have different vocabularies: "
                             "a companion must share the draft's tokenizer")
    return model


def companion_factory(model: LoadedModel) -> Callable[[], Companion]:
    """Fresh companions on the torch runtime; each holds its own KV cache."""
    return lambda: Companion(CachedLM(model.model))


def companion_for(verifier: Verifier, spec: str | None, draft: LoadedModel, dtype: torch.dtype = torch.bfloat16,
                  loaded: Sequence[LoadedModel | None] = ()) -> Callable[[], Companion] | None:
    """The companion factory a decoding loop needs for this verifier, or None.

    A companion the verifier does not read is not loaded: it would cost a forward per token for nothing.
    """
    if spec is None:
        return None
    if not needs_companion(verifier):
        log.warning("companion %s ignored: the verifier does not read companion features", spec)
        return None
    log.info("loading companion %s (one extra forward per drafted token)", spec)
    return companion_factory(load_companion(spec, draft, dtype, loaded))
