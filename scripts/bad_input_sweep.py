"""Bad-input sweep: feed ~450 bad (and a few valid edge) inputs to ``kvstate`` and its Python API, classify each.

Run: ``PYTHONPATH=src:. python scripts/bad_input_sweep.py [--md OUT.md] [--only new] [--sections depth,semantic,...]``
(``SWEEP_ALARM=SECONDS`` sets the hang limit, 90 by default). Every CLI case runs through
``kvstate.cli.main`` in-process under a 90 s alarm (a hang shows as ``HANG``; a case that may crash the
interpreter runs in a child process, ``TRACEBACK`` with the signal if it does) against copies of a tiny
model trained at start; the work directory is fingerprinted before and after each case, so a case that
changes files it must not shows as ``DISK``. Outcomes: ``error2`` (exit 2, one stderr line, no
traceback: the promised behaviour), ``ok`` (a valid edge input that ran and whose output was checked),
``SILENT`` (exit 0 on bad input), ``TRACEBACK`` (any other exit or exception), ``HANG``, ``DISK``. API
cases: ``error`` (a ``KVStateError`` / ``ValueError`` naming the argument), ``ok`` (checked result),
``WRONG`` (another exception or an unchecked result). Prints a table and one JSON line of counts.

The depth / semantic / transfer cases (:func:`axis_cases`) run against a scratch copy of the committed
``models/`` (``M``): every case is also checked to leave it unchanged (``DISK`` otherwise), and a last
row checks it byte-identical (SHA-256 of every file) to the committed directory after all cases. Cases
that must write (a result appended, a card) write into copies under the work directory. Server cases
(``srv``) send raw frames to an in-process producer server: ``error`` is an error reply on a connection
that still answers, ``WRONG`` a dropped connection or an accepted bad request. Each case has a class
(``out``: the output rule; ``trust``: damaged trusted files; ``bound``: inputs bounded at the boundary;
``list``: list options; ``api``: API misuse; ``srv``: the server) and the JSON line counts them by class.
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
classes: list[str] = []  # the class of each row (``old`` for the cases of the older commands)
_CLASS = ["old"]
REPO_MODELS = Path(__file__).resolve().parents[1] / "models"
M = ROOT / "models"  # the scratch copy of the committed models
DAMAGED: list[str] = []  # cases that changed the scratch models (restored after each)


def _quick(root: Path) -> dict[str, tuple[int, int, int]]:
    """(size, mtime_ns, inode) of every file under ``root`` (directories by name only: a writability probe
    touches their mtime): changes when any file is written, replaced, added or removed."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, p.stat().st_ino) if p.is_file()
            else (0, 0, 0) for p in sorted(root.rglob("*"))}


class Hang(Exception):
    pass


def _alarm(*_):  # type: ignore[no-untyped-def]
    raise Hang()


ALARM = int(os.environ.get("SWEEP_ALARM", "90"))  # seconds before a case counts as a hang
SKIP = int(os.environ.get("SWEEP_SKIP", "0"))  # CLI cases to skip (recorded by an earlier, interrupted run)
_SEEN = [0]


def _isolated(args: list[object]) -> tuple[object, str, str]:
    """Run ``kvstate ARGS`` in a child process (a case that may crash the interpreter): (code, stderr, stdout)."""
    import subprocess

    try:
        done = subprocess.run([sys.executable, "-c", "from kvstate.cli import main; main()", *map(str, args)],
                              capture_output=True, text=True, timeout=ALARM, env=os.environ.copy())
    except subprocess.TimeoutExpired:
        return "hang", "", ""
    code: object = done.returncode if done.returncode >= 0 else f"crashed: signal {-done.returncode}"
    return code, done.stderr, done.stdout


def cli(name: str, args: list[object], expect_ok: bool = False, check=None, writes: bool = False,  # type: ignore[no-untyped-def]
        isolate: bool = False) -> None:
    _SEEN[0] += 1
    if _SEEN[0] <= SKIP:  # resuming a sweep that stopped: these cases were recorded by the earlier run
        return
    before = fingerprint(ROOT / "w")
    models_before = _quick(M)
    err, out = io.StringIO(), io.StringIO()
    code: object = None
    if isolate:
        code, etext, otext = _isolated(args)
        err.write(etext)
        out.write(otext)
    else:
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(ALARM)
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
    models_changed = _quick(M) != models_before
    if models_changed:  # put the committed models back, so that later cases see them whole
        DAMAGED.append(name)
        shutil.rmtree(M, ignore_errors=True)
        shutil.copytree(REPO_MODELS, M)
    changed = models_changed or (not writes and fingerprint(ROOT / "w") != before)
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
    classes.append(_CLASS[0])
    print(f"{outcome:9} {name}", file=sys.__stderr__, flush=True)


def api(name: str, fn, check=None) -> None:  # type: ignore[no-untyped-def]
    from kvstate.errors import KVStateError

    classes.append(_CLASS[0])
    try:
        result = fn()
    except (KVStateError, ValueError) as exc:
        rows.append(("api", name, "error", " ".join(f"{type(exc).__name__}: {exc}".split())[:110]))
        return
    except BaseException as exc:
        rows.append(("api", name, "WRONG", f"{type(exc).__name__}: {exc}"[:110]))
        return
    try:
        ok = check is not None and bool(check(result))
    except Exception:
        ok = False
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
                      ("align 0", {"budget_bytes": 10**8, "align": 0}),
                      ("alpha nan", {"budget_bytes": 10**8, "alpha": math.nan}), ("block_size 0", {"budget_bytes": 10**8, "block_size": 0}),
                      ("policy 'nope'", {"budget_bytes": 10**8, "policy": "nope"})):
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


# ---------------------------------------------------------------------------------------------------------
# depth / semantic / transfer: the output rule, trusted files, bounds, lists, API misuse, the server


BIG = ROOT / "big"  # copies of committed models that cases damage or write into (not the scratch models/)


def klass(name: str) -> None:
    _CLASS[0] = name


def _copy(src: str, name: str) -> Path:
    d = BIG / name
    shutil.copytree(M / src, d)
    return d


def _refresh(d: Path) -> None:
    """Rewrite the checksums of a damaged copy, so only the damage itself (not the checksum) can catch it."""
    from kvstate.integrity import refresh_manifest

    if (d / "manifest.json").is_file():
        with contextlib.suppress(Exception):
            refresh_manifest(d)


def _tensor_copy(src: str, name: str, weights: str, edit) -> Path:  # type: ignore[no-untyped-def]
    d = _copy(src, name)
    save_file({k: v.contiguous() for k, v in edit(load_file(d / weights)).items()}, d / weights,
              metadata={"format": "pt"})
    _refresh(d)
    return d


def _raw_copy(src: str, name: str, path: str, edit) -> Path:  # type: ignore[no-untyped-def]
    d = _copy(src, name)
    (d / path).write_bytes(edit((d / path).read_bytes() if (d / path).is_file() else b""))
    return d


def _flip(b: bytes) -> bytes:
    return b[:-1] + bytes([b[-1] ^ 0x40])  # the exponent's top bit of the last float: a huge, finite weight


def _runs(path: Path) -> list:  # type: ignore[type-arg]
    from kvstate.lab.provenance import read_runs

    return read_runs(path)


class _Server:
    """The committed producer behind an in-process server (started once, for generate and the raw frames)."""

    def __init__(self) -> None:
        from kvstate.lab.harness import load_reference
        from kvstate.transfer.codec import Codec
        from kvstate.transfer.serving import producer_service
        from kvstate.transfer.store import MemoryStore
        from kvstate.transfer.transport import ServerConfig, ServerThread

        model, self.tok = load_reference(M / "ref-attn")
        self.codec = Codec.load(M / "codec-ref-attn-ft")
        self.thread = ServerThread(producer_service(model, self.codec, MemoryStore()), ServerConfig(timeout_s=60))
        self.thread.__enter__()
        self.address = f"127.0.0.1:{self.thread.port}"

    def close(self) -> None:
        self.thread.__exit__(None, None, None)


def srv(server: _Server, name: str, body: bytes, expect_ok: bool = False) -> None:
    """Send one raw request frame; a bad request must get an error reply on a connection that still answers."""
    import socket
    import struct

    classes.append(_CLASS[0])

    def frame(sock: socket.socket) -> bytes:
        head = b""
        while len(head) < 4:
            got = sock.recv(4 - len(head))
            if not got:
                raise ConnectionError("closed")
            head += got
        (n,) = struct.unpack(">I", head)
        data = b""
        while len(data) < n:
            got = sock.recv(min(1 << 20, n - len(data)))
            if not got:
                raise ConnectionError("closed")
            data += got
        return data

    host, port = server.address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=90) as sock:
            sock.sendall(struct.pack(">I", len(body)) + body)
            reply = json.loads(frame(sock))
            if reply.get("ok"):
                frame(sock)  # the payload
            sock.sendall(struct.pack(">I", 15) + b'{"op": "hello"}')
            alive = json.loads(frame(sock)).get("ok") is True
    except (OSError, ValueError, ConnectionError) as exc:
        rows.append(("srv", name, "WRONG", f"connection dropped: {type(exc).__name__}: {exc}"[:110]))
        return
    if reply.get("ok"):
        outcome = "ok" if expect_ok and alive else "WRONG"
        detail = f"accepted ({reply.get('bytes')} payload bytes, {reply.get('encode_ms')} ms)"
    else:
        outcome = "WRONG" if expect_ok or not alive else "error"
        detail = str(reply.get("error"))
    rows.append(("srv", name, outcome, " ".join(detail.split())[:110]))
    print(f"{outcome:9} srv {name}", file=sys.__stderr__, flush=True)


def depth_cases() -> None:
    w = ROOT / "w"
    klass("out")

    def dt(label, *args, **kw):  # type: ignore[no-untyped-def]
        cli(f"depth train: {label}", ["depth", "train", *args], **kw)
    dt("--out = --model (committed)", "--model", M / "ref-attn", "--out", M / "ref-attn", "--tokens", "256")
    dt("--out = --model --overwrite", "--model", M / "ref-attn", "--out", M / "ref-attn", "--tokens", "256", "--overwrite")
    dt("--out = --model --resume", "--model", M / "ref-attn", "--out", M / "ref-attn", "--tokens", "256", "--resume")
    dt("--resume --out a committed non-depth model", "--model", M / "ref-attn", "--out", M / "ref-attn-ft", "--tokens",
       "256", "--resume")
    dt("--out a router dir --overwrite", "--model", M / "ref-attn", "--out", M / "ref-attn-sekv", "--tokens", "256",
       "--overwrite")
    dt("--out a codec dir --overwrite", "--model", M / "ref-attn", "--out", M / "codec-ref-attn-ft", "--tokens", "256",
       "--overwrite")
    dt("--out inside --model", "--model", M / "ref-attn", "--out", M / "ref-attn" / "run", "--tokens", "256")
    dt("--out holds --model", "--model", M / "ref-attn", "--out", M, "--tokens", "256", "--overwrite")
    dt("--out another committed model (no --overwrite)", "--model", M / "ref-attn", "--out", M / "ref-attn-ft",
       "--tokens", "256")
    dt("--resume with nothing to resume", "--model", M / "ref-attn", "--out", w / "dnone", "--tokens", "256", "--resume")
    cli("depth init-kv1: --out = --model", ["depth", "init-kv1", "--model", M / "ref-attn", "--out", M / "ref-attn",
                                            "--overwrite"])
    cli("depth init-kv1: --out a router dir", ["depth", "init-kv1", "--model", M / "ref-attn", "--out",
                                               M / "ref-attn-sekv", "--overwrite"])
    cli("depth card: a committed non-depth model", ["depth", "card", "--model", M / "ref-attn"])
    d = w / "dcard"
    d.mkdir()
    for f in ("training_state.json", "depth_eval.json"):
        shutil.copy(M / "ref-attn-rcla" / f, d / f)
    (d / "README.md").write_text("# my own notes\n")
    cli("depth card: over a hand-written README", ["depth", "card", "--model", d])
    d = _copy("ref-attn-rcla", "dcard-ok")
    cli("depth card: regenerate its own card (valid)", ["depth", "card", "--model", d], expect_ok=True,
        check=lambda o: "Generated by `kvstate depth card`" in (d / "README.md").read_text())

    def de(label, *args, **kw):  # type: ignore[no-untyped-def]
        cli(f"depth eval: {label}", ["depth", "eval", "--model", kw.pop("model", M / "ref-attn"), *args], **kw)
    de("--out the model's config.json", "--n", "1", "--out", M / "ref-attn" / "config.json")
    de("--out the model's weights", "--n", "1", "--out", M / "ref-attn" / "model.safetensors")
    de("--out the model's manifest", "--n", "1", "--out", M / "ref-attn" / "manifest.json", "--overwrite")
    de("--out a directory", "--n", "1", "--out", M / "ref-attn")
    de("--out a README (not results)", "--n", "1", "--out", M / "ref-attn" / "README.md")
    klass("trust")
    de("--model with a flipped weight byte", "--n", "1", "--keep", "1",
       model=_raw_copy("ref-attn", "m-flip", "model.safetensors", _flip))
    de("--model with a truncated manifest", "--n", "1", "--keep", "1",
       model=_raw_copy("ref-attn", "m-badman", "manifest.json", lambda b: b[: len(b) // 2]))
    cli("eval: committed model with a flipped weight byte", ["eval", "--model", BIG / "m-flip", "--task", "niah_single",
                                                            "--length", "128", "--n", "1"])
    klass("bound")
    for label, args in (("--length 16384 > positions", ["--length", "16384"]), ("--length 100", ["--length", "100"]),
                        ("--length 0", ["--length", "0"]), ("--length -64", ["--length", "-64"]),
                        ("--length 2^40", ["--length", str(2**40)]), ("--minutes nan", ["--minutes", "nan"]),
                        ("--minutes inf", ["--minutes", "inf"]), ("--minutes 0", ["--minutes", "0"]),
                        ("--tokens 0", ["--tokens", "0"]), ("--tokens 10^30", ["--tokens", str(10**30)]),
                        ("--p 2", ["--p", "2"]), ("--p nan", ["--p", "nan"]), ("--seed -1", ["--seed", "-1"]),
                        ("--seed 2^70", ["--seed", str(2**70)]), ("--rule nope", ["--rule", "nope"])):
        dt(label, "--model", M / "ref-attn", "--out", w / "dnew", *(["--tokens", "256"] if "--tokens" not in args
                                                                     and "--minutes" not in args else []), *args)
    dt("no budget", "--model", M / "ref-attn", "--out", w / "dnew")
    dt("--set lr=nan", "--model", M / "ref-attn", "--out", w / "dnew", "--tokens", "256", "--set", "lr=NaN")
    klass("list")
    dt("--pattern ²", "--model", M / "ref-attn", "--out", w / "dnew", "--tokens", "256", "--pattern", "0_0_²_2")
    dt("--pattern wrong length", "--model", M / "ref-attn", "--out", w / "dnew", "--tokens", "256", "--pattern", "0_0_2")
    dt("--pattern empty", "--model", M / "ref-attn", "--out", w / "dnew", "--tokens", "256", "--pattern", "")
    for label, keep in (("duplicate", "1,1"), ("1K and 1024 style duplicate", "0.5,.5"), ("empty", ""),
                        ("empty item", "1,,0.5"), ("0", "0"), ("1.5", "1.5"), ("nan", "nan"), ("²", "²")):
        de(f"--keep {label}", "--n", "1", "--keep", keep)
    klass("bound")
    de("--pattern-kind nope", "--n", "1", "--pattern-kind", "nope")
    de("--n 0", "--n", "0")
    de("--n 10^7", "--n", str(10**7))
    de("--seed -1", "--seed", "-1")


def semantic_cases() -> None:
    w = ROOT / "w"
    klass("out")

    def st(label, *args, **kw):  # type: ignore[no-untyped-def]
        cli(f"semantic train: {label}", ["semantic", "train", "--model", kw.pop("model", M / "ref-attn"), *args], **kw)
    st("--out = --model --overwrite", "--out", M / "ref-attn", "--max-steps", "1", "--overwrite")
    st("--out a model dir --overwrite", "--out", M / "ref-attn-ft", "--max-steps", "1", "--overwrite")
    st("--out a codec dir --overwrite", "--out", M / "codec-ref-attn-ft", "--max-steps", "1", "--overwrite")
    st("--out a router (no --overwrite)", "--out", M / "ref-attn-sekv", "--max-steps", "1")
    st("--out an existing file", "--out", M / "ref-attn" / "config.json", "--max-steps", "1")

    def se(label, *args, **kw):  # type: ignore[no-untyped-def]
        base = ["--task", "niah_single", "--length", "128", "--n", "1", "--methods", "full"]
        cli(f"semantic eval: {label}", ["semantic", "eval", "--model", kw.pop("model", M / "ref-attn"), *base, *args], **kw)
    se("--out the model's config.json", "--out", M / "ref-attn" / "config.json")
    se("--out the router's manifest", "--out", M / "ref-attn-sekv" / "manifest.json", "--overwrite")
    se("--out the router's weights", "--out", M / "ref-attn-sekv" / "router.safetensors")
    se("--out a model card (not results)", "--out", M / "ref-attn" / "README.md")
    se("--kvpress-venv a model dir", "--methods", "full,kvpress", "--kvpress-venv", M / "ref-attn")
    d = _copy("ref-attn-sekv", "sekv-append")
    before = len(_runs(d / "eval.json"))
    first = _runs(d / "eval.json")[0]
    se("--out a committed eval.json appends (valid)", "--router", d, "--methods", "full,sekv", "--budget", "0.5",
       "--out", d / "eval.json", expect_ok=True, writes=True,
       check=lambda o: len(_runs(d / "eval.json")) == before + 1 and _runs(d / "eval.json")[0] == first)
    klass("trust")
    se("--router trained for another model", "--router", M / "ref-hybrid-sekv", "--methods", "sekv")
    se("--router truncated", "--methods", "sekv", "--router",
       _raw_copy("ref-attn-sekv", "r-trunc", "router.safetensors", lambda b: b[: len(b) // 2]))
    se("--router manifest not JSON", "--methods", "sekv", "--router",
       _raw_copy("ref-attn-sekv", "r-manifest", "manifest.json", lambda b: b"not json"))
    se("--router missing a tensor", "--methods", "sekv", "--router",
       _tensor_copy("ref-attn-sekv", "r-missing", "router.safetensors", lambda t: {k: v for k, v in t.items() if k != "alpha"}))
    se("--router bf16 tensors", "--methods", "sekv", "--router",
       _tensor_copy("ref-attn-sekv", "r-bf16", "router.safetensors", lambda t: {k: v.bfloat16() for k, v in t.items()}))
    se("--router NaN tensor", "--methods", "sekv", "--router",
       _tensor_copy("ref-attn-sekv", "r-nan", "router.safetensors", lambda t: {k: v * math.nan if k == "beta" else v
                                                                              for k, v in t.items()}))
    se("--router a model dir", "--methods", "sekv", "--router", M / "ref-attn-ft")
    klass("bound")
    se("--length 8192 (no room for the question)", "--length", "8192")
    se("--length 100000", "--length", "100000")
    se("--n 0", "--n", "0")
    se("--n 10^7", "--n", str(10**7))
    se("--threads 0", "--threads", "0")
    se("--threads -1", "--threads", "-1")
    se("--threads 10^6", "--threads", str(10**6), isolate=True)  # torch's OpenMP may crash the interpreter
    se("--seed -1", "--seed", "-1")
    for label, args in (("--length 16384", ["--length", "16384"]), ("--length 32", ["--length", "32"]),
                        ("--threads 0", ["--threads", "0"]), ("--minutes nan", ["--minutes", "nan"]),
                        ("--minutes inf", ["--minutes", "inf"]), ("--max-steps 0", ["--max-steps", "0"]),
                        ("--max-steps -1", ["--max-steps", "-1"]), ("--budget 0", ["--budget", "0"]),
                        ("--budget nan", ["--budget", "nan"]), ("--budget 2", ["--budget", "2"]),
                        ("--seed -1", ["--seed", "-1"])):
        st(label, "--out", w / "snew", *args)
    klass("list")
    for label, args in (("--budget duplicate", ["--budget", "0.25,0.25"]), ("--budget empty", ["--budget", ""]),
                        ("--length duplicate", ["--length", "128,128"]), ("--length 1K,1024", ["--length", "1K,1024"]),
                        ("--length empty", ["--length", ""]), ("--length ²", ["--length", "1²8"]),
                        ("--task duplicate", ["--task", "niah_single,niah_single"]), ("--task empty", ["--task", ""]),
                        ("--task text", ["--task", "text"]), ("--methods duplicate", ["--methods", "full,full"]),
                        ("--methods empty", ["--methods", ""]),
                        ("--methods kvpress + one of its presses", ["--methods", "kvpress,SnapKVPress"]),
                        ("--methods unknown", ["--methods", "full,nope"])):
        se(label, *args)
    for label, args in (("--length duplicate", ["--length", "128,128"]), ("--length empty", ["--length", ""]),
                        ("--length ²", ["--length", "²"])):
        st(label, "--out", w / "snew", *args)


def transfer_cases(server: _Server) -> None:
    w = ROOT / "w"
    pc = ["--producer", M / "ref-attn", "--consumer", M / "ref-attn-ft"]
    small = ["--prefixes", "4", "--length", "96"]
    klass("out")

    def cal(label, *args, **kw):  # type: ignore[no-untyped-def]
        cli(f"transfer calibrate: {label}", ["transfer", "calibrate", *pc, *args], **kw)
    cal("--out = --producer", "--out", M / "ref-attn", *small, "--overwrite")
    cal("--out = --consumer", "--out", M / "ref-attn-ft", *small, "--overwrite")
    cal("--out a model dir --overwrite", "--out", M / "ref-attn-rcla", *small, "--overwrite")
    cal("--out a router dir --overwrite", "--out", M / "ref-attn-sekv", *small, "--overwrite")
    cal("--out the committed codec (no --overwrite)", "--out", M / "codec-ref-attn-ft", *small)
    cal("--out inside the producer", "--out", M / "ref-attn" / "codec", *small)

    def card(label, *args, **kw):  # type: ignore[no-untyped-def]
        cli(f"transfer card: {label}", ["transfer", "card", *args], **kw)
    card("no arguments")
    card("--command only", "--command", "x")
    card("committed consumer README, no --overwrite", "--model", M / "ref-attn-ft", "--base", M / "ref-attn",
         "--command", "x")
    card("committed codec README, no --overwrite", "--codec", M / "codec-ref-attn-ft", "--command", "x")
    card("--codec a model dir", "--codec", M / "ref-attn", "--command", "x", "--overwrite")
    card("--model a codec dir", "--model", M / "codec-ref-attn-ft", "--base", M / "ref-attn", "--command", "x")
    card("no --command", "--model", M / "ref-attn-ft", "--base", M / "ref-attn", "--overwrite")

    def bench(label, *args, **kw):  # type: ignore[no-untyped-def]
        cli(f"transfer bench: {label}", ["transfer", "bench", *pc, "--codec", M / "codec-ref-attn-ft", *args], **kw)
    bench("--out the codec's weights", "--out", M / "codec-ref-attn-ft" / "codec.safetensors")
    bench("--out the codec's manifest", "--out", M / "codec-ref-attn-ft" / "manifest.json", "--overwrite")
    bench("--out the consumer's config", "--out", M / "ref-attn-ft" / "config.json")
    klass("trust")

    def gen(label, *args, **kw):  # type: ignore[no-untyped-def]
        cli(f"transfer generate: {label}", ["transfer", "generate", "--consumer", kw.pop("consumer", M / "ref-attn-ft"),
                                            "--server", server.address, "--prompt", "the secret code of apple is",
                                            *args], **kw)
    for label, name, how in (
            ("missing a tensor", "c-missing", lambda t: {k: v for k, v in t.items() if k != "k.2.dec"}),
            ("bf16 tensors", "c-bf16", lambda t: {k: v.bfloat16() for k, v in t.items()}),
            ("a NaN tensor", "c-nan", lambda t: {k: v * math.nan if k == "v.1.mu_out" else v for k, v in t.items()}),
            ("a mis-shaped tensor", "c-shape", lambda t: {k: v[..., :-1] if k == "k.0.enc" else v for k, v in t.items()})):
        gen(f"--codec {label}", "--codec", _tensor_copy("codec-ref-attn-ft", name, "codec.safetensors", how))
    gen("--codec truncated", "--codec", _raw_copy("codec-ref-attn-ft", "c-trunc", "codec.safetensors",
                                                  lambda b: b[: len(b) // 2]))
    gen("--codec flipped byte", "--codec", _raw_copy("codec-ref-attn-ft", "c-flip", "codec.safetensors", _flip))
    gen("--codec manifest not JSON", "--codec", _raw_copy("codec-ref-attn-ft", "c-man", "manifest.json",
                                                          lambda b: b"{not json"))
    gen("--codec a model dir", "--codec", M / "ref-attn")
    gen("--consumer with a flipped weight byte", "--codec", M / "codec-ref-attn-ft",
        consumer=_raw_copy("ref-attn-ft", "ft-flip", "model.safetensors", _flip))
    cli("transfer serve: --codec missing a tensor", ["transfer", "serve", "--producer", M / "ref-attn", "--codec",
                                                     BIG / "c-missing", "--port", "0"])
    klass("bound")
    gen("--max-new-tokens 20000", "--codec", M / "codec-ref-attn-ft", "--max-new-tokens", "20000")
    gen("--max-new-tokens 0", "--codec", M / "codec-ref-attn-ft", "--max-new-tokens", "0")
    gen("--prompt longer than the positions", "--codec", M / "codec-ref-attn-ft", "--prompt",
        " ".join(["apple"] * 9000))
    gen("--timeout nan", "--codec", M / "codec-ref-attn-ft", "--timeout", "nan")
    gen("--timeout 0", "--codec", M / "codec-ref-attn-ft", "--timeout", "0")
    gen("--threads 0", "--codec", M / "codec-ref-attn-ft", "--threads", "0")
    gen("--server no port", "--codec", M / "codec-ref-attn-ft", "--server", "localhost")
    gen("valid: 4 new tokens", "--codec", M / "codec-ref-attn-ft", "--max-new-tokens", "4", "--json", expect_ok=True,
        check=lambda o: json.loads(o.strip().splitlines()[-1])["new_tokens"] >= 1)
    for label, args in (("--length 100000", ["--length", "100000"]), ("--length 16384", ["--length", "16384"]),
                        ("--prefixes 2", ["--prefixes", "2", "--length", "96"]),
                        ("--prefixes 10^9", ["--prefixes", str(10**9), "--length", "96"]),
                        ("--threads 0", [*small, "--threads", "0"]), ("--threads -3", [*small, "--threads", "-3"]),
                        ("--seed -1", [*small, "--seed", "-1"]), ("--rank-k 0", [*small, "--rank-k", "0"]),
                        ("--rank-k 999", [*small, "--rank-k", "999"]), ("--bits 3", [*small, "--bits", "3"]),
                        ("--reuse-map nope", [*small, "--reuse-map", "nope"])):
        cal(label, "--out", w / "cnew", *args)
    for label, args in (("--port 70000", ["--port", "70000"]), ("--port -1", ["--port", "-1"]),
                        ("--threads 0", ["--threads", "0"]), ("--max-tokens 0", ["--max-tokens", "0"]),
                        ("--store nope://", ["--store", "nope://x"])):
        cli(f"transfer serve: {label}", ["transfer", "serve", "--producer", M / "ref-attn", "--codec",
                                         M / "codec-ref-attn-ft", *args])
    bench("--n 0", "--n", "0")
    bench("--n 10^7", "--n", str(10**7))
    bench("--ppl-n -1", "--ppl-n", "-1")
    bench("--threads 0", "--threads", "0")
    bench("--length 100000", "--length", "100000")
    klass("list")
    cal("--patch ²", "--out", w / "cnew", *small, "--patch", "²")
    cal("--patch -1", "--out", w / "cnew", *small, "--patch", "-1")
    bench("--length duplicate", "--length", "128,128")
    bench("--length empty", "--length", "")
    bench("--length 1K,1024", "--length", "1K,1024")


def server_cases(server: _Server) -> None:
    klass("srv")
    vocab = len(server.tok)
    srv(server, "ids >= vocabulary", json.dumps({"op": "encode", "ids": [1, 2, vocab + 5]}).encode())
    srv(server, "ids = 2^31 - 1", json.dumps({"op": "encode", "ids": [1, 2**31 - 1]}).encode())
    srv(server, "negative id", json.dumps({"op": "encode", "ids": [1, -1]}).encode())
    srv(server, "float ids", json.dumps({"op": "encode", "ids": [1.0, 2.5]}).encode())
    srv(server, "bool ids", json.dumps({"op": "encode", "ids": [True, 2]}).encode())
    srv(server, "empty ids", json.dumps({"op": "encode", "ids": []}).encode())
    srv(server, "32768 tokens (> the producer's 8192 positions)",
        json.dumps({"op": "encode", "ids": [5] * 32768}).encode())
    srv(server, "8193 tokens", json.dumps({"op": "encode", "ids": [5] * 8193}).encode())
    srv(server, "deeply nested JSON", b"[" * 200_000 + b"]" * 200_000)
    srv(server, "deeply nested ids", json.dumps({"op": "encode"}).encode()[:-1] + b', "ids": ' + b"[" * 100_000
        + b"]" * 100_000 + b"}")
    srv(server, "unknown op", json.dumps({"op": "drop tables"}).encode())
    srv(server, "not JSON", b"\xff\xfe not json")
    srv(server, "a JSON list", b"[1, 2, 3]")
    srv(server, "valid: 16 tokens", json.dumps({"op": "encode", "ids": list(range(3, 19))}).encode(), expect_ok=True)


def api_axis_cases(server: _Server) -> None:
    import torch

    from kvstate.lab.depth.train import DepthTrainConfig
    from kvstate.lab.harness import load_reference
    from kvstate.lab.semantic.train import TrainConfig as SemanticTrainConfig
    from kvstate.semantic import SemanticCache, SemanticConfig, SemanticRouter, prefill_and_compress
    from kvstate.semantic.segment import SegmentConfig
    from kvstate.transfer import CalibrationConfig, CodecConfig, Payload, ServerConfig, fetch_payload

    klass("api")
    for label, kw in (("budget=True", {"budget": True}), ("budget=nan", {"budget": math.nan}),
                      ("budget='0.5'", {"budget": "0.5"}), ("rank=True", {"rank": True}), ("rank=2.0", {"rank": 2.0}),
                      ("sticky='no'", {"sticky": "no"}), ("slow_tier=0", {"slow_tier": 0}),
                      ("segment=None", {"segment": None}), ("zoom='most'", {"zoom": "most"})):
        api(f"SemanticConfig({label})", lambda kw=kw: SemanticConfig(**kw))
    for label, kw in (("min_span=True", {"min_span": True}), ("anchor_fraction=nan", {"anchor_fraction": math.nan}),
                      ("threshold=inf", {"threshold": math.inf}), ("sinks=2.0", {"sinks": 2.0})):
        api(f"SegmentConfig({label})", lambda kw=kw: SegmentConfig(**kw))
    for label, kw in (("lengths=(128, 128)", {"lengths": (128, 128)}), ("budget=True", {"budget": True}),
                      ("minutes=inf", {"minutes": math.inf}), ("max_steps=0", {"max_steps": 0}),
                      ("tasks=('poems',)", {"tasks": ("poems",)}), ("seed=-1", {"seed": -1}), ("lr=nan", {"lr": math.nan})):
        api(f"semantic TrainConfig({label})", lambda kw=kw: SemanticTrainConfig(**kw))
    for label, kw in (("p=True", {"p": True, "tokens": 256}), ("minutes=inf", {"minutes": math.inf}),
                      ("length=True", {"length": True, "tokens": 256}), ("tokens=0.5", {"tokens": 0.5}),
                      ("seed=-1", {"seed": -1, "tokens": 256}), ("pattern=7", {"pattern": 7, "tokens": 256})):
        api(f"DepthTrainConfig({label})", lambda kw=kw: DepthTrainConfig(**kw))
    model, _ = load_reference(M / "ref-attn")
    ft, _ = load_reference(M / "ref-attn-ft")
    router = SemanticRouter.load(M / "ref-attn-sekv")
    for label, ids in (("batch of 2", torch.zeros(2, 16, dtype=torch.long)), ("float ids", torch.zeros(1, 16)),
                       ("ids >= vocabulary", torch.full((1, 16), 1490)), ("negative ids", torch.full((1, 16), -1)),
                       ("1-D ids", torch.zeros(16, dtype=torch.long)), ("no tokens", torch.zeros(1, 0, dtype=torch.long)),
                       ("8193 tokens > positions", torch.full((1, 8193), 5)), ("a list", [[1, 2, 3]])):
        api(f"prefill_and_compress({label})",
            lambda ids=ids: prefill_and_compress(model, SemanticCache(model, router), ids))
    api("prefill_and_compress(cache of another model)",
        lambda: prefill_and_compress(ft, SemanticCache(model, router), torch.full((1, 64), 5)))
    api("SemanticCache(router trained for another model)", lambda: SemanticCache(ft, router))
    api("SemanticCache(config='fast')", lambda: SemanticCache(model, router, "fast"))  # type: ignore[arg-type]
    api("prefill_and_compress(valid 128 tokens)",
        lambda: prefill_and_compress(model, SemanticCache(model, router, SemanticConfig(budget=0.8)),
                                     torch.randint(5, 1000, (1, 128), generator=torch.Generator().manual_seed(0))),
        check=lambda r: tuple(r.shape) == (1, 128, 1490) and bool(torch.isfinite(r).all()))
    codec = server.codec
    for label, ids in (("ids >= vocabulary", torch.full((1, 16), 1490)), ("float ids", torch.zeros(1, 16)),
                       ("batch of 2", torch.zeros(2, 16, dtype=torch.long)), ("1-D ids", torch.zeros(16, dtype=torch.long)),
                       ("8193 tokens > positions", torch.full((1, 8193), 5))):
        api(f"Codec.encode({label})", lambda ids=ids: codec.encode(model, ids))
    good = codec.encode(model, torch.full((1, 16), 5))
    absurd = {k: (v * 1e30 if k.endswith(".scale") else v) for k, v in good.tensors.items()}
    api("Codec.decode(absurd producer-side scales)",
        lambda: codec.decode(ft, Payload(good.pair, good.n_tokens, good.token_hash, absurd, good.meta)))
    api("Codec.decode(valid payload)", lambda: codec.decode(ft, good),
        check=lambda c: c.get_seq_length() == 16)
    api("fetch_payload(float ids)", lambda: fetch_payload(server.address, [1.7, 2.2], codec.pair, timeout=30))
    api("fetch_payload(timeout=nan)", lambda: fetch_payload(server.address, [1, 2], codec.pair, timeout=math.nan))
    for label, kw in (("port=True", {"port": True}), ("timeout_s=nan", {"timeout_s": math.nan}),
                      ("max_tokens=0", {"max_tokens": 0}), ("max_request_bytes=2.5", {"max_request_bytes": 2.5})):
        api(f"ServerConfig({label})", lambda kw=kw: ServerConfig(**kw))
    for label, kw in (("rank_k=True", {"rank_k": True, "rank_v": 4, "rank_h": 4}),
                      ("patch_layers=(1.5,)", {"rank_k": 4, "rank_v": 4, "rank_h": 4, "patch_layers": (1.5,)})):
        api(f"CodecConfig({label})", lambda kw=kw: CodecConfig(**kw))
    for label, kw in (("prefixes=True", {"prefixes": True}), ("ridge=nan", {"ridge": math.nan}),
                      ("seed=-1", {"seed": -1}), ("length=2.5", {"length": 2.5}), ("tasks=()", {"tasks": ()})):
        api(f"CalibrationConfig({label})", lambda kw=kw: CalibrationConfig(**kw))


def _section(fn, *args) -> None:  # type: ignore[no-untyped-def]
    """Run one group of cases; a crash of the sweep itself is one ``SWEEP`` row, and the next group runs."""
    try:
        fn(*args)
    except Exception as exc:
        classes.append(_CLASS[0])
        rows.append(("all", f"{fn.__name__} stopped", "SWEEP", f"{type(exc).__name__}: {exc}"[:110]))


def axis_cases() -> None:
    shutil.copytree(REPO_MODELS, M)
    BIG.mkdir()
    wanted = sys.argv[sys.argv.index("--sections") + 1].split(",") if "--sections" in sys.argv else [
        "depth", "semantic", "transfer", "server", "api"]
    if "depth" in wanted:
        _section(depth_cases)
    if "semantic" in wanted:
        _section(semantic_cases)
    server = _Server()
    try:
        for name, fn in (("transfer", transfer_cases), ("server", server_cases), ("api", api_axis_cases)):
            if name in wanted:
                _section(fn, server)
    finally:
        server.close()
    same = not DAMAGED and fingerprint(M) == fingerprint(REPO_MODELS)
    classes.append("out")
    rows.append(("all", "models/ byte-identical after every case", "ok" if same else "DISK",
                 "every file's SHA-256, size and mode equal" if same else
                 f"changed by {len(DAMAGED)} case(s), e.g. {', '.join(DAMAGED[:3])}"))


def report() -> None:
    counts = Counter((kind, outcome) for kind, _, outcome, _ in rows)
    by_class = Counter(f"{c}:{'pass' if r[2] in ('error', 'error2', 'ok') else r[2]}" for c, r in zip(classes, rows, strict=True))
    width = max(len(r[1]) for r in rows)
    for i, (kind, name, outcome, detail) in enumerate(rows, 1):
        print(f"{i:3} {kind:3} {name:{width}} {outcome:9} {detail}")
    bad = [r for r in rows if r[2] in ("SILENT", "SILENT-2", "TRACEBACK", "HANG", "DISK", "WRONG", "SWEEP")]
    print(json.dumps({"cases": len(rows), "counts": {f"{k}:{o}": n for (k, o), n in sorted(counts.items())},
                      "by_class": dict(sorted(by_class.items())), "failures": len(bad)}))


def markdown(path: Path) -> None:
    lines = ["| # | class | via | input | outcome | message / result |", "|---|---|---|---|---|---|"]
    lines += [f"| {i} | {c} | {k} | {n} | {o} | {d.replace('|', '/')} |"
              for i, (c, (k, n, o, d)) in enumerate(zip(classes, rows, strict=True), 1)]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    setup()
    only_new = "--only" in sys.argv and sys.argv[sys.argv.index("--only") + 1] == "new"
    try:
        if not only_new:
            cli_cases()
            eval_cases()
            train_cases()
            usage_cases()
            report_cases()
            api_cases()
        axis_cases()
    finally:
        report()
        if "--md" in sys.argv:
            markdown(Path(sys.argv[sys.argv.index("--md") + 1]))
        shutil.rmtree(ROOT, ignore_errors=True)
