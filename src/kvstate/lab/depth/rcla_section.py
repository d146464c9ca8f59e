"""Report part: the depth headline on the real model — R-CLA against the CLA2 specialist over the declared keep-0.5
family of SmolLM2-135M-Instruct, on test seeds.

Technique: Random Cross-Layer Attention ("Stochastic KV Routing") and CLA2 ("Reducing Transformer Key-Value Cache
Size with Cross-Layer Attention"), LoRA fine-tunes installed as ``models/smollm2-135m-{rcla,cla2}``. Reads the
newest run of ``models/smollm2/depth_rcla_{2048,4096}.json`` (:mod:`kvstate.lab.depth.rcla_test`): a table per
length (every method per task class, the unmodified model first), the family's worst and mean per model, and
one headline row per pre-registered target (the loop's decisions) plus, per class the unmodified model scores
≥ 0.5 on, the "≥ 0.9× the unmodified model" check of the worst pattern; from ``models/smollm2/depth_rcla_ppl.json``
(:mod:`kvstate.lab.depth.rcla_ppl`) the held-out perplexity table and that run's two decisions. A missing or stale file
shows the command that writes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvstate.lab.depth import rcla_test
from kvstate.lab.experiment import headline_fields
from kvstate.lab.provenance import load_artifact
from kvstate.lab.report.html import HeadlineRow, Table, artifact_row

FILES = {2048: ("smollm2/depth_rcla_2048.json", 1069), 4096: ("smollm2/depth_rcla_4096.json", 1070)}
WHERE = "depth on the real model (R-CLA fine-tune)"


def command(length: int) -> str:
    path, seed = FILES[length]
    return (f"OMP_NUM_THREADS=1 python -m kvstate.lab.depth.rcla_test --length {length} --seed {seed} "
            f"--out models/{path}")


def build(models_dir: Path) -> tuple[list[Table], list[HeadlineRow]]:
    tables: list[Table] = []
    head: list[HeadlineRow] = []
    for length, (path, _seed) in FILES.items():
        art = load_artifact(models_dir / path, command(length))
        if art.run is None:
            head.append(artifact_row(art, WHERE, f"R-CLA keep 0.5, worst pattern of the family >= 0.9x the "
                                     f"unmodified model at {length}", ""))
            continue
        tables.append(_table(art, length))
        head += _decisions(art) + _classes(art, length)
    ppl_table, ppl_head = _ppl(models_dir)
    return tables + ([ppl_table] if ppl_table is not None else []), head + ppl_head


def _ppl(models_dir: Path) -> tuple[Table | None, list[HeadlineRow]]:
    """Held-out perplexity (:data:`kvstate.lab.depth.rcla_test.PPL_FILE`): the table and the run's two decisions."""
    path = models_dir / rcla_test.PPL_FILE.relative_to("models")
    art = load_artifact(path, rcla_test.PPL_COMMAND)
    if art.run is None:
        return None, [artifact_row(art, WHERE, f"R-CLA held-out perplexity, every keep-0.5 pattern <= "
                                   f"{rcla_test.PPL_KEEP_HALF:g}x the unmodified model", ""),
                      artifact_row(art, WHERE, f"R-CLA held-out perplexity on its own K/V within "
                                   f"{rcla_test.PPL_KEEP_ONE:.0%} of the unmodified model", "")]
    appendix = art.run.get("appendix") or {}
    rows = (appendix.get("summary") or {}).get("rows") or []
    table = Table("Real model: held-out perplexity of the unmodified model and each fine-tune, on its own K/V and under "
                  "each pattern of the keep-0.5 family",
                  ["method", "perplexity [95%] (windows)", "vs unmodified (paired ratio)", "file"],
                  [[r["method"], f"{r['ppl']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}] ({r['windows']})",
                    f"{r['ratio']:.3f}x [{r['ratio_ci'][0]:.3f}, {r['ratio_ci'][1]:.3f}]" if "ratio" in r else "1",
                    art.status] for r in rows],
                  "Every 512-token window of the held-out licence text (never a haystack); windows resampled for the "
                  "intervals.")
    head = [artifact_row(art, WHERE, d["label"], (f"worst {d['method'].split(':', 1)[1]} " if ":" in d["method"] else "")
                         + f"{d['value']:.3f}x [{d['ci'][0]:.3f}, {d['ci'][1]:.3f}]", status=d["status"],
                         ci=(float(d["ci"][0]), float(d["ci"][1])), n=d["n"])
            for d in appendix.get("decisions") or []]
    return table, head


def _table(art: Any, length: int) -> Table:
    run = art.run
    s = (run.get("appendix") or {}).get("summary") or {}
    seeds = ", ".join(str(x) for x in (run.get("experiment") or {}).get("seeds", []))
    rows = [[r["method"], r["task"], f"{r['value']:.2f} [{r['ci'][0]:.2f}, {r['ci'][1]:.2f}] ({r['n']})", seeds,
             art.status] for r in run.get("rows") or []]
    fam = "; ".join(f"{name}: worst {m['worst'].split(':', 1)[1]} {m['worst_score']:.2f}, mean {m['mean']:.2f}"
                    for name, m in (s.get("models") or {}).items())
    pooled = run.get("pooled") or {}
    who = "R-CLA and the CLA2 specialist" if any(r["method"].startswith("cla2") for r in run.get("rows") or []) \
        else "R-CLA"
    return Table(f"Real model (SmolLM2-135M-Instruct, 30 layers) at {length:,} tokens: {who} under the declared "
                 "keep-0.5 family, against the unmodified model (base)",
                 ["method", "task", "score [95%] (n)", "seed", "file"], rows,
                 f"Family over the tasks the unmodified model solves ({', '.join(pooled.get('tasks') or []) or 'none'}): "
                 f"{fam or '—'}. Patterns: keep@0.5 (CLA2's own: layer 2i+1 reads layer 2i), top_shared@0.5 "
                 "(layers 15-29 read layer 14), two nearest-owner draws; 15 of 30 layers own K/V in each (KV bytes "
                 "0.5x). Both fine-tunes: LoRA, the same token budget (their cards: models/smollm2-135m-*-delta).")


def _decisions(art: Any) -> list[HeadlineRow]:
    out = []
    for d in art.run.get("decisions") or []:
        if d.get("value") is None:  # nothing to pool (the reference solved no task): shown undecided, with why
            out.append(artifact_row(art, WHERE, d["label"], f"— ({d.get('why') or 'nothing pooled'})",
                                    **{**headline_fields(d), "status": "undecided"}))
        else:
            out.append(artifact_row(art, WHERE, d["label"], f"{d['value']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]",
                                    **headline_fields(d)))
    return out


def _classes(art: Any, length: int) -> list[HeadlineRow]:
    """Per class the unmodified model scores >= 0.5 on: the worst R-CLA pattern's ``score - 0.9 x base`` margin."""
    ratios = ((art.run.get("appendix") or {}).get("summary") or {}).get("class_ratios") or []
    out = []
    for cell in dict.fromkeys(r["cell"] for r in ratios):
        mine = [r for r in ratios if r["cell"] == cell]
        worst = min(mine, key=lambda r: r["margin"])
        status = ("missed" if any(r["status"] == "missed" for r in mine)
                  else "undecided" if any(r["status"] == "undecided" for r in mine) else "met")
        out.append(artifact_row(
            art, WHERE, f"every pattern >= 0.9x the unmodified model on {cell}",
            f"worst {worst['method'].split(':', 1)[1]} {worst['score']:.2f} vs base {worst['reference']:.2f}: "
            f"margin {worst['margin']:+.3f} [{worst['ci'][0]:+.3f}, {worst['ci'][1]:+.3f}]",
            status=status, ci=(float(worst["ci"][0]), float(worst["ci"][1])), n=worst["n"],
            tasks=(cell.split("@")[0],)))
    return out


__all__ = ["FILES", "build", "command"]
