"""Decoding, written once: the modes and their tables, drafting, the speculative round, the local engine."""
