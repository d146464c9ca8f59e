"""A real rate-limited link on one machine: a private network namespace whose loopback the kernel shapes.

A command runs in a new network namespace (``unshare --net``; root or ``CAP_SYS_ADMIN``) and, first thing
inside it, :func:`shape_loopback` brings ``lo`` up under the kernel's token bucket filter (``tc qdisc
... tbf``, tc-tbf(8)). Every process the command starts shares that namespace, so a producer and a
consumer talking over 127.0.0.1 there cross a link of the set rate, and nothing outside is affected
(:func:`shape_loopback` refuses to run in the machine's own namespace). :func:`measure_rate` times a bulk
TCP transfer, the rate actually achieved (CPU-bound above a few Gbit/s on a busy machine). Where
namespaces are not permitted, :func:`namespace_support` gives the reason and callers skip the shaped
runs. Ignored: delay / loss emulation (netem), shaping between two machines.
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass

from kvstate.errors import KVStateError
from kvstate.validate import check_float

MIN_GBIT, MAX_GBIT = 0.001, 100.0  # beyond 100 Gbit/s tc computes a zero-byte burst and the link stalls
_TOOLS = ("unshare", "ip", "tc")
OUTER_ENV = "KVSTATE_OUTER_NETNS"  # the network namespace a namespace_argv command was started from


class LinkError(KVStateError):
    """A shaped link that cannot be set up: a rate out of range, or one the kernel refuses."""


@dataclass(frozen=True)
class ShapedLink:
    """The token bucket on a namespace's loopback."""

    rate_gbit: float  # the rate the kernel enforces, Gbit/s (10^9 bit/s)
    latency_ms: float = 50.0  # how long a packet may wait in the bucket's queue (bounds the queue's bytes)
    device: str = "lo"

    def __post_init__(self) -> None:
        check_float("ShapedLink.rate_gbit (--rate)", self.rate_gbit, MIN_GBIT, MAX_GBIT, error=LinkError,
                    hint=" Gbit/s; beyond that range tc computes a broken token bucket")
        check_float("ShapedLink.latency_ms", self.latency_ms, 1.0, 10_000.0, error=LinkError)

    @property
    def rate_bits(self) -> int:
        return round(self.rate_gbit * 1e9)

    @property
    def burst_bytes(self) -> int:
        """The bucket: 1 ms of traffic, at least 128 KiB (two 64 KiB loopback packets must fit)."""
        return max(128 << 10, self.rate_bits // 8 // 1000)

    def tc_argv(self) -> list[str]:
        return ["tc", "qdisc", "replace", "dev", self.device, "root", "tbf", "rate", f"{self.rate_bits}bit",
                "burst", str(self.burst_bytes), "latency", f"{self.latency_ms:g}ms"]


def _netns(pid: str = "self") -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def namespace_argv(argv: list[str]) -> list[str]:
    """``argv`` run in a new network namespace (only ``lo``, down until :func:`shape_loopback`); the
    namespace it leaves is passed on, so that :func:`shape_loopback` can tell it has left it."""
    return ["env", f"{OUTER_ENV}={_netns() or ''}", "unshare", "--net", "--", *argv]


@functools.cache
def namespace_support() -> str | None:
    """None when this process may create a network namespace and shape its loopback; else the reason."""
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} not installed (util-linux, iproute2)"
    probe = ShapedLink(1.0).tc_argv()
    try:
        res = subprocess.run(namespace_argv(["sh", "-c", f"ip link set lo up && {' '.join(probe)}"]),
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare --net failed: {exc}"
    if res.returncode != 0:
        why = " ".join((res.stderr or res.stdout).split())[:300]
        return f"a private network namespace with a shaped loopback is not permitted here (needs root): {why}"
    return None


def in_private_namespace() -> bool:
    """Whether this process was started by :func:`namespace_argv` and runs in another network namespace
    than the one it was started from (and than pid 1's, where that is readable)."""
    me, outer = _netns(), os.environ.get(OUTER_ENV)
    return bool(me and outer and me != outer and me != _netns("1"))


def shape_loopback(link: ShapedLink) -> str:
    """Bring ``lo`` up under ``link``'s token bucket; returns ``tc qdisc show`` of the device. Raises
    :class:`LinkError` when the kernel refuses, or when this is the machine's own namespace."""
    if not in_private_namespace():
        raise LinkError("shape_loopback runs only inside a private network namespace (start the command with "
                        "kvstate.lab.netns.namespace_argv); it would shape this machine's own loopback")
    for argv in (["ip", "link", "set", link.device, "up"], link.tc_argv()):
        res = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        if res.returncode != 0:
            why = " ".join((res.stderr or res.stdout).split())[:300]
            raise LinkError(f"the kernel refused `{' '.join(argv)}`: {why}; pick a rate in "
                            f"{MIN_GBIT:g}..{MAX_GBIT:g} Gbit/s on an existing device")
    shown = subprocess.run(["tc", "qdisc", "show", "dev", link.device], capture_output=True, text=True,
                           timeout=30).stdout.strip()
    if " tbf " not in f" {shown} " or " burst 0b" in shown:
        raise LinkError(f"the kernel did not install a working token bucket at {link.rate_gbit:g} Gbit/s "
                        f"(tc shows {shown!r}); pick a rate in {MIN_GBIT:g}..{MAX_GBIT:g} Gbit/s")
    return shown


def measure_rate(nbytes: int, timeout: float = 120.0) -> float:
    """Gbit/s of one bulk TCP transfer of ``nbytes`` over 127.0.0.1 (first byte asked -> last byte read)."""
    chunk = b"\0" * (1 << 20)
    with socket.create_server(("127.0.0.1", 0)) as srv:
        srv.settimeout(timeout)

        def send() -> None:
            conn, _ = srv.accept()
            with conn:
                view, left = memoryview(chunk), nbytes
                while left > 0:
                    left -= conn.send(view[: min(left, len(chunk))])

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        got = 0
        with socket.create_connection(srv.getsockname(), timeout=timeout) as c:
            t0 = time.perf_counter()
            while got < nbytes:
                data = c.recv(1 << 20)
                if not data:
                    break
                got += len(data)
            dt = time.perf_counter() - t0
        sender.join(timeout)
    if got != nbytes:
        raise LinkError(f"bulk transfer over the link delivered {got:,} of {nbytes:,} bytes")
    return got * 8 / dt / 1e9
