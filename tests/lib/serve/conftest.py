"""Fixtures of the server tests: a tiny random-weight hybrid model with a word-level tokenizer, and a running
server on a free loopback port (uvicorn in a background thread, stopped with ``should_exit``)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from kvstate.models import tiny_model
from kvstate.serve.app import create_app
from kvstate.serve.config import ServeConfig

POSITIONS = 256  # the tiny model's max_position_embeddings
WORDS = ["<pad>", "<bos>", "<eos>", "<unk>", ":", ".", "?", "system", "user", "assistant"]
WORDS += [f"w{i}" for i in range(128 - len(WORDS))]


def word_tokenizer() -> PreTrainedTokenizerFast:
    core = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)


@pytest.fixture(scope="session")
def tiny() -> tuple[Any, PreTrainedTokenizerFast]:
    """A Qwen3.5-shaped hybrid (3 Gated DeltaNet : 1 attention), vocabulary 128, 256 positions."""
    return tiny_model("qwen3_5", seed=0, max_position_embeddings=POSITIONS), word_tokenizer()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Running:
    """A server for ``app`` on loopback, answering until :meth:`stop`."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line and not line.startswith("#")}


def serve(tiny: tuple[Any, Any], **config: Any) -> Iterator[Running]:
    model, tok = tiny
    running = Running(create_app(model, tok, ServeConfig(model_id="tiny", **config)))
    try:
        yield running
    finally:
        running.stop()
