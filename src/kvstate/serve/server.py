"""Loading a model directory for serving and running the server under uvicorn (``kvstate serve``).

The model is loaded with :func:`kvstate.models.load_model` (checked: config, weights, manifest) and
its tokenizer with transformers' ``AutoTokenizer`` from the same directory, offline; a directory
without a tokenizer, or a port that cannot be bound, is one :class:`KVStateError` naming the fix. Before
the model is loaded, a ``--remote`` tier is connected and PINGed: one that cannot be used (refused, timed
out, not Redis, no such database) is one :class:`RemoteUnavailable` naming the URL and the error, or, with
``--remote-optional``, a one-line warning on stderr, and the server starts serving local-only (the engine
retries the tier while it serves, so it is used once it answers).
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

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


def run(model_dir: str | Path, config: ServeConfig, host: str = "127.0.0.1", port: int = 8000,
        remote_optional: bool = False) -> None:
    """Load ``model_dir`` and serve it until interrupted (``remote_optional``: see :func:`check_remote`)."""
    import uvicorn

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
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
