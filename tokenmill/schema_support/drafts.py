"""The JSON Schema drafts served: 2020-12 (the default), 2019-09, draft 7 and draft 6, read from `$schema`."""

from __future__ import annotations

from typing import Any

from tokenmill.schema_support.core import UnsupportedSchema

DRAFTS = {
    "https://json-schema.org/draft/2020-12/schema": "2020-12",
    "https://json-schema.org/draft/2019-09/schema": "2019-09",
    "http://json-schema.org/draft-07/schema": "7",
    "http://json-schema.org/draft-06/schema": "6",
}


def draft_of(schema: Any) -> str:
    """The draft a schema declares with `$schema` (2020-12 if none); drafts before 6 are refused."""
    declared = schema.get("$schema") if isinstance(schema, dict) else None
    if declared is None:
        return "2020-12"
    draft = DRAFTS.get(str(declared).rstrip("#"))
    if draft is None:
        raise UnsupportedSchema("$schema", "/$schema", f"{declared!r} is not supported (2020-12, 2019-09, draft 7, draft 6 are)")
    return draft


def validator_class(draft: str) -> Any:
    """The `jsonschema` validator class of a draft `draft_of` named."""
    from jsonschema import Draft6Validator, Draft7Validator, Draft201909Validator, Draft202012Validator

    return {"2020-12": Draft202012Validator, "2019-09": Draft201909Validator, "7": Draft7Validator,
            "6": Draft6Validator}[draft]


def specification(draft: str) -> Any:
    """The `referencing` specification of a draft `draft_of` named."""
    import referencing.jsonschema as rj

    return {"2020-12": rj.DRAFT202012, "2019-09": rj.DRAFT201909, "7": rj.DRAFT7, "6": rj.DRAFT6}[draft]
