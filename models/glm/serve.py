"""Continuous-batching decode, the way the reference's online executor serves (beside the static
``driver.py``).

What it mirrors (cann-recipes-infer, ``executor/online`` and ``executor/core``: its scheduler, its
``KVCacheManager.allocate_slots`` and its ``BlockPool``):

* requests arrive with random prompt and output lengths and wait in a queue; the loop models a loaded
  server (a request is waiting whenever a row frees, so the decode batch stays full);
* KV blocks come from a FIFO free list (block 0 is the null block, never handed out); a request gets the
  blocks for its prompt at admission and more as it grows (``allocate_slots`` with the step's S
  look-ahead); a finished request's blocks go back to the list and are re-used by later requests;
* the decode batch is the running requests in arrival order, up to the per-rank batch size
  (``running[:batch_size]``), so a row's request changes and rows shift up when a request finishes;
* the prompt is prefilled by a separate batch-1 model (disaggregated prefill) and its KV blocks are
  written into the decode caches by ``glm_serve::copy_blocks_``, a C++ ``TORCH_LIBRARY`` op declared
  ``Tensor(a!)`` that copies raw memory (``csrc/kv_transfer.cpp``): like an engine's reshape-and-cache
  kernel or KV transfer it moves no PyTorch version counter;
* every step feeds S = 1 + next_n tokens per row; MTP acceptance varies: a row advances by a random 1..S
  tokens, so rejected drafts are rewritten at the same positions next step.

Several *lanes* run the same schedule side by side: each lane is a decode model with its own caches
(the unmodified model, a compiled one, ...) and the tokens come from a seeded generator, not from the
logits, so the lanes' outputs are comparable step by step. When the batch changes, the loop keeps each
lane's gather ledger and selection rows with their request (the ledger row of a new request is reset,
as the reference's ``reset_rows`` does) and calls the lane's ``on_batch_change(src)`` with, per row,
the row its request held at the previous step (-1: a new request) — the hook an offload state uses to
follow its requests (``OffloadState.move_rows``). Models never import the passes: the caller supplies
the hook.
"""
from __future__ import annotations

import logging
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from .modeling import GlmMoeDsaForCausalLM

log = logging.getLogger("offload_passes.models.serve")

_CSRC = Path(__file__).resolve().parent / "csrc" / "kv_transfer.cpp"
_loaded = False


def load_transfer_op() -> Callable:
    """Build (once, cached under ``$TORCH_EXTENSIONS_DIR``) and load ``glm_serve::copy_blocks_``; needs a
    C++ compiler the first time (about a minute)."""
    global _loaded
    if not _loaded:
        if not hasattr(torch.ops, "glm_serve") or not hasattr(torch.ops.glm_serve, "copy_blocks_"):
            from torch.utils import cpp_extension

            root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
            out = root / "glm_serve_kv_transfer"
            out.mkdir(parents=True, exist_ok=True)
            cpp_extension.load(name="glm_serve_kv_transfer", sources=[str(_CSRC)], build_directory=str(out),
                               extra_cflags=["-O1"], is_python_module=False, verbose=False)
        _loaded = True
    return torch.ops.glm_serve.copy_blocks_


def copy_blocks_torch(dst: torch.Tensor, src: torch.Tensor, dst_blocks: torch.Tensor,
                      src_blocks: torch.Tensor) -> None:
    """The same write through PyTorch (``index_copy_``): moves ``dst``'s version counter."""
    dst.index_copy_(0, dst_blocks.to(dst.device), src.index_select(0, src_blocks.to(src.device)))


@dataclass
class ServeConfig:
    """The request stream and the scheduler's knobs (lengths are inclusive ranges, in tokens)."""

    seed: int = 0
    prompt_len: tuple[int, int] = (16, 160)
    output_len: tuple[int, int] = (4, 64)  # decode steps of a request
    mtp_accept: str = "random"  # "random": a row advances by 1..S tokens per step; "all": by S

    def __post_init__(self) -> None:
        for name in ("prompt_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"ServeConfig.{name} must be (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")
        if self.mtp_accept not in ("random", "all"):
            raise ValueError(f"ServeConfig.mtp_accept must be 'random' or 'all', got {self.mtp_accept!r}")


@dataclass
class Request:
    rid: int
    prompt: torch.Tensor  # [P] int64
    steps_left: int
    cur: int  # tokens in the cache (accepted)
    blocks: list = field(default_factory=list)


@dataclass
class Lane:
    """One decode model served by the loop: ``step_fn(ids, pos)`` runs its step (default: the model),
    ``on_batch_change(src)`` is told how the batch changed before the step that sees it."""

    model: GlmMoeDsaForCausalLM
    step_fn: Optional[Callable] = None
    on_batch_change: Optional[Callable[[list], None]] = None


class BlockPool:
    """The recipe's block pool: a FIFO free list; block 0 is the null block (padding of block tables)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"BlockPool: num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.free: deque = deque(range(1, num_blocks))

    def take(self, n: int) -> list:
        if n > len(self.free):
            raise RuntimeError(f"BlockPool: {n} blocks requested, {len(self.free)} free (num_blocks="
                               f"{self.num_blocks}); make the cache larger or the requests shorter")
        return [self.free.popleft() for _ in range(n)]

    def give_back(self, blocks: Sequence[int]) -> None:
        self.free.extend(blocks)


class Server:
    """The loop. ``lanes``: decode models with one configuration (batch size, S, block size, caches);
    ``prefill_model``: a batch-1 model with the same weights; ``transfer``: ``"cpp"`` (the C++ op that
    moves no version counter, the engine's way) or ``"torch"`` (``index_copy_``, moves it)."""

    def __init__(self, lanes: Sequence[Lane], prefill_model: GlmMoeDsaForCausalLM,
                 cfg: Optional[ServeConfig] = None, transfer: str = "cpp") -> None:
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
        if prefill_model.batch_size != 1 or prefill_model.block_size != m0.block_size:
            raise ValueError("Server: prefill_model must have batch_size 1 and the lanes' block size")
        if transfer not in ("cpp", "torch"):
            raise ValueError(f"Server: transfer must be 'cpp' or 'torch', got {transfer!r}")
        self.lanes = list(lanes)
        self.prefill_model = prefill_model
        self.cfg = cfg or ServeConfig()
        self.copy_blocks = load_transfer_op() if transfer == "cpp" else copy_blocks_torch
        self.B, self.S, self.BS = m0.batch_size, m0.seq_per_step, m0.block_size
        self.max_blocks = m0.block_table.size(1)
        self.cap = min(self.max_blocks, prefill_model.block_table.size(1)) * self.BS
        self.pool = BlockPool(m0.model.layers[0].self_attn.kv_cache.size(0))
        self.gen = torch.Generator().manual_seed(self.cfg.seed)
        self.vocab = m0.config.vocab_size
        self.running: list[Request] = []
        self.rows: list[Optional[int]] = [None] * self.B  # request id per row at the previous step
        self.next_rid = 0
        self.step_idx = 0
        self.finished = 0
        self.batch_changes = 0

    # ------------------------------------------------------------------ requests
    def _rand(self, lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=self.gen))

    def _arrive(self) -> Request:
        lo, hi = self.cfg.prompt_len
        steps = self._rand(*self.cfg.output_len)
        P = self._rand(lo, max(lo, min(hi, self.cap - (steps + 1) * self.S - self.BS)))
        if P + (steps + 1) * self.S + self.BS > self.cap:
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
        self.prefill_model.prefill(req.prompt.view(1, P), torch.tensor([P]))
        n = -(-P // self.BS)
        src = torch.arange(n, dtype=torch.int64)
        dst = torch.tensor(req.blocks[:n], dtype=torch.int64)
        for ln in self.lanes:
            for lp, ll in zip(self.prefill_model.model.layers, ln.model.model.layers):
                for name in ("kv_cache", "k_rope_cache"):
                    self.copy_blocks(getattr(ll.self_attn, name), getattr(lp.self_attn, name), dst, src)
                if ll.self_attn.indexer is not None:
                    ix, px = ll.self_attn.indexer, lp.self_attn.indexer
                    self.copy_blocks(ix.key_cache, px.key_cache, dst, src)
                    if getattr(ix, "int8", False):
                        self.copy_blocks(ix.key_scale_cache, px.key_scale_cache, dst, src)

    def _grow(self, req: Request) -> None:
        """``allocate_slots``: blocks for the cache plus this step's S tokens."""
        need = -(-(req.cur + self.S) // self.BS) - len(req.blocks)
        if need > 0:
            req.blocks += self.pool.take(need)

    # ------------------------------------------------------------------ batch
    def _schedule(self) -> list:
        """Retire finished requests, admit new ones, grow blocks; returns ``src`` per row."""
        done = [r for r in self.running if r.steps_left <= 0]
        for r in done:
            self.pool.give_back(r.blocks)
            self.finished += 1
        self.running = [r for r in self.running if r.steps_left > 0]
        while len(self.running) < self.B:  # a loaded server: someone is always waiting
            req = self._arrive()
            self._prefill(req)
            self.running.append(req)
        batch = self.running[: self.B]
        for r in batch:
            self._grow(r)
        prev = {rid: b for b, rid in enumerate(self.rows) if rid is not None}
        src = [prev.get(r.rid, -1) for r in batch]
        self.rows = [r.rid for r in batch]
        return src

    @torch.no_grad()
    def _apply(self, src: list, batch: list) -> None:
        table = torch.zeros(self.B, self.max_blocks, dtype=torch.int32)
        for b, r in enumerate(batch):
            table[b, : len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
        changed = src != list(range(self.B))
        idx = torch.tensor([max(x, 0) for x in src], dtype=torch.long)
        new = [b for b, x in enumerate(src) if x < 0]
        for ln in self.lanes:
            m = ln.model
            m.block_table.copy_(table.to(m.block_table.device))
            if changed:
                for layer in m.model.layers:
                    a = layer.self_attn
                    i = idx.to(a.sel_status.device)
                    for t in (a.sel_kv, a.sel_rope):
                        v = t.view(self.B, -1, *t.shape[1:])
                        v.copy_(v[i])
                    a.sel_status.copy_(a.sel_status[i])
                    if new:  # the reference's reset_rows: a new request's ledger holds nothing
                        a.sel_status[new] = -1
                if ln.on_batch_change is not None:
                    ln.on_batch_change(list(src))
        if changed:
            self.batch_changes += 1

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self) -> list:
        """One decode step of every lane; returns each lane's logits ``[B, S, V]``."""
        src = self._schedule()
        batch = self.running[: self.B]
        self._apply(src, batch)
        ids = torch.randint(0, self.vocab, (self.B, self.S), generator=self.gen)
        pos = torch.tensor([r.cur for r in batch], dtype=torch.int64).unsqueeze(1) + torch.arange(self.S)
        outs = []
        for ln in self.lanes:
            dev = ln.model.block_table.device
            fn = ln.step_fn if ln.step_fn is not None else ln.model
            out = fn(ids.to(dev), pos.to(dev))
            outs.append(out[0] if isinstance(out, tuple) else out)
        if self.cfg.mtp_accept == "random":
            acc = torch.randint(1, self.S + 1, (self.B,), generator=self.gen).tolist()
        else:
            acc = [self.S] * self.B
        for r, a in zip(batch, acc):
            r.cur += a
            r.steps_left -= 1
        self.step_idx += 1
        return outs
