#!/usr/bin/env python
"""The schema corpus through the engine: how many schemas are served, refused (before generation) or served
with completions that claim satisfaction but are invalid. Public API only, so it runs on any version:

    PYTHONPATH=. python benchmarks/schema_corpus.py [--per-schema 12]

Oracle: strict JSON (no NaN, no repeated keys) valid under the declared draft with `jsonschema` (format as
annotation), written here apart from the engine's own check.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

CORPUS = Path(_HERE).parent / "tests" / "data" / "schema_corpus.json"


def valid(schema: dict, text: str) -> bool:
    from jsonschema.validators import Draft202012Validator, validator_for

    def unique(pairs: list) -> dict:
        if len({k for k, _ in pairs}) != len(pairs):
            raise ValueError("repeated key")
        return dict(pairs)
    try:
        value = json.loads(text, object_pairs_hook=unique, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    except ValueError:
        return False
    try:
        return validator_for(schema, default=Draft202012Validator)(schema).is_valid(value)
    except Exception:  # noqa: BLE001 - e.g. a remote $ref, unresolvable offline: nothing can claim it is valid
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-schema", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    from tokenmill import LLM, InvalidRequestError, SamplingParams

    llm = LLM("builtin:tiny", max_num_batched_tokens=2048)
    rng = random.Random(0)
    counts = {"refused": 0, "engine error": 0, "served, all valid": 0, "served, invalid claimed valid": 0}
    wrong: list[str] = []
    cases = [c for c in json.loads(CORPUS.read_text()) if isinstance(c["schema"], dict)]
    for case in cases:
        try:
            params = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, json_schema=case["schema"])
                      for i in range(args.per_schema)]
        except InvalidRequestError:
            counts["refused"] += 1
            wrong += [f"{case['name']}: refused, expected served"] if case["expect"] == "serve" else []
            continue
        prompts = [[rng.randrange(256) for _ in range(8)] for _ in params]
        outs = llm.generate(prompts, params, use_tqdm=False)
        if any(o.finish_reason == "error" for o in outs):
            counts["engine error"] += 1
            continue
        bad = sum(bool(o.constraint_satisfied) and not valid(case["schema"], o.text) for o in outs)
        counts["served, invalid claimed valid" if bad else "served, all valid"] += 1
        if bad:
            wrong.append(f"{case['name']}: {bad}/{len(outs)} invalid completions marked satisfied")
        elif case["expect"] == "refuse":
            wrong.append(f"{case['name']}: served, expected refused (all claimed completions valid)")
    print(f"{len(cases)} schemas (object schemas of {CORPUS.name}), {args.per_schema} seeded completions each")
    for name, count in counts.items():
        print(f"  {name:32s} {count}")
    print("\n".join(["differences from the corpus's expectation:", *wrong]) if wrong else "all as the corpus expects")


if __name__ == "__main__":
    main()
