"""Which layer's own K/V does retrieval need? A per-layer K/V ablation on dev seeds.

For each attention layer ``l >= 1`` and each source in {``l - 1``, the first layer of its group}, layer
``l`` attends to the source's K/V instead of its own (every other layer keeps its own) and the model is
scored on the needle tasks, greedy through a sharing cache, as ``kvstate depth eval`` scores
(:func:`kvstate.lab.depth.evaluate.evaluate_sharing`; not shared with it, so that its digest and the committed
evaluations it covers stay current). A layer whose ablation drops retrieval is one that R-CLA must not
route (the hypothesis from the KV-sharing literature: a few retrieval / induction layers or heads carry
retrieval, "Retrieval Head Mechanistically Explains Long-Context Factuality"; LCKV keeps its warm-up layers
standard). Each ablation is a deployable pattern (the source keeps its own K/V), so the scores are what a
deployment of that pattern would see. Dev seeds only: it is a diagnosis for choosing training options, its
result file never goes under ``models/``. Ignored: per-KV-head ablation (the route is per layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstate.errors import KVStateError
from kvstate.lab import protocol, stats

DIAGNOSE_TASKS = ("niah_single", "niah_multikey")
DIAGNOSE_LENGTHS = (1024,)


def ablations(layers: Sequence[Any]) -> list[tuple[int | None, int | None, Any]]:
    """``(layer, source, pattern)`` for every single-layer ablation, first ``(None, None, no sharing)``."""
    from kvstate.depth.patterns import SharingPattern, none

    out: list[tuple[int | None, int | None, Any]] = [(None, None, none(layers))]
    attn = [i for i, spec in enumerate(layers) if spec.is_attention]
    for i in attn:
        group = [j for j in attn if j < i and layers[j].group == layers[i].group]
        for src in dict.fromkeys((group[-1], group[0]) if group else ()):  # l - 1 of its group, then the first
            sources = list(range(len(layers)))
            sources[i] = src
            out.append((i, src, SharingPattern(tuple(sources)).validate(layers)))
    return out


def check_dev_seed(seed: int) -> None:
    if protocol.is_test_seed(seed):
        raise KVStateError(f"--seed {seed} is a test seed (>= {protocol.TEST_SEED_MIN}); the diagnosis tunes training "
                           f"options, so it runs on dev seeds only — pass a seed below {protocol.TEST_SEED_MIN}, e.g. 3")


def check_out(out: Path) -> None:
    """Dev-seed results never go under ``models/`` (the protocol: result files there are test-seed runs)."""
    if "models" in out.resolve().parts:
        raise KVStateError(f"--out {str(out)!r} is under models/, which holds test-seed results only; write the "
                           "dev-seed diagnosis elsewhere, e.g. docs/results/depth_diagnosis.json")


def diagnose(model_dir: str | Path, *, n: int, seed: int, tasks: Sequence[str] = DIAGNOSE_TASKS,
             lengths: Sequence[int] = DIAGNOSE_LENGTHS, model: Any = None, tokenizer: Any = None,
             progress: bool = False) -> dict[str, Any]:
    """``{"model", "n", "seed", "tasks", "lengths", "rows"}``; a row per ablation: ``layer, source, pattern``
    and per task ``score, ci, items`` (``items`` in example order, so rows compare paired with the first)."""
    from kvstate.depth.attention import layer_specs
    from kvstate.depth.patterns import format_pattern
    from kvstate.depth.sharing import apply_sharing, sharing_cache
    from kvstate.lab.harness import load_reference, run_tasks

    check_dev_seed(seed)
    if model is None:
        model, tokenizer = load_reference(model_dir)
    rows = []
    for layer, src, pattern in ablations(layer_specs(model.config)):
        with apply_sharing(model, pattern):
            res = run_tasks(model, tokenizer, list(tasks), list(lengths), n, seed,
                            cache_factory=lambda m, pat=pattern: sharing_cache(m.config, pat), progress=progress)
        per_task = {}
        for task in tasks:
            items = [float(e.score) for e in res.examples if e.task == task]
            est = stats.rate(items, seed=seed)
            per_task[task] = {"score": round(est.value, 4), "ci": [round(est.lo, 4), round(est.hi, 4)], "items": items}
        rows.append({"layer": layer, "source": src, "pattern": format_pattern(pattern), "tasks": per_task})
    return {"model": str(model_dir), "n": n, "seed": seed, "tasks": list(tasks), "lengths": list(lengths), "rows": rows}


__all__ = ["DIAGNOSE_LENGTHS", "DIAGNOSE_TASKS", "ablations", "check_dev_seed", "check_out", "diagnose"]
