"""A seeded generator of JSON schemas for structured-output validity tests and benchmarks.

Every schema bounds the length of what it admits (strings by maxLength or a bounded pattern,
numbers by minimum/maximum, arrays by maxItems, objects by additionalProperties: false), so a
constrained generation completes within a few hundred tokens even when the weights are random:
the test then demands that every output parses and validates. Features covered: nested
objects, required / optional properties, arrays with min/maxItems, enums and consts, string
patterns and lengths, integers and numbers with bounds, booleans and nulls, anyOf, and
$defs/$ref.

    python tools/schema_corpus.py --count 2000 --seed 0 > schemas.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from typing import Any

_WORDS = ("id", "name", "count", "tags", "kind", "ok", "score", "when", "items", "meta",
          "value", "code", "label", "size", "note", "flag", "level", "unit", "rank", "owner")
_PATTERNS = ("^[a-z]{1,6}$", "^[A-Z][a-z]{0,4}$", "^[0-9]{2,4}-[0-9]{2}$", "^(ab|cd)+$",
             "^x[0-9a-f]{1,4}$", "^[a-z]+_[0-9]$")


class _Gen:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.defs: dict[str, Any] = {}

    def value(self, depth: int) -> dict[str, Any]:
        r = self.rng
        kinds = ["string", "integer", "number", "boolean", "enum", "null", "const", "pattern"]
        if depth > 0:
            kinds += ["object", "array", "anyOf", "ref"]
        kind = r.choice(kinds)
        if kind == "string":
            lo = r.randint(0, 3)
            return {"type": "string", "minLength": lo, "maxLength": lo + r.randint(0, 6)}
        if kind == "pattern":
            # A pattern with no length bound of its own gets one.
            return {"type": "string", "pattern": r.choice(_PATTERNS), "maxLength": 12}
        if kind == "integer":
            lo = r.randint(-1000, 1000)
            return {"type": "integer", "minimum": lo, "maximum": lo + r.randint(0, 5000)}
        if kind == "number":
            lo = r.randint(-100, 100)
            return {"type": "number", "minimum": lo, "maximum": lo + r.randint(1, 100)}
        if kind == "boolean":
            return {"type": "boolean"}
        if kind == "null":
            return {"type": "null"}
        if kind == "enum":
            pool = ["red", "green", "blue", 1, 2, 3.5, True, None, "a b", "x\"y"]
            return {"enum": r.sample(pool, r.randint(1, 4))}
        if kind == "const":
            return {"const": r.choice(["fixed", 7, False, "v1"])}
        if kind == "object":
            return self.obj(depth - 1)
        if kind == "array":
            lo = r.randint(0, 2)
            return {"type": "array", "items": self.value(depth - 1), "minItems": lo,
                    "maxItems": lo + r.randint(0, 2)}
        if kind == "anyOf":
            return {"anyOf": [self.value(depth - 1) for _ in range(r.randint(2, 3))]}
        name = f"d{len(self.defs)}"
        self.defs[name] = {}  # the name is taken before the definition nests more of them
        self.defs[name] = self.value(depth - 1)
        return {"$ref": f"#/$defs/{name}"}

    def obj(self, depth: int) -> dict[str, Any]:
        r = self.rng
        names = r.sample(_WORDS, r.randint(1, 4))
        props = {n: self.value(depth) for n in names}
        required = [n for n in names if r.random() < 0.7]
        out: dict[str, Any] = {"type": "object", "properties": props,
                               "additionalProperties": False}
        if required:
            out["required"] = required
        return out


def make_schema(seed: int, max_depth: int = 2) -> dict[str, Any]:
    """Schema number ``seed`` of the corpus (the same schema for the same seed, always)."""
    rng = random.Random(seed)
    gen = _Gen(rng)
    root = gen.obj(rng.randint(0, max_depth))
    if gen.defs:
        root["$defs"] = gen.defs
    return root


def corpus(count: int, seed: int = 0) -> list[dict[str, Any]]:
    return [make_schema(seed * 1_000_003 + i) for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for schema in corpus(args.count, args.seed):
        sys.stdout.write(json.dumps(schema) + "\n")


if __name__ == "__main__":
    main()
