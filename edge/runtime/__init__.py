"""What the edge runs per token: the draft (ONNX Runtime over a cached export, or torch) and the verifier."""
