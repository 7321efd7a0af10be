"""Speculative decoding on the worker: the draft proposers (n-gram, draft model, EAGLE-3)
and the verify step."""
