"""Request bodies: strict JSON (RFC 8259: no NaN / Infinity constants), bounded nesting depth, validated
into an `api` model. Every failure is an `APIError` 400 naming what was wrong."""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from .errors import APIError

DEFAULT_MAX_DEPTH = 64
M = TypeVar("M", bound=BaseModel)


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON (use a number or null)")


def json_depth(obj, limit: int) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), counting at most to `limit` + 1; iterative."""
    deepest = 0
    stack = [(obj, 0)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, dict):
            x = x.values()
        elif not isinstance(x, list):
            continue
        d += 1
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        stack.extend((y, d) for y in x if isinstance(y, (dict, list)))
    return deepest


def parse_json(raw: bytes, max_depth: int = DEFAULT_MAX_DEPTH) -> dict:
    """A JSON object from `raw`, or APIError 400 (invalid JSON, not an object, nested deeper than max_depth)."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise APIError(400, f"the request body is nested deeper than {max_depth} levels", code="invalid_json") \
            from None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}",
                       code="invalid_json")
    if json_depth(data, max_depth) > max_depth:
        raise APIError(400, f"the request body is nested deeper than {max_depth} levels", code="invalid_json")
    return data


def validate(data: dict, model: type[M]) -> M:
    """`model.model_validate(data)`, its first error as an APIError 400 (param = the field's path)."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = f"unrecognized request argument {loc!r}"
        raise APIError(400, f"{loc + ': ' if loc else ''}{msg}", param=loc or None, code="invalid_value") from None
