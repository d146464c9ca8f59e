"""Report part: SEKV and its equal-memory baselines on the real model (SmolLM2-135M-Instruct), every byte against a
bf16 full cache — the resolution section's first table (SEKV: "a semantic multi-resolution KV cache", ``docs/
techniques.md#resolution``; Quest: "Query-Aware Sparsity for Efficient Long-Context LLM Inference").

Reads the committed ``models/smollm2/sekv_2048.json`` (:mod:`kvstate.lab.semantic.realmodel`; one run per task, each
on its own test seed), ``sekv8_2048_{task}.json`` (:mod:`kvstate.lab.semantic.realmodel8`, the retention design at
8:1, shown first), the 16:1 files (:mod:`kvstate.lab.semantic.realmodel16`) and ``sekv8_ppl.json`` (held-out
perplexity at 8:1, :mod:`kvstate.lab.semantic.realmodel8_ppl`): per method and task the score with its interval and n, memory (every tier, mean and largest
over the items) and reads per pass over a bf16 full cache, memory over the fp32 cache beside; a figure of score
against bf16 memory per task; one headline row per decided target, and the class floor (no task the full cache
scores >= 0.5 on below 0.9x it) as a row. A missing or stale file shows the command that writes it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstate.lab import stats
from kvstate.lab.experiment import headline_fields
from kvstate.lab.provenance import Artifact, load_artifact, read_runs
from kvstate.lab.report import plots
from kvstate.lab.report.html import Figure, HeadlineRow, Table, artifact_row
from kvstate.lab.report.ppl_rows import headline, ppl_rows, seeds

FLOOR_AT, FLOOR = 0.5, 0.9


@dataclass(frozen=True)
class Grid:
    """One result file of :mod:`kvstate.lab.semantic.realmodel` and how the report shows it."""

    file: str  # under models/; "{task}" in it: one file per task (runs that go side by side), named by TASKS
    command: str
    where: str  # the headline rows' place
    title: str
    cap: float  # issue 48's memory cap, over a bf16 full cache
    cap_key: str  # the memory check's field: "memory_bf16_max" (after the answer) or "memory_context_bf16_max"
    cap_what: str
    figure: str


READS_8 = Grid("smollm2/sekv_2048.json",
               "OMP_NUM_THREADS=1 python -m kvstate.lab.semantic.realmodel --set test --task TASK --n 100 --seed SEED "
               "--out models/smollm2/sekv_2048.json",
               "SEKV on the real model (2K, 8:1 reads)",
               "Real model (SmolLM2-135M-Instruct) at 2,048 tokens, 8:1 reads: score and bytes over a bf16 full cache "
               "(fp32 beside)", 0.30, "memory_bf16_max", "every tier, the largest over the items", "smollm2_sekv_2048.png")
TASKS = ("single", "multikey")  # real_niah_<task>
MEMORY_16 = Grid("smollm2/sekv16_2048_{task}.json",
                 "OMP_NUM_THREADS=1 python -m kvstate.lab.semantic.realmodel16 --set test --task real_niah_{task} "
                 "--n 100 --seed SEED --out models/smollm2/sekv16_2048_{task}.json",
                 "SEKV on the real model (2K, 16:1 memory)",
                 "Real model (SmolLM2-135M-Instruct) at 2,048 tokens, 16:1 of bf16 memory: query-agnostic retention x "
                 "a quantized tier against its 16-bit twin, the window and kvpress's presses", 0.0625,
                 "memory_context_bf16_max", "the compressed context, everything held, the largest over the items",
                 "smollm2_sekv16_2048.png")
# the same grid at 4,096 tokens, where the full cache still solves niah_single (0.94 in realtext_4096.json; multikey
# 0.53): the 16:1 configuration chosen at 2K, run with --length 4096 on fresh test seeds
MEMORY_16_4K = Grid("smollm2/sekv16_4096_{task}.json",
                    "OMP_NUM_THREADS=1 python -m kvstate.lab.semantic.realmodel16 --set test --task real_niah_{task} "
                    "--length 4096 --n 100 --seed SEED --out models/smollm2/sekv16_4096_{task}.json",
                    "SEKV on the real model (4K, 16:1 memory)",
                    "Real model (SmolLM2-135M-Instruct) at 4,096 tokens, 16:1 of bf16 memory: query-agnostic retention "
                    "x a quantized tier against its 16-bit twin, the window and kvpress's presses", 0.0625,
                    "memory_context_bf16_max", "the compressed context, everything held, the largest over the items",
                    "smollm2_sekv16_4096.png")
# the 16:1 retention design at 8:1 (lab/semantic/realmodel8.py): 0.105 of bf16 held, so its peak read with the
# question and the answer stays within 1/8; one file per task, each on its own test seed
READS_8_RETAIN = Grid("smollm2/sekv8_2048_{task}.json",
                      "OMP_NUM_THREADS=1 python -m kvstate.lab.semantic.realmodel8 --set test --task real_niah_{task} "
                      "--n 100 --seed SEED --out models/smollm2/sekv8_2048_{task}.json",
                      "SEKV on the real model (2K, 8:1 reads, retention)",
                      "Real model (SmolLM2-135M-Instruct) at 2,048 tokens, 8:1 reads: SEKV's query-agnostic retention x "
                      "4-bit codes against its 16-bit twin, the paged design and Quest-like with 4-bit pages", 0.30,
                      "memory_bf16_max", "every tier, the largest over the items", "smollm2_sekv8_2048.png")
GRIDS = (READS_8_RETAIN, READS_8, MEMORY_16, MEMORY_16_4K)  # as the section shows them: the newest 8:1 design first
FILE, COMMAND, WHERE, MEMORY_CAP = READS_8.file, READS_8.command, READS_8.where, READS_8.cap
PROBE = "smollm2_routing_probe_{task}.json"  # docs/results/: the dev-seed routing probe (lab/semantic/real_routing.py)
PROBE_COMMAND = ("OMP_NUM_THREADS=1 python -m kvstate.lab.semantic.real_routing --task real_niah_{task} --n 40 "
                 "--seed {seed} --out docs/results/smollm2_routing_probe_{task}.json")
PROBE_SEEDS = {"single": 484, "multikey": 485}


def _artifacts(models_dir: Path, grid: Grid = READS_8) -> list[Artifact]:
    """One artifact per task: the newest run of each (a file holds one run per task)."""
    from kvstate.lab.provenance import load_artifact

    if "{task}" in grid.file:  # one file per task: each file's newest run, the missing ones shown as such
        arts = [a for t in TASKS for a in _artifacts(models_dir, Grid(grid.file.format(task=t), grid.command.format(
            task=t), *dataclasses.astuple(grid)[2:]))]
        return [a for a in arts if a.run is not None] or arts[:1]
    path = models_dir / grid.file
    if not path.is_file():
        return [load_artifact(path, grid.command)]
    tasks: list[str] = []
    for r in read_runs(path):
        for t in (r.get("experiment") or {}).get("tasks") or []:
            if t not in tasks:
                tasks.append(t)

    def newest_of(task: str) -> Any:
        return lambda r: task in ((r.get("experiment") or {}).get("tasks") or [])

    return [load_artifact(path, grid.command, select=newest_of(t)) for t in tasks] or \
        [load_artifact(path, grid.command)]


def _num(x: float | None) -> str:
    """A byte ratio to three places; empty where the run did not record it (the 16:1 runs hold no fp32 column)."""
    return "" if x is None else f"{x:.3f}"


def _summary_rows(art: Artifact) -> list[dict[str, Any]]:
    return list((((art.run or {}).get("appendix") or {}).get("summary") or {}).get("rows") or [])


def _figure(rows: list[dict[str, Any]], out_dir: Path, grid: Grid = READS_8) -> Figure | None:
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    if not tasks:
        return None
    fig, axes = plots.figure(0.9, 3.2, ncols=len(tasks))
    for ax, task in zip(axes[0], tasks, strict=True):
        for r in (r for r in rows if r["task"] == task):
            lo, hi = r["ci"]
            ax.errorbar([r["memory_bf16"]], [r["score"]], yerr=[[r["score"] - lo], [hi - r["score"]]], fmt="o",
                        capsize=3, color=plots.color(r["method"].split("@")[0]), label=r["method"])
        ax.set_xscale("log")
        ax.set_ylim(-0.02, 1.05)
        ax.set_xlabel("memory / bf16 full cache (every tier)")
        ax.set_title(task, fontsize=9)
    axes[0][0].set_ylabel("score (95% interval)")
    axes[0][-1].legend(fontsize=6, loc="center right")
    name = plots.save(fig, out_dir, grid.figure)
    return Figure(f"{grid.title.split(':')[0]}: score against memory over a bf16 full cache", name,
                  "Wilson 95% intervals, n = 100 per point; the full cache at 1.")


def _reference(art: Artifact) -> str:
    """The run's reference method (whose scores decide the solved tasks: the full cache), as the loop recorded it."""
    return str(((art.run or {}).get("pooled") or {}).get("reference") or "")


def _floor(rows: list[dict[str, Any]], art: Artifact, grid: Grid = READS_8,
           proposed: str | None = None) -> HeadlineRow | None:
    """No task the reference (the full cache) scores >= 0.5 on falls below 0.9x it, for ``proposed`` (the method
    the grid's targets decide; None: every method), each task on the method's own interval."""
    ref = _reference(art)
    full = {r["task"]: r for r in rows if r["method"] == ref}
    classes = [t for t, r in full.items() if r["score"] >= FLOOR_AT]
    if not classes:
        return None
    fell, open_ = [], []
    for r in rows:
        if r["method"] == ref or r["task"] not in classes or proposed not in (None, r["method"]):
            continue
        bar = FLOOR * full[r["task"]]["score"]
        if r["ci"][1] < bar:
            fell.append(f"{r['method']} {r['task']} {r['score']:.2f} vs full {full[r['task']]['score']:.2f}")
        elif r["ci"][0] < bar:
            open_.append(f"{r['method']} {r['task']} {r['score']:.2f} [{r['ci'][0]:.2f}, {r['ci'][1]:.2f}] straddles "
                         f"{FLOOR}x full {full[r['task']]['score']:.2f} = {bar:.3f}")
    status = "missed" if fell else "undecided" if open_ else "met"
    shown = fell or open_
    measured = "; ".join(shown[:4]) + (f" and {len(shown) - 4} more" if len(shown) > 4 else "") if shown else \
        f"no class below 0.9x ({len(classes)} classes)"
    who = f"{proposed}: " if proposed else ""
    return artifact_row(art, grid.where, f"{who}no task the full cache scores >= {FLOOR_AT} on below {FLOOR}x it "
                        f"({grid.where.split(', ')[-1].rstrip(')')})", measured, status=status)


def _probe_table(models_dir: Path) -> Table | None:
    """The routing probe on dev seeds: per ranker, metadata charged or not, the score beside the full cache's and
    the attention mass of the paged middle its pages captured (mean over passes and layers)."""
    from kvstate.lab.provenance import load_artifact

    body = []
    for task, seed in PROBE_SEEDS.items():
        path = models_dir.parent / "docs" / "results" / PROBE.format(task=task)
        art = load_artifact(path, PROBE_COMMAND.format(task=task, seed=seed))
        if art.run is None:  # a dev-seed diagnosis: shown where it was run, not asked for
            continue
        summ = ((art.run.get("appendix") or {}).get("summary") or {})
        for r in art.run.get("rows") or []:
            m = r["method"]
            extra = summ.get(m) or {}
            pages = extra.get("pages_read")
            body.append([m, r["task"], f"{r['value']:.2f} [{r['ci'][0]:.2f}, {r['ci'][1]:.2f}] ({r['n']})",
                         f"{extra['captured']:.3f}" if "captured" in extra else "",
                         f"{pages[0]}-{pages[1]} of {extra['pages'][0]}" if pages else "", f"{seed} ({art.status})"])
    if not body:
        return None
    return Table("Why page routing collapses on the real model (dev seeds, a diagnosis): Quest-like pages at 2K, "
                 "8:1 reads, ranked by Quest's bound, by q . mean key or by the attention oracle",
                 ["ranker", "task", "score [95%] (n)", "captured attention mass", "pages read per pass", "dev seed"],
                 body, "bound / mean / oracle: the ranker's metadata (2 / 1 / 2 key vectors per page) charged to the "
                 "read budget; *_free: uncharged (Quest's token budget); captured: the routing query's attention to "
                 "the paged middle that falls in the pages read, mean over passes and layers. The oracle needs every "
                 "key and is not a method. lab/semantic/real_routing.py")


def build(models_dir: Path, out_dir: Path) -> tuple[list[Table], list[Figure], list[HeadlineRow]]:
    probe = _probe_table(models_dir)
    tables, figures, head = [], [], []
    for grid in GRIDS:
        t, f, h = _build(models_dir, out_dir, grid)
        tables, figures, head = tables + t, figures + f, head + h
    ppl_tables, ppl_head = ppl(models_dir)
    return (tables + ppl_tables + ([probe] if probe is not None else []), figures,
            head + ppl_head + decode_rows(models_dir))


# issue 48's held-out perplexity at 8:1 (lab/semantic/realmodel8_ppl.py): one run on its own test seed
PPL_FILE = "smollm2/sekv8_ppl.json"
PPL_COMMAND = ("OMP_NUM_THREADS=1 python -m kvstate.lab.semantic.realmodel8_ppl --n 100 --seed SEED "
               "--out models/smollm2/sekv8_ppl.json")
PPL_WHERE = "SEKV on the real model (1K, 8:1, held-out perplexity)"


def ppl(models_dir: Path) -> tuple[list[Table], list[HeadlineRow]]:
    """Held-out perplexity at 8:1 (``sekv8_ppl.json``): the table and one headline row per compressed method (its
    paired perplexity ratio to the full cache's against the pre-registered limit, decided by the run)."""
    art = load_artifact(models_dir / PPL_FILE, PPL_COMMAND)
    if art.run is None:
        return [], [artifact_row(art, PPL_WHERE, "held-out perplexity at 8:1: SEKV <= 1.02x the full cache's", "")]
    run, body, head = art.run, [], []
    exp = run.get("experiment") or {}
    for p in ppl_rows(art):
        r, a = p.row, p.score
        body.append([p.method, p.perplexity, p.ratio,
                     f"{a['value']:.3f} [{a['ci'][0]:.3f}, {a['ci'][1]:.3f}]" if a and a.get("ci") else
                     f"{r['top1_agreement']:.3f}", _num(r.get("context_memory_bf16_max")), _num(r.get("memory_bf16_max")),
                     r.get("status", ""), str(r["windows"]), seeds(art), art.status])
        head += [h for h in [headline(art, PPL_WHERE, p, " at 8:1")] if h is not None]
    settings = (run.get("provenance") or {}).get("settings") or {}
    table = Table("Real model (SmolLM2-135M-Instruct): held-out perplexity after compressing the context at 8:1",
                  ["method", "perplexity [95%]", "ratio to full [95%, paired]", "top-1 = full's [95%]",
                   "memory bf16, context (max)", "memory bf16, at the end (max)", "target", "windows", "seed", "file"],
                  body,
                  f"windows of {settings.get('text', 'held-out text')}: "
                  f"{', '.join(str(x) for x in exp.get('lengths', []))} context tokens compressed, then the "
                  f"{settings.get('continuation', '')} next tokens fed one at a time and scored (teacher-forced); "
                  "full_bf16: the full cache rounded to bf16 (the noise floor, never decided); memory at the end "
                  "includes the continuation, which every method holds exact")
    return [table], head


# issue 48's decode cost at 16:1 of memory: one timing run per length, each on its own test seed
DECODE = {4096: ("smollm2/sekv16_decode.json", 1099, 2), 8192: ("smollm2/sekv16_decode_8192.json", 1100, 1)}
DECODE_CAP = 1.2  # SEKV <= 1.2x the full cache's ms/token
DECODE_WHERE = "SEKV on the real model (decode, 16:1 memory)"


def decode_command(length: int) -> str:
    file, seed, n = DECODE[length]
    return (f"python -m kvstate.lab.semantic.timing --model models/smollm2-135m-instruct --router none "
            f"--task real_niah_single --length {length} --budget 0.0625 --methods full,sekv_zip,kvzip_local "
            f"--n {n} --repeats 5 --seed {seed} --out models/{file}")


def decode_rows(models_dir: Path, proposed: str = "sekv_zip") -> list[HeadlineRow]:
    """``proposed``'s ms / token over the full cache's, per round of one interleaved timing run at each length
    (question pass and greedy answer), decided from the rounds' min / max ratio against :data:`DECODE_CAP`."""
    rows = []
    for length, (file, _, _) in DECODE.items():
        art = load_artifact(models_dir / file, decode_command(length))
        target = f"{proposed} at 16:1 of bf16 memory, decode at {length:,} tokens: ms/token <= {DECODE_CAP}x full's"
        row = ((art.run or {}).get("timing") or {}).get(proposed)
        if art.run is None or row is None or "ratio_to_reference" not in row:
            rows.append(artifact_row(art, DECODE_WHERE, target, "" if art.run is None else f"no {proposed} row",
                                     **({} if art.run is None else {"status": "missing"})))
            continue
        r, repeats = row["ratio_to_reference"], len(row["ms_per_token_rounds"])
        full = art.run["timing"]["full"]
        measured = (f"{r['median']:.2f}x [{r['min']:.2f}, {r['max']:.2f}] over {repeats} interleaved rounds "
                    f"({row['median']:.1f} vs {full['median']:.1f} ms/token, one thread)")
        status = (stats.decide(r["min"], r["max"], DECODE_CAP, higher_is_better=False) if repeats >= stats.MIN_REPEATS
                  else "undecided")
        rows.append(artifact_row(art, DECODE_WHERE, target, measured, status=status, ci=(r["min"], r["max"]), repeats=repeats,
                                 timing=True))
    return rows


PROMISE = {READS_8.file: "SEKV >= 0.95x full and >= Quest-like-4-bit - 2 points at 8:1 reads, memory <= 0.30x bf16",
           READS_8_RETAIN.file: "SEKV's retention >= 0.95x full and >= Quest-like-4-bit - 2 points at 8:1 reads, "
                                "memory <= 0.30x bf16",
           MEMORY_16.file: "SEKV >= 0.9x full and >= KVzip at equal memory, memory <= 0.0625x bf16",
           MEMORY_16_4K.file: "SEKV >= 0.9x full and >= KVzip at equal memory at 4K, memory <= 0.0625x bf16"}


def _build(models_dir: Path, out_dir: Path, grid: Grid = READS_8) -> tuple[list[Table], list[Figure], list[HeadlineRow]]:
    arts = _artifacts(models_dir, grid)
    present = [a for a in arts if a.run is not None]
    if not present:
        return [], [], [artifact_row(arts[0], grid.where, PROMISE[grid.file], "")]
    rows = [r for a in present for r in _summary_rows(a)]
    table = Table(grid.title,
                  ["method", "task", "score [95%] (n)", "memory bf16 mean (max)", "reads bf16", "memory fp32",
                   "seed", "file"],
                  [[r["method"], r["task"], f"{r['score']:.2f} [{r['ci'][0]:.2f}, {r['ci'][1]:.2f}] ({r['n']})",
                    f"{_num(r.get('memory_bf16'))} ({_num(r.get('memory_bf16_max'))})", _num(r.get("reads_bf16")),
                    _num(r.get("memory_fp32")), ", ".join(str(s) for s in (a.run or {}).get("experiment", {}).get("seeds", [])),
                    a.status] for a in present for r in _summary_rows(a)],
                  "memory: every tier held (codes as held, floats at 2 bytes); reads: what one pass reads, routing "
                  "metadata included; one run per task on its own test seed")
    head: list[HeadlineRow] = []
    for a in present:
        for d in (a.run or {}).get("decisions") or []:
            if d.get("value") is None:
                continue  # undecided for want of a solved task (shown through the class floor instead)
            measured = f"{d['value']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]"
            head.append(artifact_row(a, grid.where, d["label"], measured, **headline_fields(d)))
        proposed = next((d["method"] for d in (a.run or {}).get("decisions") or []), None)
        checks = (((a.run or {}).get("appendix") or {}).get("summary") or {}).get("memory_checks") or []
        check = next((c for c in checks if c["method"] == proposed), None)
        if check is not None and check.get(grid.cap_key) is not None:
            worst = check[grid.cap_key]
            head.append(artifact_row(a, grid.where, f"{proposed}: memory <= {grid.cap} x bf16 ({grid.cap_what})",
                                     f"{worst:.{4 if grid.cap < 0.1 else 3}f} x", status="met" if worst <= grid.cap else "missed",
                                     kind="check", because="bytes counted from the tensors held; a property of the configuration "
                                     "at this length, not a rate"))
        reads = next((c for c in ((a.run or {}).get("appendix") or {}).get("reads_checks") or []
                      if c["method"] == proposed), None)
        if reads is not None and reads.get("reads_bf16_max") is not None:
            cap = next(float(k.split("_")[2]) for k in reads if k.startswith("reads_le_"))
            head.append(artifact_row(a, grid.where, f"{proposed}: peak read <= {cap} x bf16 (8:1 reads, the question "
                                     "and the answer included, the largest over the items)",
                                     f"{reads['reads_bf16_max']:.4f} x",
                                     status="met" if reads["reads_bf16_max"] <= cap else "missed",
                                     kind="check", because="bytes counted from the tensors read; a property of the configuration "
                                     "at this length, not a rate"))
    proposed = next((d["method"] for a in present for d in (a.run or {}).get("decisions") or []), None)
    floor = _floor(rows, present[0], grid, proposed)
    if floor is not None:
        head.append(floor)
    figures = [f for f in [_figure(rows, out_dir, grid)] if f is not None]
    return [table], figures, head


__all__ = ["build"]
