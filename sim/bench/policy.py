"""bench policy: sprinter-exact with each call policy fixed, over the network sweep, greedy and sampled (issue 7).

    sprinter bench policy --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --out results/bench-policy

One `sprinter simulate` sweep per temperature, into OUT/T0 and OUT/T1, whose methods are the mode
with each policy (sprinter-exact@fixed:3, ..., sprinter-exact@goodput), at RTTs 0, 50, 100 and
200 ms, on 4 prompts x 40 tokens. The fleet validation is off by default: the fleet simulator
models each mode with its default policy only, so a 'mode@policy' method has nothing to compare.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from sim.sweep.settings import SimulateSettings

log = logging.getLogger(__name__)

POLICIES = ("fixed:3", "fixed:5", "fixed:8", "heuristic", "flag", "goodput")


@dataclass(frozen=True)
class PolicyBenchSettings:
    out: Path = Path("results/bench-policy")
    target: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"
    mode: str = "sprinter-exact"
    policies: tuple[str, ...] = POLICIES
    temperatures: tuple[float, ...] = (0.0, 1.0)
    rtt_ms: tuple[float, ...] = (0.0, 50.0, 100.0, 200.0)
    limit: int = 4
    max_new_tokens: int = 40
    fleet_validation: bool = False

    def sweeps(self) -> list[SimulateSettings]:
        """One sweep per temperature, into OUT/T<temperature>; the other sweep settings keep their defaults."""
        methods = tuple(f"{self.mode}@{policy}" for policy in self.policies)
        return [SimulateSettings(out=self.out / f"T{temperature:g}", target=self.target, draft=self.draft,
                                 modes=methods, rtt_ms=self.rtt_ms, temperature=temperature, limit=self.limit,
                                 max_new_tokens=self.max_new_tokens, fleet_validation=self.fleet_validation)
                for temperature in self.temperatures]


def bench_policy(settings: PolicyBenchSettings) -> list[SimulateSettings]:
    """Run the sweeps one after the other (each resumes if interrupted); returns what ran."""
    from sim.sweep.simulate import simulate  # the cloud and its models: not for `sprinter bench --help`

    sweeps = settings.sweeps()  # all built first: a bad policy name fails before anything runs
    for sweep in sweeps:
        log.info("bench policy: T=%g into %s", sweep.temperature, sweep.out)
        simulate(sweep)
    return sweeps
