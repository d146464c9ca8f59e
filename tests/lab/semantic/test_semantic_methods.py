"""The method registry: every name resolves to one registered object, an unknown name lists the registry,
kvpress presses go through one adapter, and whole-cache KIVI holds what it counts, within its budget."""

import pytest
import torch

from kvstate.errors import BudgetError, KVStateError
from kvstate.lab.semantic import methods
from kvstate.lab.semantic.methods.kivi import GROUP, KiviCache, kivi_nbytes
from kvstate.models import tiny_model
from kvstate.semantic import SegmentConfig, SemanticConfig, semantic_attention


def test_resolve_splits_registered_methods_from_the_adapters_names_and_refuses_unknown_ones():
    sel = methods.resolve(["full", "sekv", "SnapKVPress", "kivi"])
    assert sel.methods == ["full", "sekv", "kivi"] and sel.external == {"kvpress": ["SnapKVPress"]}
    assert methods.resolve(["kvpress"]).external["kvpress"][0] == "SnapKVPress"  # the default presses
    with pytest.raises(KVStateError, match=r"unknown method\(s\) \['h2o'\]; choose from full, sekv") as err:
        methods.resolve(["h2o"])
    assert all(n in str(err.value) for n in methods.METHODS)
    with pytest.raises(KVStateError, match="SnapKVPress twice"):
        methods.resolve(["kvpress", "SnapKVPress"])


def test_roles_name_one_reference_and_one_proposed_method():
    assert methods.reference() == "full" and methods.names_with_role("proposed") == ["sekv"]
    assert methods.role("snap_kv_press") == "baseline" and methods.role("sekv_raw") == "ablation"
    with pytest.raises(KVStateError, match="unique name"):
        methods.register(methods.get("sekv"))


def test_cli_lists_the_registry_and_refuses_an_unknown_method():
    from typer.testing import CliRunner

    from kvstate.cli import app

    out = CliRunner().invoke(app, ["semantic", "methods"]).output
    assert all(n in out for n in [*methods.METHODS, *methods.ADAPTERS])
    r = CliRunner().invoke(app, ["semantic", "eval", "--model", "models/ref-attn", "--methods", "full,h2o"])
    assert isinstance(r.exception, KVStateError) and "unknown method(s) ['h2o']" in str(r.exception)


def _kivi(budget, t=200, recent=8):
    model = tiny_model("qwen3")
    ids = torch.randint(3, 128, (1, t), generator=torch.Generator().manual_seed(0))
    cache = KiviCache(model, None, SemanticConfig(budget=budget, segment=SegmentConfig(recent=recent), zoom="none",
                                                   slow_tier=False))
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    cache.compress()
    return model, ids, cache


@pytest.mark.parametrize("budget,bits", [(0.9, 8), (0.3, 4), (0.2, 2)])
def test_kivi_takes_the_most_bits_its_budget_holds_and_counts_the_tensors(budget, bits):
    cache = _kivi(budget)[2]
    assert cache.bits == bits
    b = cache.byte_counts()
    held = 0
    for layer in cache.semantic_layers:
        st = layer.store
        held += sum(c.codes.nbytes + lo.nbytes + hi.nbytes for c, lo, hi in st.q_k)
        held += sum(v.codes.nbytes + v.lo.nbytes + v.hi.nbytes for v in st.q_v)
        held += st.anchor_k.nbytes + st.anchor_v.nbytes
        k = st.anchor_k
        assert held and st.n_quant == 192 and len(st.q_k) == -(-192 // GROUP)
    assert b.resident_bytes == b.total_bytes == held <= budget * b.full_bytes
    h, d, e = k.shape[1], k.shape[3], k.element_size()
    per_layer = kivi_nbytes(192, h, d, bits, e) + 8 * 2 * h * d * e
    assert held == per_layer * len(cache.semantic_layers)  # the formula the budget check uses


def test_kivi_at_8_bits_is_close_to_full_attention_and_2_bits_is_not():
    errs = {}
    for budget in (0.9, 0.2):
        model, ids, cache = _kivi(budget)
        nxt = torch.tensor([[5]])
        with torch.no_grad():
            ref = model(input_ids=torch.cat([ids, nxt], 1)).logits[0, -1]
            with semantic_attention(model):
                got = model(input_ids=nxt, position_ids=torch.tensor([[ids.shape[1]]]), cache=cache,
                            use_cache=True).logits[0, -1]
        errs[cache.bits] = float((got - ref).abs().max() / ref.abs().max())
    assert errs[8] < 0.02 and errs[2] > errs[8]  # fewer bits, larger error: the oracle can fail


def test_kivi_below_its_2_bit_minimum_names_the_minimum_that_fits():
    with pytest.raises(BudgetError, match=r"budget >= (0\.\d{4})") as err:
        _kivi(0.05)
    need = float(str(err.value).split("budget >= ")[1][:6]) + 1e-4
    assert _kivi(need)[2].bits == 2


def test_kivi_quantizes_its_residual_a_group_at_a_time_while_decoding():
    model, ids, cache = _kivi(0.3)
    st0 = [layer.store.n_quant for layer in cache.semantic_layers]
    with torch.no_grad(), semantic_attention(model):
        for i in range(70):
            model(input_ids=torch.tensor([[7]]), position_ids=torch.tensor([[ids.shape[1] + i]]), cache=cache,
                  use_cache=True)
    for layer, n0 in zip(cache.semantic_layers, st0, strict=True):
        st = layer.store
        assert st.n_quant == n0 + 2 * GROUP and st.anchor_k.shape[2] == 8 + 70 - 2 * GROUP < 8 + GROUP
        assert st.n_quant + st.anchor_k.shape[2] == ids.shape[1] + 70
    b = cache.byte_counts()
    assert b.total_bytes <= 0.3 * b.full_bytes  # the fed tokens did not push it past its budget
