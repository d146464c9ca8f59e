"""The OpenAI request shapes the server accepts (pydantic, strict, unknown fields refused) and its error shape.

Requests are validated at the boundary: a field of the wrong type, an unknown field, a malformed body
become one :class:`RequestError` rendered as OpenAI's ``{"error": {"message", "type", "param", "code"}}``
with a 4xx status; text that is not valid Unicode (a lone surrogate, which JSON can carry) is refused naming its
field. Fields OpenAI defines but this server cannot honour (sampling with temperature > 0,
``n > 1``) are refused by name rather than ignored. Ignores: tools, logprobs, response formats.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvstate.errors import KVStateError


class RequestError(KVStateError):
    """A request the server refuses; carries the HTTP status and OpenAI's ``param`` / ``code``."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(" ".join(message.split()))
        self.status = status
        self.param = param
        self.code = code
        self.kind = kind

    def body(self) -> dict[str, Any]:
        return error_body(str(self), self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object; the message is one line (a lone surrogate in it is escaped: it can be sent)."""
    text = " ".join(message.split()).encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": text, "type": kind, "param": param, "code": code}}


def check_unicode(where: str, text: str, param: str) -> None:
    """A :class:`RequestError` naming ``where`` when ``text`` is not valid Unicode: JSON can carry a lone surrogate
    (``"\\ud800"``) that no tokenizer can read."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(f"{where}: character {exc.start} is a lone surrogate ({text[exc.start]!r}), which is not "
                           "valid Unicode text; send UTF-8 text (a character beyond U+FFFF as a surrogate pair)",
                           param=param) from None


class _Strict(BaseModel):
    # strict: "5" is not an int and 2.0 is not a count; forbid: a misspelt field is an error, not ignored
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | int | None = None
    top_p: float | int | None = None
    n: int | None = None
    seed: int | None = None  # accepted: greedy decoding is deterministic anyway
    user: str | None = None

    def stops(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stops) > 4 or any(not s for s in stops):
            raise RequestError(f"stop: give up to 4 non-empty strings, got {list(stops)!r}", param="stop")
        for s in stops:
            check_unicode("stop", s, "stop")
        return stops

    def check_sampling(self) -> None:
        if self.n not in (None, 1):
            raise RequestError(f"n={self.n}: this server returns one choice per request; pass n=1 or omit it",
                               param="n")
        if self.temperature not in (None, 0):
            raise RequestError(f"temperature={self.temperature}: this server decodes greedily; pass temperature=0 "
                               "or omit it", param="temperature")
        if self.top_p not in (None, 1):
            raise RequestError(f"top_p={self.top_p}: this server decodes greedily; pass top_p=1 or omit it",
                               param="top_p")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream=true", param="stream_options")


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One line and the ``param`` for pydantic's (FastAPI's) validation errors of a request body."""
    # a body that is not JSON, or a misspelt field, explains the rest: name it first
    ranked = sorted(errors, key=lambda e: e.get("type") not in ("json_invalid", "extra_forbidden"))
    first: dict[str, Any] = ranked[0] if ranked else {"msg": "invalid request", "loc": ()}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        ctx = first.get("ctx", {}).get("error", "")
        return f"the request body is not valid JSON ({ctx}); send one JSON object", None
    if kind == "extra_forbidden":
        return f"unknown field {param!r}; remove it (see the OpenAI API reference for the accepted fields)", param
    if kind == "missing" and not loc:
        return "the request body is empty; send one JSON object", None
    if kind == "model_attributes_type" and not loc:
        return "the request body must be a JSON object", None
    where = f"{param}: " if param else ""
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return f"{where}{first.get('msg', 'invalid value')}{more}", param
