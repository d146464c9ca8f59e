"""Run NVIDIA kvpress presses on task files, in kvpress's own virtual environment.

Standalone on purpose: it imports only the standard library, torch, transformers and kvpress (never
kvstate), because importing kvpress patches transformers' attention for the whole process. The
benchmark (:mod:`kvstate.lab.semantic.baselines_kvpress`) writes the tasks as JSONL, runs this file with the
isolated interpreter and reads the JSONL it writes back.

Protocol (kvpress's own): the context is prefilled inside ``with press(model):`` and so compressed
without the question; the question is then fed outside the press with explicit positions and the
answer decoded greedily. Every question of an item starts from a copy of the same compressed cache.
Bytes are measured here, from the tensors of this process's cache (the kvstate byte-count contract,
``kvstate.semantic.accounting``): a press keeps its K/V on the device and drops the rest, so resident =
total = the kept K/V after the answer; the peak attended is the largest K/V any forward pass read; full
is the full K/V of the tokens seen (context, question, answer).

    python kvpress_runner.py --model DIR --tasks tasks.jsonl --out results.jsonl \
        --presses SnapKVPress,TOVAPress --ratios 0.75
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time


def _bytes(cache) -> int:  # type: ignore[no-untyped-def]
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers
               if getattr(layer, "keys", None) is not None and layer.keys.numel())


def _token_bytes(cache) -> int:  # type: ignore[no-untyped-def]
    """Full K/V bytes of one token over every attention layer."""
    return sum(2 * layer.keys.shape[1] * layer.keys.shape[3] * layer.keys.element_size() for layer in cache.layers
               if getattr(layer, "keys", None) is not None and layer.keys.numel())


def _answer(model, cache, question, start, max_new, eos):  # type: ignore[no-untyped-def]
    import torch

    ids = torch.tensor([question])
    pos = torch.arange(start, start + len(question))[None]
    tb = _token_bytes(cache)
    reads: list[tuple[int, int]] = []  # per pass: (K/V read, full K/V of the tokens seen then)
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
        p = start + len(question)
        reads.append((_bytes(cache), p * tb))
        nxt = int(out.logits[0, -1].argmax())
        new: list[int] = []
        t0 = time.perf_counter()
        steps = 0
        while nxt != eos and len(new) < max_new:
            new.append(nxt)
            if len(new) >= max_new:
                break
            out = model(input_ids=torch.tensor([[nxt]]), position_ids=torch.tensor([[p]]), past_key_values=cache,
                        use_cache=True)
            p += 1
            steps += 1
            reads.append((_bytes(cache), p * tb))
            nxt = int(out.logits[0, -1].argmax())
        dt = time.perf_counter() - t0
    kept = _bytes(cache)
    counts = {"resident_bytes": kept, "total_bytes": kept, "attended_bytes_peak": max(r for r, _ in reads),
              "full_bytes": p * tb, "read_ratio_peak": max(r / f for r, f in reads)}
    return new, dt, steps, counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tasks", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--presses", required=True)
    ap.add_argument("--ratios", required=True)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    import kvpress
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    with open(args.tasks) as f:
        items = [json.loads(line) for line in f if line.strip()]
    rows = []
    for name in args.presses.split(","):
        cls = getattr(kvpress, name, None)
        for ratio in (float(r) for r in args.ratios.split(",")):
            if cls is None:
                rows.append({"press": name, "ratio": ratio, "error": f"kvpress has no {name}"})
                continue
            try:
                press = cls(compression_ratio=ratio)
            except Exception as exc:  # a press that does not take compression_ratio
                rows.append({"press": name, "ratio": ratio, "error": f"{type(exc).__name__}: {exc}"})
                continue
            for it in items:
                ctx = torch.tensor([it["context"]])
                cache = DynamicCache()
                try:
                    with torch.no_grad(), press(model):
                        model(input_ids=ctx, position_ids=torch.arange(ctx.shape[1])[None], past_key_values=cache,
                              use_cache=True)
                except Exception as exc:
                    rows.append({"press": name, "ratio": ratio, "task": it["task"], "length": it["length"],
                                 "index": it["index"], "error": f"{type(exc).__name__}: {exc}"})
                    continue
                for qi, (q, mx) in enumerate(zip(it["questions"], it["max_new_tokens"], strict=True)):
                    new, dt, steps, counts = _answer(model, copy.deepcopy(cache), q, ctx.shape[1], mx,
                                                     tok.eos_token_id)
                    rows.append({"press": name, "ratio": ratio, "task": it["task"], "length": it["length"],
                                 "index": it["index"], "question": qi,
                                 "prediction": tok.decode(new, skip_special_tokens=True), **counts,
                                 "decode_s": dt, "decode_steps": steps})
                print(f"{name} {ratio} {it['task']} {it['length']} #{it['index']}", file=sys.stderr, flush=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, args.out)
    print(json.dumps({"transformers": transformers.__version__, "kvpress": getattr(kvpress, "__version__", "?"),
                      "rows": len(rows)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
