"""``kvpress``: the one adapter through which NVIDIA kvpress presses run as baselines.

The presses run in kvpress's own environment (:mod:`kvstate.lab.semantic.baselines_kvpress`: kvpress patches
transformers' attention when imported, so it never enters this process). ``kvpress`` in ``--methods`` stands
for its default presses (SnapKV, StreamingLLM, TOVA, ExpectedAttention, Knorm); any kvpress class name ending
in ``Press`` runs that press; result rows carry the snake-case name (``SnapKVPress`` → ``snap_kv_press``).
A press that cannot run is recorded as not run with the reason, never scored 0
(``docs/techniques.md#resolution``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

from kvstate.errors import KVStateError
from kvstate.lab.semantic import baselines_kvpress as kp
from kvstate.lab.semantic.methods.base import Adapter, register

VENV = Path(".venv-kvpress")
SUFFIX = "Press"


class KVPress(Adapter):
    name: ClassVar[str] = "kvpress"
    about: ClassVar[str] = f"kvpress presses in their own environment: {', '.join(kp.DEFAULT_PRESSES)} or any *Press"
    venv: Path = VENV  # the isolated environment (the CLI's --kvpress-venv)

    def claims(self, name: str) -> list[str] | None:
        if name == self.name:
            return list(kp.DEFAULT_PRESSES)
        return [name] if name.endswith(SUFFIX) and name.isidentifier() else None

    def owns_result(self, name: str) -> bool:
        return name.endswith("_press")

    def run(self, model_dir: Any, items: Sequence[Any], names: Sequence[str], budgets: Sequence[float],
            threads: int, journal: Any, progress: Callable[[int], None] | None,
            note: Callable[[str], None]) -> tuple[list[Any], list[dict[str, Any]], dict[str, Any]]:
        info: dict[str, Any] = {"presses": list(names), "hub_only": kp.NOT_RUN}
        if not items:
            return [], [], info
        try:
            py = kp.ensure_env(self.venv)
            info["versions"] = kp.versions(py)
            note(f"kvpress: {len(names)} presses x {len(budgets)} budgets x {len(items)} items (isolated env)")
            with tempfile.TemporaryDirectory() as work:
                got, failed = kp.run_presses(py, Path(model_dir), items, names, budgets, Path(work), threads,
                                             journal=journal, progress=progress)
            return got, failed, info
        except KVStateError as exc:  # say why, run the rest: every press is "not run", never 0
            note(f"kvpress baselines not run: {exc}")
            return [], kp.not_run(names, budgets, str(exc)), info


register(KVPress())
