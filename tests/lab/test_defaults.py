"""Defaults are what was measured: each command's default invocation runs the configuration its report headline
file recorded (the committed result files are the reference, read here, not copied)."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

from kvstate.lab.depth.cli import default_keeps
from kvstate.lab.depth.cli import eval_command as depth_eval
from kvstate.lab.semantic.cli import eval_command as semantic_eval
from kvstate.lab.semantic.methods import get as get_method
from kvstate.lab.semantic.methods.base import Context, SekvOptions
from kvstate.lab.transfer.bench import DEFAULT_LENGTHS, BenchConfig
from kvstate.lab.transfer.cli import bench_command
from kvstate.semantic.config import SemanticConfig
from kvstate.semantic.segment import SegmentConfig

MODELS = Path(__file__).resolve().parents[2] / "models"


def defaults(command: Any) -> dict[str, Any]:
    return {k: p.default for k, p in inspect.signature(command).parameters.items()}


def last_run(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())["runs"][-1]  # type: ignore[no-any-return]


def sekv_headline() -> dict[str, Any]:
    """The settings of the resolution section's headline grid (``models/ref-attn-sekv/eval.json``)."""
    return last_run(MODELS / "ref-attn-sekv" / "eval.json")["provenance"]["settings"]  # type: ignore[no-any-return]


def test_semantic_eval_defaults_are_the_headline_grids_settings() -> None:
    s, d = sekv_headline(), defaults(semantic_eval)
    for key in ("recent", "max_span", "expand_share", "slow_budget", "memory", "slow", "bits"):
        assert d[key] == s[key], key
    assert [float(b) for b in d["budget"].split(",")] == s["budgets"]


def test_the_library_default_is_the_shipped_sekv_of_the_headline() -> None:
    s = sekv_headline()
    shipped = get_method("sekv").config(0.25, Context(router=None, segment=SegmentConfig(recent=s["recent"],
                                                                                        max_span=s["max_span"]),
                                                      expand_share=s["expand_share"], slow_budget=s["slow_budget"],
                                                      options=SekvOptions(memory=s["memory"], slow=s["slow"],
                                                                          bits=s["bits"])))
    assert dataclasses.replace(SemanticConfig(), summaries=False) == shipped
    assert SemanticConfig().attend_summaries is False  # sekv reads expanded spans only (Quest's reads)
    ctx = Context(router=None, segment=SegmentConfig())
    assert (ctx.expand_share, ctx.options) == (s["expand_share"], SekvOptions(memory=s["memory"], slow=s["slow"],
                                                                              bits=s["bits"]))


def test_depth_eval_defaults_to_the_declared_familys_keeps_and_names_the_skipped() -> None:
    assert defaults(depth_eval)["keep"] is None
    keeps, skipped = default_keeps(MODELS / "ref-attn-rcla")
    assert keeps == last_run(MODELS / "ref-attn-rcla" / "depth_eval.json")["provenance"]["settings"]["keep"]
    assert list(skipped) == [0.25] and "--post-hoc" in skipped[0.25]


def test_transfer_bench_defaults_to_the_lengths_its_quality_runs_measured() -> None:
    runs = json.loads((MODELS / "codec-ref-attn-ft2" / "bench.json").read_text())["runs"]
    measured = {tuple(r["provenance"]["lengths"]) for r in runs if r.get("provenance", {}).get("lengths")}
    assert measured == {DEFAULT_LENGTHS}
    assert tuple(int(x) for x in defaults(bench_command)["lengths"].split(",")) == DEFAULT_LENGTHS
    assert BenchConfig().lengths == DEFAULT_LENGTHS
