"""``kvstate transfer bench``: every registered transfer method on the same prompts — quality and payload size.

For *Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching*
(``docs/techniques.md#across-models``) and its baselines, each a registered method
(:mod:`kvstate.transfer.methods`): the oracle (the consumer's own prefill), raw / raw_fp32, KIVI, DroidSpeak,
REUSE, SCD and whatever else is registered. The loop knows no method by name: it asks each method to profile
itself on dev prompts of the calibration stream (:meth:`~kvstate.transfer.methods.TransferMethod.profile`,
e.g. DroidSpeak's block), takes its bench rows (SCD adds its PATCH budget ``scd_k1`` ..; REUSE, given a
producer-space PCA codec, the ablation ``reuse_pca_producer``) and runs every row through encode -> wire bytes
-> decode -> greedy answer.

Under the measurement protocol (``kvstate.lab.protocol``): a row's score pools only the tasks the oracle
solves (mean >= 0.9) at that length on this run, with the excluded tasks and the oracle's score on them
beside (``tasks`` / ``excluded_tasks``); every task's items stay in ``by_task``. Each row carries its
``recomputed_layers`` (the consumer layers it runs itself), ``payload_bytes_per_token`` measured from the
payloads sent, token F1, perplexity on held-out text and the consumer's compute (payload parse + cache decode +
first logits; the oracle: its prefill). Lengths default to the TTFT grid's 1K / 4K / 8K, where "8K" is 8,128
tokens: the longest prompt that leaves <bos> and a 32-token answer inside the models' 8,192 positions.
Time to first token over a link is measured elsewhere (``ttft_ms`` / ``achieved_gbit_s`` stay null here).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from transformers import DynamicCache

from kvstate.errors import KVStateError
from kvstate.lab import experiment as xp
from kvstate.lab import protocol, stats
from kvstate.lab.decode import greedy_decode
from kvstate.lab.journal import Journal, once
from kvstate.lab.perplexity import TextNLL, continuation_nll, pooled_perplexity
from kvstate.lab.scoring import extract_answer, f1, score
from kvstate.models.accounting import kv_bytes_per_token
from kvstate.transfer import methods as registry
from kvstate.transfer.codec import Codec, CodecError
from kvstate.transfer.methods import MethodContext, TransferMethod
from kvstate.transfer.methods.reuse import CodecMethod
from kvstate.transfer.payload import Payload

GATE_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery")
WEAK_TASKS = ("vt", "fwe", "cwe", "qa")
DEFAULT_LENGTHS = (1024, 2048)  # the lengths every committed quality run measured (the consumer solves nothing at 4K / 8K)


@dataclass(frozen=True)
class BenchConfig:
    n: int = 10  # examples per (needle task, length)
    seed: int = 0
    tasks: tuple[str, ...] = GATE_TASKS
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    weak_tasks: tuple[str, ...] = WEAK_TASKS  # reported, marked weak (the full cache scores poorly there)
    weak_n: int = 3  # examples per weak task, at lengths[0]
    ppl_n: int = 4  # held-out text examples; the second half is scored given the first half's state
    ppl_length: int = 1024
    ablation_n: int = 3  # examples per needle task at lengths[0] for the key-vs-value rank ablation (0: skip)
    budget_rows: bool = True  # the methods' extended rows (SCD's PATCH budget scd_k1 .. scd_k4)
    profile_prefixes: int = 4  # dev prefixes (calibration stream) a method profiles itself on
    methods: tuple[str, ...] = ()  # registered methods to run (empty: all); the oracle always runs

    def __post_init__(self) -> None:
        if self.n < 1 or self.ppl_n < 0 or self.weak_n < 0 or self.ablation_n < 0 or self.profile_prefixes < 1:
            raise KVStateError(f"BenchConfig: n={self.n} and profile_prefixes={self.profile_prefixes} must be "
                               ">= 1 and ppl_n / weak_n / ablation_n >= 0")
        if not self.lengths or not self.tasks:
            raise KVStateError("BenchConfig: need tasks and lengths")
        for m in self.methods:
            registry.get(m, option="--methods")
        if len(set(self.methods)) != len(self.methods):
            raise KVStateError(f"BenchConfig.methods {self.methods} repeat a method")


Row = tuple[TransferMethod, MethodContext]


def profile_prompts(tokenizer: Any, ctx: MethodContext, n: int) -> list[torch.Tensor]:
    """The first ``n`` prefixes (512 tokens) of the codec's calibration stream: dev data, never a test seed; every
    method profiles on this one stream (the bench and ``kvstate transfer profile`` alike)."""
    from kvstate.lab.transfer.prompts import calibration_prompts
    from kvstate.transfer.calibrate import CalibrationConfig

    seed = int((ctx.codec.info.get("config") or {}).get("seed", 7919))
    return calibration_prompts(tokenizer, CalibrationConfig(prefixes=max(4, n), length=512, seed=seed))[:n]


def chosen_methods(cfg: BenchConfig) -> list[TransferMethod]:
    """The registered methods a bench runs, in registry order: ``cfg.methods`` (all when empty) and the oracle."""
    return [m for m in registry.methods() if not cfg.methods or m.name in cfg.methods or not m.ships_payload]


def plan(cfg: BenchConfig, pair: str = "", code: Sequence[str] = (), models: Sequence[Any] = (),
         settings: Mapping[str, Any] | None = None) -> xp.Experiment:
    """The experiment a bench asks for, before any work: each registered method it runs (named ``PAIR:METHOD``,
    so the seed ledger tells the producer / consumer pairs apart; ``pair`` is e.g. the codec directory's name),
    the needle tasks x lengths with ``n`` items each, the oracle as the reference. Its recorder
    (:func:`kvstate.lab.experiment.recorder`) is the run's provenance; :func:`run_bench` runs the same cells
    through the loop under the bench's row names."""
    chosen = chosen_methods(cfg)
    name = (lambda m: f"{pair}:{m}") if pair else (lambda m: m)
    oracle = next(m.name for m in chosen if not m.ships_payload)
    return xp.Experiment(axis="across models", name="transfer-bench", methods=tuple(name(m.name) for m in chosen),
                         seeds=(cfg.seed,), tasks=tuple(cfg.tasks), lengths=tuple(cfg.lengths), n=cfg.n,
                         reference=name(oracle), code=tuple(code), models=tuple(str(m) for m in models),
                         settings=dict(settings or {}))


def bench_rows(producer: Any, consumer: Any, tokenizer: Any, ctx: MethodContext, cfg: BenchConfig,
               journal: Journal | None = None) -> tuple[dict[str, Row], dict[str, dict[str, Any]]]:
    """(row name -> (method, context), method -> {options, info} of its profiling), in table order; the
    oracle first whatever ``cfg.methods`` says (it is every row's reference)."""
    chosen = chosen_methods(cfg)
    prompts: list[torch.Tensor] | None = None
    rows: dict[str, Row] = {}
    profiles: dict[str, dict[str, Any]] = {}

    def profile(m: TransferMethod) -> list[Any]:
        nonlocal prompts
        want = max(cfg.profile_prefixes, *(c.calibration_prefixes for c in chosen))
        if prompts is None or len(prompts) < want:
            prompts = profile_prompts(tokenizer, ctx, want)
        # each method profiles on the prefixes it asks for (at least the bench's), the same stream for all
        opts, info = m.profile(producer, consumer, prompts[: max(cfg.profile_prefixes, m.calibration_prefixes)], ctx)
        return [opts, info]

    for m in chosen:
        opts, info = once(journal, f"profile/{m.name}", lambda m=m: profile(m))
        if opts or info:
            profiles[m.name] = {"options": opts, "info": info}
        mctx = ctx.with_options(**opts)
        m.check(mctx)
        for name, rctx in m.bench_rows(mctx, extended=cfg.budget_rows).items():
            if name in rows:
                raise KVStateError(f"bench row {name!r} is given by two methods ({rows[name][0].name}, {m.name}); "
                                   "rename one")
            rows[name] = (m, rctx)
    return rows, profiles


@torch.inference_mode()
def _greedy(model: Any, eos: int, ids: torch.Tensor, cache: Any, start: int, budget: int) -> tuple[list[int], float]:
    """Greedy continuation of ``ids`` (1, T) from a cache holding ``start`` tokens; (new ids, ms to first logits)."""
    res = greedy_decode(model, cache, start, budget, eos, input_ids=ids[0, start:])
    return res.tokens, res.first_ms


def _transfer(producer: Any, consumer: Any, row: Row, ids: torch.Tensor) -> tuple[Any, int, float]:
    """(consumer cache of ids[:, :-1], payload bytes, consumer ms for parse + decode) through the wire bytes."""
    m, ctx = row
    data = m.encode(producer, ids[:, :-1], ctx).to_bytes()
    t0 = time.perf_counter()
    cache = m.decode(consumer, Payload.from_bytes(data), ids[0].tolist(), ctx)
    return cache, len(data), 1e3 * (time.perf_counter() - t0)


def summarize(cells: Mapping[str, Mapping[str, Mapping[int, Sequence[float]]]], reference: str,
              lengths: Sequence[int], seed: int = 0) -> dict[tuple[str, int], dict[str, Any]]:
    """Per (row, length): the score pooled over the tasks the ``reference`` row solves at that length
    (:func:`kvstate.lab.protocol.solved_tasks`), its interval and items, the solved tasks, the excluded tasks
    with the reference's mean there, and every task's own items (``by_task``). ``cells``: row -> task ->
    length -> per-item scores. No solved task at a length: score and interval are None (n = 0)."""
    out = {}
    for length in lengths:
        ref = {t: list(v[length]) for t, v in cells[reference].items() if length in v}
        pooled = protocol.solved_tasks(ref)
        for row, by in cells.items():
            at = {t: list(v[length]) for t, v in by.items() if length in v}
            items = pooled.pool(at)
            est = stats.rate(items, seed=seed) if items else None
            out[(row, length)] = {
                "n": len(items), "score": None if est is None else round(est.value, 4),
                "score_ci": None if est is None else [round(est.lo, 4), round(est.hi, 4)],
                "items": [round(float(x), 4) for x in items], "tasks": list(pooled.solved),
                "excluded_tasks": {t: round(v, 4) for t, v in pooled.excluded.items()},
                "by_task": {t: {"score": round(sum(v) / len(v), 4), "n": len(v), "items": [round(float(x), 4) for x in v]}
                            for t, v in at.items() if v}}
    return out


def run_bench(producer: Any, consumer: Any, tokenizer: Any, codec: Codec, cfg: BenchConfig,
              tick: Callable[[str], None] | None = None, pca_codec: Codec | None = None,
              journal: Journal | None = None, codec_dir: Any = None,
              experiment: xp.Experiment | None = None) -> dict[str, Any]:
    """Every registered method's rows on the same prompts; returns the JSON of ``kvstate transfer bench``.

    The prompts are measured prompt-major (one prompt under every row, so a journal unit is one prompt), then
    the needle cells go through the lab's experiment loop (:func:`kvstate.lab.experiment.run`): ``experiment``
    (:func:`plan`; default: ``plan(cfg)``) with the bench's row names as its methods and the oracle row as the
    reference gives the document's ``experiment``, ``rows`` (the one row schema), ``pooled`` (over the
    (task, length) cells the oracle solves) and ``decisions``, beside the bench's per-length ``results``. Weak
    tasks, perplexity and the rank ablation are not pooled rates and stay in the bench's view.

    With a ``journal`` (:mod:`kvstate.lab.journal`) every finished unit — a method's profile, one prompt under
    every row, one held-out text, one rank-ablation pass — is recorded, and a unit already there is read back
    instead of run again (an interrupted bench resumes).
    """
    from kvstate.lab.workloads.tasks import generate

    if pca_codec is not None and (pca_codec.info.get("config") or {}).get("reuse_map") != "pca":
        raise CodecError("the reuse_pca_producer ablation needs a codec calibrated with --reuse-map pca; "
                         "pass one to --pca-codec")
    codec.check_models(producer, consumer)
    if pca_codec is not None:
        pca_codec.check_models(producer, consumer)
    tick = tick or (lambda _s: None)
    ctx = MethodContext(codec=codec, codec_dir=codec_dir, pca_codec=pca_codec)
    rows, profiles = bench_rows(producer, consumer, tokenizer, ctx, cfg, journal)
    names = list(rows)
    reference = next(n for n, (m, _c) in rows.items() if not m.ships_payload)
    cells: dict[str, dict[str, dict[int, list[float]]]] = {m: {} for m in names}
    extra: dict[tuple[str, int], dict[str, list[float]]] = {
        (m, L): {"f1": [], "ms": [], "bytes": [], "tokens": []} for m in names for L in cfg.lengths}
    weak: dict[str, dict[str, list[float]]] = {m: {} for m in names}
    for task, length, n, strong in [(t, L, cfg.n, True) for t in cfg.tasks for L in cfg.lengths] + \
            [(t, cfg.lengths[0], cfg.weak_n, False) for t in cfg.weak_tasks]:
        for i, ex in enumerate(generate(task, length, n, cfg.seed, tokenizer) if n else []):
            unit = f"prompt/{task}/{length}/{i}" + ("" if strong else "/weak")
            got = once(journal, unit, lambda ex=ex: _prompt(producer, consumer, tokenizer, rows, ex))
            for m in names:
                s, f, ms, nbytes, ntok = got[m]
                if not strong:
                    weak[m].setdefault(f"{task}@{length}", []).append(s)
                    continue
                cells[m].setdefault(task, {}).setdefault(length, []).append(s)
                r = extra[(m, length)]
                for key, val in (("f1", f), ("ms", ms), ("bytes", nbytes), ("tokens", ntok)):
                    r[key].append(val)
            tick(task)
    ppl_texts: dict[str, list[TextNLL]] = {}
    ppl = _perplexities(producer, consumer, tokenizer, rows, cfg, tick, texts=ppl_texts, journal=journal)
    ppl_ci = _ppl_intervals(ppl_texts, cfg.seed)
    pooled = summarize(cells, reference, cfg.lengths, cfg.seed)
    planned = experiment if experiment is not None else plan(cfg)
    loop = xp.run(dataclasses.replace(planned, methods=tuple(names), reference=reference),
                  lambda c: xp.Measurement([float(x) for x in cells[c.method][c.task][c.length]]))
    loop.pop("provenance")  # the caller's recorder, started before any work, is the run's
    results = []
    for m in names:
        method, rctx = rows[m]
        for length in cfg.lengths:
            r, p = extra[(m, length)], pooled[(m, length)]
            results.append({
                "method": m, "registered": method.name, "options": dict(rctx.options), "length": length, **p,
                "f1": round(sum(r["f1"]) / len(r["f1"]), 4),
                "ppl": round(ppl[m], 4) if m in ppl and math.isfinite(ppl[m]) else None,
                "ppl_ci": ppl_ci.get(m), "ppl_texts": len(ppl_texts.get(m, [])),
                "payload_bytes_per_token": round(sum(r["bytes"]) / sum(r["tokens"]), 2),
                "recomputed_layers": list(method.recomputed_layers(rctx)),
                "consumer_ms": round(statistics.median(r["ms"]), 3), "ttft_ms": None, "achieved_gbit_s": None,
                "per_task": {f"{t}@{length}": v["score"] for t, v in p["by_task"].items()},
                "weak_tasks": {k: round(sum(v) / len(v), 4) for k, v in weak[m].items()}})
    g = codec.geometry
    budget = sorted(({"k": len(layers), "method": m, "layers": list(layers)} for m, (meth, rctx) in rows.items()
                     if isinstance(meth, CodecMethod) and rctx.codec is codec
                     and (layers := meth.patch(rctx)) is not None), key=lambda b: b["k"])
    out = {**loop, "results": results, "reference": reference, "solved_at": protocol.SOLVED_AT,
           "fp16_raw_kv_bytes_per_token": kv_bytes_per_token(consumer.config, torch.float16),
           "patch_layers": list(codec.config.patch_layers), "patch_budget": budget,
           "method_options": {k: v["options"] for k, v in profiles.items()},
           "profiles": {k: v["info"] for k, v in profiles.items()},
           "reuse_map": (codec.info.get("config") or {}).get("reuse_map"),
           "ranks": {"k": codec.config.rank_k, "v": codec.config.rank_v, "h": codec.config.rank_h},
           "bits": codec.config.bits, "n_layers": g.n_layers, "config": asdict(cfg),
           "drift": {k: codec.info.get(k) for k in ("raw_drift_k", "raw_drift_v", "reuse_err_k", "reuse_err_v",
                                                     "patch_err_k", "patch_err_v", "impact_raw", "impact_reuse",
                                                     "impact_patch", "patch_in_context", "patch_gain", "amplification",
                                                     "kl_all_layers")}}
    if cfg.ablation_n:
        out["ablation_rank"] = _rank_ablation(producer, consumer, tokenizer, ctx, cfg, tick, journal)
    return out


def _prompt(producer: Any, consumer: Any, tokenizer: Any, rows: Mapping[str, Row], ex: Any) -> dict[str, list[float]]:
    """One prompt under every row: ``{row: [score, f1, consumer ms, payload bytes, tokens sent]}``."""
    ids = torch.tensor([tokenizer(ex.prompt)["input_ids"]], dtype=torch.long)
    budget = len(tokenizer(ex.target, add_special_tokens=False)["input_ids"]) + 8
    eos = tokenizer.eos_token_id
    out = {}
    for name, row in rows.items():
        if not row[0].ships_payload:  # the oracle: the consumer's own prefill of the whole prompt
            new, ms = _greedy(consumer, eos, ids, DynamicCache(config=consumer.config), 0, budget)
            nbytes = 0
        else:
            cache, nbytes, dec_ms = _transfer(producer, consumer, row, ids)
            new, first_ms = _greedy(consumer, eos, ids, cache, ids.shape[1] - 1, budget)
            ms = dec_ms + first_ms
        pred = tokenizer.decode(new, skip_special_tokens=True)
        out[name] = [score(ex, pred), f1(extract_answer(pred), ex.answers), ms, nbytes, ids.shape[1] - 1]
    return out


@torch.inference_mode()
def _perplexities(producer: Any, consumer: Any, tokenizer: Any, rows: Mapping[str, Row], cfg: BenchConfig,
                  tick: Callable[[str], None], texts: dict[str, list[TextNLL]] | None = None,
                  journal: Journal | None = None) -> dict[str, float]:
    """Consumer perplexity on the second half of held-out text given each row's state of the first half."""
    from kvstate.lab.workloads.tasks import generate

    def text(ids: torch.Tensor) -> dict[str, list[float]]:
        cut = ids.shape[1] // 2
        got = {}
        for name, (m, rctx) in rows.items():
            if not m.ships_payload:  # the consumer's own forward over the whole text
                r = continuation_nll(consumer, ids, cut)
            else:
                cache = m.decode(consumer, Payload.from_bytes(m.encode(producer, ids[:, :cut], rctx).to_bytes()),
                                 ids[0].tolist(), rctx)
                r = continuation_nll(consumer, ids, cut, cache)
            got[name] = [r.nll, r.tokens, r.seconds]
        return got

    out: dict[str, list[TextNLL]] = {m: [] for m in rows}
    for i, ex in enumerate(generate("text", cfg.ppl_length, cfg.ppl_n, cfg.seed + 1, tokenizer) if cfg.ppl_n else []):
        ids = torch.tensor([tokenizer(ex.prompt)["input_ids"]], dtype=torch.long)
        got = once(journal, f"ppl/{i}", lambda ids=ids: text(ids))
        for m in rows:
            nll, tokens, seconds = got[m]
            out[m].append(TextNLL(float(nll), int(tokens), float(seconds)))
        tick("ppl")
    if texts is not None:  # the caller keeps the per-text NLL (for intervals)
        texts.update(out)
    return {m: pooled_perplexity(r) for m, r in out.items()}


def _ppl_intervals(rows: dict[str, list[TextNLL]], seed: int) -> dict[str, list[float]]:
    """95% bootstrap interval (over texts) of each row's perplexity."""
    out = {}
    for m, r in rows.items():
        if r:
            e = stats.perplexity([x.nll for x in r], [x.tokens for x in r], seed=seed)
            out[m] = [round(e.lo, 4), round(e.hi, 4)]
    return out


def _task_pass(producer: Any, consumer: Any, tokenizer: Any, row: Row, cfg: BenchConfig) -> tuple[float, float]:
    """(mean score, payload bytes per token) of one row on the ablation examples."""
    from kvstate.lab.workloads.tasks import generate

    scores, nbytes, ntok = [], 0, 0
    for task in cfg.tasks:
        for ex in generate(task, cfg.lengths[0], cfg.ablation_n, cfg.seed, tokenizer):
            ids = torch.tensor([tokenizer(ex.prompt)["input_ids"]], dtype=torch.long)
            budget = len(tokenizer(ex.target, add_special_tokens=False)["input_ids"]) + 8
            cache, b, _ = _transfer(producer, consumer, row, ids)
            new, _ = _greedy(consumer, tokenizer.eos_token_id, ids, cache, ids.shape[1] - 1, budget)
            scores.append(score(ex, tokenizer.decode(new, skip_special_tokens=True)))
            nbytes, ntok = nbytes + b, ntok + ids.shape[1] - 1
    return sum(scores) / len(scores), nbytes / ntok


def _rank_ablation(producer: Any, consumer: Any, tokenizer: Any, ctx: MethodContext, cfg: BenchConfig,
                   tick: Callable[[str], None], journal: Journal | None = None) -> list[dict[str, Any]]:
    """Key rank vs value rank: REUSE at every layer with the codec truncated to half its key or value rank."""
    codec, reuse = ctx.codec, registry.get("reuse")
    rk, rv = codec.config.rank_k, codec.config.rank_v
    out = []
    for k, v in dict.fromkeys([(rk, rv), (max(1, rk // 2), rv), (rk, max(1, rv // 2)), (max(1, rk // 2), max(1, rv // 2))]):
        row = (reuse, replace(ctx, codec=codec.truncated(k, v), options={}))
        s, bpt = once(journal, f"ablation/{k}/{v}",
                      lambda row=row: list(_task_pass(producer, consumer, tokenizer, row, cfg)))
        out.append({"rank_k": k, "rank_v": v, "score": round(s, 4), "payload_bytes_per_token": round(bpt, 2)})
        tick("ablation")
    return out
