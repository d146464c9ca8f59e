"""Pilot evaluation of R-CLA training options: retrieval at a kept fraction over the declared pattern family.

For Random Cross-Layer Attention ("Stochastic KV Routing") a model is deployed under *any* pattern of the
family its training declares (:func:`kvstate.depth.patterns.declared_family`: the uniform rule declares every
deployable pattern, ``--p-layer`` with a layer at 1 keeps that layer an owner), so a pilot scores every
pattern of the family at one kept fraction (0.5) and reports the mean and the **worst** pattern, for each
checkpoint a pilot chain saved. The score is *teacher-forced exact match*: one full forward over
``prompt + target`` under the pattern (:func:`kvstate.depth.sharing.apply_sharing`), and an item counts when
every target token (the answer and its end marker ``" ."``) is the argmax given the prompt and the target's
earlier tokens — exactly when greedy decoding's first tokens are the target, so it is a sufficient condition
for the greedy exact match ``kvstate depth eval`` scores (tested against greedy decoding through the sharing
cache). It needs one forward per item instead of a decode loop, which keeps the pilot evaluation well under
the pilot's training cost. Beside it, per pattern: ``first_token`` (the first answer token is the argmax) and
``answer_nll`` (mean NLL of the target tokens), continuous signals while exact match is still 0. Dev seeds only (a pilot chooses a recipe); the result file never goes under
``models/``. Ignored: perplexity (the pilots' curves carry the training loss).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstate.errors import KVStateError

PILOT_TASKS = ("niah_single", "niah_multikey")
PILOT_LENGTHS = (1024,)
PILOT_KEEP = 0.5


def run_family(depth: dict[str, Any] | None, layers: Sequence[Any], keep: float) -> tuple[list[Any], str]:
    """The patterns of the family a run's ``depth`` entry declares that keep ``keep`` of the caches, and how the
    family was found: ``"declared"`` (a stochastic run's per-layer p), ``"fixed"`` (a one-pattern specialist) or
    ``"uniform"`` (no depth entry: a start model, scored on every deployable pattern)."""
    from kvstate.depth.patterns import declared_family, kept_fraction, parse_pattern

    if depth is not None and depth.get("pattern"):
        family, how = [parse_pattern(depth["pattern"]).validate(layers)], "fixed"
    else:
        if depth is None:
            ps, how = (0.5,) * len(layers), "uniform"
        else:
            ps, how = tuple(depth.get("p_layer") or (float(depth["p"]),) * len(layers)), "declared"
        found = declared_family(layers, ps)
        if found is None:
            raise KVStateError(f"the declared family of {len(layers)} layers has too many patterns to score one by one")
        family = found
    return [p for p in family if abs(kept_fraction(p, layers) - keep) < 1e-9], how


def teacher_forced_ids(model: Any, prompt: Sequence[int], target: Sequence[int]) -> dict[str, Any]:
    """One full forward over ``prompt + target[:-1]`` (the model's current sharing applies): ``pred`` (the argmax at
    each target position), ``exact`` (1.0 when ``pred == target``), ``first`` (1.0 when the first token is right)
    and ``nll`` (the target's mean negative log-likelihood per token)."""
    import torch

    with torch.inference_mode():
        ids = torch.tensor([[*prompt, *target[:-1]]])
        logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False,
                       logits_to_keep=len(target)).logits[0].float()  # the target's positions: the head dominates
        pred = logits.argmax(-1).tolist()
        nll = float(torch.nn.functional.cross_entropy(logits, torch.tensor(list(target))))
    return {"pred": pred, "exact": float(pred == list(target)), "first": float(pred[0] == target[0]),
            "nll": round(nll, 4)}


def teacher_forced(model: Any, tokenizer: Any, examples: Sequence[Any]) -> list[dict[str, Any]]:
    """Per example, :func:`teacher_forced_ids` over ``<bos> prompt`` and ``<target> .`` (tokenized as greedy
    decoding meets them): ``exact``, ``first`` and ``nll`` (a continuous signal while exact is still 0)."""
    out = []
    for ex in examples:
        prompt = tokenizer(ex.prompt)["input_ids"]  # with <bos>, as greedy_answer tokenizes it
        target = tokenizer(ex.target, add_special_tokens=False)["input_ids"]
        res = teacher_forced_ids(model, prompt, target)
        out.append({k: res[k] for k in ("exact", "first", "nll")})
    return out


def teacher_forced_exact(model: Any, tokenizer: Any, examples: Sequence[Any]) -> list[float]:
    """Per example: 1.0 when every token of ``<target> .`` is the argmax given the prompt and the target's
    earlier tokens (the model's current sharing applies), else 0.0."""
    return [r["exact"] for r in teacher_forced(model, tokenizer, examples)]


def score_checkpoint(ckpt: str | Path, *, n: int, seed: int, keep: float = PILOT_KEEP,
                     tasks: Sequence[str] = PILOT_TASKS, lengths: Sequence[int] = PILOT_LENGTHS,
                     model: Any = None, tokenizer: Any = None) -> dict[str, Any]:
    """One checkpoint: ``{"ckpt", "option", "tokens", "routing", "family", "patterns", "mean", "worst",
    "worst_pattern"}``; ``patterns`` maps each family pattern at ``keep`` to ``{"score", "items"}``, items in
    ``(task, length, index)`` order (paired across patterns and checkpoints)."""
    from kvstate.depth.attention import layer_specs
    from kvstate.depth.patterns import format_pattern
    from kvstate.depth.sharing import apply_sharing
    from kvstate.lab.depth.diagnose import check_dev_seed
    from kvstate.lab.harness import load_reference
    from kvstate.lab.training.io import STATE_FILE, read_state
    from kvstate.lab.workloads.tasks import generate

    check_dev_seed(seed)
    ckpt = Path(ckpt)
    if model is None:
        model, tokenizer = load_reference(ckpt)
    state = read_state(ckpt / STATE_FILE) if (ckpt / STATE_FILE).is_file() else {}
    depth = state.get("depth")
    layers = layer_specs(model.config)
    family, how = run_family(depth, layers, keep)
    if not family:
        raise KVStateError(f"{str(ckpt)!r} declares no pattern that keeps {keep:g} of the caches; pick another keep")
    examples = [ex for task in tasks for length in lengths for ex in generate(task, length, n, seed, tokenizer)]
    was_training = model.training
    model.eval()
    patterns: dict[str, dict[str, Any]] = {}
    try:
        for pattern in family:
            with apply_sharing(model, pattern):
                res = teacher_forced(model, tokenizer, examples)
            items = [r["exact"] for r in res]
            patterns[format_pattern(pattern)] = {
                "score": round(sum(items) / len(items), 4),
                "first_token": round(sum(r["first"] for r in res) / len(res), 4),
                "answer_nll": round(sum(r["nll"] for r in res) / len(res), 4), "items": items}
    finally:
        model.train(was_training)
    worst = min(patterns, key=lambda k: (patterns[k]["score"], patterns[k]["first_token"], k))  # ties: first token
    tokens = int(state.get("tokens", 0)) - int(depth.get("start_tokens", state.get("tokens", 0))) if depth else 0
    name = ckpt.name.rsplit("-", 1)[0] if ckpt.name.rsplit("-", 1)[-1].isdigit() else ckpt.name
    return {"ckpt": str(ckpt), "option": name if depth else "start", "tokens": tokens, "family": how,
            "routing": None if depth is None else {k: depth.get(k) for k in (
                "p", "p_layer", "rule", "pattern", "distill", "p_schedule", "anneal_steps", "retrieval_share")},
            "keep": keep, "patterns": patterns,
            "mean": round(sum(p["score"] for p in patterns.values()) / len(patterns), 4),
            "worst": patterns[worst]["score"], "worst_pattern": worst,
            "mean_first_token": round(sum(p["first_token"] for p in patterns.values()) / len(patterns), 4),
            "worst_first_token": min(p["first_token"] for p in patterns.values()),
            "worst_answer_nll": max(p["answer_nll"] for p in patterns.values())}


__all__ = ["PILOT_KEEP", "PILOT_LENGTHS", "PILOT_TASKS", "run_family", "score_checkpoint", "teacher_forced", "teacher_forced_exact",
           "teacher_forced_ids"]
