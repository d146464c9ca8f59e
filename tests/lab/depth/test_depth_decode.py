"""Decode cost of sharing patterns through model.generate: kvstate depth decode on a tiny start model."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvstate.errors import KVStateError


def test_decode_benchmark_rows_hold_measured_kv_proportional_to_kept_layers(start):
    from kvstate.lab.depth.deploy import decode_benchmark
    from kvstate.lab.harness import load_reference

    model, _ = load_reference(start)
    rows = decode_benchmark(model, [1, 0.5, 0.25], context=48, new_tokens=4, repeats=2)
    assert [r["pattern"] for r in rows] == ["0_1_2_3", "0_0_2_2", "0_0_0_0"]
    full = rows[0]["cache_bytes"]
    # held after generate: 48 + 4 tokens, but the last generated token is never fed back -> 51 positions
    assert full == 51 * 4 * 2 * 2 * 16 * 4  # tokens x layers x K,V x kv heads x head_dim x fp32
    assert [r["cache_bytes_vs_full"] for r in rows] == [1.0, 0.5, 0.25]
    assert all(r["decode_tok_s"] > 0 and r["decode_tok_s_range"][0] <= r["decode_tok_s"] <= r["decode_tok_s_range"][1]
               for r in rows)
    assert rows[0]["decode_speedup_vs_full"] == 1.0
    with pytest.raises(KVStateError, match="positions"):
        decode_benchmark(model, [1], context=10**6, new_tokens=4)
    with pytest.raises(KVStateError, match="new_tokens >= 2"):
        decode_benchmark(model, [1], context=8, new_tokens=1)


def test_decode_cli_json_on_stdout_and_results_file(start, tmp_path):
    from kvstate.cli import app

    out = tmp_path / "depth_decode.json"
    res = CliRunner().invoke(app, ["depth", "decode", "--model", str(start), "--keep", "1,0.5", "--context", "32",
                                   "--new-tokens", "3", "--repeats", "1", "--json", "--out", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [r["keep"] for r in doc["results"]] == [1.0, 0.5] and doc["provenance"]["lengths"] == [32]
    saved = json.loads(out.read_text())
    assert saved["format"] == "kvstate-results/1" and len(saved["runs"]) == 1
