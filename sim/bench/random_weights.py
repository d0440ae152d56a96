"""Real architectures with random weights, for benchmarks on machines without model packages (a GPU host).

`architectures/NAME.json` holds each model's published `config.json` shape (layers, heads, widths,
vocabulary). `random_model` builds it on the device directly: a 7B model initialised on the CPU
first would spend the GPU's time on a host-to-device copy of 15 GB. Random weights make a target
that rejects nearly every draft token; a verify's cost barely depends on that (see sim/bench/engine.py
for what it does to the context).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

ARCHITECTURES = Path(__file__).with_name("architectures")
# The Coder models have their base models' shapes: the presets' names work too.
ALIASES = {"qwen2.5-coder-0.5b": "qwen2.5-0.5b", "qwen2.5-coder-1.5b": "qwen2.5-1.5b", "qwen2.5-coder-7b": "qwen2.5-7b"}


def architecture_names() -> tuple[str, ...]:
    return tuple(sorted(path.stem for path in ARCHITECTURES.glob("*.json")))


def architecture(name: str) -> PretrainedConfig:
    path = ARCHITECTURES / f"{ALIASES.get(name, name)}.json"
    if not path.exists():
        raise ValueError(f"no architecture {name!r} for --random-weights; known: {', '.join(architecture_names())}")
    fields = json.loads(path.read_text())
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


@torch.no_grad()
def random_model(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0) -> PreTrainedModel:
    """Architecture `name` with weights drawn on `device` (seeded), in `dtype`, in eval mode."""
    config = architecture(name)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()
