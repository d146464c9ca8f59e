"""The server's parts without HTTP: stop-string holding (against brute force over continuations), incremental
text, message-end positions, declared checkpoints handed to an engine that takes them, config checks, loading,
and that the serving package stays out of the lab."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstate.errors import KVStateError
from kvstate.prefix.engine import SparsePrefixCache
from kvstate.serve.app import _Handlers
from kvstate.serve.chat import DEFAULT_CHAT_TEMPLATE, message_ends, render
from kvstate.serve.config import ServeConfig
from kvstate.serve.generation import GenerationRequest, Generator
from kvstate.serve.metrics import ServerCounters
from kvstate.serve.protocol import ChatRequest
from kvstate.serve.scheduler import Scheduler
from kvstate.serve.text import TextStream, split_stop
from tests.test_layout import SRC, imports_of

ab = st.text(alphabet="ab", max_size=6)


def _first_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


@settings(max_examples=300, deadline=None)
@given(text=ab, stops=st.lists(st.text(alphabet="ab", min_size=1, max_size=3), min_size=1, max_size=3))
def test_split_stop_sends_only_text_no_continuation_can_cut(text: str, stops: list[str]) -> None:
    end, stopped = split_stop(text, stops)
    if _first_stop(text, stops) is not None:
        assert (end, stopped) == (_first_stop(text, stops), True)
        return
    assert not stopped
    continuations = [""] + [a + b + c for a in "ab" for b in ["", "a", "b"] for c in ["", "a", "b"]]
    cuts = [_first_stop(text + c, stops) for c in continuations]
    assert all(i is None or i >= end for i in cuts)  # safe: sent text is never cut later
    assert end == len(text) or end in cuts  # minimal hold: some continuation stops exactly there


def test_text_stream_joins_to_the_decoded_reply(tiny: tuple[Any, Any]) -> None:
    _, tok = tiny
    ids = tok("w1 w2 : w3 w4 . w5", add_special_tokens=False)["input_ids"]
    s = TextStream(tok)
    sent = "".join(s.push(t) for t in ids) + s.flush()
    assert sent == tok.decode(ids, skip_special_tokens=True) == "w1 w2 : w3 w4 . w5"
    s = TextStream(tok, stops=("w4 .",))
    sent = "".join(s.push(t) for t in ids) + s.flush()
    assert s.stopped and sent == "w1 w2 : w3 "


def test_message_ends_are_where_each_rendered_prefix_ends(tiny: tuple[Any, Any]) -> None:
    _, tok = tiny
    msgs = [{"role": "system", "content": "w1 w2 w3"}, {"role": "user", "content": "w4 ?"},
            {"role": "assistant", "content": "w5 w6"}, {"role": "user", "content": "w7 w8 ?"}]
    prompt = render(tok, DEFAULT_CHAT_TEMPLATE, msgs, generation_prompt=True)
    ends = message_ends(tok, DEFAULT_CHAT_TEMPLATE, msgs, prompt)
    expected = [len(render(tok, DEFAULT_CHAT_TEMPLATE, msgs[:k], generation_prompt=False)) for k in range(1, 5)]
    assert ends == expected and ends == sorted(set(ends)) and ends[-1] < len(prompt) - 1
    assert tok.convert_ids_to_tokens([prompt[e - 1] for e in ends]) == ["<eos>"] * 4  # each ends on its <eos>


class _DeclaringCache(SparsePrefixCache):
    """An engine that accepts declared checkpoint positions (records them, plans as before)."""

    seen: list[list[int]]

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                boundaries: list[int] | None = None, **kw: Any) -> Any:
        self.seen.append(list(boundaries or []))
        return super().prefill(input_ids, attention_mask, boundaries=boundaries, **kw)


def test_message_ends_reach_an_engine_that_takes_boundaries(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    cache = _DeclaringCache(model, 1 << 28)
    cache.seen = []
    gen = Generator(model, tok, cache)
    assert gen.accepts_boundaries and Generator(model, tok, SparsePrefixCache(model, 1 << 28)).accepts_boundaries
    h = _Handlers(gen, tok, ServeConfig("tiny"), Scheduler(1), ServerCounters())
    req = ChatRequest(model="tiny", max_tokens=2, messages=[{"role": "system", "content": "w1 w2 w3"},
                                                             {"role": "user", "content": "w4 ?"}])
    gr = h.chat(req)
    assert list(gr.boundaries) == message_ends(tok, h.template, [m.model_dump(include={"role", "content"})
                                                                  for m in req.messages], gr.prompt_ids)
    out = gen.run(gr, lambda _: None, lambda: False)
    assert cache.seen == [list(gr.boundaries)] and len(gr.boundaries) == 2 and out.completion_tokens >= 1


def test_a_cancelled_request_inserts_nothing(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    gen = Generator(model, tok, SparsePrefixCache(model, 1 << 28))
    out = gen.run(GenerationRequest(tuple(range(4, 30)), 50), lambda _: None, lambda: True)
    assert (out.finish_reason, out.inserted, out.completion_tokens, gen.pinned_nodes) == ("cancelled", False, 0, 0)
    assert gen.cache.metrics.requests == 1  # the prefill itself was served and committed


@pytest.mark.parametrize("kw", [{"model_id": ""}, {"model_id": "m", "max_queue": 0},
                                {"model_id": "m", "budget_bytes": 0}, {"model_id": "m", "default_max_tokens": True},
                                {"model_id": "m", "max_body_bytes": 0}])
def test_config_refuses_bad_values(kw: dict[str, Any]) -> None:
    with pytest.raises(KVStateError):
        ServeConfig(**kw)


def test_serving_never_imports_the_lab() -> None:
    used = {i for p in (SRC / "serve").rglob("*.py") for i in imports_of(p)}
    assert {i for i in used if i.startswith("kvstate.")} and not {i for i in used if i.startswith("kvstate.lab")}


def test_cli_refuses_a_model_without_a_tokenizer(tiny: tuple[Any, Any], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from kvstate.cli import main
    from kvstate.serve.server import load_tokenizer
    from tests.lib.serve.conftest import free_port

    model, tok = tiny
    model.save_pretrained(tmp_path / "m")
    capsys.readouterr()  # transformers' save progress
    with pytest.raises(SystemExit) as info:
        main(["serve", "--model", str(tmp_path / "m"), "--port", str(free_port())])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and "tokenizer" in err
    tok.save_pretrained(tmp_path / "m")
    assert load_tokenizer(tmp_path / "m")("w1 w2")["input_ids"] == tok("w1 w2")["input_ids"]


def test_an_error_message_is_cut_with_its_length() -> None:
    from kvstate.serve.protocol import MAX_MESSAGE_CHARS, brief, error_body

    text = error_body("x" * 50_000, "invalid_request_error")["error"]["message"]
    assert len(text) < MAX_MESSAGE_CHARS + 60 and text.endswith("(message cut, 50,000 characters)")
    assert brief(list(range(10))) == "[0, 1, 2, 3, … (10 in all)]" and brief(["ab"]) == "['ab']"
