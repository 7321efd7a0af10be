"""Constrained decoding: request specs to grammars, compiled off the engine loop, and the
per-step next-token bitmasks the sampler applies (llguidance backend)."""
