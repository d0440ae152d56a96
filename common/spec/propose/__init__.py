"""Proposers: what proposes a block's tokens (the draft model, text copied from the context, or both) behind one interface."""
