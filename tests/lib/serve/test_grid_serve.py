"""``kvstate serve`` keeps grid checkpoints by default: a prefix's second sighting is a hit, and the reply is the
one the server without them gives."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from kvstate.errors import KVStateError
from kvstate.prefix.grid import DEFAULT_BLOCK, GridConfig
from kvstate.serve.cli import GRID_BLOCK
from kvstate.serve.config import ServeConfig
from tests.lib.serve.conftest import WORDS, serve


def test_serve_turns_the_grid_on_by_default_and_refuses_a_bad_grid():
    assert ServeConfig("m").grid == GridConfig() and GridConfig().block == DEFAULT_BLOCK == GRID_BLOCK
    assert ServeConfig("m").grid.enabled and not GridConfig(block=0).enabled
    with pytest.raises(KVStateError, match="grid"):
        ServeConfig("m", grid=256)  # type: ignore[arg-type]


def _complete(url: str, prompt: str) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_second_sighting_resumes_on_the_grid_and_replies_as_without_it(tiny):
    words = [w for w in WORDS if w.startswith("w")]
    a = " ".join(words[i % 60] for i in range(150))  # 151 tokens with <bos>
    b = " ".join(words[(7 * i + 3) % 100] for i in range(150))
    probe = b + " w101 w102 w103"
    out: dict[str, tuple[int, str]] = {}
    for arm, grid in (("off", GridConfig(block=0)), ("on", GridConfig(block=64))):
        for running in serve(tiny, grid=grid):
            _complete(running.url, a + " w110")  # shares <bos> with b: b's own plan captures nothing mid-prompt
            _complete(running.url, b + " w111")
            r = _complete(running.url, probe)
            out[arm] = (r["usage"]["prompt_tokens_details"]["cached_tokens"], r["choices"][0]["text"])
    # the tiny model's chunk is 64 tokens: a grid state at 64 and 128 of b's 151 tokens
    assert out["off"][0] < 128 <= out["on"][0] and out["on"][1] == out["off"][1]
