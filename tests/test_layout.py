"""The library never imports the lab; no import cycle between packages; transformers stays in models/ and lab/.

Imports are read from the source (``ast``), top-level and inside functions alike, so a lazy import of the
lab from a technique fails here as surely as a module-level one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvstate"
TECHNIQUES = ("models", "prefix", "depth", "semantic", "transfer", "serve")
# library modules that import transformers outside models/ and lab/, each with its reason
TRANSFORMERS_ELSEWHERE = {
    "depth/attention.py": "registers the routed attention through transformers' AttentionInterface",
    "depth/sharing.py": "sets transformers' own kv_sharing_modes so DynamicCache(config=...) holds owners only",
    "semantic/attention.py": "registers mixed-resolution attention through transformers' AttentionInterface",
    "semantic/cache.py": "SemanticCache subclasses transformers' Cache so model.generate accepts it",
    "semantic/retention.py": "registers the reconstruction-scoring attention through transformers' AttentionInterface",
    "prefix/segments.py": "assembles stored KV segments into transformers' DynamicCache / DynamicLayer",
    "transfer/states.py": "builds the consumer's DynamicCache from decoded K/V",
    "transfer/recompute.py": "returns the consumer's DynamicCache with the recomputed layer's K/V filled in",
    "transfer/methods/oracle.py": "prefills the consumer into its own DynamicCache(config=...) (the reference row)",
    "serve/server.py": "loads the served model's tokenizer (AutoTokenizer) and config",
    "serve/generation.py": "reads the served model's config and cache classes while generating",
    "serve/batching.py": "holds the running batch in one transformers DynamicCache(config=...) the model decodes into",
}


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                out.add(arg.value)
    return out


def library_files() -> list[Path]:
    files = [p for t in TECHNIQUES for p in (SRC / t).rglob("*.py")]
    files += [p for p in SRC.glob("*.py") if p.name != "cli.py"]  # errors, validate, io_safety, integrity
    return sorted(files)


def package_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) < 2:
        return module
    if parts[1] == "cli":
        return "kvstate.cli"
    if parts[1] == "lab":  # the lab's subpackages are rooms of their own: the lab has no cycle inside either
        return ".".join(parts[:3]) if len(parts) > 2 and (SRC / "lab" / parts[2]).is_dir() else "kvstate.lab"
    return ".".join(parts[:2]) if (SRC / parts[1]).is_dir() else "kvstate"


def test_library_never_imports_the_lab() -> None:
    offenders = {module_name(p): sorted(i for i in imports_of(p) if i == "kvstate.lab" or i.startswith("kvstate.lab."))
                 for p in library_files()}
    offenders = {k: v for k, v in offenders.items() if v}
    assert offenders == {}


def test_the_walker_sees_lazy_imports(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from kvstate.lab.harness import perplexity\n    __import__('kvstate.lab.report')\n")
    assert {"kvstate.lab.harness", "kvstate.lab.report"} <= imports_of(f)


def test_no_import_cycle_between_packages() -> None:
    graph: dict[str, set[str]] = {}
    for p in SRC.rglob("*.py"):
        src = package_of(module_name(p))
        for i in imports_of(p):
            if i.startswith("kvstate."):
                dst = package_of(i)
                if dst != src:
                    graph.setdefault(src, set()).add(dst)
    seen: dict[str, int] = {}

    def visit(n: str, stack: list[str]) -> None:
        if seen.get(n) == 1:
            pytest.fail(f"import cycle: {' -> '.join([*stack, n])}")
        if seen.get(n) == 2:
            return
        seen[n] = 1
        for m in sorted(graph.get(n, ())):
            visit(m, [*stack, n])
        seen[n] = 2

    for n in sorted(graph):
        visit(n, [])


def test_axes_stand_on_models_only() -> None:
    """The four axes import the library root and models/, never each other: they sit on one floor."""
    axes = ("prefix", "depth", "semantic", "transfer")  # serve/ is a deployment layer above prefix/
    crossings = []
    for a in axes:
        for p in (SRC / a).rglob("*.py"):
            for i in imports_of(p):
                other = i.split(".")[1] if i.startswith("kvstate.") and "." in i else None
                if other in axes and other != a:
                    crossings.append((module_name(p), i))
    assert crossings == []


def test_transformers_outside_models_and_lab_says_why() -> None:
    users = set()
    for p in library_files():
        rel = p.relative_to(SRC).as_posix()
        if rel.startswith("models/"):
            continue
        if any(i == "transformers" or i.startswith("transformers.") for i in imports_of(p)):
            users.add(rel)
    assert users <= set(TRANSFORMERS_ELSEWHERE), sorted(users - set(TRANSFORMERS_ELSEWHERE))
