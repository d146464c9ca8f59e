"""Benchmark: greedy needle-QA chats through ``kvstate serve``, prefix cache on vs off: are the replies identical?

Starts two servers on ``models/ref-hybrid`` (``kvstate serve`` and ``... --no-cache``, one thread each) and
holds, per item, the same conversation with both over ``/v1/chat/completions`` (temperature 0, not
streamed): the item is a ``niah_multikey`` document of ``kvstate.lab.workloads.tasks`` (test seed,
``--lengths`` tokens, 4 needles ``the secret code of NAME is D D D D D D .``); the first message (``system``)
holds the document, then ``--turns`` user turns each ask one needle's code (turn 1 the task's own
question, later turns another needle's key, in the task's words ``what is the secret code of NAME ? answer :``),
and each turn appends the server's own previous reply as an ``assistant`` message (so a diverging reply
would diverge the rest of that conversation too). Items alternate which server is asked first.
``--template default`` serves the model as it is (no chat template of its own, so the server's default
``ROLE : CONTENT <eos>`` lines); ``--template raw`` serves a copy of the model directory (files linked)
(without manifest.json, whose checksums describe the original) whose tokenizer_config.json adds the chat template ``<bos>`` + each message's content, space-separated —
the raw ``context question answer : code .`` form the reference model was trained on.

Reported: replies identical between the servers (count / total, per turn), distinct replies, correct
replies (the reply's first 6 words are the asked code; context only: the model was trained on the raw
prompt, not this chat form), the cached server's prefix-cache counters from ``/metrics`` (hits, tokens reused),
and the load average. Target: 100% identical with >= 10 distinct replies.

Usage: ``OMP_NUM_THREADS=1 python benchmarks/serve_chat_qa.py [--model models/ref-hybrid] [--items 12]
[--lengths 512 1024] [--turns 3] [--max-tokens 12] [--template default|raw] [--seed 1000] [--out FILE]``. Progress and a table on
stderr, one JSON line on stdout; ``--out`` appends the run, with provenance, to a ``kvstate-results/1`` file.
Ignored: timings (``serve_chat.py`` measures them), sampling (greedy only).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvstate.lab.protocol import check_reported_seed
from kvstate.lab.provenance import Recorder, append_run
from kvstate.lab.workloads import tasks
from serve_clients import Server, loadavg, scrape

MODEL = Path("models/ref-hybrid")
RAW_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
NEEDLE = re.compile(r"the secret code of (\S+) is ((?:\d ){5}\d) \.")


def log(msg: str) -> None:
    print(f"[serve_chat_qa {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def conversations(model: Path, lengths: list[int], items: int, turns: int, seed: int) -> list[dict[str, Any]]:
    """Per item: the document, and ``turns`` (question, code) pairs, the task's own question first."""
    tok = AutoTokenizer.from_pretrained(model)
    out = []
    for i in range(items):
        length = lengths[i % len(lengths)]
        ex = tasks.generate("niah_multikey", length, i + 1, seed, tok)[-1]  # example i: its own needles
        needles = dict(NEEDLE.findall(ex.context))  # name -> code
        asked = ex.question.split(" of ")[1].split(" ?")[0]
        if needles.get(asked) != ex.answers[0]:
            raise RuntimeError(f"item {i}: needle parse disagrees with the task ({asked}: {needles.get(asked)} "
                               f"vs {ex.answers[0]})")
        others = [n for n in needles if n != asked]
        qs = [(ex.question, ex.answers[0])] + [
            (f"what is the secret code of {n} ? answer :", needles[n]) for n in others[: turns - 1]]
        out.append({"item": i, "length": length, "n_tokens": ex.n_tokens, "document": ex.context, "turns": qs})
    return out


def raw_template_copy(model: Path, out: Path) -> Path:
    """``model``'s files linked into ``out``, with :data:`RAW_TEMPLATE` as the tokenizer's chat template."""
    out.mkdir()
    for f in model.iterdir():
        if f.name not in ("tokenizer_config.json", "manifest.json"):  # the manifest's checksums name the original
            (out / f.name).symlink_to(f.resolve())
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": RAW_TEMPLATE}, indent=1))
    return out


def chat(url: str, model_name: str, messages: list[dict[str, str]], max_tokens: int) -> str:
    r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "model": model_name, "messages": messages, "temperature": 0, "max_tokens": max_tokens})
    if r.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:500]}")
    return str(r.json()["choices"][0]["message"]["content"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--items", type=int, default=12)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--turns", type=int, default=3, choices=[1, 2, 3, 4])
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--template", choices=["default", "raw"], default="default")
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.out is not None:
        check_reported_seed(args.seed)
    rec = Recorder(code=("serve", "prefix", "models", "lab/workloads"), models=[args.model], n=args.items,
                   seeds=[args.seed], tasks=["niah_multikey"], lengths=args.lengths,
                   settings={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"})
    convs = conversations(args.model, args.lengths, args.items, args.turns, args.seed)
    log(f"{len(convs)} conversations, document tokens {[c['n_tokens'] for c in convs]}")
    work = Path(tempfile.mkdtemp(prefix="serve_chat_qa-"))
    load = {"start": loadavg()}
    servers: list[Server] = []
    rows: list[dict[str, Any]] = []
    try:
        served = args.model if args.template == "default" else raw_template_copy(args.model, work / args.model.name)
        servers = [Server(served, True, "cache", work), Server(served, False, "no-cache", work)]
        name = servers[0].model_name()
        for c in convs:
            order = servers if c["item"] % 2 == 0 else servers[::-1]
            history = {s.name: [{"role": "system", "content": c["document"]}] for s in servers}
            for t, (question, code) in enumerate(c["turns"]):
                reply = {}
                for s in order:
                    history[s.name].append({"role": "user", "content": question})
                    reply[s.name] = chat(s.url, name, history[s.name], args.max_tokens)
                    history[s.name].append({"role": "assistant", "content": reply[s.name]})
                same = reply["cache"] == reply["no-cache"]
                correct = {k: v.split()[:6] == code.split() for k, v in reply.items()}
                rows.append({"item": c["item"], "length": c["length"], "turn": t + 1, "code": code,
                             "reply_cache": reply["cache"], "reply_no_cache": reply["no-cache"], "identical": same,
                             "correct_cache": correct["cache"], "correct_no_cache": correct["no-cache"]})
                log(f"item {c['item']} ({c['n_tokens']} tok) turn {t + 1}: {'same' if same else 'DIFFERENT'} "
                    f"{reply['cache']!r}" + ("" if same else f" vs {reply['no-cache']!r}") + f" (code {code})")
        metrics = scrape(servers[0].url)
    finally:
        for s in servers:
            s.stop()
    load["end"] = loadavg()
    n = len(rows)
    identical = sum(r["identical"] for r in rows)
    distinct = len({r["reply_cache"] for r in rows} | {r["reply_no_cache"] for r in rows})
    per_turn = {t: [sum(r["identical"] for r in rows if r["turn"] == t), sum(r["turn"] == t for r in rows)]
                for t in range(1, args.turns + 1)}
    correct = {"cache": sum(r["correct_cache"] for r in rows), "no-cache": sum(r["correct_no_cache"] for r in rows)}
    cache_counters = {k: v for k, v in metrics.items()
                      if k.startswith(("kvstate_prefix_hits", "kvstate_prefix_requests", "kvstate_prefix_reused_tokens",
                                       "kvstate_prefix_prompt_tokens"))}
    status = "met" if identical == n and distinct >= 10 else "missed"
    print(f"{'turn':>4} {'identical':>9} {'correct (cache)':>15} {'correct (no-cache)':>18}", file=sys.stderr)
    for t, (same, tot) in per_turn.items():
        cc = sum(r["correct_cache"] for r in rows if r["turn"] == t)
        cn = sum(r["correct_no_cache"] for r in rows if r["turn"] == t)
        print(f"{t:>4} {same:>5}/{tot:<3} {cc:>11}/{tot:<3} {cn:>14}/{tot:<3}", file=sys.stderr)
    print(f"all: {identical}/{n} identical, {distinct} distinct replies, correct {correct}; cached server's "
          f"prefix cache {cache_counters}; target (100% identical, >= 10 distinct): {status}; load {load}",
          file=sys.stderr)
    out = {"benchmark": "serve_chat_qa", "model": str(args.model), "task": "niah_multikey", "items": args.items,
           "lengths": args.lengths, "turns": args.turns, "template": args.template, "seed": args.seed, "replies": n, "identical": identical,
           "identical_per_turn": per_turn, "distinct_replies": distinct, "correct": correct,
           "target_identical_100pct_and_10_distinct": status, "cached_server_prefix_metrics": cache_counters,
           "load_average": load, "cpus": os.cpu_count(), "rows": rows}
    if args.out is not None:
        append_run(args.out, out, rec.finish())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
