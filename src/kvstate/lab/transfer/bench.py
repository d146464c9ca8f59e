"""``kvstate transfer bench``: SCD against its baselines on the same prompts: quality and payload size.

Compares, for *Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching*
(``docs/techniques.md#across-models``): the consumer's own full prefill (``oracle``), raw producer KV in
fp16 / fp32 (``raw`` / ``raw_fp32``), KIVI at 4 / 2 bits with its fp16 residual window (``kivi4`` /
``kivi2``), DroidSpeak's recompute of the contiguous block its offline profiling picks (``droidspeak``),
REUSE codes at every layer (``reuse``), REUSE + PATCH on the calibrated transition layers (``scd``), the
PATCH budget ``scd_k1`` .. ``scd_k4`` (the k layers with the largest measured patch gain; k = 0 is
``reuse``) and, given a producer-space PCA codec, the ablation ``reuse_pca_producer``. One row per method
and length: the consumer's score (RULER metric) with its 95% interval and per-item scores (for paired
differences), token F1, perplexity on held-out text, payload bytes per token measured from the payloads
sent, and the consumer's compute (payload parse + cache decode + first logits; the oracle: its prefill).
Time to first token over a link is measured elsewhere (``ttft_ms`` / ``achieved_gbit_s`` stay null here).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import DynamicCache

from kvstate.errors import KVStateError
from kvstate.lab import stats
from kvstate.lab.decode import greedy_decode
from kvstate.lab.journal import Journal, once
from kvstate.lab.perplexity import TextNLL, continuation_nll, pooled_perplexity
from kvstate.lab.scoring import extract_answer, f1, score
from kvstate.lab.transfer.baselines import (
    choose_block,
    decode_baseline,
    encode_baseline,
    profile_blocks,
    raw_pair,
)
from kvstate.models import model_fingerprint
from kvstate.transfer.codec import Codec, CodecError
from kvstate.transfer.lowrank import select_patch_layers
from kvstate.transfer.payload import Payload

BASELINES = ("raw", "raw_fp32", "kivi4", "kivi2", "droidspeak")
GATE_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery")
WEAK_TASKS = ("vt", "fwe", "cwe", "qa")
MAX_BUDGET = 4  # PATCH budget rows scd_k1 .. scd_k{min(4, layers)}


@dataclass(frozen=True)
class BenchConfig:
    n: int = 10  # examples per (needle task, length)
    seed: int = 0
    tasks: tuple[str, ...] = GATE_TASKS
    lengths: tuple[int, ...] = (1024, 2048)
    weak_tasks: tuple[str, ...] = WEAK_TASKS  # reported, marked weak (the full cache scores poorly there)
    weak_n: int = 3  # examples per weak task, at lengths[0]
    ppl_n: int = 4  # held-out text examples; the second half is scored given the first half's state
    ppl_length: int = 1024
    ablation_n: int = 3  # examples per needle task at lengths[0] for the key-vs-value rank ablation (0: skip)
    budget_rows: bool = True  # the PATCH budget rows scd_k1 .. scd_k4
    droidspeak_prefixes: int = 4  # dev prefixes (calibration stream) of DroidSpeak's block profiling
    droidspeak_keep: float = 0.25  # its quality bound: the block's KL <= keep x raw reuse's

    def __post_init__(self) -> None:
        if self.n < 1 or self.ppl_n < 0 or self.weak_n < 0 or self.ablation_n < 0 or self.droidspeak_prefixes < 1:
            raise KVStateError(f"BenchConfig: n={self.n} and droidspeak_prefixes={self.droidspeak_prefixes} must be "
                               ">= 1 and ppl_n / weak_n / ablation_n >= 0")
        if not self.lengths or not self.tasks:
            raise KVStateError("BenchConfig: need tasks and lengths")
        if not 0.0 <= self.droidspeak_keep < 1.0:
            raise KVStateError(f"BenchConfig.droidspeak_keep={self.droidspeak_keep} must be in [0, 1)")


Encode = Callable[[torch.Tensor], Payload]
Decode = Callable[[Payload, list[int]], Any]


def budget_layers(codec: Codec, k: int) -> list[int]:
    """The ``k`` PATCH layers with the largest calibrated patch gain (the transition layers)."""
    gain = codec.info.get("patch_gain") or [0.0] * codec.geometry.n_layers
    return select_patch_layers(gain, k)


def transfer_methods(producer: Any, consumer: Any, codec: Codec, block: tuple[int, int],
                     pca_codec: Codec | None = None, budget_rows: bool = True) -> dict[str, tuple[Encode, Decode]]:
    """(encode on the producer, decode on the consumer) of every method but the oracle, in table order."""
    codec.check_models(producer, consumer)
    if pca_codec is not None:
        pca_codec.check_models(producer, consumer)
    rp = raw_pair(model_fingerprint(producer), model_fingerprint(consumer))

    def base(method: str) -> tuple[Encode, Decode]:
        return (lambda ids: encode_baseline(method, producer, ids, rp, block),
                lambda pl, _ids: decode_baseline(consumer, pl, rp))

    def scd(c: Codec, patch: Sequence[int] | None) -> tuple[Encode, Decode]:
        return (lambda ids: c.encode(producer, ids, patch=patch, check=False),
                lambda pl, ids: c.decode(consumer, pl, ids, check=False))

    out = {m: base(m) for m in BASELINES}
    if pca_codec is not None:
        out["reuse_pca_producer"] = scd(pca_codec, ())
    out.update(reuse=scd(codec, ()), scd=scd(codec, None))
    if budget_rows:
        for k in range(1, min(MAX_BUDGET, codec.geometry.n_layers) + 1):
            out[f"scd_k{k}"] = scd(codec, budget_layers(codec, k))
    return out


def droidspeak_profile(producer: Any, consumer: Any, tokenizer: Any, cfg: BenchConfig,
                       seed: int) -> tuple[tuple[int, int], dict[str, float]]:
    """DroidSpeak's block from its offline profiling on dev prefixes of the calibration stream (``seed``)."""
    from kvstate.lab.transfer.prompts import calibration_prompts
    from kvstate.transfer.calibrate import CalibrationConfig

    prompts = calibration_prompts(tokenizer, CalibrationConfig(prefixes=max(4, cfg.droidspeak_prefixes),
                                                               length=512, seed=seed))[: cfg.droidspeak_prefixes]
    rp = raw_pair(model_fingerprint(producer), model_fingerprint(consumer))
    kl = profile_blocks(producer, consumer, prompts, rp)
    return choose_block(kl, cfg.droidspeak_keep), {f"{a},{b}": round(v, 6) for (a, b), v in kl.items()}


@torch.inference_mode()
def _greedy(model: Any, eos: int, ids: torch.Tensor, cache: Any, start: int, budget: int) -> tuple[list[int], float]:
    """Greedy continuation of ``ids`` (1, T) from a cache holding ``start`` tokens; (new ids, ms to first logits)."""
    res = greedy_decode(model, cache, start, budget, eos, input_ids=ids[0, start:])
    return res.tokens, res.first_ms


def _transfer(enc: Encode, dec: Decode, ids: torch.Tensor) -> tuple[Any, int, float]:
    """(consumer cache of ids[:, :-1], payload bytes, consumer ms for parse + decode)."""
    data = enc(ids[:, :-1]).to_bytes()
    t0 = time.perf_counter()
    cache = dec(Payload.from_bytes(data), ids[0].tolist())
    return cache, len(data), 1e3 * (time.perf_counter() - t0)


def run_bench(producer: Any, consumer: Any, tokenizer: Any, codec: Codec, cfg: BenchConfig,
              tick: Callable[[str], None] | None = None, pca_codec: Codec | None = None,
              journal: Journal | None = None) -> dict[str, Any]:
    """Every method on the same prompts; returns the JSON of ``kvstate transfer bench``.

    With a ``journal`` (:mod:`kvstate.lab.journal`) every finished unit — the DroidSpeak profile, one
    prompt under every method, one held-out text, one rank-ablation pass — is recorded, and a unit
    already there is read back instead of run again (an interrupted bench resumes).
    """
    from kvstate.lab.workloads.tasks import generate

    if pca_codec is not None and (pca_codec.info.get("config") or {}).get("reuse_map") != "pca":
        raise CodecError("the reuse_pca_producer ablation needs a codec calibrated with --reuse-map pca; "
                         "pass one to --pca-codec")
    tick = tick or (lambda _s: None)
    seed = int((codec.info.get("config") or {}).get("seed", 7919))  # the calibration stream: dev data, not test
    blk, block_kl = once(journal, "droidspeak", lambda: list(droidspeak_profile(producer, consumer, tokenizer, cfg, seed)))
    block = (int(blk[0]), int(blk[1]))
    tick("droidspeak")
    methods = transfer_methods(producer, consumer, codec, block, pca_codec, cfg.budget_rows)
    names = ["oracle", *methods]
    rows: dict[tuple[str, int], dict[str, list[float]]] = {
        (m, L): {"score": [], "f1": [], "ms": [], "bytes": [], "tokens": []} for m in names for L in cfg.lengths}
    cells: dict[str, dict[str, list[float]]] = {m: {} for m in names}
    weak: dict[str, dict[str, list[float]]] = {m: {} for m in names}
    for task, length, n, strong in [(t, L, cfg.n, True) for t in cfg.tasks for L in cfg.lengths] + \
            [(t, cfg.lengths[0], cfg.weak_n, False) for t in cfg.weak_tasks]:
        for i, ex in enumerate(generate(task, length, n, cfg.seed, tokenizer) if n else []):
            unit = f"prompt/{task}/{length}/{i}" + ("" if strong else "/weak")
            got = once(journal, unit, lambda ex=ex: _prompt(consumer, tokenizer, methods, names, ex))
            for m in names:
                s, f, ms, nbytes, ntok = got[m]
                (cells if strong else weak)[m].setdefault(f"{task}@{length}", []).append(s)
                if strong:
                    r = rows[(m, length)]
                    for key, val in (("score", s), ("f1", f), ("ms", ms), ("bytes", nbytes), ("tokens", ntok)):
                        r[key].append(val)
            tick(task)
    ppl_texts: dict[str, list[TextNLL]] = {}
    ppl = _perplexities(consumer, tokenizer, methods, cfg, tick, only=names, texts=ppl_texts, journal=journal)
    ppl_ci = _ppl_intervals(ppl_texts, cfg.seed)
    results = []
    for (m, length), r in rows.items():
        est = stats.rate(r["score"], seed=cfg.seed)
        results.append({"method": m, "length": length, "n": est.n, "score": round(est.value, 4),
                        "score_ci": [round(est.lo, 4), round(est.hi, 4)],
                        "items": [round(float(x), 4) for x in r["score"]],
                        "f1": round(sum(r["f1"]) / len(r["f1"]), 4), "ppl": round(ppl[m], 4) if m in ppl and math.isfinite(ppl[m]) else None,
                        "ppl_ci": ppl_ci.get(m), "ppl_texts": len(ppl_texts.get(m, [])),
                        "payload_bytes_per_token": round(sum(r["bytes"]) / sum(r["tokens"]), 2),
                        "consumer_ms": round(statistics.median(r["ms"]), 3), "ttft_ms": None, "achieved_gbit_s": None,
                        "per_task": {k: round(sum(v) / len(v), 4) for k, v in cells[m].items() if k.endswith(f"@{length}")},
                        "weak_tasks": {k: round(sum(v) / len(v), 4) for k, v in weak[m].items()}})
    g = codec.geometry
    budget = [{"k": 0, "method": "reuse", "layers": []}]
    if cfg.budget_rows:
        budget += [{"k": k, "method": f"scd_k{k}", "layers": budget_layers(codec, k)}
                   for k in range(1, min(MAX_BUDGET, g.n_layers) + 1)]
    out = {"results": results,
           "fp16_raw_kv_bytes_per_token": g.n_layers * 2 * g.n_kv_heads * g.head_dim * 2,
           "patch_layers": list(codec.config.patch_layers), "patch_budget": budget,
           "droidspeak_block": list(block), "droidspeak_profile_kl": block_kl,
           "reuse_map": (codec.info.get("config") or {}).get("reuse_map"),
           "ranks": {"k": codec.config.rank_k, "v": codec.config.rank_v, "h": codec.config.rank_h},
           "bits": codec.config.bits, "config": asdict(cfg),
           "drift": {k: codec.info.get(k) for k in ("raw_drift_k", "raw_drift_v", "reuse_err_k", "reuse_err_v",
                                                     "patch_err_k", "patch_err_v", "impact_raw", "impact_reuse",
                                                     "impact_patch", "patch_in_context", "patch_gain", "amplification",
                                                     "kl_all_layers")}}
    if cfg.ablation_n:
        out["ablation_rank"] = _rank_ablation(producer, consumer, tokenizer, codec, cfg, tick, journal)
    return out


def _prompt(consumer: Any, tokenizer: Any, methods: dict[str, tuple[Encode, Decode]], names: Sequence[str],
            ex: Any) -> dict[str, list[float]]:
    """One prompt under every method: ``{method: [score, f1, consumer ms, payload bytes, tokens sent]}``."""
    ids = torch.tensor([tokenizer(ex.prompt)["input_ids"]], dtype=torch.long)
    budget = len(tokenizer(ex.target, add_special_tokens=False)["input_ids"]) + 8
    eos = tokenizer.eos_token_id
    out = {}
    for m in names:
        if m == "oracle":
            new, ms = _greedy(consumer, eos, ids, DynamicCache(config=consumer.config), 0, budget)
            nbytes = 0
        else:
            cache, nbytes, dec_ms = _transfer(*methods[m], ids)
            new, first_ms = _greedy(consumer, eos, ids, cache, ids.shape[1] - 1, budget)
            ms = dec_ms + first_ms
        pred = tokenizer.decode(new, skip_special_tokens=True)
        out[m] = [score(ex, pred), f1(extract_answer(pred), ex.answers), ms, nbytes, ids.shape[1] - 1]
    return out


@torch.inference_mode()
def _perplexities(consumer: Any, tokenizer: Any, methods: dict[str, tuple[Encode, Decode]], cfg: BenchConfig,
                  tick: Callable[[str], None], only: Sequence[str],
                  texts: dict[str, list[TextNLL]] | None = None, journal: Journal | None = None) -> dict[str, float]:
    """Consumer perplexity on the second half of held-out text given each method's state of the first half."""
    from kvstate.lab.workloads.tasks import generate

    def text(ids: torch.Tensor) -> dict[str, list[float]]:
        cut = ids.shape[1] // 2
        got = {}
        for m in only:
            if m == "oracle":  # the consumer's own forward over the whole text
                r = continuation_nll(consumer, ids, cut)
            else:
                enc, dec = methods[m]
                cache = dec(Payload.from_bytes(enc(ids[:, :cut]).to_bytes()), ids[0].tolist())
                r = continuation_nll(consumer, ids, cut, cache)
            got[m] = [r.nll, r.tokens, r.seconds]
        return got

    rows: dict[str, list[TextNLL]] = {m: [] for m in only}
    for i, ex in enumerate(generate("text", cfg.ppl_length, cfg.ppl_n, cfg.seed + 1, tokenizer) if cfg.ppl_n else []):
        ids = torch.tensor([tokenizer(ex.prompt)["input_ids"]], dtype=torch.long)
        got = once(journal, f"ppl/{i}", lambda ids=ids: text(ids))
        for m in only:
            nll, tokens, seconds = got[m]
            rows[m].append(TextNLL(float(nll), int(tokens), float(seconds)))
        tick("ppl")
    if texts is not None:  # the caller keeps the per-text NLL (for intervals)
        texts.update(rows)
    return {m: pooled_perplexity(r) for m, r in rows.items()}


def _ppl_intervals(rows: dict[str, list[TextNLL]], seed: int) -> dict[str, list[float]]:
    """95% bootstrap interval (over texts) of each method's perplexity."""
    out = {}
    for m, r in rows.items():
        if r:
            e = stats.perplexity([x.nll for x in r], [x.tokens for x in r], seed=seed)
            out[m] = [round(e.lo, 4), round(e.hi, 4)]
    return out


def _task_pass(producer: Any, consumer: Any, tokenizer: Any, codec: Codec, layers: Sequence[int] | None,
               cfg: BenchConfig) -> tuple[float, float]:
    """(mean score, payload bytes per token) of ``codec`` with PATCH ``layers`` on the ablation examples."""
    from kvstate.lab.workloads.tasks import generate

    enc = lambda ids: codec.encode(producer, ids, patch=layers, check=False)  # noqa: E731
    dec = lambda pl, ids: codec.decode(consumer, pl, ids, check=False)  # noqa: E731
    scores, nbytes, ntok = [], 0, 0
    for task in cfg.tasks:
        for ex in generate(task, cfg.lengths[0], cfg.ablation_n, cfg.seed, tokenizer):
            ids = torch.tensor([tokenizer(ex.prompt)["input_ids"]], dtype=torch.long)
            budget = len(tokenizer(ex.target, add_special_tokens=False)["input_ids"]) + 8
            cache, b, _ = _transfer(enc, dec, ids)
            new, _ = _greedy(consumer, tokenizer.eos_token_id, ids, cache, ids.shape[1] - 1, budget)
            scores.append(score(ex, tokenizer.decode(new, skip_special_tokens=True)))
            nbytes, ntok = nbytes + b, ntok + ids.shape[1] - 1
    return sum(scores) / len(scores), nbytes / ntok


def _rank_ablation(producer: Any, consumer: Any, tokenizer: Any, codec: Codec, cfg: BenchConfig,
                   tick: Callable[[str], None], journal: Journal | None = None) -> list[dict[str, Any]]:
    """Key rank vs value rank: the codec truncated to half its key or value rank (REUSE at every layer)."""
    rk, rv = codec.config.rank_k, codec.config.rank_v
    out = []
    for k, v in dict.fromkeys([(rk, rv), (max(1, rk // 2), rv), (rk, max(1, rv // 2)), (max(1, rk // 2), max(1, rv // 2))]):
        s, bpt = once(journal, f"ablation/{k}/{v}",
                      lambda k=k, v=v: list(_task_pass(producer, consumer, tokenizer, codec.truncated(k, v), (), cfg)))
        out.append({"rank_k": k, "rank_v": v, "score": round(s, 4), "payload_bytes_per_token": round(bpt, 2)})
        tick("ablation")
    return out
