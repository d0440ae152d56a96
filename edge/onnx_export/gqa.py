"""Grouped-query attention as grouped MatMuls over the 2 KV heads, in place of the exporter's expanded attention.

onnxscript's fusions turn each layer's attention into `MultiHeadAttention`, which has as many key/value heads as
query heads. Under grouped-query attention (Qwen2.5-0.5B: 14 query heads, 2 key/value heads) the exported graph
therefore expands the present key/value 7x to 14 heads, transposes it to [b, seq, 14 * 64] and hands it to
`MultiHeadAttention`, which transposes it back. Every step copies each row's whole past that way several times over.
Measured with ORT's profiler on one core (AMD EPYC, Qwen2.5-Coder-0.5B int8, 300 tokens of context): attention,
Transpose, Expand and Concat took 8.4 ms of a 1-row step and 28.1 ms of a 3-row step, 9.8 ms per extra row against
4 ms for all MatMulNBits.

ORT's `GroupQueryAttention` reads the KV heads where they lie, but on CPU it runs one M=1 product per query head:
2.0 ms per extra row in the draft. Here the 7 query heads that share a KV head (and the new positions) become the
rows of one product instead: scores = Q [b, kv, 7n, d] x K^T [b, kv, d, past + n], then a causal bias, Softmax and x V.
Alone, one layer at 300 tokens: 27 us for 1 row and 64 for 3, against GroupQueryAttention's 63 and 173. Plain ONNX
ops, so any provider runs it.

The rewrite works on the graph alone (the weights stay in their external file): per `MultiHeadAttention` whose key
and value come from `Concat(past, new)` through that expansion, the Concats stay (they make the `present_*`
outputs) and the nodes below take the attention's place; what nothing reads any more is dropped.
"""

from __future__ import annotations

import logging

import onnx
from onnx import TensorProto, helper

log = logging.getLogger(__name__)

# Key and value reach MultiHeadAttention from Concat(past, new) through these ops, from the attention upwards.
_EXPANSION = ("Reshape", "Transpose", "Reshape", "Expand", "Unsqueeze", "Concat")
_BIAS = "grouped_causal_bias"  # [groups * n, past + n]: 0 where a query row may attend, -inf where not


def grouped_attention(model: onnx.ModelProto) -> int:
    """Rewrite `model` in place; returns how many attention nodes became grouped MatMuls."""
    graph = model.graph
    producers = {output: node for node in graph.node for output in node.output}
    past = {i.name: i for i in graph.input if i.name.startswith("past_")}
    nodes: list[onnx.NodeProto] = []
    replaced = 0
    for node in graph.node:
        pair = _concats(node, producers, past) if node.op_type == "MultiHeadAttention" else None
        if pair is None:
            nodes.append(node)
            continue
        dims = past[pair[0].input[0]].type.tensor_type.shape.dim
        kv_heads, head_dim = dims[1].dim_value, dims[3].dim_value
        groups = _attribute(node, "num_heads") // kv_heads
        if not replaced:
            nodes.extend(_causal_bias(graph, next(iter(past)), groups, kv_heads, head_dim))
        nodes.extend(_attention(node, pair, head_dim, replaced))
        replaced += 1
    if replaced:
        del graph.node[:]
        graph.node.extend(_live(nodes, {o.name for o in graph.output}))
        read = {i for n in graph.node for i in n.input}
        kept = [i for i in graph.initializer if i.name in read]  # the dropped mask's constants: ORT warns of each
        del graph.initializer[:]
        graph.initializer.extend(kept)
        log.info("attention of %d layers as grouped MatMuls", replaced)
    return replaced


def _attribute(node: onnx.NodeProto, name: str, default: float | None = None) -> float | int | None:
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _concats(node: onnx.NodeProto, producers: dict[str, onnx.NodeProto],
             past: dict[str, onnx.ValueInfoProto]) -> tuple[onnx.NodeProto, onnx.NodeProto] | None:
    """The Concat(past_key, new key) and Concat(past_value, new value) behind an attention node's key and value,
    or None where the node is not fed that way (then it stays as it is)."""
    found = []
    for name in node.input[1:3]:
        for op in _EXPANSION:
            source = producers.get(name)
            if source is None or source.op_type != op:
                return None
            name = source.input[0]
        if source.input[0] not in past or len(source.input) != 2:
            return None
        found.append(source)
    if any(name for name in node.input[3:5]):  # a bias or padding mask of its own: not the export's graph
        return None
    return found[0], found[1]


def _causal_bias(graph: onnx.GraphProto, past_name: str, groups: int, kv_heads: int,
                 head_dim: int) -> list[onnx.NodeProto]:
    """Nodes computing `_BIAS` once for all layers from the inputs' shapes: new position i (row g * n + i of every
    group g) sees keys 0 .. past + i. Also the layers' shared reshape targets."""
    graph.initializer.extend([
        helper.make_tensor("grouped_zero", TensorProto.INT64, [], [0]),
        helper.make_tensor("grouped_step", TensorProto.INT64, [], [1]),
        helper.make_tensor("grouped_open", TensorProto.FLOAT, [], [0.0]),
        helper.make_tensor("grouped_shut", TensorProto.FLOAT, [], [float("-inf")]),
        helper.make_tensor("grouped_tiles", TensorProto.INT64, [2], [groups, 1]),
        helper.make_tensor("grouped_column", TensorProto.INT64, [1], [1]),
        helper.make_tensor("grouped_q5", TensorProto.INT64, [5], [0, 0, kv_heads, groups, head_dim]),
        helper.make_tensor("grouped_q4", TensorProto.INT64, [4], [0, kv_heads, -1, head_dim]),
        helper.make_tensor("grouped_o5", TensorProto.INT64, [5], [0, kv_heads, groups, -1, head_dim]),
        helper.make_tensor("grouped_o3", TensorProto.INT64, [3], [0, 0, -1]),
    ])
    make = helper.make_node
    return [
        make("Shape", [past_name], ["grouped_past1"], start=2, end=3),
        make("Shape", ["input_ids"], ["grouped_new1"], start=1, end=2),
        make("Squeeze", ["grouped_past1"], ["grouped_past"]),
        make("Squeeze", ["grouped_new1"], ["grouped_new"]),
        make("Add", ["grouped_past", "grouped_new"], ["grouped_total"]),
        make("Range", ["grouped_zero", "grouped_total", "grouped_step"], ["grouped_keys"]),
        make("Range", ["grouped_past", "grouped_total", "grouped_step"], ["grouped_queries1"]),
        make("Unsqueeze", ["grouped_queries1", "grouped_column"], ["grouped_queries"]),
        make("LessOrEqual", ["grouped_keys", "grouped_queries"], ["grouped_allowed"]),
        make("Where", ["grouped_allowed", "grouped_open", "grouped_shut"], ["grouped_bias1"]),
        make("Tile", ["grouped_bias1", "grouped_tiles"], [_BIAS]),
    ]


def _attention(node: onnx.NodeProto, concats: tuple[onnx.NodeProto, onnx.NodeProto], head_dim: int,
               index: int) -> list[onnx.NodeProto]:
    """The nodes standing in for `node`, writing its output [b, n, heads * head_dim] from the presents."""
    scale = _attribute(node, "scale", 0.0) or head_dim ** -0.5  # MultiHeadAttention's default
    key, value = concats[0].output[0], concats[1].output[0]  # [b, kv_heads, past + n, head_dim]
    name = lambda what: f"grouped_{what}_{index}"  # noqa: E731
    make = helper.make_node
    return [
        make("Constant", [], [name("scale")], value=helper.make_tensor("s", TensorProto.FLOAT, [], [scale])),
        make("Mul", [node.input[0], name("scale")], [name("q")]),  # scaling q: 896 numbers, not the scores
        # [b, n, kv, groups, d] -> [b, kv, groups, n, d] -> [b, kv, groups * n, d]: a KV head's query rows together
        make("Reshape", [name("q"), "grouped_q5"], [name("q5")]),
        make("Transpose", [name("q5")], [name("qt")], perm=[0, 2, 3, 1, 4]),
        make("Reshape", [name("qt"), "grouped_q4"], [name("q4")]),
        make("Transpose", [key], [name("kt")], perm=[0, 1, 3, 2]),  # ORT folds it into the MatMul (transB)
        make("MatMul", [name("q4"), name("kt")], [name("scores")]),
        make("Add", [name("scores"), _BIAS], [name("masked")]),
        make("Softmax", [name("masked")], [name("probs")], axis=-1),
        make("MatMul", [name("probs"), value], [name("o4")]),
        make("Reshape", [name("o4"), "grouped_o5"], [name("o5")]),
        make("Transpose", [name("o5")], [name("ot")], perm=[0, 3, 1, 2, 4]),
        make("Reshape", [name("ot"), "grouped_o3"], [node.output[0]]),
    ]


def _live(nodes: list[onnx.NodeProto], outputs: set[str]) -> list[onnx.NodeProto]:
    """`nodes` without those whose outputs nothing reads (the old expansion, the mask no op takes now)."""
    needed = set(outputs)
    kept = []
    for node in reversed(nodes):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(i for i in node.input if i)
    return kept[::-1]
