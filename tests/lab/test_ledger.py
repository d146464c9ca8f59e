"""The test-seed ledger: a result under models/ takes test seeds only, and a used seed only the same method."""

import json
from typing import Any

import pytest

from kvstate.lab import ledger as L
from kvstate.lab import provenance as P


def prov(seeds, digest="d1", **extra):
    return {"commit": "c1", "date_utc": "2026-01-01 00:00:00", "seeds": seeds, "code": {"modules": ["axis"],
            "digest": digest}, "models": {"models/m": "w1"}, "settings": {"k": 1, "threads": 1}, **extra}


def test_a_dev_seed_or_no_seed_is_refused_and_nothing_is_written(models):
    out = models / "m" / "eval.json"
    with pytest.raises(L.SeedRefused, match=r"m/eval.json: --seed 0 is a dev seed.*e\.g\. --seed 1000"):
        P.append_run(out, {"v": 1}, prov([0]))
    with pytest.raises(L.SeedRefused, match=r"names no seed.*--seed 1000"):
        P.append_run(out, {"v": 1}, prov([]))
    with pytest.raises(L.SeedRefused, match="dev seed"):
        P.append_run(out, {"v": 1}, prov([1000, 2]))
    assert not out.exists() and not (models / L.LEDGER_NAME).exists()


def test_a_used_test_seed_takes_only_the_same_unchanged_method(models):
    out = models / "m" / "eval.json"
    P.append_run(out, {"v": 1}, prov([1000]))
    ledger = L.read_ledger(models / L.LEDGER_NAME)
    assert [(e.seed, e.file.endswith("models/m/eval.json"), e.commit) for e in ledger["m/eval"]] == [(1000, True, "c1")]
    P.append_run(out, {"v": 2}, prov([1000]) | {"settings": {"k": 1, "threads": 4}})  # re-scored, unchanged
    assert len(L.read_ledger(models / L.LEDGER_NAME)["m/eval"]) == 2
    before = out.read_text()
    with pytest.raises(L.SeedRefused) as e:  # the method's code changed after seed 1000 was scored
        P.append_run(out, {"v": 3}, prov([1000], digest="d2"))
    msg = str(e.value)
    assert "\n" not in msg and "test seed 1000 is already in" in msg and "seeds_used.json for m/eval" in msg
    assert "commit c1" in msg and "--seed 1001" in msg
    with pytest.raises(L.SeedRefused, match="1000"):  # a changed hyperparameter is a different method too
        P.append_run(out, {"v": 3}, prov([1000]) | {"settings": {"k": 2}})
    with pytest.raises(L.SeedRefused, match="1000"):  # so is a retrained model
        P.append_run(out, {"v": 3}, prov([1000]) | {"models": {"models/m": "w2"}})
    assert out.read_text() == before
    P.append_run(out, {"v": 3}, prov([1001], digest="d2"))  # the fix: a fresh test seed
    assert [e.seed for e in L.read_ledger(models / L.LEDGER_NAME)["m/eval"]] == [1000, 1000, 1001]


def test_listed_methods_are_ledgered_one_by_one(models):
    out = models / "m" / "eval.json"
    P.append_run(out, {"v": 1}, prov([1000]) | {"settings": {"methods": ["full", "sekv"]}})
    P.append_run(out, {"v": 2}, prov([1000]) | {"settings": {"methods": ["full", "window"]}})  # full unchanged
    assert {m: [e.seed for e in es] for m, es in L.read_ledger(models / L.LEDGER_NAME).items()} == {
        "axis:full": [1000, 1000], "axis:sekv": [1000], "axis:window": [1000]}
    with pytest.raises(L.SeedRefused, match="for axis:sekv"):
        P.append_run(out, {"v": 3}, prov([1000], digest="d2") | {"settings": {"methods": ["sekv"]}})


def test_a_result_outside_models_is_not_checked(models, tmp_path):
    P.append_run(tmp_path / "scratch.json", {"v": 1}, prov([0]))
    assert not (models / L.LEDGER_NAME).exists()


def test_a_malformed_ledger_is_refused(models):
    (models / L.LEDGER_NAME).write_text(json.dumps({"format": "other"}))
    with pytest.raises(L.InputFileError, match="not a seed ledger"):
        P.append_run(models / "m" / "eval.json", {"v": 1}, prov([1000]))


def test_the_ledger_is_rebuilt_from_result_files(models):
    out = models / "m" / "eval.json"
    P.append_run(out, {"v": 1}, prov([1000]))
    P.append_run(out, {"v": 2}, prov([1001], digest="d2"))
    (models / L.LEDGER_NAME).unlink()
    legacy = models / "m" / "old.json"
    P.append_run(models.parent / "x.json", {"v": 0}, prov([0]))
    legacy.write_bytes((models.parent / "x.json").read_bytes())  # a dev-seed run committed before the ledger
    ledger, skipped = L.ledger_from_results(models, L.result_files(models))
    assert [(e.seed, e.digest) for e in ledger["m/eval"]] == [(1000, L.method_digest(prov([1000]))),
                                                                (1001, L.method_digest(prov([1001], digest="d2")))]
    assert len(skipped) == 1 and "old.json run 1: seeds [0]" in skipped[0]


def test_the_committed_ledger_holds_every_committed_test_seed_run():
    root = L.results_root()
    ledger = L.read_ledger(root / L.LEDGER_NAME)
    derived, _ = L.ledger_from_results(root, L.result_files(root))
    have = {(m, e.seed, e.file, e.digest) for m, es in ledger.items() for e in es}
    missing = {(m, e.seed, e.file, e.digest) for m, es in derived.items() for e in es} - have
    assert not missing, f"runs not in {L.LEDGER_NAME}: {sorted(missing)[:3]} (scripts/seed_ledger.py --overwrite)"


def _one_invocation(entries: list[tuple[str, Any]], runs: list[dict[str, Any]] | None = None) -> bool:
    """Every digest of a file's seed came from one command: one digest, or sibling experiments one command wrote
    to one file (the reference eval's sweep and gate): the file's runs on that seed carry one command line and one
    run per experiment name. A renamed or changed method re-scoring the seed repeats an experiment (or a command)."""
    if len({e.digest for _, e in entries}) == 1:
        return True
    if runs is None:
        file, seed = entries[0][1].file, entries[0][1].seed
        runs = [r for r in P.read_runs(P.REPO / file) if seed in ((r.get("provenance") or {}).get("seeds") or [])]
    provs = [r.get("provenance") or {} for r in runs]
    names = [(p.get("settings") or {}).get("experiment") for p in provs]
    return (len(runs) == len({e.digest for _, e in entries}) and None not in names and len(set(names)) == len(names)
            and len({p.get("command") for p in provs}) == 1)


def _run(experiment: str, command: str = "python -m kvstate.lab.report.eval_section --seed 1074") -> dict[str, Any]:
    return {"provenance": {"seeds": [1074], "command": command, "settings": {"experiment": experiment}}}


def test_sibling_experiments_of_one_command_are_one_scoring_and_a_renamed_method_is_not():
    e = L.Entry  # (seed, file, commit, date, digest)
    gate, sweep = e(1074, "f.json", "abc", "d", "d1"), e(1074, "f.json", "abc", "d", "d2")
    two = [("m:full:reference-gate", gate), ("m:full:reference-sweep", sweep)]
    assert _one_invocation(two, [_run("reference-sweep"), _run("reference-gate")])
    assert not _one_invocation(two, [_run("sekv-eval"), _run("sekv-eval")])  # a rerun of one experiment
    assert not _one_invocation(two, [_run("a"), _run("b", command="another command")])
    assert not _one_invocation(two, [_run("a")])  # a digest the file's runs do not account for


# (file, seed) pairs scored by two different runs before this check existed: kept as history, never extended
RESCORED_BEFORE_THE_CHECK = {
    ("models/ref-attn-cla2/depth_eval.json", 1000), ("models/ref-attn-norouting/depth_eval.json", 1000),
    ("models/ref-attn-rcla/depth_eval.json", 1000), ("models/ref-attn-rcla075/depth_eval.json", 1000),
    ("models/ref-attn/depth_eval.json", 1000), ("models/ref-attn-ft/reference_eval.json", 1234),
    ("models/ref-attn-ft/reference_eval.json", 1235), ("models/ref-attn-ft2/reference_eval.json", 1234),
    ("models/ref-attn-ft2/reference_eval.json", 1235), ("models/ref-attn/reference_eval.json", 1234),
    ("models/ref-attn/reference_eval.json", 1235), ("models/ref-hybrid/reference_eval.json", 1234),
    ("models/ref-hybrid/reference_eval.json", 1235),
}


def test_no_committed_result_file_scores_a_test_seed_with_two_different_runs():
    """A headline takes a test seed never scored for its result file: renaming a method (``sekv`` ->
    ``sekv@0.125``) or adding one gives the run a new digest, and the per-method ledger check alone would let it
    reuse the file's seed. Checked here over the committed ledger rather than in ``kvstate.lab.ledger`` itself,
    whose source every committed run executed (an edit there marks them all stale)."""
    ledger = L.read_ledger(L.results_root() / L.LEDGER_NAME)
    scored: dict[tuple[str, int], list[tuple[str, Any]]] = {}
    for m, es in ledger.items():
        for e in es:
            scored.setdefault((e.file, e.seed), []).append((m, e))
    twice = sorted(k for k, es in scored.items() if not _one_invocation(es) and k not in RESCORED_BEFORE_THE_CHECK)
    assert not twice, (f"test seeds scored twice for one result file by different runs: {twice[:3]}; rerun "
                       "on a fresh test seed")
