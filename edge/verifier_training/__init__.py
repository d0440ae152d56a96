"""The SPRINTER verifier, offline: collect data on the pair's decoding path, train, evaluate, export.

`sprinter verifier collect | train | eval` (command.py). The runtime that loads what this pipeline
exports is edge/runtime/verifier.py; nothing in the edge's serving path imports this package.
"""
