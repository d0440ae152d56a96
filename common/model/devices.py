"""Where torch models run: `--device auto|cpu|cuda|cuda:N`.

`auto` is the first CUDA GPU when torch sees one, else the CPU. A model's weights and, in the
cloud, every session's resident KV live on that device. Sampling coins are always drawn by a CPU
`torch.Generator` seeded from the request: a forward brings the rows a rule reads to the host once,
and the rules (common/spec/acceptance_rules.py) run there. So a seed draws the same coins on every device;
seeded outputs still differ between a CPU and a GPU where their logits round differently (bf16
GEMMs do), exactly as between two CPUs with different kernels.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from common.errors import SprinterError

if TYPE_CHECKING:  # imported where a device is resolved: `--device` is parsed without torch
    import torch

DEVICE_HELP = "auto (a CUDA GPU when torch sees one, else the CPU), cpu, cuda or cuda:N (default auto)"


class DeviceError(SprinterError, ValueError):
    """A device that this machine does not have."""


def resolve_device(name: str = "auto") -> torch.device:
    """`--device` as a torch device; refuses a GPU this machine lacks instead of falling back to the CPU."""
    import torch

    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise DeviceError(f"--device {name!r} is not a device: use auto, cpu, cuda or cuda:N") from err
    if device.type not in ("cpu", "cuda"):
        raise DeviceError(f"--device {name!r}: only cpu and cuda are supported")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {name}: torch sees no CUDA GPU here (torch {torch.__version__}); "
                              "use --device cpu, or install a CUDA build of torch")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise DeviceError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
        device = torch.device("cuda", index)
    return device


def add_device_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """`--device`, its help saying `what` lives there."""
    parser.add_argument("--device", default="auto", help=f"where {what}: {DEVICE_HELP}")

