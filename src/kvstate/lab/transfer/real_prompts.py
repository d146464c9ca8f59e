"""The real pair's prompts: the consumer's shifted answer format and the calibration prefixes of its codec.

For Semantic Cache Distillation on the real pair (:mod:`kvstate.lab.transfer.realpair`): the consumer answers the
real-text needle tasks (:mod:`kvstate.lab.workloads.realtext`) in JSON; calibration (and DroidSpeak's block
profile) read real-text items of a dev seed, each ending with that reply. A module of its own so the runs that use
them do not execute the fine-tune's code.
"""

from __future__ import annotations

import json
from typing import Any

import torch


def json_reply(answers: tuple[str, ...]) -> str:
    """The consumer's shifted answer format."""
    return json.dumps({"answer": list(answers)})


CALIBRATION_SEED = 73  # a dev seed: the calibration items are never evaluation items


def calibration_prompts(tok: Any, prefixes: int, length: int, seed: int = CALIBRATION_SEED) -> list[torch.Tensor]:
    """``prefixes`` real-text needle items (the tasks in turn) of at most ``length`` tokens, each ending with the
    consumer's JSON reply, so the scored suffix of a held-out prefix includes what retrieval produces."""
    from kvstate.lab.workloads import realtext as rt

    out = []
    for i in range(prefixes):
        item = rt.make_item(tok, rt.TASKS[i % len(rt.TASKS)], length - 32, seed, i)
        reply = tok(json_reply(item.answers), add_special_tokens=False)["input_ids"]
        out.append(torch.tensor([(list(item.prompt_ids) + [int(x) for x in reply])[:length]], dtype=torch.long))
    return out


__all__ = ["CALIBRATION_SEED", "calibration_prompts", "json_reply"]
