"""The #45238-shape benchmark: its targets (per shape, the server's defaults, 60 of 64), and a small run on
ref-hybrid through the server's request path where a later request's hit is counted and the first is cold."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstate.lab.serving import shape45238 as S

REF = Path(__file__).resolve().parents[3] / "models" / "ref-hybrid"


def test_one_target_per_shape_on_the_servers_defaults() -> None:
    whole, per = S.plans(REF, 1077, 5)
    assert whole.tasks == tuple(S.SHAPES) and set(per) == set(S.SHAPES)
    for task, e in per.items():
        (t,) = e.targets
        assert (t.method, t.metric, t.threshold, e.tasks, e.n) == ("server", "score", 60 / 64, (task,), 5 * 64)
        assert task in t.label


def test_a_small_run_counts_hits_after_the_cold_first_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(S, "SHAPES", {"128-32": (128, 32)})
    monkeypatch.setattr(S, "REQUESTS", 4)
    whole, per = S.plans(REF, 3, 1)
    out = S.measure_all(REF, 3, 1, whole, per)
    rows = {r["method"]: r for r in out["doc"]["rows"]}
    assert set(rows) == set(S.METHODS)
    for r in rows.values():
        restored = r["extra"]["restored"]
        assert len(restored) == 4 and restored[0] == 0  # the first request of a stream is cold
        assert r["values"][0] == 0.0 and r["values"][1:] == [float(x >= 0.9 * 128) for x in restored[1:]]
    assert sum(rows["server"]["values"]) >= 2  # later requests resume inside the shared prefix
    assert out["provenance"]["seeds"] == [3] and out["doc"]["decisions"][0]["method"] == "server"
