"""The depth registries: routing rules and sharing-pattern families looked up by name, unknown names refused
with the registry listed, and no name comparisons left outside the registry."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from kvstate.depth.patterns import (
    LayerSpec,
    PatternError,
    cla,
    draw_pattern,
    draw_route,
    keep,
    preset,
    top_shared,
)
from kvstate.depth.registry import FAMILIES, RULES, PatternFamily, Registry, keep_families

F = LayerSpec("full_attention", 2, 16)
L = [F] * 4
SRC = Path(__file__).resolve().parents[3] / "src" / "kvstate"


def test_rules_and_families_by_name():
    assert RULES.names() == ("paper", "owner") and RULES.get("paper").own_kv and not RULES.get("owner").own_kv
    for name, draw in (("paper", draw_route), ("owner", draw_pattern)):
        a, b = random.Random(3), random.Random(3)
        assert [RULES.get(name).draw(L, 0.5, a) for _ in range(20)] == [draw(L, 0.5, b) for _ in range(20)]
    assert FAMILIES.names() == ("keep", "cla", "top_shared", "none") and keep_families() == ("keep", "cla", "top_shared")
    assert preset(L, "cla", 2) == cla(L, 2) and preset(L, "top_shared", 1) == top_shared(L, 1)
    assert preset(L, "keep", 0.5) == keep(L, 0.5) and preset(L, "none").sources == (0, 1, 2, 3)


def test_unknown_name_lists_the_registry():
    with pytest.raises(PatternError, match="--rule 'bogus' is not a registered routing rule; choose one of paper, owner"):
        RULES.get("bogus")
    with pytest.raises(PatternError, match="--pattern-kind 'cla3' is not a registered pattern family; choose one of "
                                           "keep, cla, top_shared, none"):
        preset(L, "cla3")
    reg: Registry[PatternFamily] = Registry("pattern family", "--x")
    reg.register(PatternFamily("a", lambda layers, v: keep(layers, 1.0), None, "a"))
    with pytest.raises(PatternError, match="registered twice"):
        reg.register(PatternFamily("a", lambda layers, v: keep(layers, 1.0), None, "again"))
    assert "a" in reg and "b" not in reg and 3 not in reg


def test_cli_unknown_rule_and_kind_list_the_registry(capsys, tmp_path):
    from kvstate.cli import main

    for args, message in (
            (["depth", "train", "--model", str(tmp_path), "--out", str(tmp_path / "o"), "--tokens", "256", "--rule",
              "bogus"], "--rule 'bogus' is not a registered routing rule; choose one of paper, owner"),
            (["depth", "eval", "--model", str(tmp_path), "--pattern-kind", "nope"],
             "--pattern-kind 'nope' is not a registered pattern family; choose one of keep, cla, top_shared, none")):
        with pytest.raises(SystemExit) as exc:
            main(args)
        err = capsys.readouterr().err.strip()
        assert exc.value.code == 2 and message in err and len(err.splitlines()) == 1, err


def test_no_rule_or_family_name_comparisons_outside_the_registry():
    names = "|".join(re.escape(n) for n in (*RULES.names(), *FAMILIES.names()))
    name = rf"""["']({names})["']"""
    # x == "paper", "paper" != x, x in ("keep", "cla") — a tuple of names; a table's column list is not one
    compare = re.compile(rf"(==|!=)\s*{name}|{name}\s*(==|!=)|\bin\s*[(\[{{]\s*{name}\s*,\s*{name}")
    # iterating over names (``for fam in ("keep", "top_shared")``, each then looked up) is not a comparison
    loop = re.compile(r"\bfor\s+\w+\s+in\b")

    def compares(line: str) -> bool:
        return compare.search(loop.sub("for _ over", line)) is not None

    assert compares('if kind in ("keep", "cla"):') and compares('x == "paper"') and compares('"owner" != rule')
    assert not compares('for fam in ("keep", "top_shared")]') and compares('[f for f in xs if f in ("keep", "cla")]')
    hits = [f"{p.relative_to(SRC)}:{i}" for d in ("depth", "lab/depth") for p in sorted((SRC / d).rglob("*.py"))
            if p.name != "registry.py" for i, line in enumerate(p.read_text().splitlines(), 1) if compares(line)]
    assert hits == []
