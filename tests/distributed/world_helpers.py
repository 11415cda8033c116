"""Bodies of spawned ranks used by the tests (importable by the spawned children: pytest puts this
folder on sys.path, which multiprocessing's spawn hands to the children)."""
from __future__ import annotations

import datetime
import os
import traceback

import torch


def mc2_rank(rank: int, world: int, port: int, out_path: str) -> None:
    """MoE expert parallel two ways on one set of inputs: the model's traceable dispatch / combine
    (``models/glm/moe_comm.py``) and the ``offload_ref`` MC2 references with their compacted layout."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    res = {"rank": rank, "ok": False}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        import offload_passes  # noqa: F401  (registers the offload_ref ops)
        from offload_passes.models.glm import moe_comm
        from offload_passes.models.glm.modeling import GlmMoeDsaMLP
        from offload_passes.models.glm.parallel import ParallelLayout

        layout = ParallelLayout.current()
        E, T, K, H = 4, 3, 2, 16
        L = E // world
        g = torch.Generator().manual_seed(100 + rank)  # every rank its own tokens
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
        w = torch.rand(T, K, generator=g)
        torch.manual_seed(7)  # the same experts on every rank; each keeps its own
        experts = [GlmMoeDsaMLP(H, 8, torch.bfloat16) for _ in range(E)]
        for e in experts:
            for p in e.parameters():
                p.data = torch.randn(p.shape).to(torch.bfloat16) * 0.3
        mine = experts[rank * L:(rank + 1) * L]
        with torch.no_grad():
            recv_x, recv_e, ctx = moe_comm.dispatch(x, ids, w, E, layout)
            a2a = moe_comm.combine(moe_comm.run_local_experts(mine, recv_x, recv_e), ctx, layout)
            name = layout.group_name
            ex, dyn, assist, tok, recv_counts, tp, scales = torch.ops.offload_ref.npu_moe_distribute_dispatch_v2(
                x, ids, name, world, rank, E, expert_scales=w)
            out = torch.zeros(ex.shape, dtype=torch.float32)
            start = 0
            for j, n in enumerate(tok.tolist()):  # expand_x is grouped by local expert
                out[start:start + n] = mine[j](ex[start:start + n]).float()
                start += n
            mc2 = torch.ops.offload_ref.npu_moe_distribute_combine_v2(
                out.to(ex.dtype), ids, assist, recv_counts, w, name, world, rank, E)
            dense = torch.zeros(T, H)
            for t in range(T):  # the oracle: every pair through its expert, weighted, fp32, k in order
                for k in range(K):
                    dense[t] += w[t, k] * experts[int(ids[t, k])](x[t:t + 1])[0].float()
        res.update(ok=True, a2a=a2a, mc2=mc2, dense=dense.to(torch.bfloat16), tok=tok, recv_counts=recv_counts,
                   ex_shape=tuple(ex.shape), assist_shape=tuple(assist.shape), scales=scales, tp=tp,
                   ids=ids, w=w)
        try:
            torch.ops.offload_ref.npu_moe_distribute_dispatch_v2(x, ids, name, world, rank, E, quant_mode=2)
        except RuntimeError as e:
            res["quant_error"] = str(e)
    except BaseException as e:
        res["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        torch.save(res, out_path)
        if dist.is_initialized():
            dist.destroy_process_group()
