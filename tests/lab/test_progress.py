"""The one progress convention: stderr only, plain lines off a terminal, nothing when disabled."""

from __future__ import annotations

from rich.console import Console

from kvstate.lab.progress import progress_bar


def test_off_a_terminal_one_final_line_on_stderr(capsys):
    with progress_bar("eval", 3, unit="ex") as bar:
        for _ in range(3):
            bar.advance()
        bar.note("last")
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [err.splitlines()[0]] and err.startswith("eval: 3/3 ex (") and "last" in err


def test_off_a_terminal_lines_every_interval(capsys):
    with progress_bar("train", 10, unit="s", interval=0.0) as bar:
        bar.set(4)
        bar.set(9)
    out, err = capsys.readouterr()
    assert out == "" and [line.split(" (")[0] for line in err.splitlines()] == ["train: 4/10 s", "train: 9/10 s",
                                                                                "train: 9/10 s"]


def test_disabled_prints_nothing(capsys):
    bar = progress_bar("eval", 2, enabled=False)
    bar.advance(2)
    bar.close()
    assert capsys.readouterr() == ("", "") and bar.done == 2


def test_on_a_terminal_the_rich_bar_writes_to_stderr_only(capsys, monkeypatch):
    monkeypatch.setattr(Console, "is_terminal", property(lambda self: True))
    with progress_bar("replay", 2, unit="requests") as bar:
        bar.advance()
        bar.advance()
    out, err = capsys.readouterr()
    assert out == "" and "replay" in err
