"""The journal of a long measurement: finished units read back, a torn line dropped, another run's
journal set aside, wall time summed over parts."""

import json

from kvstate.lab.journal import Journal, identity, journal_path


def _ident(**settings):
    return identity(settings, ["lab/journal.py"], [])


def test_units_read_back_by_a_rerun_of_the_same_run(tmp_path):
    path = journal_path(tmp_path / "eval.json")
    assert path.name == ".eval.json.journal"
    j = Journal(path, _ident(n=3))
    assert j.resumed == 0 and j.get("a") is None
    j.put("a", {"x": [1, 2]})
    j.put("b", [float("nan")])
    j.close(remove=False)
    again = Journal(path, _ident(n=3))
    assert again.resumed == 2 and again.get("a") == {"x": [1, 2]} and again.get("c") is None
    assert again.parts == 2
    prov = again.stamp({"wall_seconds": 10.0})
    assert prov["parts"] == 2 and prov["resumed_units"] == 2 and prov["wall_seconds"] >= 10.0
    again.put("c", 3)
    again.close()
    assert not path.exists()


def test_a_line_cut_by_a_kill_is_dropped(tmp_path):
    path = tmp_path / ".r.journal"
    j = Journal(path, _ident(n=1))
    j.put("a", 1)
    j.close(remove=False)
    with open(path, "a") as fh:
        fh.write('{"unit": "b", "rec')  # the kill came mid-write
    again = Journal(path, _ident(n=1))
    assert again.resumed == 1 and again.get("b") is None
    again.put("b", 2)  # appended after the torn line: the next reader still sees both
    again.close(remove=False)
    third = Journal(path, _ident(n=1))
    assert third.get("a") == 1 and third.get("b") == 2


def test_a_journal_of_another_run_is_set_aside_never_mixed_in(tmp_path):
    path = tmp_path / ".r.journal"
    j = Journal(path, _ident(n=1))
    j.put("a", 1)
    j.close(remove=False)
    other = Journal(path, _ident(n=2))
    assert other.resumed == 0 and other.get("a") is None
    assert other.set_aside is not None and other.set_aside.is_file() and not path.exists()
    head = json.loads(other.set_aside.read_text().splitlines()[0])
    assert head["identity"]["settings"] == {"n": 1}
    garbage = tmp_path / ".g.journal"
    garbage.write_text("not json\n")
    assert Journal(garbage, _ident(n=1)).set_aside is not None


def test_a_journal_set_aside_twice_keeps_both(tmp_path):
    path = tmp_path / ".r.journal"
    kept = []
    for n in (1, 2, 3):
        j = Journal(path, _ident(n=n))
        j.put(f"unit{n}", n)
        j.close(remove=False)
        other = Journal(path, _ident(n=0))  # another run: the journal of run n is set aside
        kept.append(other.set_aside)
    assert len(set(kept)) == 3 and all(p is not None and p.is_file() for p in kept)
    assert [json.loads(p.read_text().splitlines()[1])["records"] for p in kept] == [1, 2, 3]
