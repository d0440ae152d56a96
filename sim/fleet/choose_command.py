"""`sprinter fleet choose`: what `--mode auto` would choose on clouds this project cannot run here, and whether the
fleet simulator agrees.

    sprinter fleet choose --clouds this-cpu,cpu-16,h100 --rtt-ms 0,50,100,200 --out results/fleet-choose

For each cloud and RTT: the cost model's predicted tokens/s of each option (common/spec/round_cost.py, the formulas
the edge decides with: target alone, speculating on the edge in sprinter-exact, cloud-sd), the choice it makes, and
the fleet simulator's tokens/s of one edge in each mode (sim/fleet/simulation.py: the same costs, simulated call by call
with the mode's recorded blocks). "agrees" says whether the simulator's fastest is the model's choice; "auto/best"
is the simulated speed of the choice over the simulated best.

The clouds are data, their assumptions written beside their numbers (CLOUDS). Every edge drafts with the edge's
own runtime (ONNX int8, Qwen2.5-Coder-0.5B: 23 ms a token, issue 57's measurement on one core of this machine kind)
and runs the verifier (0.8 ms a token). The calls per mode are the illustrative profiles (`demo_profiles`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common.arguments import floats, names

CLOUD_NAMES = ("this-cpu", "this-cpu-resident", "cpu-16", "h100")  # sim/fleet/mode_choice.py CLOUDS


def register(programs: argparse._SubParsersAction) -> None:
    """Adds `choose` to `sprinter fleet` (entry-point group sprinter.fleet_commands)."""
    p = programs.add_parser("choose", help="what --mode auto would choose on other clouds, beside the fleet simulator",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clouds", type=names, default=CLOUD_NAMES, help=f"comma list of {', '.join(CLOUD_NAMES)}")
    p.add_argument("--rtt-ms", type=floats, default=(0.0, 50.0, 100.0, 200.0))
    p.add_argument("--max-tokens", type=int, default=128, help="tokens a request asks for")
    p.add_argument("--out", type=Path, default=Path("results/fleet-choose"))
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from sim.fleet.mode_choice import CLOUDS, choose, table  # numpy: not for --help

    unknown = [c for c in args.clouds if c not in CLOUDS]
    if unknown:
        raise SystemExit(f"sprinter fleet choose: --clouds: unknown {', '.join(unknown)}; choose of {', '.join(CLOUDS)}")
    rows = choose(tuple(args.clouds), tuple(args.rtt_ms), args.max_tokens)
    text = table(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"rows": rows, "clouds": {
        c: {"assumption": CLOUDS[c].assumption, "forward": vars(CLOUDS[c].forward),
            "draft_forward": vars(CLOUDS[c].draft_forward)} for c in args.clouds}}, indent=1))
    (args.out / "table.md").write_text(text + "\n")
    print(text)
    return 0
