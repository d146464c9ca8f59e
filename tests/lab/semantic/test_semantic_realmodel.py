"""The real-model resolution run: every set names registered runs, and each test set carries issue 48's two 8:1
targets for its own proposed configuration (none without the full cache and the equal-memory twin)."""

from kvstate.lab.semantic import methods as registry
from kvstate.lab.semantic import realmodel as R


def test_every_set_names_registered_runs():
    for labels in R.SETS.values():
        for lab in labels:
            registry.get(R.RUNS[lab].method)


def test_each_test_set_targets_its_proposed_configuration():
    for name, proposed in (("test", R.PROPOSED), ("test_pages", R.PROPOSED_PAGES)):
        t = R.targets(R.SETS[name])
        assert [(x.method, x.against, x.threshold) for x in t] == [(proposed, "full", -0.05 * R.FULL_2K),
                                                                  (proposed, R.TWIN, -0.02)]
    assert R.targets(("full", R.PROPOSED_PAGES)) == () and R.targets(("full", R.TWIN, "kivi@0.25")) == ()
