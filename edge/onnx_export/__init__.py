"""Exporting the draft to ONNX (offline, once per weights): `export.py` writes and caches the graph."""
