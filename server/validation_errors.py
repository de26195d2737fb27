"""A malformed request body's first problem as the 400 says it: the field, what was sent, what was
wrong and what to send instead, in words (pydantic's own messages name the type it wanted, not
what to do; its repr of the input is Python's, not JSON's)."""

from __future__ import annotations

import json

_UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}
_SHOWN = 60   # characters of the value sent that a message quotes

# pydantic error type -> (what was wrong, what to send); {sent} is the value as JSON
_WORDS = {
    "int_type": ("{sent} is not an integer", "send a whole number"),
    "int_parsing": ("{sent} is not an integer", "send a whole number, without quotes"),
    "int_from_float": ("{sent} is not a whole number", "send an integer"),
    "float_type": ("{sent} is not a number", "send a number"),
    "float_parsing": ("{sent} is not a number", "send a number, without quotes"),
    "bool_type": ("{sent} is not true or false", "send true or false"),
    "bool_parsing": ("{sent} is not true or false", "send true or false"),
    "string_type": ("{sent} is not a string", "send a string in quotes"),
    "list_type": ("{sent} is not a list", "send a JSON array"),
    "dict_type": ("{sent} is not an object", "send a JSON object"),
    "model_type": ("{sent} is not an object", "send a JSON object with the documented fields"),
    "model_attributes_type": ("{sent} is not an object", "send a JSON object with the documented fields"),
    "missing": ("this field is required but missing", "add it"),
    "literal_error": ("{sent} is not one of {expected}", "send one of them"),
    "enum": ("{sent} is not one of {expected}", "send one of them"),
    "greater_than_equal": ("{sent} is below the minimum, {ge}", "send a value of at least {ge}"),
    "greater_than": ("{sent} must be more than {gt}", "send a value above {gt}"),
    "less_than_equal": ("{sent} is above the maximum, {le}", "send a value of at most {le}"),
    "less_than": ("{sent} must be less than {lt}", "send a value below {lt}"),
    "too_short": ("it holds {actual_length} item(s), fewer than {min_length}", "send at least {min_length}"),
    "too_long": ("it holds more than {max_length} item(s)", "send at most {max_length}"),
    "string_too_short": ("{sent} is shorter than {min_length} character(s)", "send a longer string"),
    "string_too_long": ("it is longer than {max_length} characters", "send a shorter string"),
    "json_invalid": ("the body is not valid JSON ({error})", "send a JSON object"),
    "extra_forbidden": ("not a field of this endpoint", "drop it"),
}


def field_path(loc) -> str:
    """pydantic's error location as a field path: ('body', 'messages', 0, 'content', 'str') ->
    'messages[0].content' (the union member tags such as 'str' or 'list[int]' dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "body" and part not in _UNION_TAGS and "[" not in part and not part[:1].isupper():
            out += f".{part}" if out else part
    return out


def describe(error: dict) -> tuple[str | None, str]:
    """(the field's path or None, the message) for one of pydantic's errors."""
    where = field_path(error.get("loc", ()))
    words = _WORDS.get(error.get("type", ""))
    if words is None:   # a validator's own message (ours are in words already), or a type not listed
        message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        return where or None, f"{where or 'body'}: {message}"
    values = {"sent": _sent(error.get("input")), "expected": "", **(error.get("ctx") or {})}
    values = {k: (_plain(v) if k != "sent" else v) for k, v in values.items()}
    wrong, fix = (part.format(**values) for part in words)
    return where or None, f"{where or 'body'}: {wrong}; {fix}"


def _sent(value) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = str(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def _plain(value) -> str:
    """A pydantic context value (an expected literal list, a bound) without Python's quoting."""
    if isinstance(value, float):
        return f"{value:g}"
    return str(value).replace("'", '"') if isinstance(value, str) else str(value)
