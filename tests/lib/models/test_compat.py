"""The transformers internals kvstate relies on, checked in their one home (``kvstate.models.compat``)."""

from __future__ import annotations

import functools
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from kvstate.models import chunk_size, compat, restore_cache, segmented_prefill, tiny_model
from tests.conftest import FAMILIES, get_model, random_ids

REPO = Path(__file__).resolve().parents[3]


def test_every_internal_holds_in_the_installed_release() -> None:
    assert compat.check_internals() == []


@pytest.mark.parametrize("family", FAMILIES)
def test_a_live_cache_has_every_layer_attribute_kvstate_reads(family: str) -> None:
    model = get_model(family)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(random_ids(9, seed=1), cache=cache, use_cache=True)
    assert compat.check_cache(cache) == []


def test_a_missing_internal_is_one_line_naming_the_version_and_the_internal() -> None:
    with pytest.raises(compat.TransformersInternalError) as err:
        compat.internal("transformers.cache_utils", "NoSuchLayer")
    msg = str(err.value)
    assert "\n" not in msg and compat.version() in msg and "transformers.cache_utils.NoSuchLayer" in msg
    assert "make canary" in msg


def test_the_chunk_length_is_found_behind_each_kind_of_wrapper() -> None:
    def kernel(q: int, chunk_size: int = 48) -> int:
        return q

    @functools.wraps(kernel)
    def wrapped(*args: object, **kwargs: object) -> int:
        return kernel(*args, **kwargs)  # type: ignore[arg-type]

    class Func(torch.nn.Module):  # transformers 5.25: a kernels-hub module whose forward calls the function
        def forward(self, *args: object, **kwargs: object) -> int:
            return wrapped(*args, **kwargs)

    def closure(*args: object, **kwargs: object) -> int:
        return kernel(*args, **kwargs)  # type: ignore[arg-type]

    for obj in (kernel, wrapped, Func(), closure):
        fn = compat._plain_function(obj, "chunk_size")
        assert fn is kernel
    assert compat._plain_function(lambda *a: a, "chunk_size") is None


def _resumed_and_one_shot(family: str, dtype: torch.dtype, total: int):  # type: ignore[no-untyped-def]
    model = tiny_model(family, seed=0, dtype=dtype)
    model.set_attn_implementation("eager")  # SDPA's kernel choice depends on the query length
    ids = random_ids(total, seed=3)
    one_shot = segmented_prefill(model, ids, all_logits=True).logits

    def resumed_at(cut: int) -> torch.Tensor:
        seg = segmented_prefill(model, ids, cuts=[cut])
        cache = restore_cache(model.config, seg.snapshots[cut])
        return segmented_prefill(model, ids, cache=cache, start=cut, all_logits=True).logits

    return model, resumed_at, one_shot


def test_the_gated_deltanet_chunk_length_is_the_one_the_forward_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunk length ``chunk_size`` reports is the one the forward calls the chunked kernel with (its bound
    argument at every call, the default included), and a prefill resumed on it matches one call. An earlier form
    of this test asked for bit-identity at chunk-aligned cuts: that holds on some CPUs only (on others the
    projections' matmul kernels differ with the sequence length, ~1e-7 apart), so it pinned the hardware, not the
    chunk."""
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5 as mod

    real = mod.torch_chunk_gated_delta_rule
    sig = inspect.signature(real)
    seen: list[int] = []

    def spy(*args: object, **kwargs: object) -> object:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        seen.append(int(bound.arguments["chunk_size"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, "torch_chunk_gated_delta_rule", spy)
    model, resumed_at, one_shot = _resumed_and_one_shot("qwen3_5", torch.float32, 2 * 64 + 40)
    c = chunk_size(model.config)
    assert c == 64 and len(seen) >= 1 and set(seen) == {c}
    seen.clear()
    for cut in (c, 2 * c):
        torch.testing.assert_close(resumed_at(cut), one_shot[:, cut:], atol=1e-6, rtol=0)
    assert len(seen) >= 2 and set(seen) == {c}


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_gated_deltanet_resume_is_exact_at_aligned_and_unaligned_cuts(family: str) -> None:
    model, resumed_at, one_shot = _resumed_and_one_shot(family, torch.float32, 2 * 64 + 40)
    c = chunk_size(model.config)
    for cut in (c, c - 1, c // 2, 2 * c + 1):
        torch.testing.assert_close(resumed_at(cut), one_shot[:, cut:], atol=1e-5, rtol=0)


def test_the_tested_range_is_pyprojects_bound() -> None:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(d for d in deps if d.startswith("transformers"))
    low, high = compat.TESTED
    major, minor = (int(x) for x in high.split("."))
    assert spec == f"transformers>={low},<{major}.{minor + 1}"
    assert compat.in_tested_range(compat.version())


def test_an_untested_release_is_one_warning_naming_the_range_and_the_canary(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(compat, "version", lambda: "5.99.0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compat.warn_if_untested()
    assert len(caught) == 1 and caught[0].category is RuntimeWarning
    msg = str(caught[0].message)
    assert "5.99.0" in msg and compat.tested_range() in msg and "make canary" in msg
    monkeypatch.setattr(compat, "version", lambda: f"{compat.TESTED[1]}.3")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compat.warn_if_untested()
    assert caught == []


def test_nothing_outside_the_compat_home_reaches_into_transformers_modules() -> None:
    out = subprocess.run(["grep", "-rnE", r"inspect\.signature|import_module\(f\"transformers|from transformers\.",
                          "src"], cwd=REPO, capture_output=True, text=True).stdout
    offenders = [ln for ln in out.splitlines() if not ln.startswith("src/kvstate/models/compat.py")]
    assert offenders == []


def test_kvstate_imports_without_a_warning_on_the_locked_release() -> None:
    done = subprocess.run([sys.executable, "-c", "import kvstate.models"], capture_output=True, text=True)
    assert done.returncode == 0 and "kvstate was tested with" not in done.stderr
