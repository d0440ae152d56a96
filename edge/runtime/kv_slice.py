"""Cut a KV cache held as `OrtValue`s to its first positions, on the device that holds it.

A rollback keeps the first `length` positions of every past tensor [1, kv_heads, past, head_dim].
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
    graph = helper.make_graph(nodes, "kv_slice", inputs, outputs)
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
        model = slice_graph(n_tensors, kv_heads, head_dim)
        self.session = ort.InferenceSession(model.SerializeToString(), options, providers=providers)
        self.device = device
        log.debug("KV slicer for %d tensors on %s", n_tensors, self.session.get_providers()[0])
        self._inputs = [f"past_{i}" for i in range(n_tensors)]
        self._outputs = [f"kept_{i}" for i in range(n_tensors)]

    def bound(self, past: list[ort.OrtValue], length: int) -> list[ort.OrtValue]:
        """New, contiguous `OrtValue`s on `device` holding the first `length` positions of each of `past`."""
        binding = self.session.io_binding()
        binding.bind_cpu_input("length", np.asarray([length], dtype=np.int64))
        for name, value in zip(self._inputs, past):
            binding.bind_ortvalue_input(name, value)
        for name in self._outputs:
            binding.bind_output(name, self.device)
        self.session.run_with_iobinding(binding)
        return list(binding.get_outputs())
