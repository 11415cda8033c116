"""``offload-demo --serve --store SPEC``: the KV store's tiers from one command-line value, the multi-turn
workload's shape, and the ``reuse`` part of the report (docs/store.md, "Serving loop").

SPEC names each tier at most once, top first whatever the order given:
``ram=SIZE``, ``disk=PATH:SIZE``, ``mooncake=MASTER_HOST:PORT@METADATA_HOST:PORT`` (the master's RPC address,
then its HTTP metadata server), comma separated; SIZE is a byte count or a number with KiB / MiB / GiB.
``rule=measured`` adds the reload-or-recompute rule: each tier's reload cost and the prefill cost are timed once
before serving, and a found prefix is reloaded only when that is predicted faster (default: always reload).
"""
from __future__ import annotations

import re
from typing import Any, Optional

from .._cli import UsageError

#: --store's syntax, as --help shows it
STORE_HELP = ("KV store tiers for --serve, top first: ram=SIZE,disk=PATH:SIZE,mooncake=MASTER_HOST:PORT@"
              "METADATA_HOST:PORT (each at most once; SIZE: bytes or a number with KiB/MiB/GiB, 1MiB..1TiB); "
              "add rule=measured to reload a prefix only when timing predicts it beats recomputing")
TIER_ORDER = ("ram", "disk", "mooncake")
MIN_SIZE, MAX_SIZE = 1 << 20, 1 << 40
_UNITS = {"": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"^(\d+)\s*([A-Za-z]*)$")
_HOST_PORT = re.compile(r"^[A-Za-z0-9.\-]+:(\d{1,5})$")


def parse_size(text: str, what: str) -> int:
    """``256MiB`` / ``1GiB`` / ``1048576`` -> bytes in ``[MIN_SIZE, MAX_SIZE]``; UsageError naming ``what``."""
    m = _SIZE.match(text.strip())
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise UsageError(f"--store: {what} size {text!r} is not a byte count or a number with KiB, MiB, GiB or TiB")
    n = int(m.group(1)) * _UNITS[unit]
    if not MIN_SIZE <= n <= MAX_SIZE:
        raise UsageError(f"--store: {what} size {text!r} must be in [1MiB, 1TiB], got {n} bytes")
    return n


def _host_port(text: str, what: str) -> str:
    m = _HOST_PORT.match(text)
    if m is None or not 1 <= int(m.group(1)) <= 65535:
        raise UsageError(f"--store: mooncake {what} {text!r} is not HOST:PORT (port in [1, 65535])")
    return text


def _tier_value(name: str, value: str) -> tuple:
    if name == "ram":
        return (parse_size(value, "ram"),)
    if name == "disk":
        path, sep, size = value.rpartition(":")
        if not sep or not path:
            raise UsageError(f"--store: disk needs PATH:SIZE, got {value!r}")
        return path, parse_size(size, "disk")
    master, sep, metadata = value.partition("@")
    if not sep:
        raise UsageError(f"--store: mooncake needs MASTER_HOST:PORT@METADATA_HOST:PORT, got {value!r}")
    return _host_port(master, "master"), _host_port(metadata, "metadata server")


def parse_store(text: str) -> dict[str, tuple]:
    """``--store``'s value -> {tier: its arguments} in top-first order; UsageError for anything else."""
    if not isinstance(text, str) or not text.strip():
        raise UsageError(f"--store must name at least one tier: {STORE_HELP}")
    spec: dict[str, tuple] = {}
    rule = None
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        if name == "rule":
            if value != "measured":
                raise UsageError(f"--store: {part.strip()!r}: the only rule is rule=measured")
            if rule is not None:
                raise UsageError("--store names the rule twice")
            rule = ("measured",)
            continue
        if name not in TIER_ORDER or not sep or not value:
            raise UsageError(f"--store: {part.strip()!r} is not ram=..., disk=... or mooncake=... ({STORE_HELP})")
        if name in spec:
            raise UsageError(f"--store names the {name} tier twice")
        spec[name] = _tier_value(name, value)
    if not spec:
        raise UsageError(f"--store must name at least one tier: {STORE_HELP}")
    out = {n: spec[n] for n in TIER_ORDER if n in spec}
    return {**out, "rule": rule} if rule else out


def build_tiers(spec: dict[str, tuple]) -> list:
    """The tiers of a parsed spec, top first. A directory that cannot be used or a shared store that does not
    answer is a UsageError naming it (before any model is built)."""
    from ..store import DiskTier, MooncakeTier, RamTier

    tiers: list = []
    try:
        for name, args in spec.items():
            if name == "rule":
                continue  # not a tier: make_store's
            if name == "ram":
                tiers.append(RamTier(args[0]))
            elif name == "disk":
                tiers.append(DiskTier(args[0], budget_bytes=args[1]))
            else:
                master, meta = args
                tiers.append(MooncakeTier(master, f"http://{meta}/metadata"))
    except (ValueError, ImportError) as exc:
        for t in tiers:
            t.close()
        raise UsageError(f"--store: {exc}") from None
    return tiers


def multiturn_config(seed: int, cap: int, K: int, arrival: float) -> Any:
    """The multi-turn / shared-prefix workload the demo serves: conversations sharing a system prompt of a
    quarter of the cache (at least K tokens), each turn's prompt = the last turn's conversation + new user
    tokens, so every later turn and every branch after the first finds a stored prefix."""
    from ..models.glm.serve import ServeConfig

    return ServeConfig(seed=seed, output_len=(4, 16), arrival=arrival, workload="multiturn",
                       shared_prefix=min(max(K, cap // 4), cap // 2), branches=6, turns=3, user_len=(8, 32))

def measured_rule(prefill_model: Any, tiers: list, fp: Any, C: int) -> Any:
    """A :class:`ReuseRule` timed here: each tier's reload cost from one- and four-chunk blobs
    (``measure_tiers``), the prefill cost ``a*n + b*n**2`` fitted through two timed prefills of the model (two
    and eight chunks, within its cache). Run before serving: the prefills only write caches a request's own
    prefill overwrites. A tier that fails the timing is a UsageError naming it."""
    import torch

    from ..store.rule import ReuseRule, best_time, fit_prefill_cost, measure_tiers

    cap = int(prefill_model.block_table.size(1)) * C
    n1, n2 = min(2 * C, cap // 4), min(8 * C, cap)
    ids = torch.randint(0, int(prefill_model.config.vocab_size), (n2,), generator=torch.Generator().manual_seed(0))
    points = [(n, best_time(lambda n=n: prefill_model.prefill(ids[:n].view(1, -1), torch.tensor([n]))))
              for n in (n1, n2)]
    chunk = C * fp.bytes_per_token()
    try:
        timings = measure_tiers(tiers, sizes=(chunk, 4 * chunk))
    except (ValueError, OSError, RuntimeError) as exc:
        raise UsageError(f"--store: rule=measured: {exc}") from None
    return ReuseRule(fit_prefill_cost(points), {n: t.cost for n, t in timings.items()})


def make_store(prefill_model: Any, tiers: list, rule: Optional[str] = None) -> tuple[Any, Any]:
    """(PagedStore, RecomputeReference) over ``tiers``: chunks of one KV block; the fingerprint names the
    weights by their digest, so a disk or shared tier never serves another model's KV. The reference lanes'
    chunks are kept in the same tiers under their own fingerprint, so a later run reloading what this one
    stored is still checked against a recompute (that run's reference). ``rule="measured"``: the reloading
    store decides with :func:`measured_rule` (the reference's store never decides: it reloads what was)."""
    from ..store import KVStore
    from ..store.paged import PagedStore, RecomputeReference, paged_fingerprint, reference_fingerprint

    C = int(prefill_model.block_size)
    fp = paged_fingerprint(prefill_model, C)
    if rule not in (None, "measured"):
        raise ValueError(f"make_store: rule must be None or 'measured', got {rule!r}")
    reuse_rule = measured_rule(prefill_model, tiers, fp, C) if rule == "measured" else None
    ps = PagedStore(KVStore(fp, C, tiers, block_size=C, rule=reuse_rule))
    return ps, RecomputeReference(ps, keep=KVStore(reference_fingerprint(fp), C, tiers, block_size=C))


def reuse_report(srv: Any, store: Any, diff: float) -> dict:
    """The ``reuse`` object of ``--json``: prefill tokens (all prompts' tokens / those computed), chunks per
    tier, rejections, faults, and the largest difference of the reloaded lane against the unmodified model
    recomputing every reloaded prefix with the same boundary (exact: 0)."""
    st = srv.reuse_stats()
    return {"tiers": [t.name for t in store.store.tiers], "chunk_tokens": store.chunk_tokens,
            "prefill_tokens_total": st["prefill_tokens_total"], "prefill_tokens_computed": st["prefill_tokens_computed"],
            "admitted_with_hit": st["admitted_with_hit"], "chunks_loaded": st.get("chunks_loaded", {}),
            "chunks_stored": st.get("chunks_stored", {}), "chunks_rejected": st.get("chunks_rejected", 0),
            "tier_faults": st.get("tier_faults", {}), "max_abs_diff": diff, "decisions": _decisions(store.store)}


def _decisions(kv: Any) -> Optional[dict]:
    """The rule's decisions (None without a rule): counts and the last one."""
    if kv.rule is None:
        return None
    st = kv.stats.as_dict()
    return {"reload": st["decisions_reload"], "recompute": st["decisions_recompute"], "last": st["last_decision"]}


def summary_reuse(r: Optional[dict]) -> list[str]:
    if not r:
        return []
    return [f"  reuse ({'+'.join(r['tiers'])}): prefill tokens computed {r['prefill_tokens_computed']} of "
            f"{r['prefill_tokens_total']}; chunks loaded {r['chunks_loaded']}, rejected {r['chunks_rejected']}; "
            f"max |diff| vs recomputing the same prefixes {r['max_abs_diff']:.3g}"] + \
        ([f"  reuse rule: {r['decisions']['reload']} reloaded, {r['decisions']['recompute']} recomputed"]
         if r.get("decisions") else [])
