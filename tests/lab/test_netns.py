"""A private network namespace whose loopback the kernel shapes: achieved rate, refused rates, the guard."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvstate.lab.netns import (
    LinkError,
    ShapedLink,
    in_private_namespace,
    namespace_argv,
    namespace_support,
)

_INSIDE = """
import json
from kvstate.lab.netns import LinkError, ShapedLink, measure_rate, shape_loopback
out = {"qdisc": shape_loopback(ShapedLink(0.1)), "gbit_s": measure_rate(4_000_000)}
try:
    shape_loopback(ShapedLink(0.1, device="nosuchdev"))
except LinkError as exc:
    out["refused"] = str(exc)
print(json.dumps(out))
"""


def test_rates_out_of_range_raise_one_clear_error() -> None:
    for bad in (0, -1, 1000.0, float("nan"), True):
        with pytest.raises(LinkError, match=r"--rate.*Gbit/s"):
            ShapedLink(bad)  # type: ignore[arg-type]
    link = ShapedLink(1.0)
    assert link.tc_argv()[-6:] == ["rate", "1000000000bit", "burst", "131072", "latency", "50ms"]
    assert ShapedLink(10.0).burst_bytes == 1_250_000  # 1 ms at 10 Gbit/s


def test_this_process_is_not_in_a_private_namespace() -> None:
    assert in_private_namespace() is False  # shape_loopback would refuse to shape this machine's own loopback


def test_loopback_in_a_namespace_achieves_the_set_rate() -> None:
    why = namespace_support()
    if why is not None:
        pytest.skip(why)
    res = subprocess.run(namespace_argv([sys.executable, "-c", _INSIDE]), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert "tbf" in out["qdisc"] and "100Mbit" in out["qdisc"]
    assert 0.08 <= out["gbit_s"] <= 0.12  # within 20% of the set 0.1 Gbit/s
    assert "the kernel refused `ip link set nosuchdev up`" in out["refused"]
