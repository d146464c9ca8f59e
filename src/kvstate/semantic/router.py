"""The learned parts of SEKV: routing projections, zoom thresholds and the rank-gate predictor.

From "SEKV: Resolution-Adaptive Semantic KV Cache with Hierarchical Semantic Memory": keys are projected
into a small routing space to build one summary per span; at decode the query is projected into the
same space and a sigmoid relevance gate ``sigmoid(alpha_l * cos(P_q q, summary) + beta_l)`` scores each
span; a learned per-layer, per-head threshold decides which spans to expand. The base model stays
frozen; only this module trains (``kvstate semantic train``). It saves as ``router.safetensors`` with a
checksum manifest (:mod:`kvstate.integrity`, kind ``"router"``) carrying the base model's fingerprint
(:func:`kvstate.models.model_fingerprint`) and the router's config; loading verifies the checksums and
refuses a router trained for another model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from kvstate.errors import KVStateError
from kvstate.integrity import read_manifest, write_manifest
from kvstate.io_safety import check_output_dir, staged_dir
from kvstate.models.fingerprint import model_fingerprint
from kvstate.semantic.lowrank import RankGate

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
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"RouterConfig.{name}={v!r} must be an int >= 1")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"RouterConfig: n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if not isinstance(self.routing_dim, int) or not 1 <= self.routing_dim <= 1024:
            raise ValueError(f"RouterConfig.routing_dim={self.routing_dim!r} must be an int in [1, 1024]")

    @classmethod
    def from_model_config(cls, config: Any, routing_dim: int = 16) -> RouterConfig:
        tc = config.get_text_config(decoder=True)
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        return cls(tc.num_hidden_layers, tc.num_attention_heads, tc.num_key_value_heads, head_dim, routing_dim)


def is_router_dir(path: Path) -> bool:
    """An empty directory, or one holding a saved router (``router.safetensors`` and ``manifest.json``)."""
    return path.is_dir() and (not any(path.iterdir()) or ((path / WEIGHTS).is_file() and (path / MANIFEST).is_file()))


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
        try:
            router = cls(RouterConfig(**manifest["config"]))
            router.load_state_dict(load_file(p / WEIGHTS))
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise RouterMismatchError(f"router in {str(p)!r}: its {MANIFEST} config does not fit its weights "
                                      f"({' '.join(str(exc).split())[:200]}); {RETRAIN}") from None
        if model is not None:
            mine = RouterConfig.from_model_config(model.config, router.config.routing_dim)
            if mine != router.config:
                raise RouterMismatchError(f"router in {str(p)!r} has shape {router.config}, the model needs {mine}")
        return router.eval()
