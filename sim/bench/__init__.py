"""Benchmarks (`sprinter bench ...`): local decoding modes (local), the cloud under N edges (cloud),
the edge's draft runtime (draft), call policies over the network sweep (policy), and the benchmarks
page's sweep table (readme)."""
