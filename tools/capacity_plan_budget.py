"""The hardware budget of ``offload-capacity`` and the range of each of its numbers (one table, :data:`LIMITS`).

A limit that a kernel sets is read from the kernel's OpSpec (``custom::dsa_install``): the context from
its id range (``MAX_ID_RANGE``: the pool's ``id_to_slot`` table holds one entry per cached token), ``next_n``
from ``MAX_RAW_SEQ``, the block size from the selection block sizes, the pool sizes from
``custom_ops/_pool.py``. The other bounds only refuse values no deployment has (a 1e300 GiB device), so
that every figure the planner prints is one a kernel could serve.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional

from offload_passes.custom_ops import spec_for
from offload_passes.custom_ops._library import is_pow2
from offload_passes.custom_ops._pool import pool_size_problem

_INSTALL = spec_for("dsa_install")
#: Tokens cached per request: every position needs an entry in the pool's id_to_slot table.
MAX_CONTEXT = _INSTALL.limit("MAX_ID_RANGE")
MAX_NEXT_N = _INSTALL.limit("MAX_RAW_SEQ") - 1  # raw_seq = 1 + next_n
MIN_BLOCK = _INSTALL.limit("MIN_SELECTION_BLOCK_SIZE")
MAX_BLOCK = _INSTALL.limit("MAX_SELECTION_BLOCK_SIZE")
#: The largest global batch the planner checks and the what-if models: one request on each of the most
#: ranks the budget allows (8192 devices x 8).
MAX_BATCH = 65536


@dataclass(frozen=True)
class Limit:
    """The range of one :class:`Budget` number, and the flag that sets it (None: no flag)."""

    field: str
    flag: Optional[str]
    kind: type          # int or float
    lo: float
    hi: float
    why: str
    lo_open: bool = False   # (lo, hi] instead of [lo, hi]

    def text(self) -> str:
        what = "an integer" if self.kind is int else "a finite number"
        hi = int(self.hi) if float(self.hi).is_integer() else self.hi
        return f"{what} in {'(' if self.lo_open else '['}{self.lo:g}, {hi}] ({self.why})"

    def holds(self, v: object) -> bool:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral if self.kind is int else numbers.Real):
            return False
        return math.isfinite(v) and (v > self.lo if self.lo_open else v >= self.lo) and v <= self.hi


_ID_RANGE = "custom::dsa_install's MAX_ID_RANGE: the pool's id_to_slot table holds one id per cached token"
_DTYPE = "1-bit to f32 per parameter"
LIMITS: tuple[Limit, ...] = (
    Limit("devices", "--devices", int, 1, 8192, "up to 8192 devices"),
    Limit("ranks_per_device", "--ranks-per-device", int, 1, 8, "dies per device"),
    Limit("hbm_per_device_gib", "--hbm-gib", float, 0, 4096, "GiB of HBM per device", lo_open=True),
    Limit("host_mem_per_device_gib", "--host-gib", float, 0, 65536, "GiB of host memory per device", lo_open=True),
    Limit("context_len", "--context", int, 1, MAX_CONTEXT, _ID_RANGE),
    Limit("next_n", "--next-n", int, 0, MAX_NEXT_N,
          f"raw_seq = 1 + next_n <= custom::dsa_install's MAX_RAW_SEQ {MAX_NEXT_N + 1}"),
    Limit("pa_block_size", "--block-size", int, MIN_BLOCK, MAX_BLOCK,
          "a power of two: custom::dsa_install's selection block sizes"),
    Limit("kv_dtype_bytes", "--kv-bytes", int, 2, 4, "f16/bf16 or f32"),
    Limit("indexer_dtype_bytes", "--indexer-bytes", int, 1, 4, "int8, f16/bf16 or f32"),
    Limit("indexer_scale_bytes", "--indexer-scale-bytes", int, 0, 512,
          "a token's indexer-key scales: 512 B is a whole 128-dim f32 key"),
    Limit("weight_bytes", "--weight-bytes", float, 0.125, 4, _DTYPE),
    Limit("embed_bytes", None, float, 0.125, 4, _DTYPE),
    Limit("gate_bytes", None, float, 0.125, 4, _DTYPE),
    Limit("weights_gib_per_rank", "--weights-gib", float, 0, 4096, "GiB per rank", lo_open=True),
    Limit("reserve_gib_per_rank", "--reserve-gib", float, 0, 4096, "GiB per rank"),
    Limit("prefill_mini_batch", "--prefill-mini-batch", int, 1, 4096, "requests in the prefill staging cache"),
)

#: Numbers that may be None: unbounded host memory, weights estimated from the config.
OPTIONAL = ("host_mem_per_device_gib", "weights_gib_per_rank")


@dataclass(frozen=True)
class Budget:
    """Hardware budget and every assumption of the arithmetic, with the GLM-5.2 reference defaults."""

    devices: int = 16                      # Atlas A3 cards (2 machines x 8)
    ranks_per_device: int = 2              # dies per card: world_size = 2 * chip_num
    hbm_per_device_gib: float = 128.0      # Ascend 910C: 2 x 64 GiB
    host_mem_per_device_gib: float | None = None   # host DRAM for offloaded KV per card; None = unbounded
    context_len: int = 65536               # tokens cached per request (prompt + generated), rounded up to BS
    next_n: int = 3                        # MTP draft tokens: S = 1 + next_n query rows per request
    pool_sizes: tuple[int, ...] = (8192, 16384)   # pool entries per layer: 8192, 16384 with enlarge_pool_size
    pa_block_size: int = 128
    kv_dtype_bytes: int = 2                # bf16 latent KV (the W8A8C16 deployment); 4 = f32
    indexer_dtype_bytes: int = 2           # bf16 indexer keys
    indexer_scale_bytes: int = 0           # per token per indexer layer when the indexer cache is quantised
    weight_bytes: float = 1.0              # W8A8
    embed_bytes: float = 2.0               # bf16 embedding / lm_head
    gate_bytes: float = 4.0                # fp32 MoE router
    weights_gib_per_rank: float | None = None   # replaces the estimate from the config
    reserve_gib_per_rank: float = 10.0     # activations, comm buffers, workspace, runtime
    prefill_mini_batch: int = 1            # prefill staging cache (offload modes) holds this many requests

    @property
    def ranks(self) -> int:
        return self.devices * self.ranks_per_device

    def validate(self, flags: bool = False) -> None:
        """Every number in its range (:data:`LIMITS`) and the rules that tie numbers together; ``ValueError``
        naming the field (``flags``: the command-line flag) and the limit otherwise."""
        def name(f: str) -> str:
            lim = next((x for x in LIMITS if x.field == f), None)
            return lim.flag if flags and lim is not None and lim.flag else f

        if self.kv_dtype_bytes not in (2, 4):
            raise ValueError(f"{name('kv_dtype_bytes')} must be 2 (f16/bf16) or 4 (f32), got {self.kv_dtype_bytes}: "
                             "the int8 (C8) cache layout is not modeled, and the pass refuses quantised KV")
        for lim in LIMITS:
            v = getattr(self, lim.field)
            if not (v is None and lim.field in OPTIONAL) and not lim.holds(v):
                raise ValueError(f"{name(lim.field)} must be {lim.text()}, got {v!r}")
        if self.indexer_dtype_bytes not in (1, 2, 4):
            raise ValueError(f"{name('indexer_dtype_bytes')} must be 1 (int8), 2 (f16/bf16) or 4 (f32), got 3")
        if not is_pow2(self.pa_block_size):
            raise ValueError(f"{name('pa_block_size')} must be a power of two (custom::dsa_install's selection "
                             f"block sizes), got {self.pa_block_size}")
        rank_gib = self.hbm_per_device_gib / self.ranks_per_device
        for f in ("weights_gib_per_rank", "reserve_gib_per_rank"):  # more than a rank's HBM is a typo
            v = getattr(self, f)
            if v is not None and v > rank_gib:
                raise ValueError(f"{name(f)} must be <= {name('hbm_per_device_gib')} / {name('ranks_per_device')} "
                                 f"({rank_gib:g} GiB per rank), got {v:g}")
        self._validate_pools("--pool-size" if flags else "pool_size")

    def _validate_pools(self, what: str) -> None:
        if not self.pool_sizes:
            raise ValueError(f"{what} must name at least one pool size")
        for ps in self.pool_sizes:
            if isinstance(ps, bool) or not isinstance(ps, numbers.Integral):
                raise ValueError(f"{what} must be an integer, got {ps!r}")
            # the ops' pool rule, with the selection block size the plan assumes (pa_block_size)
            problem = pool_size_problem(ps, self.pa_block_size)
            if problem is not None:
                raise ValueError(f"{what} {problem[0]} (dsa_plan / dsa_install limits), got {problem[1]}")
