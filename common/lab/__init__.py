"""Measurement only (benches, simulations, offline training): prompt sets, quality scores, plots, results pages.

Serving code (cloud/, edge/ outside edge/verifier_training/, the rest of common/) never imports it."""
