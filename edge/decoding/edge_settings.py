"""A request's settings on the edge (`EdgeSettings`): its decoding (`DecodeSettings`) and what the edge adds around it,
the link to the cloud, the pipeline, the placement, `--mode auto`. Checked as made: a bad field is named."""

from __future__ import annotations

from dataclasses import dataclass

from common.spec.modes import DRAFT_DISTS, PIPELINES, DecodeSettings
from edge.decoding.placer import check_placement


@dataclass(frozen=True)
class EdgeSettings:
    decode: DecodeSettings
    cloud_retry_s: float = 2.0  # while degraded, how often to try the cloud again
    max_sparse_support: int = 4096  # sampling: the draft samples from at most this many tokens (sent exactly)
    stop: tuple[str, ...] = ()  # OpenAI's stop sequences
    request_deadline_s: float | None = None  # how long the request may wait for the cloud in all; None: as needed
    pipeline_adapts: bool = True  # False: draft ahead every round even when it does not pay (edge/decoding/ahead_gauge.py)
    pipeline: str = "off"  # edge/decoding/pipeline.py: draft while a block is in flight ("ahead"), and send it ("send-ahead")
    placement: str = "edge"  # where the draft runs: edge, cloud (cloud-sd), auto (edge/decoding/placer.py)
    # Under sampling, what a verify frame carries of the draft's distributions: "full" (all of them), or
    # "on-rejection" (p_draft of each token alone; the cloud asks for what it needs at a rejection, one more
    # round trip there: cloud/residual.py). Only for modes whose rule reads a distribution only where it rejects.
    draft_dists: str = "full"
    priority: int = 0  # the request's place within its edge's share of the cloud's line: lower first (as vLLM's)
    chooses_mode: bool = False  # `--mode auto`: the placer picks target, decode's mode, or cloud-sd (placer.py)

    def __post_init__(self) -> None:
        if self.pipeline not in PIPELINES:
            raise ValueError(f"unknown pipeline {self.pipeline!r}; choose one of {', '.join(PIPELINES)}")
        check_placement(self.placement)
        if self.draft_dists not in DRAFT_DISTS:
            raise ValueError(f"unknown draft_dists {self.draft_dists!r}; choose one of {', '.join(DRAFT_DISTS)}")
        if self.draft_dists == "on-rejection":
            self._check_on_rejection()

    def _check_on_rejection(self) -> None:
        traits = self.decode.traits
        if not traits.dists_on_rejection:
            raise ValueError(f"draft_dists 'on-rejection' needs a rule that reads a draft distribution only where it "
                             f"rejects (the token rule); mode {self.decode.mode!r} "
                             + (f"verifies with the {traits.verify_method} rule, which reads every one: use 'full'"
                                if traits.verify_method else "verifies no blocks"))
        if self.pipeline == "send-ahead" and traits.pipelines:
            raise ValueError("draft_dists 'on-rejection' cannot go with pipeline 'send-ahead': candidates queued "
                             "behind a block would reach the cloud before the answer to its residual query; "
                             "use pipeline 'ahead' or 'off', or draft_dists 'full'")
