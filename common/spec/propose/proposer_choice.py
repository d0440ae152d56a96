"""Which strategy proposes a generation's tokens (`--proposer`, the API's `proposer`): the names in PROPOSERS.

    model    the draft model alone (common/spec/propose/drafting.py)
    suffix   copied runs from the text where it matches, each ending its block (suffix_proposer.py)
    hybrid   copies and the draft's tokens chained by their expected acceptance (hybrid_proposer.py)
"""

from __future__ import annotations

from typing import Callable

from common.spec.propose.drafting import ModelProposer
from common.spec.propose.hybrid_proposer import ChainedRuns
from common.spec.modes import DecodeSettings
from common.spec.propose.proposals import Proposer
from common.spec.propose.suffix_proposer import RunRule, SuffixMemory, SuffixProposer, WholeRuns

RULES: dict[str, type[RunRule]] = {"suffix": WholeRuns, "hybrid": ChainedRuns}  # a suffix proposer's


def proposer_for(settings: DecodeSettings, memory: SuffixMemory) -> Callable[[ModelProposer], Proposer] | None:
    """What a generation's `settings.proposer` puts around the draft model (None: the model alone)."""
    if settings.proposer == "model":
        return None
    rule = RULES[settings.proposer]()

    def around(model: ModelProposer) -> Proposer:
        shaped = model.processor is not None and model.processor.active
        return SuffixProposer(model, memory, passes_unchecked=settings.traits.releases_passed,
                              may_pass=settings.sampling.logprobs is None and not shaped, rule=rule)
    return around
