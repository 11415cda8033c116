"""Continuous-batching decode, the way the reference's online executor serves (beside the static
``driver.py``).

What it mirrors (cann-recipes-infer, ``executor/online`` and ``executor/core``: its scheduler, its
``KVCacheManager.allocate_slots`` and its ``BlockPool``):

* requests arrive with random prompt and output lengths and wait in a queue; by default the loop models a
  loaded server (a request is waiting whenever a row frees, so the decode batch stays full);
  ``ServeConfig.arrival`` < 1 makes a request wait at a free row only with that probability, so the number
  of running requests varies;
* KV blocks come from a free list, FIFO as the reference's ``BlockPool`` (``ServeConfig.free_list="lifo"``: a
  stack, so a freed block is handed out again at once; block 0 is the null block, never handed out); a
  request gets the blocks for its prompt at admission and more as it grows (``allocate_slots`` with the
  step's S look-ahead); a finished request's blocks go back to the list and are re-used by later requests;
* retraction (``ServeConfig.retract`` > 0): a running request loses its blocks and waits again; it is
  admitted before new arrivals and its whole sequence is prefilled and transferred again (new KV, the same
  request id), as engines that preempt by recompute do. The reference's decode scheduler
  (``_retract_one``) finishes a preempted request instead; re-admitting it is the harder case for the
  offload (a request id that continues with new KV);
* prefix reuse (``Server(store=...)``, ``reuse.py``): a request's KV outlives it in a KV store; at admission
  the longest stored prefix of the prompt is reloaded into the prefill model's caches and only the rest is
  prefilled on top of it; a finished or retracted request stores the KV its admission wrote (the KV decode
  steps wrote is not stored: a recompute would not reproduce its bits). The request is new to the decode
  lanes all the same (its KV was written outside the decode graph). ``ServeConfig.workload="multiturn"``:
  conversations that share a prefix, each turn's prompt extending the previous turn's;
* the decode batch is the running requests in arrival order, up to the per-rank batch size
  (``running[:batch_size]``), so a row's request changes and rows shift up when a request finishes;
* the prompt is prefilled by a separate batch-1 model (disaggregated prefill) and its KV blocks are
  written into the decode caches by ``glm_serve::copy_blocks_``, a C++ ``TORCH_LIBRARY`` op declared
  ``Tensor(a!)`` that copies raw memory (``csrc/kv_transfer.cpp``): like an engine's reshape-and-cache
  kernel or KV transfer it moves no PyTorch version counter;
* every step feeds S = 1 + next_n tokens per row; MTP acceptance varies: a row advances by a random 1..S
  tokens, so rejected drafts are rewritten at the same positions next step;
* batch buckets (optional, ``Lane.buckets``): as engines capture one graph per batch size, a lane may
  carry smaller-batch decode models built by :func:`bucket_model` over the same weights, the same KV /
  indexer caches and rows ``0..b-1`` of the same selection buffers and ledgers; each step runs the
  smallest bucket that holds the running requests, and the rows past them are padding rows (an all-null
  block table, block 0; announced as new; their outputs dropped).

Several *lanes* run the same schedule side by side: each lane is a decode model with its own caches
(the unmodified model, a compiled one, ...) and the tokens come from a seeded generator, not from the
logits, so the lanes' outputs are comparable step by step. When the batch changes, the loop keeps each
lane's gather ledger and selection rows with their request (the ledger row of a new request is reset,
as the reference's ``reset_rows`` does) and calls the lane's ``on_batch_change(src)`` with, per row,
the row its request held at the previous step, whatever bucket ran it (-1: a new request, a re-admitted
one, or a padding row; ``src`` is as long as the step's bucket) — the hook an offload state uses to
follow its requests (``OffloadState.move_rows``). A lane may instead take ``engine_step(rows, written)``,
called before every step with the request id per row (None: padding) and the ids whose KV was written
outside the decode graph since the previous step: what an engine knows. Such a lane keeps its model's
selection rows and ledgers itself (``offload_passes.engine.EngineAdapter`` does). Models never import the
passes: the caller supplies the hooks.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from .kv_transfer import (  # noqa: F401  (re-exported: the serving loop's transfer op lives beside it)
    copy_blocks_torch, load_transfer_op, transfer_build_dir, transfer_library, transfer_origin)
from .buckets import bucket_model  # noqa: F401  (re-exported)
from .modeling import GlmMoeDsaForCausalLM
from .reuse import MultiTurn, PrefixReuse

log = logging.getLogger("offload_passes.models.serve")


@torch.no_grad()
def transfer_blocks(copy: Callable, prefill_model: GlmMoeDsaForCausalLM, model: GlmMoeDsaForCausalLM,
                    blocks: Sequence[int]) -> None:
    """Write row 0 of a batch-1 ``prefill_model``'s caches (its first ``len(blocks)`` blocks: an identity
    table) into ``blocks`` of ``model``'s caches, every layer: latent, rope and indexer keys (and scales).
    ``copy``: :func:`load_transfer_op` (moves no version counter, as an engine's transfer) or
    :func:`copy_blocks_torch`."""
    n = len(blocks)
    src = torch.arange(n, dtype=torch.int64)
    dst = torch.tensor(list(blocks), dtype=torch.int64)
    for lp, ll in zip(prefill_model.model.layers, model.model.layers):
        for name in ("kv_cache", "k_rope_cache"):
            copy(getattr(ll.self_attn, name), getattr(lp.self_attn, name), dst, src)
        if ll.self_attn.indexer is not None:
            ix, px = ll.self_attn.indexer, lp.self_attn.indexer
            copy(ix.key_cache, px.key_cache, dst, src)
            if getattr(ix, "int8", False):
                copy(ix.key_scale_cache, px.key_scale_cache, dst, src)


@dataclass
class ServeConfig:
    """The request stream and the scheduler's knobs (lengths are inclusive ranges, in tokens)."""

    seed: int = 0
    prompt_len: tuple[int, int] = (16, 160)
    output_len: tuple[int, int] = (4, 64)  # decode steps of a request
    mtp_accept: str = "random"  # "random": a row advances by 1..S tokens per step; "all": by S
    # probability that a request is waiting when a row is free (drawn per free row and step); 1: a loaded
    # server, the batch always full (no draw). An empty server always admits one.
    arrival: float = 1.0
    free_list: str = "fifo"  # "fifo": the reference's BlockPool; "lifo": a freed block is handed out next
    # probability per step that the scheduler retracts its newest running request (when more than one runs)
    retract: float = 0.0
    # "random": independent random prompts; "multiturn": conversations sharing a prefix (reuse.MultiTurn):
    # ``branches`` of them, ``turns`` turns each, ``user_len`` new tokens per turn (prompt_len unused)
    workload: str = "random"
    shared_prefix: int = 64
    branches: int = 3
    turns: int = 3
    user_len: tuple[int, int] = (4, 24)

    def __post_init__(self) -> None:
        for name in ("prompt_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"ServeConfig.{name} must be (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")
        if self.mtp_accept not in ("random", "all"):
            raise ValueError(f"ServeConfig.mtp_accept must be 'random' or 'all', got {self.mtp_accept!r}")
        if not 0.0 < self.arrival <= 1.0:
            raise ValueError(f"ServeConfig.arrival must be in (0, 1], got {self.arrival!r}")
        if self.free_list not in ("fifo", "lifo"):
            raise ValueError(f"ServeConfig.free_list must be 'fifo' or 'lifo', got {self.free_list!r}")
        if not 0.0 <= self.retract < 1.0:
            raise ValueError(f"ServeConfig.retract must be in [0, 1), got {self.retract!r}")
        if self.workload not in ("random", "multiturn"):
            raise ValueError(f"ServeConfig.workload must be 'random' or 'multiturn', got {self.workload!r}")
        for name in ("shared_prefix", "branches", "turns"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ServeConfig.{name} must be an int >= 1, got {v!r}")
        lo, hi = self.user_len
        if not 1 <= lo <= hi:
            raise ValueError(f"ServeConfig.user_len must be (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")


@dataclass
class Request:
    rid: int
    prompt: torch.Tensor  # [P] int64
    steps_left: int
    cur: int  # tokens in the cache (accepted)
    blocks: list = field(default_factory=list)
    branch: Optional[int] = None  # its conversation (the multi-turn workload)
    generated: list = field(default_factory=list)  # the accepted tokens, per step
    prefilled: Optional[torch.Tensor] = None  # the tokens whose KV the admission wrote (what reuse stores)


def request_rows(model: GlmMoeDsaForCausalLM) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The decode model's buffers that belong to the request in a batch row: per layer the selection buffers
    (``sel_kv``, ``sel_rope``) and the gather ledger (``sel_status``)."""
    attn = [layer.self_attn for layer in model.model.layers]
    return [t for a in attn for t in (a.sel_kv, a.sel_rope)], [a.sel_status for a in attn]


@torch.no_grad()
def follow_requests(row_tensors: Sequence[torch.Tensor], ledgers: Sequence[torch.Tensor], src: Sequence[int],
                    batch: int) -> None:
    """Keep a decode model's per-row buffers with their requests when the batch changes (the unmodified
    model's own requirement: its gather reuses what its ledger says a row's selection buffer holds). Row
    ``b`` of every tensor (viewed ``[batch, -1, ...]``) takes row ``src[b]``; rows past ``len(src)`` (a
    smaller bucket) and ``-1`` rows hold no request, and their ledger is reset to -1 (holds nothing: what
    the reference's ``reinit_status`` writes for the whole batch)."""
    full = list(src) + [-1] * (batch - len(src))
    idx = torch.tensor([max(x, 0) for x in full], dtype=torch.long)
    new = [b for b, x in enumerate(full) if x < 0]
    for t in list(row_tensors) + list(ledgers):
        v = t.view(batch, -1, *t.shape[1:])
        v.copy_(v[idx.to(t.device)])
    for st in ledgers:
        if new:
            st[new] = -1


@dataclass
class Lane:
    """One decode model served by the loop: ``step_fn(ids, pos)`` runs its step (default: the model),
    ``on_batch_change(src)`` is told how the batch changed before the step that sees it,
    ``engine_step(rows, written)`` is told what an engine knows before every step (module doc). ``buckets``:
    smaller batch sizes -> ``(model, step_fn)``, the model from :func:`bucket_model` of ``model`` (the
    largest bucket), ``step_fn`` as above (``None``: the model)."""

    model: GlmMoeDsaForCausalLM
    step_fn: Optional[Callable] = None
    on_batch_change: Optional[Callable[[list], None]] = None
    buckets: dict = field(default_factory=dict)
    # before every step: (request id per row, ids whose KV was written outside the graph since the last
    # step); a lane with it keeps its model's selection rows and ledgers itself (the Server does not)
    engine_step: Optional[Callable[[list, set], object]] = None
    # with a store: this lane gets the prompt's KV recomputed with the same prefix boundaries as the reload
    # (the reference a reloaded lane is compared with), not the reloaded one
    reference: bool = False

    def decoder(self, batch_size: int) -> tuple[GlmMoeDsaForCausalLM, Callable]:
        """The model and step function of bucket ``batch_size``."""
        if batch_size == self.model.batch_size:
            m, fn = self.model, self.step_fn
        else:
            m, fn = self.buckets[batch_size]
        return m, (fn if fn is not None else m)


class BlockPool:
    """The recipe's block pool: a free list, FIFO as the reference's (``order="lifo"``: a stack, a freed block
    is handed out again first, in the order it was held); block 0 is the null block (padding of block
    tables)."""

    def __init__(self, num_blocks: int, order: str = "fifo") -> None:
        if num_blocks < 2:
            raise ValueError(f"BlockPool: num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        if order not in ("fifo", "lifo"):
            raise ValueError(f"BlockPool: order must be 'fifo' or 'lifo', got {order!r}")
        self.num_blocks = num_blocks
        self.order = order
        self.free: deque = deque(range(1, num_blocks))

    def take(self, n: int) -> list:
        if n > len(self.free):
            raise RuntimeError(f"BlockPool: {n} blocks requested, {len(self.free)} free (num_blocks="
                               f"{self.num_blocks}); make the cache larger or the requests shorter")
        return [self.free.popleft() for _ in range(n)]

    def give_back(self, blocks: Sequence[int]) -> None:
        if self.order == "fifo":
            self.free.extend(blocks)
        else:  # in front, in their order: the next request of that size gets exactly these blocks
            self.free.extendleft(reversed(list(blocks)))


def _check_lanes(lanes: Sequence[Lane], prefill_model: GlmMoeDsaForCausalLM, transfer: str, store, reference
                 ) -> None:
    """What ``Server`` refuses: lanes of different shapes or buckets, a prefill model that does not fit them, an
    unknown transfer, reference lanes without a store and a reference (or the reverse)."""
    if not lanes:
        raise ValueError("Server: at least one lane")
    m0 = lanes[0].model
    for ln in lanes:
        m = ln.model
        if (m.batch_size, m.seq_per_step, m.block_size, tuple(m.block_table.shape)) != (
                m0.batch_size, m0.seq_per_step, m0.block_size, tuple(m0.block_table.shape)):
            raise ValueError("Server: every lane must have the same batch size, S, block size and cache")
        if not m.runner.enable_offload:
            raise ValueError("Server: lanes must be built with enable_offload=True (selection ledger)")
        if sorted(ln.buckets) != sorted(lanes[0].buckets):
            raise ValueError(f"Server: every lane must have the same bucket sizes, got {sorted(ln.buckets)} "
                             f"and {sorted(lanes[0].buckets)}")
        for b, (bm, _) in ln.buckets.items():
            a, ab = m.model.layers[0].self_attn, bm.model.layers[0].self_attn
            if not (isinstance(b, int) and 1 <= b < m.batch_size and bm.batch_size == b):
                raise ValueError(f"Server: bucket sizes must be in [1, {m.batch_size}) (the lane's batch) and "
                                 f"match their model's batch size, got {b} -> {bm.batch_size}")
            if ab.kv_cache is not a.kv_cache or ab.sel_status.data_ptr() != a.sel_status.data_ptr():
                raise ValueError(f"Server: the bucket {b} model must share the lane model's caches and "
                                 "selection rows (build it with serve.bucket_model)")
    if prefill_model.batch_size != 1 or prefill_model.block_size != m0.block_size:
        raise ValueError("Server: prefill_model must have batch_size 1 and the lanes' block size")
    if transfer not in ("cpp", "torch"):
        raise ValueError(f"Server: transfer must be 'cpp' or 'torch', got {transfer!r}")
    refs = [ln for ln in lanes if ln.reference]
    if (store is None and (refs or reference is not None)) or (bool(refs) != (reference is not None)):
        raise ValueError("Server: reference lanes need a store and a reference (and a reference needs reference "
                         f"lanes); got store={store is not None}, reference={reference is not None}, "
                         f"{len(refs)} reference lane(s)")
    if refs and len(refs) == len(lanes):
        raise ValueError("Server: with a store at least one lane must be a reloaded (not reference) lane")


class Server:
    """The loop. ``lanes``: decode models with one configuration (batch size, S, block size, caches);
    ``prefill_model``: a batch-1 model with the same weights; ``transfer``: ``"cpp"`` (the C++ op that
    moves no version counter, the engine's way) or ``"torch"`` (``index_copy_``, moves it). Every lane
    has the same bucket sizes (``Lane.buckets``); ``bucket_steps`` counts the steps each bucket ran.

    ``store`` (duck-typed, e.g. ``offload_passes.store.paged.PagedStore``): at admission the longest stored
    prefix of the prompt (all but its last token at most) is reloaded into the prefill model's caches and only
    the rest is prefilled on top (``reuse.prefill_from``); a finished or retracted request stores the KV its
    admission wrote. ``reference`` (duck-typed, ``store.paged.RecomputeReference``): the lanes marked
    ``Lane.reference`` get that prefix recomputed with the same boundaries instead. ``reuse_stats()``."""

    def __init__(self, lanes: Sequence[Lane], prefill_model: GlmMoeDsaForCausalLM,
                 cfg: Optional[ServeConfig] = None, transfer: str = "cpp", store=None, reference=None) -> None:
        _check_lanes(lanes, prefill_model, transfer, store, reference)
        m0 = lanes[0].model
        self.lanes = list(lanes)
        self.prefill_model = prefill_model
        self.cfg = cfg or ServeConfig()
        self.copy_blocks = load_transfer_op() if transfer == "cpp" else copy_blocks_torch
        self.B, self.S, self.BS = m0.batch_size, m0.seq_per_step, m0.block_size
        self.max_blocks = m0.block_table.size(1)
        self.cap = min(self.max_blocks, prefill_model.block_table.size(1)) * self.BS
        self.pool = BlockPool(m0.model.layers[0].self_attn.kv_cache.size(0), self.cfg.free_list)
        self.gen = torch.Generator().manual_seed(self.cfg.seed)
        self.vocab = m0.config.vocab_size
        self.running: list[Request] = []
        self.waiting: deque = deque()  # retracted requests, admitted again before new arrivals
        self.written: set = set()  # request ids whose KV was written outside the decode graph this step
        self.sizes = sorted(set(lanes[0].buckets) | {self.B})  # the batch buckets, the lanes' batch last
        self.bucket_steps = {b: 0 for b in self.sizes}
        self.bucket = self.B  # the bucket of the last step
        self.rows: list[Optional[int]] = [None] * self.B  # request id per row at the previous step
        self.next_rid = 0
        self.step_idx = 0
        self.finished = 0
        self.retracted = 0
        self.batch_changes = 0
        self.reuse = PrefixReuse(store, reference) if store is not None else None
        self.workload = None
        if self.cfg.workload == "multiturn":
            self.workload = MultiTurn(self.cfg.shared_prefix, self.cfg.branches, self.cfg.turns, self.cfg.user_len)
            self.workload.start(self.gen, self.vocab)

    # ------------------------------------------------------------------ requests
    def _rand(self, lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=self.gen))

    def _fits(self, P: int, steps: int) -> bool:
        return P + (steps + 1) * self.S + self.BS <= self.cap

    def _arrive(self) -> Optional[Request]:
        steps = self._rand(*self.cfg.output_len)
        if self.workload is not None:
            turn = self.workload.next_turn(self.gen, self.vocab, lambda P: self._fits(P, steps))
            if turn is None:
                return None
            req = Request(self.next_rid, turn[1], steps, turn[1].numel(), branch=turn[0])
            self.next_rid += 1
            return req
        lo, hi = self.cfg.prompt_len
        P = self._rand(lo, max(lo, min(hi, self.cap - (steps + 1) * self.S - self.BS)))
        if not self._fits(P, steps):
            raise ValueError(f"Server: the cache ({self.cap} tokens per row) cannot hold the output lengths "
                             f"{self.cfg.output_len} x S={self.S}")
        prompt = torch.randint(0, self.vocab, (P,), generator=self.gen)
        req = Request(self.next_rid, prompt, steps, P)
        self.next_rid += 1
        return req

    @torch.no_grad()
    def _prefill(self, req: Request) -> None:
        """Prefill on the batch-1 model, then write its KV blocks into every lane's caches (the transfer)."""
        P = req.prompt.numel()
        req.blocks = self.pool.take(-(-(P + self.S) // self.BS))
        req.prefilled = req.prompt
        blocks = req.blocks[: -(-P // self.BS)]

        def transfer(reference: Optional[bool]) -> None:  # None: every lane
            for ln in self.lanes:
                if reference is None or ln.reference == reference:
                    transfer_blocks(self.copy_blocks, self.prefill_model, ln.model, blocks)

        if self.reuse is None:
            self.prefill_model.prefill(req.prompt.view(1, P), torch.tensor([P]))
            transfer(None)
        else:
            self.reuse.admit(self.prefill_model, req.prompt, transfer)

    def _leave(self, req: Request) -> None:
        """A finished or retracted request: its admission's KV goes to the store (read from the decode caches
        at its blocks, before they go back to the pool), then the blocks go back."""
        if self.reuse is not None and req.prefilled is not None:
            reloaded = next(ln.model for ln in self.lanes if not ln.reference)
            reference = next((ln.model for ln in self.lanes if ln.reference), None)
            self.reuse.leave(reloaded, reference, req.blocks, req.prefilled)
        self.pool.give_back(req.blocks)

    def _grow(self, req: Request) -> None:
        """``allocate_slots``: blocks for the cache plus this step's S tokens."""
        need = -(-(req.cur + self.S) // self.BS) - len(req.blocks)
        if need > 0:
            req.blocks += self.pool.take(need)

    # ------------------------------------------------------------------ batch
    def _retract(self) -> None:
        """The scheduler preempts its newest running request: its blocks go back, it waits again, and its
        whole sequence (the prompt and the tokens decoded so far) is prefilled again when it is re-admitted."""
        req = self.running.pop()
        self._leave(req)
        req.blocks = []
        extra = req.cur - req.prompt.numel()
        if extra > 0 and self.workload is not None:  # the tokens it decoded
            req.prompt = torch.cat([req.prompt] + req.generated)
        elif extra > 0:  # the decoded tokens come from the seeded generator too
            req.prompt = torch.cat([req.prompt, torch.randint(0, self.vocab, (extra,), generator=self.gen)])
        req.generated = []
        self.waiting.appendleft(req)
        self.retracted += 1

    def _retire(self) -> None:
        """Finished requests leave (their KV to the store), their conversation's next turn becomes ready."""
        for r in [r for r in self.running if r.steps_left <= 0]:
            self._leave(r)
            if r.branch is not None:
                self.workload.finished(r.branch, torch.cat([r.prompt] + r.generated))
            self.finished += 1
        self.running = [r for r in self.running if r.steps_left > 0]

    def _schedule(self) -> tuple[list, list]:
        """Retire finished requests, retract (``ServeConfig.retract``), admit waiting and new requests, grow
        blocks, pick the bucket; returns ``src`` per row and the batch (``None``: a padding row)."""
        self._retire()
        if (self.cfg.retract > 0 and len(self.running) > 1
                and float(torch.rand((), generator=self.gen)) < self.cfg.retract):
            self._retract()
        self.written = set()
        for _ in range(self.B - len(self.running)):
            # 1: a loaded server, someone is always waiting (no draw); an empty server admits one
            if self.waiting:
                req = self.waiting.popleft()
            elif (self.cfg.arrival >= 1.0 or not self.running
                    or float(torch.rand((), generator=self.gen)) < self.cfg.arrival):
                req = self._arrive()
            else:
                continue
            if req is None:  # the multi-turn workload has no turn ready
                continue
            self._prefill(req)
            self.written.add(req.rid)
            self.running.append(req)
        bucket = min(b for b in self.sizes if b >= len(self.running))
        batch: list = self.running[:bucket]
        for r in batch:
            self._grow(r)
        batch += [None] * (bucket - len(batch))
        prev = {rid: b for b, rid in enumerate(self.rows) if rid is not None}
        # a request whose KV was just written (admitted, or re-admitted after a retraction) is new wherever
        # it is, even at the row it held before
        src = [prev.get(r.rid, -1) if r is not None and r.rid not in self.written else -1 for r in batch]
        self.rows = [r.rid if r is not None else None for r in batch]
        return src, batch

    @torch.no_grad()
    def _apply(self, src: list, batch: list) -> None:
        n = len(batch)
        table = torch.zeros(n, self.max_blocks, dtype=torch.int32)  # padding rows: all null (block 0)
        for b, r in enumerate(batch):
            if r is not None:
                table[b, : len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
        changed = src != list(range(n)) or n != self.bucket
        rows = [r.rid if r is not None else None for r in batch]
        for ln in self.lanes:
            bm = ln.decoder(n)[0]
            bm.block_table.copy_(table.to(bm.block_table.device))
            if ln.engine_step is not None:  # the lane's engine glue keeps its rows itself
                ln.engine_step(list(rows), set(self.written))
            elif changed:
                # on the largest model's buffers (a bucket's are views of its first rows)
                follow_requests(*request_rows(ln.model), src, self.B)
                if ln.on_batch_change is not None:
                    ln.on_batch_change(list(src))
        if changed:
            self.batch_changes += 1
        self.bucket = n

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self) -> list:
        """One decode step of every lane; returns each lane's logits ``[n, S, V]`` of the rows that hold a
        request (``n`` = the running requests; ``B`` with the default ``arrival``): padding rows dropped."""
        src, batch = self._schedule()
        n = len(batch)
        self._apply(src, batch)
        ids = torch.randint(0, self.vocab, (n, self.S), generator=self.gen)
        # a padding row decodes positions 0..S-1 into the null block
        pos = torch.tensor([r.cur if r is not None else 0 for r in batch],
                           dtype=torch.int64).unsqueeze(1) + torch.arange(self.S)
        real = [b for b, r in enumerate(batch) if r is not None]
        outs = []
        for ln in self.lanes:
            m, fn = ln.decoder(n)
            dev = m.block_table.device
            out = fn(ids.to(dev), pos.to(dev))
            out = out[0] if isinstance(out, tuple) else out
            outs.append(out if len(real) == n else out[real])
        if self.cfg.mtp_accept == "random":
            acc = torch.randint(1, self.S + 1, (n,), generator=self.gen).tolist()
        else:
            acc = [self.S] * n
        for b, (r, a) in enumerate(zip(batch, acc)):
            if r is not None:
                r.generated.append(ids[b, :a].clone())
                r.cur += a
                r.steps_left -= 1
        self.bucket_steps[n] += 1
        self.step_idx += 1
        return outs

    # ------------------------------------------------------------------ workload / reuse
    @property
    def done(self) -> bool:
        """The multi-turn workload is over: every conversation ended and no request runs or waits."""
        return self.workload is not None and self.workload.exhausted and not self.running and not self.waiting

    def reuse_stats(self) -> dict:
        """Prefill tokens (total, computed) and the store's counters (chunks loaded per tier, rejected...)."""
        return self.reuse.stats() if self.reuse is not None else {}
