"""The serving comparison on the real model: methods name a server at a concurrency, GuideLLM's output is read in
seconds, the prefix and prompts are cut to their token counts, the targets name measured methods, and the report
shows a committed run's table and decisions."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvstate.lab import experiment as X
from kvstate.lab.models import peer_section, section, serve_peer
from kvstate.lab.models.cli import REAL_MODEL, missing_hint

REPO = Path(__file__).resolve().parents[3]
MODEL = REPO / REAL_MODEL


def test_every_method_is_one_server_at_one_concurrency():
    assert len(set(serve_peer.METHODS)) == len(serve_peer.SERVERS) * len(serve_peer.CONCURRENCY)
    assert {serve_peer.split_method(m) for m in serve_peer.METHODS} == {
        (s, c) for s in serve_peer.SERVERS for c in serve_peer.CONCURRENCY}
    assert serve_peer.split_method("kvstate-nocache@c8") == ("kvstate-nocache", 8)


def _metric(p50: float, p99: float, mean: float) -> dict:
    return {"successful": {"count": 3, "mean": mean, "percentiles": {"p50": p50, "p99": p99}}}


def test_guidellm_output_is_read_in_seconds_with_its_errors():
    doc = {"benchmarks": [{"metrics": {
        "request_totals": {"successful": 3, "errored": 1, "incomplete": 1},
        "time_to_first_token_ms": _metric(250.0, 900.0, 300.0), "inter_token_latency_ms": _metric(40.0, 80.0, 45.0),
        "output_tokens_per_second": _metric(0.0, 0.0, 12.5), "prompt_token_count": _metric(2113.0, 2113.0, 2113.0)},
        "requests": {"errored": [{"info": {"error": "500 Internal Server Error\ntrace"}},
                                 {"info": {"error": "500 Internal Server Error\nother"}}]}}]}
    row = serve_peer.parse(doc)
    assert row["ok"] == 3 and row["failed"] == 2 and row["errors"] == ["500 Internal Server Error"]
    assert math.isclose(row["ttft_p50_s"], 0.25) and math.isclose(row["ttft_p99_s"], 0.9)
    assert math.isclose(row["itl_p50_s"], 0.04) and row["output_tok_s"] == 12.5 and row["prompt_tokens_p50"] == 2113


def test_a_metric_without_successes_reads_as_none():
    doc = {"benchmarks": [{"metrics": {"request_totals": {"successful": 0, "errored": 2, "incomplete": 0},
                                       "time_to_first_token_ms": {"successful": {"count": 0}}},
                           "requests": {"errored": []}}]}
    row = serve_peer.parse(doc)
    assert row["ttft_p50_s"] is None and row["output_tok_s"] is None and row["failed"] == 2


def test_the_targets_name_measured_methods_and_the_peer_runs_with_a_bounded_cache(tmp_path):
    ttft, per_token = serve_peer.plans(tmp_path, 1100, 5, serve_peer.Load(), "continuous-batching")
    for e in (ttft, per_token):
        assert e.kind == "timing" and e.repeats == 5
        assert all(t.method in e.methods and t.against in e.methods for t in e.targets)
    throughput = per_token.targets[0]
    assert (throughput.method, throughput.against, throughput.threshold) == ("kvstate@c8", "kvstate@c1", 1 / 3)
    peer = serve_peer.server_argv("hf-serve", tmp_path, 9, "continuous-batching")
    assert "--continuous-batching" in peer and peer[peer.index("--cb-num-blocks") + 1] == str(serve_peer.CB_BLOCKS)
    assert "--continuous-batching" not in serve_peer.server_argv("hf-serve", tmp_path, 9, "sequential")
    assert serve_peer.server_argv("kvstate-nocache", tmp_path, 9, "sequential")[-1] == "--no-cache"


@pytest.mark.skipif(not (MODEL / "manifest.json").is_file(), reason=missing_hint())
def test_the_prefix_and_prompts_have_their_token_counts_and_differ_per_index():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL))
    load = serve_peer.Load(prefix_tokens=300, prompt_tokens=20)
    prefix, prompts = serve_peer.texts(tok, 5, 1, load, 3)
    n = len(tok(prefix, add_special_tokens=False)["input_ids"])
    assert abs(n - 300) <= 2 and len(prompts) == 3 and len(set(prompts)) == 3
    assert all(abs(len(tok(p, add_special_tokens=False)["input_ids"]) - 20) <= 2 for p in prompts)
    assert serve_peer.texts(tok, 5, 2, load, 1)[0] != prefix and serve_peer.texts(tok, 5, 1, load, 3)[0] == prefix


def test_the_report_shows_the_committed_comparison(models, tmp_path):
    from kvstate.lab.cli_output import write_results

    ttft_e, tok_e = serve_peer.plans(tmp_path, 1100, 5, serve_peer.Load(), "continuous-batching")
    ttft = {"kvstate": 0.05, "kvstate-nocache": 9.0, "hf-serve": 0.2}
    rate = {"kvstate": 15.0, "kvstate-nocache": 3.0, "hf-serve": 10.0}

    def fake(cell: X.Cell) -> dict:
        server, c = serve_peer.split_method(cell.method)
        t = ttft[server] * c * (1 + 0.01 * cell.repeat * (1 + serve_peer.SERVERS.index(server)))
        return {"ttft_p50_s": t, "ttft_p99_s": 2 * t, "itl_p50_s": 0.05,
                "output_tok_s": rate[server] * (4 if c == 8 else 1) + cell.repeat * 0.01 * c, "reused_tokens": 2049}

    doc = X.run(ttft_e, lambda c: X.Measurement([fake(c)["ttft_p50_s"]], {f"r{c.repeat}": fake(c)}))
    tok = X.run(tok_e, lambda c: X.Measurement([1 / fake(c)["output_tok_s"]]))
    result = {k: doc[k] for k in ("experiment", "rows", "pooled", "decisions")}
    result |= {"per_token": {k: tok[k] for k in ("experiment", "rows", "decisions")}, "servers_agree": True}
    write_results(models / section.RESULTS / peer_section.FILE, result, doc["provenance"], overwrite=False)
    s = section.build(tmp_path, models)
    rows = {r.target: r for r in s.headline if r.technique == peer_section.WHERE}
    assert len(rows) == 7 and all(r.status in ("met", "missed") for r in rows.values())
    assert rows[ttft_e.targets[0].label].status == "met"  # 0.05 / 9.0
    assert rows[tok_e.targets[0].label].status == "met"  # c8 four times c1's rate: 1/4 <= 1/3
    table = next(t for t in s.tables if t.title.startswith("The real model served three ways"))
    got = {r[0]: r for r in table.rows}
    assert got["kvstate@c8"][1] == "408 [400–416]" and got["kvstate@c1"][5].startswith("2049") and \
        got["hf-serve@c1"][6] == 5
    assert (tmp_path / "smollm2_serve_peer.png").is_file()
