// CPU kernel of custom::dsa_serve (docs/ops.md §3.2), exposed as offload_cpu::dsa_serve with the op's own
// arguments (csrc/_entry.cpp runs it as the op's CPU kernel once a call signature passed validation).
//
// One selection row per plan row: kind 1 copies a pool row, kinds 2/3 a full-cache row, anything
// else (and any out-of-range value) writes zeros. Rows are whole-byte copies (memcpy of D*elem
// bytes), so the result is bit-exact for every payload dtype. Plan rows are independent, so they
// are split across threads in contiguous chunks; sources are prefetched a few rows ahead because
// the full/pool rows are scattered and the copy is memory-latency bound.
//
// The op's user-facing limits are validated once per call signature (custom_ops/dsa_serve.py); the checks
// here keep direct calls memory-safe (shapes, dtypes, destination capacity). Strided tensors are served
// through dense copies (inputs) and dense temporaries copied back (the selection). A rope width of 0 (the
// no-rope mode, docs/ops.md §3.3) copies no rope bytes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "plan_kind.h"

namespace {

constexpr int64_t kGrainRows = 512;     // ~0.5 MiB of kv per chunk at Dkv=512 bf16
constexpr int64_t kPrefetchAhead = 8;   // rows; enough to cover DRAM latency at ~1 KiB per row

void check_payload(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), "offload_cpu::dsa_serve: ", name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 3, "offload_cpu::dsa_serve: ", name, " must be 3-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.scalar_type() == dtype, "offload_cpu::dsa_serve: ", name, " dtype must be ", dtype,
              ", got ", t.scalar_type());
}

// The copy loop on dense tensors whose shapes were checked.
void serve_rows(const at::Tensor& plan, const at::Tensor& full_kv, const at::Tensor& full_rope,
                const at::Tensor& pool_kv, const at::Tensor& pool_rope, const at::Tensor& sel_kv,
                const at::Tensor& sel_rope, int64_t raw_seq, int64_t topk, bool compact) {
  const int64_t rows = plan.size(0);
  const int64_t F = full_kv.size(1), PS = pool_kv.size(1);
  const int64_t es = static_cast<int64_t>(full_kv.element_size());
  const int64_t kv_bytes = full_kv.size(2) * es, rope_bytes = full_rope.size(2) * es;
  const int64_t kv_dst_stride = compact ? kv_bytes : sel_kv.size(1) * kv_bytes;
  const int64_t rope_dst_stride = compact ? rope_bytes : sel_rope.size(1) * rope_bytes;
  const int64_t per_batch = raw_seq * topk;

  const int32_t* p = plan.data_ptr<int32_t>();
  const char* fkv = static_cast<const char*>(full_kv.data_ptr());
  const char* frp = static_cast<const char*>(full_rope.data_ptr());
  const char* pkv = static_cast<const char*>(pool_kv.data_ptr());
  const char* prp = static_cast<const char*>(pool_rope.data_ptr());
  char* skv = static_cast<char*>(sel_kv.data_ptr());
  char* srp = static_cast<char*>(sel_rope.data_ptr());

  // Source row of plan row q (false = zero fill). Every index is range-checked here.
  auto source = [&](int64_t q, const char** kv, const char** rp) {
    const int32_t kind = p[2 * q];
    const int64_t v = p[2 * q + 1];
    const int64_t b = q / per_batch;
    if (kind == offload_plan_kind::kPoolHit && v >= 0 && v < PS) {
      const int64_t row = b * PS + v;
      *kv = pkv + row * kv_bytes;
      *rp = prp + row * rope_bytes;
      return true;
    }
    if ((kind == offload_plan_kind::kFullOldMiss || kind == offload_plan_kind::kDecodeWindow) && v >= 0 && v < F) {
      const int64_t row = b * F + v;
      *kv = fkv + row * kv_bytes;
      *rp = frp + row * rope_bytes;
      return true;
    }
    return false;
  };

  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      if (q + kPrefetchAhead < end) {
        const char *nkv, *nrp;
        if (source(q + kPrefetchAhead, &nkv, &nrp)) {
          __builtin_prefetch(nkv);
          __builtin_prefetch(nkv + 64);
          if (rope_bytes) __builtin_prefetch(nrp);
        }
      }
      const char *kv, *rp;
      const bool found = source(q, &kv, &rp);
      char* dkv = skv + q * kv_dst_stride;
      if (found) {
        std::memcpy(dkv, kv, kv_bytes);
      } else {
        std::memset(dkv, 0, kv_bytes);
      }
      if (rope_bytes == 0) continue;  // no-rope mode: the rope tensors may have no storage at all
      char* drp = srp + q * rope_dst_stride;
      if (found) {
        std::memcpy(drp, rp, rope_bytes);
      } else {
        std::memset(drp, 0, rope_bytes);
      }
    }
  });
}

void dsa_serve_cpu(const at::Tensor& plan_in, const at::Tensor& full_kv_in, const at::Tensor& full_rope_in,
                   const at::Tensor& pool_kv_in, const at::Tensor& pool_rope_in, const at::Tensor& sel_kv_arg,
                   const at::Tensor& sel_rope_arg, int64_t raw_seq, int64_t topk, int64_t selection_block_size,
                   int64_t compact_layout) {
  TORCH_CHECK(plan_in.device().is_cpu() && plan_in.scalar_type() == at::kInt && plan_in.dim() == 2 &&
                  plan_in.size(1) == 2,
              "offload_cpu::dsa_serve: plan must be a CPU int32 [rows, 2] tensor");
  const at::ScalarType dtype = full_kv_in.scalar_type();
  check_payload(full_kv_in, "full_kv_cache", dtype);
  check_payload(full_rope_in, "full_k_rope", dtype);
  check_payload(pool_kv_in, "pool_kv_cache", dtype);
  check_payload(pool_rope_in, "pool_k_rope", dtype);
  check_payload(sel_kv_arg, "selection_kv_cache", dtype);
  check_payload(sel_rope_arg, "selection_k_rope", dtype);

  const int64_t rows = plan_in.size(0);
  const int64_t B = full_kv_in.size(0), F = full_kv_in.size(1), PS = pool_kv_in.size(1);
  const int64_t Dkv = full_kv_in.size(2), Dr = full_rope_in.size(2);
  TORCH_CHECK(full_rope_in.size(0) == B && full_rope_in.size(1) == F && pool_kv_in.size(0) == B &&
                  pool_rope_in.size(0) == B && pool_rope_in.size(1) == PS && pool_kv_in.size(2) == Dkv &&
                  pool_rope_in.size(2) == Dr && sel_kv_arg.size(2) == Dkv && sel_rope_arg.size(2) == Dr,
              "offload_cpu::dsa_serve: full/pool/selection shapes disagree");
  TORCH_CHECK(raw_seq > 0 && topk > 0 && rows == B * raw_seq * topk,
              "offload_cpu::dsa_serve: plan rows must equal batch*raw_seq*topk");
  TORCH_CHECK(compact_layout == 0 || compact_layout == 1,
              "offload_cpu::dsa_serve: compact_layout must be 0 or 1");
  const bool compact = compact_layout == 1;
  // Destination capacity: compact writes flat row q, legacy writes entry 0 of block q.
  if (compact) {
    TORCH_CHECK(sel_kv_arg.size(0) * sel_kv_arg.size(1) >= rows && sel_rope_arg.size(0) * sel_rope_arg.size(1) >= rows,
                "offload_cpu::dsa_serve: selection buffers hold fewer than plan rows");
  } else {
    TORCH_CHECK(sel_kv_arg.size(0) >= rows && sel_rope_arg.size(0) >= rows && sel_kv_arg.size(1) >= 1 &&
                    sel_rope_arg.size(1) >= 1,
                "offload_cpu::dsa_serve: legacy selection buffers need one block per plan row");
  }
  if (rows == 0) return;
  // strided arguments: dense copies of the inputs, dense temporaries for the selection (copied back)
  const at::Tensor sel_kv = sel_kv_arg.contiguous(), sel_rope = sel_rope_arg.contiguous();
  serve_rows(plan_in.contiguous(), full_kv_in.contiguous(), full_rope_in.contiguous(), pool_kv_in.contiguous(),
             pool_rope_in.contiguous(), sel_kv, sel_rope, raw_seq, topk, compact);
  if (!sel_kv.is_same(sel_kv_arg)) sel_kv_arg.copy_(sel_kv);
  if (!sel_rope.is_same(sel_rope_arg)) sel_rope_arg.copy_(sel_rope);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(offload_cpu, m) {
  m.def(
      "dsa_serve(Tensor plan, Tensor full_kv_cache, Tensor full_k_rope, Tensor pool_kv_cache, "
      "Tensor pool_k_rope, Tensor(a!) selection_kv_cache, Tensor(b!) selection_k_rope, "
      "int raw_seq=1, int topk=2048, int selection_block_size=128, int compact_layout=1) -> ()");
}

TORCH_LIBRARY_IMPL(offload_cpu, CPU, m) {
  m.impl("dsa_serve", &dsa_serve_cpu);
}
