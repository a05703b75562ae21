"""Small HTTP helpers shared by the routes: JSON out, bounded JSON in, the error shape."""

from __future__ import annotations

from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from router.protocol.errors import APIError, InvalidRequest, PayloadTooLarge

M = TypeVar("M", bound=BaseModel)


def json_response(content: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(content), status_code=status, media_type="application/json", headers=headers)


def error_response(error: APIError) -> Response:
    return json_response(error.body(), error.status)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"The request body is larger than the limit of {limit} bytes.", code="request_too_large")


def parse_model(model: type[M], body: bytes) -> M:
    """Validate a JSON body; every failure is a 400 that names the parameter."""
    if not body.strip():
        raise InvalidRequest("The request body is empty; send a JSON object.", code="invalid_json")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> InvalidRequest:
    err = exc.errors(include_url=False)[0]
    kind = err["type"]
    if kind == "json_invalid":
        return InvalidRequest(
            "We could not parse the JSON body of your request: " + str((err.get("ctx") or {}).get("error", "invalid JSON")),
            code="invalid_json",
        )
    if kind == "model_type":
        return InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    param = _param(err["loc"])
    if kind == "extra_forbidden":
        return InvalidRequest(f"Unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")
    if kind == "missing":
        return InvalidRequest(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    ctx_error = (err.get("ctx") or {}).get("error")
    message = str(ctx_error) if ctx_error is not None else err["msg"]
    return InvalidRequest(f"Invalid value for '{param}': {message}", param=param, code="invalid_value")


def _param(loc: tuple[int | str, ...]) -> str:
    # pydantic puts union branch names in loc ("str", "list[any]"); they mean nothing to a client.
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not out:
            out = part
        elif part not in ("str", "list[any]", "dict[str,any]") and not part.startswith("function-after["):
            out += f".{part}"
    return out


def int_param(raw: str, name: str, low: int, high: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise InvalidRequest(f"'{name}' must be an integer from {low} to {high}.", param=name, code="invalid_value")
    return value


def order_param(raw: str) -> Any:
    if raw not in ("asc", "desc"):
        raise InvalidRequest("'order' must be 'asc' or 'desc'.", param="order", code="invalid_value")
    return raw


def list_page(page: Any) -> dict[str, Any]:
    """A store ItemPage as the API's list object."""
    data = page.data
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": page.has_more,
    }
