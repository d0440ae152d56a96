"""The settings of `sprinter bench`'s benches and their commands, a module per group of benches.

engines, capacity, trees, operations and sweeps each hold their benches' settings dataclasses and `Bench` entries
(sim/bench/registry.py), ending with `BENCHES`. They import nothing heavy, apart from the modules that measure
(sim/bench/local.py, cloud.py, ...), which load torch, gRPC or ONNX Runtime, so that building `sprinter`'s parser
(sim/bench/command.py) stays light.
"""
