"""TTFT measured end to end: serve / consumer processes over a shaped loopback, the skip where not permitted,
and ``kvstate transfer serve / generate --method`` with the consumer's fallback."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvstate.cli import app
from kvstate.errors import KVStateError
from kvstate.lab.netns import LinkError, namespace_support
from kvstate.lab.transfer import ttft
from kvstate.lab.transfer.ttft import TTFTConfig, run_ttft
from kvstate.lab.workloads.tokenizer import build_tokenizer
from kvstate.models.tiny import tiny_model
from kvstate.transfer.calibrate import CalibrationConfig, calibrate_on


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("ttft")
    tok = build_tokenizer()
    models = []
    for name, seed in (("producer", 0), ("consumer", 1)):
        m = tiny_model("qwen3", seed=seed, vocab_size=len(tok), max_position_embeddings=4096)
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        models.append(m)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, len(tok), (1, 32), generator=g) for _ in range(4)]
    cfg = CalibrationConfig(rank_k=4, rank_v=4, rank_h=16, patch=1, prefixes=4, length=32, suffix=4, aligner_steps=5)
    calibrate_on(models[0], models[1], prompts, cfg).save(root / "codec")
    torch.set_num_threads(before)
    return root / "producer", root / "consumer", root / "codec"


def test_serve_and_consumer_in_a_shaped_namespace(dirs: tuple[Path, Path, Path]) -> None:
    why = namespace_support()
    if why is not None:
        pytest.skip(why)
    p, c, codec = dirs
    cfg = TTFTConfig(rates_gbit=(0.1,), lengths=(2048,), repeats=1, methods=("raw",), bulk_s=0.3)
    out = run_ttft(cfg, p, c, codec)
    assert out["skipped"] == {} and set(out["links"]) == {"0.1"}
    assert 0.08 <= out["links"]["0.1"]["achieved_gbit_s"] <= 0.12  # within 20% of the set rate
    rows = {r["method"]: r for r in out["rows"]}
    assert set(rows) == {"oracle", "raw"} and all(r["length"] == 2048 and r["n"] == 1 for r in rows.values())
    raw = rows["raw"]
    assert raw["payload_bytes"] > 4 * (128 << 10)  # well beyond the token bucket's burst
    # the payload crossed the shaped link: no faster than the rate allows beyond the burst
    floor_ms = (raw["payload_bytes"] - (128 << 10)) * 8 / 0.1e9 * 1e3
    assert raw["parts_ms"]["0.1"]["warm"]["fetch"] >= 0.8 * floor_ms
    assert raw["ttft_ms"]["0.1"]["cold"] >= raw["parts_ms"]["0.1"]["cold"]["producer"] > 0
    assert rows["oracle"]["ttft_ms"]["0.1"]["cold"] == rows["oracle"]["ttft_ms"]["0.1"]["warm"] > 0
    assert "Redis" in out["links"]["0.1"]["store"]


def test_without_namespaces_the_shaped_rates_are_skipped_not_estimated(dirs: tuple[Path, Path, Path],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ttft, "namespace_support", lambda: "not permitted here (needs root)")
    monkeypatch.setattr(ttft, "run_link", lambda *a, **k: pytest.fail("no link may be measured"))
    out = run_ttft(TTFTConfig(rates_gbit=(0.1, 1.0), lengths=(64,), repeats=1), *dirs)
    assert out["rows"] == [] and out["links"] == {}
    assert out["skipped"] == {"0.1": "not permitted here (needs root)", "1": "not permitted here (needs root)"}


def test_bad_ttft_settings_raise_one_clear_error(dirs: tuple[Path, Path, Path]) -> None:
    with pytest.raises(LinkError, match="--rate"):
        TTFTConfig(rates_gbit=(500.0,))
    with pytest.raises(KVStateError, match="no link"):
        TTFTConfig(rates_gbit=())
    with pytest.raises(KVStateError, match="--method 'zip'"):
        TTFTConfig(methods=("zip",))
    with pytest.raises(KVStateError, match=r"--length 8,192 exceeds the models' max_position_embeddings=4,096"):
        run_ttft(TTFTConfig(rates_gbit=(1.0,), lengths=(8192,)), *dirs)


def test_generate_falls_back_and_says_so_when_the_producer_is_down(dirs: tuple[Path, Path, Path]) -> None:
    _, c, codec = dirs
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    args = ["transfer", "generate", "--consumer", str(c), "--codec", str(codec), "--server", f"127.0.0.1:{port}",
            "--prompt", "the cat sat on the mat", "--max-new-tokens", "2", "--method", "kivi4", "--timeout", "5"]
    res = CliRunner().invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output[res.output.rindex('{"text"'):])
    assert "cannot reach the producer" in out["fallback"] and out["payload_bytes"] == 0 and out["new_tokens"] >= 1
    strict = CliRunner().invoke(app, [*args, "--no-fallback"])
    assert strict.exit_code != 0 and "cannot reach the producer" in str(strict.exception)
    bad = CliRunner().invoke(app, [*args[:-4], "--method", "zip"])
    assert isinstance(bad.exception, KVStateError) and "--method 'zip'" in str(bad.exception)


def test_profiled_options_reach_the_server_and_the_store_key(dirs: tuple[Path, Path, Path], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The TTFT bench serves each method with the options its profiling chose (DroidSpeak's block); payloads of
    two blocks never share a store key; a bad block or a block for another method is one error naming it."""
    from kvstate.models.loading import load_model
    from kvstate.transfer import methods as registry
    from kvstate.transfer.codec import Codec

    p, _, codec_dir = dirs
    codec = Codec.load(codec_dir)
    ds = registry.get("droidspeak")
    ctx = registry.MethodContext(codec=codec, options={"block": "1:2"})
    assert ds.recomputed_layers(ctx) == (1,) and ds.recomputed_layers(registry.MethodContext(codec=codec)) == (0, 1)
    assert ds.variant(ctx) != ds.variant(registry.MethodContext(codec=codec)) == "droidspeak"
    # every option set gives a valid store key (a block's ':' or an artifact's path never reaches it); a file-valued
    # option is keyed by content: a retrained artifact at the same path never reads the old one's entries
    from kvstate.transfer.store import store_key

    art = tmp_path / "art.safetensors"
    art.write_bytes(b"one")
    rc = registry.get("scd_recompute")
    keys = [ds.variant(ctx), ds.variant(registry.MethodContext(codec=codec, options={"block": "0:2"})),
            rc.variant(registry.MethodContext(codec=codec, options={"artifact": str(art)}))]
    for v in keys:
        store_key(b"\x01", b"\x02", v)
    art.write_bytes(b"two")
    assert len({*keys, rc.variant(registry.MethodContext(codec=codec, options={"artifact": str(art)}))}) == 4
    producer = load_model(p)
    ids = torch.randint(3, 50, (1, 12), generator=torch.Generator().manual_seed(1))
    pair, encode = registry.encoder("droidspeak", producer, ctx)
    want = ds.encode(producer, ids, ctx)
    assert encode(ids).to_bytes() == want.to_bytes() and want.pair == pair and want.meta["block"] == "1,2"
    for method, extra in (("kivi4", ["--block", "0:1"]), ("droidspeak", ["--block", "2:1"]),
                          ("raw", ["--option", "block=0:1"])):
        res = CliRunner().invoke(app, ["transfer", "serve", "--producer", str(p), "--codec", str(codec_dir),
                                       "--method", method, *extra])
        assert isinstance(res.exception, KVStateError) and "block" in str(res.exception), res.output
    argvs = []

    class NoProcess:
        def __init__(self, argv: list[str], **_: object) -> None:
            argvs.append(argv)

    monkeypatch.setattr(ttft.subprocess, "Popen", NoProcess)
    spec = {"producer": str(p), "codec": str(codec_dir), "methods": ["droidspeak", "raw"], "lengths": [64],
            "options": {"droidspeak": {"block": "1:2"}}}
    ttft._start_servers(spec, "memory://", tmp_path)
    assert argvs[0][-2:] == ["--option", "block=1:2"] and "--option" not in argvs[1]
    with pytest.raises(KVStateError, match="takes no option block"):
        TTFTConfig(options={"raw": {"block": "1:2"}})
    from kvstate.lab.transfer.ttft import method_options, profiled_options

    assert profiled_options({"droidspeak_block": [1, 3]}) == {"droidspeak": {"block": "1:3"}}  # older files
    assert profiled_options({"method_options": {"droidspeak": {"block": "0:2"}}}) == {"droidspeak": {"block": "0:2"}}
    assert method_options("droidspeak.block=1:2,scd.patch=0", codec_dir) == \
        {"droidspeak": {"block": "1:2"}, "scd": {"patch": "0"}}
    with pytest.raises(KVStateError, match="--options 'zip'"):
        method_options("zip.x=1", codec_dir)
    # a profiled artifact the bench kept in a temporary directory that is gone: named, with the command that keeps one
    from kvstate.lab.provenance import append_run

    append_run(codec_dir / "bench.json", {"method_options": {"scd_recompute": {"artifact": str(tmp_path / "gone")}}},
               {"seeds": [0]})
    with pytest.raises(KVStateError, match="kvstate transfer profile --method scd_recompute"):
        method_options("auto", codec_dir, ["scd_recompute"])
    assert method_options("auto", codec_dir, ["droidspeak"]) == {"scd_recompute": {"artifact": str(tmp_path / "gone")}}


def test_ttft_command_writes_a_result_and_profile_keeps_a_methods_artifact(dirs: tuple[Path, Path, Path],
                                                                            tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    from kvstate.transfer.methods.recompute import ScdRecompute

    p, c, codec = dirs
    monkeypatch.setattr(ttft, "namespace_support", lambda: "not permitted here (needs root)")
    out = tmp_path / "ttft.json"
    args = ["transfer", "ttft", "--producer", str(p), "--consumer", str(c), "--codec", str(codec), "--rate", "1",
            "--length", "64", "--methods", "raw", "--options", "none", "--seed", "3", "--out", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    run = json.loads(out.read_text())["runs"][-1]
    assert run["skipped"] == {"1": "not permitted here (needs root)"} and run["provenance"]["seeds"] == [3]
    assert run["provenance"]["settings"]["methods"] == ["raw"]

    def fake_profile(self: object, producer: object, consumer: object, prompts: list[torch.Tensor],
                     ctx: object) -> tuple[dict[str, str], dict[str, object]]:
        f = Path(tempfile.mkdtemp(prefix="kvstate-recompute-")) / "recompute.safetensors"
        f.write_bytes(b"trained-" + bytes([len(prompts)]))
        return {"artifact": str(f)}, {"layer": 1}

    monkeypatch.setattr(ScdRecompute, "profile", fake_profile)
    keep = tmp_path / "profiles"
    prof = ["transfer", "profile", "--method", "scd_recompute", "--producer", str(p), "--consumer", str(c),
            "--codec", str(codec), "--out", str(keep)]
    res = CliRunner().invoke(app, prof)
    assert res.exit_code == 0, res.output
    assert (keep / "scd_recompute.safetensors").read_bytes() == b"trained-" + bytes([48])  # its 48 prefixes
    doc = json.loads((keep / "scd_recompute.json").read_text())
    assert doc["options"] == {"artifact": str(keep / "scd_recompute.safetensors")} and doc["info"] == {"layer": 1}
    again = CliRunner().invoke(app, prof)  # kept before: not replaced without --overwrite
    assert isinstance(again.exception, KVStateError) and "--overwrite" in str(again.exception)
    assert (keep / "scd_recompute.safetensors").read_bytes() == b"trained-" + bytes([48])
    none = CliRunner().invoke(app, [*prof[:3], "reuse", *prof[4:-1], str(tmp_path / "other")])
    assert isinstance(none.exception, KVStateError) and "trains no artifact" in str(none.exception)
