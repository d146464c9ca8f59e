"""The OpenAI request shapes the server accepts (pydantic, strict, unknown fields refused) and its error shape.

Requests are validated at the boundary: a field of the wrong type, an unknown field, a malformed body
become one :class:`RequestError` rendered as OpenAI's ``{"error": {"message", "type", "param", "code"}}``
with a 4xx status; text that is not valid Unicode (a lone surrogate, which JSON can carry) is refused naming its
field. Fields OpenAI defines but this server cannot honour (``n > 1``, non-zero presence / frequency
penalties, ``echo``, logprobs while streaming) are refused by name rather than ignored.

Accepted with their meaning (OpenAI's and vLLM's, which every benchmark client sends): ``temperature``,
``top_p``, ``top_k``, ``seed``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``skip_special_tokens``, ``add_special_tokens``, ``max_completion_tokens``, ``logprobs`` (completions:
a count; chat: ``logprobs`` + ``top_logprobs``), ``stream_options.include_usage`` and
``stream_options.continuous_usage_stats``. Accepted and ignored (:data:`IGNORED_FIELDS`: they change
nothing a single-choice server computes): ``user``, ``store``, ``metadata``, ``service_tier``. Any other
field is a 400 naming it. Ignores: tools, response formats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvstate.errors import KVStateError
from kvstate.serve.sampling import SamplingParams


class RequestError(KVStateError):
    """A request the server refuses; carries the HTTP status, OpenAI's ``param`` / ``code``, and for a 503 the
    seconds after which a retry may succeed (sent as ``Retry-After``)."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", retry_after: int | None = None) -> None:
        super().__init__(" ".join(message.split()))
        self.status = status
        self.param = param
        self.code = code
        self.kind = kind
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}

    def body(self) -> dict[str, Any]:
        return error_body(str(self), self.kind, self.param, self.code)


MAX_MESSAGE_CHARS = 1000  # an error message is cut here: a refusal never echoes a large input back


def brief(values: Sequence[Any], keep: int = 4, chars: int = 40) -> str:
    """``values`` for an error message: the first ``keep``, each repr cut at ``chars``, and how many in all."""
    shown = []
    for v in list(values[:keep]):
        r = repr(v)
        shown.append(r if len(r) <= chars else f"{r[:chars]}… ({len(r):,} characters)")
    more = f", … ({len(values):,} in all)" if len(values) > keep else ""
    return f"[{', '.join(shown)}{more}]"


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object; the message is one line of at most about ``MAX_MESSAGE_CHARS`` (a lone surrogate in
    it is escaped: it can be sent)."""
    text = " ".join(message.split()).encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) > MAX_MESSAGE_CHARS:
        text = f"{text[:MAX_MESSAGE_CHARS]}… (message cut, {len(text):,} characters)"
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


IGNORED_FIELDS = ("user", "store", "metadata", "service_tier")  # accepted, documented, no effect


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | int | None = None
    top_p: float | int | None = None
    top_k: int | None = None  # vLLM; 0 or -1: off
    n: int | None = None
    seed: int | None = None
    repetition_penalty: float | int | None = None  # vLLM
    presence_penalty: float | int | None = None  # only 0 is served
    frequency_penalty: float | int | None = None  # only 0 is served
    min_tokens: int | None = None  # vLLM: end-of-sequence banned before this many tokens
    ignore_eos: bool = False  # vLLM: an end-of-sequence token does not end the reply
    skip_special_tokens: bool = True  # vLLM
    add_special_tokens: bool | None = None  # vLLM: the tokenizer's special tokens around a text prompt
    max_completion_tokens: int | None = None
    user: str | None = None  # accepted and ignored (IGNORED_FIELDS)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    LOGPROBS_FIELD: ClassVar[str] = "logprobs"  # the field that asks for top logprobs per token

    def stops(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stops) > 4 or any(not s for s in stops):
            raise RequestError(f"stop: give up to 4 non-empty strings, got {brief(stops)}", param="stop")
        for s in stops:
            check_unicode("stop", s, "stop")
        return stops

    def top_logprobs_asked(self) -> int | None:
        """Top logprobs per token the request asks for (None: no logprobs)."""
        return None

    def check_sampling(self) -> None:
        if self.n not in (None, 1):
            raise RequestError(f"n={self.n}: this server returns one choice per request; pass n=1 or omit it",
                               param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise RequestError(f"{name}={getattr(self, name)}: this server does not apply it; pass 0 or omit "
                                   "it (repetition_penalty is served)", param=name)
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream=true", param="stream_options")
        if self.stream and self.top_logprobs_asked() is not None:
            raise RequestError("logprobs are returned for stream=false only; drop logprobs or stream",
                               param="logprobs")

    def sampling(self, default: SamplingParams, max_tokens: int) -> SamplingParams | None:
        """The request's sampling on top of the model's ``default``; None when it sets nothing (the default
        applies). A value out of range is a 400 naming the field."""
        fields: dict[str, Any] = {}
        if self.temperature is not None:
            fields["temperature"] = float(self.temperature)
        if self.top_p is not None:
            fields["top_p"] = float(self.top_p)
        if self.top_k is not None:
            fields["top_k"] = 0 if self.top_k == -1 else self.top_k  # vLLM: -1 is off
        if self.repetition_penalty is not None:
            fields["repetition_penalty"] = float(self.repetition_penalty)
        for name in ("seed", "min_tokens"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.ignore_eos:
            fields["ignore_eos"] = True
        if self.top_logprobs_asked() is not None:
            fields["logprobs"] = self.top_logprobs_asked()
        if (self.min_tokens or 0) > max_tokens:
            raise RequestError(f"min_tokens={self.min_tokens} is above the reply's {max_tokens} tokens at most; lower "
                               "min_tokens or raise max_tokens", param="min_tokens")
        if not fields:
            return None
        try:
            return replace(default, **fields)
        except KVStateError as exc:
            name = str(exc).split(".", 1)[-1].split(" ", 1)[0]
            message = str(exc).replace("SamplingParams.", "")
            param = name if name in fields else None
            if name == "logprobs":  # named as the request asks for the count (chat: top_logprobs)
                message, param = message.replace("logprobs", self.LOGPROBS_FIELD, 1), self.LOGPROBS_FIELD
            raise RequestError(message, param=param) from None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # top logprobs per token (OpenAI: up to 5; here up to 20)
    echo: bool = False  # only false is served

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    def check_sampling(self) -> None:
        super().check_sampling()
        if self.echo:
            raise RequestError("echo=true is not served; the reply never repeats the prompt", param="echo")


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
    logprobs: bool = False
    top_logprobs: int | None = None
    LOGPROBS_FIELD: ClassVar[str] = "top_logprobs"

    def top_logprobs_asked(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


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
