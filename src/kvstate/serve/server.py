"""Loading a model directory for serving and running the server under uvicorn (``kvstate serve``).

The model is loaded with :func:`kvstate.models.load_model` (checked: config, weights, manifest) and
its tokenizer with transformers' ``AutoTokenizer`` from the same directory, offline; a directory
without a tokenizer, or a port that cannot be bound, is one :class:`KVStateError` naming the fix. Before
the model is loaded, a ``--remote`` tier is connected and PINGed: one that cannot be used (refused, timed
out, not Redis, no such database) is one :class:`RemoteUnavailable` naming the URL and the error, or, with
``--remote-optional``, a one-line warning on stderr, and the server starts serving local-only (the engine
retries the tier while it serves, so it is used once it answers).

The first SIGTERM (or Ctrl-C) drains with a deadline (:class:`DrainingServer`): the app's ``drain`` stops
admitting and ends what still runs after ``--shutdown-grace`` seconds, then uvicorn closes the sockets and
the process exits 0; a second signal stops at once, as uvicorn does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from kvstate.errors import KVStateError
from kvstate.models import load_model
from kvstate.models.loading import load_tokenizer
from kvstate.serve.config import ServeConfig


def check_port(host: str, port: int) -> None:
    """Refuse a host/port that cannot be bound before the model is loaded."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise KVStateError(f"--host {host!r} does not resolve ({exc}); pass an address such as 127.0.0.1") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            raise KVStateError(f"--host {host} --port {port} cannot be bound ({exc.strerror or exc}); pass a free "
                               "--port") from None


def check_remote(url: str, optional: bool = False) -> None:
    """Connect to the shared tier at ``url`` and PING it; :class:`RemoteUnavailable` naming the URL and the error
    when it cannot be used, or with ``optional`` a one-line warning on stderr instead."""
    from kvstate.prefix.remote import RedisTier, RemoteUnavailable

    tier = RedisTier(url)
    try:
        tier.ping()
    except RemoteUnavailable as exc:
        why = str(exc).rstrip(".")
        if not optional:
            raise RemoteUnavailable(f"{why}; start Redis there, fix --remote, or pass --remote-optional to start "
                                    "local-only") from None
        sys.stderr.write(f"warning: {why}; starting local-only (--remote-optional), the tier is retried while "
                         "serving\n")
        sys.stderr.flush()
    finally:
        tier.close()


SHUTDOWN_FLUSH_S = 2  # after the drain, how long the last events may take to reach slow clients


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first exit signal runs ``drain()`` (while the sockets still answer, with 503s)
    before uvicorn's own shutdown; the process then exits 0, not by the signal re-raised."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain = drain
        self._signalled = False
        self._draining: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._signalled:  # a second signal: uvicorn's shutdown now, whatever still runs
            super().handle_exit(sig, frame)
            return
        self._signalled = True
        if self._loop is not None:  # admission stops at the loop's next turn, not at the next tick
            self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        if self._signalled and self._draining is None:
            self._draining = asyncio.ensure_future(self._drain())

    async def on_tick(self, counter: int) -> bool:
        self._begin_drain()  # a signal before the loop was known
        if self._draining is not None and self._draining.done():
            if not self._draining.cancelled() and self._draining.exception() is not None:
                sys.stderr.write(f"error: the shutdown drain failed ({self._draining.exception()!r}); stopping\n")
            return True
        return await super().on_tick(counter)

    @property
    def drained(self) -> bool:
        """A signal ran the drain to its end (no second signal cut it short)."""
        return (self._draining is not None and self._draining.done() and not self._draining.cancelled()
                and self._draining.exception() is None and not self._captured_signals)


def serve_app(app: Any, host: str, port: int) -> None:
    """Serve ``app`` (made by :func:`kvstate.serve.app.create_app`) until a signal, draining it first."""
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=SHUTDOWN_FLUSH_S), app.state.drain)
    server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)
    if server.drained:  # every request is over and the lifespan has ended: exit now, not after the interpreter's
        logging.shutdown()  # teardown of torch (a second on a busy machine, counted against the orchestrator's grace)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run(model_dir: str | Path, config: ServeConfig, host: str = "127.0.0.1", port: int = 8000,
        remote_optional: bool = False) -> None:
    """Load ``model_dir`` and serve it until interrupted (``remote_optional``: see :func:`check_remote`)."""
    from kvstate.models.compat import hf_logging
    from kvstate.serve.app import create_app

    if not Path(model_dir).is_dir():
        what = "is not a directory" if Path(model_dir).exists() else "does not exist"
        raise KVStateError(f"--model {model_dir}: the model directory {what}; pass a directory holding the model's "
                           "config, weights and tokenizer")
    check_port(host, port)
    if config.remote is not None:
        check_remote(config.remote, optional=remote_optional)
    hf_logging().disable_progress_bar()  # the server logs nothing per load step
    tokenizer = load_tokenizer(model_dir)  # the cheaper check first
    model = load_model(model_dir)
    app = create_app(model, tokenizer, config)
    serve_app(app, host, port)
