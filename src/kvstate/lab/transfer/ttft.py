"""Time to first token measured end to end: producer and consumer as separate processes over a shaped link.

For *Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching*
(``docs/techniques.md#across-models``) and its baselines. Per link rate, one process is started in a
private network namespace whose loopback the kernel rate-limits (:mod:`kvstate.lab.netns`); it measures
the rate a bulk transfer achieves, starts a Redis store on a unix socket next to the producers (so the
store is not on the shaped link), one ``kvstate transfer serve --method M`` process per method, loads
the consumer and times, for every prompt (one per repeat and length, interleaved, the order of methods
rotated per repeat):

- ``cold``: request -> producer prefill + encode (a store miss) -> wire -> consumer parse + decode ->
  the last prompt token on the consumer -> first token;
- ``warm``: the same request again, the payload now in the store (no producer prefill);
- ``oracle``: the consumer's own prefill of the whole prompt -> first token, timed the same way (its
  row holds that time under both ``cold`` and ``warm``: it uses no link).

Rows (method, length) carry ``ttft_ms: {rate: {"cold", "warm"}}`` (medians), their spread, the parts
(fetch, the producer's encode, decode, first token), the payload bytes and ``achieved_gbit_s``: the
shape of ``kvstate transfer bench`` rows. Where namespaces are not permitted, the shaped rates are skipped
with the reason (``skipped``), never estimated; ``unshaped`` adds plain loopback in the caller's own
namespace. Ignored: concurrent requests, a producer on another machine, batch > 1.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvstate.errors import KVStateError
from kvstate.lab.netns import (
    LinkError,
    ShapedLink,
    measure_rate,
    namespace_argv,
    namespace_support,
    shape_loopback,
)
from kvstate.validate import check_float, check_int

UNSHAPED = "loopback"  # the rate key of plain, unshaped loopback
STORE_NOTE = "Redis on a unix socket next to the producers (not on the shaped link)"


@dataclass(frozen=True)
class TTFTConfig:
    rates_gbit: tuple[float, ...] = (0.1, 1.0, 10.0)  # shaped link rates
    lengths: tuple[int, ...] = (1024, 4096, 8192)  # prompt tokens
    repeats: int = 5  # prompts per length (each timed cold, warm and oracle)
    methods: tuple[str, ...] = ()  # () = every registered method that ships a payload
    seed: int = 0
    unshaped: bool = False  # also measure plain loopback in this namespace
    bulk_s: float = 0.5  # seconds of the bulk transfer that measures the achieved rate
    timeout_s: float = 600.0  # per request
    start_timeout_s: float = 300.0  # for the servers to load
    options: dict[str, dict[str, str]] = field(default_factory=dict)  # method -> its --option KEY=VALUE (profiled)

    def __post_init__(self) -> None:
        for r in self.rates_gbit:
            ShapedLink(r)
        if not self.rates_gbit and not self.unshaped:
            raise KVStateError("TTFTConfig: no link to measure; pass --rate and/or --unshaped")
        if len(set(self.rates_gbit)) != len(self.rates_gbit) or len(set(self.lengths)) != len(self.lengths):
            raise KVStateError(f"TTFTConfig: rates {self.rates_gbit} / lengths {self.lengths} repeat a value")
        if not self.lengths:
            raise KVStateError("TTFTConfig.lengths (--length): pass at least one prompt length")
        for n in self.lengths:
            check_int("TTFTConfig.lengths[] (--length)", n, 2, 1 << 20, error=KVStateError)
        check_int("TTFTConfig.repeats (--repeats)", self.repeats, 1, 1000, error=KVStateError)
        check_int("TTFTConfig.seed (--seed)", self.seed, 0, 2**31, error=KVStateError)
        from kvstate.transfer import methods as registry

        for m in self.methods:
            registry.get(m, shipped_only=True)
        for m, opts in self.options.items():
            keys = registry.get(m, option="TTFTConfig.options").option_keys
            bad = sorted(set(opts) - set(keys))
            if bad:
                raise KVStateError(f"TTFTConfig.options: --method {m} takes no option {', '.join(bad)} "
                                   f"(it takes {', '.join(keys) or 'none'})")
        if len(set(self.methods)) != len(self.methods):
            raise KVStateError(f"TTFTConfig.methods {self.methods} repeat a method")
        check_float("TTFTConfig.bulk_s", self.bulk_s, 0.05, 60.0, error=KVStateError)
        check_float("TTFTConfig.timeout_s", self.timeout_s, 1.0, 86400.0, error=KVStateError)
        check_float("TTFTConfig.start_timeout_s", self.start_timeout_s, 1.0, 86400.0, error=KVStateError)

    @property
    def method_list(self) -> tuple[str, ...]:
        from kvstate.transfer import methods as registry

        return self.methods or registry.served_methods()


def rate_key(rate: float | None) -> str:
    return UNSHAPED if rate is None else f"{rate:g}"


def bulk_bytes(rate: float | None, seconds: float) -> int:
    """Bytes of the bulk transfer: ``seconds`` at the set rate (unshaped: 256 MiB), within 1 MiB..512 MiB."""
    n = (256 << 20) if rate is None else int(rate * 1e9 / 8 * seconds)
    return min(max(n, 1 << 20), 512 << 20)


def profiled_options(run: dict[str, Any]) -> dict[str, dict[str, str]]:
    """The options each method's offline profiling chose in one bench run (``method_options``); a run written
    before methods were registered kept only DroidSpeak's block, as ``droidspeak_block`` [a, b]."""
    if isinstance(run.get("method_options"), dict):
        return {m: {k: str(v) for k, v in o.items()} for m, o in run["method_options"].items()}
    block = run.get("droidspeak_block")
    return {"droidspeak": {"block": f"{block[0]}:{block[1]}"}} if isinstance(block, list) and len(block) == 2 else {}


def method_options(value: str, codec_dir: Path, methods: Sequence[str] = ()) -> dict[str, dict[str, str]]:
    """``--options``: ``auto`` reads what the bench's profiling chose for this codec's pair (the newest run of
    ``CODEC/bench.json``; none there: every method's defaults), ``none`` is every method's defaults, else
    ``METHOD.KEY=VALUE`` pairs, comma-separated. A profiled ``artifact`` that no longer exists (the bench keeps
    its profiles in a temporary directory) is an error for the ``methods`` measured: it names
    ``kvstate transfer profile``, whose file an explicit ``METHOD.artifact=PATH`` then points to."""
    from kvstate.lab.provenance import read_runs
    from kvstate.transfer import methods as registry

    if value == "none":
        return {}
    if value == "auto":
        bench = codec_dir / "bench.json"
        runs = read_runs(bench) if bench.is_file() else []
        out = profiled_options(runs[-1]) if runs else {}
        for m, opts in out.items():
            path = opts.get("artifact")
            if (not methods or m in methods) and path is not None and not Path(path).is_file():
                raise KVStateError(
                    f"--options auto: {m}'s profiled artifact {path} is gone (the bench profiles into a temporary "
                    f"directory); run `kvstate transfer profile --method {m} --codec {codec_dir} --out DIR` and pass "
                    f"--options {m}.artifact=DIR/{m}.safetensors")
        return out
    out = {}
    for part in filter(None, (x.strip() for x in value.split(","))):
        head, eq, v = part.partition("=")
        m, dot, key = head.partition(".")
        if not eq or not dot:
            raise registry.MethodError(f"--options {part!r} must be METHOD.KEY=VALUE (e.g. droidspeak.block=1:4), "
                                       "'auto' or 'none'")
        registry.get(m, option="--options")
        out.setdefault(m, {})[key] = v
    return out


# --- the consumer process, inside the namespace ------------------------------------------------------


def first_token(model: Any, ids: Sequence[int], cache: Any = None) -> int:
    """The greedy first new token after ``ids``: the last prompt token on ``cache`` (holding all the others),
    or the whole prompt on a fresh cache (the consumer's own prefill)."""
    import torch
    from transformers import DynamicCache

    start = 0 if cache is None else len(ids) - 1
    cache = DynamicCache(config=model.config) if cache is None else cache
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([list(ids[start:])]), position_ids=torch.arange(start, len(ids))[None],
                    cache=cache, use_cache=True, logits_to_keep=1)
    return int(out.logits[0, -1].argmax())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return " ".join(path.read_text(errors="replace")[-n:].split())
    except OSError:
        return ""


class _Redis:
    """A redis-server on a unix socket in ``root`` (None when redis-server is not installed)."""

    def __init__(self, root: Path) -> None:
        self.exe, self.sock, self.proc = shutil.which("redis-server"), root / "redis.sock", None
        self.url = f"unix://{self.sock}?db=0"

    def __enter__(self) -> _Redis:
        if self.exe is None:
            return self
        self.proc = subprocess.Popen([self.exe, "--port", "0", "--unixsocket", str(self.sock), "--unixsocketperm", "700",
                                      "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        from kvstate.transfer.store import RedisStore, StoreError

        deadline = time.time() + 20
        while True:
            try:
                RedisStore(self.url, timeout_s=1.0).close()
                return self
            except StoreError:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise KVStateError(f"redis-server did not start on {self.sock}") from None
                time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


def _env() -> dict[str, str]:
    """This process's environment with this kvstate first on the path (servers import the same code)."""
    src = str(Path(__file__).resolve().parents[3])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])}


def _start_servers(spec: dict[str, Any], store: str, root: Path) -> dict[str, tuple[str, subprocess.Popen[bytes], Path]]:
    servers = {}
    for m in spec["methods"]:
        port, log = _free_port(), root / f"serve-{m}.log"
        argv = [sys.executable, "-m", "kvstate.cli", "transfer", "serve", "--producer", spec["producer"], "--codec",
                spec["codec"], "--method", m, "--port", str(port), "--store", store, "--threads", "1",
                "--max-tokens", str(max(spec["lengths"]))]
        for key, value in sorted(((spec.get("options") or {}).get(m) or {}).items()):
            argv += ["--option", f"{key}={value}"]
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=_env())
        servers[m] = (f"127.0.0.1:{port}", proc, log)
    return servers


def _wait_ready(servers: dict[str, tuple[str, subprocess.Popen[bytes], Path]], timeout: float) -> None:
    from kvstate.transfer.transport import TransportError, hello

    deadline = time.time() + timeout
    for m, (addr, proc, log) in servers.items():
        while True:
            try:
                hello(addr, timeout=5)
                break
            except TransportError:
                if proc.poll() is not None or time.time() > deadline:
                    raise KVStateError(f"`kvstate transfer serve --method {m}` did not come up on {addr}: "
                                       f"{_tail(log)}") from None
                time.sleep(0.2)


def _prompts(tokenizer: Any, lengths: Sequence[int], n: int, seed: int) -> dict[int, list[list[int]]]:
    """``n`` distinct prompts of exactly L tokens (held-out text) per length: the workload's text is asked for a
    little more than L (a tokenizer other than the reference models' may split it into fewer tokens) and cut."""
    from kvstate.lab.workloads.tasks import generate

    out = {}
    for length in lengths:
        ids = [tokenizer(ex.prompt)["input_ids"][:length]
               for ex in generate("text", length + length // 16 + 16, n, seed, tokenizer)]
        if any(len(x) != length for x in ids) or len({tuple(x) for x in ids}) != n:
            raise KVStateError(f"the text workload gave prompts of {sorted({len(x) for x in ids})} tokens at length "
                               f"{length}; pass other --length values")
        out[length] = ids
    return out


def _timed_fetch(consumer: Any, receiver: Any, server: str, ids: list[int], timeout: float,
                 cached: bool) -> dict[str, Any]:
    from kvstate.transfer.transport import fetch_payload

    t0 = time.perf_counter()
    payload, head = fetch_payload(server, ids[:-1], receiver.pair, timeout)
    t1 = time.perf_counter()
    cache = receiver.decode(payload, ids)
    t2 = time.perf_counter()
    token = first_token(consumer, ids, cache)
    t3 = time.perf_counter()
    if bool(head["cached"]) != cached:
        raise KVStateError(f"the producer at {server} answered {'from' if head['cached'] else 'without'} its store "
                           f"where a {'warm' if cached else 'cold'} request was meant; is another bench using its store?")
    return {"total": 1e3 * (t3 - t0), "fetch": 1e3 * (t1 - t0), "producer": float(head["encode_ms"]),
            "decode": 1e3 * (t2 - t1), "first_token": 1e3 * (t3 - t2), "bytes": int(head["bytes"]), "token": token}


def measure_inside(spec: dict[str, Any], log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The measurement of one link (run in its namespace when ``spec["rate"]`` is set)."""
    import torch

    from kvstate.lab.harness import load_reference
    from kvstate.transfer import methods as registry
    from kvstate.transfer.codec import Codec

    torch.set_num_threads(1)
    rate = spec["rate"]
    qdisc = shape_loopback(ShapedLink(rate)) if rate is not None else ""
    nbytes = bulk_bytes(rate, spec["bulk_s"])
    achieved = measure_rate(nbytes)
    log(f"link {rate_key(rate)}: achieved {achieved:.3f} Gbit/s over {nbytes:,} B")
    with tempfile.TemporaryDirectory(prefix="kvstate-ttft-") as tmp, _Redis(Path(tmp)) as redis:
        store = redis.url if redis.proc is not None else "memory://"
        servers = _start_servers(spec, store, Path(tmp))
        try:
            codec = Codec.load(spec["codec"])
            consumer, tok = load_reference(spec["consumer"])
            receivers = {m: registry.receiver(m, consumer, registry.MethodContext(
                codec=codec, codec_dir=Path(spec["codec"]), options=(spec.get("options") or {}).get(m) or {}))
                for m in spec["methods"]}
            _wait_ready(servers, spec["start_timeout_s"])
            n = spec["repeats"]
            prompts = _prompts(tok, spec["lengths"], n + 1, spec["seed"])  # the last: warm-up only
            samples: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}
            ref = registry.reference()
            order = [ref, *spec["methods"]]
            for length in spec["lengths"]:
                for r in [n, *range(n)]:  # warm-up first, not recorded
                    ids = prompts[length][r]
                    for m in order[r % len(order):] + order[:r % len(order)]:
                        cell = samples.setdefault(m, {}).setdefault(str(length), {"cold": [], "warm": []})
                        if m == ref:
                            t0 = time.perf_counter()
                            token = first_token(consumer, ids)
                            ms = 1e3 * (time.perf_counter() - t0)
                            got = {"cold": {"total": ms, "prefill": ms, "token": token}}
                            got["warm"] = got["cold"]
                        else:
                            addr = servers[m][0]
                            got = {"cold": _timed_fetch(consumer, receivers[m], addr, ids, spec["timeout_s"], False),
                                   "warm": _timed_fetch(consumer, receivers[m], addr, ids, spec["timeout_s"], True)}
                        if r < n:
                            for mode in ("cold", "warm"):
                                cell[mode].append({**got[mode], "repeat": r})
                    log(f"link {rate_key(rate)}: length {length} repeat {r + 1 if r < n else 'warm-up'}")
        finally:
            for _addr, proc, _log in servers.values():
                proc.terminate()
            for _addr, proc, _log in servers.values():
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return {"rate_gbit": rate, "achieved_gbit_s": achieved, "bulk_bytes": nbytes, "qdisc": qdisc,
            "store": STORE_NOTE if store != "memory://" else "memory:// in the producer (redis-server not installed)",
            "samples": samples}


def _main(argv: Sequence[str]) -> int:
    """``python -m kvstate.lab.transfer.ttft SPEC OUT``: measure one link, write the JSON to OUT."""
    spec_path, out_path = argv
    spec = json.loads(Path(spec_path).read_text())
    try:
        result: dict[str, Any] = measure_inside(spec, log=lambda s: print(s, file=sys.stderr, flush=True))
    except KVStateError as exc:
        result = {"error": str(exc), "type": type(exc).__name__}
    Path(out_path).write_text(json.dumps(result))
    return 0 if "error" not in result else 2


# --- the caller: one namespace per rate, rows -------------------------------------------------------


def check_positions(lengths: Sequence[int], *dirs: str | Path) -> int | None:
    """The smallest ``max_position_embeddings`` of the models; :class:`KVStateError` for a longer prompt."""
    from kvstate.models.families import text_config
    from kvstate.models.loading import load_config

    limits = [getattr(text_config(load_config(d)), "max_position_embeddings", None) for d in dirs]
    known = [x for x in limits if isinstance(x, int)]
    limit = min(known) if known else None
    for length in lengths:
        if limit is not None and length > limit:
            raise KVStateError(f"--length {length:,} exceeds the models' max_position_embeddings={limit:,}; pass "
                               f"--length <= {limit:,}")
    return limit


def run_link(spec: dict[str, Any], shaped: bool, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Measure one link in a child process (in a new network namespace when ``shaped``)."""
    with tempfile.TemporaryDirectory(prefix="kvstate-ttft-spec-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        argv = [sys.executable, "-m", "kvstate.lab.transfer.ttft", str(spec_path), str(out_path)]
        proc = subprocess.Popen(namespace_argv(argv) if shaped else argv, env=_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("link "):
                log(line.strip())
        proc.wait()
        if not out_path.is_file():
            raise KVStateError(f"the TTFT measurement of link {rate_key(spec['rate'])} died (exit {proc.returncode}): "
                               f"{' '.join(''.join(lines[-30:]).split())[-1500:]}")
        result = json.loads(out_path.read_text())
    if "error" in result:
        raise (LinkError if result.get("type") == "LinkError" else KVStateError)(result["error"])
    return dict(result)


def _median(xs: Sequence[float]) -> float:
    return round(statistics.median(xs), 3)


def rows_from(links: dict[str, dict[str, Any]], methods: Sequence[str], lengths: Sequence[int]) -> list[dict[str, Any]]:
    """One row per (method, length) over every measured link (medians, spread, parts)."""
    from kvstate.transfer import methods as registry

    ref = registry.reference()
    rows = []
    for m in [ref, *methods]:
        for length in lengths:
            row: dict[str, Any] = {"method": m, "length": length, "ttft_ms": {}, "ttft_range_ms": {},
                                   "parts_ms": {}, "achieved_gbit_s": {}}
            for key, link in links.items():
                cell = link["samples"][m][str(length)]
                row["n"] = len(cell["cold"])
                row["ttft_ms"][key] = {mode: _median([s["total"] for s in cell[mode]]) for mode in ("cold", "warm")}
                row["ttft_range_ms"][key] = {mode: [round(min(s["total"] for s in cell[mode]), 3),
                                                    round(max(s["total"] for s in cell[mode]), 3)]
                                             for mode in ("cold", "warm")}
                parts = ("prefill",) if m == ref else ("fetch", "producer", "decode", "first_token")
                row["parts_ms"][key] = {mode: {p: _median([s[p] for s in cell[mode]]) for p in parts}
                                        for mode in ("cold", "warm")}
                row["achieved_gbit_s"][key] = round(link["achieved_gbit_s"], 4)
                if m != ref:
                    row["payload_bytes"] = int(statistics.median(s["bytes"] for s in cell["cold"]))
                    row["payload_bytes_per_token"] = round(row["payload_bytes"] / (length - 1), 2)
                    oracle = {s["repeat"]: s["token"] for s in links[key]["samples"][ref][str(length)]["cold"]}
                    same = [s["token"] == oracle[s["repeat"]] for s in cell["cold"] + cell["warm"]]
                    row["first_token_agrees"] = round(sum(same) / len(same), 4)
            rows.append(row)
    return rows


def run_ttft(cfg: TTFTConfig, producer: str | Path, consumer: str | Path, codec: str | Path,
             log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Every link of ``cfg`` measured in its own process; the result document (rows + links + skipped)."""
    limit = check_positions(cfg.lengths, producer, consumer)
    spec = {"producer": str(producer), "consumer": str(consumer), "codec": str(codec), "methods": list(cfg.method_list),
            "lengths": list(cfg.lengths), "repeats": cfg.repeats, "seed": cfg.seed, "bulk_s": cfg.bulk_s,
            "timeout_s": cfg.timeout_s, "start_timeout_s": cfg.start_timeout_s,
            "options": {m: o for m, o in cfg.options.items() if m in cfg.method_list}}
    links: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    why = namespace_support() if cfg.rates_gbit else None
    for rate in cfg.rates_gbit:
        if why is not None:
            skipped[rate_key(rate)] = why
            log(f"link {rate_key(rate)}: skipped — {why}")
            continue
        links[rate_key(rate)] = run_link({**spec, "rate": rate}, shaped=True, log=log)
    if cfg.unshaped:
        links[UNSHAPED] = run_link({**spec, "rate": None}, shaped=False, log=log)
    rows = rows_from(links, cfg.method_list, cfg.lengths) if links else []
    return {"rows": rows, "skipped": skipped, "config": asdict(cfg), "producer": str(producer),
            "consumer": str(consumer), "codec": str(codec), "max_position_embeddings": limit,
            "options": spec["options"],
            "links": {k: {x: v[x] for x in ("rate_gbit", "achieved_gbit_s", "bulk_bytes", "qdisc", "store")}
                      for k, v in links.items()},
            "timing": "medians over repeats; cold = producer prefill + encode + wire + consumer decode + first token, "
                      "warm = the payload already in the store, oracle = the consumer's own prefill + first token"}


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
