"""What a grammar backend is given: `prepare` (bundle the references, then normalise) and `xgrammar_gap`."""

from __future__ import annotations

import functools
import json
from typing import Any

from tokenmill.schema_support.core import escape
from tokenmill.schema_support.drafts import draft_of
from tokenmill.schema_support.normaliser import Normaliser
from tokenmill.schema_support.refs import Bundler


def prepare(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema a grammar backend can enforce in full, or UnsupportedSchema. Cached by the schema's text."""
    return json.loads(_prepared(json.dumps(schema, sort_keys=False)))


@functools.lru_cache(maxsize=256)
def _prepared(text: str) -> str:
    schema = json.loads(text)
    draft = draft_of(schema)
    root, defs, def_pointers = Bundler(schema, draft).run()
    return json.dumps(Normaliser(root, defs, def_pointers, draft).run())


def xgrammar_gap(prepared: Any, pointer: str = "") -> str | None:
    """Why xgrammar 0.2.9 cannot enforce a prepared schema in full (llguidance can), or None: a pattern beside
    minLength/maxLength, where xgrammar would ignore the length; patternProperties."""
    if isinstance(prepared, dict):
        if prepared.get("type") == "string" and "pattern" in prepared and ("minLength" in prepared or "maxLength" in prepared):
            return f"pattern at {pointer or '/'}: beside minLength/maxLength is enforced by llguidance only"
        if prepared.get("type") == "object" and isinstance(prepared.get("patternProperties"), dict):
            return f"patternProperties at {pointer or '/'}: is enforced by llguidance only"
        for key, value in prepared.items():
            if key not in ("enum", "const"):
                found = xgrammar_gap(value, f"{pointer}/{escape(key)}")
                if found:
                    return found
    elif isinstance(prepared, list):
        for i, value in enumerate(prepared):
            found = xgrammar_gap(value, f"{pointer}/{i}")
            if found:
                return found
    return None
