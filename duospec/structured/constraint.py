"""What a constrained request asks for, as it travels from the API to both workers.

A `Constraint` is plain data (kind + text): the fronts build it from an OpenAI `response_format` /
`tools` or a gRPC `constraint`, the coordinator validates it by compiling it once, and the target
compiles the same text again where its matcher lives. Nothing here knows a grammar library.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

# A schema or grammar is compiled on both sides of the wire and held in the compile cache: bounded,
# so one request cannot make either side parse megabytes (the OpenAI body limit is larger).
MAX_CONSTRAINT_BYTES = 256 * 1024

# JSON as `json.dumps` writes it (", " and ": ", no other whitespace): what instruct models write, and no
# room for a model to pad a document with whitespace until max_tokens (llguidance's "x-guidance" options;
# a schema's own override them).
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}

# How long a compile may take before the request is refused (ServerSettings.grammar_compile_timeout_s).
DEFAULT_COMPILE_TIMEOUT_S = 10.0


class ConstraintKind(enum.Enum):
    JSON_SCHEMA = "json_schema"  # text: the schema as JSON
    JSON_OBJECT = "json_object"  # any JSON object (OpenAI's response_format json_object); text ""
    REGEX = "regex"  # text: the regular expression the whole output must match
    GRAMMAR = "grammar"  # text: a Lark grammar (llguidance's dialect: `start:` rule, /regex/ terminals)


class ConstraintError(ValueError):
    """A constraint that cannot be used: invalid, unsupported, too large, or too slow to compile.
    The fronts turn it into a 400 / INVALID_ARGUMENT naming the request field it came from."""


@dataclass(frozen=True)
class Constraint:
    kind: ConstraintKind
    text: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ConstraintKind):
            raise ConstraintError(f"kind {self.kind!r} is not a ConstraintKind")
        size = len(self.text.encode("utf-8"))
        if size > MAX_CONSTRAINT_BYTES:
            raise ConstraintError(f"is {size} bytes; at most {MAX_CONSTRAINT_BYTES} are accepted")
        if self.kind is not ConstraintKind.JSON_OBJECT and not self.text.strip():
            raise ConstraintError(f"a {self.kind.value} constraint needs a non-empty text")

    @classmethod
    def json_schema(cls, schema: dict | str) -> "Constraint":
        """From a schema object (or its JSON text), re-serialised compactly. Key order is kept: the grammar
        writes an object's properties in the order the schema lists them."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ConstraintError(f"is not valid JSON: {exc}") from None
        if schema is False:
            raise ConstraintError("the schema `false` matches no JSON value")
        if schema is True:
            schema = {}  # any JSON value, as an object schema (what the grammar compiler takes)
        if not isinstance(schema, dict):
            raise ConstraintError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls(ConstraintKind.JSON_SCHEMA, json.dumps(schema, separators=(",", ":")))
