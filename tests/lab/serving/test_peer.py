"""The peer benchmark's parts: its prompts, the stream parser and the closed loop over a scripted server, the
peer's mode per model, the resident-set sampler, the targets it registers, and its report part."""

from __future__ import annotations

import asyncio
import json
import os
import random
from pathlib import Path

import httpx
import pytest

from kvstate.lab.serving import peer, peer_section

REPO = Path(__file__).resolve().parents[3]


def _take(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(10**6)}" for _ in range(n))


def test_shared_prefix_prompts_cycle_four_prefixes_and_no_shared_prompts_share_none() -> None:
    load = peer.Load(prefix_tokens=5, suffix_tokens=2)
    shared = peer.prompts(_take, "shared-prefix", 9, load, random.Random(0))
    heads = [" ".join(p.split()[:5]) for p in shared]
    assert [heads.index(h) for h in heads] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    assert len(set(heads[:4])) == 4 and all(len(p.split()) == 7 for p in shared)
    assert len(set(shared)) == 9  # every tail fresh
    fresh = peer.prompts(_take, "no-shared-prefix", 6, load, random.Random(0))
    assert len({" ".join(p.split()[:5]) for p in fresh}) == 6
    # the same seed string gives every server the same prompts
    again = peer.prompts(_take, "shared-prefix", 9, load, random.Random(0))
    assert again == shared


def test_word_level_text_is_one_token_per_word() -> None:
    from kvstate.models.loading import load_tokenizer

    model = REPO / "models" / "ref-hybrid"
    tok = load_tokenizer(model)
    take = peer.text_source(model, tok)
    text = take(random.Random(1), 50)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 50 and tok.unk_token_id not in ids


def test_the_peer_is_sequential_on_a_hybrid_and_batches_on_attention() -> None:
    assert peer.peer_mode(REPO / "models" / "ref-hybrid") == "sequential"
    assert peer.peer_mode(REPO / "models" / "ref-attn") == "continuous-batching"


def test_sse_events_skip_done_and_comments() -> None:
    lines = ["data: {\"a\": 1}", "", ": keep-alive", "data: [DONE]", "data:{\"b\":2}"]
    assert peer.sse_events(lines) == [{"a": 1}, {"b": 2}]


def _scripted(texts: list[str], cached: int | None) -> httpx.MockTransport:
    """A server that streams ``texts`` as completion events (then a usage event when ``cached`` is set)."""
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        events = [{"choices": [{"index": 0, "text": t}]} for t in texts]
        events.append({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        if cached is not None and body.get("stream_options", {}).get("include_usage"):
            events.append({"choices": [], "usage": {"prompt_tokens": 9, "prompt_tokens_details":
                                                    {"cached_tokens": cached}}})
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    t = httpx.MockTransport(handler)
    t.seen = seen  # type: ignore[attr-defined]
    return t


def test_the_closed_loop_counts_text_events_reads_cached_tokens_and_answers_every_request() -> None:
    t = _scripted(["a", "b", "c"], cached=7)
    done = asyncio.run(peer.closed_loop("http://x", "m", ["p0", "p1", "p2", "p3", "p4"], 2, 3, usage=True,
                                        transport=t))
    assert len(done) == 5 and all(r["tokens"] == 3 and len(r["gaps"]) == 2 and r["reused"] == 7 for r in done)
    assert all(0 <= r["ttft"] <= r["end"] - r["start"] for r in done)
    assert sorted(b["prompt"] for b in t.seen) == ["p0", "p1", "p2", "p3", "p4"]  # type: ignore[attr-defined]
    assert all(b["temperature"] == 0 and b["stream"] and b["max_tokens"] == 3 for b in t.seen)  # type: ignore[attr-defined]
    # without usage (the peer) nothing is asked for and nothing is restored
    t2 = _scripted(["a"], cached=7)
    (one,) = asyncio.run(peer.closed_loop("http://x", "m", ["p"], 1, 3, usage=False, transport=t2))
    assert one["reused"] == 0 and "stream_options" not in t2.seen[0]  # type: ignore[attr-defined]


def test_a_refused_request_is_an_error_naming_the_status() -> None:
    t = httpx.MockTransport(lambda r: httpx.Response(422, text="Unexpected fields"))
    with pytest.raises(RuntimeError, match="422"):
        asyncio.run(peer.closed_loop("http://x", "m", ["p"], 1, 3, usage=False, transport=t))


def test_the_resident_set_sampler_sees_memory_another_process_takes_while_it_watches() -> None:
    """A child takes ~200 MiB for a moment and frees it: the sampler watching its pid saw the peak (a fresh process,
    so no allocator of this test process can hide the growth in memory it already holds)."""
    import subprocess
    import sys

    code = ("import sys, time; sys.stdin.readline(); b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); "
            "time.sleep(0.5); del b; time.sleep(0.3)")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    try:
        with peer.RssPeak(child.pid) as rss:
            start = peer.rss_bytes(child.pid)
            assert child.stdin is not None
            child.stdin.write(b"go\n")
            child.stdin.flush()
            child.wait(timeout=60)
    finally:
        child.kill()
    assert 0 < start < 150 * 2**20 <= rss.peak
    assert peer.rss_bytes(os.getpid()) > 0 and peer.rss_bytes(2**31 - 1) == 0


def test_the_targets_are_issue_46s_and_only_where_their_methods_run() -> None:
    whole, plan = peer.plans(Path("models/ref-attn"), 1082, 5, peer.Load(), (1, 8, 16), peer.TASKS,
                             "continuous-batching")
    assert whole.methods == tuple(f"{s}@c{c}" for c in (1, 8, 16) for s in peer.SERVERS)
    shared = {e.name: e for e in plan["shared-prefix"]}
    thresholds = {t.label.split(": ", 1)[1]: (t.method, t.against, t.threshold)
                  for e in shared.values() for t in e.targets}
    assert thresholds["ITL p50 at c = 8 <= 2.5x c = 1's (kvstate)"] == ("kvstate@c8", "kvstate@c1", 2.5)
    assert thresholds["TTFT p99 at c = 8 <= 4x c = 1's median (kvstate)"] == ("kvstate@c8", "kvstate@c1", 4.0)
    assert thresholds["kvstate peak RSS <= 1.3x transformers serve's, c = 8"] == ("kvstate@c8", "hf-serve@c8", 1.3)
    assert len(thresholds) == 8
    no_shared = [t for e in plan["no-shared-prefix"] for t in e.targets]
    assert len(no_shared) == 5 and not any("c = 1's" in t.label or "3x c = 1" in t.label for t in no_shared)
    _, only_c1 = peer.plans(Path("models/ref-attn"), 1082, 5, peer.Load(), (1,), ("shared-prefix",), "sequential")
    assert [t.label for e in only_c1["shared-prefix"] for t in e.targets] == [
        "shared-prefix: kvstate TTFT p50 <= transformers serve's, c = 1",
        "shared-prefix: kvstate output tokens/s >= transformers serve's, c = 1"]


def test_bad_input_is_one_line_naming_the_flag(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert peer.main(["--model", str(tmp_path)]) == 2
    assert "--model" in capsys.readouterr().err
    if peer_section.RUNS and (REPO / ".venv-peer" / "bin" / "transformers").is_file():
        assert peer.main(["--model", str(REPO / "models" / "ref-attn"), "--requests-c8", "0"]) == 2
        assert "--requests-c8 0: must be >= 1" in capsys.readouterr().err


def _run_doc(tmp: Path, file: str) -> None:
    reps = {f"r{i}": {"ttft_p50_s": 0.05, "ttft_p99_s": 0.1, "itl_p50_s": 0.005 * (i + 1), "output_tok_s": 100.0,
                      "goodput": 1.0, "peak_rss_bytes": 500 * 2**20} for i in range(5)}
    run = {"provenance": {"seeds": [1082], "settings": {"repeats": 5, "peer_mode": "sequential",
                                                         "load": {"prefix_tokens": 1024}}, "command": "cmd"},
           "rows": [{"task": "shared-prefix", "method": m, "extra": reps} for m in ("kvstate@c8", "hf-serve@c8")],
           "decisions": [{"label": "shared-prefix: kvstate output tokens/s >= transformers serve's, c = 8",
                          "method": "kvstate@c8", "metric": "ratio", "value": 0.5, "ci": [0.4, 0.8],
                          "status": "met", "seeds": [1082], "repeats": 5}],
           "goodput": [{"method": "kvstate@c8", "task": "shared-prefix", "met": 38, "requests": 40, "share": 0.95,
                        "ci": [0.83, 0.99]},
                       {"method": "hf-serve@c8", "task": "shared-prefix", "met": 4, "requests": 40, "share": 0.1,
                        "ci": [0.04, 0.23]}],
           "later_visits": [{"method": "kvstate@c8", "restoring_90pct": 99, "visits": 100},
                            {"method": "hf-serve@c8", "restoring_90pct": 0, "visits": 100}], "servers_agree": True}
    (tmp / file).parent.mkdir(parents=True, exist_ok=True)
    (tmp / file).write_text(json.dumps({"format": "kvstate-results/1", "runs": [run]}))


def test_the_report_part_shows_decisions_goodput_beside_the_peer_and_every_server(tmp_path: Path) -> None:
    file, _, label = next(r for r in peer_section.RUNS if "hybrid" in r[0])  # goodput is decided on the hybrid
    _run_doc(tmp_path, file)
    tables, head = peer_section.build(tmp_path)
    mine = [r for r in head if r.target.startswith(label)]
    assert mine[0].measured.startswith("2.00x tokens/s [1.25, 2.50]")
    assert "0.95 (38 / 40); transformers serve 0.10" in mine[1].measured and mine[1].status in ("undecided", "stale")
    assert len(mine) == 2 and [r[1] for r in tables[0].rows] == ["kvstate@c8", "hf-serve@c8"]
    assert tables[0].rows[0][4] == "15.0" and tables[0].rows[0][7] == "500" and tables[0].rows[0][8] == "99 / 100"
    assert tables[0].rows[1][8] == "not reported / 100"  # the peer says nothing of cached tokens
    # the other models' runs are missing: one row each naming its command
    missing = [r for r in head if r.status == "missing"]
    assert len(missing) == len(peer_section.RUNS) - 1 and all("serving.peer" in (r.command or "") for r in missing)
    attn, _, attn_label = next(r for r in peer_section.RUNS if "ref-attn" in r[0])
    _run_doc(tmp_path, attn)  # elsewhere goodput is a column, not a decided row
    _, head = peer_section.build(tmp_path)
    assert not any(r.target.startswith(attn_label) and "goodput" in r.target for r in head)
