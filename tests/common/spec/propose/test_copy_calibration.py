"""The copies' calibration holds out of sample: fitted on prompts 2-3 of the proposer suite's grounded categories,
the a_i that hybrid drafting gives its copies on the held-out prompt 1 of each match the share the target keeps
(a reliability curve), on SmolLM2 with its 4-layer self-draft, greedy, float32."""

from __future__ import annotations

import json

import pytest

from common.spec.local_decoder import LocalDecoder
from common.spec.modes import DecodeSettings
from common.spec.propose.suffix_proposer import load_priors, suffix_memory
from common.lab.prompt_sets import load_prompts
from common.model.prompting import encode_prompt
from sim.bench.proposer import SUITE, chosen_prompts
from sim.bench.proposer_calibration import fit_calibration, pooled

GROUNDED = ("code-edit", "passage-qa")  # where the small pair copies most


@pytest.mark.smollm2
def test_the_copies_rates_fitted_on_some_prompts_hold_on_held_out_ones(smollm2, smollm2_4_layers, tmp_path) -> None:
    records = load_prompts(SUITE)
    fitting = chosen_prompts(records, GROUNDED, 1, skip=1)  # one prompt a category fits; the held-out one checks
    held_out = chosen_prompts(records, GROUNDED, 1)
    engine = LocalDecoder(smollm2, smollm2_4_layers, suffix_memory=suffix_memory(cache=False))
    _generate(engine, fitting)
    path = tmp_path / "suffix_calibration.json"
    path.write_text(json.dumps(fit_calibration(engine.suffix_memory.calibration.report(), "greedy", "test")))
    engine.suffix_memory = suffix_memory(cache=False, priors={"greedy": load_priors(path)})
    _generate(engine, held_out)
    curve = pooled(engine.suffix_memory.calibration.report())  # (source, bucket) -> [reached, kept, sum of a_i]
    reached = sum(n for n, _, _ in curve.values())
    kept, predicted = (sum(t[i] for t in curve.values()) / reached for i in (1, 2))
    print({k: (n, round(kept_n / n, 2), round(a / n, 2)) for k, (n, kept_n, a) in sorted(curve.items())})
    assert reached >= 20  # the held-out prompts copy enough for the curve to say something
    assert abs(kept - predicted) <= 0.1  # calibrated in the mean
    for short in (True, False):  # and along the curve: copies after short matches and after long ones
        points = [t for (_, bucket), t in curve.items() if (bucket < 8) == short]
        n = sum(t[0] for t in points)
        if n >= 10:
            assert abs(sum(t[1] for t in points) / n - sum(t[2] for t in points) / n) <= 0.25, (short, points)


def _generate(engine: LocalDecoder, records) -> None:
    for record in records:
        prompt = encode_prompt(engine.target.tokenizer, record.prompt, record.chat)
        engine.generate(prompt, DecodeSettings(mode="sd-block", max_new_tokens=64, proposer="hybrid"))
