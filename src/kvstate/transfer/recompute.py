"""Selective recompute inside an SCD payload: the consumer recomputes one chosen layer exactly with its own
weights and takes transferred codes for the rest — one payload, one codec.

Extends *Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching*
(``docs/techniques.md#across-models``) with the recompute of *DroidSpeak: KV Cache Sharing for
Cross-LLM Communication and Multi-LLM Serving*, at a fraction of its cost. What recomputing layer ``l`` for
the context needs is the consumer's residual stream *entering* ``l``; DroidSpeak gets it by recomputing
every layer below (or ships the producer's stream unmapped). Here:

- ``l = 0``: the stream is the consumer's own token embedding — nothing is shipped for it.
- ``l > 0``: the producer ships a rank-``r`` principal code of *its* residual stream entering ``l``
  (int8 / int4 / fp16 on the wire); the consumer maps (code, its own embedding of the token) into its own
  stream with a learned nonlinear map (:mod:`kvstate.transfer.nonlinear`; the token's embedding is free on
  the consumer and carries most of what a linear map of the producer's stream misses).
- The consumer runs layer ``l`` (attention over the context and MLP) on that stream: its K/V at ``l`` and,
  by projection of ``l``'s output alone (no attention), at ``l + 1`` are what its own prefill would give
  for that stream — exact when the stream is.
- Layer 0's K/V are always the projection of the consumer's own embeddings (exact, no attention).
- Every other layer takes the SCD codec's REUSE code of the producer's K/V, decoded by the codec's linear
  map (mode ``R``) or by learned nonlinear maps (mode ``M``).

The recompute layer is chosen offline by DroidSpeak's criterion: the consumer's next-token KL divergence on
held-out calibration prompts (the median over prompts), per candidate layer (:func:`calibrate_recompute`). Per-layer modes: ``E``
(projected from embeddings), ``C`` (recomputed), ``J`` (projected from the recomputed layer's output),
``R`` / ``M`` (REUSE code, linear / nonlinear decoder). The codec's ``pair`` hashes the SCD codec's pair,
the recompute layer, ranks and every weight; a payload for another pair, one without the boundary code the
codec recomputes from, or a codec whose layer is outside the consumer's range is refused with one error
naming it. Ignored: recomputing more than one layer, pipelining the recompute with the payload's transfer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from kvstate.models.fingerprint import model_fingerprint
from kvstate.models.rotary import rotary_tables
from kvstate.transfer.codec import KV_LIMIT, Codec, CodecError
from kvstate.transfer.nonlinear import (
    MAP_PARTS,
    Frozen,
    KVMaps,
    MapConfig,
    apply_map,
    fit_map,
    kl_div,
    kl_tune,
    reuse_code,
    suffix_logits,
)
from kvstate.transfer.payload import Payload, PayloadError, ids_hash
from kvstate.transfer.quant import quantize_codes
from kvstate.transfer.states import build_cache, capture_inputs, geometry, project_kv
from kvstate.validate import check_int, check_token_ids

METHOD = "scd_recompute"
RECOMPUTE_VERSION = 1
EMBED, RECOMPUTE, PROJECT, REUSE, MAPPED = "E", "C", "J", "R", "M"


@dataclass(frozen=True)
class RecomputeConfig:
    layer: int  # the consumer layer recomputed exactly
    rank: int = 128  # channels of the boundary code (the producer's residual stream entering `layer`)
    bits: int = 8  # boundary and REUSE code precision on the wire: 4 / 8 / 16 / 32
    map: MapConfig = field(default_factory=MapConfig)  # the boundary map (code, embedding) -> consumer stream

    def __post_init__(self) -> None:
        check_int("RecomputeConfig.layer", self.layer, 0, 1 << 16, error=CodecError)
        check_int("RecomputeConfig.rank", self.rank, 1, 1 << 20, error=CodecError)
        if isinstance(self.bits, bool) or self.bits not in (4, 8, 16, 32):
            raise CodecError(f"RecomputeConfig.bits={self.bits!r} must be 4, 8, 16 or 32")

    def check(self, n_layers: int, hidden: int) -> None:
        if not self.layer < n_layers:
            raise CodecError(f"recompute layer {self.layer} is outside the consumer's layers 0..{n_layers - 1}; "
                             f"pick one in that range")
        if self.rank > hidden:
            raise CodecError(f"RecomputeConfig.rank={self.rank} exceeds the hidden size {hidden}")


def consumer_embed(model: Any, token_ids: torch.Tensor) -> torch.Tensor:
    """The consumer's input embeddings (T, hidden) of ``token_ids`` (1, T)."""
    return torch.as_tensor(model.model.embed_tokens(token_ids))[0]


def project_stream(model: Any, layer: int, resid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (pre-rotary) and values (T, H, D) of ``layer`` from the residual stream (T, hidden) entering it:
    the layer's ``input_layernorm`` then its own projections."""
    ln = model.model.layers[layer].input_layernorm
    return project_kv(model, layer, ln(resid.to(ln.weight.dtype)))


def recompute_layer(model: Any, layer: int, resid: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Run ``model``'s decoder layer ``layer`` over the residual stream (T, hidden) entering it (causal, positions
    0..T-1); returns the keys and values (T, H, D) of ``layer`` and, projected from its output, of ``layer + 1``
    (when there is one). With the consumer's true stream these are its own prefill's K/V."""
    g = geometry(model)
    t = resid.shape[0]
    cos, sin = rotary_tables(model, torch.arange(t))
    dtype = next(model.parameters()).dtype
    out = model.model.layers[layer](resid.to(dtype)[None], attention_mask=None, position_ids=torch.arange(t)[None],
                                    position_embeddings=(cos, sin))
    out = out[0] if isinstance(out, tuple) else out
    k, v = project_stream(model, layer, resid)
    keys, values = [k], [v]
    if layer + 1 < g.n_layers:
        k1, v1 = project_stream(model, layer + 1, out[0])
        keys.append(k1)
        values.append(v1)
    return keys, values


@dataclass
class RecomputeCodec:
    """An SCD codec plus the recompute of one layer (see the module docstring)."""

    config: RecomputeConfig
    scd: Codec  # the REUSE maps of every transferred layer
    tensors: dict[str, torch.Tensor]  # boundary code and map: b.enc (hidden, r), b.mu (hidden,), b.<map part>
    maps: KVMaps | None = None  # nonlinear decoders of the transferred layers (mode M), else the linear ones
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        g = self.scd.geometry
        self.config.check(g.n_layers, g.hidden_size)
        want = {"b.enc", "b.mu", *(f"b.{p}" for p in MAP_PARTS)} if self.config.layer > 0 else set()
        if set(self.tensors) != want:
            raise CodecError(f"recompute codec for layer {self.config.layer} holds tensors {sorted(self.tensors)}, "
                             f"expected {sorted(want)}; recalibrate it")
        if self.maps is not None:
            self.maps.check(self.scd.producer_fp, self.scd.consumer_fp, self.scd.pair.hex())
        h = hashlib.sha256(self.scd.pair)
        h.update(json.dumps({"method": METHOD, **asdict(self.config)}, sort_keys=True).encode())
        for name, t in sorted(self.tensors.items()):
            h.update(name.encode())
            h.update(t.detach().float().contiguous().numpy().tobytes())
        if self.maps is not None:
            h.update(json.dumps(self.maps.identity(), sort_keys=True).encode())
            for name, t in sorted(self.maps.tensors.items()):
                h.update(name.encode())
                h.update(t.detach().float().contiguous().numpy().tobytes())
        self.pair = h.digest()

    @property
    def modes(self) -> str:
        n, lay = self.scd.geometry.n_layers, self.config.layer
        mapped = set(self.maps.layers) if self.maps is not None else set()

        def mode(i: int) -> str:
            if i == lay:
                return RECOMPUTE
            if i == lay + 1:
                return PROJECT
            if i == 0:
                return EMBED
            return MAPPED if i in mapped else REUSE
        return "".join(mode(i) for i in range(n))

    @property
    def recomputed_layers(self) -> int:
        return 1

    # --- encode -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def encode(self, producer: Any, input_ids: torch.Tensor, check: bool = True) -> Payload:
        """Prefill ``input_ids`` (1, T) on the producer; ship the boundary code and the REUSE codes."""
        if check:
            self.scd.check_models(producer=producer)
        limit = getattr(producer.config, "max_position_embeddings", None)
        check_token_ids("RecomputeCodec.encode input_ids", input_ids, int(producer.config.vocab_size),
                        max_len=limit if isinstance(limit, int) else None, error=CodecError)
        t, bits, modes = input_ids.shape[1], self.config.bits, self.modes
        with capture_inputs(producer, "attn") as h_in, capture_inputs(producer, "layer") as resid:
            producer(input_ids=input_ids, position_ids=torch.arange(t)[None], use_cache=False)
        out: dict[str, torch.Tensor] = {}
        for i, mode in enumerate(modes):
            if mode in (REUSE, MAPPED):
                k, v = project_kv(producer, i, h_in[i][0].float())
                rk = self.scd.config.rank_k
                code = reuse_code(self.scd, i, k.float(), v.float())
                h = self.scd.geometry.n_kv_heads
                for name, z in (("k", code[:, : h * rk]), ("v", code[:, h * rk:])):
                    out.update({f"{name}.{i}.{p}": q for p, q in quantize_codes(z.contiguous(), bits).items()})
        if self.config.layer > 0:
            z = (resid[self.config.layer][0].float() - self.tensors["b.mu"]) @ self.tensors["b.enc"]
            out.update({f"b.{self.config.layer}.{p}": q for p, q in quantize_codes(z, bits).items()})
        if not out:  # every layer comes from the consumer itself (layer 0 recomputed on a two-layer model)
            out["empty"] = torch.zeros(1, dtype=torch.uint8)
        meta = {"method": METHOD, "modes": modes, "bits": str(bits), "recompute": str(self.config.layer)}
        return Payload(self.pair, t, ids_hash(input_ids[0].tolist()), out, meta)

    # --- decode -----------------------------------------------------------------------------------
    def check_payload(self, payload: Payload, token_ids: Sequence[int]) -> None:
        """Raise :class:`PayloadError` unless ``payload`` is this codec's, for ``token_ids``, and holds every
        code the codec decodes from (the boundary code of the recompute layer included)."""
        if not isinstance(payload, Payload):
            raise PayloadError(f"decode: expected a Payload, got {type(payload).__name__}")
        meta = payload.meta
        if meta.get("method") != METHOD or meta.get("modes") != self.modes or meta.get("recompute") != str(
                self.config.layer) or meta.get("bits") != str(self.config.bits):
            raise PayloadError(f"payload metadata {meta} does not match this recompute codec (method {METHOD}, "
                               f"modes {self.modes}, recompute layer {self.config.layer}, bits {self.config.bits})")
        payload.check(self.pair, token_ids)
        lay = self.config.layer
        if lay > 0 and f"b.{lay}.q" not in payload.tensors:
            raise PayloadError(f"payload lacks the boundary code 'b.{lay}.q' (the producer's residual stream entering "
                               f"layer {lay}) that this codec recomputes layer {lay} from; re-encode it with this codec")

    def _codes(self, payload: Payload, prefix: str, t: int, channels: int) -> torch.Tensor:
        return Codec._codes(payload, prefix, t, channels, self.config.bits)

    def transferred(self, payload: Payload, emb: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """K/V (T, H, D) of the payload's REUSE / mapped layers."""
        g, t, w = self.scd.geometry, payload.n_tokens, self.scd.tensors
        rk, rv = self.scd.config.rank_k, self.scd.config.rank_v
        out = {}
        for i, mode in enumerate(self.modes):
            if mode not in (REUSE, MAPPED):
                continue
            zk = self._codes(payload, f"k.{i}", t, g.n_kv_heads * rk)
            zv = self._codes(payload, f"v.{i}", t, g.n_kv_heads * rv)
            if mode == MAPPED and self.maps is not None:
                out[i] = self.maps.apply(i, torch.cat([zk, zv], 1), emb)
                continue
            kv = []
            for name, z, r in (("k", zk, rk), ("v", zv, rv)):
                z3 = z.view(t, g.n_kv_heads, r)
                kv.append(torch.einsum("thr,hrd->thd", z3, w[f"{name}.{i}.dec"]) + w[f"{name}.{i}.mu_out"])
            out[i] = (kv[0], kv[1])
        return out

    def boundary(self, payload: Payload, emb: torch.Tensor, params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The consumer's residual stream (T, hidden) entering the recompute layer."""
        lay = self.config.layer
        if lay == 0:
            return emb
        z = self._codes(payload, f"b.{lay}", payload.n_tokens, self.config.rank)
        t = params or {p: self.tensors[f"b.{p}"] for p in MAP_PARTS}
        return apply_map(t, torch.cat([z, emb.float()], 1))

    def assemble(self, consumer: Any, payload: Payload, token_ids: torch.Tensor,
                 params: dict[str, torch.Tensor] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer consumer keys (pre-rotary) and values, differentiable in ``params`` (the boundary map);
        no checks (see :meth:`decode_layers`)."""
        n, lay = self.scd.geometry.n_layers, self.config.layer
        emb = consumer_embed(consumer, token_ids[:, : payload.n_tokens]).float()
        kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = self.transferred(payload, emb)
        ks, vs = recompute_layer(consumer, lay, self.boundary(payload, emb, params))
        for j, (k, v) in enumerate(zip(ks, vs, strict=True)):
            kv[lay + j] = (k, v)
        if 0 not in kv:
            kv[0] = project_stream(consumer, 0, emb)
        return [kv[i][0] for i in range(n)], [kv[i][1] for i in range(n)]

    @torch.inference_mode()
    def decode_layers(self, consumer: Any, payload: Payload, token_ids: Sequence[int],
                      check: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer consumer keys (pre-rotary) and values (T, H, D); needs the prompt's ``token_ids`` (the
        consumer embeds them itself)."""
        if check:
            self.scd.check_models(consumer=consumer)
        if token_ids is None:
            raise PayloadError("RecomputeCodec.decode needs the prompt's token ids (the consumer embeds them)")
        self.check_payload(payload, token_ids)
        limit = getattr(consumer.config, "max_position_embeddings", None)
        if isinstance(limit, int) and payload.n_tokens > limit:
            raise PayloadError(f"payload of {payload.n_tokens:,} tokens exceeds the consumer's "
                               f"max_position_embeddings={limit:,}")
        ids = torch.as_tensor(list(token_ids)[: payload.n_tokens], dtype=torch.long)[None]
        keys, values = self.assemble(consumer, payload, ids)
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            for name, x in (("keys", k), ("values", v)):
                if not bool(torch.isfinite(x).all()) or float(x.abs().max()) > KV_LIMIT:
                    raise PayloadError(f"payload decodes to unusable {name} at layer {i} (non-finite or beyond "
                                       f"±{KV_LIMIT:g}); request the payload again")
        return keys, values

    def decode(self, consumer: Any, payload: Payload, token_ids: Sequence[int], check: bool = True) -> DynamicCache:
        return build_cache(consumer, *self.decode_layers(consumer, payload, token_ids, check))


    # --- files ------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """One safetensors file: the boundary tensors, the nonlinear maps' (``maps.*``) and the identity (the
        SCD codec's pair, the config, the maps' identity) in its metadata; ships next to the SCD codec."""
        from kvstate.transfer.nonlinear import write_artifact

        meta = {"version": RECOMPUTE_VERSION, "scd_pair": self.scd.pair.hex(), "config": asdict(self.config),
                "maps": None if self.maps is None else self.maps.identity(), "info": self.info, "pair": self.pair.hex()}
        tensors = {**self.tensors, **({f"maps.{k}": v for k, v in self.maps.tensors.items()} if self.maps else {})}
        return write_artifact(path, tensors or {"none": torch.zeros(1)}, meta)

    @classmethod
    def load(cls, path: str | Path, scd: Codec) -> RecomputeCodec:
        """The codec saved at ``path``; :class:`CodecError` if it was calibrated on another SCD codec (another
        pair) or its content does not match its recorded identity."""
        from kvstate.transfer.nonlinear import MapError, read_artifact

        fix = "recalibrate it with kvstate.transfer.recompute.calibrate_recompute"
        try:
            meta, tensors = read_artifact(path, "recompute-codec", fix)
        except MapError as exc:
            raise CodecError(str(exc)) from None
        try:
            if meta["version"] != RECOMPUTE_VERSION:
                raise CodecError(f"recompute codec {str(path)!r} has version {meta['version']}; this kvstate reads "
                                 f"{RECOMPUTE_VERSION}; {fix}")
            if meta["scd_pair"] != scd.pair.hex():
                raise CodecError(f"recompute codec {str(path)!r} was calibrated for another SCD codec / model pair "
                                 f"({meta['scd_pair'][:12]}…, this codec is {scd.pair.hex()[:12]}…); {fix}")
            c = meta["config"]
            cfg = RecomputeConfig(c["layer"], c["rank"], c["bits"], MapConfig(**c["map"]))
            maps = None
            if meta["maps"] is not None:
                m = meta["maps"]
                maps = KVMaps(m["producer_fp"], m["consumer_fp"], m["codec_pair"], m["n_kv_heads"], m["head_dim"],
                              m["hidden_size"], tuple(m["layers"]),
                              {k[5:]: v for k, v in tensors.items() if k.startswith("maps.")}, MapConfig(**m["config"]))
            own = {k: v for k, v in tensors.items() if k.startswith("b.")}
            codec = cls(cfg, scd, own, maps, meta.get("info") or {})
        except (KeyError, TypeError) as exc:
            raise CodecError(f"{str(path)!r} is not a kvstate recompute-codec file ({exc!r}); {fix}") from None
        if codec.pair.hex() != meta.get("pair"):
            raise CodecError(f"recompute codec {str(path)!r}: its tensors do not match its recorded identity; {fix}")
        return codec


def _pca(x: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean (hidden,), encoder (hidden, rank)) of the top-``rank`` principal directions of ``x`` (N, hidden)."""
    mu = x.mean(0)
    _, _, vh = torch.linalg.svd((x - mu).double(), full_matrices=False)
    return mu, vh[:rank].T.float().contiguous()


def calibrate_recompute(producer: Any, consumer: Any, scd: Codec, prompts: Sequence[torch.Tensor], rank: int = 128,
                        bits: int = 8, map_cfg: MapConfig | None = None, layers: Sequence[int] | None = None,
                        maps: KVMaps | None = None, suffix: int = 16,
                        progress: Callable[[str], None] | None = None) -> RecomputeCodec:
    """Fit the boundary map of every candidate layer in ``layers`` (default: all) on the first three quarters of
    ``prompts`` and keep the layer whose codec gives the lowest consumer next-token KL on the last ``suffix``
    tokens of the held-out quarter (DroidSpeak's criterion, taken as the median over prompts rather than the
    mean: on the pair's dev data two held-out prompts of multi-value tasks, KL 3-5 under every candidate, decided
    the mean against the layer best on the other ten); ``info`` records every candidate's median and mean."""
    map_cfg = map_cfg or MapConfig()
    scd.check_models(producer, consumer)
    g = scd.geometry
    cands = list(range(g.n_layers)) if layers is None else list(layers)
    for lay in cands:
        RecomputeConfig(lay, min(rank, g.hidden_size), bits, map_cfg).check(g.n_layers, g.hidden_size)
    RecomputeConfig(0, rank, bits).check(g.n_layers, g.hidden_size)
    if len(prompts) < 2 or any(ids.shape[1] <= suffix + 1 for ids in prompts):
        raise CodecError(f"calibrate_recompute: pass at least 2 prompts (a quarter, at least one, is held out), each "
                         f"longer than suffix + 1 = {suffix + 1} tokens")
    tick = progress or (lambda _s: None)
    n_hold = max(1, len(prompts) // 4)
    fit, hold = prompts[:-n_hold], prompts[-n_hold:]
    rp: dict[int, list[torch.Tensor]] = {i: [] for i in cands}
    rc: dict[int, list[torch.Tensor]] = {i: [] for i in cands}
    embs: list[torch.Tensor] = []
    with torch.inference_mode():
        for ids in fit:
            t = ids.shape[1]
            with capture_inputs(producer, "layer") as gp:
                producer(input_ids=ids, position_ids=torch.arange(t)[None], use_cache=False)
            with capture_inputs(consumer, "layer") as gc:
                consumer(input_ids=ids, position_ids=torch.arange(t)[None], use_cache=False)
            for i in cands:
                rp[i].append(gp[i][0].float())
                rc[i].append(gc[i][0].float())
            embs.append(consumer_embed(consumer, ids).float())
    emb = torch.cat(embs)
    rank = min(rank, g.hidden_size, emb.shape[0])  # no more principal directions than the data has
    kl: dict[int, float] = {}  # the median over held-out prompts: a few prompts no layer can fix (tasks the
    mean: dict[int, float] = {}  # consumer itself barely solves) would otherwise decide the mean
    codecs: dict[int, RecomputeCodec] = {}
    for lay in cands:
        cfg = RecomputeConfig(lay, rank, bits, map_cfg)
        tensors: dict[str, torch.Tensor] = {}
        if lay > 0:
            x = torch.cat(rp[lay])
            mu, enc = _pca(x, rank)
            z = (x - mu) @ enc
            fitted = fit_map(torch.cat([z, emb], 1), torch.cat(rc[lay]), map_cfg)
            tensors = {"b.enc": enc, "b.mu": mu, **{f"b.{k}": v for k, v in fitted.items()}}
        codec = RecomputeCodec(cfg, scd, tensors, maps)
        if lay > 0 and map_cfg.kl_steps:
            codec = _kl_tune_boundary(codec, producer, consumer, fit, suffix, tick)
        codecs[lay] = codec
        per = held_out_kl(codec, producer, consumer, hold, suffix)
        kl[lay], mean[lay] = float(np.median(per)), float(np.mean(per))
        tick(f"recompute layer {lay}: held-out KL median {kl[lay]:.4f}, mean {mean[lay]:.4f}")
    best = min(cands, key=lambda i: (kl[i], i))
    chosen = codecs[best]
    chosen.info = {"kl_by_layer": {str(k): round(v, 6) for k, v in kl.items()},
                   "kl_mean_by_layer": {str(k): round(v, 6) for k, v in mean.items()}, "chosen": best,
                   "fit_prompts": len(fit), "holdout_prompts": len(hold), "suffix": suffix,
                   "map": asdict(map_cfg), "rank": rank, "bits": bits,
                   "producer_fp": model_fingerprint(producer), "consumer_fp": model_fingerprint(consumer)}
    return chosen


@torch.inference_mode()
def held_out_kl(codec: RecomputeCodec, producer: Any, consumer: Any, prompts: Sequence[torch.Tensor],
                suffix: int) -> list[float]:
    """Per prompt, the consumer's mean next-token KL (its own prefill against the codec's cache) on the last
    ``suffix`` tokens."""
    out = []
    for ids in prompts:
        cut = ids.shape[1] - suffix
        ref = torch.as_tensor(consumer(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None],
                                       use_cache=False).logits[0, cut:]).float()
        keys, values = codec.decode_layers(consumer, codec.encode(producer, ids[:, :cut], check=False), ids[0].tolist(),
                                           check=False)
        out.append(float(kl_div(ref, suffix_logits(consumer, keys, values, ids, cut))))
    return out


def _kl_tune_boundary(codec: RecomputeCodec, producer: Any, consumer: Any, prompts: Sequence[torch.Tensor],
                      suffix: int, tick: Callable[[str], None]) -> RecomputeCodec:
    """Fine-tune the boundary map on the consumer's next-token KL through the recomputed layer (both models
    frozen); returns the codec with the tuned map."""
    cfg = codec.config.map
    data = []
    with torch.inference_mode():
        for ids in prompts:
            cut = ids.shape[1] - suffix
            ref = torch.as_tensor(consumer(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None],
                                           use_cache=False).logits[0, cut:]).float().clone()
            data.append((ids, cut, codec.encode(producer, ids[:, :cut], check=False), ref))
    params = {p: codec.tensors[f"b.{p}"].clone() for p in MAP_PARTS}
    gen = torch.Generator().manual_seed(cfg.seed)

    def loss(_step: int) -> torch.Tensor:
        ids, cut, payload, ref = data[int(torch.randint(0, len(data), (1,), generator=gen))]
        keys, values = codec.assemble(consumer, payload, ids, params)
        return kl_div(ref, suffix_logits(consumer, keys, values, ids, cut))

    with Frozen(consumer):
        kl_tune([params[p] for p in ("w1", "b1", "w2", "b2", "w_lin")], loss, cfg.kl_steps, cfg.kl_lr,
                lambda s: tick(s) if s.endswith("0") else None)
    tensors = {**codec.tensors, **{f"b.{p}": v.detach().clone() for p, v in params.items()}}
    return RecomputeCodec(codec.config, codec.scd, tensors, codec.maps)


__all__ = ["METHOD", "RecomputeCodec", "RecomputeConfig", "calibrate_recompute", "consumer_embed", "held_out_kl",
           "project_stream", "recompute_layer", "suffix_logits"]
