"""Structured-output fields of a request -> the GrammarSpec the pipeline enforces (pipeline/grammar.py).

OpenAI's `response_format`:
    {"type": "text"}                                               no constraint
    {"type": "json_object"}                                        any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}
and vLLM's extension fields, under vLLM's names (one constraint per request):
    "guided_json": {...} (a schema)     "guided_regex": "..."     "guided_grammar": "..." (Lark / EBNF)
A schema is enforced as given whether `strict` is true or false (a grammar cannot be followed
loosely); whether it compiles is checked when the request arrives (LLM.check_request -> 400).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from tandem.pipeline.grammar import GrammarSpec
from tandem.pipeline.request_checks import RequestError


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: StrictStr = "response"
    description: StrictStr | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredFields(BaseModel):
    """The request fields this module reads (mixed into the request bodies of server/protocol.py)."""

    response_format: ResponseFormat | None = None
    guided_json: dict | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_grammar: StrictStr | None = None

    def grammar(self) -> GrammarSpec | None:
        """The request's constraint, or None; RequestError (-> 400) naming the field if it is malformed."""
        asked = [f for f in ("guided_json", "guided_regex", "guided_grammar") if getattr(self, f) is not None]
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            asked.insert(0, "response_format")
        if len(asked) > 1:
            raise RequestError(asked[1], f"{' and '.join(asked)} both constrain the output: send one of them")
        if not asked:
            return None
        if asked[0] == "response_format":
            if fmt.type == "json_object":
                return GrammarSpec("json_object")
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise RequestError("response_format", 'response_format: type "json_schema" needs '
                                   '"json_schema": {"name": ..., "schema": {...}}')
            return GrammarSpec.json_schema(fmt.json_schema.schema_, "response_format.json_schema.schema")
        if asked[0] == "guided_json":
            if isinstance(self.guided_json, str):
                return GrammarSpec("json_schema", self.guided_json, "guided_json")
            return GrammarSpec.json_schema(self.guided_json, "guided_json")
        if asked[0] == "guided_regex":
            return GrammarSpec("regex", self.guided_regex, "guided_regex")
        return GrammarSpec("lark", self.guided_grammar, "guided_grammar")
