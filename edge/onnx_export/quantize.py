"""Quantisation of the draft's float32 ONNX export's MatMul weights, in one of three formats.

A draft step reads every weight once, so it is memory-bandwidth bound and smaller weights are the
one big lever left on CPU.

- int8 and int4: ORT MatMulNBits blocks, 32 weights per scale, accuracy_level 4, which lets the CPU kernel
  quantise activations to int8 per block and use integer dot products (VNNI); without it the kernels dequantise
  the weights on every call and lose most of the gain. int8: symmetric round-to-nearest (ORT's default
  quantiser); int4: see `INT4_RECIPE`, chosen by acceptance against the target and speed (docs/edge.md).
- w8a8: int8 weights with a scale per output channel and activations quantised at run time with one scale per
  input (ORT's `DynamicQuantizeMatMul`, on MLAS's integer GEMM), made from a SmoothQuant copy of the model
  (edge/onnx_export/smooth.py). MatMulNBits runs a step's rows one after another: on the Intel Xeon this project
  measures on, 3 rows side by side cost 1.4x one row there and 1.2-1.3x on the integer GEMM, whose prompt
  prefill was also 2.7x as fast (docs/edge.md). Made for CPUs: not measured on a GPU.

Only this module's functions import onnx and ORT's quantisers, so the CLI can read `WEIGHT_FORMATS`
without loading them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal, get_args

log = logging.getLogger(__name__)

DraftWeights = Literal["float32", "int8", "int4", "w8a8"]  # a settings field of this type offers them as choices
WEIGHT_FORMATS: tuple[str, ...] = get_args(DraftWeights)
BLOCK_SIZE = 32
ACCURACY_LEVEL = 4
DATA_FILE = "model.onnx.data"  # weights live outside the protobuf (its limit is 2 GB)
# How `int4` is made, chosen by acceptance against the target and decode speed (Qwen2.5-Coder-0.5B drafting for the
# 1.5B, docs/edge.md): asymmetric round-to-nearest 4-bit blocks (a zero point per block follows skewed blocks, on
# which a symmetric scale wastes levels), except the MLP's down projection and the attention's key and value, kept at
# int8 (key and value are narrow under grouped-query attention, so cheap to keep). Tokens per call against int8's,
# 14 prompts: this recipe -1.7% at 1.35x int8's decode speed; the LM head at int8 too -0.4% at 1.21x; RTN 4-bit
# everywhere but an int8 head -3.4%; HQQ 4-bit everywhere -2.7% (its float zero points miss the fast kernel);
# RTN 4-bit everywhere -5.6% (6 prompts). On two sets of 96 prompts that chose nothing (with 95% intervals, docs/
# benchmarks/index.md): this recipe -2.1% and -2.8%; the head at int8 too -1.2%; AWQ-style scales first -3.0%.
INT4_RECIPE = "rtn-asym int4; int8 down, key, value"
# Part of the int4 export's cache directory name (`<key>-int4-r2`): an export made by an earlier recipe is not reused.
INT4_RECIPE_VERSION = 2
# How much of an input channel's range SmoothQuant moves into the weights (edge/onnx_export/smooth.py has the
# measurements that chose it); here because the recipe names it.
SMOOTHQUANT_ALPHA = 0.65
W8A8_RECIPE = (f"SmoothQuant alpha {SMOOTHQUANT_ALPHA} (norms, up rows); int8 weights per channel, int8 activations "
               "per tensor")
W8A8_RECIPE_VERSION = 1
RECIPES = {"int4": (INT4_RECIPE, INT4_RECIPE_VERSION), "w8a8": (W8A8_RECIPE, W8A8_RECIPE_VERSION)}


def quantize_weights(source: Path, destination: Path, weights: str) -> None:
    """Write `source` (a float32 export; for w8a8, of the smoothed model) to `destination` with its constant MatMul
    weights in the `weights` format."""
    import onnx

    if weights not in ("int8", "int4", "w8a8"):
        raise ValueError(f"weights must be 'int8', 'int4' or 'w8a8' to quantise, not {weights!r}")
    if weights == "w8a8":
        _dynamic_int8(source, destination)
        return
    model = onnx.load(str(source))
    if weights == "int4":
        model = _matmul_nbits(model, bits=4, symmetric=False, exclude=kept_at_int8(model))
    model = _matmul_nbits(model, bits=8, symmetric=True)  # after int4: what int4 left as plain MatMul
    # location is relative to the model file, so the directory can be renamed afterwards.
    onnx.save(model, str(destination), save_as_external_data=True, location=DATA_FILE)


def _matmul_nbits(model, bits: int, symmetric: bool, exclude: list[str] | None = None):
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=BLOCK_SIZE, is_symmetric=symmetric,
                                     accuracy_level=ACCURACY_LEVEL, nodes_to_exclude=exclude or [])
    quantizer.process()
    return quantizer.model.model


def _dynamic_int8(source: Path, destination: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # MatMulConstBOnly: the weights only; the attention's activation x activation products stay float.
    quantize_dynamic(source, destination, weight_type=QuantType.QInt8, per_channel=True,
                     op_types_to_quantize=["MatMul"], use_external_data_format=True,
                     extra_options={"MatMulConstBOnly": True})  # weights beside it, as <name>.data (DATA_FILE)


def kept_at_int8(model) -> list[str]:
    """Names of the MatMuls `int4` keeps at int8, told apart by their weights' shapes [in, out]: the MLP's down
    projection (in > out) and the attention's key and value (in = hidden size, out narrower: grouped-query attention;
    a model without it has none told apart, and keeps them at int4). The LM head (the widest output) is int4."""
    weights = _constant_weights(model)
    if not weights:
        return []
    head = max(weights, key=lambda name: weights[name][1])
    hidden = weights[head][0]  # the head reads the hidden state
    return [name for name, (rows, cols) in weights.items()
            if name != head and (rows > cols or (rows == hidden and cols < hidden))]


def _constant_weights(model) -> dict[str, tuple[int, int]]:
    """MatMul node name -> [in, out] of its constant 2-D weight."""
    shapes = {init.name: tuple(init.dims) for init in model.graph.initializer}
    found = {}
    for node in model.graph.node:
        shape = shapes.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) > 1 else None
        if shape and len(shape) == 2:
            found[node.name] = shape
    return found
