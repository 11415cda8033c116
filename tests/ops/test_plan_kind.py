"""The plan kinds are written once: ``custom_ops/plan_kind.py`` (``PlanKind``), mirrored by the C++ header the
kernels include, read by name everywhere else."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offload_passes.custom_ops import plan_kind
from offload_passes.custom_ops.plan_kind import HEADER, NUM_PLAN_KINDS, PlanKind

ROOT = Path(__file__).resolve().parents[2]
CUSTOM_OPS = ROOT / "custom_ops"


def test_the_kinds_are_docs_ops_2_4():
    assert [(k.name, int(k)) for k in PlanKind] == [
        ("INVALID", 0), ("POOL_HIT", 1), ("FULL_OLD_MISS", 2), ("DECODE_WINDOW", 3), ("FUTURE_SKIP", 4),
        ("NEGATIVE_STOP", 5)]
    assert NUM_PLAN_KINDS == 6


def test_the_cpp_header_has_the_same_values():
    text = (CUSTOM_OPS / HEADER).read_text()
    found = {m.group(1): int(m.group(2)) for m in re.finditer(r"\b(k[A-Z]\w+)\s*=\s*(\d+)", text)}
    camel = {"k" + "".join(w.capitalize() for w in k.name.split("_")): int(k) for k in PlanKind}
    assert found == camel
    for src in ("dsa_plan.cpp", "dsa_serve.cpp", "dsa_install_sc.cpp"):  # the kernels that read kinds
        assert '#include "plan_kind.h"' in (CUSTOM_OPS / "csrc" / src).read_text(), src


def test_the_module_imports_no_torch():
    """A tool or script can read the kinds without torch: the module loaded alone, with torch unimportable."""
    code = ("import importlib.util, sys; sys.modules['torch'] = None; "
            f"spec = importlib.util.spec_from_file_location('plan_kind', {str(CUSTOM_OPS / 'plan_kind.py')!r}); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "print(int(m.PlanKind.POOL_HIT), m.NUM_PLAN_KINDS)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "6"]
    assert "torch" not in plan_kind.__dict__


def test_the_state_counts_every_kind_and_the_step():
    from offload_passes import state

    assert state.STATS_WIDTH == NUM_PLAN_KINDS + 1


def test_the_reference_plan_emits_the_enum_values():
    """A pool hit, a miss, a window row, a future row and the stop, classified by the reference plan."""
    from offload_passes.custom_ops.dsa_plan import reference_dsa_plan

    B, S, K, PS, IR = 1, 1, 64, 32, 256
    topk = torch.full((B, S, 1, K), -1, dtype=torch.int32)
    topk[0, 0, 0, :5] = torch.tensor([3, 7, 99, 150, -1], dtype=torch.int32)
    L = torch.tensor([100], dtype=torch.int32)  # max_valid 98, max_sel 99: 99 is the window, > 99 future
    pool_ids = torch.full((B, PS), -1, dtype=torch.int32)
    id_to_slot = torch.full((B, IR), -1, dtype=torch.int32)
    id_to_slot[0, 3], pool_ids[0, 5] = 5, 3
    plan, _, _ = reference_dsa_plan(topk, L, pool_ids, id_to_slot, torch.zeros(B, PS // 16, dtype=torch.int32),
                                    raw_seq=S)
    assert plan[:5, 0].tolist() == [PlanKind.POOL_HIT, PlanKind.FULL_OLD_MISS, PlanKind.DECODE_WINDOW,
                                    PlanKind.FUTURE_SKIP, PlanKind.NEGATIVE_STOP]
    assert plan[5:8, 0].tolist() == [PlanKind.INVALID] * 3


#: bare plan-kind numbers: a kind compared with, or a count indexed by, a digit
_BARE = re.compile(r"\b(kinds?|kd|src_kind)\s*(==|!=)\s*\d|\bkinds\[\d\]|minlength=6\b")


@pytest.mark.parametrize("folder", ["offload_passes", "custom_ops", "tools", "benchmarks"])
def test_no_bare_plan_kind_numbers(folder):
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")) + sorted((ROOT / folder).rglob("*.cpp")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0] if path.suffix == ".py" else line.split("//", 1)[0]
            if _BARE.search(code):
                bad.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert bad == [], "plan kinds by number (use custom_ops/plan_kind.py's PlanKind):\n" + "\n".join(bad)
