"""Dump directory writer (docs/ARCHITECTURE.md §5), read by ``offload-inspect``.

``DUMP_DIR/report.json`` = ``{"format": "offload_passes.report", "version": 1, "graphs": [...]}``
rewritten after every graph; ``DUMP_DIR/<graph_id>/NN_<stage>.py`` hold the graph code per stage.
In a multi-rank run (``torch.distributed`` initialised with world size > 1) each rank writes under its
own ``DUMP_DIR/rank<r>/`` (same names inside), so ranks never overwrite each other's report.
"""
from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

from .passes._fx import graph_code

log = logging.getLogger("offload_passes.dump")

FORMAT = "offload_passes.report"
VERSION = 1
STAGES = {"dynamo": "00_dynamo", "rewrite": "01_rewrite", "functional": "02_functional", "reinplace": "03_reinplace"}

_lock = threading.Lock()


def rank_dir_name() -> str | None:
    """``rank<r>`` when this process is one rank of an initialised world of size > 1, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return f"rank{dist.get_rank()}"
    return None


class Dumper:
    def __init__(self, root: str | Path):
        sub = rank_dir_name()
        self.root = Path(root) / sub if sub else Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def graph(self, graph_id: str, stage: str, gm_or_graph: Any) -> str:
        d = self.root / graph_id
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"{STAGES[stage]}.py"
        path.write_text(graph_code(gm_or_graph))
        return str(path)

    def report(self, graph_report: dict) -> None:
        """Add or replace ``graph_report`` (by graph_id) in report.json."""
        path = self.root / "report.json"
        with _lock:
            data = {"format": FORMAT, "version": VERSION, "graphs": []}
            if path.exists():
                try:
                    old = json.loads(path.read_text())
                    if old.get("format") == FORMAT:
                        data["graphs"] = [g for g in old.get("graphs", []) if g.get("graph_id") != graph_report["graph_id"]]
                except (OSError, ValueError):
                    log.warning("offload dump: %s unreadable, starting a new report", path)
            data["graphs"].append(graph_report)
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(data, indent=1, default=str))
            tmp.replace(path)
