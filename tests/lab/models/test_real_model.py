"""The real pretrained model: converted once from its locked wheel, loaded as any model directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvstate.errors import IntegrityError
from kvstate.integrity import write_manifest
from kvstate.lab.models.cli import REAL_MODEL, missing_hint
from kvstate.models.convert import ConversionError, convert_gguf, converted_from

REPO = Path(__file__).resolve().parents[3]
MODEL = REPO / REAL_MODEL
needs_model = pytest.mark.skipif(not (MODEL / "manifest.json").is_file(), reason=missing_hint())


def fake_conversion(d: Path, sha: str) -> Path:
    d.mkdir(parents=True)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        (d / name).write_bytes(name.encode())
    write_manifest(d, kind="model", meta={"source": {"sha256": sha}})
    return d


def test_a_conversion_of_the_same_source_is_kept_and_another_is_refused_without_overwrite(tmp_path: Path) -> None:
    out = fake_conversion(tmp_path / "m", "a" * 64)
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    assert "skipped" in convert_gguf(gguf, out, source={"sha256": "a" * 64}, command="c", progress=False)
    with pytest.raises(ConversionError, match=r"converted from another source \(sha256 aaaaaaaaaaaa\).*--overwrite"):
        convert_gguf(gguf, out, source={"sha256": "b" * 64}, command="c", progress=False)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ConversionError, match="holds no conversion; pass --overwrite"):
        convert_gguf(gguf, other, source={"sha256": "b" * 64}, command="c", progress=False)
    assert (other / "notes.txt").read_text() == "mine"
    with pytest.raises(ConversionError, match="not found"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "new", source={}, command="c", progress=False)
    assert not (tmp_path / "new").exists()


def test_a_tampered_conversion_is_refused_by_its_manifest_naming_the_file(tmp_path: Path) -> None:
    out = fake_conversion(tmp_path / "m", "a" * 64)
    assert converted_from(out) == "a" * 64
    (out / "model.safetensors").write_bytes(b"model.safetensorZ")
    with pytest.raises(IntegrityError, match=r"model\.safetensors.*kvstate models convert") as err:
        converted_from(out)
    assert "\n" not in str(err.value)
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(IntegrityError):  # not silently kept, not silently replaced
        convert_gguf(gguf, out, source={"sha256": "a" * 64}, command="c", progress=False)


@needs_model
def test_the_converted_model_loads_and_answers_the_chat_its_conversion_recorded() -> None:
    from kvstate.models.convert import _chat_ids
    from kvstate.models.loading import load_model, load_tokenizer

    model, tok = load_model(MODEL), load_tokenizer(MODEL)
    cfg = model.config
    assert (type(model).__name__, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        "LlamaForCausalLM", 30, 9, 3)
    manifest = json.loads((MODEL / "manifest.json").read_text())
    check = manifest["conversion"]
    assert check["max_logit_diff"] <= 1e-4 and check["greedy_equal"] == check["prompts"] == 20
    first = check["replies"][0]
    ids = _chat_ids(tok, first["prompt"])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(ids),
                             pad_token_id=tok.eos_token_id)
    reply = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert reply == first["reply"] and "Paris" in reply


@pytest.fixture(scope="module")
def real() -> tuple[object, object]:
    from kvstate.models.loading import load_model, load_tokenizer

    return load_model(MODEL), load_tokenizer(MODEL)


@needs_model
def test_the_prefix_cache_on_the_real_model_equals_full_recompute(real: tuple[object, object]) -> None:
    from kvstate.models import segmented_prefill
    from kvstate.prefix.engine import SparsePrefixCache

    model, tok = real
    text = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(20))
    doc = tok(text, return_tensors="pt")["input_ids"]
    cache = SparsePrefixCache(model, 1 << 28, slots_per_entry=2, align=16)
    cache.prefill(torch.cat([doc, tok(" First question?", return_tensors="pt")["input_ids"]], 1))
    q = torch.cat([doc, tok(" Which animal jumps?", return_tensors="pt")["input_ids"]], 1)
    res = cache.prefill(q)
    assert res.reused_tokens >= doc.shape[1] - 16
    torch.testing.assert_close(res.logits, segmented_prefill(model, q).logits, atol=1e-4, rtol=0)


@needs_model
def test_kvstate_serve_answers_a_real_chat_and_reuses_the_shared_prefix(real: tuple[object, object]) -> None:
    import httpx

    from kvstate.serve.app import create_app
    from kvstate.serve.config import ServeConfig
    from tests.lib.serve.conftest import Running

    model, tok = real
    server = Running(create_app(model, tok, ServeConfig(model_id="smollm2")))
    try:
        system = "You are a helpful assistant. " + " ".join(f"Fact {i}: water boils at 100 C." for i in range(12))
        replies = []
        for question in ("What is the capital of France? Answer in one sentence.", "Name three primary colors."):
            body = {"model": "smollm2", "max_tokens": 24, "temperature": 0,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
            r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            replies.append(r.json())
        assert "Paris" in replies[0]["choices"][0]["message"]["content"]
        cached = replies[1]["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        assert cached >= len(tok(system)["input_ids"]) - 64
    finally:
        server.stop()


def test_a_converted_model_is_not_a_synthetic_task_reference(tmp_path: Path) -> None:
    from kvstate.lab.report.eval_section import reference_dirs

    out = fake_conversion(tmp_path / "converted", "a" * 64)
    (out / "config.json").write_text("{}")
    write_manifest(out, kind="model", meta={"source": {"sha256": "a" * 64}, "conversion": {"command": "c"}})
    trained = tmp_path / "trained"
    trained.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (trained / name).write_text("{}")
    assert reference_dirs(tmp_path) == [trained]


@needs_model
@pytest.mark.parametrize("task", ["real_niah_single", "real_niah_multiquery", "real_vt"])
def test_a_real_text_item_splits_into_context_and_question_token_for_token(task: str) -> None:
    from kvstate.lab.semantic.bench import score_prediction
    from kvstate.lab.semantic.protocol import QUESTION_MARK, build_items
    from kvstate.lab.workloads import realtext as rt
    from kvstate.models.loading import load_tokenizer

    tok = load_tokenizer(MODEL)
    got = build_items(tok, task, 512, 2, 7)
    for i, it in enumerate(got):
        whole = rt.make_item(tok, task.removeprefix("real_"), 512, 7, i)
        assert it.context + it.questions[0] == list(whole.prompt_ids)
        assert QUESTION_MARK not in tok.decode(it.context) and QUESTION_MARK in tok.decode(it.questions[0])
        assert len(it.questions[0]) < 80 and it.answers == [list(whole.answers)]
        reply = "Sure.\nThe answer: " + ", ".join(whole.answers) + "."
        assert score_prediction(it, 0, reply) == 1.0 and score_prediction(it, 0, "Sure.") == 0.0


def test_a_real_text_task_on_a_model_without_a_chat_template_names_the_fix() -> None:
    from kvstate.errors import KVStateError
    from kvstate.lab.semantic.protocol import build_items

    class NoTemplate:
        chat_template = None

    with pytest.raises(KVStateError) as e:
        build_items(NoTemplate(), "real_niah_single", 512, 1, 7)
    assert "chat template" in str(e.value) and "smollm2" in str(e.value) and "\n" not in str(e.value)
