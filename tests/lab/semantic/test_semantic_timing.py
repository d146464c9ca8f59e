"""The decode timing interleaves its rounds, reports every round with the median and spread, and refuses
fewer than five repeats."""

import pytest

from kvstate.lab.semantic.protocol import build_items
from kvstate.lab.semantic.timing import main, time_methods
from kvstate.lab.workloads import build_tokenizer
from kvstate.models import tiny_model
from kvstate.semantic import SegmentConfig


def test_rounds_median_and_ratio_per_round():
    tok = build_tokenizer()
    model = tiny_model("qwen3", vocab_size=len(tok))
    items = build_items(tok, "niah_single", 160, 1, 0)
    res = time_methods(model, tok, items, ["full", "sekv"], 0.7, None, SegmentConfig(sinks=2, recent=8, max_span=8), 5)
    for m in ("full", "sekv"):
        v = res[m]["ms_per_token_rounds"]
        assert len(v) == 5 and res[m]["min"] <= res[m]["median"] <= res[m]["max"] and min(v) > 0
    r = res["sekv"]["ratio_to_reference"]
    assert r["min"] <= r["median"] <= r["max"] and "ratio_to_reference" not in res["full"]


def test_fewer_than_five_repeats_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="needs >= 5 interleaved repeats"):
        main(["--repeats", "3", "--out", str(tmp_path / "t.json")])


def test_without_a_router_key_routed_methods_are_timed_and_the_task_is_recorded(model_dir, tmp_path):
    import json

    d, _, _ = model_dir
    out = tmp_path / "t.json"
    main(["--model", str(d), "--router", "none", "--task", "niah_single", "--length", "160", "--budget", "0.7",
          "--methods", "full,sekv_pages16", "--n", "1", "--recent", "8", "--max-span", "8", "--out", str(out)])
    run = json.loads(out.read_text())["runs"][-1]
    assert set(run["timing"]) == {"full", "sekv_pages16"} and run["provenance"]["tasks"] == ["niah_single"]
    assert len(run["provenance"]["models"]) == 1  # the model only: no router read
