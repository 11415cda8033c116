"""The Triton kernels (custom_ops/cuda/) equal their C++ twins bit for bit, on CPU tensors under
Triton's interpreter: >= 200 random cases per op (hypothesis, the generators of tests/ops/_gen.py and
the gather Case of tests/ops), the bad-input strategy of tests/ops/test_properties.py (same error as the
C++ kernel, nothing written) and adversarial cases (-1 sentinels, duplicates, out-of-range ids, garbage
records and metadata, batch rows sharing pool rows).

Geometries are small: the interpreter runs every program in Python. ``opcheck`` of the CUDA kernels
needs CUDA tensors and is not run here (see docs/cuda.md).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, note, settings
from hypothesis import strategies as st

import _gen as G
import test_npu_gather_selection_kv_cache as TG
import test_properties as TP
from offload_passes.custom_ops import OP_SPECS
from offload_passes.custom_ops import _library as Lib
from offload_passes.custom_ops._records import encode_records, records_layout

plan_op = torch.ops.custom.dsa_plan.default
serve_op = torch.ops.custom.dsa_serve.default
serve_f_op = torch.ops.custom.dsa_serve_functional.default
install_op = torch.ops.custom.dsa_install.default
install_f_op = torch.ops.custom.dsa_install_functional.default
install_sc_op = torch.ops.offload_ref.dsa_install_sc.default
gather_op = torch.ops.custom.npu_gather_selection_kv_cache.default
gather_f_op = torch.ops.custom.npu_gather_selection_kv_cache_functional.default

CASES = settings(max_examples=200)


@pytest.fixture(scope="module", autouse=True)
def kernels(triton_interpreted, force_cpp_kernels_cuda):
    from offload_passes.custom_ops.cuda import (dsa_install, dsa_install_sc, dsa_plan, dsa_serve,
                                                npu_gather_selection_kv_cache)
    for name in ("dsa_plan", "dsa_serve", "dsa_install", "dsa_install_sc", "npu_gather_selection_kv_cache"):
        Lib.cpu_op(name)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield dict(plan=dsa_plan, serve=dsa_serve, install=dsa_install, sc=dsa_install_sc,
               gather=npu_gather_selection_kv_cache)
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def force_cpp_kernels_cuda():
    mp = pytest.MonkeyPatch()
    mp.setenv("OFFLOAD_PASSES_CPU_KERNELS", "cpp")  # the twins are the C++ kernels, not the reference
    yield
    mp.undo()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int8) if t.element_size() == 1 else t.view(torch.int16)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_floating_point() or a.dtype == torch.int8:
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


# --------------------------------------------------------------------------------------------
# random group steps (small: the interpreter is slow)
# --------------------------------------------------------------------------------------------

@st.composite
def step(draw):
    B = draw(st.integers(1, 2))
    S = draw(st.integers(1, 2))
    sbs = draw(st.sampled_from([16, 32, 64]))
    K = 64
    PS = 16 * 2 ** draw(st.integers(0, 2))
    IR = draw(st.integers(1, 2 * K))
    L = draw(st.lists(st.integers(-2, 2 * K + S), min_size=B, max_size=B))
    return dict(
        B=B, S=S, K=K, PS=PS, IR=IR, sbs=sbs, L=L,
        F=max(max(L), 1) + draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2 ** 31 - 1)),
        fill=draw(st.sampled_from([1.0, 0.5, 0.1])),
        hole=draw(st.sampled_from([0.0, 0.5, 1.0])),
        dup=draw(st.sampled_from([0.0, 0.5, 1.0])),
        future=draw(st.sampled_from([0.0, 0.5])),
        beyond=draw(st.booleans()), garbage=draw(st.booleans()),
        pool_fill=draw(st.sampled_from([0.0, 0.5, 1.0])),
        D=draw(st.integers(1, 8)), Dr=draw(st.integers(0, 4)),  # Dr = 0: the no-rope mode (docs/ops.md §3.3)
        dtype=draw(st.sampled_from([torch.bfloat16, torch.float16])),
        mu=draw(st.sampled_from([0, 1])),
    )


@CASES
@given(c=step())
def test_plan_equals_cpp(kernels, c):
    note(str(c))
    L, tk, pid, i2s, lru, *_ = TP._make_step(c)
    want = plan_op(tk, L, pid, i2s, lru, raw_seq=c["S"])
    got = kernels["plan"].run(tk, L, pid, i2s, lru, raw_seq=c["S"])
    for name, a, b in zip(("plan", "install_records", "selection_kv_actual_seq"), want, got):
        assert same(a, b), name


@st.composite
def serve_step(draw):
    c = draw(step())
    c["compact"] = draw(st.sampled_from([1, 1, 0]))
    c["strided_out"] = draw(st.booleans())
    return c


@CASES
@given(c=serve_step())
def test_serve_equals_cpp(kernels, c):
    note(str(c))
    B, S, K, sbs = c["B"], c["S"], c["K"], c["sbs"]
    L, tk, pid, i2s, lru, fkv, frope, pkv, prope = TP._make_step(c)
    plan, _, _ = plan_op(tk, L, pid, i2s, lru, raw_seq=S)
    rows = B * S * K
    if c["compact"]:
        shape_kv, shape_rope = (rows // sbs, sbs, c["D"]), (rows // sbs, sbs, c["Dr"])
    else:  # legacy: one block per plan row, entry 0 written (limits: topk <= 64, rows <= 256)
        assume(rows <= 256 and c["PS"] <= 256 and c["F"] <= 512)
        shape_kv, shape_rope = (rows, sbs, c["D"]), (rows, sbs, c["Dr"])
    g = G.gen(c["seed"] + 1)
    kw = dict(raw_seq=S, topk=K, selection_block_size=sbs, compact_layout=c["compact"])
    # the selection lives inside NaN guards (and, optionally, is a strided view): no write outside
    guard = [torch.full((n + 2, *rest), float("nan"), dtype=c["dtype"]) for n, *rest in (shape_kv, shape_rope)]
    outs_c = [G.payload(s, c["dtype"], g) for s in (shape_kv, shape_rope)]
    outs_t = [t.clone() for t in outs_c]
    if c["strided_out"]:
        outs_t = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in outs_t]
    else:
        for gd, t in zip(guard, outs_t):
            gd[1:-1].copy_(t)
        outs_t = [gd[1:-1] for gd in guard]
    serve_op(plan, fkv, frope, pkv, prope, *outs_c, **kw)
    kernels["serve"].run(plan, fkv, frope, pkv, prope, *outs_t, **kw)
    assert same(outs_c[0], outs_t[0]) and same(outs_c[1], outs_t[1])
    if not c["strided_out"]:
        for gd in guard:
            assert bool(gd[0].isnan().all() and gd[-1].isnan().all()), "wrote outside the selection"
    # the functional twin: new tensors equal to the in-place result, inputs untouched
    base = [G.payload(s, c["dtype"], g) for s in (shape_kv, shape_rope)]
    keep = [t.clone() for t in base]
    want = serve_f_op(plan, fkv, frope, pkv, prope, *base, **kw)
    got = kernels["serve"].run_functional(plan, fkv, frope, pkv, prope, *base, **kw)
    assert all(same(a, b) for a, b in zip(want, got)) and all(same(a, b) for a, b in zip(base, keep))


def _install_inputs(c):
    B, S, K, sbs = c["B"], c["S"], c["K"], c["sbs"]
    L, tk, pid, i2s, lru, fkv, frope, pkv, prope = TP._make_step(c)
    plan, rec, _ = plan_op(tk, L, pid, i2s, lru, raw_seq=S)
    g = G.gen(c["seed"] + 2)
    rows = B * S * K
    sel = [G.payload((rows // sbs, sbs, c["D"]), c["dtype"], g), G.payload((rows // sbs, sbs, c["Dr"]), c["dtype"], g)]
    table = torch.arange(rows // sbs, dtype=torch.int32).view(B * S, K // sbs)
    return plan, rec, sel, table, [pkv, prope, pid, i2s, lru]


def _both_install(kernels, c, policy):
    plan, rec, sel, table, state = _install_inputs(c)
    kw = dict(raw_seq=c["S"], topk=c["K"], selection_block_size=c["sbs"], metadata_update=c["mu"])
    sc, st_ = [t.clone() for t in state], [t.clone() for t in state]
    if policy == "sc":
        install_sc_op(plan, rec, *sel, table, *sc, **kw)
        kernels["sc"].run(plan, rec, *sel, table, *st_, **kw)
    else:
        install_op(rec, *sel, table, *sc, **kw)
        kernels["install"].run(rec, *sel, table, *st_, **kw)
    names = ("pool_kv_cache", "pool_k_rope", "pool_ids", "id_to_slot", "lru_counter")
    for n, a, b in zip(names, sc, st_):
        assert same(a, b), n
    return rec, sel, table, state, kw


@CASES
@given(c=step())
def test_install_equals_cpp(kernels, c):
    note(str(c))
    rec, sel, table, state, kw = _both_install(kernels, c, "fifo")
    if c["seed"] % 4 == 0:  # the functional twin on a quarter of the cases (same kernels)
        want = install_f_op(rec, *sel, table, *state, **kw)
        got = kernels["install"].run_functional(rec, *sel, table, *state, **kw)
        assert all(same(a, b) for a, b in zip(want, got))


@CASES
@given(c=step())
def test_install_second_chance_equals_cpp(kernels, c):
    note(str(c))
    _both_install(kernels, c, "sc")


@st.composite
def gather_case(draw):
    small = draw(st.booleans())
    K = draw(st.sampled_from([8, 16, 24, 32])) if small else draw(st.sampled_from([64, 128]))
    return dict(
        seed=draw(st.integers(0, 2 ** 31 - 1)), K=K, small=small,
        B=draw(st.integers(1, 2)), S=draw(st.integers(1, 3)),
        bsz=draw(st.sampled_from([1, 2, 4, 8, 16])) if small else 1,
        dtype=draw(st.sampled_from([torch.bfloat16, torch.float16, torch.int8])),
        # the no-rope mode in both forms: a 1-D empty rope, or a zero-width 3-D one (docs/ops.md §1.2)
        rope=draw(st.sampled_from(["3d", "1d", "zero"])), layout=draw(st.sampled_from(["BSND", "TND"])),
        hole=draw(st.sampled_from([0.0, 0.5])), dup=draw(st.sampled_from([0.0, 0.5])),
        future=draw(st.sampled_from([0.0, 0.5])), garbage_status=draw(st.booleans()),
        functional=draw(st.booleans()),
    )


@CASES
@given(c=gather_case())
def test_gather_equals_cpp(kernels, c):
    note(str(c))
    case = TG.Case(c["seed"], K=c["K"], B=c["B"], S=c["S"], bsz=c["bsz"], dtype=c["dtype"],
                   no_rope=c["rope"] == "1d", layout=c["layout"], D=4, Dr=0 if c["rope"] == "zero" else 2)
    if c["garbage_status"]:
        case.status = TG.garbage_status(case.B, case.S, case.K, case.bsz, case.L, case.g)
    for step_ in range(2):  # the second step reuses the first step's ledger
        tk = case.next_topk(hole=c["hole"], dup=c["dup"], future=c["future"])
        sc, st_ = case.clone_state(), case.clone_state()
        if c["functional"]:
            want = gather_f_op(*case.args(tk, sc), selection_topk_block_size=case.bsz)
            got = kernels["gather"].run_functional(*case.args(tk, st_), case.bsz)
            assert all(same(a, b) for a, b in zip(want, got)), f"step {step_}"
            assert all(same(a, b) for a, b in zip(sc, st_)), "inputs of the functional twin changed"
            sc = (want[1], want[2], want[4].view(sc[2].shape))
        else:
            act_c = gather_op(*case.args(tk, sc), selection_topk_block_size=case.bsz)
            act_t = kernels["gather"].run(*case.args(tk, st_), case.bsz)
            assert same(act_c, act_t), f"actual_seq, step {step_}"
            for n, a, b in zip(("selection_k_rope", "selection_kv_cache", "status"), sc, st_):
                assert same(a, b), f"{n}, step {step_}"
        case.sel_rope, case.sel_kv, case.status = sc
        case.advance()


# --------------------------------------------------------------------------------------------
# bad input: the same error as the C++ kernel, nothing written
# --------------------------------------------------------------------------------------------

def _triton_call(kernels, op):
    """The op's Triton runner; a check that reads tensor data (the gather's block-table entries) flags an error
    word on the device, which ``raise_device_errors`` turns into the C++ kernel's message."""
    from offload_passes.custom_ops.cuda._common import raise_device_errors

    run = {"dsa_plan": kernels["plan"].run, "dsa_serve": kernels["serve"].run,
           "dsa_install": kernels["install"].run, "npu_gather_selection_kv_cache": kernels["gather"].run}[op]

    def call(*args, **kwargs):
        out = run(*args, **kwargs)
        raise_device_errors()
        return out
    return call


@CASES
@given(c=TP.bad_call())
def test_bad_input_same_error_as_cpp(kernels, c):
    op = c["op"]
    tensors, ints, mutated = TP._valid(op, G.gen(c["seed"]))
    arg, must_raise = TP._mutate(c, tensors, ints)
    note(f"{op}: {c['kind']} on {arg} {ints}")
    cpu = {n: t.clone() for n, t in tensors.items()}
    tri = {n: t.clone() for n, t in tensors.items()}
    before = {n: t.clone() for n, t in tensors.items()}
    try:
        want = TP._OPS[op](*cpu.values(), **ints)
        err = None
    except RuntimeError as e:
        want, err = None, str(e)
    if err is not None:
        with pytest.raises(RuntimeError) as e:
            _triton_call(kernels, op)(*tri.values(), **ints)
        # the same message; a device-side check (data-dependent) reports it through the error words
        assert str(e.value) == err or str(e.value).startswith(f"device-side check failed: {err} (on cpu;")
        for n, t in tri.items():
            assert TP._same(t, before[n]), f"{n} changed although the call raised"
        return
    assert must_raise is not True
    got = _triton_call(kernels, op)(*tri.values(), **ints)
    for a, b in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
        if a is not None:
            assert TP._same(a, b)
    for n in tensors:
        assert TP._same(cpu[n], tri[n]), n


# --------------------------------------------------------------------------------------------
# adversarial cases
# --------------------------------------------------------------------------------------------

def _payloads(B, S, K, sbs, PS, D, Dr, g, dtype=torch.bfloat16):
    rows = B * S * K
    sel = [G.payload((rows // sbs, sbs, D), dtype, g), G.payload((rows // sbs, sbs, Dr), dtype, g)]
    pool = [G.payload((B, PS, D), dtype, g), G.payload((B, PS, Dr), dtype, g)]
    table = torch.arange(rows // sbs, dtype=torch.int32).view(B * S, K // sbs)
    return sel, pool, table


@pytest.mark.parametrize("mu", [0, 1])
@pytest.mark.parametrize("policy", ["fifo", "sc"])
def test_install_garbage_records(kernels, mu, policy):
    """Counts < 0 and above the slab capacity, sets that disagree with the id, the same id in several
    sets and microtasks, ids/positions out of range, batch rows sharing pool rows (PS % sbs != 0)."""
    g = G.gen(5)
    for B, S, PS, sbs in ((2, 2, 32, 16), (3, 1, 16, 32), (2, 1, 16, 64)):
        K, IR, NS = 64, 40, PS // 16
        lay = records_layout(B, S, K)
        recs, counts = [], []
        for mt in range(lay.microtasks):
            n = int(torch.randint(0, 12, (1,), generator=g))
            for _ in range(n):
                x = int(torch.randint(-3, IR + 3, (1,), generator=g))
                recs.append((mt, int(torch.randint(-1, NS + 1, (1,), generator=g)), x,
                             int(torch.randint(-1, S + 1, (1,), generator=g)),
                             int(torch.randint(-1, K + 1, (1,), generator=g))))
            counts.append(n if mt % 5 else (-3 if mt % 2 else 10 ** 6))
        rec = encode_records(recs, counts, B, S, K)
        sel, pool, table = _payloads(B, S, K, sbs, PS, 4, 2, g)
        pid, i2s, lru = G.garbage_state(B, PS, IR, g)
        plan = torch.stack([torch.randint(0, 6, (B * S * K,), generator=g, dtype=torch.int32),
                            torch.randint(-2, PS + 2, (B * S * K,), generator=g, dtype=torch.int32)], 1)
        state = [*pool, pid, i2s, lru]
        a, b = [t.clone() for t in state], [t.clone() for t in state]
        kw = dict(raw_seq=S, topk=K, selection_block_size=sbs, metadata_update=mu)
        if policy == "sc":
            install_sc_op(plan, rec, *sel, table, *a, **kw)
            kernels["sc"].run(plan, rec, *sel, table, *b, **kw)
        else:
            install_op(rec, *sel, table, *a, **kw)
            kernels["install"].run(rec, *sel, table, *b, **kw)
        for n, x, y in zip(("pool_kv", "pool_rope", "pool_ids", "id_to_slot", "lru"), a, b):
            assert same(x, y), f"{n} B={B} PS={PS} sbs={sbs}"


def test_install_records_at_odd_byte_offset(kernels):
    """install_records as a view at byte offset 1 (misaligned int32 words): decoded like the C++ kernel."""
    g = G.gen(9)
    B, S, K, PS, IR, sbs = 2, 1, 64, 32, 90, 16
    L = torch.tensor([70, 90], dtype=torch.int32)
    tk = G.topk(L, S, K, g, reuse=0.2)
    pid, i2s, lru = G.pool_state(B, PS, IR, g)
    _, rec, _ = plan_op(tk, L, pid, i2s, lru, raw_seq=S)
    buf = torch.zeros(rec.numel() + 1, dtype=torch.int8)
    buf[1:] = rec
    sel, pool, table = _payloads(B, S, K, sbs, PS, 4, 2, g)
    state = [*pool, pid, i2s, lru]
    a, b = [t.clone() for t in state], [t.clone() for t in state]
    install_op(buf[1:], *sel, table, *a, raw_seq=S, topk=K, selection_block_size=sbs)
    kernels["install"].run(buf[1:], *sel, table, *b, raw_seq=S, topk=K, selection_block_size=sbs)
    assert all(same(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("row", [
    [-1] * 64,                                   # all sentinels
    [5, -1] + [7] * 62,                          # stop after the first id, duplicates after it
    list(range(7, -1, -1)) + [-1] * 56,          # suffix padding at a microtask boundary
    [3] * 64,                                    # one id 64 times
    [10 ** 6, -2 ** 31, 2 ** 31 - 1] + list(range(61)),  # out of range and extreme negatives
    list(range(8)) * 4 + [-1] + list(range(100, 131)),    # -1 in the middle
])
def test_plan_adversarial_rows(kernels, row):
    B, S, K, PS, IR = 1, 1, 64, 32, 50
    tk = torch.tensor(row, dtype=torch.int32).view(1, 1, 1, K)
    g = G.gen(3)
    for L_ in (0, 1, 40, 200):
        L = torch.tensor([L_], dtype=torch.int32)
        for pid, i2s, lru in (G.pool_state(B, PS, IR, g, fill=1.0), G.garbage_state(B, PS, IR, g)):
            want = plan_op(tk, L, pid, i2s, lru, raw_seq=S)
            got = kernels["plan"].run(tk, L, pid, i2s, lru, raw_seq=S)
            assert all(same(a, b) for a, b in zip(want, got)), L_


def test_serve_adversarial_plan(kernels):
    """Every kind with negative, zero, last and out-of-range values (pool and full), including kinds
    outside 0..5 and NaN payloads: served bit for bit like the C++ kernel."""
    B, S, K, PS, F, sbs = 2, 1, 64, 16, 20, 16
    vals = torch.tensor([-(2 ** 31), -1, 0, 1, PS - 1, PS, F - 1, F, 2 ** 31 - 1], dtype=torch.int32)
    kinds = torch.tensor([-1, 0, 1, 2, 3, 4, 5, 6, 99], dtype=torch.int32)
    pairs = torch.cartesian_prod(kinds, vals).to(torch.int32)
    plan = pairs.repeat(B * S * K // pairs.size(0) + 1, 1)[: B * S * K].contiguous()
    g = G.gen(4)
    fkv, frope = G.payload((B, F, 8), torch.float16, g), G.payload((B, F, 4), torch.float16, g)
    pkv, prope = G.payload((B, PS, 8), torch.float16, g), G.payload((B, PS, 4), torch.float16, g)
    fkv.view(torch.int16)[0, 0, 0] = 0x7E01  # a NaN with payload bits
    pkv.view(torch.int16)[1, 3, 1] = 0x7C01
    outs = [[torch.empty(B * S * K // sbs, sbs, d, dtype=torch.float16) for d in (8, 4)] for _ in range(2)]
    kw = dict(raw_seq=S, topk=K, selection_block_size=sbs)
    serve_op(plan, fkv, frope, pkv, prope, *outs[0], **kw)
    kernels["serve"].run(plan, fkv, frope, pkv, prope, *outs[1], **kw)
    assert same(outs[0][0], outs[1][0]) and same(outs[0][1], outs[1][1])


def test_gather_bad_block_table_entry_same_error(kernels):
    """A block-table entry the op dereferences is out of range: nothing written, and the C++ kernel's message
    (the Triton kernel checks on the device and leaves an error record the host raises, no synchronisation)."""
    from offload_passes.custom_ops.cuda._common import raise_device_errors

    case = TG.Case(11, K=64, B=2, S=1, bsz=1, dtype=torch.bfloat16, no_rope=False, layout="BSND", D=4, Dr=2)
    tk = case.next_topk()
    for fbt_entry, sel_entry, want in ((10 ** 6, None, "full_kv_block_table[0] has an entry outside [0, "),
                                       (None, -3, "selection_kv_block_table[1] has an entry outside [0, ")):
        fbt, sbt = case.fbt.clone(), case.sbt.clone()
        if fbt_entry is not None:
            case.fbt[0, 0] = fbt_entry
        if sel_entry is not None:
            case.sbt[1, 0] = sel_entry
        msgs = []
        for functional in (False, True):
            state = case.clone_state()
            before = [t.clone() for t in state]
            with pytest.raises(RuntimeError) as e:
                gather_op(*case.args(tk, state), selection_topk_block_size=1)
            cpp = str(e.value)
            assert cpp.startswith("custom::npu_gather_selection_kv_cache: " + want), cpp
            run = kernels["gather"].run_functional if functional else kernels["gather"].run
            out = run(*case.args(tk, state), 1)  # returns: the check is on the device
            with pytest.raises(RuntimeError) as e:
                raise_device_errors()
            assert str(e.value) == f"device-side check failed: {cpp} (on cpu; checked on the device, reported on the host)"
            assert all(same(a, b) for a, b in zip(state, before)), "the inputs changed"
            if functional:  # the twin's outputs are the inputs' clones: nothing was written into them either
                assert all(same(a, b) for a, b in zip(out[1:3], before[:2]))
            raise_device_errors()  # the words were cleared
            msgs.append(cpp)
        case.fbt, case.sbt = fbt, sbt
    # a good call after a bad one runs normally and reports nothing
    state, want_state = case.clone_state(), case.clone_state()
    gather_op(*case.args(tk, want_state), selection_topk_block_size=1)
    kernels["gather"].run(*case.args(tk, state), 1)
    raise_device_errors()
    assert all(same(a, b) for a, b in zip(state, want_state))


# --------------------------------------------------------------------------------------------
# registration from the specs
# --------------------------------------------------------------------------------------------

def test_cuda_kernels_found_from_the_specs(kernels):
    from offload_passes.custom_ops import cuda

    with_kernel = {s.name for s in OP_SPECS if s.cuda_kernel is not None}
    assert with_kernel == {"dsa_plan", "dsa_serve", "dsa_install", "npu_gather_selection_kv_cache",
                           "dsa_install_sc", "npu_mla_prolog_cache_write_", "static_cache_write_",
                           "npu_lightning_indexer",
                           "npu_quant_lightning_indexer", "npu_sparse_flash_attention", "npu_scatter_nd_update_"}
    # every op but the MoE communication references (multi-rank, not on a CUDA path) has a device kernel
    assert {s.name for s in OP_SPECS} - with_kernel == {"npu_moe_distribute_dispatch_v2",
                                                        "npu_moe_distribute_combine_v2"}
    cuda.register_all(force=True)
    for spec in OP_SPECS:
        if spec.cuda_kernel is None:
            with pytest.raises(KeyError, match="has no CUDA kernel"):
                cuda.kernel_module(spec)
            continue
        assert cuda.kernel_module(spec).__name__.endswith("." + spec.cuda_kernel)
        for name in spec.op_names:  # the op and its functional twin
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"{spec.namespace}::{name}", "CUDA"), name
    assert cuda.register_all(force=True) == []  # idempotent: nothing registered twice
