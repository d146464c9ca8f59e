"""No method / planner / policy / rule name is compared as a string outside the registries.

A method is a registered object (one file each); code that branches on its name (``if method == "sekv"``)
is a second, hidden list of methods that a new method must find and edit. This scans ``src/kvstate`` with
the ``ast`` module for comparisons (``==``, ``!=``, ``in``, ``not in``) of a name that says it holds a method
(``method``, ``planner``, ``policy``, ``rule``, ``press`` in the variable or attribute) against string
literals, and lists every offending line. In the position axis (``src/kvstate/prefix``) a placement mode
(``"path"`` / ``"tree"``, :class:`kvstate.prefix.placement.Placement`) compared as a literal is flagged whatever
the variable is called: the store asks ``config.placement is Placement.TREE``.

``ALLOWED`` is the explicit allow-list of files that still branch on names — each entry says why and is
meant to shrink to nothing; a registry's own module (where names are defined) is listed in ``REGISTRIES``.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kvstate"
WORDS = ("method", "planner", "policy", "rule", "press", "placement")

# the registries: names are defined (and may be compared) here
REGISTRIES: set[str] = {
    "prefix/placement.py",  # PLANNERS
    "prefix/eviction.py",  # POLICIES (eviction)
    "serve/policy.py",  # POLICIES (admission)
}

# files that still compare names outside a registry: each is a debt, remove the entry when it is paid
ALLOWED: dict[str, str] = {
    # across models: a payload's recorded method is checked on decode (a format check, but a name compared)
    "transfer/codec.py": "payload.meta['method'] != 'scd' on decode",
}


def _key(node: ast.expr) -> str | None:
    """The identifier an expression reads: ``x``, ``a.x``, ``r["x"]``, ``d.get("x")``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
        return node.slice.value
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args
            and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        return node.args[0].value
    return None


def _position_names() -> set[str]:
    """Names in the position axis's registries: a literal one of them is a name whatever the variable is called."""
    from kvstate.prefix.eviction import POLICIES
    from kvstate.prefix.placement import PLANNERS

    return set(PLANNERS) | set(POLICIES)


NAMES = _position_names()


def _placement_names() -> set[str]:
    """The placement modes: compared as literals they are flagged in the position axis (``prefix/``) only —
    elsewhere "path" is too common a word to mean a mode."""
    from kvstate.prefix.placement import Placement

    return {m.value for m in Placement}


PLACEMENTS = _placement_names()
PLACEMENT_DIR = "prefix/"


def _holds_method(node: ast.expr) -> str | None:
    if isinstance(node, ast.Attribute) and node.attr == "name":  # policy.name, self.method.name
        node = node.value
    name = _key(node)
    if name is not None and any(w in name.lower() for w in WORDS):
        return name
    return None


def _registered_literal(node: ast.expr, names: set[str]) -> bool:
    elts = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return any(isinstance(e, ast.Constant) and e.value in names for e in elts)


def _literal_names(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)
    return False


def offenders(path: Path) -> list[str]:
    """``file:line: source`` for each name comparison in ``path``."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    rel = path.relative_to(SRC).as_posix()
    names = NAMES | PLACEMENTS if rel.startswith(PLACEMENT_DIR) else NAMES
    out = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for op, (a, b) in zip(node.ops, itertools.pairwise(operands), strict=True):
            if not isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
                continue
            eq = isinstance(op, (ast.Eq, ast.NotEq))
            if ((_holds_method(a) and _literal_names(b)) or (_holds_method(b) and _literal_names(a) and eq)
                    or _registered_literal(b, names) or (eq and _registered_literal(a, names))):
                out.append(f"{rel}:{node.lineno}: {lines[node.lineno - 1].strip()}")
                break
    return out


def all_offenders() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel in REGISTRIES:
            continue
        hits = offenders(path)
        if hits:
            found[rel] = hits
    return found


def test_no_method_name_is_compared_as_a_string_outside_the_registries():
    found = all_offenders()
    unexpected = [line for rel, hits in found.items() if rel not in ALLOWED for line in hits]
    assert unexpected == [], "name comparisons outside the registries:\n" + "\n".join(unexpected)


def test_the_allow_list_only_holds_files_that_still_offend():
    found = all_offenders()
    paid = sorted(rel for rel in ALLOWED if rel not in found)
    assert paid == [], f"remove these from ALLOWED (no name comparison left): {paid}"


def test_the_scan_finds_a_name_comparison(tmp_path, monkeypatch):
    f = SRC / "lab" / "__init__.py"
    probe = tmp_path / "probe.py"
    probe.write_text('if method == "sekv":\n    pass\nif cfg.planner in ("optimal", "block"):\n    pass\n'
                     'if "lru" != policy:\n    pass\nif kind == "x" or method == other:\n    pass\n'
                     'if r["planner"] == "a":\n    pass\nif k != "optimal":\n    pass\nif m.get("method") == "b":\n    pass\n')
    monkeypatch.setattr("tests.test_registries_guard.SRC", tmp_path)
    assert offenders(probe) == ['probe.py:1: if method == "sekv":', 'probe.py:3: if cfg.planner in ("optimal", "block"):',
                                'probe.py:5: if "lru" != policy:', 'probe.py:9: if r["planner"] == "a":',
                                'probe.py:11: if k != "optimal":', 'probe.py:13: if m.get("method") == "b":']
    assert f.is_file()


def test_the_scan_finds_a_placement_mode_compared_as_a_string(tmp_path, monkeypatch):
    src = 'if c.placement == "tree":\n    pass\nif mode in ("path", "tree"):\n    pass\nif kind == "path":\n    pass\n'
    (tmp_path / "prefix").mkdir()
    (tmp_path / "prefix" / "probe.py").write_text(src)
    (tmp_path / "probe.py").write_text(src)
    monkeypatch.setattr("tests.test_registries_guard.SRC", tmp_path)
    # in the position axis every literal mode is a name; elsewhere only a variable that says it holds a placement
    assert offenders(tmp_path / "prefix" / "probe.py") == [
        'prefix/probe.py:1: if c.placement == "tree":', 'prefix/probe.py:3: if mode in ("path", "tree"):',
        'prefix/probe.py:5: if kind == "path":']
    assert offenders(tmp_path / "probe.py") == ['probe.py:1: if c.placement == "tree":']
