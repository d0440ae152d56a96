"""Cut a KV cache held as `OrtValue`s to its first positions, on the device that holds it.

A rollback keeps the first `length` positions of every past tensor [1, kv_heads, past, head_dim]; a tree's branches
drafted side by side start from that past repeated along the batch axis (`tiled`, a second graph of Tile ops).
ORT has no slicing call for an `OrtValue`, and going through numpy would copy a CUDA cache to the
host and back. So this builds, in code (no file shipped), a tiny graph of one `Slice` per past
tensor plus one `length` input, and runs it with IO binding on the draft's execution provider: the
cut copies happen on the device, and only `length` (8 bytes) crosses from the host.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

log = logging.getLogger(__name__)

# Slice has taken its bounds as inputs (so `length` can vary per call) since opset 10; 13 is well within
# every ORT this project runs, on CPU and CUDA alike.
_OPSET = 13


def slice_graph(n_tensors: int, kv_heads: int | str, head_dim: int | str) -> onnx.ModelProto:
    """`kept_i = past_i[:, :, :length]` for i < n_tensors; `length` is int64 [1]."""
    nodes = [helper.make_node("Constant", [], ["zero"], value=helper.make_tensor("z", TensorProto.INT64, [1], [0])),
             helper.make_node("Constant", [], ["axis"], value=helper.make_tensor("a", TensorProto.INT64, [1], [2]))]
    inputs = [helper.make_tensor_value_info("length", TensorProto.INT64, [1])]
    outputs = []
    for i in range(n_tensors):
        nodes.append(helper.make_node("Slice", [f"past_{i}", "zero", "length", "axis"], [f"kept_{i}"]))
        inputs.append(helper.make_tensor_value_info(f"past_{i}", TensorProto.FLOAT, [1, kv_heads, "past", head_dim]))
        outputs.append(helper.make_tensor_value_info(f"kept_{i}", TensorProto.FLOAT, [1, kv_heads, "kept", head_dim]))
    return _model(nodes, "kv_slice", inputs, outputs)


def tile_graph(n_tensors: int, kv_heads: int | str, head_dim: int | str) -> onnx.ModelProto:
    """`rows_i = past_i` repeated `repeats` = [b, 1, 1, 1] times along the batch axis (a tree's branches)."""
    inputs = [helper.make_tensor_value_info("repeats", TensorProto.INT64, [4])]
    nodes, outputs = [], []
    for i in range(n_tensors):
        nodes.append(helper.make_node("Tile", [f"past_{i}", "repeats"], [f"kept_{i}"]))
        inputs.append(helper.make_tensor_value_info(f"past_{i}", TensorProto.FLOAT, [1, kv_heads, "past", head_dim]))
        outputs.append(helper.make_tensor_value_info(f"kept_{i}", TensorProto.FLOAT, ["b", kv_heads, "past", head_dim]))
    return _model(nodes, "kv_tile", inputs, outputs)


def _model(nodes: list, name: str, inputs: list, outputs: list) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET)])
    model.ir_version = 8  # what ORT >= 1.14 reads; onnx's default may be newer than the installed ORT knows
    onnx.checker.check_model(model)
    return model


class KvSlicer:
    """Slices `n_tensors` past tensors on `device` ("cpu" or "cuda") through the given providers."""

    def __init__(self, n_tensors: int, kv_heads: int | str, head_dim: int | str, providers: list[str],
                 device: str) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1  # memory copies: more threads would only compete with the draft's
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session, self.tiles = (
            ort.InferenceSession(graph(n_tensors, kv_heads, head_dim).SerializeToString(), options,
                                 providers=providers) for graph in (slice_graph, tile_graph))
        self.device = device
        log.debug("KV slicer for %d tensors on %s", n_tensors, self.session.get_providers()[0])
        self._inputs = [f"past_{i}" for i in range(n_tensors)]
        self._outputs = [f"kept_{i}" for i in range(n_tensors)]

    def bound(self, past: list[ort.OrtValue], length: int) -> list[ort.OrtValue]:
        """New, contiguous `OrtValue`s on `device` holding the first `length` positions of each of `past`."""
        return self._run(self.session, "length", np.asarray([length], dtype=np.int64), past)

    def tiled(self, past: list[ort.OrtValue], rows: int) -> list[ort.OrtValue]:
        """New `OrtValue`s on `device`: each of `past` (batch 1) repeated `rows` times along the batch axis."""
        return self._run(self.tiles, "repeats", np.asarray([rows, 1, 1, 1], dtype=np.int64), past)

    def _run(self, session: ort.InferenceSession, argument: str, value: np.ndarray,
             past: list[ort.OrtValue]) -> list[ort.OrtValue]:
        binding = session.io_binding()
        binding.bind_cpu_input(argument, value)
        for name, value in zip(self._inputs, past):
            binding.bind_ortvalue_input(name, value)
        for name in self._outputs:
            binding.bind_output(name, self.device)
        session.run_with_iobinding(binding)
        return list(binding.get_outputs())
