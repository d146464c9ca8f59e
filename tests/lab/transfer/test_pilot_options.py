"""The dev-seed pilot of the transfer options refuses test seeds and result paths under models/ before any work."""

from __future__ import annotations

import pytest

from kvstate.lab.transfer.pilot_options import ROWS, main


def test_pilot_refuses_test_seeds_and_models_dir() -> None:
    with pytest.raises(SystemExit, match="dev seeds only"):
        main(["--seed", "1000"])
    with pytest.raises(SystemExit, match="never go under models/"):
        main(["--out", "models/codec-ref-attn-ft2/pilot.json"])
    names = [m for m, _ in ROWS]
    assert names[0] == "oracle" and len(names) == len(set(names))
    assert {"recompute", "nonlinear", "adapter", "combined", "droidspeak", "scd", "reuse", "raw"} <= set(names)


def test_timing_refuses_models_dir() -> None:
    from kvstate.lab.transfer.pilot_options_timing import main as timing_main

    with pytest.raises(SystemExit, match="never go under models/"):
        timing_main(["--out", "models/codec-ref-attn-ft2/timing.json"])
