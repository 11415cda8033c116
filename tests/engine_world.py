"""Random engine schedules (tests/backend/test_engine_schedules.py, tests/converters/test_new_requests_npu.py):
the serving loop of ``models/glm/serve.py`` (the project's scheduler and block pool: FIFO or LIFO free
list, retraction, KV by a transfer that moves no version counter or by ``index_copy_``, varying MTP
acceptance, batch buckets) running three lanes on one schedule: the unmodified model, the model compiled
with the offload backend and glued by ``offload_passes.engine.EngineAdapter`` (the engine's account), and
the same compiled model told nothing (the loop only keeps its ledgers with their requests, the unmodified
model's own requirement). Every step of both compiled lanes is compared with the unmodified one.

A schedule's ``invalid`` rate has the announcing lane's engine try, before that many of its steps, a
wrong announcement first (:data:`HOSTILE`: too many rows, a row past the batch, a bool mask, floats, a
meta tensor, a row twice; ``EngineAdapter.step`` with ``written=None`` or an unhashable id, ...): each
must raise, change nothing (offload state, the model's rows, the adapter's account), and the corrected
announcement that follows keeps the lane bit-identical with the unmodified model.

A :class:`World` compiles its lanes once (one cell: S, ``update_ledger``, buckets, mode); each schedule
runs a new :class:`~offload_passes.models.glm.serve.Server` on them after putting every model and offload
state back to where it started, so a schedule's result does not depend on the ones before it (what
hypothesis needs to replay and shrink).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pytest
import torch
from hypothesis import strategies as st

from offload_passes import make_offload_backend, models
from offload_passes.engine import EngineAdapter
from offload_passes.models.glm.serve import Lane, Server, ServeConfig, bucket_model
from offload_passes.state import module_state

#: the tiny preset cut to 4 layers (IndexShare FSFS: two groups), the reference's 4 rows per rank
OVER = dict(enable_offload=True, batch_size=4, pa_max_length=256, prefill_len=64, decode_steps=1,
            num_hidden_layers=4, index_topk_pattern="FSFS")
TOL = {"eager": 0.0, "npugraph_ex": 0.0, "inductor": 5e-2}


@dataclass(frozen=True)
class Cell:
    S: int
    update_ledger: bool
    buckets: tuple = ()
    mode: str = "eager"
    batch: int = 4

    @property
    def id(self) -> str:
        b = "-b" + "+".join(map(str, self.buckets)) if self.buckets else ""
        return f"S{self.S}-{'ledger' if self.update_ledger else 'noledger'}{b}-{self.mode}"


@dataclass(frozen=True)
class Schedule:
    seed: int
    steps: int
    free_list: str = "fifo"
    transfer: str = "cpp"
    arrival: float = 1.0
    retract: float = 0.0
    mtp_accept: str = "random"
    prompt_len: tuple = (64, 160)
    output_len: tuple = (1, 6)
    invalid: float = 0.0  # share of steps whose announcement is tried wrong first (module doc)


SCHEDULES = st.builds(
    Schedule,
    seed=st.integers(0, 2**16),
    steps=st.integers(6, 14),
    free_list=st.sampled_from(["fifo", "lifo"]),
    transfer=st.sampled_from(["cpp", "torch"]),  # KV written with / without moving a version counter
    arrival=st.sampled_from([1.0, 0.7, 0.3]),  # < 1: the running count varies (buckets small and large)
    retract=st.sampled_from([0.0, 0.25]),
    mtp_accept=st.sampled_from(["random", "all"]),
    # one prompt length: a new request's first length equals its predecessor's (the same-block case)
    prompt_len=st.sampled_from([(64, 64), (96, 96), (64, 160)]),
    output_len=st.sampled_from([(1, 1), (1, 3), (2, 8)]),
    invalid=st.sampled_from([0.0, 0.5, 1.0]),
)


def _limit(state: Any) -> int:
    """How many rows an announcement may name on ``state`` (the model's batch before the first step)."""
    return state._limits()[1]


#: wrong announcements: (name, call(adapter, rows, written, limit) that must raise, the exception)
HOSTILE: list[tuple[str, Callable, type]] = [
    ("src one too long", lambda ad, r, w, n: ad.state.move_rows([-1] * (n + 1)), ValueError),
    ("src row twice", lambda ad, r, w, n: ad.state.move_rows([0, 0] + [-1] * (len(r) - 2)), ValueError),
    ("src a bool mask", lambda ad, r, w, n: ad.state.move_rows(torch.ones(len(r), dtype=torch.bool)), TypeError),
    ("src floats", lambda ad, r, w, n: ad.state.move_rows([float(b) for b in range(len(r))]), TypeError),
    ("src NaN", lambda ad, r, w, n: ad.state.move_rows(torch.full((len(r),), float("nan"))), TypeError),
    ("src meta", lambda ad, r, w, n: ad.state.move_rows(torch.zeros(len(r), dtype=torch.long, device="meta")),
     TypeError),
    ("src sparse", lambda ad, r, w, n: ad.state.move_rows(torch.arange(len(r)).to_sparse()), TypeError),
    ("rows past the batch", lambda ad, r, w, n: ad.state.begin_request([0, n]), ValueError),
    ("rows a float", lambda ad, r, w, n: ad.state.begin_request([0.0]), TypeError),
    ("adapter too many rows", lambda ad, r, w, n: ad.step(list(r) + [None] * (ad.batch_size + 1 - len(r)), w),
     ValueError),
    ("adapter written None", lambda ad, r, w, n: ad.step(r, None), TypeError),
    ("adapter written int", lambda ad, r, w, n: ad.step(r, 5), TypeError),
    ("adapter unhashable id", lambda ad, r, w, n: ad.step([["x"]] + list(r)[1:], w), TypeError),
    ("adapter id twice", lambda ad, r, w, n: ad.step(["x", "x"], w), ValueError),
]


def _snapshot(adapter: EngineAdapter) -> list:
    """Everything a refused announcement must leave as it was."""
    st = adapter.state
    out: list = [t.clone() for t in st.tensors().values()] if st.groups else []
    out += [[(g.shared.announced, g.shared.announced_batch, g.shared.rows) for g in st.groups]]
    out += [t.clone() for t in adapter.row_tensors + adapter.ledgers]
    return out + [list(adapter._rows), adapter.batch_changes]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
                                    for x, y in zip(a, b))


class World:
    """The lanes of one cell, compiled once. ``compiler_config``: the npugraph_ex / TorchAir config of an
    NPU mode (tests/converters)."""

    def __init__(self, cell: Cell, compiler_config: Any = None, pool_size: int = 256,
                 lanes: tuple = ("told", "blind"), reference_compiled: bool = True) -> None:
        torch._dynamo.reset()
        self.cell = cell
        over = dict(OVER, next_n=cell.S - 1, batch_size=cell.batch)
        self.ref = models.build("tiny", **over).model
        self.prefill = models.build("tiny", **dict(over, batch_size=1)).model
        kw: dict[str, Any] = {"pool_size": pool_size, "exe_mode": cell.mode, "update_ledger": cell.update_ledger,
                              "next_n": cell.S - 1}
        if cell.mode in ("npugraph_ex", "ge_graph"):
            kw = {k: v for k, v in kw.items() if k != "update_ledger"}
            kw.update(npu_bookkeeping=cell.update_ledger, compiler_config=compiler_config)
        # the unmodified model under Inductor when the offload is (the demo's comparison), unless told not to
        ref_be = "inductor" if cell.mode == "inductor" and reference_compiled else None

        def lane(m: Any, be: Any, **hooks: Any) -> Lane:
            step = torch.compile(m, backend=be) if be is not None else None
            buckets = {}
            for b in cell.buckets:
                bm = bucket_model(m, b)
                buckets[b] = (bm, torch.compile(bm, backend=be) if be is not None else None)
            return Lane(m, step, buckets=buckets, **hooks)

        self.names = [n for n in ("told", "blind") if n in lanes]
        self.lanes = [lane(self.ref, ref_be)]
        self.backends = []
        self.adapter = None
        for name in self.names:
            m = models.build("tiny", **over).model  # same seed: the unmodified model's weights
            be = make_offload_backend(**kw)
            self.backends.append(be)
            if name == "told":  # the announcing lane: told by the engine adapter
                self.adapter = EngineAdapter(m)
                self.lanes.append(lane(m, be, engine_step=self._engine_step))
            else:  # told nothing: the loop only keeps its ledgers with their requests
                self.lanes.append(lane(m, be))
        self.fresh = True
        self._rng = random.Random(0)
        self._invalid = 0.0
        self._first = 0
        self.refused: list[str] = []  # the wrong announcements tried (and refused) in the last run

    def _engine_step(self, rows: list, written: set) -> list:
        """The announcing lane's engine: sometimes a wrong announcement first (refused, nothing changed),
        then the right one."""
        ad = self.adapter
        if self._rng.random() < self._invalid:  # the kinds in turn, from a schedule-chosen one
            name, call, exc = HOSTILE[(self._first + len(self.refused)) % len(HOSTILE)]
            before = _snapshot(ad)
            with pytest.raises(exc):
                call(ad, rows, written, _limit(ad.state))
            assert _same(before, _snapshot(ad)), f"the refused announcement '{name}' changed something"
            self.refused.append(name)
        return ad.step(rows, written)

    def model(self, name: str) -> Any:
        """The model of lane ``name`` (``"told"``, ``"blind"``)."""
        return self.lanes[1 + self.names.index(name)].model

    def _restart(self) -> None:
        """Every model's caches, ledgers and selection rows, and both offload states, as at the start."""
        with torch.no_grad():
            for m in self.models:
                m.reset_caches()
                m.block_table.zero_()
            for m in self.models[1:]:
                st = module_state(m)
                if st.groups:
                    st.reset()
        if self.adapter is not None:
            self.adapter._rows = []

    @property
    def models(self) -> list:
        """The lanes' models: unmodified, announcing, told nothing (when built)."""
        return [ln.model for ln in self.lanes]

    def run(self, sched: Schedule, on_step: Optional[Any] = None) -> dict:
        """Serve ``sched``; per step the max |logits diff| of each compiled lane against the unmodified one
        and the step's pool hits. Never raises on a difference: the caller asserts."""
        if not self.fresh:
            self._restart()
        self.fresh = False
        self._rng = random.Random(sched.seed)
        self._invalid = sched.invalid
        self._first = self._rng.randrange(len(HOSTILE))
        self.refused = []
        cfg = ServeConfig(seed=sched.seed, prompt_len=sched.prompt_len, output_len=sched.output_len,
                          mtp_accept=sched.mtp_accept, arrival=sched.arrival, free_list=sched.free_list,
                          retract=sched.retract)
        srv = Server(self.lanes, self.prefill, cfg, transfer=sched.transfer)
        names = self.names
        out: dict[str, list] = {k: [] for n in names for k in (n, "hits_" + n)}
        out["bucket"] = []
        for i in range(sched.steps):
            ref, *outs = srv.step()
            for n, o, m in zip(names, outs, self.models[1:]):
                out[n].append((ref.float() - o.float()).abs().max().item())
                st = module_state(m)
                out["hits_" + n].append(st.totals("step")["hits"] if st.groups else 0)
            out["bucket"].append(srv.bucket)
            if on_step is not None:
                on_step(i, srv)
        out["server"] = srv
        return out
