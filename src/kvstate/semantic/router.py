"""The learned parts of SEKV: routing projections, zoom thresholds and the rank-gate predictor.

From "SEKV: Resolution-Adaptive Semantic KV Cache with Hierarchical Semantic Memory": keys are projected
into a small routing space to build one summary per span; at decode the query is projected into the
same space and a sigmoid relevance gate ``sigmoid(alpha_l * cos(P_q q, summary) + beta_l)`` scores each
span; a learned per-layer, per-head threshold decides which spans to expand. The base model stays
frozen; only this module trains (``kvstate semantic train``). It saves as ``router.safetensors`` with a
checksum manifest (:mod:`kvstate.integrity`, kind ``"router"``) carrying the base model's fingerprint
(:func:`kvstate.models.model_fingerprint`) and the router's config; loading verifies the checksums and
refuses a router trained for another model, one whose tensors are missing, extra, mis-shaped, not
float32 or not finite. A loaded router remembers its base model's fingerprint, so a
:class:`~kvstate.semantic.cache.SemanticCache` refuses it on another model too (:meth:`SemanticRouter.check_model`).
"""

from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from kvstate.errors import IntegrityError, KVStateError
from kvstate.integrity import accepts_kind, check_safetensors_header, read_manifest, write_manifest
from kvstate.io_safety import check_output_dir, staged_dir
from kvstate.models.fingerprint import model_fingerprint
from kvstate.semantic.lowrank import RankGate
from kvstate.validate import check_int

WEIGHTS, MANIFEST = "router.safetensors", "manifest.json"
RETRAIN = "train the router again with `kvstate semantic train --model DIR --out DIR`"


class RouterMismatchError(KVStateError):
    """A router trained for another model (fingerprint or shape mismatch)."""


@dataclass(frozen=True)
class RouterConfig:
    n_layers: int  # decoder layers of the base model (all of them; non-attention layers are unused)
    n_heads: int  # query heads
    n_kv_heads: int
    head_dim: int
    routing_dim: int = 16  # width of the routing space

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_heads", "n_kv_heads", "head_dim"):
            check_int(f"RouterConfig.{name}", getattr(self, name), 1, 1 << 20)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"RouterConfig: n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        check_int("RouterConfig.routing_dim", self.routing_dim, 1, 1024)

    @classmethod
    def from_model_config(cls, config: Any, routing_dim: int = 16) -> RouterConfig:
        tc = config.get_text_config(decoder=True)
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        return cls(tc.num_hidden_layers, tc.num_attention_heads, tc.num_key_value_heads, head_dim, routing_dim)


def is_router_dir(path: Path) -> bool:
    """An empty directory, or one holding a saved router (``router.safetensors`` and a router ``manifest.json``)."""
    return path.is_dir() and accepts_kind("router")(path)


class SemanticRouter(nn.Module):
    def __init__(self, config: RouterConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        c = config
        g = torch.Generator().manual_seed(seed)
        # untrained: the same random projection for queries and keys, so routing cosine ~ key-space cosine
        base = torch.randn(c.n_layers, c.head_dim, c.routing_dim, generator=g) / c.head_dim**0.5
        self.q_proj = nn.Parameter(base.clone())  # (L, D, R)
        self.k_proj = nn.Parameter(base.clone())  # (L, D, R)
        self.alpha = nn.Parameter(torch.full((c.n_layers,), 8.0))  # relevance = sigmoid(alpha * cos + beta)
        self.beta = nn.Parameter(torch.full((c.n_layers,), -2.0))
        self.theta = nn.Parameter(torch.zeros(c.n_layers, c.n_heads))  # threshold = sigmoid(theta) per layer, head
        self.rank_gate = RankGate()
        self.fingerprint: str | None = None  # the base model's, when loaded from a saved router
        self._checked: weakref.WeakSet[Any] = weakref.WeakSet()  # models already found to match the fingerprint

    def check_model(self, model: Any) -> None:
        """Raise :class:`RouterMismatchError` unless this router fits ``model``: the shapes of its config, and
        (a loaded router) the fingerprint it was trained for — computed once per model object."""
        mine = RouterConfig.from_model_config(model.config, self.config.routing_dim)
        if mine != self.config:
            raise RouterMismatchError(f"this router has shape {self.config}, the model needs {mine}; train a router "
                                      "for this model with `kvstate semantic train`")
        if self.fingerprint is None or model in self._checked:
            return
        fp = model_fingerprint(model)
        if fp != self.fingerprint:
            raise RouterMismatchError(f"this router was trained for a model with fingerprint {self.fingerprint[:16]}…, "
                                      f"but this model's is {fp[:16]}…; train a router for this model with "
                                      "`kvstate semantic train`")
        self._checked.add(model)

    def route_keys(self, layer: int, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Span routing summary: normalised weighted mean of projected keys.

        keys (H, n, D), weights (n,) summing to 1 → (H, R).
        """
        proj = keys.float() @ self.k_proj[layer]  # (H, n, R)
        s = (weights.float()[None, :, None] * proj).sum(1)  # (H, R)
        return nn.functional.normalize(s, dim=-1)

    def relevance(self, layer: int, query: torch.Tensor, summaries: torch.Tensor) -> torch.Tensor:
        """Sigmoid relevance of each span per query head and token.

        query (Hq, Tq, D), summaries (Hkv, S, R) → (Hq, Tq, S).
        """
        group = self.config.n_heads // self.config.n_kv_heads
        q = nn.functional.normalize(query.float() @ self.q_proj[layer], dim=-1)  # (Hq, Tq, R)
        s = summaries.float().repeat_interleave(group, dim=0)  # (Hq, S, R)
        cos = q @ s.transpose(-1, -2)  # (Hq, Tq, S)
        return torch.sigmoid(self.alpha[layer] * cos + self.beta[layer])

    def zoom_logits(self, layer: int, query: torch.Tensor, summaries: torch.Tensor) -> torch.Tensor:
        """``alpha * cos + beta - theta_h``: positive exactly where relevance > threshold. (Hq, Tq, S)."""
        group = self.config.n_heads // self.config.n_kv_heads
        q = nn.functional.normalize(query.float() @ self.q_proj[layer], dim=-1)  # (Hq, Tq, R)
        s = summaries.float().repeat_interleave(group, dim=0)  # (Hq, S, R)
        cos = q @ s.transpose(-1, -2)  # (Hq, Tq, S)
        return self.alpha[layer] * cos + self.beta[layer] - self.theta[layer][:, None, None]

    def thresholds(self, layer: int) -> torch.Tensor:
        return torch.sigmoid(self.theta[layer])  # (Hq,)

    def n_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def save(self, out_dir: str | Path, fingerprint: str, extra: dict[str, Any] | None = None) -> None:
        """Write ``router.safetensors`` + ``manifest.json`` (kind ``"router"``: ``fingerprint`` of the base model,
        config, ``extra``) into ``out_dir``, which appears whole: built aside, then swapped in. Files already
        there (evaluation results, the card) are kept; a directory holding something else than a router is
        refused with :class:`~kvstate.errors.OutputError`."""
        out = check_output_dir(out_dir, overwrite=True, accept=is_router_dir, option="router directory",
                               kind=f"a SEKV router directory ({WEIGHTS} + {MANIFEST})")
        if any(not torch.isfinite(p).all() for p in self.parameters()):
            raise KVStateError("SemanticRouter.save: a parameter holds NaN or inf; the router is not saved — lower the "
                               "learning rate and train again")
        tensors = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        meta = {"config": asdict(self.config), "fingerprint": fingerprint, **(extra or {})}
        with staged_dir(out, keep=True) as tmp:
            save_file(tensors, str(tmp / WEIGHTS))  # the fingerprint lives in the manifest only
            write_manifest(tmp, kind="router", files=[WEIGHTS], meta=meta)

    @classmethod
    def load(cls, path: str | Path, model: Any | None = None, fingerprint: str | None = None) -> SemanticRouter:
        """Load a saved router after checking its files against their checksums (:class:`IntegrityError`
        naming a damaged file); with ``model`` (or its ``fingerprint``) refuse one trained for another model."""
        p = Path(path)
        if not (p / WEIGHTS).is_file() or not (p / MANIFEST).is_file():
            raise KVStateError(f"{str(p)!r} holds no SEKV router ({WEIGHTS} + {MANIFEST}); train one with "
                               "`kvstate semantic train --model DIR --out DIR`")
        manifest = read_manifest(p, kind="router", covers=(WEIGHTS,), remedy=RETRAIN)
        want = fingerprint if fingerprint is not None else (model_fingerprint(model) if model is not None else None)
        if want is not None and manifest.get("fingerprint") != want:
            raise RouterMismatchError(f"router in {str(p)!r} was trained for a model with fingerprint "
                                      f"{str(manifest.get('fingerprint'))[:16]}…, but this model's is {want[:16]}…; "
                                      "train a router for this model with `kvstate semantic train`")
        check_safetensors_header(p / WEIGHTS)
        try:
            router = cls(RouterConfig(**manifest["config"]))
            tensors = load_file(p / WEIGHTS)
        except (KeyError, TypeError, ValueError) as exc:
            raise RouterMismatchError(f"router in {str(p)!r}: its {MANIFEST} config does not fit its weights "
                                      f"({' '.join(str(exc).split())[:200]}); {RETRAIN}") from None
        except Exception as exc:  # safetensors' own error types: a file the checksum passed but that does not parse
            raise IntegrityError(f"{str(p / WEIGHTS)!r} is not readable safetensors ({exc}); {RETRAIN}") from None
        want_shapes = {k: (tuple(v.shape), v.dtype) for k, v in router.state_dict().items()}
        got_shapes = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
        if want_shapes != got_shapes:
            diff = sorted(k for k in want_shapes.keys() | got_shapes.keys() if want_shapes.get(k) != got_shapes.get(k))
            shown = ", ".join(f"{k}: {got_shapes.get(k, 'missing')} (want {want_shapes.get(k, 'none')})" for k in diff[:3])
            raise RouterMismatchError(f"router in {str(p)!r}: {WEIGHTS} does not fit its {MANIFEST} config ({shown}); "
                                      f"{RETRAIN}")
        bad = [k for k, v in tensors.items() if not bool(torch.isfinite(v).all())]
        if bad:
            raise IntegrityError(f"router in {str(p)!r}: tensor {bad[0]!r} holds NaN or inf; {RETRAIN}")
        router.load_state_dict(tensors)
        router.fingerprint = manifest.get("fingerprint") if isinstance(manifest.get("fingerprint"), str) else None
        if model is not None:
            if want is not None:
                router._checked.add(model)  # its fingerprint was compared above
            router.check_model(model)
        return router.eval()
