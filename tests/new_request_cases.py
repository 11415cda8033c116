"""The new-request matrix (docs/new-requests.md): a row's full KV re-filled outside the compiled decode
graph, by every path a user has, must never be served from the pool rows of the previous request.

A *session* is one front-end × mode × bookkeeping × next_n: an unmodified model and a compiled copy
that see the same tokens; every re-fill path then runs on both, followed by compiled decode steps that
are compared with the unmodified model step by step. Compiles are shared across re-fill paths.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from offload_passes import models
from offload_passes.backend import make_offload_backend

#: re-fill paths of the recipe-form model (per batch row, through the model's own prefill)
RECIPE_REFILLS = ("shorter", "equal", "longer", "same_len", "eager_between", "all_rows", "one_row", "eager_again")
#: re-fill paths of the HF model (StaticCache: one length for the whole batch)
HF_REFILLS = ("cache_reset_shorter", "cache_reset_equal", "cache_reset_longer", "same_len", "eager_between")
# (each HF path starts with cache.reset(); same_len / eager_between re-fill the same length with other tokens)
STEPS_AFTER = 2  # compiled steps after each re-fill
#: max |logits diff| accepted: eager rewrites are exact; Inductor (vs the unmodified model through
#: Inductor) and HF bf16 as in the demo (offload_passes/demo.py); a stale pool is off by 0.29-1.7
TOL = {"eager": 0.0, "inductor": 5e-2, "npugraph_ex": 0.0}
HF_REL_TOL = 2e-2


@dataclass(frozen=True)
class Cell:
    frontend: str  # "tiny" | "tiny-w8a8" | "hf-tiny"
    mode: str  # "eager" | "inductor" | "npugraph_ex"
    bookkeeping: bool  # update_ledger (CPU modes) / npu_bookkeeping (NPU modes)
    next_n: int

    @property
    def id(self) -> str:
        return f"{self.frontend}-{self.mode}-{'bk' if self.bookkeeping else 'nobk'}-nn{self.next_n}"


def _valid(c: Cell) -> bool:
    return not (c.frontend == "hf-tiny" and (c.next_n != 0 or c.bookkeeping))  # HF: S = 1, no ledger


def full_matrix(modes: tuple[str, ...]) -> list[Cell]:
    return [c for c in (Cell(*v) for v in itertools.product(("tiny", "tiny-w8a8", "hf-tiny"), modes,
                                                             (True, False), (0, 3))) if _valid(c)]


def covering(cells: list[Cell]) -> list[Cell]:
    """A subset in which every pair of axis values that occurs in ``cells`` occurs at least once (greedy)."""
    def pairs(c: Cell) -> set:
        v = list(enumerate((c.frontend, c.mode, c.bookkeeping, c.next_n)))
        return {(a, b) for a, b in itertools.combinations(v, 2)}

    need = set().union(*(pairs(c) for c in cells))
    out: list[Cell] = []
    while need:
        best = max(cells, key=lambda c: len(pairs(c) & need))
        out.append(best)
        need -= pairs(best)
    return out


def cells_for(modes: tuple[str, ...]) -> list[Cell]:
    """CI: the covering subset; ``OFFLOAD_PASSES_LONG=1``: the whole matrix."""
    full = full_matrix(modes)
    return full if os.environ.get("OFFLOAD_PASSES_LONG") == "1" else covering(full)


# ------------------------------------------------------------------------------------------ sessions
@dataclass
class RecipeSession:
    cell: Cell
    backend: Any
    base: Any
    comp: Any
    step_fn: Callable
    ref_fn: Callable
    diffs: dict = field(default_factory=dict)

    def step(self) -> float:
        want = self.base.driver.step(self.ref_fn).logits
        got = self.comp.driver.step(self.step_fn).logits
        return float((got.float() - want.float()).abs().max())

    def refill(self, how: str) -> None:
        for b in (self.base, self.comp):
            d = b.driver
            cur = int(d.cur_len[1])
            if how == "shorter":
                d.reset_row(1, prompt_len=int(d.prefill_lens[1]) - 24)
            elif how == "equal":  # the previous request's prompt length
                d.reset_row(1, prompt_len=int(d.prefill_lens[1]))
            elif how == "longer":
                d.reset_row(1, prompt_len=cur + 20)
            elif how == "same_len":  # looks like a continuation by length alone
                d.reset_row(1, prompt_len=cur)
            elif how == "one_row":  # a new request of an unrelated length while row 0 decodes on
                d.reset_row(1, prompt_len=cur - 3)
            elif how == "all_rows":  # every row: a new prompt of the same length, other tokens
                g = torch.Generator().manual_seed(1234 + d.step_idx)
                d.prompt = torch.randint(0, b.model.config.vocab_size, d.prompt.shape, generator=g)
                keep = d.step_idx
                d.prefill()
                d.step_idx = keep  # the token stream goes on (prefill() restarts it)
            elif how == "eager_between":  # a re-fill, then one step through the unmodified module
                d.reset_row(1, prompt_len=cur)
            elif how == "eager_again":  # no re-fill: switching back to the unmodified module once more
                pass
            else:
                raise ValueError(how)
        if how in ("eager_between", "eager_again"):  # (eager_again: its ledger must not be stale either)
            want = self.base.driver.step().logits
            got = self.comp.driver.step(None).logits  # the compiled model's own module, uncompiled
            assert torch.equal(want, got)


def recipe_session(cell: Cell, npu_compiler_config: Any = None, steps: int = 40) -> RecipeSession:
    torch._dynamo.reset()
    over = dict(enable_offload=True, decode_steps=steps, next_n=cell.next_n, prefill_len=128)
    base, comp = models.build(cell.frontend, **over), models.build(cell.frontend, **over)
    kw: dict = dict(pool_size=256, pa_block_size=comp.runner.pa_block_size, next_n=cell.next_n, exe_mode=cell.mode)
    if cell.mode in ("eager", "inductor"):
        kw["update_ledger"] = cell.bookkeeping
    else:
        kw["npu_bookkeeping"] = cell.bookkeeping
        kw["compiler_config"] = npu_compiler_config
    be = make_offload_backend(**kw)
    step = torch.compile(comp.model, backend=be)
    ref = torch.compile(base.model, backend="inductor") if cell.mode == "inductor" else None
    base.driver.prefill()
    comp.driver.prefill()
    return RecipeSession(cell, be, base, comp, step, ref)


@dataclass
class HfSession:
    cell: Cell
    backend: Any
    base: Any
    comp: Any
    db: Any
    dc: Any
    step_fn: Callable
    ref_fn: Optional[Callable]

    def step(self) -> float:
        want = self.db.step(self.ref_fn)
        got = self.dc.step(self.step_fn)
        return float((got.float() - want.float()).abs().max() / want.float().abs().max())

    def refill(self, how: str) -> None:
        g = torch.Generator().manual_seed(99 + self.db.pos)
        tokens = torch.randint(0, self.comp.config.vocab_size, self.db.tokens.shape, generator=g)
        pos = self.db.pos
        for d in (self.db, self.dc):
            d.tokens = tokens.clone()
            d.cache.reset()  # transformers' way to start over (a StaticCache appends after its length)
            n = {"cache_reset_shorter": 40, "cache_reset_equal": self.base_prefill, "cache_reset_longer": pos + 20,
                 "same_len": pos, "eager_between": pos}[how]  # same_len: other tokens, a continuation by length
            d.prefill(n)
        if how == "eager_between":
            want, got = self.db.step(), self.dc.step(None)
            assert torch.equal(want, got)

    @property
    def base_prefill(self) -> int:
        return self.base.runner.prefill_len


def hf_session(cell: Cell, npu_compiler_config: Any = None) -> HfSession:
    from offload_passes.models import hf

    torch._dynamo.reset()
    over = dict(dtype="bfloat16", decode_steps=64)
    base, comp = hf.build("hf-tiny", **over), hf.build("hf-tiny", **over)
    kw: dict = dict(enable_offload=True, exe_mode=cell.mode)
    if cell.mode not in ("eager", "inductor"):
        kw["compiler_config"] = npu_compiler_config
    be = make_offload_backend(**kw)
    step = torch.compile(comp.model, backend=be, fullgraph=True)
    ref = torch.compile(base.model, backend="inductor", fullgraph=True) if cell.mode == "inductor" else None
    db, dc = base.decoder(), comp.decoder()
    db.prefill()
    dc.prefill()
    return HfSession(cell, be, base, comp, db, dc, step, ref)


def run_matrix_cell(cell: Cell, npu_compiler_config: Any = None) -> dict[str, list[float]]:
    """Warm steps, then every re-fill path followed by ``STEPS_AFTER`` compiled steps; the diffs per path."""
    hf_form = cell.frontend.startswith("hf")
    s = hf_session(cell, npu_compiler_config) if hf_form else recipe_session(cell, npu_compiler_config)
    out: dict[str, list[float]] = {"warm": [s.step() for _ in range(3)]}
    for how in (HF_REFILLS if hf_form else RECIPE_REFILLS):
        s.refill(how)
        out[how] = [s.step() for _ in range(STEPS_AFTER)]
    st = s.backend.state
    # rows resident in the pools at the end (the stats are stripped in the NPU modes without bookkeeping)
    out["_resident"] = [float(sum(int((g.pool_ids >= 0).sum()) for g in st.groups))] if st is not None else [0.0]
    out["_rewritten"] = [float(bool(s.backend.reports and any(r["rewritten"] for r in s.backend.reports)))]
    return out


def tolerance(cell: Cell) -> float:
    return HF_REL_TOL if cell.frontend.startswith("hf") else TOL[cell.mode]
