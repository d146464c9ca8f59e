"""The library's boundaries refuse bad input with one clear error: token ids, config fields, outputs that are
inputs or of another kind, files a manifest covers, a router or codec from another model or damaged, decoded
K/V that are not usable."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvstate.errors import IntegrityError, KVStateError, OutputError
from kvstate.integrity import accepts_kind, artifact_kind, is_trusted_file, refresh_manifest, write_manifest
from kvstate.io_safety import check_not_input, check_output_dir
from kvstate.models import model_fingerprint, tiny_model
from kvstate.semantic import (
    RouterMismatchError,
    SemanticCache,
    SemanticConfig,
    SemanticRouter,
    prefill_and_compress,
)
from kvstate.semantic.router import RouterConfig
from kvstate.semantic.segment import SegmentConfig
from kvstate.transfer import CalibrationConfig, CodecConfig, Payload, PayloadError, ServerConfig
from kvstate.transfer.calibrate import calibrate_on
from kvstate.transfer.codec import Codec, CodecError
from kvstate.validate import check_bool, check_id_list, check_token_ids

# ---- token ids


@pytest.mark.parametrize(("ids", "needle"), [
    (torch.zeros(2, 4, dtype=torch.long), "batch size 2"),
    (torch.zeros(1, 4), "integer dtype"),
    (torch.zeros(4, dtype=torch.long), "rank 1"),
    (torch.zeros(1, 0, dtype=torch.long), "0 tokens"),
    (torch.full((1, 4), 10), "outside the vocabulary"),
    (torch.full((1, 4), -1), "outside the vocabulary"),
    (torch.zeros(1, 9, dtype=torch.long), "9 tokens"),
    ([[1, 2]], "must be a tensor"),
])
def test_check_token_ids_refuses(ids, needle):
    with pytest.raises(KVStateError, match=needle):
        check_token_ids("ids", ids, 10, max_len=8, error=KVStateError)


def test_check_token_ids_takes_a_valid_tensor():
    assert check_token_ids("ids", torch.tensor([[0, 9, 3]]), 10, max_len=8) == (1, 3)


@pytest.mark.parametrize(("ids", "needle"), [([], "0 token ids"), ([1.5], "not an int"), ([True], "not an int"),
                                             ([10], "outside the vocabulary"), ("12", "list of token ids"),
                                             (list(range(9)), "9 token ids")])
def test_check_id_list_refuses(ids, needle):
    with pytest.raises(ValueError, match=needle):
        check_id_list("ids", ids, 10, max_len=8)


def test_check_bool_refuses_truthy_values():
    assert check_bool("x", False) is False
    for bad in (0, "no", None):
        with pytest.raises(ValueError, match="True or False"):
            check_bool("x", bad)


# ---- the output rule's library pieces


def test_an_output_is_never_an_input(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    for out, where in ((model, "is the input"), (model / "sub", "lies inside"), (tmp_path, "holds the input")):
        with pytest.raises(OutputError, match=where):
            check_not_input(out, {"--model": model})
    assert check_not_input(tmp_path / "other", {"--model": model, "--base": None}) == tmp_path / "other"


def test_artifact_kind_and_a_directory_of_another_kind_is_never_written_into(tmp_path):
    model, router, other, empty = (tmp_path / n for n in ("model", "router", "other", "empty"))
    for d in (model, router, other, empty):
        d.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"x")
    (router / "router.safetensors").write_bytes(b"x")
    (other / "notes.txt").write_text("mine")
    assert [artifact_kind(d) for d in (model, router, other, empty, tmp_path / "nope")] == [
        "model", "router", "other", None, None]
    write_manifest(router, kind="router")
    assert artifact_kind(router) == "router" and accepts_kind("router")(router) and not accepts_kind("model")(router)
    for d in (model, other):
        with pytest.raises(OutputError, match="is not a SEKV router"):
            check_output_dir(d, overwrite=True, accept=accepts_kind("router"), kind="a SEKV router")
    check_output_dir(empty, accept=accepts_kind("router"))  # an empty directory takes any kind


def test_files_a_manifest_covers_are_trusted(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "eval.json").write_text("{}")
    write_manifest(tmp_path, kind="model", files=["config.json"])
    assert is_trusted_file(tmp_path / "config.json") and is_trusted_file(tmp_path / "manifest.json")
    assert not is_trusted_file(tmp_path / "eval.json") and not is_trusted_file(tmp_path / "README.md")


# ---- semantic: configs, prefill, routers


@pytest.mark.parametrize("kw", [{"budget": True}, {"budget": math.nan}, {"budget": "0.5"}, {"budget": 0},
                                {"rank": True}, {"rank": 2.0}, {"sticky": "no"}, {"slow_tier": 0},
                                {"segment": None}, {"zoom": "most"}])
def test_semantic_config_refuses_wrong_types(kw):
    with pytest.raises(KVStateError, match="SemanticConfig"):
        SemanticConfig(**kw)


@pytest.mark.parametrize("kw", [{"min_span": True}, {"anchor_fraction": math.nan}, {"threshold": math.inf},
                                {"sinks": 2.0}, {"max_span": True}])
def test_segment_config_refuses_wrong_types(kw):
    with pytest.raises(ValueError, match="SegmentConfig"):
        SegmentConfig(**kw)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    return tiny_model("qwen3", seed=0), tiny_model("qwen3", seed=1)


@pytest.mark.parametrize(("ids", "needle"), [
    (torch.zeros(2, 16, dtype=torch.long), "batch size 2"),
    (torch.zeros(1, 16), "integer dtype"),
    (torch.full((1, 16), 10**6), "outside the vocabulary"),
    (torch.zeros(16, dtype=torch.long), "rank 1"),
    (torch.zeros(1, 0, dtype=torch.long), "0 tokens"),
])
def test_prefill_and_compress_refuses_bad_ids(models, ids, needle):
    model = models[0]
    with pytest.raises(KVStateError, match=needle):
        prefill_and_compress(model, SemanticCache(model), ids)


def test_prefill_and_compress_refuses_more_tokens_than_positions(models):
    model = models[0]
    limit = model.config.max_position_embeddings
    with pytest.raises(KVStateError, match="the model positions"):
        prefill_and_compress(model, SemanticCache(model), torch.zeros(1, limit + 1, dtype=torch.long))


def test_prefill_and_compress_refuses_a_cache_of_another_model(models):
    a, b = models
    with pytest.raises(KVStateError, match="built for another model"):
        prefill_and_compress(b, SemanticCache(a), torch.zeros(1, 64, dtype=torch.long))


def test_a_semantic_cache_refuses_a_router_trained_for_another_model(models, tmp_path):
    a, b = models
    SemanticRouter(RouterConfig.from_model_config(a.config)).save(tmp_path / "r", model_fingerprint(a))
    router = SemanticRouter.load(tmp_path / "r")  # no model given: the fingerprint travels with the router
    SemanticCache(a, router)  # its own model: accepted
    with pytest.raises(RouterMismatchError, match="fingerprint"):
        SemanticCache(b, router)
    wrong_shape = SemanticRouter(RouterConfig(2, 2, 1, 8))
    with pytest.raises(RouterMismatchError, match="shape"):
        SemanticCache(a, wrong_shape)


@pytest.mark.parametrize("damage", ["missing", "bf16", "nan", "extra"])
def test_a_damaged_router_is_one_clear_error(models, tmp_path, damage):
    a, _ = models
    d = tmp_path / "r"
    SemanticRouter(RouterConfig.from_model_config(a.config)).save(d, model_fingerprint(a))
    t = load_file(d / "router.safetensors")
    t = {"missing": lambda: {k: v for k, v in t.items() if k != "alpha"},
         "bf16": lambda: {k: v.bfloat16() for k, v in t.items()},
         "nan": lambda: {k: v * math.nan if k == "beta" else v for k, v in t.items()},
         "extra": lambda: {**t, "gamma": torch.zeros(3)}}[damage]()
    save_file(t, d / "router.safetensors")
    refresh_manifest(d)  # checksums of the damaged file: only the tensor checks can catch it
    with pytest.raises(KVStateError, match="router in") as exc:
        SemanticRouter.load(d, a)
    assert str(d) in str(exc.value)


def test_a_truncated_router_is_an_integrity_error(models, tmp_path):
    a, _ = models
    d = tmp_path / "r"
    SemanticRouter(RouterConfig.from_model_config(a.config)).save(d, model_fingerprint(a))
    raw = (d / "router.safetensors").read_bytes()
    (d / "router.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(IntegrityError, match="checksum"):
        SemanticRouter.load(d, a)
    (d / "manifest.json").write_text("not json")
    with pytest.raises(IntegrityError, match="not a kvstate manifest"):
        SemanticRouter.load(d, a)


# ---- transfer: configs, codec files, encode / decode boundaries


@pytest.fixture(scope="module")
def codec(models):
    p, c = models
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (1, 32), generator=g) for _ in range(4)]
    cfg = CalibrationConfig(rank_k=4, rank_v=4, rank_h=16, patch=1, prefixes=4, length=32, suffix=4, aligner_steps=5)
    return calibrate_on(p, c, prompts, cfg)


@pytest.mark.parametrize(("make", "needle"), [
    (lambda: CodecConfig(True, 4, 4), "rank_k"), (lambda: CodecConfig(4, 4, 4, (1.5,)), "patch_layers"),
    (lambda: CalibrationConfig(prefixes=True), "prefixes"), (lambda: CalibrationConfig(ridge=math.nan), "ridge"),
    (lambda: CalibrationConfig(seed=-1), "seed"), (lambda: CalibrationConfig(tasks=()), "tasks"),
    (lambda: ServerConfig(port=True), "port"), (lambda: ServerConfig(timeout_s=math.nan), "timeout_s"),
    (lambda: ServerConfig(max_tokens=0), "max_tokens")])
def test_transfer_configs_refuse_wrong_types(make, needle):
    with pytest.raises(KVStateError, match=needle):
        make()


@pytest.mark.parametrize(("ids", "needle"), [
    (torch.full((1, 8), 10**6), "outside the vocabulary"), (torch.zeros(1, 8), "integer dtype"),
    (torch.zeros(2, 8, dtype=torch.long), "batch size 2")])
def test_codec_encode_refuses_bad_ids(models, codec, ids, needle):
    with pytest.raises(CodecError, match=needle):
        codec.encode(models[0], ids)


def test_absurd_payload_scales_never_reach_the_consumer(models, codec):
    p, c = models
    good = codec.encode(p, torch.full((1, 8), 5))
    assert codec.decode(c, good).get_seq_length() == 8
    absurd = {k: (v * 1e30 if k.endswith(".scale") else v) for k, v in good.tensors.items()}
    with pytest.raises(PayloadError, match="unusable"):
        codec.decode(c, Payload(good.pair, good.n_tokens, good.token_hash, absurd, good.meta))


@pytest.mark.parametrize("damage", ["missing", "bf16", "nan", "shape"])
def test_a_damaged_codec_is_refused_at_load(codec, tmp_path, damage):
    d = codec.save(tmp_path / "c")
    t = load_file(d / "codec.safetensors")
    t = {"missing": lambda: {k: v for k, v in t.items() if k != "k.1.dec"},
         "bf16": lambda: {k: v.bfloat16() for k, v in t.items()},
         "nan": lambda: {k: v * math.nan if k == "v.0.mu_out" else v for k, v in t.items()},
         "shape": lambda: {k: v[..., :-1].contiguous() if k == "k.0.enc" else v for k, v in t.items()}}[damage]()
    save_file(t, d / "codec.safetensors")
    refresh_manifest(d)  # checksums of the damaged file: only the tensor checks can catch it
    needle = {"missing": "lacks k.1.dec", "bf16": "bfloat16", "nan": "NaN", "shape": "expected"}[damage]
    with pytest.raises(CodecError, match=needle):
        Codec.load(d)


def test_a_codec_manifest_that_is_not_json_is_an_integrity_error(codec, tmp_path):
    d = codec.save(tmp_path / "c")
    (d / "manifest.json").write_text(json.dumps([1])[:2])
    with pytest.raises(IntegrityError, match="not a kvstate manifest"):
        Codec.load(d)
