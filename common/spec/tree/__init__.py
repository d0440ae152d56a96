"""Draft trees: several candidate paths in one verify, how they grow, what they cost, and their acceptance rules."""
