"""The copies' calibration measured by `sprinter bench proposer`: its reliability table, and the file shipped beside
the verifier (`--fit-calibration edge/verifiers/PAIR/suffix_calibration.json`), which a serving edge starts from
(common/spec/propose/suffix_proposer.py `load_priors`)."""

from __future__ import annotations

from datetime import date

from common.spec.propose.suffix_proposer import PRIOR_RATES, PRIOR_WEIGHT, SAMPLED_PRIOR_RATES


def pooled(calibration: list[dict]) -> dict[tuple[str, int], list[float]]:
    """(source, match bucket) -> [copies the target reached, of them kept, the sum of the a_i they carried]."""
    tallies: dict[tuple[str, int], list[float]] = {}
    for c in calibration:
        tally = tallies.setdefault((c["source"], c["match_length"]), [0, 0.0, 0.0])
        tally[0] += c["reached"]
        tally[1] += c["kept"] * c["reached"]
        tally[2] += c["predicted"] * c["reached"]
    return tallies


def fit_calibration(calibration: list[dict], regime: str, measured: str) -> dict:
    """Per source and match bucket, P(kept | reached) from the run's verdicts, drawn toward the built-in prior by
    PRIOR_WEIGHT verdicts as a serving edge's own learning is (a sparse bucket stays near the prior)."""
    priors = PRIOR_RATES if regime == "greedy" else SAMPLED_PRIOR_RATES
    rates = {source: {str(b): r for b, r in buckets.items()} for source, buckets in priors.items()}
    reached: dict[str, dict[str, int]] = {}
    for (source, bucket), (n, kept, _) in sorted(pooled(calibration).items()):
        prior = priors[source][bucket]
        rates[source][str(bucket)] = round((kept + prior * PRIOR_WEIGHT) / (n + PRIOR_WEIGHT), 3)
        reached.setdefault(source, {})[str(bucket)] = int(n)
    return {"regime": regime, "measured": f"{date.today().isoformat()}: {measured}", "rates": rates,
            "reached": reached}


def calibration_table(calibration: list[dict]) -> str:
    """How well the copies' scores (a_i) predicted the target keeping them, over every pass, per source and match."""
    tallies = pooled(calibration)
    if not tallies:
        return ""
    lines = ["", "", "The copies' scores against the verdicts (tokens the target reached):", "",
             "| source | match length >= | reached | kept | mean a_i |", "| --- | --- | --- | --- | --- |"]
    for (source, bucket), (n, kept, predicted) in sorted(tallies.items()):
        lines.append(f"| {source} | {bucket} | {n} | {kept / n:.2f} | {predicted / n:.2f} |")
    return "\n".join(lines)
