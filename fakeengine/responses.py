"""Protocol-neutral response helpers: errors, JSON, server-sent events and deliberate garbage."""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from fastapi.responses import Response, StreamingResponse

from fakeengine.state import GarbageKind

JSON_MEDIA_TYPE = "application/json"
HTML_ERROR_PAGE = (
    "<!DOCTYPE html><html><head><title>502 Bad Gateway</title></head>"
    "<body><h1>502 Bad Gateway</h1><p>fake engine garbage</p></body></html>"
)


class ApiError(Exception):
    """Rendered by the active backend in its own error shape."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class RankOutOfRange(ApiError):
    """A request pinned to a data-parallel rank the engine does not have (400)."""

    def __init__(self, message: str) -> None:
        super().__init__(400, message)


class ClientGone(Exception):
    """The client went away while the request was parked; nobody will read a response."""


def status_type(status: int) -> str:
    """OpenAI-style error type for a status, e.g. 400 -> ``BadRequestError``."""
    try:
        phrase = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
    except ValueError:
        return "Error"
    return phrase if phrase.endswith("Error") else phrase + "Error"


def encode_json(body: object) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def json_response(body: object, status: int = 200) -> Response:
    return Response(encode_json(body), status_code=status, media_type=JSON_MEDIA_TYPE)


def sse_response(events: AsyncIterator[dict[str, Any]], *, done_marker: bool) -> Response:
    async def lines() -> AsyncIterator[bytes]:
        async for event in events:
            yield b"data: " + encode_json(event) + b"\n\n"
        if done_marker:
            yield b"data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")


def generation_response(body: dict[str, Any], garbage: GarbageKind | None) -> Response:
    """A successful generation body, or the requested kind of broken one (still HTTP 200)."""
    if garbage is None:
        return json_response(body)
    if garbage == "invalid_json":
        return Response(b"{not json", media_type=JSON_MEDIA_TYPE)
    if garbage == "html":
        return Response(HTML_ERROR_PAGE, media_type="text/html")
    if garbage == "empty":
        return Response(b"", media_type=JSON_MEDIA_TYPE)
    if garbage == "truncated":
        encoded = encode_json(body)
        return Response(encoded[: len(encoded) // 2], media_type=JSON_MEDIA_TYPE)
    if garbage == "no_finish_reason":
        return json_response(_without_finish_reason(body))
    if garbage == "wrong_token_count":
        return json_response(_with_extra_token(body))
    return Response(encode_json(body), media_type="text/plain")


def _containers(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The dicts of any of our response shapes that may carry finish reasons or token counts."""
    found = [body]
    for key in ("usage", "meta_info"):
        if isinstance(body.get(key), dict):
            found.append(body[key])
    found.extend(choice for choice in body.get("choices", []) if isinstance(choice, dict))
    return found


def _without_finish_reason(body: dict[str, Any]) -> dict[str, Any]:
    stripped = copy.deepcopy(body)
    for container in _containers(stripped):
        for key in ("finish_reason", "stop_type", "stop"):
            container.pop(key, None)
    return stripped


def _with_extra_token(body: dict[str, Any]) -> dict[str, Any]:
    bumped = copy.deepcopy(body)
    for container in _containers(bumped):
        for key in ("completion_tokens", "total_tokens", "tokens_predicted"):
            if isinstance(container.get(key), int):
                container[key] += 1
    return bumped
