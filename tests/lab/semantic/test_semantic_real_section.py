"""The resolution section leads with the real model: the committed per-task runs read as one table over bf16
bytes, decided targets become headline rows, and the class floor is missed when a method collapses on a task the
full cache scores >= 0.5 on (met when none does)."""

from __future__ import annotations

from pathlib import Path

from kvstate.lab import experiment as X
from kvstate.lab import provenance as P
from kvstate.lab.semantic import real_section


def _row(method: str, task: str, score: float, mem: float) -> dict:
    return {"method": method, "task": task, "n": 10, "score": score, "ci": [max(score - 0.1, 0.0), min(score + 0.1, 1.0)],
            "memory_bf16": mem, "memory_bf16_max": mem + 0.001, "reads_bf16": 0.125 if method != "full" else 1.0,
            "memory_fp32": mem * 0.8}


def _commit(models: Path, task: str, seed: int, sekv: float, grid: real_section.Grid = real_section.READS_8) -> None:
    e = X.Experiment(axis="resolution", name="sekv-real", methods=("full", "sekv@0.125"), seeds=(seed,), tasks=(task,),
                     lengths=(2048,), n=10, code=("lab/scoring.py",),
                     targets=(X.Target("SEKV - full >= -0.05", "sekv@0.125", "difference", -0.05, against="full"),))

    def item(it: X.Item) -> X.ItemResult:
        return X.ItemResult({"full": 1.0, "sekv@0.125": float(it.index < round(sekv * 10))})

    rows = [_row("full", task, 1.0, 1.0), _row("sekv@0.125", task, sekv, 0.26)]
    if grid is not real_section.READS_8:  # the 16:1 runner (realmodel16) records no fp32 column: None
        rows = [{**r, "memory_fp32": None} for r in rows]
    checks = [{"method": "sekv@0.125", "memory_bf16_max": 0.261 if sekv < 0.5 else 0.31,
               "memory_context_bf16_max": 0.0625 if sekv < 0.5 else 0.07}]
    reads = [{"method": "sekv@0.125", "reads_bf16_max": 0.12 if sekv < 0.5 else 0.13, "reads_le_0.125_bf16": sekv < 0.5}]
    X.run_items(e, item, out=models / grid.file.format(task=task.removeprefix("real_niah_")),
                appendix=lambda _j: {"summary": {"rows": rows, "memory_checks": checks}, "reads_checks": reads})


def test_the_table_holds_every_task_and_a_collapse_misses_the_floor(models, tmp_path):
    _commit(models, "real_niah_single", 1100, 0.2)
    _commit(models, "real_niah_multikey", 1101, 1.0)
    tables, figures, head = real_section.build(models, tmp_path)
    rows = tables[0].rows
    assert [r[:2] for r in rows] == [["full", "real_niah_single"], ["sekv@0.125", "real_niah_single"],
                                     ["full", "real_niah_multikey"], ["sekv@0.125", "real_niah_multikey"]]
    assert rows[1][3] == "0.260 (0.261)" and rows[1][6] == "1100" and rows[3][6] == "1101"
    floor = next(h for h in head if "no task the full cache" in h.target)
    assert floor.status == "missed" and "sekv@0.125 real_niah_single 0.20 vs full 1.00" in floor.measured
    decided = [h for h in head if h.target == "SEKV - full >= -0.05"]
    by_task = {h.tasks[0]: h for h in decided}
    assert by_task["real_niah_single@2048"].status == "missed" and by_task["real_niah_single@2048"].measured.startswith("-0.800")
    assert by_task["real_niah_multikey@2048"].status != "missed"
    assert len(figures) == 1 and (tmp_path / "smollm2_sekv_2048.png").is_file()
    caps = {h.tasks[0] if h.tasks else "": h for h in head if "memory <= 0.3 x bf16" in h.target}
    assert [(h.status, h.measured) for h in caps.values()] == [("met", "0.261 x"), ("missed", "0.310 x")]


def test_no_collapse_meets_the_floor_and_no_file_names_the_command(models, tmp_path):
    _, _, head = real_section.build(models, tmp_path)
    assert [h.technique for h in head] == [g.where for g in real_section.GRIDS] + [real_section.PPL_WHERE] + \
        [real_section.DECODE_WHERE] * 2
    assert all(h.status == "missing" for h in head) and all("realmodel" in h.command for h in head[:4])
    assert "realmodel8 --set test --task real_niah_single" in head[0].command
    assert "sekv8_2048_single.json" in head[0].command and "sekv_2048.json" in head[1].command
    assert "--length 4096" in head[3].command and "sekv16_4096_single.json" in head[3].command
    assert "realmodel16 --set test --task real_niah_single" in head[2].command
    assert "sekv16_2048_single.json" in head[2].command
    _commit(models, "real_niah_single", 1100, 1.0)
    _, _, head = real_section.build(models, tmp_path)
    floor = next(h for h in head if "no task the full cache" in h.target)
    assert floor.status == "met"


def test_the_16_to_1_grid_is_its_own_table_with_its_cap_on_the_compressed_context(models, tmp_path):
    _commit(models, "real_niah_single", 1100, 0.2, real_section.MEMORY_16)
    _commit(models, "real_niah_multikey", 1101, 1.0, real_section.MEMORY_16)
    tables, figures, head = real_section.build(models, tmp_path)
    assert len(tables) == 1 and "16:1 of bf16 memory" in tables[0].title  # the 8:1 file is missing: its row only
    fp32 = tables[0].columns.index("memory fp32")
    assert [r[fp32] for r in tables[0].rows] == ["", "", "", ""]  # not recorded: an empty cell, not a crash
    assert (tmp_path / "smollm2_sekv16_2048.png").is_file() and len(figures) == 1
    caps = [(h.status, h.measured) for h in head if "memory <= 0.0625 x bf16" in h.target]
    assert caps == [("met", "0.0625 x"), ("missed", "0.0700 x")]
    assert [h.status for h in head if h.technique == real_section.READS_8.where] == ["missing"]
    floor = next(h for h in head if "no task the full cache" in h.target)
    assert floor.technique == real_section.MEMORY_16.where and "(16:1 memory)" in floor.target


def _timing(models: Path, length: int, ratios: list[float]) -> None:
    file, seed, n = real_section.DECODE[length]
    full = [50.0] * len(ratios)
    sekv = [50.0 * r for r in ratios]
    res = {"full": {"ms_per_token_rounds": full, "median": 50.0},
           "sekv_zip": {"ms_per_token_rounds": sekv, "median": sorted(sekv)[len(sekv) // 2],
                        "ratio_to_reference": {"median": sorted(ratios)[len(ratios) // 2], "min": min(ratios),
                                               "max": max(ratios)}}}
    rec = P.Recorder(code=("lab/semantic/timing.py",), n=n, seeds=[seed], tasks=["real_niah_single"], lengths=[length],
                     settings={"timing": True, "repeats": len(ratios)})
    P.append_run(models / file, {"timing": res}, rec.finish())


def test_decode_cost_is_decided_per_length_from_the_rounds_ratio_range(models, tmp_path):
    _timing(models, 4096, [0.9, 0.95, 0.92, 0.91, 0.93])  # every round under the cap
    _timing(models, 8192, [1.1, 1.3, 1.15, 1.2, 1.25])  # straddles 1.2x
    rows = real_section.decode_rows(models)
    assert [(r.status, r.repeats, r.timing) for r in rows] == [("met", 5, True), ("undecided", 5, True)]
    assert rows[0].measured.startswith("0.92x [0.90, 0.95] over 5 interleaved rounds") and "4,096" in rows[0].target
    assert rows[1].ci == (1.1, 1.3) and rows[1].seeds == (1100,)


def test_the_4k_grid_is_its_own_table_and_its_missing_task_is_not_a_row(models, tmp_path):
    _commit(models, "real_niah_single", 1100, 1.0, real_section.MEMORY_16_4K)
    tables, _, head = real_section.build(models, tmp_path)
    assert [t.title.split(" at ")[1][:5] for t in tables] == ["4,096"]  # the 2K files are missing: their rows only
    mine = [h for h in head if h.technique == real_section.MEMORY_16_4K.where]
    assert all(h.status != "missing" and h.artifact.endswith("sekv16_4096_single.json") for h in mine)
    assert {h.target for h in mine} >= {"SEKV - full >= -0.05", "sekv@0.125: memory <= 0.0625 x bf16 (the compressed "
                                        "context, everything held, the largest over the items)"}
    assert [h.status for h in head if h.technique == real_section.MEMORY_16.where] == ["missing"]


def test_the_8_to_1_retention_grid_leads_with_its_memory_and_reads_as_checks(models, tmp_path):
    _commit(models, "real_niah_single", 1102, 0.2, real_section.READS_8_RETAIN)
    _commit(models, "real_niah_multikey", 1103, 1.0, real_section.READS_8_RETAIN)
    tables, _, head = real_section.build(models, tmp_path)
    assert len(tables) == 1 and "retention" in tables[0].title
    mine = [h for h in head if h.technique == real_section.READS_8_RETAIN.where]
    checks = [(h.status, h.measured) for h in mine if h.kind == "check"]
    assert checks == [("met", "0.261 x"), ("met", "0.1200 x"), ("missed", "0.310 x"), ("missed", "0.1300 x")]
    assert all("peak read <= 0.125 x bf16" in h.target for h in mine if h.kind == "check" and h.measured.startswith("0.1"))
    assert [h.status != "missed" for h in mine if h.target == "SEKV - full >= -0.05"] == [False, True]


def test_held_out_perplexity_at_8_to_1_is_a_table_and_one_decided_row_per_compressed_method(models, tmp_path):
    from kvstate.lab.semantic import realmodel8_ppl as R

    tables, head = real_section.ppl(models)  # no file yet: one row naming the command
    assert tables == [] and len(head) == 1 and "realmodel8_ppl" in head[0].measured + str(head[0])
    methods = (R.REFERENCE, R.FLOOR, R.PROPOSED)
    e = X.Experiment(axis="resolution", name=R.EXPERIMENT, methods=methods, seeds=(1104,), tasks=(R.TASK,),
                     lengths=(R.CONTEXT,), n=8, reference=R.REFERENCE, code=("lab/scoring.py",),
                     settings={"text": "Python's topics", "continuation": R.CONTINUATION})
    nll = {i: 20.0 + i % 3 for i in range(8)}

    def extra(i: int) -> dict:
        return {R.REFERENCE: {"nll": nll[i], "tokens": 10, "memory_bf16": 1.0, "context_memory_bf16": 1.0},
                R.FLOOR: {"nll": nll[i] + 0.001 * (i % 2), "tokens": 10, "memory_bf16": 1.0, "context_memory_bf16": 1.0},
                R.PROPOSED: {"nll": nll[i] + 1.0 + 0.1 * (i % 3), "tokens": 10, "memory_bf16": 0.16,
                             "context_memory_bf16": 0.105}}

    recs = [{"scores": {R.REFERENCE: 1.0, R.FLOOR: 1.0, R.PROPOSED: 0.9}, "extra": extra(i)} for i in range(8)]
    X.run_items(e, lambda it: X.ItemResult(recs[it.index]["scores"], recs[it.index]["extra"]),
                out=models / real_section.PPL_FILE, appendix=lambda _j: R.summary(methods, recs, 1104))
    tables, head = real_section.ppl(models)
    assert [r[0] for r in tables[0].rows] == list(methods)
    assert [(h.status, h.target.split(":")[0]) for h in head] == [("missed", R.PROPOSED)]  # ~+11%: above +2%
    assert head[0].measured.startswith("1.1") and head[0].ci[0] > R.PPL_LIMIT
    assert tables[0].rows[2][4] == "0.105" and tables[0].rows[1][6] == ""  # the floor: shown, not decided


def test_the_floor_holds_the_decided_method_and_a_straddle_is_undecided_naming_the_class(models, tmp_path):
    _commit(models, "real_niah_single", 1100, 1.0)
    art = real_section._artifacts(models)[0]

    def row(method: str, task: str, score: float, lo: float, hi: float) -> dict:
        return {"method": method, "task": task, "score": score, "ci": [lo, hi]}

    rows = [row("full", "real_niah_single", 1.0, 0.96, 1.0), row("full", "real_niah_multikey", 0.6, 0.5, 0.7),
            row("sekv@0.125", "real_niah_single", 0.97, 0.92, 1.0), row("sekv@0.125", "real_niah_multikey", 0.5, 0.4, 0.6),
            row("quest", "real_niah_single", 0.0, 0.0, 0.04), row("quest", "real_niah_multikey", 0.0, 0.0, 0.04)]
    mine = real_section._floor(rows, art, proposed="sekv@0.125")
    assert mine.status == "undecided" and mine.target.startswith("sekv@0.125: no task the full cache")
    assert "real_niah_multikey 0.50 [0.40, 0.60] straddles 0.9x full 0.60 = 0.540" in mine.measured
    assert "quest" not in mine.measured  # a baseline's collapse is not the proposed method's
    every = real_section._floor(rows, art)  # no decided method: every method held to it
    assert every.status == "missed" and "quest real_niah_single 0.00 vs full 1.00" in every.measured
    rows[3] = row("sekv@0.125", "real_niah_multikey", 0.3, 0.2, 0.4)
    assert real_section._floor(rows, art, proposed="sekv@0.125").status == "missed"
