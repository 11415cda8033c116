"""custom::dsa_install / dsa_install_functional: opcheck, exact semantics (docs/ops.md §4), C++ == reference, limits."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, os.path.dirname(__file__))
import _gen as G  # noqa: E402

from offload_passes.custom_ops import _library as Lib  # noqa: E402
from offload_passes.custom_ops import dsa_install as M  # noqa: E402
from offload_passes.custom_ops._records import encode_records, records_layout  # noqa: E402

install_op = torch.ops.custom.dsa_install
functional_op = torch.ops.custom.dsa_install_functional
plan_op = torch.ops.custom.dsa_plan


@pytest.fixture(scope="module", autouse=True)
def cpp_kernels():
    """Build/load the C++ kernels once for the module (cached on disk across sessions)."""
    return Lib.cpu_op("dsa_install"), Lib.cpu_op("dsa_plan")


# ------------------------------------------------------------------------------------------------
# Independent oracle: literal scalar transcription of docs/ops.md §4.2 (base = 0), in place.
# ------------------------------------------------------------------------------------------------

def literal_install(records, sel_kv, sel_rope, pool_kv, pool_rope, pool_ids, id_to_slot, lru, S, K, sbs, mu):
    B, PS = pool_kv.shape[:2]
    NS, IR = PS // 16, id_to_slot.size(1)
    lay = records_layout(B, S, K)
    words = records[: lay.required].clone().view(torch.int32).tolist()
    cap = min(lay.stride // 16, K)
    pid, i2s, lr = pool_ids.tolist(), id_to_slot.tolist(), lru.tolist()
    skv, srp = sel_kv.flatten(0, -2), sel_rope.flatten(0, -2)  # flatten: a [-1, 0] view (no rope) is undefined
    pkv, prp = pool_kv.flatten(0, -2), pool_rope.flatten(0, -2)  # views of the (dense) pools
    for b in range(B):
        seen = set()
        ctr = list(lr[b]) if mu == 0 else lr[b]
        for s in range(S):
            for m in range(8):
                mt = (b * S + s) * 8 + m
                n = min(words[(lay.rec_bytes + mt * 32) // 4], cap)
                if n <= 0:
                    continue
                for i in range(n):
                    o = (mt * lay.stride + 16 * i) // 4
                    st, x, sq, pos = words[o : o + 4]
                    if not (0 <= x < IR and 0 <= st < NS and 0 <= sq < S and 0 <= pos < K):
                        continue
                    if x in seen:
                        continue
                    seen.add(x)
                    way = ctr[st] & 15
                    ctr[st] = (ctr[st] + 1) & 15
                    slot = st * 16 + way
                    if mu == 1:
                        old = pid[b][slot]
                        if 0 <= old < IR:
                            i2s[b][old] = -1
                        pid[b][slot] = x
                        i2s[b][x] = slot
                    src = ((b * S + sq) * -(-K // sbs) + pos // sbs) * sbs + pos % sbs
                    dst = b * (PS // sbs) * sbs + slot
                    pkv[dst] = skv[src]
                    prp[dst] = srp[src]
    pool_ids.copy_(torch.tensor(pid, dtype=torch.int32))
    id_to_slot.copy_(torch.tensor(i2s, dtype=torch.int32))
    lru.copy_(torch.tensor(lr, dtype=torch.int32))


# ------------------------------------------------------------------------------------------------
# Random cases
# ------------------------------------------------------------------------------------------------

@G._single_threaded
def random_case(seed: int, max_elems: int = 8192):
    """Random install inputs: records from dsa_plan (temporal-locality top-k) or synthetic records."""
    g = G.gen(10_000 + seed)
    K = [64, 512, 2048][seed % 3]
    S = G._randint(1, 4, g)
    PS = [256, 8192, 16384, 32, 64][(seed // 3) % 5] if seed % 11 else 32
    B = G._randint(1, max(1, min(8, max_elems // (S * K), 32768 // PS)), g)  # keep pools small
    sbs = [s for s in (16, 32, 64, 128) if K % s == 0][G._randint(0, 3, g) % (3 if K == 64 else 4)]
    IR = G._randint(K, 4 * K, g)  # modest; sometimes below L so ids >= IR occur
    dtype = torch.bfloat16 if seed % 2 else torch.float16
    Dkv, Dr = [8, 16, 24][seed % 3], [4, 8][seed % 2]
    mu = (seed // 2) % 2
    L = G.lengths(B, S, K, g, lo=1, hi=3 * K)
    prev = G.topk((L - S).clamp(min=0), S, K, g)
    fill = [0.05, 0.3, 0.6][seed % 3] * min(1.0, IR / PS)  # leave some ids < IR non-resident
    pid, i2s, lru = G.pool_state(B, PS, IR, g, fill=fill, prefer=prev if seed % 2 else None)
    lay = records_layout(B, S, K)
    if seed % 5 == 4:  # synthetic records: invalid fields, untrusted sets, over-full sets, odd counts
        MT, NS = B * S * 8, PS // 16
        rows = []
        for mt in range(MT):
            for _ in range(G._randint(0, 6, g)):
                x = G._randint(-2, IR + 2, g) if G._rand(g) < 0.2 else G._randint(0, min(IR, 40) - 1, g)
                st = x & (NS - 1) if G._rand(g) < 0.8 else G._randint(-1, NS, g)
                sq = G._randint(0, S - 1, g) if G._rand(g) < 0.9 else G._randint(-1, S, g)
                pos = G._randint(0, K - 1, g) if G._rand(g) < 0.9 else G._randint(-1, K, g)
                rows.append([mt, st, x, sq, pos])
        fill = [0] * MT
        for r in rows:
            fill[r[0]] += 1
        counts = [c if G._rand(g) < 0.8 else G._randint(-3, lay.cap + 5, g) for c in fill]
        records = encode_records(rows, counts, B, S, K)
    else:
        tk = G.topk(L, S, K, g, prev=prev, hole=0.2, dup=0.3, beyond=IR if seed % 2 else 0)
        _, records, _ = plan_op(tk, L, pid, i2s, lru, raw_seq=S)
    if seed % 4 == 3:  # records of a consistent pool applied to arbitrary (inconsistent) metadata
        pid, i2s, lru = G.garbage_state(B, PS, IR, g)
    if seed % 6 == 5:  # odd byte offset / exact size: CPU kernels do not depend on the address
        big = torch.zeros(lay.required + 3, dtype=torch.int8)
        big[1 : 1 + lay.required] = records[: lay.required]
        records = big[1 : 1 + lay.required]
    nb = -(-B * S * K // sbs) + (seed % 3)
    sel_kv = G.payload((nb, sbs, Dkv), dtype, g)
    sel_rope = G.payload((nb, sbs, Dr), dtype, g)
    bt = torch.arange(B * S * (K // sbs), dtype=torch.int32).view(B * S, K // sbs)
    pool_kv = G.payload((B, PS, Dkv), dtype, g)
    pool_rope = G.payload((B, PS, Dr), dtype, g)
    kw = dict(raw_seq=S, topk=K, selection_block_size=sbs, metadata_update=mu)
    return [records, sel_kv, sel_rope, bt, pool_kv, pool_rope, pid, i2s, lru], kw


def _clone_state(args):
    return args[:4] + [t.clone() for t in args[4:]]


def _bits(t):
    return t.view(torch.int16) if t.dtype in (torch.float16, torch.bfloat16) else t


def _assert_same_state(a, b, what=""):
    for name, x, y in zip(M.SPEC.mutated, a[4:], b[4:]):
        assert torch.equal(_bits(x), _bits(y)), f"{what}: {name} differs"


@pytest.mark.parametrize("chunk", range(4))
def test_cpp_matches_reference_bit_exact(chunk, cpp_kernels):
    """>= 200 random cases (4 x 55): all five mutated tensors bit-identical between C++ and reference."""
    changed = 0
    nthreads = torch.get_num_threads()
    with G.single_thread():  # much faster on a loaded 2-core box
        for seed in range(chunk * 55, chunk * 55 + 55):
            args, kw = random_case(seed)
            ref, cpp = _clone_state(args), _clone_state(args)
            M.reference_dsa_install(*ref, **kw)
            install_op(*cpp, **kw)
            _assert_same_state(ref, cpp, f"seed {seed}")
            if seed % 4 == 0:  # one batch row per task with the default thread count: a real split
                split = _clone_state(args)
                with G.threads(nthreads):
                    cpp_kernels[0](*split, kw["raw_seq"], kw["topk"], kw["selection_block_size"],
                                   kw["metadata_update"], 1)  # grain 1
                _assert_same_state(ref, split, f"seed {seed} (grain 1)")
            changed += not torch.equal(_bits(ref[4]), _bits(args[4]))
    assert changed > 48  # the cases really install something


@pytest.mark.parametrize("seed", range(20))
def test_reference_matches_literal_spec(seed):
    """The vectorised reference equals a literal transcription of docs/ops.md §4.2."""
    args, kw = random_case(seed, max_elems=2048)
    with G.single_thread():
        ref, lit = _clone_state(args), _clone_state(args)
        M.reference_dsa_install(*ref, **kw)
        literal_install(*lit[:3], *lit[4:], kw["raw_seq"], kw["topk"], kw["selection_block_size"],
                        kw["metadata_update"])
        _assert_same_state(ref, lit, f"seed {seed}")


# ------------------------------------------------------------------------------------------------
# Hand-checked semantics
# ------------------------------------------------------------------------------------------------

def _small(B=1, S=1, K=64, PS=256, IR=1000, sbs=16, D=(4, 2), dtype=torch.float16, seed=0):
    g = G.gen(seed)
    nb = B * S * K // sbs
    sel_kv, sel_rope = G.payload((nb, sbs, D[0]), dtype, g), G.payload((nb, sbs, D[1]), dtype, g)
    bt = torch.arange(nb, dtype=torch.int32).view(B * S, K // sbs)
    pool_kv, pool_rope = torch.zeros(B, PS, D[0], dtype=dtype), torch.zeros(B, PS, D[1], dtype=dtype)
    pid = torch.full((B, PS), -1, dtype=torch.int32)
    i2s = torch.full((B, IR), -1, dtype=torch.int32)
    lru = torch.zeros(B, PS // 16, dtype=torch.int32)
    return [None, sel_kv, sel_rope, bt, pool_kv, pool_rope, pid, i2s, lru]


def _sel_row(args, S, K, b, s, k):
    kv, rp = args[1], args[2]
    r = (b * S + s) * K + k
    return kv.reshape(-1, kv.size(-1))[r], rp.reshape(-1, rp.size(-1))[r]


def test_fifo_dedupe_and_payload_hand_example():
    """Two batch rows; dedupe per row across S; ways follow the counter; payload from the first occurrence."""
    B, S, K, PS = 2, 2, 64, 256
    args = _small(B, S, K, PS)
    args[8][0, 3] = 14  # set 3 of row 0 starts at way 14
    rows = [  # (mt, set, id, seq, pos); mt = (b*S + s)*8 + m
        [0, 3, 19, 0, 2],  # b0: id 19 -> set 3, way 14
        [1, 3, 35, 0, 9],  # b0: id 35 -> set 3, way 15
        [8, 3, 19, 1, 5],  # b0, s=1: duplicate of 19 -> skipped (first occurrence wins)
        [9, 3, 51, 1, 12],  # b0: id 51 -> set 3, way 0 (wraps)
        [16, 3, 19, 0, 7],  # b1: id 19 again: other batch row, not a duplicate; way 0
    ]
    args[0] = encode_records(rows, None, B, S, K)
    install_op(*args, raw_seq=S, topk=K, selection_block_size=16, metadata_update=1)
    pid, i2s, lru = args[6], args[7], args[8]
    assert pid[0, 48 + 14].item() == 19 and pid[0, 48 + 15].item() == 35 and pid[0, 48].item() == 51
    assert i2s[0, 19].item() == 62 and i2s[0, 35].item() == 63 and i2s[0, 51].item() == 48
    assert pid[1, 48].item() == 19 and i2s[1, 19].item() == 48
    assert lru[0, 3].item() == 1 and lru[1, 3].item() == 1 and int(lru.sum()) == 2
    assert int((pid >= 0).sum()) == 4
    for b, slot, (s, k) in ((0, 62, (0, 2)), (0, 63, (0, 9)), (0, 48, (1, 12)), (1, 48, (0, 7))):
        kv, rp = _sel_row(args, S, K, b, s, k)
        assert torch.equal(args[4][b, slot], kv) and torch.equal(args[5][b, slot], rp)
    assert int((args[4] != 0).any(-1).sum()) == 4  # nothing else written


def test_last_writer_wins_over_16_per_set():
    """17 distinct ids into one set in one call: the 17th overwrites the 1st and clears its id_to_slot."""
    K, PS = 64, 256
    args = _small(1, 1, K, PS)
    args[6][0, 5 * 16 + 0] = 999  # an old resident of set 5, way 0
    args[7][0, 999] = 80
    ids = [5 + 16 * j for j in range(17)]
    rows = [[j // 8, 5, x, 0, j] for j, x in enumerate(ids)]  # 8 records per microtask (cap 64)
    args[0] = encode_records(rows, None, 1, 1, K)
    install_op(*args, raw_seq=1, topk=K, selection_block_size=16, metadata_update=1)
    pid, i2s, lru = args[6][0], args[7][0], args[8][0]
    assert pid[80:96].tolist() == [ids[16]] + ids[1:16]
    assert i2s[ids[0]].item() == -1 and i2s[999].item() == -1 and i2s[ids[16]].item() == 80
    assert lru[5].item() == 1
    kv, _ = _sel_row(args, 1, K, 0, 0, 16)
    assert torch.equal(args[4][0, 80], kv)


def test_invalid_records_are_skipped_and_set_is_trusted():
    K, PS, IR, S = 64, 256, 100, 2
    args = _small(1, S, K, PS, IR)
    rows = [
        [0, 1, -1, 0, 0], [0, 1, IR, 0, 0], [0, 16, 1, 0, 0], [0, -1, 1, 0, 0],
        [0, 1, 1, S, 0], [0, 1, 1, -1, 0], [0, 1, 1, 0, K], [0, 1, 1, 0, -1],
        [0, 7, 33, 1, 40],  # set 7 although 33 & 15 == 1: trusted as written
    ]
    args[0] = encode_records(rows, None, 1, S, K)
    install_op(*args, raw_seq=S, topk=K, selection_block_size=16, metadata_update=1)
    assert (args[6] >= 0).sum().item() == 1 and args[6][0, 7 * 16].item() == 33
    assert args[7][0, 33].item() == 112 and args[8][0].tolist() == [0] * 7 + [1] + [0] * 8


def test_counts_are_clamped_to_cap_and_negative_counts_skip():
    """count > cap reads cap records (zero slots decode as id 0); count <= 0 reads nothing."""
    K = 64
    lay = records_layout(1, 1, K)
    args = _small(1, 1, K)
    counts = [lay.cap + 100, -5] + [0] * 6
    args[0] = encode_records([[0, 2, 2, 0, 3], [1, 4, 4, 0, 9]], counts, 1, 1, K)
    install_op(*args, raw_seq=1, topk=K, selection_block_size=16, metadata_update=1)
    # microtask 0: id 2 then 63 zero records (set 0, id 0, seq 0, pos 0) -> one install of id 0
    assert args[6][0, 32].item() == 2 and args[6][0, 0].item() == 0
    assert int((args[6] >= 0).sum()) == 2 and args[7][0, 4].item() == -1
    assert args[8][0, :3].tolist() == [1, 0, 1]


def test_metadata_update_0_is_neutral_and_picks_the_same_ways():
    """docs/ops.md §8.6: pool_ids/id_to_slot/lru bit-identical; payload equals what metadata_update=1 writes."""
    for seed in (0, 1, 2, 4, 5):
        args, kw = random_case(seed * 4)
        kw0, kw1 = dict(kw, metadata_update=0), dict(kw, metadata_update=1)
        a0, a1 = _clone_state(args), _clone_state(args)
        install_op(*a0, **kw0)
        install_op(*a1, **kw1)
        for x, y in zip(a0[6:], args[6:]):
            assert torch.equal(x, y)
        assert torch.equal(_bits(a0[4]), _bits(a1[4])) and torch.equal(_bits(a0[5]), _bits(a1[5]))


def test_install_accounting_on_plan_records():
    """docs/ops.md §8.4/§8.7 after a plan -> install on a consistent pool."""
    for seed in range(4):
        g = G.gen(77 + seed)
        B, S, K, PS, IR, sbs = 3, 3, 512, 256, 3000, 64
        L = G.lengths(B, S, K, g, lo=K, hi=IR)
        prev = G.topk(L - S, S, K, g)
        tk = G.topk(L, S, K, g, prev=prev, reuse=0.7, dup=0.5, beyond=IR)
        pid, i2s, lru = G.pool_state(B, PS, IR, g, fill=0.8, prefer=prev)
        plan, records, act = plan_op(tk, L, pid, i2s, lru, raw_seq=S)
        sel_kv, sel_rope = G.payload((B * S * K // sbs, sbs, 16), torch.bfloat16, g), G.payload(
            (B * S * K // sbs, sbs, 8), torch.bfloat16, g)
        bt = torch.zeros(B * S, K // sbs, dtype=torch.int32)
        pool_kv, pool_rope = G.payload((B, PS, 16), torch.bfloat16, g), G.payload((B, PS, 8), torch.bfloat16, g)
        new = [t.clone() for t in (pool_kv, pool_rope, pid, i2s, lru)]
        install_op(records, sel_kv, sel_rope, bt, *new, raw_seq=S, topk=K, selection_block_size=sbs)
        npid, ni2s, nlru = new[2], new[3], new[4]
        NS = PS // 16
        kinds = plan[:, 0].view(B, S * K)
        ids = tk.reshape(B, S * K)
        for b in range(B):
            miss = ids[b][(kinds[b] == 2)]
            miss = miss[miss < IR]
            order = G.first_occurrence(miss)
            want = miss[order]  # distinct kind-2 ids, first occurrence order
            assert want.numel() > 0
            per_set = torch.bincount(want & (NS - 1), minlength=NS)
            assert torch.equal(nlru[b].long(), (lru[b].long() + per_set) % 16)
            # resident afterwards unless more than 16 installs hit the set (later ones evict)
            res = ni2s[b, want.long()]
            overfull = per_set[want & (NS - 1)] > 16
            assert bool((res[~overfull] >= 0).all())
            # payload = served row of the first occurrence
            flat_pos = (kinds[b] == 2).nonzero().squeeze(1)
            flat_pos = flat_pos[ids[b][flat_pos] < IR][order]
            for x, fp in zip(want[~overfull].tolist(), flat_pos[~overfull].tolist()):
                slot = ni2s[b, x].item()
                s, k = divmod(fp, K)
                kv, rp = _sel_row([None, sel_kv, sel_rope], S, K, b, s, k)
                assert torch.equal(new[0][b, slot], kv) and torch.equal(new[1][b, slot], rp)
            # §8.4 consistency
            occ = (npid[b] >= 0).nonzero().squeeze(1)
            assert torch.equal(ni2s[b, npid[b, occ].long()].long(), occ)
            assert torch.equal(occ // 16, (npid[b, occ] & (NS - 1)).long())
            assert npid[b, occ].unique().numel() == occ.numel()
            assert int((ni2s[b] >= 0).sum()) == occ.numel()
        assert int(nlru.min()) >= 0 and int(nlru.max()) <= 15


def test_records_address_independent():
    """A clone, a misaligned copy and an exactly-`required` slice all decode identically (base = 0)."""
    args, kw = random_case(1)
    lay = records_layout(args[4].size(0), kw["raw_seq"], kw["topk"])
    outs = []
    for rec in (args[0], args[0].clone(), torch.cat([torch.zeros(3, dtype=torch.int8), args[0]])[3:],
                args[0][: lay.required].clone()):
        a = _clone_state(args)
        a[0] = rec
        install_op(*a, **kw)
        outs.append(a)
    for o in outs[1:]:
        _assert_same_state(outs[0], o)
    assert not torch.equal(_bits(outs[0][4]), _bits(args[4]))


def test_non_contiguous_pool_tensors():
    """Mutated args that are non-contiguous views get the same result, written into their storage."""
    args, kw = next((a, k) for a, k in map(random_case, range(4, 100)) if a[4].size(0) > 1)
    ref = _clone_state(args)
    install_op(*ref, **kw)
    a = list(args)
    stores = [t.transpose(0, 1).contiguous() for t in args[4:6]]  # [PS, B, D] storage
    a[4], a[5] = (s.transpose(0, 1) for s in stores)
    i2s_store = args[7].t().contiguous()
    a[6] = args[6].clone()
    a[7] = i2s_store.t()
    a[8] = args[8].clone()
    assert not a[4].is_contiguous() and not a[7].is_contiguous()
    install_op(*a, **kw)
    _assert_same_state(ref, a)
    assert torch.equal(_bits(stores[0].transpose(0, 1)), _bits(ref[4]))
    assert torch.equal(i2s_store.t(), ref[7])


def test_functional_returns_updated_clones(monkeypatch):
    args, kw = random_case(2)
    before = [t.clone() for t in args]
    outs = functional_op(*args, **kw)
    for x, y in zip(args, before):
        assert torch.equal(_bits(x), _bits(y))  # inputs untouched
    ref = _clone_state(args)
    M.reference_dsa_install(*ref, **kw)
    _assert_same_state(ref, list(args[:4]) + list(outs))
    _assert_same_state(ref, list(args[:4]) + list(M.reference_dsa_install_functional(*args, **kw)))
    for x, y in zip(args, before):
        assert torch.equal(_bits(x), _bits(y))
    monkeypatch.setenv("OFFLOAD_PASSES_CPU_KERNELS", "reference")
    outs_r = functional_op(*args, **kw)
    _assert_same_state(ref, list(args[:4]) + list(outs_r))


def test_functionalize_maps_to_functional_twin():
    from torch.fx.experimental.proxy_tensor import make_fx

    assert torch._C._dispatch_has_kernel_for_dispatch_key("custom::dsa_install", "Functionalize")
    args = plan_case(2, 2, 64, 256, 512, 32, torch.float16, seed=3)
    kw = dict(raw_seq=2, topk=64, selection_block_size=32, metadata_update=1)

    def f(*a):
        install_op(*a, **kw)
        return a[4] + 0

    gm = make_fx(torch.func.functionalize(f, remove="mutations_and_views"))(*_clone_state(args))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert functional_op.default in targets and install_op.default not in targets
    assert sum(t is torch.ops.aten.copy_.default for t in targets) == 5
    ref, got = _clone_state(args), _clone_state(args)
    install_op(*ref, **kw)
    gm(*got)
    _assert_same_state(ref, got)


def test_schema_strings():
    assert str(install_op.default._schema) == "custom::" + M.SPEC.schema
    assert str(functional_op.default._schema) == "custom::" + M.SPEC.functional_schema


def test_fake_functional_shapes():
    args, kw = random_case(3)
    with FakeTensorMode(allow_non_fake_inputs=True):
        outs = functional_op(*args, **kw)
        assert [tuple(o.shape) for o in outs] == [tuple(t.shape) for t in args[4:]]
        assert [o.dtype for o in outs] == [t.dtype for t in args[4:]]
        assert install_op(*args, **kw) is None


def plan_case(B, S, K, PS, IR, sbs, dtype, seed, D=(16, 8)):
    """Install inputs with records from dsa_plan on a temporal-locality top-k (small, for opcheck)."""
    with G.single_thread():
        g = G.gen(seed)
        L = G.lengths(B, S, K, g, lo=K, hi=IR)
        prev = G.topk(L - S, S, K, g)
        tk = G.topk(L, S, K, g, prev=prev, dup=0.3)
        pid, i2s, lru = G.pool_state(B, PS, IR, g, fill=0.5, prefer=prev)
        _, rec, _ = plan_op(tk, L, pid, i2s, lru, raw_seq=S)
        nb = B * S * K // sbs
        return [rec, G.payload((nb, sbs, D[0]), dtype, g), G.payload((nb, sbs, D[1]), dtype, g),
                torch.arange(nb, dtype=torch.int32).view(B * S, K // sbs),
                G.payload((B, PS, D[0]), dtype, g), G.payload((B, PS, D[1]), dtype, g), pid, i2s, lru]


OPCHECK_CASES = [  # (B, S, K, PS, IR, sbs, dtype, metadata_update, op)
    (2, 4, 128, 256, 1024, 128, torch.bfloat16, 1, "inplace"),
    (2, 4, 128, 256, 1024, 64, torch.float16, 0, "functional"),
    (1, 1, 64, 256, 512, 16, torch.float16, 0, "inplace"),
    (3, 2, 64, 32, 300, 64, torch.bfloat16, 1, "functional"),  # PS % sbs != 0
]


@pytest.mark.parametrize("B,S,K,PS,IR,sbs,dtype,mu,which", OPCHECK_CASES)
def test_opcheck(B, S, K, PS, IR, sbs, dtype, mu, which):
    """opcheck (schema, fake, AOT dispatch: the in-place op goes through our Functionalize kernel)."""
    args = plan_case(B, S, K, PS, IR, sbs, dtype, seed=B * 100 + S * 10 + mu)
    kw = dict(raw_seq=S, topk=K, selection_block_size=sbs, metadata_update=mu)
    op = install_op if which == "inplace" else functional_op
    torch.library.opcheck(op.default, tuple(_clone_state(args)), kw)


# ------------------------------------------------------------------------------------------------
# Validation: every limit of docs/ops.md §4.1 once
# ------------------------------------------------------------------------------------------------

def _valid():
    B, S, K, PS, IR, sbs = 2, 2, 128, 256, 512, 64
    lay = records_layout(B, S, K)
    nb = B * S * K // sbs
    a = dict(
        rec=torch.zeros(lay.alloc, dtype=torch.int8),
        skv=torch.zeros(nb, sbs, 32, dtype=torch.float16),
        srp=torch.zeros(nb, sbs, 8, dtype=torch.float16),
        bt=torch.zeros(B * S, K // sbs, dtype=torch.int32),
        pkv=torch.zeros(B, PS, 32, dtype=torch.float16),
        prp=torch.zeros(B, PS, 8, dtype=torch.float16),
        pid=torch.full((B, PS), -1, dtype=torch.int32),
        i2s=torch.full((B, IR), -1, dtype=torch.int32),
        lru=torch.zeros(B, PS // 16, dtype=torch.int32),
        raw_seq=S, topk=K, sbs=sbs, mu=1,
    )
    return a


def _f16(*s):
    return torch.zeros(*s, dtype=torch.float16)


def _i32(*s):
    return torch.zeros(*s, dtype=torch.int32)


BAD_INSTALL = [
    ("rec", lambda a: a["rec"].to(torch.uint8), r"install_records must be int8"),
    ("rec", lambda a: a["rec"].view(-1, 1), r"install_records must be 1-D, got 2-D"),
    ("rec", lambda a: a["rec"][:0], r"install_records must be non-empty"),
    ("rec", lambda a: a["rec"][:1000], r"install_records must hold >= 135168 bytes .*got 1000"),
    ("skv", lambda a: a["skv"].float(), r"selection_kv_cache dtype must be float16 or bfloat16"),
    ("srp", lambda a: a["srp"].bfloat16(), r"selection_k_rope dtype must equal selection_kv_cache's"),
    ("pkv", lambda a: a["pkv"].bfloat16(), r"pool_kv_cache dtype must equal"),
    ("prp", lambda a: a["prp"].float(), r"pool_k_rope dtype must equal"),
    ("bt", lambda a: a["bt"].long(), r"selection_kv_block_table must be int32"),
    ("pid", lambda a: a["pid"].long(), r"pool_ids must be int32"),
    ("i2s", lambda a: a["i2s"].short(), r"id_to_slot must be int32"),
    ("lru", lambda a: a["lru"].long(), r"lru_counter must be int32"),
    ("raw_seq", lambda a: 0, r"raw_seq must be in \[1, 4\], got 0"),
    ("raw_seq", lambda a: 5, r"raw_seq must be in \[1, 4\], got 5"),
    ("topk", lambda a: 4096, r"topk must be in \[1, 2048\], got 4096"),
    ("topk", lambda a: 0, r"topk must be in \[1, 2048\], got 0"),
    ("topk", lambda a: 100, r"topk must be a multiple of 8, got 100"),
    ("sbs", lambda a: 256, r"selection_block_size must be a power of two in \[16, 128\], got 256"),
    ("sbs", lambda a: 8, r"selection_block_size must be a power of two in \[16, 128\], got 8"),
    ("sbs", lambda a: 48, r"selection_block_size must be a power of two in \[16, 128\], got 48"),
    ("topk", lambda a: 136, r"topk must be a multiple of selection_block_size=64, got 136"),
    ("mu", lambda a: 2, r"metadata_update must be 0 or 1, got 2"),
    ("skv", lambda a: _f16(4, 64 * 32), r"selection_kv_cache must be 3-D, got 2-D"),
    ("srp", lambda a: _f16(8, 64, 8, 1), r"selection_k_rope must be 3-D, got 4-D"),
    ("pkv", lambda a: _f16(2, 256), r"pool_kv_cache must be 3-D, got 2-D"),
    ("prp", lambda a: _f16(2, 256), r"pool_k_rope must be 3-D, got 2-D"),
    ("bt", lambda a: _i32(8), r"selection_kv_block_table must be 2-D, got 1-D"),
    ("pkv", lambda a: _f16(0, 256, 32), r"pool_kv_cache dim 0 \(B\) must be > 0, got 0"),
    ("pkv", lambda a: _f16(2, 32768, 32), r"pool_kv_cache dim 1 \(PS\) must be in \(0, 16384\], got 32768"),
    ("pkv", lambda a: _f16(2, 0, 32), r"pool_kv_cache dim 1 \(PS\) must be in \(0, 16384\], got 0"),
    ("pkv", lambda a: _f16(2, 200, 32), r"pool_kv_cache dim 1 \(PS\) must be a multiple of 16, got 200"),
    ("pkv", lambda a: _f16(2, 96, 32), r"\(sets\) must be a power of two, got 6"),
    ("skv", lambda a: _f16(7, 64, 32), r"selection_kv_cache must hold >= B\*raw_seq\*topk = 512 rows .*got 448"),
    ("srp", lambda a: _f16(8, 32, 8), r"selection_k_rope dims 0,1 must equal selection_kv_cache's \(8, 64\)"),
    ("bt", lambda a: _i32(3, 2), r"selection_kv_block_table must be \[B\*raw_seq=4, >= topk/selection_block_size=2\]"),
    ("bt", lambda a: _i32(4, 1), r"selection_kv_block_table must be \[B\*raw_seq=4, >= topk/selection_block_size=2\], got \(4, 1\)"),
    ("pkv", lambda a: _f16(2, 256, 513), r"pool_kv_cache dim 2 \(Dkv\) must be in \(0, 512\], got 513"),
    ("prp", lambda a: _f16(2, 256, 129), r"pool_k_rope dim 2 \(Dr\) must be in \[0, 128\] \(0: no-rope mode\), got 129"),
    ("prp", lambda a: _f16(2, 256, 0), r"selection_k_rope dim 2 must equal pool_k_rope's Dr=0, got 8"),
    ("skv", lambda a: _f16(8, 64, 16), r"selection_kv_cache dim 2 must equal pool_kv_cache's Dkv=32, got 16"),
    ("srp", lambda a: _f16(8, 64, 4), r"selection_k_rope dim 2 must equal pool_k_rope's Dr=8, got 4"),
    ("prp", lambda a: _f16(2, 128, 8), r"pool_k_rope must be \[B=2, PS=256, Dr\], got \(2, 128, 8\)"),
    ("pid", lambda a: _i32(2, 128), r"pool_ids must be \[B=2, PS=256\], got \(2, 128\)"),
    ("i2s", lambda a: _i32(3, 512), r"id_to_slot must be \[B=2, IR\], got \(3, 512\)"),
    ("i2s", lambda a: _i32(2, 0), r"id_to_slot dim 1 \(id_range\) must be > 0, got 0"),
    ("lru", lambda a: _i32(2, 15), r"lru_counter must be \[B=2, NS=16\], got \(2, 15\)"),
]


def _call(op, a):
    return op(a["rec"], a["skv"], a["srp"], a["bt"], a["pkv"], a["prp"], a["pid"], a["i2s"], a["lru"],
              raw_seq=a["raw_seq"], topk=a["topk"], selection_block_size=a["sbs"], metadata_update=a["mu"])


@pytest.mark.parametrize("arg,make,msg", BAD_INSTALL, ids=[m for _, _, m in BAD_INSTALL])
@pytest.mark.parametrize("mode", ["cpu", "fake"])
def test_validation(arg, make, msg, mode):
    a = _valid()
    a[arg] = make(a)
    if mode == "fake":
        with FakeTensorMode(allow_non_fake_inputs=True):
            with pytest.raises(RuntimeError, match="custom::dsa_install: .*" + msg):
                _call(install_op, a)
    else:
        with pytest.raises(RuntimeError, match="custom::dsa_install: .*" + msg):
            _call(install_op, a)


@pytest.mark.parametrize("index", [0, 3, 12, 17, 21, 33, 44])
def test_validation_functional(index):
    """The functional twin runs the same validation, naming itself (a sample of the limits)."""
    arg, make, msg = BAD_INSTALL[index]
    a = _valid()
    a[arg] = make(a)
    with pytest.raises(RuntimeError, match="custom::dsa_install_functional: .*" + msg):
        _call(functional_op, a)
    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(RuntimeError, match="custom::dsa_install_functional: .*" + msg):
            _call(functional_op, a)


def test_valid_args_pass():
    a = _valid()
    _call(install_op, a)
    _call(functional_op, a)
