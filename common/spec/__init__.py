"""The speculative round and what it is made of: modes, the round, the acceptance rules, the call policy, the verifier."""
