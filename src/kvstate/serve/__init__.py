"""kvstate.serve — an OpenAI-compatible HTTP server with the sparse prefix cache under every request.

``kvstate serve --model DIR`` answers ``/v1/completions`` and ``/v1/chat/completions`` (OpenAI's and vLLM's
request fields, greedy or sampled, ``stream=true`` as server-sent events), ``/v1/models``, ``/health``,
``/metrics`` (Prometheus text) and ``/v1/cache/events`` (the prefix cache's store / evict events).
Each request's prompt is prefilled through :class:`kvstate.prefix.SparsePrefixCache` (it resumes from
the deepest stored state) and its reply is inserted after generation, so the next turn of a chat resumes
from the end of the previous one. See ``docs/techniques.md`` ("Serving").

Why FastAPI + uvicorn: the OpenAI request and error shapes are pydantic models validated at the
boundary (FastAPI's own request parsing), streaming responses and client-disconnect detection come from
Starlette, and uvicorn is the ASGI server most Python inference servers (vLLM, SGLang) ship with — a
well-kept stack instead of a hand-written HTTP layer. One worker thread owns the model and batches the
requests (continuous batching, :mod:`kvstate.serve.scheduler`) from a bounded queue; the event loop only
parses and streams (a body over ``--max-body-bytes`` is refused 413 before it is read; prompts are
tokenized in a worker thread).

Modules: ``config`` (:class:`ServeConfig`), ``protocol`` (request models, error shape), ``chat`` (chat
template and message-end positions), ``text`` (incremental detokenization with stop strings),
``sampling`` (per-request sampler), ``generation`` (prefill through the cache, one request's decoding,
insert), ``batching`` (the decode batch over hybrid caches), ``policy`` (admission order and bounds),
``scheduler`` (bounded queue, one worker thread, continuous batching, cancellation), ``logprobs``
(response shapes), ``metrics`` (Prometheus collector), ``app`` (the FastAPI routes), ``server`` (loading a
model directory and running uvicorn).
"""

from kvstate.serve.config import ServeConfig

__all__ = ["ServeConfig"]
