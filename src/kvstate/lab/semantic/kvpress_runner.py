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
is the full K/V of the tokens seen (context, question, answer). A press that compresses by masking (kvpress's
"fake compression": KVzip, AdaKV, CriticalKV, ... set ``masked_key_indices`` on each attention module and keep
the K/V) is counted by what attention can still read: the masked keys' K/V are not counted as held or read.
Each row also records ``context_bytes`` / ``context_full_bytes``: the compressed context alone, before the question.

    python kvpress_runner.py --model DIR --tasks tasks.jsonl --out results.jsonl \
        --presses SnapKVPress,TOVAPress --ratios 0.75
    python kvpress_runner.py --model DIR --serve   # one JSON request per stdin line, one JSON reply line each:
        # {"item": {...}, "presses": [...], "ratios": [...]} -> {"rows": [...]} (the item-major loop's worker)
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


def _masked(model, cache) -> int:  # type: ignore[no-untyped-def]
    """K/V bytes a masking press hides from attention (kvpress's ``masked_key_indices``), over every layer."""
    total = 0
    for layer in model.model.layers:
        idx = getattr(layer.self_attn, "masked_key_indices", None)
        if idx is not None:
            k = cache.layers[layer.self_attn.layer_idx].keys
            total += len(idx[0]) * 2 * k.shape[3] * k.element_size()
    return total


def _held(model, cache) -> int:  # type: ignore[no-untyped-def]
    return _bytes(cache) - _masked(model, cache)


def _answer(model, cache, question, start, max_new, eos):  # type: ignore[no-untyped-def]
    import torch

    ids = torch.tensor([question])
    pos = torch.arange(start, start + len(question))[None]
    tb = _token_bytes(cache)
    reads: list[tuple[int, int]] = []  # per pass: (K/V read, full K/V of the tokens seen then)
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
        p = start + len(question)
        reads.append((_held(model, cache), p * tb))
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
            reads.append((_held(model, cache), p * tb))
            nxt = int(out.logits[0, -1].argmax())
        dt = time.perf_counter() - t0
    kept = _held(model, cache)
    counts = {"resident_bytes": kept, "total_bytes": kept, "attended_bytes_peak": max(r for r, _ in reads),
              "full_bytes": p * tb, "read_ratio_peak": max(r / f for r, f in reads)}
    return new, dt, steps, counts


def _press(kvpress, name, ratio):  # type: ignore[no-untyped-def]
    """(press, None) or (None, why it cannot run)."""
    cls = getattr(kvpress, name, None)
    if cls is None:
        return None, f"kvpress has no {name}"
    try:
        return cls(compression_ratio=ratio), None
    except Exception as exc:  # a press that does not take compression_ratio
        return None, f"{type(exc).__name__}: {exc}"


def run_item(model, tok, kvpress, it, presses, ratios) -> list:  # type: ignore[no-untyped-def]
    """Every press at every ratio on one item (a row per question, or one error row per press and ratio)."""
    import torch
    from transformers import DynamicCache

    rows = []
    for name in presses:
        for ratio in ratios:
            press, why = _press(kvpress, name, ratio)
            where = {"press": name, "ratio": ratio, "task": it["task"], "length": it["length"], "index": it["index"]}
            if press is None:
                rows.append({**where, "error": why})
                continue
            ctx = torch.tensor([it["context"]])
            cache = DynamicCache()
            try:
                with torch.no_grad(), press(model):
                    model(input_ids=ctx, position_ids=torch.arange(ctx.shape[1])[None], past_key_values=cache,
                          use_cache=True)
            except Exception as exc:
                rows.append({**where, "error": f"{type(exc).__name__}: {exc}"})
                continue
            context = {"context_bytes": _held(model, cache), "context_full_bytes": ctx.shape[1] * _token_bytes(cache)}
            for qi, (q, mx) in enumerate(zip(it["questions"], it["max_new_tokens"], strict=True)):
                try:
                    new, dt, steps, counts = _answer(model, copy.deepcopy(cache), q, ctx.shape[1], mx,
                                                     tok.eos_token_id)
                except Exception as exc:  # e.g. a masking press that finds no fake key while decoding
                    rows.append({**where, "question": qi, "error": f"{type(exc).__name__}: {exc}"})
                    continue
                rows.append({**where, "question": qi, "prediction": tok.decode(new, skip_special_tokens=True),
                             **counts, **context, "decode_s": dt, "decode_steps": steps})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tasks")
    ap.add_argument("--out")
    ap.add_argument("--presses")
    ap.add_argument("--ratios")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--serve", action="store_true", help="answer requests on stdin, one JSON line each")
    args = ap.parse_args(argv)
    if not args.serve and not (args.tasks and args.out and args.presses and args.ratios):
        ap.error("--tasks, --out, --presses and --ratios are required without --serve")

    import kvpress
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    versions = {"transformers": transformers.__version__, "kvpress": getattr(kvpress, "__version__", "?")}
    if args.serve:
        print(json.dumps({"ready": True, **versions}), flush=True)
        for line in sys.stdin:
            if not line.strip():
                continue
            req = json.loads(line)
            rows = run_item(model, tok, kvpress, req["item"], req["presses"], [float(r) for r in req["ratios"]])
            print(json.dumps({"rows": rows}), flush=True)
        return 0
    with open(args.tasks) as f:
        items = [json.loads(line) for line in f if line.strip()]
    presses, ratios = args.presses.split(","), [float(r) for r in args.ratios.split(",")]
    rows = []
    for name in presses:  # press-major, as before: one press's rows over every item, then the next press
        for ratio in ratios:
            for it in items:
                rows += run_item(model, tok, kvpress, it, [name], [ratio])
                print(f"{name} {ratio} {it['task']} {it['length']} #{it['index']}", file=sys.stderr, flush=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, args.out)
    print(json.dumps({**versions, "rows": len(rows)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
