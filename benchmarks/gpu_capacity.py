"""The ``capacity`` section of the GPU benchmark (``gpu_check.py`` runs it in a process of its own): a GLM-5-shaped
attention stack (:class:`StackGeo`, :class:`AttentionStack`) at 64K and 128K context: the largest batch that fits
one HBM budget with dense device KV and with the offload (host budget: what the machine pins), by arithmetic
(:func:`stack_bytes`, :func:`capacity_batches`); then, measured, the peak device memory, the tokens/s of each at
its batch and the pool hit rate.

That the offloaded stack computes what the dense one does, bit for bit (so the two tokens/s compare the same
work): ``tests/cuda/test_gpu_capacity.py``, which also checks the arithmetic.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Any, Optional

import torch

from _harness import NO_GPU, err, fill_from_device, gen, pinned_empty, randn, ratio, row

CAPACITY_CONTEXTS = (65536, 131072)


@dataclass(frozen=True)
class StackGeo:
    """A GLM-5-shaped attention stack: GLM-5's per-layer shapes (latent 512 + rope 64 in bf16, 64 heads, top-k
    2048, a lightning indexer of 32 heads x 128 shared by a group of 4 layers: IndexShare), ``layers`` of them.
    ``pool`` rows per layer and batch row when offloaded; selection blocks of ``sbs`` rows."""

    layers: int = 8
    group: int = 4
    heads: int = 64
    dkv: int = 512
    dr: int = 64
    topk: int = 2048
    idx_heads: int = 32
    idx_dim: int = 128
    pool: int = 8192
    sbs: int = 128
    elem: int = 2

    def __post_init__(self) -> None:
        if self.layers < 1 or self.layers % self.group:
            raise ValueError(f"StackGeo: layers must be a positive multiple of group={self.group}, got {self.layers}")

    @property
    def groups(self) -> int:
        return self.layers // self.group

    @property
    def row(self) -> int:
        """Bytes of one token's latent + rope row of one layer."""
        return (self.dkv + self.dr) * self.elem


#: the benchmark's stack (8 layers: 2 IndexShare groups) and the CPU tests' (interpreter-sized widths)
GLM5_STACK = StackGeo()
DRY_STACK = StackGeo(layers=8, heads=4, dkv=8, dr=4, topk=64, idx_heads=2, idx_dim=8, pool=64, sbs=16)


def stack_bytes(geo: StackGeo, T: int) -> dict:
    """Bytes per batch row of the stack over ``T`` cached tokens: ``dense`` (device KV + indexer keys + the
    step's transient), ``offload`` (device: pools, selection buffers, pool metadata, indexer keys, transient),
    ``host`` (the offloaded full caches), ``transient`` (what one step allocates per row: the indexer's scores
    and top-k, the attention's rows and probabilities, the plan)."""
    idx = geo.groups * T * geo.idx_dim * geo.elem
    # one step's intermediates (the indexer's scores [heads, T] and their weighted sum in fp32, the top-k; a layer's
    # K rows, its fp32 scores and probabilities, the plan; the layers' outputs), twice: the eager step's and the
    # captured step's (its own memory pool)
    transient = 2 * (T * (geo.idx_heads * geo.elem + 12) + geo.topk * (geo.row + geo.heads * 4 * 2 + 16)
                     + 2 * geo.layers * geo.heads * geo.dkv * geo.elem)
    dense = geo.layers * T * geo.row + idx + transient
    meta = geo.groups * (geo.pool * 4 + T * 4 + geo.pool // 16 * 4)
    offload = geo.layers * (geo.pool + geo.topk) * geo.row + meta + idx + transient
    return {"dense": dense, "offload": offload, "host": geo.layers * T * geo.row, "transient": transient}


def capacity_batches(geo: StackGeo, T: int, hbm_bytes: int, host_bytes: int) -> dict:
    """The largest batch of the stack at ``T`` tokens that fits ``hbm_bytes`` of device memory, dense and
    offloaded; the offloaded one also within ``host_bytes`` of pinned host memory (``binds``: which bound)."""
    b = stack_bytes(geo, T)
    dense = hbm_bytes // b["dense"]
    by_hbm, by_host = hbm_bytes // b["offload"], host_bytes // b["host"]
    return {"dense": int(dense), "offload": int(min(by_hbm, by_host)), "offload_by_hbm": int(by_hbm),
            "offload_by_host": int(by_host), "binds": "host" if by_host < by_hbm else "hbm", "bytes": b}


# ------------------------------------------------------------------------------------ capacity

class AttentionStack:
    """``geo.layers`` attention layers of GLM-5's shapes over ``B`` rows holding ``ctx`` tokens, one decode token per
    row and step; the full latent / rope caches on the device (``offload=False``) or in pinned host memory with a
    pool per layer (``offload=True``: one ``dsa_plan`` per group, ``dsa_serve`` per layer, the installs after each
    layer, the owner's ``metadata_update=1`` install last, as ``passes/rewrite.py`` emits them).

    Per group, per step: the new token's rows are written (host: the cache-write kernel through the pinned
    address), an indexer of ``idx_heads x idx_dim`` scores every cached token (``relu(q . k)``, weighted over its
    heads; its query turns a little every step, so successive top-k overlap as a decode's do), the top-k ids;
    then every layer attends (absorbed MLA: ``softmax(q . [latent, rope]) . latent``) over its K rows, gathered
    from the device cache or placed by ``dsa_serve``. Both variants compute the same thing: :meth:`step` returns
    every layer's output, equal bit for bit. Every tensor the step touches is static, so a step is capturable.
    ``host_store``: a flat pinned ``uint8`` buffer the host caches are carved from (re-used between contexts)."""

    def __init__(self, geo: StackGeo, B: int, ctx: int, room: int, dev: torch.device, offload: bool,
                 host_store: Optional[torch.Tensor] = None, seed: int = 0):
        from offload_passes.custom_ops.cuda import cache_write as CW
        from offload_passes.custom_ops.cuda import dsa_install as CI
        from offload_passes.custom_ops.cuda import dsa_plan as CP
        from offload_passes.custom_ops.cuda import dsa_serve as CS

        self.k = dict(plan=CP.run, serve=CS.run, install=CI.run, write=CW.run)
        self.geo, self.B, self.dev, self.offload = geo, B, dev, offload
        self.T = T = ctx + room
        G, L, H, K = geo.groups, geo.layers, geo.heads, geo.topk
        g = gen(dev, seed)
        bf = torch.bfloat16
        if offload:
            nkv, nr = L * B * T * geo.dkv, L * B * T * geo.dr
            if host_store is None:
                host_store = pinned_empty(((nkv + nr) * 2,), torch.uint8, dev)
            flat = host_store[:(nkv + nr) * 2].view(bf)
            self.kv, self.rope = flat[:nkv].view(L, B, T, geo.dkv), flat[nkv:].view(L, B, T, geo.dr)
        else:
            self.kv = torch.empty(L, B, T, geo.dkv, dtype=bf, device=dev)
            self.rope = torch.empty(L, B, T, geo.dr, dtype=bf, device=dev)
        for l in range(L):
            fill_from_device(self.kv[l], dev, g)
            fill_from_device(self.rope[l], dev, g)
        self.idx_keys = randn((G, B, T, geo.idx_dim), dev, g)
        self.q_idx = randn((G, B, geo.idx_heads, geo.idx_dim), dev, g)
        self.w_idx = torch.rand(G, B, 1, geo.idx_heads, generator=g, device=dev).to(bf)
        self.q = randn((L, B, H, geo.dkv + geo.dr), dev, g)
        self.new_kv, self.new_rope = randn((L, B, geo.dkv), dev, g), randn((L, B, geo.dr), dev, g)
        self.new_key = randn((G, B, geo.idx_dim), dev, g)
        self.length = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        self.base_rows = torch.arange(B, device=dev, dtype=torch.int64) * T
        self.cols = torch.arange(T, device=dev)
        self.scale = (geo.dkv + geo.dr) ** -0.5
        self.kinds = torch.zeros(6, dtype=torch.int64, device=dev)  # plan kinds counted on the device
        self.kind_ids = torch.arange(6, device=dev)
        if offload:
            P, sbs = geo.pool, geo.sbs
            self.pools = [(torch.zeros(B, P, geo.dkv, dtype=bf, device=dev), torch.zeros(B, P, geo.dr, dtype=bf,
                                                                                        device=dev)) for _ in range(L)]
            self.meta = [(torch.full((B, P), -1, dtype=torch.int32, device=dev),
                          torch.full((B, T), -1, dtype=torch.int32, device=dev),
                          torch.zeros(B, P // 16, dtype=torch.int32, device=dev)) for _ in range(G)]
            self.sel = [(torch.empty(B * K // sbs, sbs, geo.dkv, dtype=bf, device=dev),
                         torch.empty(B * K // sbs, sbs, geo.dr, dtype=bf, device=dev)) for _ in range(L)]
            self.table = torch.arange(B * K // sbs, dtype=torch.int32, device=dev).view(B, K // sbs)

    def _indexer(self, gi: int) -> torch.Tensor:
        q = self.q_idx[gi]
        half = q.shape[-1] // 2  # the query turns by a small angle each step (pairs of dims rotated)
        c, s = 0.9998, 0.02
        q.copy_(torch.cat([c * q[..., :half] - s * q[..., half:], s * q[..., :half] + c * q[..., half:]], -1))
        scores = torch.matmul(q, self.idx_keys[gi].transpose(1, 2)).relu_()  # [B, idx_heads, T]
        total = torch.matmul(self.w_idx[gi], scores).squeeze(1).float()  # weighted over the heads: [B, T]
        total.masked_fill_(self.cols.view(1, -1) >= self.length.view(-1, 1), float("-inf"))
        return total.topk(self.geo.topk, dim=-1).indices.to(torch.int32)  # [B, K]

    def _attend(self, l: int, kv: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        q = self.q[l]
        s = (torch.matmul(q[..., :self.geo.dkv], kv.transpose(1, 2)) +
             torch.matmul(q[..., self.geo.dkv:], rope.transpose(1, 2))).float() * self.scale
        return torch.matmul(torch.softmax(s, -1).to(kv.dtype), kv)  # [B, H, dkv]

    def step(self) -> torch.Tensor:
        """One decode token per row through every layer; returns the layers' outputs ``[L, B, H, dkv]``."""
        geo, B, K = self.geo, self.B, self.geo.topk
        pos = self.length.long()
        for gi in range(geo.groups):
            self.idx_keys[gi].index_copy_(1, pos[:1], self.new_key[gi].unsqueeze(1))
        for l in range(geo.layers):
            if self.offload:  # the new token's rows into the host cache, through the pinned address
                kvc = self.kv[l].view(1, B * self.T, 1, geo.dkv)
                self.k["write"](kvc, self.rope[l].view(1, B * self.T, 1, geo.dr), self.base_rows + pos,
                                self.new_kv[l], self.new_rope[l])
            else:
                self.kv[l].index_copy_(1, pos[:1], self.new_kv[l].unsqueeze(1))
                self.rope[l].index_copy_(1, pos[:1], self.new_rope[l].unsqueeze(1))
        self.length += 1
        outs = []
        for gi in range(geo.groups):
            ids = self._indexer(gi)
            layers = range(gi * geo.group, (gi + 1) * geo.group)
            if not self.offload:
                idx = ids.long().unsqueeze(-1)
                for l in layers:
                    outs.append(self._attend(l, torch.gather(self.kv[l], 1, idx.expand(B, K, geo.dkv)),
                                             torch.gather(self.rope[l], 1, idx.expand(B, K, geo.dr))))
                continue
            pid, i2s, lru = self.meta[gi]
            plan, rec, _ = self.k["plan"](ids.view(B, 1, 1, K), self.length, pid, i2s, lru, raw_seq=1)
            self.kinds += (plan[:, :1].long() == self.kind_ids).sum(0)  # a static shape: capturable
            kw = dict(raw_seq=1, topk=K, selection_block_size=geo.sbs)
            owner, last = layers[0], layers[-1]
            for l in layers:
                skv, srp = self.sel[l]
                self.k["serve"](plan, self.kv[l], self.rope[l], *self.pools[l], skv, srp, compact_layout=1, **kw)
                outs.append(self._attend(l, skv.view(B, K, geo.dkv), srp.view(B, K, geo.dr)))
                for layer, md in ([(l, 0)] if l != owner else []) + ([(owner, 1)] if l == last else []):
                    self.k["install"](rec, *self.sel[layer], self.table, *self.pools[layer], pid, i2s, lru,
                                      metadata_update=md, **kw)
        return torch.stack(outs)

    def hit_rate(self) -> Optional[float]:
        """Hits over hits + misses + window rows of every plan so far (offloaded only)."""
        k = self.kinds.tolist()
        looked = k[1] + k[2] + k[3]
        return k[1] / looked if looked else None


def time_stack(stack: AttentionStack, steps: int) -> dict:
    """ms per step of ``stack`` eagerly (CUDA events; the launches included) and replayed as one captured step (the
    device time: the launch overhead is the difference); host ms per step of the eager launches."""
    for _ in range(2):
        stack.step()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    a.record()
    for _ in range(steps):
        stack.step()
    b.record()
    host = (time.perf_counter() - t0) / steps
    b.synchronize()
    out = {"eager_ms": a.elapsed_time(b) / steps, "host_ms": host * 1e3, "replay_ms": None}
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            stack.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            stack.step()
        torch.cuda.synchronize()
        a.record()
        for _ in range(steps):
            graph.replay()
        b.record()
        b.synchronize()
        out["replay_ms"] = a.elapsed_time(b) / steps
    except Exception as e:  # the eager figure stands; say why
        traceback.print_exc()
        out["capture_error"] = err(e)
    return out


def _room(steps: int) -> int:
    """Tokens a capacity stack holds beyond its context: every step :func:`time_stack` runs adds one."""
    return 3 * steps + 8


def _capacity_rows(geo: StackGeo, ctx: int, hbm: int, host: int, room: int) -> tuple:
    cap = capacity_batches(geo, ctx + room, hbm, host)
    by = cap["bytes"]
    mib = lambda n: f"{n / 2 ** 20:.1f} MiB"  # noqa: E731
    rows = [row("capacity", f"largest batch, dense @ {ctx}", cap["dense"], None,
                f"arithmetic: {mib(by['dense'])} of device per row in {hbm / 2 ** 30:.0f} GiB"),
            row("capacity", f"largest batch, offloaded @ {ctx}", cap["offload"], None,
                f"arithmetic: {mib(by['offload'])} of device per row (HBM bound {cap['offload_by_hbm']}), "
                f"{mib(by['host'])} pinned per row (host bound {cap['offload_by_host']}): {cap['binds']} binds"),
            row("capacity", f"rows offloaded / dense @ {ctx}", ratio(cap["offload"], cap["dense"]), None,
                "arithmetic, the same HBM budget")]
    return rows, cap


def _measure(geo: StackGeo, B: int, ctx: int, room: int, offload: bool, store: Optional[torch.Tensor],
             dev: torch.device, args: Any) -> tuple:
    """One variant at its batch: ``(tokens/s, note, host ms per step, peak device GiB)``."""
    if B < 1:
        raise ValueError(f"no row fits at {ctx} tokens (batch {B})")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    stack = AttentionStack(geo, B, ctx, room, dev, offload, store)
    t = time_stack(stack, args.capacity_steps)
    peak = torch.cuda.max_memory_allocated() / 2 ** 30
    ms = t["replay_ms"] or t["eager_ms"]
    note = (f"B={B}; {ms:.3g} ms/step ({'graph replay' if t['replay_ms'] else 'eager'}), eager "
            f"{t['eager_ms']:.3g} ms/step; peak device {peak:.1f} GiB of {args.hbm_gib:g}")
    hr = stack.hit_rate() if offload else None
    note += f"; pool hit rate {hr:.1%}" if hr is not None else ""
    if t.get("capture_error"):
        note += f"; capture: {t['capture_error']}"
    return B / ms * 1e3, note, t["host_ms"], peak


def section_capacity(dev: torch.device, dry: bool, args: Any) -> list:
    geo = StackGeo(layers=args.capacity_layers)
    hbm, host = int(args.hbm_gib * 2 ** 30), int(args.host_gib * 2 ** 30)
    rows: list = []
    store, room = None, _room(args.capacity_steps)
    for ctx in CAPACITY_CONTEXTS:
        arith, cap = _capacity_rows(geo, ctx, hbm, host, room)
        rows += arith
        names = [f"tokens/s dense @ {ctx}", f"tokens/s offloaded @ {ctx}", f"tokens/s offloaded / dense @ {ctx}"]
        if dry:
            rows += [row("capacity", n, NO_GPU, None, NO_GPU, host_us=NO_GPU) for n in names]
            continue
        tok = {}
        for name, offload in ((names[0], False), (names[1], True)):
            B = cap["offload" if offload else "dense"]
            try:
                if offload and store is None:  # one pinned store for both contexts: pinning is slow
                    need = max(capacity_batches(geo, c + room, hbm, host)["offload"] *
                               stack_bytes(geo, c + room)["host"] for c in CAPACITY_CONTEXTS)
                    store = pinned_empty((max(need, 1),), torch.uint8, dev)
                tok[offload], note, host_ms, peak = _measure(geo, B, ctx, room, offload, store, dev, args)
                rows.append(row("capacity", name, tok[offload], None, note, host_us=host_ms * 1e3,
                                ok=None if peak <= args.hbm_gib else False))
            except Exception as e:
                traceback.print_exc()
                rows.append(row("capacity", name, None, None, f"B={B}: {err(e)}", ok=False))
        rows.append(row("capacity", names[2], ratio(tok.get(True), tok.get(False)), None,
                        "each at its largest batch"))
    return rows


RUNNERS = {"capacity": section_capacity}
