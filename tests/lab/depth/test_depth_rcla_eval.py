"""The fine-tuned depth evaluation: the declared keep-0.5 family, model specs refused with the fix, and the driver
scoring the unmodified model once and every fine-tuned model under every pattern (a tiny Llama)."""

from __future__ import annotations

import json

import pytest
import torch

from kvstate.depth.attention import layer_specs
from kvstate.depth.patterns import LayerSpec, format_pattern
from kvstate.errors import KVStateError
from kvstate.lab.depth import rcla_eval as ev
from kvstate.models.tiny import tiny_model
from tests.lab.models.test_real_model import MODEL, needs_model

SMOL = [LayerSpec("full_attention", 3, 64)] * 30


def test_the_family_has_keep_top_shared_and_distinct_draws_all_with_15_owners():
    rows = ev.family(SMOL, draws=3)
    assert [r.label for r in rows] == ["keep@0.5", "top_shared@0.5", "rcla1@0.5", "rcla2@0.5", "rcla3@0.5"]
    assert all(len(r.pattern.owners) == 15 and r.kept == 0.5 for r in rows)
    assert len({r.pattern for r in rows}) == 5
    assert format_pattern(rows[0].pattern) == "_".join(str(i - i % 2) for i in range(30))  # CLA2
    assert ev.family(SMOL, draws=3) == rows and ev.family(SMOL, draws=3, draw_seed=1)[2] != rows[2]
    assert ev.method_names(["rcla"], rows[:2]) == ("base", "rcla", "rcla:keep@0.5", "rcla:top_shared@0.5")


def test_model_specs_are_refused_with_the_fix(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert ev.parse_models([f"a={tmp_path / 'm'}"]) == {"a": tmp_path / "m"}
    for bad, why in ((["a"], "NAME=DIR"), ([f"base={tmp_path / 'm'}"], "other than 'base'"),
                     ([f"a:b={tmp_path / 'm'}"], "without ':'"), ([f"a={tmp_path}"], "holds no model"),
                     ([], "at least one")):
        with pytest.raises(KVStateError, match=why):
            ev.parse_models(bad)


@needs_model
@torch.inference_mode()
def test_the_driver_scores_every_model_under_every_pattern_per_item(tmp_path):
    from kvstate.lab.experiment import run_items
    from kvstate.models.loading import load_tokenizer

    tok = load_tokenizer(MODEL)
    kw = {"num_hidden_layers": 4, "vocab_size": len(tok), "max_position_embeddings": 1024}
    models = {ev.BASE: tiny_model("llama", seed=2, **kw), "ft": tiny_model("llama", seed=3, **kw)}
    rows = ev.family(layer_specs(models["ft"].config), draws=1)
    e = ev.experiment(MODEL, {"ft": MODEL}, rows, ("niah_single",), (256,), 2, 5, 8, 0)
    seen = []
    out = tmp_path / "ft.json"
    doc = run_items(e, ev.Measure(models, tok, rows, 8, seen.append), out=out, appendix=lambda j: {
        "summary": ev.summary(e, [{"task": "niah_single", "length": 256, **j.get(f"5/256/niah_single/{i}")}
                                  for i in range(2)])})
    assert len(seen) == 2
    assert all(set(r["scores"]) == set(e.methods) == {"base", "ft", *(f"ft:{x.label}" for x in rows)}
               for r in doc["items"])
    replies = {r["extra"][m]["reply"] for r in doc["items"] for m in e.methods}
    assert len(replies) > 2  # the two models and the patterns say different things
    s = json.loads(out.read_text())["runs"][-1]["appendix"]["summary"]
    ft = s["models"]["ft"]
    assert set(ft["patterns"]) == {x.label for x in rows} and ft["worst_score"] <= ft["mean"]
    assert ft["worst"] in {f"ft:{x.label}" for x in rows}


def test_nearest_owner_draws_read_the_closest_owner_below_and_join_the_family():
    import itertools
    import random

    from kvstate.lab.depth import nearest

    small = SMOL[:6]
    for k in range(0, 6):  # every owner set of 6 layers with layer 0: brute force over the definition
        for rest in itertools.combinations(range(1, 6), k):
            owners = {0, *rest}
            p = nearest.from_owners(small, owners)
            assert p.sources == tuple(max(o for o in owners if o <= i) for i in range(6))
    with pytest.raises(KVStateError, match="layer 0 must own"):
        nearest.from_owners(small, {1, 2})
    got = nearest.draw_exact(SMOL, 15, random.Random(4))
    assert len(got.owners) == 15 and 0 in got.owners
    rows = ev.family(SMOL, draws=1, nearest=2)
    assert [r.label for r in rows] == ["keep@0.5", "top_shared@0.5", "rcla1@0.5", "near1@0.5", "near2@0.5"]
    assert all(len(r.pattern.owners) == 15 for r in rows) and len({r.pattern for r in rows}) == 5
    assert all(r.pattern.sources == nearest.from_owners(SMOL, r.pattern.owners).sources for r in rows[3:])
