"""JSON Schema for structured outputs: what the grammar backend is given, and the check of every completion.

A grammar backend enforces a subset of JSON Schema and ignores the rest, so a schema is analysed before it is
queued (`prepare`) and every completion is validated after decoding (`completion_error`):

* `refs`: every `$ref` resolved inside the schema and rewritten to a local `#/$defs/tm<N>` pointer.
* `normaliser` with its keyword families (`combinators`, `objects`, `arrays`, `strings`, `numbers`): the bundled
  schema rewritten into a core subset xgrammar 0.2.9 and llguidance enforce in full (`xgrammar_gap` names what
  only llguidance does), each keyword kept, soundly rewritten or refused with `UnsupportedSchema` naming the
  keyword and its JSON pointer. Sound: every output the rewritten schema admits is valid under the original.
* `checks`: strict JSON, valid under the declared draft (`drafts`); a completion failing it is unsatisfied.

Torch-free and xgrammar-free: `SamplingParams` runs `prepare` at the client, so refusals happen before queueing.
"""

from tokenmill.schema_support.analysis import prepare, xgrammar_gap
from tokenmill.schema_support.checks import completion_error, regex_error
from tokenmill.schema_support.core import UnsupportedSchema
from tokenmill.schema_support.drafts import draft_of, validator_class

__all__ = ["UnsupportedSchema", "completion_error", "draft_of", "prepare", "regex_error", "validator_class",
           "xgrammar_gap"]
