#!/usr/bin/env python
"""Schema corpora through the engine, per grammar backend: how many schemas are served, refused (before
generation), served with a completion the final check failed, or served with a completion that claims
satisfaction but is invalid (must be 0). Public API only.

    PYTHONPATH=. python benchmarks/schema_corpus.py [--per-schema 4] [--backends auto,xgrammar,llguidance]

Corpora (`--corpus`, default all):
* everyday: benchmarks/data/schema_everyday.json, pydantic models, function-call signatures, config schemas
  (written by benchmarks/data/make_everyday.py);
* suite: benchmarks/data/schema_suite.json, every test group's schema of JSON-Schema-Test-Suite draft 2020-12
  and draft 7 (MIT; feature-heavy by construction: one keyword's corner cases per group);
* tests: tests/data/schema_corpus.json, the issue's failure classes (feature-heavy).

Oracle: strict JSON (no NaN, no repeated keys) valid under the declared draft with `jsonschema` (format as
annotation), written here apart from the engine's own check. The "llguidance alone" column is the baseline of the
issue: llguidance's strict mode given the schema unchanged, counted by grammar validation (no model).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

CORPORA = {"everyday": Path(_HERE) / "data" / "schema_everyday.json", "suite": Path(_HERE) / "data" / "schema_suite.json",
           "tests": Path(_HERE).parent / "tests" / "data" / "schema_corpus.json"}


def load(name: str) -> list[dict]:
    data = json.loads(CORPORA[name].read_text())
    cases = data["schemas"] if isinstance(data, dict) else data
    out = []
    for case in cases:
        schema = case["schema"]
        out.append({"name": case["name"], "schema": schema if isinstance(schema, dict) else {"allOf": [schema]},
                    "group": "everyday" if name == "everyday" else "feature-heavy"})
    return out


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


def llguidance_alone(cases: list[dict]) -> int:
    """Schemas llguidance's strict mode accepts as given (no rewrite): the baseline to beat."""
    import llguidance as llg

    served = 0
    for case in cases:
        grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(case["schema"]), defaults={"lenient": False})
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
        served += not failed and not messages
    return served


def run(llm: object, cases: list[dict], per_schema: int, max_tokens: int) -> dict[str, object]:
    from tokenmill import InvalidRequestError, SamplingParams

    counts = {"schemas": len(cases), "refused": 0, "backend refused": 0, "served": 0, "final-check failures": 0,
              "invalid claimed valid": 0}
    params, owners, wrong = [], [], []
    for index, case in enumerate(cases):
        try:
            params += [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, json_schema=case["schema"])
                       for i in range(per_schema)]
            owners += [index] * per_schema
        except InvalidRequestError:
            counts["refused"] += 1
    prompts = [[(7 * i + 3) % 250 + 3 for i in range(k, k + 8)] for k in range(len(params))]
    outs = llm.generate(prompts, params, use_tqdm=False)  # type: ignore[attr-defined]
    by_case: dict[int, list] = {}
    for owner, out in zip(owners, outs):
        by_case.setdefault(owner, []).append(out)
    backends: dict[str, int] = {}
    for index, case_outs in by_case.items():
        if any(o.finish_reason == "error" for o in case_outs):
            counts["backend refused"] += 1
            continue
        counts["served"] += 1
        for backend in {o.constraint_backend for o in case_outs}:
            backends[backend] = backends.get(backend, 0) + 1
        counts["final-check failures"] += any(o.constraint_error for o in case_outs)
        bad = sum(bool(o.constraint_satisfied) and not valid(cases[index]["schema"], o.text) for o in case_outs)
        if bad:
            counts["invalid claimed valid"] += 1
            wrong.append(f"{cases[index]['name']}: {bad}/{len(case_outs)} invalid completions marked satisfied")
        for out in case_outs:
            if out.constraint_error:
                wrong.append(f"{cases[index]['name']}: final check: {out.constraint_error[:160]}")
    return {**counts, "by backend": backends, "notes": wrong}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-schema", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--backends", default="auto,xgrammar,llguidance")
    parser.add_argument("--corpus", default="everyday,suite,tests")
    parser.add_argument("--verbose", action="store_true", help="list each final-check failure and invalid schema")
    args = parser.parse_args()
    from tokenmill import LLM

    cases = [case for name in args.corpus.split(",") for case in load(name)]
    groups = {group: [c for c in cases if c["group"] == group] for group in ("everyday", "feature-heavy")}
    print(f"corpora {args.corpus}: {len(cases)} schemas; {args.per_schema} seeded completions each on builtin:tiny, "
          f"max_tokens {args.max_tokens}; load average {os.getloadavg()[0]:.1f}\n")
    print("| backend | group | schemas | served | refused (client) | refused (backend) | final-check failures "
          "| invalid claimed valid | llguidance alone | backends used |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    baseline = {group: llguidance_alone(group_cases) for group, group_cases in groups.items()}
    notes = []
    for backend in args.backends.split(","):
        llm = LLM("builtin:tiny", max_num_batched_tokens=4096, constraint_backend=backend)
        for group, group_cases in groups.items():
            if not group_cases:
                continue
            r = run(llm, group_cases, args.per_schema, args.max_tokens)
            n, served = r["schemas"], r["served"]
            print(f"| {backend} | {group} | {n} | {served} ({100 * served / n:.0f}%) | {r['refused']} | {r['backend refused']} "
                  f"| {r['final-check failures']} ({100 * r['final-check failures'] / n:.1f}%) | {r['invalid claimed valid']} "
                  f"| {baseline[group]} ({100 * baseline[group] / n:.0f}%) | "
                  f"{', '.join(f'{k} {v}' for k, v in sorted(r['by backend'].items()))} |", flush=True)
            notes += [f"[{backend}] {note}" for note in r["notes"]]
    if args.verbose and notes:
        print("\n" + "\n".join(notes))


if __name__ == "__main__":
    main()
