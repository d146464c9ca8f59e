"""The depth headline's report part: a table per length, one headline row per pre-registered target with the loop's
status, the per-class 0.9x check naming the worst pattern, and a missing file shown with the command that writes it."""

from __future__ import annotations

from kvstate.depth.patterns import LayerSpec
from kvstate.lab.depth import rcla_section, rcla_test
from kvstate.lab.experiment import ItemResult, items, run_items

SMOL = [LayerSpec("full_attention", 3, 64)] * 30


def _models(tmp_path):
    out = {}
    for name in ("base", "rcla", "cla2"):
        d = tmp_path / "weights" / name
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        out[name] = d
    return out


def _run(models_dir, tmp_path):
    m = _models(tmp_path)
    plan = rcla_test.PLANS[2048]
    rows = rcla_test.declared_family(SMOL)
    e = rcla_test.experiment(plan, rows, 1069, 40, m["base"], {"rcla": m["rcla"], "cla2": m["cla2"]}, 48)

    def fn(item):
        k = item.index
        single = item.task == "niah_single"
        s = {"base": 1.0 if single else float(k % 5 != 0), "rcla": 1.0}
        for r in rows:
            s[f"rcla:{r.label}"] = 0.0 if r.label == "top_shared@0.5" else (1.0 if single else float(k % 5 != 0))
            s[f"cla2:{r.label}"] = 1.0 if r.label == "keep@0.5" else 0.0
        return ItemResult(s, {})

    recs = {}

    def measure(item):
        got = fn(item)
        recs[item.unit] = {"scores": dict(got.scores)}
        return got

    out = models_dir / "smollm2" / "depth_rcla_2048.json"
    out.parent.mkdir(parents=True)
    run_items(e, measure, out=out, appendix=lambda j: {"summary": rcla_test.summary(e, [
        {"task": it.task, "length": it.length, **recs[it.unit]} for it in items(e)])})
    return e


def test_the_headline_rows_are_the_loops_decisions_and_the_class_check(tmp_path):
    models_dir = tmp_path / "models"
    e = _run(models_dir, tmp_path)
    tables, head = rcla_section.build(models_dir)
    assert len(tables) == 1 and "2,048 tokens" in tables[0].title
    assert tables[0].rows[0][:2] == ["base", "niah_single"] and len(tables[0].rows) == 2 * len(e.methods)
    assert "rcla: worst top_shared@0.5 0.00" in tables[0].note
    by = {r.target: r for r in head}
    decided = [t.label for t in e.targets]
    assert all(t in by for t in decided)
    assert by["R-CLA top_shared@0.5 within 0.10 of the unmodified model at 2048"].status == "missed"
    assert by["R-CLA keep@0.5 within 0.10 of the unmodified model at 2048"].status == "met"
    assert by["R-CLA ahead of the CLA2 specialist by 0.10 on near1@0.5 at 2048"].status == "met"
    # pooled over the solved class only (niah_single; the base's 0.8 on multikey is beside it): 1.0 vs 1.0 on 40
    # items cannot rule out a 2-point loss — the interval decides, not the point
    own = by["R-CLA within 0.02 of the CLA2 specialist at its own pattern (keep@0.5) at 2048"]
    assert own.status == "undecided" and own.ci[0] < -0.02 < 0 < own.ci[1] and own.n == 40
    cls = [r for r in head if r.target.startswith("every pattern >= 0.9x")]
    assert [r.target.split(" on ")[-1] for r in cls] == ["niah_single@2048", "niah_multikey@2048"]
    assert all(r.status == "missed" and "worst top_shared@0.5 0.00" in r.measured for r in cls)
    missing = [r.command for r in head if r.status == "missing"]  # 4K and the perplexity run
    assert missing == [rcla_section.command(4096), rcla_test.PPL_COMMAND, rcla_test.PPL_COMMAND]
    assert "--length 4096 --seed 1070" in missing[0]


def test_no_files_give_one_missing_row_per_target_group_with_its_command(tmp_path):
    tables, head = rcla_section.build(tmp_path)
    assert tables == [] and [r.status for r in head] == ["missing"] * 4
    assert [r.command for r in head] == [rcla_section.command(2048), rcla_section.command(4096),
                                         rcla_test.PPL_COMMAND, rcla_test.PPL_COMMAND]


def _ppl_file(models_dir, tmp_path, rcla_nll, own_nll):
    """A perplexity result through the loop: 17 windows; the reference's NLL 2.0 per token, R-CLA's given."""
    from kvstate.lab.depth import rcla_ppl, real_ppl

    rows = rcla_test.declared_family(SMOL)
    labels = [r.label for r in rows]
    m = _models(tmp_path / f"w-{models_dir.name}")
    e = rcla_ppl.experiment(rows, 1071, 17, m["base"], {"rcla": m["rcla"], "cla2": m["cla2"]})
    methods = e.methods
    recs = {}

    def fn(item):
        wobble = 0.02 * ((item.index % 3) - 1)
        nll = {"base": 2.0, "rcla": own_nll, **{f"rcla:{x}": rcla_nll.get(x, 2.0) for x in labels},
               "cla2": 2.5, **{f"cla2:{x}": 3.0 for x in labels}}  # the specialist's rows decide nothing
        jitter = {m: 0.0 if m == "base" else 0.002 * ((item.index % 2) * 2 - 1) for m in nll}  # paired spread
        extra = {m: {"nll": round((v + wobble + jitter[m]) * 511, 4), "tokens": 511} for m, v in nll.items()}
        recs[item.unit] = {"scores": {m: 0.5 for m in methods}, "extra": extra}
        return ItemResult(recs[item.unit]["scores"], extra)

    out = models_dir / rcla_test.PPL_FILE.relative_to("models")
    out.parent.mkdir(parents=True, exist_ok=True)
    def appendix(j):
        s = real_ppl.summary(e, [recs[it.unit] for it in items(e)])
        return {"summary": s, "decisions": rcla_ppl.decisions(s)}

    run_items(e, fn, out=out, appendix=appendix)


def test_perplexity_targets_read_the_worst_pattern_and_the_own_kv_ratio(tmp_path):
    import math

    models_dir = tmp_path / "models"
    _ppl_file(models_dir, tmp_path, {"top_shared@0.5": 2.2}, 2.0)  # exp(0.2) = 1.22x on top_shared; own equal
    tables, head = rcla_section.build(models_dir)
    by = {r.target: r for r in head if r.status != "missing"}
    half = by["R-CLA held-out perplexity, every keep-0.5 pattern <= 1.05x the unmodified model"]
    assert half.status == "missed" and half.measured.startswith(f"worst top_shared@0.5 {math.exp(0.2):.3f}x")
    one = by["R-CLA held-out perplexity on its own K/V within 1% of the unmodified model"]
    assert one.status == "met" and one.n == 17
    assert tables[-1].rows[0][0] == "base" and len(tables[-1].rows) == 11
    _ppl_file(tmp_path / "m2", tmp_path, {}, 2.05)  # own K/V 1.051x: missed; every pattern equal: met
    by = {r.target: r for r in rcla_section.build(tmp_path / "m2")[1] if r.status != "missing"}
    assert by["R-CLA held-out perplexity on its own K/V within 1% of the unmodified model"].status == "missed"
    assert by["R-CLA held-out perplexity, every keep-0.5 pattern <= 1.05x the unmodified model"].status == "met"


def test_a_target_with_nothing_pooled_stays_in_the_headline_as_undecided(tmp_path):
    m = _models(tmp_path)
    rows = rcla_test.declared_family(SMOL)
    plan = rcla_test.PLANS[4096]
    e = rcla_test.experiment(plan, rows, 1070, 4, m["base"], {"rcla": m["rcla"]}, 48)
    recs = {}

    def measure(item):  # the reference solves nothing (0.5 < 0.9): no task is pooled
        s = {name: float(item.index % 2) for name in e.methods}
        recs[item.unit] = {"scores": s}
        return ItemResult(s, {})

    out = tmp_path / "models" / "smollm2" / "depth_rcla_4096.json"
    out.parent.mkdir(parents=True)
    run_items(e, measure, out=out, appendix=lambda j: {"summary": rcla_test.summary(e, [
        {"task": it.task, "length": it.length, **recs[it.unit]} for it in items(e)])})
    tables, head = rcla_section.build(tmp_path / "models")
    assert "at 4,096 tokens: R-CLA under" in tables[0].title  # the specialist is not scored at 4K
    mine = [r for r in head if r.target.endswith("at 4096")]
    assert len(mine) == 4 and all(r.status == "undecided" and r.measured.startswith("— (the reference") for r in mine)
