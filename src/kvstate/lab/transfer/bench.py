"""``kvstate transfer bench``: SCD against its baselines on the same prompts, quality and time to first token.

Compares, for *Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching*
(``docs/techniques.md#across-models``): the consumer's own full prefill (``oracle``), raw producer KV
(``raw``, fp16), KIVI-style 4-bit raw KV (``kv4bit``), DroidSpeak-style recompute of a contiguous block
of critical layers (``droidspeak``), REUSE codes only (``reuse``) and REUSE + PATCH (``scd``). For every
method: the consumer's score (RULER metric) and token F1 on the needle tasks, perplexity on held-out
text, payload bytes per token, the consumer's compute (payload parse + cache decode + the last prompt
token; the oracle: its full prefill) measured here, TTFT = payload bytes / bandwidth + consumer compute
at 1, 10 and 100 Gbit/s, and one measured loopback TCP fetch. Ablation: PATCH budget k = 0..L.
Ignored: the producer's own prefill time (it runs before the consumer is involved in both designs).
"""

from __future__ import annotations

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
from kvstate.lab.perplexity import TextNLL, continuation_nll, pooled_perplexity
from kvstate.lab.scoring import extract_answer, f1, score
from kvstate.lab.transfer.baselines import decode_baseline, encode_baseline, raw_pair
from kvstate.models import model_fingerprint
from kvstate.transfer.codec import Codec
from kvstate.transfer.lowrank import select_patch_layers
from kvstate.transfer.payload import Payload
from kvstate.transfer.store import MemoryStore
from kvstate.transfer.transport import ProducerService, ServerThread, fetch_payload

METHODS = ("oracle", "raw", "kv4bit", "droidspeak", "reuse", "scd")
GATE_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery")
WEAK_TASKS = ("vt", "fwe", "cwe", "qa")


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
    bandwidths_gbit: tuple[float, ...] = (1.0, 10.0, 100.0)
    ablation_n: int = 3  # examples per needle task at lengths[0] for the PATCH-budget ablation (0: skip)

    def __post_init__(self) -> None:
        if self.n < 1 or self.ppl_n < 0 or self.weak_n < 0 or self.ablation_n < 0:
            raise KVStateError(f"BenchConfig: n={self.n} must be >= 1 and ppl_n / weak_n / ablation_n >= 0")
        if not self.lengths or not self.tasks or any(b <= 0 for b in self.bandwidths_gbit):
            raise KVStateError("BenchConfig: need tasks, lengths and positive bandwidths")


Encode = Callable[[torch.Tensor], Payload]
Decode = Callable[[Payload, list[int]], Any]


def transfer_methods(producer: Any, consumer: Any, codec: Codec) -> dict[str, tuple[Encode, Decode]]:
    """(encode on the producer, decode on the consumer) of every method but the oracle."""
    codec.check_models(producer, consumer)
    rp = raw_pair(model_fingerprint(producer), model_fingerprint(consumer))
    block = droidspeak_block(codec)

    def base(method: str) -> tuple[Encode, Decode]:
        return (lambda ids: encode_baseline(method, producer, ids, rp, block),
                lambda pl, _ids: decode_baseline(consumer, pl, rp))

    def scd(patch: Sequence[int] | None) -> tuple[Encode, Decode]:
        return (lambda ids: codec.encode(producer, ids, patch=patch, check=False),
                lambda pl, ids: codec.decode(consumer, pl, ids, check=False))

    return {"raw": base("raw"), "kv4bit": base("kv4bit"), "droidspeak": base("droidspeak"),
            "reuse": scd(()), "scd": scd(None)}


def droidspeak_block(codec: Codec) -> tuple[int, int]:
    """The contiguous block of as many layers as the codec patches (>= 1) with the largest raw-reuse impact."""
    impact = codec.info.get("impact_raw") or [1.0] * codec.geometry.n_layers
    width = max(1, len(codec.config.patch_layers))
    start = max(range(len(impact) - width + 1), key=lambda a: (sum(impact[a:a + width]), -a))
    return start, start + width


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
              tick: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every method on the same prompts; returns the JSON of ``kvstate transfer bench``."""
    from kvstate.lab.workloads.tasks import generate

    tick = tick or (lambda _s: None)
    methods = transfer_methods(producer, consumer, codec)
    eos = tokenizer.eos_token_id
    rows: dict[str, dict[str, list[float]]] = {m: {"score": [], "f1": [], "ms": [], "bytes": [], "tokens": []}
                                               for m in METHODS}
    cells: dict[str, dict[str, list[float]]] = {m: {} for m in METHODS}
    weak: dict[str, dict[str, list[float]]] = {m: {} for m in METHODS}
    for task, length, n, strong in [(t, L, cfg.n, True) for t in cfg.tasks for L in cfg.lengths] + \
            [(t, cfg.lengths[0], cfg.weak_n, False) for t in cfg.weak_tasks]:
        for ex in generate(task, length, n, cfg.seed, tokenizer) if n else []:
            ids = torch.tensor([tokenizer(ex.prompt)["input_ids"]], dtype=torch.long)
            budget = len(tokenizer(ex.target, add_special_tokens=False)["input_ids"]) + 8
            for m in METHODS:
                if m == "oracle":
                    new, ms = _greedy(consumer, eos, ids, DynamicCache(config=consumer.config), 0, budget)
                    nbytes = 0
                else:
                    cache, nbytes, dec_ms = _transfer(*methods[m], ids)
                    new, first_ms = _greedy(consumer, eos, ids, cache, ids.shape[1] - 1, budget)
                    ms = dec_ms + first_ms
                pred = tokenizer.decode(new, skip_special_tokens=True)
                s, f = score(ex, pred), f1(extract_answer(pred), ex.answers)
                key = f"{task}@{length}"
                (cells if strong else weak)[m].setdefault(key, []).append(s)
                if strong:
                    r = rows[m]
                    r["score"].append(s)
                    r["f1"].append(f)
                    r["ms"].append(ms)
                    r["bytes"].append(nbytes)
                    r["tokens"].append(ids.shape[1] - 1)
            tick(task)
    ppl_texts: dict[str, list[TextNLL]] = {}
    ppl = _perplexities(consumer, tokenizer, methods, cfg, tick, texts=ppl_texts)
    ppl_ci = _ppl_intervals(ppl_texts, cfg.seed)
    loop = _loopback(producer, tokenizer, methods, cfg)
    results = []
    for m in METHODS:
        r = rows[m]
        bpt = sum(r["bytes"]) / sum(r["tokens"])
        cms = statistics.median(r["ms"])
        mean_tokens = sum(r["tokens"]) / len(r["tokens"])
        ttft = {f"{b:g}": round(bpt * mean_tokens * 8 / (b * 1e9) * 1e3 + cms, 3) for b in cfg.bandwidths_gbit}
        est = stats.rate(r["score"], seed=cfg.seed)
        results.append({"method": m, "score": round(est.value, 4), "score_ci": [round(est.lo, 4), round(est.hi, 4)],
                        "n": est.n, "items": [round(float(s), 4) for s in r["score"]],
                        "f1": round(sum(r["f1"]) / len(r["f1"]), 4), "ppl": round(ppl[m], 4),
                        "ppl_ci": ppl_ci.get(m), "ppl_texts": len(ppl_texts.get(m, [])),
                        "payload_bytes_per_token": round(bpt, 2), "consumer_ms": round(cms, 3), "ttft_ms": ttft,
                        "loopback_ms": round(loop.get(m, 0.0), 3),
                        "per_task": {k: round(sum(v) / len(v), 4) for k, v in cells[m].items()},
                        "weak_tasks": {k: round(sum(v) / len(v), 4) for k, v in weak[m].items()}})
    g = codec.geometry
    out = {"results": results, "mean_prompt_tokens": round(mean_tokens, 1),
           "fp16_raw_kv_bytes_per_token": g.n_layers * 2 * g.n_kv_heads * g.head_dim * 2,
           "patch_layers": list(codec.config.patch_layers), "droidspeak_block": list(droidspeak_block(codec)),
           "ranks": {"k": codec.config.rank_k, "v": codec.config.rank_v, "h": codec.config.rank_h},
           "bits": codec.config.bits, "config": asdict(cfg),
           "drift": {k: codec.info.get(k) for k in ("raw_drift_k", "raw_drift_v", "reuse_err_k", "reuse_err_v",
                                                     "patch_err_k", "patch_err_v", "impact_raw", "impact_reuse",
                                                     "impact_patch", "amplification", "kl_all_layers")}}
    if cfg.ablation_n:
        out["ablation_patch"] = _patch_ablation(producer, consumer, tokenizer, codec, cfg, tick)
        out["ablation_rank"] = _rank_ablation(producer, consumer, tokenizer, codec, cfg, tick)
    return out


@torch.inference_mode()
def _perplexities(consumer: Any, tokenizer: Any, methods: dict[str, tuple[Encode, Decode]], cfg: BenchConfig,
                  tick: Callable[[str], None], only: Sequence[str] = METHODS,
                  texts: dict[str, list[TextNLL]] | None = None) -> dict[str, float]:
    """Consumer perplexity on the second half of held-out text given each method's state of the first half."""
    from kvstate.lab.workloads.tasks import generate

    rows: dict[str, list[TextNLL]] = {m: [] for m in only}
    for ex in generate("text", cfg.ppl_length, cfg.ppl_n, cfg.seed + 1, tokenizer) if cfg.ppl_n else []:
        ids = torch.tensor([tokenizer(ex.prompt)["input_ids"]], dtype=torch.long)
        cut = ids.shape[1] // 2
        for m in only:
            if m == "oracle":  # the consumer's own forward over the whole text
                rows[m].append(continuation_nll(consumer, ids, cut))
            else:
                enc, dec = methods[m]
                cache = dec(Payload.from_bytes(enc(ids[:, :cut]).to_bytes()), ids[0].tolist())
                rows[m].append(continuation_nll(consumer, ids, cut, cache))
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


def _loopback(producer: Any, tokenizer: Any, methods: dict[str, tuple[Encode, Decode]],
              cfg: BenchConfig) -> dict[str, float]:
    """Median of 3 loopback TCP fetches (connect, hello, request, payload) of one ``ppl_length`` prompt's payload."""
    from kvstate.lab.workloads.tasks import generate

    ex = generate("text", cfg.ppl_length, 1, cfg.seed + 2, tokenizer)[0]
    ids = torch.tensor([tokenizer(ex.prompt)["input_ids"]], dtype=torch.long)[:, :-1]
    out = {}
    for m, (enc, _dec) in methods.items():
        payload = enc(ids)
        service = ProducerService(lambda _ids, p=payload: p, payload.pair, MemoryStore())
        with ServerThread(service) as srv:
            fetch_payload(f"127.0.0.1:{srv.port}", ids[0].tolist())  # encodes once, then served from the store
            out[m] = statistics.median(fetch_payload(f"127.0.0.1:{srv.port}", ids[0].tolist())[1]["wire_ms"]
                                       for _ in range(3))
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
                   tick: Callable[[str], None]) -> list[dict[str, Any]]:
    """Key rank vs value rank: the codec truncated to half its key or value rank (REUSE at every layer)."""
    rk, rv = codec.config.rank_k, codec.config.rank_v
    out = []
    for k, v in dict.fromkeys([(rk, rv), (max(1, rk // 2), rv), (rk, max(1, rv // 2)), (max(1, rk // 2), max(1, rv // 2))]):
        s, bpt = _task_pass(producer, consumer, tokenizer, codec.truncated(k, v), (), cfg)
        out.append({"rank_k": k, "rank_v": v, "score": round(s, 4), "payload_bytes_per_token": round(bpt, 2)})
        tick("ablation")
    return out


def _patch_ablation(producer: Any, consumer: Any, tokenizer: Any, codec: Codec, cfg: BenchConfig,
                    tick: Callable[[str], None]) -> list[dict[str, Any]]:
    """Score, perplexity and payload size for PATCH budgets k = 0..L (layers by calibrated patch gain)."""
    gain = codec.info.get("patch_gain") or [0.0] * codec.geometry.n_layers
    out = []
    for k in range(codec.geometry.n_layers + 1):
        layers = select_patch_layers(gain, k)
        s, bpt = _task_pass(producer, consumer, tokenizer, codec, layers, cfg)
        enc = lambda ids, lay=layers: codec.encode(producer, ids, patch=lay, check=False)  # noqa: E731
        dec = lambda pl, ids: codec.decode(consumer, pl, ids, check=False)  # noqa: E731
        ppl = _perplexities(consumer, tokenizer, {"scd": (enc, dec)}, cfg, tick, only=("scd",))["scd"]
        out.append({"k": k, "layers": layers, "score": round(s, 4), "ppl": round(ppl, 4),
                    "payload_bytes_per_token": round(bpt, 2)})
        tick("ablation")
    return out
