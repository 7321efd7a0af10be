"""Constrained decoding: request specs to grammars, compiled off the engine loop by the backend
each spec is routed to (llguidance or xgrammar: spec.choose_backend, router.py), and the
per-step next-token bitmasks the sampler applies."""
