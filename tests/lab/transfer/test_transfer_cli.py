"""``kvstate transfer calibrate / bench / serve / generate`` end to end on tiny random models."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstate.cli import app
from kvstate.errors import KVStateError
from kvstate.lab.workloads.tokenizer import build_tokenizer
from kvstate.models.tiny import tiny_model


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pair")
    tok = build_tokenizer()
    dirs = []
    for name, seed in (("producer", 0), ("consumer", 1)):
        m = tiny_model("qwen3", seed=seed, vocab_size=len(tok), max_position_embeddings=4096)
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        dirs.append(root / name)
    return dirs[0], dirs[1]


@pytest.fixture(scope="module")
def codec_dir(pair_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("codec") / "c"
    p, c = pair_dirs
    res = CliRunner().invoke(app, ["transfer", "calibrate", "--producer", str(p), "--consumer", str(c), "--out", str(out),
                                   "--prefixes", "4", "--length", "96", "--rank-k", "4", "--rank-v", "8",
                                   "--rank-h", "16", "--patch", "1"])
    assert res.exit_code == 0, res.output
    return out


def test_calibrate_writes_a_codec_with_its_manifest(codec_dir: Path) -> None:
    m = json.loads((codec_dir / "manifest.json").read_text())
    assert (m["rank_k"], m["rank_v"], m["rank_h"], len(m["patch_layers"]), m["format_version"]) == (4, 8, 16, 1, 2)
    assert m["format"] == "kvstate-manifest/2" and m["kind"] == "codec" and set(m["files"]) == {"codec.safetensors"}
    assert len(m["producer_fingerprint"]) == 64 and m["producer_fingerprint"] != m["consumer_fingerprint"]
    assert len(m["calibration"]["raw_drift_k"]) == 2


def test_bench_prints_the_json_shape(pair_dirs: tuple[Path, Path], codec_dir: Path, tmp_path: Path) -> None:
    p, c = pair_dirs
    pca = tmp_path / "pca"
    res = CliRunner().invoke(app, ["transfer", "calibrate", "--producer", str(p), "--consumer", str(c), "--out", str(pca),
                                   "--prefixes", "4", "--length", "96", "--rank-k", "4", "--rank-v", "8",
                                   "--rank-h", "16", "--patch", "0", "--reuse-map", "pca"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, ["transfer", "bench", "--producer", str(p), "--consumer", str(c), "--codec",
                                   str(codec_dir), "--n", "1", "--length", "256,320", "--ppl-n", "1", "--weak-n", "0",
                                   "--ablation-n", "1", "--pca-codec", str(pca), "--json", "--out", str(tmp_path / "b.json")])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    known = ["oracle", "raw", "raw_fp32", "kivi4", "kivi2", "droidspeak", "reuse_pca_producer", "reuse", "scd",
             "scd_k1", "scd_k2"]
    rows = list(dict.fromkeys(r["method"] for r in out["results"]))
    assert [m for m in rows if m in known] == known and rows[0] == "oracle"  # table order; registered methods beside
    assert [(r["method"], r["length"]) for r in out["results"]] == [(m, n) for m in rows for n in (256, 320)]
    tasks = {"niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"}
    for r in out["results"]:
        assert set(r) >= {"method", "length", "n", "score", "score_ci", "f1", "ppl", "payload_bytes_per_token",
                          "recomputed_layers", "by_task", "tasks", "excluded_tasks"}
        # random tiny models: the oracle solves no task, so nothing is pooled and every task is shown beside
        assert r["n"] == 0 and r["score"] is None and r["tasks"] == [] and set(r["excluded_tasks"]) == tasks
        assert set(r["by_task"]) == tasks and all(v["n"] == 1 and len(v["items"]) == 1 for v in r["by_task"].values())
        assert r["ppl"] > 1 and r["ttft_ms"] is None and r["achieved_gbit_s"] is None  # TTFT: over a link
    by = {r["method"]: r for r in out["results"] if r["length"] == 256}
    assert by["oracle"]["recomputed_layers"] == [0, 1] and by["raw"]["recomputed_layers"] == []
    raw = by["raw"]["payload_bytes_per_token"]
    assert 1.9 * raw < by["raw_fp32"]["payload_bytes_per_token"] < 2.1 * raw
    assert raw > by["kivi4"]["payload_bytes_per_token"] > by["kivi2"]["payload_bytes_per_token"]  # residual window: not 4x
    assert by["scd"]["payload_bytes_per_token"] < raw and by["oracle"]["payload_bytes_per_token"] == 0
    assert [b["k"] for b in out["patch_budget"]] == [0, 1, 2] and out["patch_budget"][2]["layers"] == [0, 1]
    a, b = (int(x) for x in out["method_options"]["droidspeak"]["block"].split(":"))
    assert 0 <= a < b <= 2 and by["droidspeak"]["recomputed_layers"] == list(range(a, b))
    assert "0,0" in out["profiles"]["droidspeak"]["profile_kl"] and out["reuse_map"] == "joint"
    assert out["reference"] == "oracle" and out["fp16_raw_kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2
    assert [(a["rank_k"], a["rank_v"]) for a in out["ablation_rank"]] == [(4, 8), (2, 8), (4, 4), (2, 4)]
    [run] = json.loads((tmp_path / "b.json").read_text())["runs"]  # appended with its provenance
    assert run["results"] == out["results"] and run["provenance"] == out["provenance"]


def test_bad_codec_ranks_and_patch_raise_one_clear_error(pair_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    from kvstate.errors import KVStateError

    p, c = pair_dirs
    for args, msg in ((["transfer", "bench", "--producer", str(p), "--consumer", str(c), "--codec", str(tmp_path)],
                       "not a codec directory"),
                      (["transfer", "calibrate", "--producer", str(p), "--consumer", str(c), "--out", str(tmp_path / "x"),
                        "--prefixes", "4", "--length", "96", "--rank-k", "99"], "head dimension"),
                      (["transfer", "calibrate", "--producer", str(p), "--consumer", str(c), "--out", str(tmp_path / "x"),
                        "--patch", "some"], "--patch"),
                      (["transfer", "generate", "--consumer", str(c), "--server", "localhost", "--prompt", "a b"],
                       "must be HOST:PORT")):  # the address is checked first, before anything loads
        res = CliRunner().invoke(app, [*args, *(["--codec", str(tmp_path)] if args[1] == "generate" else [])])
        assert isinstance(res.exception, KVStateError) and msg in str(res.exception), res.output
    assert not (tmp_path / "x").exists()  # nothing half-written


def test_serve_and_generate_over_loopback(pair_dirs: tuple[Path, Path], codec_dir: Path) -> None:
    import socket

    p, c = pair_dirs
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = subprocess.Popen([sys.executable, "-m", "kvstate.cli", "transfer", "serve", "--producer", str(p), "--codec",
                            str(codec_dir), "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        args = ["transfer", "generate", "--consumer", str(c), "--codec", str(codec_dir), "--server", f"127.0.0.1:{port}",
                "--prompt", "the cat sat on the mat . answer :", "--max-new-tokens", "4", "--json",
                "--no-fallback", "--no-gate"]  # while the server loads, fail rather than fall back to own prefill
        deadline = time.time() + 90
        while True:
            res = CliRunner().invoke(app, args)
            if res.exit_code == 0 or time.time() > deadline or srv.poll() is not None:
                break
            time.sleep(1)  # the server is still loading
        assert res.exit_code == 0, res.output
        out = json.loads(res.output[res.output.rindex('{"text"'):])  # after transformers' loading bar
        assert out["new_tokens"] >= 1 and out["payload_bytes"] > 0 and out["prompt_tokens"] >= 2
        assert out["gate_error"] is None  # --no-gate
        # a gate that accepts nothing falls back to the consumer's own prefill, said on stderr
        gated = CliRunner().invoke(app, [*args[:-2], "--gate-max-error", "0", "--gate-tokens", "4"])
        assert gated.exit_code == 0, gated.output
        got = json.loads(gated.output[gated.output.rindex('{"text"'):])
        assert "no payload: the gate refused the transferred cache" in gated.output
        assert got["payload_bytes"] == 0 and got["gate_error"] > 0 and got["fallback"].startswith("the gate refused")
        # a consumer whose codec is for another pair is refused by fingerprint
        bad = CliRunner().invoke(app, [*args[:2], "--consumer", str(p), *args[4:]])
        assert bad.exit_code != 0 and isinstance(bad.exception, KVStateError)
        assert "calibrated for another consumer (fingerprint" in str(bad.exception), bad.output
    finally:
        srv.terminate()
        srv.wait(10)


def test_an_interrupted_bench_resumes_from_its_journal(pair_dirs: tuple[Path, Path], codec_dir: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A bench killed after two prompts reruns only the rest and gives the unbroken run's rows."""
    from kvstate.lab.transfer import bench

    p, c = pair_dirs
    args = ["transfer", "bench", "--producer", str(p), "--consumer", str(c), "--codec", str(codec_dir), "--n", "1",
            "--length", "256", "--ppl-n", "1", "--weak-n", "0", "--ablation-n", "1", "--no-budget", "--json"]
    whole = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "whole.json")])
    assert whole.exit_code == 0, whole.output
    real, calls = bench._prompt, []

    def killed_after_two(*a: object, **k: object) -> object:
        calls.append(1)
        if len(calls) > 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(bench, "_prompt", killed_after_two)
    out = tmp_path / "b.json"
    assert CliRunner().invoke(app, [*args, "--out", str(out)]).exit_code != 0
    assert (tmp_path / ".b.json.journal").is_file() and not out.exists()
    calls.clear()
    monkeypatch.setattr(bench, "_prompt", lambda *a, **k: calls.append(1) or real(*a, **k))
    res = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert len(calls) == 2  # 4 needle tasks x 1 length x 1 item: two were journaled
    [run] = json.loads(out.read_text())["runs"]
    [ref] = json.loads((tmp_path / "whole.json").read_text())["runs"]
    drop = ("consumer_ms", "options")  # wall time; a profiled option may name a trained artifact's temporary path
    assert [{k: v for k, v in r.items() if k not in drop} for r in run["results"]] == \
        [{k: v for k, v in r.items() if k not in drop} for r in ref["results"]]
    from kvstate.transfer import methods as registry

    # 2 prompts + every registered method's profile unit (DroidSpeak's block search among them)
    assert run["provenance"]["parts"] == 2 and run["provenance"]["resumed_units"] == 2 + len(registry.names())
    assert not (tmp_path / ".b.json.journal").exists()


def test_bench_without_perplexity_prints_strict_json(pair_dirs: tuple[Path, Path], codec_dir: Path) -> None:
    p, c = pair_dirs
    res = CliRunner().invoke(app, ["transfer", "bench", "--producer", str(p), "--consumer", str(c), "--codec",
                                   str(codec_dir), "--n", "1", "--length", "256", "--ppl-n", "0", "--weak-n", "0",
                                   "--ablation-n", "0", "--no-budget", "--json"])
    assert res.exit_code == 0, res.output

    def no_constants(name: str) -> None:
        raise AssertionError(f"{name} in the JSON")

    out = json.loads(res.output.strip().splitlines()[-1], parse_constant=no_constants)
    assert out["results"] and all(r["ppl"] is None and r["ppl_ci"] is None for r in out["results"])


def _main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from kvstate.cli import main

    with pytest.raises(SystemExit) as done:
        main(args)
    out, err = capsys.readouterr()
    return int(done.value.code or 0), out, err


def test_generate_falls_back_on_a_corrupt_payload_and_says_so_in_one_line(
        pair_dirs: tuple[Path, Path], codec_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvstate.lab.harness import load_reference
    from kvstate.transfer.codec import Codec
    from kvstate.transfer.serving import producer_service
    from kvstate.transfer.store import MemoryStore
    from kvstate.transfer.transport import ServerThread

    p, c = pair_dirs
    model, _ = load_reference(p)
    service = producer_service(model, Codec.load(codec_dir), MemoryStore())
    serve = service.payload_bytes

    def corrupt(ids: list[int]) -> tuple[bytes, bool]:  # a bit flipped in transit, after the producer's checks
        data = serve(ids)[0]
        return data[:-1] + bytes([data[-1] ^ 1]), False

    service.payload_bytes = corrupt  # type: ignore[method-assign]
    with ServerThread(service) as srv:
        args = ["transfer", "generate", "--consumer", str(c), "--codec", str(codec_dir), "--server",
                f"127.0.0.1:{srv.port}", "--prompt", "the cat sat on the mat . answer :", "--max-new-tokens", "2",
                "--json"]
        code, out, err = _main(args, capsys)
        assert code == 0 and json.loads(out.strip().splitlines()[-1])["fallback"] is not None
        notes = [line for line in err.splitlines() if line.startswith("no payload:")]
        assert len(notes) == 1 and "checksum" in notes[0] and notes[0].endswith("prefilled on the consumer instead")
        code, out, err = _main([*args, "--no-fallback"], capsys)
        errors = [line for line in err.splitlines() if "error" in line.lower()]  # transformers' loading bar aside
        assert code == 2 and len(errors) == 1 and errors[0].startswith("error: ") and "checksum" in errors[0]


def test_generate_refuses_a_reply_that_is_not_utf8_in_one_line(pair_dirs: tuple[Path, Path], codec_dir: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    import socket
    import struct
    import threading

    _, c = pair_dirs
    listener = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:  # reads the hello frame, answers with bytes that are not UTF-8
        conn, _ = listener.accept()
        with conn:
            (n,) = struct.unpack(">I", conn.recv(4))
            while n > 0:
                n -= len(conn.recv(n))
            reply = b'{"ok": "\xc3\x28"}'  # invalid UTF-8 inside a JSON-looking reply
            conn.sendall(struct.pack(">I", len(reply)) + reply)
            conn.recv(1)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    with listener:
        code, _, err = _main(["transfer", "generate", "--consumer", str(c), "--codec", str(codec_dir), "--server",
                              f"127.0.0.1:{listener.getsockname()[1]}", "--prompt", "the cat sat", "--no-fallback"],
                             capsys)
        thread.join(5)
    errors = [line for line in err.splitlines() if "error" in line.lower()]  # transformers' loading bar aside
    assert code == 2 and len(errors) == 1 and errors[0].startswith("error: ") and "malformed reply" in errors[0]
    assert "Traceback" not in err


def test_the_bench_writes_the_experiment_loops_rows_beside_its_own(pair_dirs: tuple[Path, Path], codec_dir: Path,
                                                                   tmp_path: Path) -> None:
    from kvstate.lab import experiment as X
    from kvstate.transfer import methods as registry

    p, c = pair_dirs
    out = tmp_path / "bench.json"
    res = CliRunner().invoke(app, ["transfer", "bench", "--producer", str(p), "--consumer", str(c), "--codec",
                                   str(codec_dir), "--n", "2", "--length", "256", "--ppl-n", "0", "--weak-n", "0",
                                   "--ablation-n", "0", "--no-budget", "--methods", "raw,kivi4", "--out", str(out)])
    assert res.exit_code == 0, res.output
    [run] = json.loads(out.read_text())["runs"]
    assert run["experiment"]["axis"] == "across models" and run["experiment"]["methods"] == ["oracle", "raw", "kivi4"]
    assert run["pooled"]["reference"] == "oracle" and run["experiment"]["n"] == 2
    assert len(run["rows"]) == 3 * 4 and all(tuple(r) == X.ROW_KEYS and r["n"] == 2 for r in run["rows"])
    # the loop's per-item values are the bench's own per-task items
    by_task = {(r["method"], t): v["items"] for r in run["results"] for t, v in r["by_task"].items()}
    assert all(r["values"] == by_task[(r["method"], r["task"])] for r in run["rows"])
    # the provenance (so the seed ledger) names each method with its pair, as asked
    oracle = next(m.name for m in registry.methods() if not m.ships_payload)
    assert run["provenance"]["settings"]["methods"] == [f"{codec_dir.name}:{m}" for m in (oracle, "raw", "kivi4")]


def test_a_bench_on_a_dev_seed_into_models_is_refused_before_the_weights_load(
        pair_dirs: tuple[Path, Path], codec_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstate.lab import ledger as L

    root = tmp_path / "models"
    (root / "codec").mkdir(parents=True)
    monkeypatch.setattr(L, "results_root", lambda: root)
    loaded: list[object] = []
    monkeypatch.setattr("kvstate.lab.harness.load_reference", lambda *a, **k: loaded.append(a))
    p, c = pair_dirs
    out = root / "codec" / "bench.json"
    res = CliRunner().invoke(app, ["transfer", "bench", "--producer", str(p), "--consumer", str(c), "--codec",
                                   str(codec_dir), "--n", "1", "--length", "256", "--seed", "5", "--out", str(out)])
    assert isinstance(res.exception, L.SeedRefused) and "bench.json: --seed 5 is a dev seed" in str(res.exception)
    assert loaded == [] and not out.exists()


@pytest.mark.parametrize("command, bad, needle", [
    ("generate", ["--server", "localhost"], "--server 'localhost' must be HOST:PORT"),
    ("serve", ["--store", "mongodb://x"], "--store 'mongodb://x'"),
])
def test_an_argument_error_is_one_line_before_the_model_loads(pair_dirs: tuple[Path, Path], codec_dir: Path,
                                                              capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch, command: str,
                                                              bad: list[str], needle: str) -> None:
    import kvstate.transfer.cli

    loaded: list[Path] = []
    monkeypatch.setattr(kvstate.transfer.cli, "load_pair_model", lambda d: loaded.append(d) or (None, None))
    p, c = pair_dirs
    args = (["transfer", "generate", "--consumer", str(c), "--server", "127.0.0.1:1", "--prompt", "the cat"]
            if command == "generate" else ["transfer", "serve", "--producer", str(p), "--port", "0"])
    code, _, err = _main([*args, "--codec", str(codec_dir), *bad], capsys)
    assert code == 2 and loaded == [] and len(err.splitlines()) == 1 and needle in err
