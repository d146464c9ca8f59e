"""kvstate.lab — what trains, evaluates, benchmarks, writes cards and the report.

The library (``kvstate.models``, ``prefix``, ``depth``, ``semantic``, ``transfer``) never imports this
package; the lab stands on the library. Shared pieces live here once: the decode loop and perplexity
(:mod:`kvstate.lab.harness`), statistics (:mod:`kvstate.lab.stats`), provenance of result files
(:mod:`kvstate.lab.provenance`), the test-seed ledger it checks (:mod:`kvstate.lab.ledger`), list parsing (:mod:`kvstate.lab.lists`), progress bars
(:mod:`kvstate.lab.progress`), where a command's output goes (:mod:`kvstate.lab.cli_output`), the
synthetic workloads (:mod:`kvstate.lab.workloads`), the reference models' training
(:mod:`kvstate.lab.training`), the report (:mod:`kvstate.lab.report`), and one slice per axis
(``lab/<axis>/``: train / bench / card / section / cli).
"""
