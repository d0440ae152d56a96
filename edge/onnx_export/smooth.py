"""SmoothQuant for the `w8a8` draft export: each MatMul input's channel scales folded into the weights before export.

`w8a8` runs the draft's MatMuls on ONNX Runtime's integer GEMM (`DynamicQuantizeMatMul`): int8 weights with a scale
per output channel, and activations quantised to int8 at run time with one scale for the whole input. A decoder's
inputs to its projections hold a few channels tens of times larger than the rest, and one scale for all of them
leaves the others a handful of levels. SmoothQuant (Xiao et al., 2023) divides input channel j by

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)      X_j: channel j's calibration values, W_j: the weights
                                                            that multiply channel j (a column of torch's [out, in])

and multiplies those weights by s_j: the product is the same in exact arithmetic, the activations flatter and the
weights a little less so. The division folds into the op before each projection, so the graph gains no op:

    input RMSNorm's weight      / s  ->  query, key, value columns    * s
    post-attention RMSNorm's    / s  ->  gate, up columns             * s
    up projection's output rows / s  ->  down projection's columns    * s   (act(gate) * up is linear in up)

The attention's output projection is left as is: its input comes from value heads shared by 7 query heads
(grouped-query attention), so its scales could not fold into one value row each.

Measured (Qwen2.5-Coder-0.5B drafting for the 1.5B, 14 prompts x 64 greedy target tokens, blocks of 5, tokens per
call from the draft's top-1 along the target's text): MatMulNBits int8 3.896, float32 3.879; this format without
smoothing 3.718 (-4.6% against int8), with it at alpha 0.5 3.765, 0.65 3.930 and 0.8 3.913. On 7 prompts held out of
that choice: int8 4.110, w8a8 4.036 (-1.8%) (`sprinter bench draft-acceptance`, docs/edge.md); on two sets of 96,
-1.9% and -2.0%. An alpha chosen per site by the simulated w8a8 error (0.4-0.7) did no better there (-2.2%).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from common.model.prompting import encode_prompt
from edge.onnx_export.quantize import SMOOTHQUANT_ALPHA
from edge.onnx_export.verify import DraftExportError

log = logging.getLogger(__name__)

# Calibration: a few varied texts of our own (not the export check's prompts, edge/onnx_export/verify.py), read once
# for each input channel's largest magnitude. The maxima come from a handful of outlier channels that any text shows.
CALIBRATION_TEXTS = (
    "def parse_header(line: str) -> tuple[str, str]:\n    name, _, value = line.partition(':')\n"
    "    if not name:\n        raise ValueError(f'no header name in {line!r}')\n    return name.strip().lower(), value.strip()\n",
    "The committee met on Tuesday to review the harbour's budget. Dredging costs rose by a fifth after the spring "
    "storms, and two members asked whether the ferry timetable could absorb a later first sailing.",
    "Q: A train leaves at 09:40 and arrives at 13:05. How long is the journey?\nA: From 09:40 to 13:40 is 4 hours; "
    "13:05 is 35 minutes earlier, so the journey takes 3 hours 25 minutes.",
    "SELECT customer_id, SUM(amount) AS total FROM orders WHERE placed_at >= '2024-01-01' GROUP BY customer_id "
    "HAVING SUM(amount) > 500 ORDER BY total DESC LIMIT 20;",
    "Translate into French: The library opens at nine, but the reading room stays closed until noon on Mondays.",
    "- Preheat the oven to 200 C.\n- Slice the leeks and rinse them well.\n- Whisk three eggs with the cream, season, "
    "and pour over the leeks in a buttered dish.\n- Bake for 25 minutes until just set.",
)


class SmoothingNotSupported(DraftExportError):
    """The model's layers are not the llama/qwen2 shape whose norms and projections the scales fold into."""


@dataclass(frozen=True)
class _Site:
    """One folding: the inputs read by `projections`, scaled down in `source` (a norm's weight, or rows)."""
    source: torch.Tensor  # [in]: an RMSNorm's weight, or [in, hidden]: the up projection's weight (its rows)
    source_bias: torch.Tensor | None
    projections: tuple[torch.Tensor, ...]  # each [out, in]: its columns (input channels) are scaled up


def smoothed_copy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                  alpha: float = SMOOTHQUANT_ALPHA) -> PreTrainedModel:
    """A float32 copy of `model` with SmoothQuant's scales folded in: the same function, flatter MatMul inputs."""
    _layers(model)  # refused before anything is copied
    smoothed = copy.deepcopy(model).float().eval()
    maxima = input_maxima(smoothed, tokenizer)
    with torch.no_grad():
        for key, site in _sites(smoothed).items():
            weights = torch.stack([p.abs().amax(0) for p in site.projections]).amax(0)  # [in]
            scale = (maxima[key].clamp(min=1e-5) ** alpha / weights.clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)
            if site.source.dim() == 1:
                site.source.div_(scale)
            else:
                site.source.div_(scale[:, None])
            if site.source_bias is not None:
                site.source_bias.div_(scale)
            for projection in site.projections:
                projection.mul_(scale[None, :])
    log.info("SmoothQuant (alpha %.2f) folded into %d layers", alpha, len(smoothed.model.layers))
    return smoothed


def input_maxima(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 texts: tuple[str, ...] = CALIBRATION_TEXTS) -> dict[tuple[int, str], torch.Tensor]:
    """Per input channel, the largest magnitude each folding site's projections read over `texts` (each alone and,
    where the tokenizer has a chat template, as a user's message: the template's tokens have outliers of their own)."""
    maxima: dict[tuple[int, str], torch.Tensor] = {}

    def record(key: tuple[int, str]):
        def hook(_module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            values = inputs[0].detach().abs().reshape(-1, inputs[0].shape[-1]).amax(0)
            maxima[key] = torch.maximum(maxima[key], values) if key in maxima else values
        return hook

    handles = [module.register_forward_pre_hook(record(key)) for key, module in _reading_modules(model).items()]
    try:
        with torch.no_grad():
            for text in texts:
                for chat in (False, True) if getattr(tokenizer, "chat_template", None) else (False,):
                    model(torch.tensor([encode_prompt(tokenizer, text, chat)]))
    finally:
        for handle in handles:
            handle.remove()
    return maxima


def _reading_modules(model: PreTrainedModel) -> dict[tuple[int, str], torch.nn.Module]:
    """One projection per site: the inputs it reads are every projection's of that site."""
    return {(i, name): module for i, layer in enumerate(_layers(model))
            for name, module in (("attention", layer.self_attn.q_proj), ("mlp", layer.mlp.gate_proj),
                                 ("down", layer.mlp.down_proj))}


def _sites(model: PreTrainedModel) -> dict[tuple[int, str], _Site]:
    sites = {}
    for i, layer in enumerate(_layers(model)):
        attention, mlp = layer.self_attn, layer.mlp
        sites[(i, "attention")] = _Site(layer.input_layernorm.weight, None,
                                        (attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight))
        sites[(i, "mlp")] = _Site(layer.post_attention_layernorm.weight, None,
                                  (mlp.gate_proj.weight, mlp.up_proj.weight))
        sites[(i, "down")] = _Site(mlp.up_proj.weight, mlp.up_proj.bias, (mlp.down_proj.weight,))
    return sites


def _layers(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The decoder layers, refused unless each has the norms and projections the scales fold into."""
    layers = list(getattr(getattr(model, "model", None), "layers", []) or [])
    needed = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj", "self_attn.k_proj",
              "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    missing = [name for name in needed if not layers or not _has(layers[0], name)]
    if missing:
        raise SmoothingNotSupported(
            f"w8a8 folds its scales into llama/qwen2-style layers; {model.config.model_type} lacks {missing}")
    return layers


def _has(module: torch.nn.Module, dotted: str) -> bool:
    for part in dotted.split("."):
        module = getattr(module, part, None)
        if module is None:
            return False
    return True
