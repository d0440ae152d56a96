"""`sprinter gpu check|bundle|page`: the GPU figures in one prepared run, its bundle, and its page section.

    sprinter gpu bundle --out .gpu-bundle                  # here: wheels, stubs and entry points (make gpu-bundle)
    sprinter gpu check --out results/gpu-check              # on the GPU host (make gpu-check); --device cpu: dry run
    sprinter gpu page --results results/gpu-check --page docs/benchmarks/gpu.md
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common.arguments import DTYPE_NAMES, comma_list, one_of
from common.model.devices import add_device_argument
from sim.gpu_check.sizes import STEP_BUDGET_S

STEP_NAMES = tuple(STEP_BUDGET_S)  # in the order they run


def register(subcommands: argparse._SubParsersAction) -> None:
    gpu = subcommands.add_parser("gpu", help="the GPU figures: one prepared run for a brief, offline GPU host",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = gpu.add_subparsers(dest="gpu_command", required=True, metavar="COMMAND")
    check = commands.add_parser("check", help="run every step on this host's GPU (or --device cpu: the dry run)")
    check.add_argument("--out", type=Path, default=Path("results/gpu-check"))
    add_device_argument(check, "the engine runs (cuda on the GPU host; cpu: the dry run at the smallest sizes)")
    check.add_argument("--dtype", default="bfloat16", choices=DTYPE_NAMES)
    check.add_argument("--steps", type=comma_list(one_of(STEP_NAMES, "step"), "steps"), default=STEP_NAMES,
                       help=f"which steps, comma-separated (default all: {','.join(STEP_NAMES)})")
    check.set_defaults(run=_check)
    bundle = commands.add_parser("bundle", help="build the wheelhouse, stubs and entry points a GPU host needs")
    bundle.add_argument("--out", type=Path, default=Path(".gpu-bundle"))
    bundle.add_argument("--python-version", default="3.12", help="the GPU host's Python (default 3.12)")
    bundle.set_defaults(run=_bundle)
    page = commands.add_parser("page", help="a docs/benchmarks page section from what a check brought back")
    page.add_argument("--results", type=Path, required=True, help="the folder `gpu check --out` wrote")
    page.add_argument("--page", type=Path, default=Path("docs/benchmarks/gpu.md"))
    page.add_argument("--section", default="gpu-check")
    page.set_defaults(run=_page)


def _check(args: argparse.Namespace) -> int:
    try:
        from sim.gpu_check.check import GpuCheckSettings, run_check
    except ImportError as err:  # the host lacks a module: one line that says which, within seconds
        print(f"gpu-check: FAILED before step 1: cannot import {err.name or err} ({err}); is the bundle unpacked "
              "(python3 -m sim.gpu_check.unpack .gpu-bundle) and .gpu-bundle/site on PYTHONPATH?", flush=True)
        return 1

    return run_check(GpuCheckSettings(out=args.out, device=args.device, dtype=args.dtype, steps=tuple(args.steps)))


def _bundle(args: argparse.Namespace) -> int:
    from sim.gpu_check.wheelhouse import build_bundle

    bundle = build_bundle(args.out, args.python_version)
    print(f"{bundle.path}: {len(bundle.wheels)} wheels for Python {bundle.python_version}, {bundle.size_mb:.1f} MiB")
    return 0


def _page(args: argparse.Namespace) -> int:
    from sim.gpu_check.page import publish_results

    publish_results(args.results, args.page, args.section, "sprinter " + " ".join(args.argv))
    print(f"wrote section {args.section!r} of {args.page}")
    return 0
