"""Result files record where they came from, keep every run, and go stale when their code or models change."""

import json
import sys
import types

import pytest

from kvstate.errors import InputFileError
from kvstate.lab import provenance as P


def test_a_run_records_its_provenance_and_runs_are_appended(tmp_path):
    rec = P.Recorder(code=("depth",), models=[tmp_path / "absent"], n=100, seeds=[1000], tasks=["niah_single"],
                     lengths=[1024], command="kvstate depth eval --n 100")
    prov = rec.finish()
    for key in ("commit", "command", "date_utc", "wall_seconds", "n", "seeds", "tasks", "lengths", "torch",
                "transformers", "torch_threads", "code", "models"):
        assert key in prov
    path = tmp_path / "r.json"
    P.append_run(path, {"results": [1]}, prov)
    P.append_run(path, {"results": [2]}, prov)
    runs = P.read_runs(path)
    assert [r["results"] for r in runs] == [[1], [2]] and runs[0]["provenance"]["n"] == 100
    assert json.loads(path.read_text())["format"] == P.FORMAT
    P.append_run(path, {"ratio": float("nan"), "rows": [{"r2": float("inf")}]}, prov)  # no baseline measured
    assert P.read_runs(path)[-1]["ratio"] is None and P.read_runs(path)[-1]["rows"] == [{"r2": None}]


def _executes(monkeypatch, path) -> None:
    """The run imports ``path`` (a module in sys.modules whose file it is)."""
    monkeypatch.setitem(sys.modules, f"_kvstate_test_{path.stem}", types.SimpleNamespace(__file__=str(path)))


def test_stale_when_the_code_it_executed_changes(tmp_path, monkeypatch):
    src = tmp_path / "src"
    (src / "axis").mkdir(parents=True)
    (src / "axis" / "m.py").write_text("x = 1\n")
    monkeypatch.setattr(P, "SRC", src)
    _executes(monkeypatch, src / "axis" / "m.py")
    path = tmp_path / "r.json"
    P.append_run(path, {"v": 1}, P.Recorder(code=("axis",)).finish())
    assert P.load_artifact(path, "cmd").status == "current"
    (src / "axis" / "m.py").write_text("x = 2\n")
    art = P.load_artifact(path, "cmd")
    assert art.status == "stale" and "m.py" in art.reason and art.command == "cmd"
    rec = P.Recorder(code=("axis",))  # the code is edited while the run is under way: its result is stale
    (src / "axis" / "m.py").write_text("x = 3\n")
    P.append_run(path, {"v": 2}, rec.finish())
    assert P.load_artifact(path, "cmd").status == "stale"


def test_a_file_the_run_never_executed_or_one_that_only_presents_leaves_it_current(tmp_path, monkeypatch):
    src = tmp_path / "src"
    (src / "axis").mkdir(parents=True)
    used, other, page = src / "axis" / "sekv.py", src / "axis" / "another_method.py", src / "page.py"
    for f in (used, other, page):
        f.write_text("x = 1\n")
    monkeypatch.setattr(P, "SRC", src)
    _executes(monkeypatch, used)
    _executes(monkeypatch, page)
    monkeypatch.setattr(P, "PRESENTATION", frozenset({str(page.resolve())}))
    path = tmp_path / "r.json"
    P.append_run(path, {"v": 1}, P.Recorder(code=("axis",)).finish())  # names the whole axis as its method's code
    other.write_text("x = 2\n")  # a new method beside it, never imported by the run
    (src / "axis" / "brand_new.py").write_text("y = 1\n")
    page.write_text("x = 2\n")  # the report's page: records and presents, computes nothing measured
    assert P.load_artifact(path, "cmd").status == "current"
    used.write_text("x = 2\n")  # a real change to what it ran
    assert P.load_artifact(path, "cmd").status == "stale"


def test_a_run_without_per_file_hashes_is_still_decided_by_its_named_code(tmp_path, monkeypatch):
    src = tmp_path / "src"
    (src / "axis").mkdir(parents=True)
    (src / "axis" / "m.py").write_text("x = 1\n")
    monkeypatch.setattr(P, "SRC", src)
    prov = P.Recorder(code=("axis",)).finish()
    del prov["executed"]  # recorded before per-file hashes existed
    path = tmp_path / "r.json"
    P.append_run(path, {"v": 1}, prov)
    assert P.load_artifact(path, "cmd").status == "current"
    (src / "axis" / "m.py").write_text("x = 2\n")
    assert P.load_artifact(path, "cmd").status == "stale"


def test_presentation_modules_are_not_measurement_drivers():
    """A module exempt from staleness must not be a run's driver or compute a value: none has a ``__main__`` or
    an argparse entry, and each is one of the recording / page modules by path."""
    root = P.REPO
    for rel in P.PRESENTATION:
        text = (root / rel).read_text()
        assert (root / rel).is_file() and "if __name__ ==" not in text and "import argparse" not in text, rel


def test_stale_without_provenance_missing_without_file_and_bad_files_refused(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"results": []}))
    assert P.load_artifact(old, "cmd").status == "stale"
    assert P.load_artifact(tmp_path / "none.json", "cmd").status == "missing"
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InputFileError, match="make reproduce"):
        P.read_runs(bad)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": "something-else/9"}))
    with pytest.raises(InputFileError, match="expected"):
        P.load_artifact(other, "cmd")


def test_model_digest_ignores_cards_and_results(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"w")
    (tmp_path / "config.json").write_text("{}")
    d = P.model_digest(tmp_path)
    (tmp_path / "README.md").write_text("card")
    (tmp_path / "depth_eval.json").write_text("{}")
    assert P.model_digest(tmp_path) == d
    (tmp_path / "config.json").write_text('{"a": 1}')
    assert P.model_digest(tmp_path) != d


def test_the_digest_covers_what_the_run_imported_and_its_driver_script(tmp_path, monkeypatch):
    import sys

    import kvstate.lab.stats  # noqa: F401  (imported: must be covered without being listed)

    bench = tmp_path / "benchmarks"
    bench.mkdir()
    driver = bench / "drive.py"
    driver.write_text("print('v1')\n")
    monkeypatch.setattr(P, "SCRIPT_DIRS", (bench,))
    monkeypatch.setattr(sys, "argv", [str(driver), "--out", "x"])
    files = P.executed_files()
    assert driver.resolve() in files and (P.SRC / "lab" / "stats.py").resolve() in files
    prov = P.Recorder(code=()).finish()  # no modules named by hand
    assert "src/kvstate/lab/stats.py" in prov["executed"]["files"] and str(driver.resolve()) in prov["executed"]["files"]
    path = tmp_path / "r.json"
    P.append_run(path, {"v": 1}, prov)
    assert P.load_artifact(path, "cmd").status == "current"
    driver.write_text("print('v2')\n")  # the driver script changes: the result no longer describes it
    art = P.load_artifact(path, "cmd")
    assert art.status == "stale" and "drive.py" in art.reason
    assert P.Recorder(code=()).finish()["executed"]["digest"] != prov["executed"]["digest"]


def test_provenance_and_ledger_do_not_import_each_other_at_module_level():
    """Issue 42 item 10: the recorder and the seed ledger share the result-file layer (``results_file``) and
    neither imports the other when loaded (``append_run`` reaches the ledger inside the call)."""
    import ast

    def top_imports(rel: str) -> set[str]:
        tree = ast.parse((P.REPO / rel).read_text())
        names = set()
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        return names

    prov, ledger = top_imports("src/kvstate/lab/provenance.py"), top_imports("src/kvstate/lab/ledger.py")
    low = top_imports("src/kvstate/lab/results_file.py")
    assert "kvstate.lab.ledger" not in prov and "kvstate.lab.provenance" not in ledger
    assert "kvstate.lab.results_file" in prov and "kvstate.lab.results_file" in ledger
    assert not {m for m in low if m.startswith("kvstate.lab")}
    assert P.read_runs is __import__("kvstate.lab.results_file", fromlist=["read_runs"]).read_runs
