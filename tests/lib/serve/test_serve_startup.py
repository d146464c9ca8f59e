"""``kvstate serve`` fails fast, before the model is loaded, with one line on stderr and exit code 2: a ``--remote``
that cannot be used (closed port, a database the server lacks, a port that does not speak Redis, bad URL options)
and an empty ``--served-model-name``; ``--remote-optional`` starts local-only with a one-line warning instead."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvstate.cli import main
from tests.lib.prefix.redis_server import RedisServer, redis_server  # noqa: F401 (fixture)
from tests.lib.serve.conftest import free_port


class Loads:
    """Stands in for the model directory: records what ``kvstate serve`` loaded and the app it would run."""

    def __init__(self, tiny: tuple[Any, Any]) -> None:
        self.tiny, self.loaded, self.served = tiny, [], []  # type: ignore[var-annotated]

    def tokenizer(self, path: Any) -> Any:
        self.loaded.append("tokenizer")
        return self.tiny[1]

    def model(self, path: Any) -> Any:
        self.loaded.append("model")
        return self.tiny[0]


@pytest.fixture
def loads(tiny: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> Loads:
    import kvstate.serve.app
    import kvstate.serve.server

    rec = Loads(tiny)
    configs: list[Any] = []
    create = kvstate.serve.app.create_app
    monkeypatch.setattr(kvstate.serve.server, "load_tokenizer", rec.tokenizer)
    monkeypatch.setattr(kvstate.serve.server, "load_model", rec.model)
    monkeypatch.setattr(kvstate.serve.app, "create_app", lambda m, t, c: configs.append(c) or create(m, t, c))
    monkeypatch.setattr(kvstate.serve.server, "serve_app",
                        lambda app, host, port: rec.served.append((app, configs[-1], {"host": host, "port": port})))
    return rec


def _serve(capsys: pytest.CaptureFixture[str], tmp_path: Any, *args: str) -> tuple[int, list[str]]:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--model", str(tmp_path), "--port", str(free_port()), *args])
    return int(info.value.code or 0), capsys.readouterr().err.splitlines()


@pytest.fixture
def garbage_port() -> Iterator[int]:
    """A loopback port whose listener answers every connection with an HTTP error line (it does not speak Redis)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    srv.settimeout(0.2)
    stop = threading.Event()

    def answer() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    yield int(srv.getsockname()[1])
    stop.set()
    thread.join(5)
    srv.close()


def _assert_one_error(code: int, err: list[str], loads: Loads, *needles: str) -> None:
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and loads.loaded == [] and loads.served == []
    assert all(n in err[0] for n in needles), err


def test_a_closed_remote_port_exits_2_before_loading(loads: Loads, capsys: pytest.CaptureFixture[str],
                                                     tmp_path: Any) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    code, err = _serve(capsys, tmp_path, "--remote", url)
    _assert_one_error(code, err, loads, url, "--remote-optional")


def test_a_database_the_server_lacks_exits_2(loads: Loads, capsys: pytest.CaptureFixture[str], tmp_path: Any,
                                             redis_server: RedisServer) -> None:  # noqa: F811
    url = redis_server.url.rsplit("/", 1)[0] + "/99999"
    code, err = _serve(capsys, tmp_path, "--remote", url)
    _assert_one_error(code, err, loads, url, "DB index")


def test_a_port_that_does_not_speak_redis_exits_2(loads: Loads, capsys: pytest.CaptureFixture[str], tmp_path: Any,
                                                  garbage_port: int) -> None:
    url = f"redis://127.0.0.1:{garbage_port}/0"
    code, err = _serve(capsys, tmp_path, "--remote", url)
    _assert_one_error(code, err, loads, url)


def test_a_bad_url_option_exits_2(loads: Loads, capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    code, err = _serve(capsys, tmp_path, "--remote", "redis://127.0.0.1:6379/0?socket_timeout=abc")
    _assert_one_error(code, err, loads, "socket_timeout")


def test_an_empty_served_model_name_exits_2(loads: Loads, capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    code, err = _serve(capsys, tmp_path, "--served-model-name", "")
    _assert_one_error(code, err, loads, "--served-model-name")


def test_remote_optional_starts_local_only_with_a_warning(loads: Loads, capsys: pytest.CaptureFixture[str],
                                                          tmp_path: Any) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    code, err = _serve(capsys, tmp_path, "--remote", url, "--remote-optional", "--served-model-name", "m")
    assert code == 0 and len(err) == 1 and err[0].startswith("warning: ") and url in err[0]
    assert loads.loaded == ["tokenizer", "model"] and len(loads.served) == 1 and loads.served[0][1].model_id == "m"


def test_a_remote_that_answers_starts_without_a_word(loads: Loads, capsys: pytest.CaptureFixture[str],
                                                     tmp_path: Any, redis_server: RedisServer) -> None:  # noqa: F811
    code, err = _serve(capsys, tmp_path, "--remote", redis_server.url)
    assert code == 0 and err == [] and len(loads.served) == 1 and loads.served[0][1].remote == redis_server.url


def test_max_body_bytes_reaches_the_server(loads: Loads, capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    code, _ = _serve(capsys, tmp_path, "--max-body-bytes", "1000")
    assert code == 0 and loads.served[0][1].max_body_bytes == 1000


def test_a_model_directory_that_does_not_exist_is_named(loads: Loads, capsys: pytest.CaptureFixture[str],
                                                        tmp_path: Any) -> None:
    code, err = _serve(capsys, tmp_path / "nope")
    _assert_one_error(code, err, loads, "nope", "does not exist")


def test_a_key_file_and_the_key_variable_both_set_warn_which_wins(
        loads: Loads, capsys: pytest.CaptureFixture[str], tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
        redis_server: RedisServer) -> None:  # noqa: F811
    key = tmp_path / "key"
    key.write_text("k" * 32)
    monkeypatch.setenv("KVSTATE_REMOTE_KEY", "e" * 32)
    code, err = _serve(capsys, tmp_path, "--remote", redis_server.url, "--remote-key-file", str(key))
    assert code == 0 and len(err) == 1 and err[0].startswith("warning: ") and "the file's key is used" in err[0]
    assert len(loads.served) == 1


def test_max_preparing_reaches_the_server(loads: Loads, capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    code, _ = _serve(capsys, tmp_path, "--max-preparing", "3")
    assert code == 0 and loads.served[0][1].max_preparing == 3


def test_shutdown_grace_reaches_the_server(loads: Loads, capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    code, _ = _serve(capsys, tmp_path, "--shutdown-grace", "5")
    assert code == 0 and loads.served[0][1].shutdown_grace_s == 5
    code, err = _serve(capsys, tmp_path, "--shutdown-grace", "-1")
    assert code == 2 and any("--shutdown-grace" in line for line in err) and len(loads.served) == 1
