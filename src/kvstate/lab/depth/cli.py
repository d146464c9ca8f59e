"""``kvstate depth ...``: train with stochastic KV routing (R-CLA) and evaluate cross-layer KV sharing.

A typer sub-app registered by ``cli.py``. ``train`` wraps :func:`kvstate.lab.depth.train.depth_train`
(runs under ``torchrun`` with DDP over gloo when started that way); ``init-kv1`` wraps
:func:`kvstate.lab.depth.kv1.init_kv1` (the equal-KV dense baseline's start); ``eval`` wraps
:func:`kvstate.lab.depth.evaluate.evaluate_sharing`; ``decode`` wraps
:func:`kvstate.lab.depth.deploy.decode_benchmark` (decode speed and resident KV through ``generate``); ``pilot``
wraps :func:`kvstate.lab.depth.pilot.score_checkpoint` (dev-seed pilots over the declared pattern family). torch and transformers load inside the commands.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from kvstate.depth.registry import FAMILIES, keep_families
from kvstate.depth.registry import RULES as _RULES

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Cross-layer KV sharing: train with stochastic KV routing (R-CLA), evaluate patterns.")


@app.command("train")
def train_command(
    model: Annotated[Path, typer.Option("--model", help="Start model: a kvstate train output (e.g. models/ref-attn).")],
    out: Annotated[Path, typer.Option("--out", help="Directory to save the model, tokenizer and training state.")],
    p: Annotated[float, typer.Option("--p", help="Probability a layer attends to its own K/V (1: no routing).")] = 0.5,
    pattern: Annotated[str | None, typer.Option(
        "--pattern", help="Train a fixed-pattern specialist instead, e.g. 0_0_2_2 (CLA2).")] = None,
    minutes: Annotated[float | None, typer.Option("--minutes", help="Wall-clock budget of this run.")] = None,
    tokens: Annotated[int | None, typer.Option("--tokens", help="Token budget (same batches for every run).")] = None,
    length: Annotated[int, typer.Option("--length", help="Tokens per training row.")] = 1024,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Routing seed (DDP rank r uses seed + r).")] = 0,
    rule: Annotated[str, typer.Option("--rule", help=f"Routing rule — {_RULES.describe()}.")] = "paper",
    p_layer: Annotated[str | None, typer.Option(
        "--p-layer", help="Per-layer p, one per layer, e.g. 1,1,0.5,0.5 (replaces --p; a layer at 1 is never routed).")] = None,
    distill: Annotated[float, typer.Option(
        "--distill", help="Weight of the KL to the model's own-KV pass in the same step (0: none).")] = 0.0,
    p_schedule: Annotated[str, typer.Option(
        "--p-schedule", help="constant, or anneal: p from 1 to the target over --anneal-frac of the steps.")] = "constant",
    anneal_frac: Annotated[float, typer.Option("--anneal-frac", help="Share of the steps the anneal takes.")] = 0.25,
    anneal_tokens: Annotated[int | None, typer.Option(
        "--anneal-tokens", help="The anneal's horizon in tokens (replaces --anneal-frac; spans a run trained in parts).")] = None,
    retrieval_share: Annotated[float | None, typer.Option(
        "--retrieval-share", help="Share of needle tasks in the training rows (default: the start model's mix).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the depth run saved in --out.")] = False,
    overrides: Annotated[list[str] | None, typer.Option(
        "--set", help="Override a TrainConfig field, e.g. --set lr=0.0005 (JSON values).")] = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace an --out directory that already holds files (replaced whole when the run ends).")] = False,
    stop_at_step: Annotated[int | None, typer.Option(
        "--stop-at-step", min=0, help="Stop after this step with the periodic save written and --out not, as an "
        "interrupted part (kvstate lab retrain replays a part that was stopped early and resumed).")] = None,
) -> None:
    """Continue training a reference model with stochastic KV routing; under torchrun, DDP over gloo."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from rich.console import Console

    from kvstate.errors import KVStateError
    from kvstate.lab.depth.train import DepthTrainConfig, check_outputs, depth_train
    from kvstate.lab.training.cli import parse_overrides
    from kvstate.lab.training.train import PartStopped

    try:
        layer_ps = tuple(float(v) for v in p_layer.split(",")) if p_layer is not None else None
    except ValueError:
        raise KVStateError(f"--p-layer {p_layer!r} must be comma-separated numbers in [0, 1], one per layer, "
                           "e.g. 1,1,0.5,0.5") from None
    cfg = DepthTrainConfig(p=p, pattern=pattern, length=length, minutes=minutes, tokens=tokens, seed=seed, rule=rule,
                           p_layer=layer_ps, distill=distill, p_schedule=p_schedule, anneal_frac=anneal_frac,
                           retrieval_share=retrieval_share, anneal_tokens=anneal_tokens)
    extra = parse_overrides(overrides or [])
    check_outputs(model, out, cfg, resume=resume, overwrite=overwrite)  # before DDP starts: every refusal first
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    try:
        state = depth_train(model, out, cfg, resume=resume, overrides=extra, progress=True, log=lambda s: None,
                            overwrite=overwrite, stop_at_step=stop_at_step)
    except PartStopped as stopped:
        Console().print(f"{out}: {stopped}")
        return
    finally:
        if distributed:
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        from kvstate.lab.depth.card import write_card

        write_card(out)  # the card with this run's learning curve (rewritten after kvstate depth eval --out)
        last = state["curve"][-1] if state["curve"] else {}
        Console().print(f"saved {out}: step {state['step']}, {state['tokens']:,} tokens, "
                        f"{state['seconds'] / 60:.1f} min, loss {last.get('loss')}, "
                        f"routing {state['depth']['pattern'] or routing_text(state['depth'])}")


def routing_text(depth: dict) -> str:
    """``p=0.5`` or ``p_layer=1,1,0.5,0.5``, with the options a run used."""
    parts = [f"p_layer={','.join(f'{v:g}' for v in depth['p_layer'])}" if depth.get("p_layer") else f"p={depth['p']}"]
    if depth.get("distill"):
        parts.append(f"distill={depth['distill']:g}")
    if depth.get("p_schedule") == "anneal":
        parts.append(f"anneal over {depth.get('anneal_steps')} steps")
    if depth.get("retrieval_share") is not None:
        parts.append(f"retrieval share {depth['retrieval_share']:g}")
    return ", ".join(parts)


# the source a depth evaluation depends on: a change here makes committed depth_eval.json files stale
EVAL_CODE = ("depth", "models", "lab/depth/evaluate.py", "lab/depth/pilot.py", "lab/experiment.py", "lab/harness.py",
             "lab/decode.py", "lab/perplexity.py", "lab/stats.py", "lab/scoring.py", "lab/workloads/tasks.py")


@app.command("eval")
def eval_command(
    model: Annotated[Path, typer.Option("--model", help="A model directory with its tokenizer.")],
    keep: Annotated[str | None, typer.Option("--keep", help="Kept cache fractions in (0, 1], comma-separated (default: "
                                       "those of 1,0.75,0.5,0.25 the model's declared family covers; the skipped "
                                       "ones are named).")] = None,
    pattern_kind: Annotated[str, typer.Option(
        "--pattern-kind", help=f"Pattern family: {', '.join(keep_families())}.")] = "keep",
    n: Annotated[int, typer.Option("--n", min=1, help="Examples per task and length.")] = 10,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Seed of the held-out examples.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document (the table goes to stderr).")] = False,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Append this run, with its provenance, to a result file (e.g. DIR/depth_eval.json).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Start the --out file afresh (drop its runs).")] = False,
    post_hoc: Annotated[bool, typer.Option(
        "--post-hoc", help="Measure patterns outside the model's declared family (sharing it was not trained for).")] = False,
) -> None:
    """Score, perplexity, KV bytes per token and decode speed of a model under sharing patterns; at each keep every
    pattern of the model's declared family is scored (mean and worst)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from rich.table import Table

    from kvstate.errors import KVStateError
    from kvstate.lab.cli_output import check_results_out, print_json, table_console
    from kvstate.lab.depth.evaluate import SCORE_LENGTHS, evaluate_sharing
    from kvstate.lab.harness import MAX_EXAMPLES, check_lengths_fit
    from kvstate.lab.lists import parse_floats
    from kvstate.models.loading import load_config

    if keep is not None:  # a bad list is refused before any work
        parse_floats(keep, "--keep", lo=0.0, lo_open=True, hi=1.0, example="1,0.75,0.5,0.25")
    if pattern_kind not in keep_families():
        FAMILIES.get(pattern_kind)  # unknown: refused listing the registry
        raise KVStateError(f"--pattern-kind {pattern_kind!r} has no pattern per kept fraction; choose one of "
                           f"{', '.join(keep_families())}")
    if not 1 <= n <= MAX_EXAMPLES:
        raise KVStateError(f"--n {n} must be in 1..{MAX_EXAMPLES:,} (examples per task and length)")
    if out is not None:
        check_results_out(out, overwrite=overwrite)
    check_lengths_fit(load_config(model), SCORE_LENGTHS)  # the config alone: before reading the weights
    fractions = keeps_to_run(model, keep, pattern_kind, post_hoc=post_hoc)
    # through the lab's experiment loop: ledger checked before any item, solved cells pooled, provenance appended
    result = evaluate_sharing(model, fractions, pattern_kind, n=n, seed=seed, progress=True, post_hoc=post_hoc,
                              out=out, overwrite=overwrite, code=EVAL_CODE)

    def f3(x: float | None) -> str:
        return "—" if x is None else f"{x:.3f}"

    table = Table(title=f"{model} — {pattern_kind} patterns, n={n}, seed={seed}")
    for col in ("keep", "pattern", "ppl", "score", "family", "mean", "worst", "worst pattern", "KV B/token",
                "decode tok/s"):
        table.add_column(col, justify="right")
    for r in result["results"]:
        table.add_row(f"{r['keep']:g}", r["pattern"], f"{r['ppl']:.3f}", f3(r["score"]),
                      f"{r['family']} ({len(r['family_patterns'])})", f3(r["mean_score"]),
                      f3(r["worst_score"]), r["worst_pattern"], f"{r['kv_bytes_per_token']:,}",
                      f"{r['decode_tok_s']:.1f}")
    excluded = result["results"][0]["excluded_tasks"] if result["results"] else {}
    if excluded:
        table.caption = "not pooled (the full cache scores < 0.9): " + ", ".join(
            f"{k} ({v:.2f})" for k, v in excluded.items())
    table_console(as_json).print(table)
    if as_json:
        print_json(result)


DIAGNOSE_CODE = ("depth", "models", "lab/depth/diagnose.py", "lab/harness.py", "lab/decode.py", "lab/stats.py",
                 "lab/scoring.py", "lab/workloads/tasks.py")


@app.command("diagnose")
def diagnose_command(
    models: Annotated[list[Path], typer.Option("--model", help="Model directories (repeat --model).")],
    out: Annotated[Path, typer.Option(
        "--out", help="Result file (appended; never under models/), e.g. docs/results/depth_diagnosis.json.")],
    n: Annotated[int, typer.Option("--n", min=1, help="Examples per task.")] = 40,
    seed: Annotated[int, typer.Option("--seed", min=0, help="A dev seed (< 1000).")] = 3,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Start the --out file afresh (drop its runs).")] = False,
) -> None:
    """Dev-seed diagnosis: each layer l >= 1 reads layer l-1's (and layer 0's) K/V instead of its own; needle scores."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from rich.table import Table

    from kvstate.errors import KVStateError
    from kvstate.lab.cli_output import check_results_out, table_console, write_results
    from kvstate.lab.depth.diagnose import (
        DIAGNOSE_LENGTHS,
        DIAGNOSE_TASKS,
        check_dev_seed,
        check_out,
        diagnose,
    )
    from kvstate.lab.harness import MAX_EXAMPLES
    from kvstate.lab.provenance import Recorder

    check_dev_seed(seed)
    check_out(out)
    if not 1 <= n <= MAX_EXAMPLES:
        raise KVStateError(f"--n {n} must be in 1..{MAX_EXAMPLES:,} (examples per task)")
    check_results_out(out, overwrite=overwrite)
    rec = Recorder(code=DIAGNOSE_CODE, models=list(models), n=n, seeds=[seed], tasks=DIAGNOSE_TASKS,
                   lengths=DIAGNOSE_LENGTHS, settings={"ablation": "layer l reads layer l-1's / the first layer's K/V"})
    result = {"models": [diagnose(m, n=n, seed=seed, progress=True) for m in models]}
    table = Table(title=f"own-K/V ablation, n={n} per task, dev seed {seed}, {DIAGNOSE_LENGTHS[0]} tokens")
    for col in ("model", "layer <- source", "pattern", *DIAGNOSE_TASKS):
        table.add_column(col, justify="right")
    for res in result["models"]:
        for r in res["rows"]:
            cells = [f"{r['tasks'][t]['score']:.2f} [{r['tasks'][t]['ci'][0]:.2f}, {r['tasks'][t]['ci'][1]:.2f}]"
                     for t in DIAGNOSE_TASKS]
            which = "none" if r["layer"] is None else f"{r['layer']} <- {r['source']}"
            table.add_row(Path(res["model"]).name, which, r["pattern"], *cells)
    table_console(False).print(table)
    write_results(out, result, rec.finish(), overwrite=overwrite)


PILOT_CODE = ("depth", "models", "lab/depth/pilot.py", "lab/harness.py", "lab/workloads/tasks.py")


@app.command("pilot")
def pilot_command(
    ckpts: Annotated[list[Path], typer.Option(
        "--ckpt", help="Checkpoints of pilot runs (repeat --ckpt; a model without a depth entry scores every pattern).")],
    out: Annotated[Path, typer.Option(
        "--out", help="Result file (appended; never under models/), e.g. docs/results/depth_pilots.json.")],
    n: Annotated[int, typer.Option("--n", min=1, help="Examples per task (niah_single, niah_multikey at 1K).")] = 25,
    seed: Annotated[int, typer.Option("--seed", min=0, help="A dev seed (< 1000).")] = 7,
    keep: Annotated[float, typer.Option("--keep", help="Kept cache fraction whose family patterns are scored.")] = 0.5,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Start the --out file afresh (drop its runs).")] = False,
) -> None:
    """Dev-seed pilot evaluation: every pattern of each checkpoint's declared family at --keep; mean and worst."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from rich.table import Table

    from kvstate.errors import KVStateError
    from kvstate.lab.cli_output import check_results_out, table_console, write_results
    from kvstate.lab.depth.diagnose import check_dev_seed, check_out
    from kvstate.lab.depth.pilot import PILOT_LENGTHS, PILOT_TASKS, score_checkpoint
    from kvstate.lab.harness import MAX_EXAMPLES
    from kvstate.lab.provenance import Recorder

    check_dev_seed(seed)
    check_out(out)
    if not 1 <= n <= MAX_EXAMPLES:
        raise KVStateError(f"--n {n} must be in 1..{MAX_EXAMPLES:,} (examples per task)")
    if not 0 < keep <= 1:
        raise KVStateError(f"--keep {keep!r} must be a kept fraction in (0, 1], e.g. 0.5")
    missing = [str(c) for c in ckpts if not c.is_dir()]
    if missing:
        raise KVStateError(f"--ckpt {missing[0]!r} is not a directory; pass a pilot checkpoint (a model directory)")
    check_results_out(out, overwrite=overwrite)
    rec = Recorder(code=PILOT_CODE, models=list(ckpts), n=n, seeds=[seed], tasks=PILOT_TASKS, lengths=PILOT_LENGTHS,
                   settings={"keep": keep, "score": "teacher-forced exact match over the declared family"})
    rows = [score_checkpoint(c, n=n, seed=seed, keep=keep) for c in ckpts]
    table = Table(title=f"pilots: keep {keep:g}, every declared pattern, n={n} per task, dev seed {seed}, 1K tokens")
    for col in ("checkpoint", "tokens", "patterns", "mean", "worst", "worst pattern", "mean 1st tok", "worst 1st tok"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["ckpt"], f"{r['tokens']:,}", str(len(r["patterns"])), f"{r['mean']:.3f}", f"{r['worst']:.3f}",
                      r["worst_pattern"], f"{r['mean_first_token']:.3f}", f"{r['worst_first_token']:.3f}")
    table_console(False).print(table)
    write_results(out, {"n": n, "seed": seed, "keep": keep, "tasks": list(PILOT_TASKS), "lengths": list(PILOT_LENGTHS),
                        "rows": rows}, rec.finish(), overwrite=overwrite)


DECODE_CODE = ("depth", "models", "lab/depth/deploy.py", "lab/depth/evaluate.py", "lab/depth/pilot.py")


DEFAULT_KEEPS = (1.0, 0.75, 0.5, 0.25)  # tried in order when --keep is not given


def default_keeps(model: Path, kind: str = "keep", *, post_hoc: bool = False) -> tuple[list[float], dict[float, str]]:
    """The :data:`DEFAULT_KEEPS` ``model``'s declared family covers, and each one skipped with the reason."""
    from kvstate.depth.patterns import PatternError

    kept: list[float] = []
    skipped: dict[float, str] = {}
    for k in DEFAULT_KEEPS:
        try:
            check_deployable(model, [k], kind, post_hoc=post_hoc)
            kept.append(k)
        except PatternError as err:
            skipped[k] = str(err)
    return kept, skipped


def keeps_to_run(model: Path, keep: str | None, kind: str = "keep", *, post_hoc: bool) -> list[float]:
    """``--keep`` parsed and checked against the declared family, or (unset) :func:`default_keeps`, naming on stderr
    each default keep it skipped."""
    from kvstate.errors import KVStateError
    from kvstate.lab.cli_output import notes_console
    from kvstate.lab.lists import parse_floats

    if keep is not None:
        fractions = parse_floats(keep, "--keep", lo=0.0, lo_open=True, hi=1.0, example="1,0.75,0.5,0.25")
        check_deployable(model, fractions, kind, post_hoc=post_hoc)
        return fractions
    fractions, skipped = default_keeps(model, kind, post_hoc=post_hoc)
    for k, why in skipped.items():
        notes_console().print(f"skipped keep {k:g} (outside {model}'s declared family): {why}")
    if not fractions:
        raise KVStateError(f"{model}'s declared family covers none of the keeps {', '.join(f'{k:g}' for k in DEFAULT_KEEPS)}; "
                           "pass --keep, or --post-hoc to measure sharing it was not trained for")
    return fractions


def check_deployable(model: Path, fractions: list[float], kind: str = "keep", *, post_hoc: bool) -> None:
    """Each keep's pattern is in the model's declared family (the config and training state only: before the
    weights load); :class:`PatternError` naming the layer it breaks otherwise."""
    from kvstate.depth.attention import layer_specs
    from kvstate.lab.depth.evaluate import family_plan
    from kvstate.lab.training.io import STATE_FILE, read_state
    from kvstate.models.loading import load_config

    depth = read_state(model / STATE_FILE).get("depth") if (model / STATE_FILE).is_file() else None
    layers = layer_specs(load_config(model))
    for keep in fractions:
        family_plan(depth, layers, keep, kind, post_hoc=post_hoc)


@app.command("decode")
def decode_command(
    model: Annotated[Path, typer.Option("--model", help="A model directory (e.g. models/ref-attn-rcla).")],
    keep: Annotated[str | None, typer.Option("--keep", help="Kept cache fractions in (0, 1], comma-separated (default: "
                                       "those of 1,0.75,0.5,0.25 the model's declared family covers; the skipped "
                                       "ones are named).")] = None,
    context: Annotated[str, typer.Option("--context", help="Prompt tokens before decoding (e.g. 2K).")] = "2K",
    new_tokens: Annotated[int, typer.Option("--new-tokens", min=2, help="Tokens generated per timed call.")] = 32,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Interleaved repeats (medians reported).")] = 5,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Seed of the random prompt.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document (the table goes to stderr).")] = False,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Append this run, with its provenance, to a result file (e.g. DIR/depth_decode.json).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Start the --out file afresh (drop its runs).")] = False,
    post_hoc: Annotated[bool, typer.Option(
        "--post-hoc", help="Allow patterns outside the model's declared family (sharing it was not trained for).")] = False,
) -> None:
    """Decode tokens/s and resident KV bytes through model.generate under each sharing pattern, beside keep 1."""
    from rich.table import Table

    from kvstate.lab.cli_output import check_results_out, print_json, table_console, write_results
    from kvstate.lab.depth.deploy import decode_benchmark
    from kvstate.lab.harness import load_reference
    from kvstate.lab.lists import parse_ints
    from kvstate.lab.provenance import Recorder

    (ctx,) = parse_ints(context, "--context", lo=1, example="2K")
    if out is not None:
        check_results_out(out, overwrite=overwrite)
    fractions = keeps_to_run(model, keep, post_hoc=post_hoc)
    rec = Recorder(code=DECODE_CODE, models=[model], seeds=[seed], lengths=[ctx],
                   settings={"keep": fractions, "new_tokens": new_tokens, "repeats": repeats})
    net, _ = load_reference(model)
    rows = decode_benchmark(net, fractions, context=ctx, new_tokens=new_tokens, repeats=repeats, seed=seed)
    table = Table(title=f"{model} — generate at {ctx} tokens, {new_tokens} new, median of {repeats}")
    for col in ("keep", "pattern", "decode tok/s", "range", "vs keep 1", "prefill s", "KV bytes held", "vs keep 1 "):
        table.add_column(col, justify="right")
    for r in rows:
        lo, hi = r["decode_tok_s_range"]
        table.add_row(f"{r['keep']:g}", r["pattern"], f"{r['decode_tok_s']:.1f}", f"{lo:.1f}-{hi:.1f}",
                      f"{r['decode_speedup_vs_full']}x", f"{r['prefill_s']:.3f}", f"{r['cache_bytes']:,}",
                      f"{r['cache_bytes_vs_full']}")
    table_console(as_json).print(table)
    result = {"model": str(model), "context": ctx, "new_tokens": new_tokens, "repeats": repeats, "results": rows}
    prov = rec.finish()
    if out is not None:
        write_results(out, result, prov, overwrite=overwrite)
    if as_json:
        print_json({**result, "provenance": prov})


@app.command("card")
def card_command(
    model: Annotated[Path, typer.Option("--model", help="A kvstate depth train --out directory.")],
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace a README.md that this card command did not write.")] = False,
) -> None:
    """Write DIR/README.md from its training_state.json and depth_eval.json."""
    from kvstate.lab.depth.card import write_card

    print(write_card(model, overwrite=overwrite))


@app.command("init-kv1")
def init_kv1_command(
    model: Annotated[Path, typer.Option("--model", help="A kvstate train output with 2+ KV heads (e.g. models/ref-attn).")],
    out: Annotated[Path, typer.Option("--out", help="Directory for the 1-KV-head model (continue it with depth train).")],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an --out directory that already holds files.")] = False,
) -> None:
    """Start the equal-KV dense baseline: one KV head per layer, the mean of the model's KV heads."""
    from kvstate.lab.depth.kv1 import KV1_KEY, init_kv1

    state = init_kv1(model, out, overwrite=overwrite)
    before, after = state[KV1_KEY]["kv_heads"]
    print(f"saved {out}: {before} -> {after} KV heads per layer, {state['params']:,} parameters; continue it with "
          f"kvstate depth train --model {out} --p 1 --out DIR --tokens N")
