"""Bad-input sweep: feed ~150 bad (and a few valid edge) inputs to ``kvstate`` and its Python API, classify each.

Run: ``PYTHONPATH=src python scripts/bad_input_sweep.py [--md OUT.md]``. Every CLI case runs through
``kvstate.cli.main`` in-process under a 90 s alarm (a hang shows as ``HANG``) against copies of a tiny
model trained at start; the work directory is fingerprinted before and after each case, so a case that
changes files it must not shows as ``DISK``. Outcomes: ``error2`` (exit 2, one stderr line, no
traceback: the promised behaviour), ``ok`` (a valid edge input that ran and whose output was checked),
``SILENT`` (exit 0 on bad input), ``TRACEBACK`` (any other exit or exception), ``HANG``, ``DISK``. API
cases: ``error`` (a ``KVStateError`` / ``ValueError`` naming the argument), ``ok`` (checked result),
``WRONG`` (another exception or an unchecked result). Prints a table and one JSON line of counts.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import signal
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TQDM_DISABLE", "1")

import numpy as np
import torch
import transformers as tf
from safetensors.torch import load_file, save_file
from tests.bad_input_util import TINY, fingerprint

from kvstate.cli import main

ROOT = Path(tempfile.mkdtemp(prefix="kvstate-sweep-"))
SET = [f"--set={k}={v}" for k, v in TINY.items()]
rows: list[tuple[str, str, str, str]] = []


class Hang(Exception):
    pass


def _alarm(*_):  # type: ignore[no-untyped-def]
    raise Hang()


def cli(name: str, args: list[object], expect_ok: bool = False, check=None, writes: bool = False) -> None:  # type: ignore[no-untyped-def]
    before = fingerprint(ROOT / "w")
    err, out = io.StringIO(), io.StringIO()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(90)
    code: object = None
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            main([str(a) for a in args])
    except SystemExit as exc:
        code = exc.code if exc.code is not None else 0
    except Hang:
        code = "hang"
    except BaseException as exc:
        code = f"{type(exc).__name__}: {exc}"
    finally:
        signal.alarm(0)
    text = err.getvalue()
    lines = [ln for ln in text.splitlines() if ln.strip() and "Loading weights" not in ln]
    changed = not writes and fingerprint(ROOT / "w") != before
    if code == "hang":
        outcome = "HANG"
    elif changed:
        outcome = "DISK"
    elif code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in text:
        outcome = "SILENT-2" if expect_ok else "error2"
    elif code == 0:
        good = expect_ok and (check is None or check(out.getvalue()))
        outcome = "ok" if good else "SILENT"
    else:
        outcome = "TRACEBACK"
    detail = lines[0][7:] if outcome == "error2" else (str(code)[:120] if outcome == "TRACEBACK" else out.getvalue().strip()[-100:])
    rows.append(("cli", name, outcome, " ".join(detail.split())[:110]))
    print(f"{outcome:9} {name}", file=sys.__stderr__, flush=True)


def api(name: str, fn, check=None) -> None:  # type: ignore[no-untyped-def]
    from kvstate.errors import KVStateError

    try:
        result = fn()
    except (KVStateError, ValueError) as exc:
        rows.append(("api", name, "error", " ".join(f"{type(exc).__name__}: {exc}".split())[:110]))
        return
    except BaseException as exc:
        rows.append(("api", name, "WRONG", f"{type(exc).__name__}: {exc}"[:110]))
        return
    ok = check is not None and check(result)
    rows.append(("api", name, "ok" if ok else "WRONG", repr(result)[:110]))


def model_copy(name: str, edit_weights=None, edit_config=None, raw=None, drop=()) -> Path:  # type: ignore[no-untyped-def]
    d = ROOT / "w" / name
    shutil.copytree(ROOT / "tiny", d)
    if edit_weights or raw or edit_config or drop:
        (d / "manifest.json").unlink()
    if edit_weights:
        save_file(edit_weights(load_file(d / "model.safetensors")), d / "model.safetensors", metadata={"format": "pt"})
    if raw:
        (d / "model.safetensors").write_bytes(raw((d / "model.safetensors").read_bytes()))
    if edit_config:
        cfg = json.loads((d / "config.json").read_text())
        result = edit_config(cfg)
        (d / "config.json").write_text(result if isinstance(result, str) else json.dumps(cfg))
    for f in drop:
        (d / f).unlink()
    return d


def setup() -> None:
    from kvstate.lab.training.train import TrainConfig, train

    train(TrainConfig(arch="attn", **TINY), ROOT / "tiny", progress=False, log=lambda s: None)
    (ROOT / "w").mkdir()
    (ROOT / "w" / "afile").write_text("x")
    (ROOT / "w" / "emptydir").mkdir()
    np.save(ROOT / "w" / "ok.npy", np.array([6.0, 0, 0, 3, 1]))


def npy(name: str, value) -> Path:  # type: ignore[no-untyped-def]
    p = ROOT / "w" / name
    if callable(value):
        value(p)
    else:
        np.save(p, value)
    return p


def text(name: str, content: bytes | str) -> Path:
    p = ROOT / "w" / name
    (p.write_bytes if isinstance(content, bytes) else p.write_text)(content)  # type: ignore[operator]
    return p


def cli_cases() -> None:
    w = ROOT / "w"
    # ---- info: model directories and configs
    cli("info: missing dir", ["info", w / "nope"])
    cli("info: a file", ["info", w / "afile"])
    cli("info: empty dir", ["info", w / "emptydir"])
    cli("info: config not JSON", ["info", model_copy("i1", edit_config=lambda c: "{not json")])
    d = model_copy("i2")
    (d / "config.json").write_bytes(b"\xff\xfe{}")
    cli("info: config not UTF-8", ["info", d])
    cli("info: config a JSON list", ["info", model_copy("i3", edit_config=lambda c: "[1, 2]")])
    cli("info: num_attention_heads=-4", ["info", model_copy("i4", edit_config=lambda c: c.update(num_attention_heads=-4))])
    cli("info: num_key_value_heads=0", ["info", model_copy("i5", edit_config=lambda c: c.update(num_key_value_heads=0))])
    cli("info: hidden_size='big'", ["info", model_copy("i6", edit_config=lambda c: c.update(hidden_size="big"))])
    cli("info: dtype float7", ["info", model_copy("i7", edit_config=lambda c: c.update(dtype="float7"))])
    cli("info: dtype int8", ["info", model_copy("i8", edit_config=lambda c: c.update(dtype="int8"))])
    cli("info: num_hidden_layers=1e12", ["info", model_copy("i9", edit_config=lambda c: c.update(num_hidden_layers=10**12))])
    cli("info: num_hidden_layers=0", ["info", model_copy("i10", edit_config=lambda c: c.update(num_hidden_layers=0))])
    cli("info: heads 3 / kv 2", ["info", model_copy("i11", edit_config=lambda c: c.update(num_attention_heads=3, num_key_value_heads=2))])
    cli("info: head_dim=-1", ["info", model_copy("i12", edit_config=lambda c: c.update(head_dim=-1))])
    cli("info: vocab_size=0", ["info", model_copy("i13", edit_config=lambda c: c.update(vocab_size=0))])
    cli("info: model_type foo", ["info", model_copy("i14", edit_config=lambda c: c.update(model_type="foo"))])
    d = model_copy("i15", drop=["config.json"])
    (d / "config.json").mkdir()
    cli("info: config.json is a dir", ["info", d])
    from kvstate.models import tiny_config
    for fam, change, label in (("qwen3_5", {"layer_types": ["linear_attention"] * 3}, "qwen3_5 layer_types too short"),
                               ("mamba2", {"state_size": 0}, "mamba2 state_size=0"),
                               ("bamba", {"mamba_n_heads": -2}, "bamba mamba_n_heads=-2"),
                               ("qwen3_5", {"linear_key_head_dim": 0}, "qwen3_5 linear_key_head_dim=0")):
        cfg = tiny_config(fam)
        cfg.save_pretrained(w / f"c-{fam}-{label[-3:]}")
        raw = json.loads((w / f"c-{fam}-{label[-3:]}" / "config.json").read_text())
        raw.update(change)
        (w / f"c-{fam}-{label[-3:]}" / "config.json").write_text(json.dumps(raw))
        cli(f"info: {label}", ["info", w / f"c-{fam}-{label[-3:]}"])
    tf.ViTConfig().save_pretrained(w / "vit")
    cli("info: ViT config", ["info", w / "vit"])
    tf.GPT2Config().save_pretrained(w / "gpt2")
    cli("info: GPT-2 config", ["info", w / "gpt2"])
    cli("info: --dtype int8", ["info", ROOT / "tiny", "--dtype", "int8"])
    cli("info: --dtype ''", ["info", ROOT / "tiny", "--dtype", ""])
    cli("info: valid tiny model", ["info", ROOT / "tiny", "--json"], expect_ok=True,
        check=lambda o: json.loads(o.strip().splitlines()[-1])["kv_bytes_per_token"] > 0)
    # ---- plan: weights
    def plan(label, *args, **kw):  # type: ignore[no-untyped-def]
        cli(f"plan: {label}", ["plan", *args], **kw)
    plan("--weights missing", "--weights", w / "nope.npy", "--slots", "2")
    plan("--weights a dir", "--weights", w / "emptydir", "--slots", "2")
    plan("--weights empty array", "--weights", npy("e.npy", np.array([])), "--slots", "2")
    plan("--weights one element", "--weights", npy("one.npy", np.array([1.0])), "--slots", "2")
    plan("--weights NaN", "--weights", npy("nan.npy", np.array([1.0, np.nan, 1])), "--slots", "2")
    plan("--weights inf", "--weights", npy("inf.npy", np.array([1.0, np.inf, 1])), "--slots", "2")
    plan("--weights negative", "--weights", npy("neg.npy", np.array([1.0, -1, 1])), "--slots", "2")
    plan("--weights all zero", "--weights", npy("zero.npy", np.zeros(5)), "--slots", "2")
    plan("--weights complex", "--weights", npy("cx.npy", np.array([1 + 1j, 1, 1])), "--slots", "2")
    plan("--weights strings", "--weights", npy("str.npy", np.array(["1", "2"])), "--slots", "2")
    plan("--weights object (pickle)", "--weights", npy("obj.npy", lambda p: np.save(p, np.array([1, None], dtype=object), allow_pickle=True)), "--slots", "2")
    plan("--weights 2-D", "--weights", npy("2d.npy", np.ones((3, 3))), "--slots", "2")
    plan("--weights .npz archive", "--weights", npy("z.npy", lambda p: (np.savez(str(p) + ".npz", a=np.ones(3)), Path(str(p) + ".npz").rename(p))), "--slots", "2")
    plan("--weights truncated .npy", "--weights", npy("tr.npy", lambda p: (np.save(p, np.ones(100)), p.write_bytes(p.read_bytes()[:90]))), "--slots", "2")
    plan("--weights a text file", "--weights", text("t.npy", "1 2 3"), "--slots", "2")
    plan("--weights [1e308]*3 (valid)", "--weights", npy("huge.npy", np.array([1e308] * 3)), "--slots", "1", "--method", "block", "--json",
         expect_ok=True, check=lambda o: json.loads(o.strip().splitlines()[-1])["methods"]["block"]["expected_recompute"] == 1.0)
    plan("--weights [5e-324]*3 (valid)", "--weights", npy("tiny.npy", np.array([5e-324] * 3)), "--slots", "1", "--method", "balanced", "--json",
         expect_ok=True, check=lambda o: math.isfinite(json.loads(o.strip().splitlines()[-1])["methods"]["balanced"]["expected_recompute"]))
    plan("--weights bool array (valid)", "--weights", npy("b.npy", np.array([True, False, True])), "--slots", "1", "--json", expect_ok=True,
         check=lambda o: json.loads(o.strip().splitlines()[-1])["methods"]["optimal"]["expected_recompute"] == 0.0)
    plan("absurd: N=2^22, slots 4096", "--weights", npy("big.npy", np.ones(2**22)), "--slots", "4096", "--method", "optimal")
    plan("--slots -1", "--weights", w / "ok.npy", "--slots", "-1")
    plan("--slots x", "--weights", w / "ok.npy", "--slots", "x")
    plan("--slots 1.5", "--weights", w / "ok.npy", "--slots", "1.5")
    plan("--slots 1e30 (valid)", "--weights", w / "ok.npy", "--slots", str(10**30), "--method", "optimal", "--json", expect_ok=True,
         check=lambda o: json.loads(o.strip().splitlines()[-1])["methods"]["optimal"]["expected_recompute"] == 0.0)
    plan("--slots 0 (valid)", "--weights", w / "ok.npy", "--slots", "0", "--json", expect_ok=True,
         check=lambda o: json.loads(o.strip().splitlines()[-1])["methods"]["optimal"]["positions"] == [])
    plan("--align 0", "--weights", w / "ok.npy", "--slots", "2", "--align", "0")
    plan("--align -3", "--weights", w / "ok.npy", "--slots", "2", "--align", "-3")
    plan("--align > N", "--weights", w / "ok.npy", "--slots", "2", "--align", "99")
    plan("--method nope", "--weights", w / "ok.npy", "--slots", "2", "--method", "nope")
    plan("both --weights and --trace", "--weights", w / "ok.npy", "--trace", w / "x.jsonl", "--slots", "2")
    plan("neither --weights nor --trace", "--slots", "2")
    plan("no --slots", "--weights", w / "ok.npy")
    # ---- plan: traces
    def trace(label, content, *extra, **kw):  # type: ignore[no-untyped-def]
        plan(f"--trace {label}", "--trace", text(f"t{len(rows)}.jsonl", content), "--slots", "2", *extra, **kw)
    plan("--trace missing", "--trace", w / "nope.jsonl", "--slots", "2")
    plan("--trace a dir", "--trace", w / "emptydir", "--slots", "2")
    trace("not UTF-8", b'{"overlap": 1, "length": 3}\n\xff\xfe\n')
    trace("invalid JSON", '{"overlap": 1, "length": 3}\nnot json\n')
    trace("JSON list line", "[1, 2]\n")
    trace("length 300000000", '{"overlap": 1, "length": 300000000}\n')
    trace("length 3e8 float", '{"overlap": 1, "length": 3e8}\n')
    trace("overlap > length", '{"overlap": 9, "length": 3}\n')
    trace("negative overlap", '{"overlap": -1, "length": 3}\n')
    trace("bool length", '{"overlap": 0, "length": true}\n')
    trace("tokens not ints", '{"tokens": [1, "a"]}\n')
    trace("tokens/length mismatch", '{"tokens": [1, 2], "length": 5}\n')
    trace("prefix_id a list", '{"overlap": 1, "length": 3, "prefix_id": [1]}\n')
    trace("deep nesting", "[" * 100000 + "\n")
    trace("empty file", "")
    trace("only comments", "# nothing\n\n")
    trace("no overlap or tokens", '{"length": 3}\n')
    trace("unknown --prefix-id", '{"overlap": 1, "length": 3, "prefix_id": "a"}\n', "--prefix-id", "b")
    trace("valid, 2 requests", '{"overlap": 0, "length": 9, "prefix_id": "a"}\n{"overlap": 8, "length": 9, "prefix_id": "a"}\n',
          "--json", expect_ok=True, check=lambda o: json.loads(o.strip().splitlines()[-1])["methods"]["optimal"]["positions"] == [8])
    # ---- plan: plot
    plan("--plot missing dir", "--weights", w / "ok.npy", "--slots", "2", "--plot", w / "nodir" / "p.png")
    plan("--plot unknown suffix", "--weights", w / "ok.npy", "--slots", "2", "--plot", w / "p.unknownfmt")
    plan("--plot a directory", "--weights", w / "ok.npy", "--slots", "2", "--plot", w / "emptydir")
    plan("--plot under /proc", "--weights", w / "ok.npy", "--slots", "2", "--plot", "/proc/kvstate.png")


def eval_cases() -> None:
    w = ROOT / "w"

    def ev(label, model, *args, **kw):  # type: ignore[no-untyped-def]
        extra = list(args) or ["--task", "niah_single", "--length", "128", "--n", "1"]
        cli(f"eval: {label}", ["eval", "--model", model, *extra], **kw)
    ev("model missing", w / "nope")
    ev("no tokenizer", model_copy("e1", drop=["tokenizer.json", "tokenizer_config.json"]))
    ev("empty safetensors", model_copy("e2", edit_weights=lambda sd: {}))
    ev("layer 0 removed", model_copy("e3", edit_weights=lambda sd: {k: v for k, v in sd.items() if ".layers.0." not in k}))
    ev("extra tensor", model_copy("e4", edit_weights=lambda sd: {**sd, "model.extra": torch.zeros(3)}))
    ev("mis-shaped tensor", model_copy("e5", edit_weights=lambda sd: {k: (torch.zeros(3, 3) if "q_proj" in k else v) for k, v in sd.items()}))
    ev("NaN tensor", model_copy("e6", edit_weights=lambda sd: {k: v * math.nan if k == "model.norm.weight" else v for k, v in sd.items()}))
    ev("truncated safetensors", model_copy("e7", raw=lambda b: b[: len(b) // 2]))
    ev("garbage safetensors", model_copy("e8", raw=lambda b: b"\xff" * 100))
    ev("empty file safetensors", model_copy("e9", raw=lambda b: b""))
    d = model_copy("e10")
    raw = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(raw[:-5] + bytes([raw[-5] ^ 1]) + raw[-4:])
    ev("one flipped bit (manifest)", d)
    ev("no weights file", model_copy("e11", drop=["model.safetensors"]))
    ev("manifest not JSON", _bad_manifest())
    ev("task unknown", ROOT / "tiny", "--task", "poems", "--length", "128")
    ev("task text", ROOT / "tiny", "--task", "text", "--length", "128")
    ev("task empty ','", ROOT / "tiny", "--task", ",", "--length", "128")
    ev("task duplicate", ROOT / "tiny", "--task", "niah_single,niah_single", "--length", "128")
    ev("length duplicate", ROOT / "tiny", "--task", "niah_single", "--length", "128,128")
    ev("length 0", ROOT / "tiny", "--task", "niah_single", "--length", "0")
    ev("length -5", ROOT / "tiny", "--task", "niah_single", "--length", "-5")
    ev("length 1.5K", ROOT / "tiny", "--task", "niah_single", "--length", "1.5K")
    ev("length abc", ROOT / "tiny", "--task", "niah_single", "--length", "abc")
    ev("length 1_000", ROOT / "tiny", "--task", "niah_single", "--length", "1_000")
    ev("length 100000000", ROOT / "tiny", "--task", "niah_single", "--length", "100000000")
    ev("length 16000 > positions", ROOT / "tiny", "--task", "niah_single", "--length", "16000")
    ev("length 10 too short", ROOT / "tiny", "--task", "niah_single", "--length", "10")
    ev("--n 0", ROOT / "tiny", "--task", "niah_single", "--length", "128", "--n", "0")
    ev("--n 10000000", ROOT / "tiny", "--task", "niah_single", "--length", "128", "--n", "10000000")
    ev("--seed -1", ROOT / "tiny", "--task", "niah_single", "--length", "128", "--seed", "-1")
    ev("intact copy (valid)", ROOT / "tiny", "--task", "niah_single", "--length", "128", "--n", "1", "--json", expect_ok=True,
       check=lambda o: json.loads(o.strip().splitlines()[-1])["results"][0]["n"] == 1)


def _bad_manifest() -> Path:
    d = model_copy("e12")
    (d / "manifest.json").write_text("not json")
    return d


def train_cases() -> None:
    w = ROOT / "w"
    existing = model_copy("t-existing")

    def tr(label, *args, out=None, **kw):  # type: ignore[no-untyped-def]
        cli(f"train: {label}", ["train", "--arch", kw.pop("arch", "attn"), "--out", out or w / "t-new", *args], **kw)
    tr("--out an existing model", "--minutes", "0.05", *SET, out=existing)
    tr("--out an existing file", *SET, out=w / "afile")
    tr("--out under a file", *SET, out=w / "afile" / "sub")
    tr("--out under /proc", *SET, out="/proc/kvstate-out")
    tr("--out . --overwrite (the working dir)", "--overwrite", *SET, out=".")
    tr("--out .. --overwrite", "--overwrite", *SET, out="..")
    for setting in ("lr=1e999", "lr=NaN", "lr=-1", "lr=0", "lr=2", "warmup_steps=0", "log_every=0", "threads=0",
                    "window=0", "max_steps=0", "seed=-1", "hidden_size=2.5", "hidden_size=30", "max_length=true",
                    "bf16=2", 'task_mix={"niah_single": NaN}', "task_mix=[1]", 'task_mix={"poems": 1}', "foo=1",
                    "lr", "resume_length=8", "start_length=8", "max_batch=0", "tokens_per_step=0",
                    "decay_fraction=1.0", "answer_share=1", "save_every_min=0", "weight_decay=Infinity"):
        tr(f"--set {setting}", "--set", setting)
    tr("--set seed=1 (has its own option)", "--set", "seed=1")
    tr("--set lr twice", "--set", "lr=0.001", "--set", "lr=0.002")
    tr("--minutes 0", "--minutes", "0")
    tr("--minutes nan", "--minutes", "nan")
    tr("--minutes -1", "--minutes", "-1")
    tr("--seed -1", "--seed", "-1")
    tr("--arch mamba", arch="mamba")
    tr("hybrid num_layers=6", "--set", "num_layers=6", arch="hybrid")
    tr("--resume missing", "--resume", w / "nope", *SET)
    tr("--resume dir without state", "--resume", w / "emptydir", *SET)
    tr("--resume + --init-from", "--resume", ROOT / "tiny", "--init-from", ROOT / "tiny", *SET)
    tr("--resume an attn run as hybrid", "--resume", ROOT / "tiny", *[s.replace("num_layers=1", "num_layers=4") for s in SET], arch="hybrid")
    tr("--resume with corrupt state", "--resume", _bad_state(), *SET)
    tr("--init-from missing", "--init-from", w / "nope", *[s.replace("num_layers=1", "num_layers=4") for s in SET], arch="hybrid")
    tr("--init-from config only", "--init-from", model_copy("t-cfg", drop=["model.safetensors"]),
       *[s.replace("num_layers=1", "num_layers=4") for s in SET], arch="hybrid")
    tr("valid 1-step run (writes --out)", *SET, out=w / "t-valid", expect_ok=True, writes=True,
       check=lambda o: (w / "t-valid" / "manifest.json").is_file())
    tr("--overwrite an existing model (valid)", "--overwrite", *SET, out=w / "t-valid", expect_ok=True, writes=True,
       check=lambda o: (w / "t-valid" / "manifest.json").is_file())


def _bad_state() -> Path:
    d = model_copy("t-badstate")
    (d / "training_state.json").write_text('{"step": "x"}')
    return d


def report_cases() -> None:
    w = ROOT / "w"
    cli("report: --out an existing file", ["report", "--out", w / "afile", "--models", w / "nope"])
    cli("report: --out under /proc", ["report", "--out", "/proc/kvstate-report", "--models", w / "nope"])


def usage_cases() -> None:
    for args in (["plan", "--slots"], ["info"], ["nonsense"], ["eval", "--n", "2"], ["train", "--out", "x"],
                 ["info", "a", "b"], ["plan", "--slots", "2", "--unknown"]):
        cli("usage: kvstate " + " ".join(args), args)


def api_cases() -> None:
    from kvstate.lab.harness import check_tasks, run_tasks
    from kvstate.lab.training.train import TrainConfig
    from kvstate.lab.workloads.traces import Request, generate, overlap_weights
    from kvstate.models import describe, load_model, tiny_config, tiny_model
    from kvstate.prefix.engine import SparsePrefixCache
    from kvstate.prefix.histogram import OverlapHistogram, total_variation
    from kvstate.prefix.placement import expected_recompute, plan_checkpoints

    api("plan_checkpoints([1e308]*3, 1, 'block') recompute", lambda: expected_recompute([1e308] * 3, plan_checkpoints([1e308] * 3, 1, "block")),
        check=lambda r: r == 1.0)
    api("plan_checkpoints(complex weights)", lambda: plan_checkpoints(np.array([1j, 1, 1]), 1))
    api("plan_checkpoints(['1','2'])", lambda: plan_checkpoints(["1", "2"], 1))
    api("plan_checkpoints(ragged)", lambda: plan_checkpoints([[1, 2], [3]], 1))
    api("plan_checkpoints(slots=True)", lambda: plan_checkpoints(np.ones(5), True))
    api("plan_checkpoints(slots=2.0)", lambda: plan_checkpoints(np.ones(5), 2.0))
    api("plan_checkpoints(align=np.int64(2))", lambda: plan_checkpoints(np.ones(5), 2, align=np.int64(2)),
        check=lambda r: all(p % 2 == 0 for p in r))
    api("plan_checkpoints(10**400 ints)", lambda: plan_checkpoints([10**400, 1], 1))
    api("plan_checkpoints(block_size=0)", lambda: plan_checkpoints(np.ones(5), 2, "block", block_size=0))
    api("expected_recompute(positions > N)", lambda: expected_recompute(np.ones(5), [9]))
    api("expected_recompute(positions 1.5)", lambda: expected_recompute(np.ones(5), [1.5]))
    api("OverlapHistogram(n=2**40)", lambda: OverlapHistogram(2**40))
    api("OverlapHistogram(gamma=True)", lambda: OverlapHistogram(5, gamma=True))
    api("OverlapHistogram(alpha=inf)", lambda: OverlapHistogram(5, alpha=math.inf))
    api("OverlapHistogram(gamma=nan)", lambda: OverlapHistogram(5, gamma=math.nan))
    api("OverlapHistogram.record(2.5)", lambda: OverlapHistogram(5).record(2.5))  # type: ignore[arg-type]
    api("OverlapHistogram.record(9) beyond n", lambda: OverlapHistogram(5).record(9))
    api("total_variation(complex)", lambda: total_variation(np.array([1j, 1]), np.ones(2)))
    api("total_variation([1e308]*2, [1,1])", lambda: total_variation([1e308] * 2, [1, 1]), check=lambda r: r == 0.0)
    model = tiny_model("qwen3_5")
    for label, kw in (("budget nan", {"budget_bytes": math.nan}), ("budget inf", {"budget_bytes": math.inf}),
                      ("budget -1", {"budget_bytes": -1}), ("budget True", {"budget_bytes": True}),
                      ("budget '1000'", {"budget_bytes": "1000"}), ("slots -1", {"budget_bytes": 10**8, "slots_per_entry": -1}),
                      ("align 0", {"budget_bytes": 10**8, "align": 0}), ("gamma 0", {"budget_bytes": 10**8, "gamma": 0.0}),
                      ("alpha nan", {"budget_bytes": 10**8, "alpha": math.nan}), ("block_size 0", {"budget_bytes": 10**8, "block_size": 0})):
        api(f"SparsePrefixCache({label})", lambda kw=kw: SparsePrefixCache(model, **kw))
    api("SparsePrefixCache.lookup(batch of 2)", lambda: SparsePrefixCache(model, 10**8).lookup(torch.zeros(2, 8, dtype=torch.long)))
    for label, kw in (("lr=inf", {"lr": math.inf}), ("lr=nan", {"lr": math.nan}), ("warmup_steps=0", {"warmup_steps": 0}),
                      ("seed=True", {"seed": True}), ("minutes='5'", {"minutes": "5"}), ("task_mix=[1]", {"task_mix": [1]}),
                      ("num_layers=2.0", {"num_layers": 2.0}), ("answer_share=nan", {"answer_share": math.nan})):
        api(f"TrainConfig({label})", lambda kw=kw: TrainConfig(**kw))
    reqs = [Request(None, "a", 7, 9)]
    api("overlap_weights(length below deepest)", lambda: overlap_weights(reqs, length=5))
    api("traces.generate(scale=nan)", lambda: generate("chat", 3, scale=math.nan))
    api("traces.generate(n_requests=0)", lambda: generate("chat", 0))
    api("check_tasks(duplicates)", lambda: check_tasks(["qa", "qa"], [128]))
    api("check_tasks(length True)", lambda: check_tasks(["qa"], [True]))
    api("load_model(empty safetensors copy)", lambda: load_model(ROOT / "w" / "e2"))
    api("load_model(flipped bit copy)", lambda: load_model(ROOT / "w" / "e10"))
    cfg = tiny_config("qwen3")
    cfg.num_attention_heads = -4
    api("describe(negative heads)", lambda: describe(cfg))
    lm = load_model(ROOT / "tiny")
    from kvstate.lab.workloads import build_tokenizer
    tok = build_tokenizer()
    api("run_tasks(n=0)", lambda: run_tasks(lm, tok, ["niah_single"], [128], 0, 0))
    api("run_tasks(seed=-1)", lambda: run_tasks(lm, tok, ["niah_single"], [128], 1, -1))
    api("run_tasks(length 16000 > positions)", lambda: run_tasks(lm, tok, ["niah_single"], [16000], 1, 0))


def report() -> None:
    counts = Counter((kind, outcome) for kind, _, outcome, _ in rows)
    width = max(len(r[1]) for r in rows)
    for i, (kind, name, outcome, detail) in enumerate(rows, 1):
        print(f"{i:3} {kind:3} {name:{width}} {outcome:9} {detail}")
    bad = [r for r in rows if r[2] in ("SILENT", "SILENT-2", "TRACEBACK", "HANG", "DISK", "WRONG")]
    print(json.dumps({"cases": len(rows), "counts": {f"{k}:{o}": n for (k, o), n in sorted(counts.items())},
                      "failures": len(bad)}))


def markdown(path: Path) -> None:
    lines = ["| # | via | input | outcome | message / result |", "|---|---|---|---|---|"]
    lines += [f"| {i} | {k} | {n} | {o} | {d.replace('|', '/')} |" for i, (k, n, o, d) in enumerate(rows, 1)]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    setup()
    try:
        cli_cases()
        eval_cases()
        train_cases()
        usage_cases()
        report_cases()
        api_cases()
    finally:
        report()
        if "--md" in sys.argv:
            markdown(Path(sys.argv[sys.argv.index("--md") + 1]))
        shutil.rmtree(ROOT, ignore_errors=True)
