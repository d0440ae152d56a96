"""bench policy: sprinter-exact with each call policy fixed, over the network sweep, greedy and sampled (issue 7).

    sprinter bench policy --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --out results/bench-policy

One `sprinter simulate` sweep per temperature, into OUT/T0 and OUT/T1, whose methods are the mode
with each policy (sprinter-exact@fixed:3, ..., sprinter-exact@goodput), at RTTs 0, 50, 100 and
200 ms, on 4 prompts x 40 tokens. The fleet validation is off by default: the fleet simulator
models each mode with its default policy only, so a 'mode@policy' method has nothing to compare.
Prints each sweep's summary; writes OUT/results.json (every sweep's summary rows) and OUT/table.md.
"""

from __future__ import annotations

import logging

from sim.bench.run_folder import RunFolder
from sim.bench.settings.sweeps import PolicyBenchSettings
from sim.sweep.report import format_summary, read_csv
from sim.sweep.simulate import simulate

log = logging.getLogger(__name__)


def bench_policy(settings: PolicyBenchSettings) -> str:
    """Run the sweeps one after the other (each resumes if interrupted); write OUT, return their summaries."""
    sweeps = settings.sweeps()  # all built first: a bad policy name fails before anything runs
    for sweep in sweeps:
        log.info("bench policy: T=%g into %s", sweep.temperature, sweep.out)
        simulate(sweep)
    folder = RunFolder(settings.out)
    folder.write_results(settings, sweeps=[{"temperature": sweep.temperature, "out": sweep.out,
                                            "rows": read_csv(sweep.out / "summary.csv")} for sweep in sweeps])
    text = "\n\n".join(f"T={sweep.temperature:g} (`{sweep.out}`):\n\n{format_summary(sweep.out).strip()}"
                       for sweep in sweeps)
    return folder.write_table(text)
