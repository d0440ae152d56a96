"""Weight-only quantisation of the draft's float32 ONNX export: MatMul weights become ORT MatMulNBits blocks.

A draft step reads every weight once, so it is memory-bandwidth bound and smaller weights are the
one big lever left on CPU. Both formats keep 32 weights per scale and set accuracy_level 4, which
lets the CPU kernel quantise activations to int8 and use integer dot products (VNNI); without it
the kernels dequantise the weights on every call and lose most of the gain.

- int8: symmetric round-to-nearest (ORT's default quantiser).
- int4: see `INT4_RECIPE`, chosen by acceptance against the target (docs/edge.md has the table).

Only this module's functions import onnx and ORT's quantisers, so the CLI can read `WEIGHT_FORMATS`
without loading them.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

WEIGHT_FORMATS = ("float32", "int8", "int4")
BLOCK_SIZE = 32
ACCURACY_LEVEL = 4
DATA_FILE = "model.onnx.data"  # weights live outside the protobuf (its limit is 2 GB)
# How `int4` is made (measured on Qwen2.5-Coder-0.5B drafting for the 1.5B; docs/edge.md):
# asymmetric round-to-nearest blocks (a zero point per block follows skewed weight blocks that a symmetric scale
# wastes half its levels on) for the decoder layers, and the LM head kept at int8. The head is the largest single
# weight (vocab x hidden) and the one whose error reaches the draft's choice of token directly.
INT4_RECIPE = "rtn-asym, head int8"


def quantize_weights(source: Path, destination: Path, weights: str) -> None:
    """Write `source` (a float32 export) to `destination` with its constant MatMul weights as `weights` blocks."""
    import onnx

    if weights not in ("int8", "int4"):
        raise ValueError(f"weights must be 'int8' or 'int4' to quantise, not {weights!r}")
    model = onnx.load(str(source))
    if weights == "int8":
        model = _matmul_nbits(model, bits=8, symmetric=True)
    else:
        head = lm_head_node(model)
        model = _matmul_nbits(model, bits=4, symmetric=False, exclude=[head] if head else [])
        if head:
            model = _matmul_nbits(model, bits=8, symmetric=True)  # only the head is still a plain MatMul
    # location is relative to the model file, so the directory can be renamed afterwards.
    onnx.save(model, str(destination), save_as_external_data=True, location=DATA_FILE)


def _matmul_nbits(model, bits: int, symmetric: bool, exclude: list[str] | None = None):
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=BLOCK_SIZE, is_symmetric=symmetric,
                                     accuracy_level=ACCURACY_LEVEL, nodes_to_exclude=exclude or [])
    quantizer.process()
    return quantizer.model.model


def lm_head_node(model) -> str | None:
    """Name of the MatMul whose constant weight has the most output columns: the LM head (vocab wide)."""
    shapes = {init.name: list(init.dims) for init in model.graph.initializer}
    best, best_width = None, 0
    for node in model.graph.node:
        shape = shapes.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) > 1 else None
        if shape and len(shape) == 2 and shape[1] > best_width:
            best, best_width = node.name, shape[1]
    return best
