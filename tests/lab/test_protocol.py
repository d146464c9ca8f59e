"""The protocol's pieces: which tasks enter a pooled score, and which seeds a reported run may use."""

import pytest

from kvstate.errors import KVStateError
from kvstate.lab import protocol


def test_only_tasks_the_reference_solves_are_pooled_and_the_rest_shown_beside():
    reference = {"niah_single": [1] * 10, "niah_multivalue": [1] * 4 + [0] * 6, "niah_4q": [1] * 9 + [0], "empty": []}
    p = protocol.solved_tasks(reference)
    assert p.solved == ["niah_single", "niah_4q"]
    assert p.excluded == {"niah_multivalue": pytest.approx(0.4), "empty": 0.0}
    method = {"niah_single": [1] * 10, "niah_multivalue": [0] * 10, "niah_4q": [0] * 10, "empty": []}
    assert p.pool(method) == [1.0] * 10 + [0.0] * 10  # the unsolved task's zeros never reach the pooled score
    with pytest.raises(KVStateError, match="niah_4q"):
        p.pool({"niah_single": [1] * 10})
    cells = {("niah_single", 1024): [1, 1], ("niah_single", 4096): [1, 0]}
    assert protocol.solved_cells(cells) == [("niah_single", 1024)]


def test_a_dev_seed_is_refused_with_a_fresh_seed_named():
    protocol.check_reported_seed(1000)
    with pytest.raises(KVStateError, match=r"--seed 3 is a dev seed.*e\.g\. --seed 1002"):
        protocol.check_reported_seed(3, fresh=1002)
