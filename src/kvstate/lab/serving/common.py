"""What the serving benchmarks share: the model they load and the prompt vocabulary, and how a run ends
(written with its provenance, its decisions printed)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Loaded:
    """A model served in-process: its tokenizer, the token ids a prompt may use (the vocabulary less the special
    tokens) and what the tokenizer puts before every prompt."""

    model: Any
    tokenizer: Any
    ids: list[int]
    bos: tuple[int, ...]


def load(model_dir: Path) -> Loaded:
    """Load ``model_dir`` for a one-thread in-process benchmark."""
    import torch

    from kvstate.models import load_model
    from kvstate.models.loading import load_tokenizer

    torch.set_num_threads(1)
    tokenizer, model = load_tokenizer(model_dir), load_model(model_dir)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return Loaded(model, tokenizer, [i for i in range(vocab) if i not in special], tuple(tokenizer("").input_ids))


def missing_model(model_dir: Path) -> bool:
    """True (after one line on stderr) when ``model_dir`` holds no model."""
    if (model_dir / "config.json").is_file():
        return False
    print(f"error: --model {model_dir}: no model there (config.json missing); run `make setup`", file=sys.stderr)
    return True


def finish(out: Path | None, result: dict[str, Any], overwrite: bool) -> int:
    """Append the run to ``out`` (with its provenance) and print each decision; the exit status (0)."""
    if out is not None:
        from kvstate.lab.cli_output import write_results

        write_results(out, result["doc"], result["provenance"], overwrite=overwrite)
    for d in result["doc"]["decisions"]:
        print(f"{d['label']}: {d['value']:.3f} {d['ci']} -> {d['status']}", file=sys.stderr)
    return 0
