"""A GGUF checkpoint converted once into a model directory kvstate loads in seconds (safetensors + tokenizer).

transformers reads GGUF files itself (``from_pretrained(dir, gguf_file=...)``, through the ``gguf``
package): it de-quantizes every tensor to torch and converts the GGUF vocabulary into a tokenizer with its
chat template — tens of seconds on every load, and a GGUF-loaded model refuses ``save_pretrained`` (its config
carries a ``quantization_config``). :func:`convert_gguf` does that once: it loads the GGUF, builds the same
architecture from the config without the quantization entry, loads the de-quantized weights into it (fp32:
Q4_1's ``d * q + m`` values are exact there, not in bf16), checks that the converted model reproduces the
GGUF-loaded one (logits within ``tolerance`` and the same greedy replies on ``prompts``), and writes the
directory aside and moves it into place whole, with a ``manifest.json`` recording every file's sha256, the
source's sha256 and the check. A directory already converted from the same source is left as it is.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvstate.errors import IntegrityError, KVStateError
from kvstate.integrity import MANIFEST, read_manifest, sha256_file, write_manifest
from kvstate.io_safety import staged_dir

# the conversion's check: chats a reader can judge, greedy, through the chat template
CHECK_PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Name three primary colors.",
    "What is 12 plus 30?",
    "Write one sentence about the sea.",
    "Which planet is closest to the sun?",
    "Translate 'good morning' into French.",
    "What do bees make?",
    "Give a synonym for 'happy'.",
    "How many days are in a week?",
    "What is the opposite of 'cold'?",
    "Name a fruit that is yellow.",
    "What language is spoken in Brazil?",
    "Complete the sentence: The quick brown fox",
    "What is water made of?",
    "Who wrote 'Romeo and Juliet'?",
    "What is the boiling point of water in Celsius?",
    "Name an animal that lives in the ocean.",
    "What color is the sky on a clear day?",
    "What is the square root of 81?",
    "Say hello in Spanish.",
)


class ConversionError(KVStateError):
    """A GGUF file could not be converted, or a conversion on disk does not match its source."""


def converted_from(out: Path) -> str | None:
    """The source sha256 recorded by the conversion at ``out`` (verifying every file), or None when absent."""
    if not (out / MANIFEST).is_file():
        return None
    m = read_manifest(out, kind="model", covers=("model.safetensors", "config.json", "tokenizer.json"),
                      remedy="delete the directory and run `kvstate models convert` again")
    src = m.get("source")
    return str(src.get("sha256")) if isinstance(src, dict) else None


def _chat_ids(tokenizer: Any, prompt: str) -> torch.Tensor:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt")
    return ids["input_ids"] if hasattr(ids, "keys") else ids  # type: ignore[no-any-return]


@torch.no_grad()
def compare(a: Any, b: Any, tokenizer: Any, prompts: Sequence[str], new_tokens: int = 24) -> dict[str, Any]:
    """Max |logit difference| over each prompt's positions, and how many greedy replies are equal."""
    worst, equal, replies = 0.0, 0, []
    for p in prompts:
        ids = _chat_ids(tokenizer, p)
        worst = max(worst, float((a(ids).logits - b(ids).logits).abs().max()))
        kw = {"max_new_tokens": new_tokens, "do_sample": False, "attention_mask": torch.ones_like(ids),
              "pad_token_id": tokenizer.eos_token_id}
        ra, rb = a.generate(ids, **kw)[0, ids.shape[1]:], b.generate(ids, **kw)[0, ids.shape[1]:]
        equal += int(torch.equal(ra, rb))
        replies.append({"prompt": p, "reply": tokenizer.decode(ra, skip_special_tokens=True)})
    return {"max_logit_diff": worst, "greedy_equal": equal, "prompts": len(prompts), "replies": replies}


def convert_gguf(gguf: Path, out: Path, *, source: dict[str, Any], command: str, tolerance: float = 1e-4,
                 prompts: Sequence[str] = CHECK_PROMPTS, overwrite: bool = False,
                 progress: bool = True) -> dict[str, Any]:
    """Convert ``gguf`` into ``out`` (see the module docstring); returns the manifest's ``conversion`` entry, or
    ``{"skipped": ...}`` when ``out`` already holds a verified conversion of the same source (``source["sha256"]``).
    ``overwrite``: replace a directory holding something else, another source's conversion or damaged files."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvstate.models.fingerprint import model_fingerprint

    def say(msg: str) -> None:
        if progress:
            print(f"convert: {msg}", file=sys.stderr, flush=True)

    if not gguf.is_file():
        raise ConversionError(f"GGUF file {str(gguf)!r} not found; fetch it with `kvstate models convert`")
    try:
        have = converted_from(out) if out.is_dir() else None
    except IntegrityError:
        if not overwrite:
            raise
        have = "damaged"  # --overwrite: convert again over a directory whose files no longer match
    if have is not None and have == source.get("sha256"):
        return {"skipped": f"{out} already holds this conversion (source sha256 {have[:12]})"}
    if out.exists() and any(out.iterdir()) and not overwrite:
        what = "holds no conversion" if have is None else f"was converted from another source (sha256 {have[:12]})"
        raise ConversionError(f"{str(out)!r} exists and {what}; pass --overwrite to replace it, or another --out")
    t0 = time.monotonic()
    say(f"reading {gguf.name} (de-quantizing and converting its tokenizer: tens of seconds)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    fields = {k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"}
    config = type(loaded.config).from_dict(fields)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise ConversionError(f"{gguf.name}: the de-quantized weights do not fit {type(model).__name__} "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.tie_weights()
    with staged_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        say(f"checking the converted model against the GGUF-loaded one on {len(prompts)} chats")
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        check = compare(reloaded, loaded, tokenizer, prompts)
        if check["max_logit_diff"] > tolerance or check["greedy_equal"] != len(prompts):
            raise ConversionError(f"{gguf.name}: the converted model differs from the GGUF-loaded one (max logit "
                                  f"difference {check['max_logit_diff']:.2e} > {tolerance:g} or greedy replies equal "
                                  f"on {check['greedy_equal']} of {len(prompts)} chats); nothing was written")
        import transformers

        conversion = {"command": command, "transformers": transformers.__version__, "torch": torch.__version__,
                      "dtype": "float32", "seconds": round(time.monotonic() - t0, 1), **check}
        names = sorted(p.name for p in tmp.iterdir() if p.is_file() and p.name != MANIFEST)
        write_manifest(tmp, kind="model", files=names, meta={
            "source": source, "conversion": conversion, "fingerprint": model_fingerprint(reloaded)})
    say(f"wrote {out} in {conversion['seconds']} s: max logit difference {check['max_logit_diff']:.1e}, greedy "
        f"replies equal on {check['greedy_equal']} / {len(prompts)} chats")
    return conversion


__all__ = ["CHECK_PROMPTS", "ConversionError", "compare", "convert_gguf", "converted_from", "sha256_file"]
