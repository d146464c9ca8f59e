"""The SCD codec: per-layer REUSE maps and PATCH aligners between one producer and one consumer.

*Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching*
(``docs/techniques.md#across-models``). ``Codec.encode(producer, ids)`` prefills on the producer and
turns every layer into a compact code: REUSE layers send low-rank codes of their keys (pre-rotary)
and values, per KV head; PATCH layers send a low-rank code of the normalised pre-attention input
``H_in``. ``Codec.decode(consumer, payload)`` rebuilds the consumer's cache: REUSE codes go through
the layer's linear decoders into the consumer's K/V space (calibrated as a joint decomposition:
the producer's principal code, a scaled orthogonal decoder per KV head); PATCH codes go through a small MLP aligner
into the consumer's ``H_in`` and the consumer regenerates K/V with its own ``k_proj`` / ``k_norm`` /
``v_proj`` and rotary positions. The consumer then decodes normally (``model.generate`` continues the
returned ``DynamicCache``). Codes travel as int8 / int4 with per-channel scales (or fp16 / fp32).

A codec holds REUSE maps and aligners for every layer, so the producer may patch any subset
(``patch=`` of :meth:`Codec.encode`; the payload says which): the calibrated ``patch_layers`` are the
default. Saved as ``codec.safetensors`` + a checksum ``manifest.json`` (:mod:`kvstate.integrity`, kind
``"codec"``, carrying both models' fingerprints, the ranks and the geometry); loading verifies the
checksums. The codec's identity (``pair``, which every payload carries) hashes that manifest's content:
the fingerprints, config, geometry and the SHA-256 of the weights file. Every tensor is checked against
the config and geometry when a codec is built or loaded (names, shapes, float32, finite:
:func:`check_tensors`), token ids against the model at :meth:`Codec.encode`, and decoded K/V are checked
finite (and within the fp16 range no model's K/V leaves) before they reach the consumer. Ignored:
per-request rank adaptation.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save

from kvstate.errors import IntegrityError, KVStateError
from kvstate.integrity import accepts_kind, check_safetensors_header, read_manifest, write_manifest
from kvstate.io_safety import check_output_dir, staged_dir
from kvstate.models.fingerprint import model_fingerprint
from kvstate.transfer.payload import Payload, PayloadError, ids_hash
from kvstate.transfer.quant import dequantize_codes, quantize_codes
from kvstate.transfer.states import (
    Geometry,
    build_cache,
    capture_inputs,
    geometry,
    project_kv,
)
from kvstate.validate import check_int, check_token_ids

CODEC_VERSION = 2  # 2: the kvstate manifest schema with checksums; the pair hashes the manifest's content
MANIFEST, WEIGHTS = "manifest.json", "codec.safetensors"
RECALIBRATE = "recalibrate with `kvstate transfer calibrate`"
REUSE, PATCH = "R", "P"
KV_LIMIT = 65504.0  # the fp16 maximum: decoded keys / values beyond it come from a damaged payload or codec


class CodecError(KVStateError):
    """A codec that does not fit: wrong model pair, bad ranks or layers, unreadable files."""


@dataclass(frozen=True)
class CodecConfig:
    """Ranks, code precision and the default PATCH layers of a codec."""

    rank_k: int  # code channels per KV head for keys (<= head_dim)
    rank_v: int  # ... for values (<= head_dim)
    rank_h: int  # code channels of H_in at PATCH layers (<= hidden_size)
    patch_layers: tuple[int, ...] = ()  # default PATCH layers (ascending)
    bits: int = 8  # code precision on the wire: 8 / 4 (per-channel scales) or 16 / 32 (float)

    def __post_init__(self) -> None:
        for name in ("rank_k", "rank_v", "rank_h"):
            check_int(f"CodecConfig.{name}", getattr(self, name), 1, 1 << 20, error=CodecError)
        if isinstance(self.bits, bool) or self.bits not in (4, 8, 16, 32):
            raise CodecError(f"CodecConfig.bits={self.bits!r} must be 4, 8, 16 or 32")
        for i in self.patch_layers:
            check_int("CodecConfig.patch_layers[]", i, 0, 1 << 16, error=CodecError)
        if list(self.patch_layers) != sorted(set(self.patch_layers)):
            raise CodecError(f"CodecConfig.patch_layers={self.patch_layers} must be ascending without repeats")

    def check(self, g: Geometry) -> None:
        """Raise :class:`CodecError` if ranks or layers do not fit the model geometry ``g``."""
        if self.rank_k > g.head_dim or self.rank_v > g.head_dim:
            raise CodecError(f"rank_k={self.rank_k} / rank_v={self.rank_v} exceed the head dimension {g.head_dim}; "
                             f"pass ranks in [1, {g.head_dim}]")
        if self.rank_h > g.hidden_size:
            raise CodecError(f"rank_h={self.rank_h} exceeds the hidden size {g.hidden_size}")
        bad = [i for i in self.patch_layers if not 0 <= i < g.n_layers]
        if bad:
            raise CodecError(f"patch layers {bad} out of range: the model has layers 0..{g.n_layers - 1}")


def expected_shapes(cfg: CodecConfig, g: Geometry, aligner_hidden: int) -> dict[str, tuple[int, ...]]:
    """Every tensor a codec holds and its shape (REUSE maps and PATCH aligners for every layer)."""
    h, d, hid = g.n_kv_heads, g.head_dim, g.hidden_size
    out: dict[str, tuple[int, ...]] = {}
    for i in range(g.n_layers):
        for name, r in (("k", cfg.rank_k), ("v", cfg.rank_v)):
            out.update({f"{name}.{i}.enc": (h, d, r), f"{name}.{i}.dec": (h, r, d), f"{name}.{i}.mu_in": (h, d),
                        f"{name}.{i}.mu_out": (h, d)})
        a = aligner_hidden
        out.update({f"h.{i}.enc": (hid, cfg.rank_h), f"h.{i}.dec": (cfg.rank_h, hid), f"h.{i}.mu_in": (hid,),
                    f"h.{i}.mu_out": (hid,), f"h.{i}.z_std": (cfg.rank_h,), f"h.{i}.w1": (a, cfg.rank_h),
                    f"h.{i}.b1": (a,), f"h.{i}.w2": (hid, a), f"h.{i}.b2": (hid,), f"h.{i}.val_mse": (2,)})
    return out


def check_tensors(tensors: dict[str, torch.Tensor], cfg: CodecConfig, g: Geometry, where: str = "codec") -> None:
    """Raise :class:`CodecError` unless ``tensors`` are exactly the codec's: every name, its shape, float32,
    finite (one clear error instead of a failure per request later)."""
    w1 = tensors.get("h.0.w1")
    want = expected_shapes(cfg, g, int(w1.shape[0]) if isinstance(w1, torch.Tensor) and w1.dim() == 2 else 0)
    missing, extra = sorted(want.keys() - tensors.keys()), sorted(tensors.keys() - want.keys())
    if missing or extra:
        what = (f"lacks {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}" if missing else
                f"holds unexpected {', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''}")
        raise CodecError(f"{where} {what} (a codec for {g.n_layers} layers with ranks {cfg.rank_k}/{cfg.rank_v}/"
                         f"{cfg.rank_h}); {RECALIBRATE}")
    for name, shape in want.items():
        t = tensors[name]
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != shape:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise CodecError(f"{where}: tensor {name!r} is {got}, expected {shape} torch.float32; {RECALIBRATE}")
        if not bool(torch.isfinite(t).all()):
            raise CodecError(f"{where}: tensor {name!r} holds NaN or inf; {RECALIBRATE}")


def _aligner(t: dict[str, torch.Tensor], layer: int, z: torch.Tensor) -> torch.Tensor:
    """Consumer H_in (T, hidden) from a PATCH code z (T, rank_h): linear decoder + MLP residual."""
    p = f"h.{layer}."
    lin = z @ t[p + "dec"] + t[p + "mu_out"]
    zn = z / t[p + "z_std"]
    hid = torch.nn.functional.gelu(zn @ t[p + "w1"].T + t[p + "b1"])
    return lin + hid @ t[p + "w2"].T + t[p + "b2"]


@dataclass
class Codec:
    config: CodecConfig
    geometry: Geometry
    producer_fp: str  # model_fingerprint of the producer it was calibrated on
    consumer_fp: str
    tensors: dict[str, torch.Tensor]  # k.{l}.enc (H, D, rk), k.{l}.dec (H, rk, D), k.{l}.mu_in/mu_out (H, D); v.*; h.*
    info: dict[str, Any] = field(default_factory=dict)  # calibration measurements (errors, impacts, data)

    def __post_init__(self) -> None:
        self.config.check(self.geometry)
        check_tensors(self.tensors, self.config, self.geometry)
        self._weights = save({k: v.detach().contiguous() for k, v in self.tensors.items()})  # codec.safetensors
        identity = json.dumps(self._identity(), sort_keys=True).encode()
        self.pair = hashlib.sha256(identity).digest()  # what a payload must carry to be decoded by this codec

    # --- identity -------------------------------------------------------------------------------
    def check_models(self, producer: Any | None = None, consumer: Any | None = None) -> None:
        for role, model, fp in (("producer", producer, self.producer_fp), ("consumer", consumer, self.consumer_fp)):
            if model is None:
                continue
            if geometry(model) != self.geometry or model_fingerprint(model) != fp:
                raise CodecError(f"this codec was calibrated for another {role} (fingerprint {fp[:12]}…), or the "
                                 f"{role}'s weights changed since calibration; calibrate one for this pair with "
                                 "`kvstate transfer calibrate`")

    def modes(self, patch: Sequence[int] | None) -> str:
        layers = self.config.patch_layers if patch is None else tuple(patch)
        CodecConfig(self.config.rank_k, self.config.rank_v, self.config.rank_h, tuple(sorted(set(layers))),
                    self.config.bits).check(self.geometry)
        return "".join(PATCH if i in layers else REUSE for i in range(self.geometry.n_layers))

    def truncated(self, rank_k: int, rank_v: int) -> Codec:
        """The codec with the first ``rank_k`` / ``rank_v`` REUSE code channels (the fits order channels by
        importance: for ``regress`` maps this is the lower-rank fit; for ``joint`` maps the same principal code
        decoded by the larger fit's orthogonal rows, not a refit); a new pair fingerprint."""
        if not (1 <= rank_k <= self.config.rank_k and 1 <= rank_v <= self.config.rank_v):
            raise CodecError(f"truncated: ranks ({rank_k}, {rank_v}) must be in [1, ({self.config.rank_k}, "
                             f"{self.config.rank_v})]")
        t = dict(self.tensors)
        for i in range(self.geometry.n_layers):
            for name, r in (("k", rank_k), ("v", rank_v)):
                t[f"{name}.{i}.enc"] = self.tensors[f"{name}.{i}.enc"][:, :, :r].contiguous()  # (H, D, r)
                t[f"{name}.{i}.dec"] = self.tensors[f"{name}.{i}.dec"][:, :r].contiguous()  # (H, r, D)
        c = self.config
        return Codec(CodecConfig(rank_k, rank_v, c.rank_h, c.patch_layers, c.bits), self.geometry, self.producer_fp,
                     self.consumer_fp, t, self.info)

    # --- encode / decode -----------------------------------------------------------------------
    @torch.inference_mode()
    def encode(self, producer: Any, input_ids: torch.Tensor, patch: Sequence[int] | None = None,
               bits: int | None = None, check: bool = True) -> Payload:
        """Prefill ``input_ids`` (1, T) on the producer and encode its state (``patch``: override the
        PATCH layers; ``bits``: the code precision)."""
        if check:
            self.check_models(producer=producer)
        limit = getattr(producer.config, "max_position_embeddings", None)
        check_token_ids("Codec.encode input_ids", input_ids, int(producer.config.vocab_size),
                        max_len=limit if isinstance(limit, int) else None, error=CodecError)
        modes, bits = self.modes(patch), self.config.bits if bits is None else bits
        t = input_ids.shape[1]
        with capture_inputs(producer, "attn") as got:
            producer(input_ids=input_ids, position_ids=torch.arange(t)[None], use_cache=False)
        out: dict[str, torch.Tensor] = {}
        w = self.tensors
        for i, mode in enumerate(modes):
            h = got[i][0].float()  # (T, hidden)
            if mode == PATCH:
                z = (h - w[f"h.{i}.mu_in"]) @ w[f"h.{i}.enc"]  # (T, rank_h)
                out.update({f"h.{i}.{part}": x for part, x in quantize_codes(z, bits).items()})
                continue
            keys, values = project_kv(producer, i, h)
            for name, x in (("k", keys.float()), ("v", values.float())):
                z = torch.einsum("thd,hdr->thr", x - w[f"{name}.{i}.mu_in"], w[f"{name}.{i}.enc"])  # (T, H, r)
                out.update({f"{name}.{i}.{part}": q for part, q in quantize_codes(z.reshape(t, -1), bits).items()})
        meta = {"method": "scd", "modes": modes, "bits": str(bits)}
        return Payload(self.pair, t, ids_hash(input_ids[0].tolist()), out, meta)

    def decode(self, consumer: Any, payload: Payload, token_ids: Sequence[int] | None = None,
               check: bool = True) -> Any:
        """The consumer's ``DynamicCache`` for the payload's tokens; raises :class:`PayloadError` on a
        payload for another pair / other tokens / of the wrong shape."""
        return build_cache(consumer, *self.decode_layers(consumer, payload, token_ids, check))

    @torch.inference_mode()
    def decode_layers(self, consumer: Any, payload: Payload, token_ids: Sequence[int] | None = None,
                      check: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer consumer keys (pre-rotary) and values (T, H_kv, D) decoded from ``payload``."""
        if check:
            self.check_models(consumer=consumer)
        if not isinstance(payload, Payload):
            raise PayloadError(f"decode: expected a Payload, got {type(payload).__name__}")
        payload.check(self.pair, token_ids)
        limit = getattr(consumer.config, "max_position_embeddings", None)
        if isinstance(limit, int) and payload.n_tokens > limit:
            raise PayloadError(f"payload of {payload.n_tokens:,} tokens exceeds the consumer's "
                               f"max_position_embeddings={limit:,}")
        g, t, w = self.geometry, payload.n_tokens, self.tensors
        modes, bits = payload.meta.get("modes", ""), payload.meta.get("bits", "")
        if payload.meta.get("method") != "scd" or len(modes) != g.n_layers or set(modes) - {REUSE, PATCH} \
                or bits not in ("4", "8", "16", "32"):
            raise PayloadError(f"payload metadata {payload.meta} is not an SCD payload for {g.n_layers} layers")
        b = int(bits)
        keys, values = [], []
        for i, mode in enumerate(modes):
            if mode == PATCH:
                z = self._codes(payload, f"h.{i}", t, self.config.rank_h, b)
                k, v = project_kv(consumer, i, _aligner(w, i, z))
            else:
                kv = []
                for name, r in (("k", self.config.rank_k), ("v", self.config.rank_v)):
                    z = self._codes(payload, f"{name}.{i}", t, g.n_kv_heads * r, b).view(t, g.n_kv_heads, r)
                    kv.append(torch.einsum("thr,hrd->thd", z, w[f"{name}.{i}.dec"]) + w[f"{name}.{i}.mu_out"])
                k, v = kv
            dtype = next(consumer.parameters()).dtype
            for name, x in (("keys", k), ("values", v)):
                y = x.to(dtype)  # what the consumer will hold
                if not bool(torch.isfinite(y).all()) or float(y.abs().max()) > KV_LIMIT:
                    raise PayloadError(f"payload decodes to unusable {name} at layer {i} (non-finite or beyond "
                                       f"±{KV_LIMIT:g}): its codes or scales are damaged; request the payload again, "
                                       "or check the producer's codec")
            keys.append(k)
            values.append(v)
        return keys, values

    @staticmethod
    def _codes(payload: Payload, prefix: str, t: int, channels: int, bits: int) -> torch.Tensor:
        shape = {32: (t, channels), 16: (t, channels), 8: (t, channels), 4: (t, (channels + 1) // 2)}[bits]
        dtype = {32: torch.float32, 16: torch.float16, 8: torch.int8, 4: torch.uint8}[bits]
        parts = {"q": payload.tensor(f"{prefix}.q", shape, dtype)}
        if bits in (4, 8):
            parts["scale"] = payload.tensor(f"{prefix}.scale", (channels,), torch.float32)
        z = dequantize_codes(parts, bits, channels)
        if not torch.isfinite(z).all():
            raise PayloadError(f"payload codes {prefix!r} hold non-finite values")
        return z

    def payload_bytes_per_token(self, n_tokens: int, patch: Sequence[int] | None = None) -> float:
        """Bytes on the wire per token of a payload of ``n_tokens`` (header and scales included)."""
        ids = torch.zeros(1, n_tokens, dtype=torch.long)
        return len(self._dummy_payload(ids, patch).to_bytes()) / n_tokens

    def _dummy_payload(self, ids: torch.Tensor, patch: Sequence[int] | None) -> Payload:
        g, t, b = self.geometry, ids.shape[1], self.config.bits
        out: dict[str, torch.Tensor] = {}
        for i, mode in enumerate(self.modes(patch)):
            chans = [("h", self.config.rank_h)] if mode == PATCH else [
                ("k", g.n_kv_heads * self.config.rank_k), ("v", g.n_kv_heads * self.config.rank_v)]
            for name, c in chans:
                out.update({f"{name}.{i}.{part}": q for part, q in quantize_codes(torch.zeros(t, c), b).items()})
        return Payload(self.pair, t, ids_hash(ids[0].tolist()), out, {"method": "scd", "modes": self.modes(patch),
                                                                      "bits": str(b)})

    # --- files ----------------------------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        """The manifest fields that make the codec what it is; ``pair`` is their hash."""
        c = self.config
        return {"format_version": CODEC_VERSION, "producer_fingerprint": self.producer_fp,
                "consumer_fingerprint": self.consumer_fp, "rank_k": c.rank_k, "rank_v": c.rank_v,
                "rank_h": c.rank_h, "patch_layers": list(c.patch_layers), "bits": c.bits,
                "geometry": self.geometry.as_json(), "weights_sha256": hashlib.sha256(self._weights).hexdigest()}

    def manifest(self) -> dict[str, Any]:
        """The metadata ``save`` writes into ``manifest.json`` next to the file checksums."""
        return {**self._identity(), "pair": self.pair.hex(), "calibration": self.info}

    def save(self, out_dir: str | Path) -> Path:
        """Write ``codec.safetensors`` + ``manifest.json`` into ``out_dir``, which appears whole (built aside,
        then swapped in); files already there (benchmarks, the card) are kept. A directory holding something
        else than a codec is refused with :class:`~kvstate.errors.OutputError`."""
        out = check_output_dir(out_dir, overwrite=True, accept=is_codec_dir, option="codec directory",
                               kind=f"a codec directory ({WEIGHTS} + {MANIFEST})")
        with staged_dir(out, keep=True) as tmp:
            (tmp / WEIGHTS).write_bytes(self._weights)
            write_manifest(tmp, kind="codec", files=[WEIGHTS], meta=self.manifest())
        return out

    @classmethod
    def load(cls, codec_dir: str | Path) -> Codec:
        """The codec saved in ``codec_dir``, after checking its files against their checksums
        (:class:`~kvstate.errors.IntegrityError` naming a damaged file) and its identity against its manifest."""
        d = Path(codec_dir)
        if not (d / MANIFEST).is_file() or not (d / WEIGHTS).is_file():
            raise CodecError(f"{str(d)!r} is not a codec directory (needs {MANIFEST} and {WEIGHTS}); "
                             "write one with `kvstate transfer calibrate`")
        m = read_manifest(d, kind="codec", covers=(WEIGHTS,), remedy=RECALIBRATE)
        try:
            version = m["format_version"]
            if version != CODEC_VERSION:
                raise CodecError(f"codec {str(d)!r} has format version {version}; this kvstate reads "
                                 f"{CODEC_VERSION} — {RECALIBRATE}")
            cfg = CodecConfig(m["rank_k"], m["rank_v"], m["rank_h"], tuple(m["patch_layers"]), m["bits"])
            g = Geometry(**m["geometry"])
            check_safetensors_header(d / WEIGHTS)
            try:
                tensors = load_file(d / WEIGHTS)
            except Exception as exc:  # safetensors' own error types: a file the checksum passed but that does not parse
                raise IntegrityError(f"{str(d / WEIGHTS)!r} is not readable safetensors ({exc}); {RECALIBRATE}") from None
            check_tensors(tensors, cfg, g, f"codec {str(d)!r}")
            codec = cls(cfg, g, m["producer_fingerprint"], m["consumer_fingerprint"], tensors,
                        m.get("calibration", {}))
        except (KeyError, TypeError) as exc:
            raise CodecError(f"codec manifest {str(d / MANIFEST)!r} is malformed ({exc!r}); {RECALIBRATE}") from None
        if m.get("weights_sha256") != m["files"][WEIGHTS].get("sha256"):
            raise CodecError(f"codec manifest {str(d / MANIFEST)!r} names weights {str(m.get('weights_sha256'))[:12]}… but "
                             f"checksums another {WEIGHTS}; {RECALIBRATE}")
        if codec.pair.hex() != m.get("pair"):
            raise CodecError(f"codec manifest {str(d / MANIFEST)!r} does not describe {WEIGHTS} (its pair "
                             f"{str(m.get('pair'))[:12]}… is not the hash of its content, {codec.pair.hex()[:12]}…); "
                             f"{RECALIBRATE}")
        return codec


def is_codec_dir(path: Path) -> bool:
    """An empty directory, or one holding a saved codec (``codec.safetensors`` and a codec ``manifest.json``)."""
    return path.is_dir() and accepts_kind("codec")(path)
