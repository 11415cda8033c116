// CPU kernel of custom::dsa_plan (docs/ops.md §2). Registered as offload_cpu::dsa_plan with the op's own
// arguments (plus `grain`); csrc/_entry.cpp runs it as the op's CPU kernel once a call signature passed
// validation (custom_ops/dsa_plan.py). Work items are the (b, s) query rows, run with at::parallel_for;
// each row writes only its own plan rows, its own actual_seq entry and its own 8 microtask slabs/counts,
// so the result does not depend on the thread split.
//
// install_records uses base = 0 (records at byte 0, counts at byte rec_bytes): unlike the NPU kernel the
// layout never depends on the buffer address.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "plan_kind.h"

namespace {

constexpr int64_t kPage = 4096;
constexpr int64_t kMicrotasks = 8;
constexpr int64_t kWays = 16;

using namespace offload_plan_kind;

inline int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

std::tuple<at::Tensor, at::Tensor, at::Tensor> dsa_plan_cpu(
    const at::Tensor& topk_in, const at::Tensor& seq_in, const at::Tensor& pool_ids,
    const at::Tensor& id_to_slot_in, const at::Tensor& /*lru_counter: shape-checked only*/, int64_t raw_seq,
    int64_t /*group_id*/, int64_t /*owner_layer*/, int64_t /*group_kind*/, int64_t grain) {
  TORCH_CHECK(pool_ids.dim() == 2, "offload_cpu::dsa_plan: pool_ids must be [B, PS]");
  const int64_t pool_size = pool_ids.size(1);
  // Shape guards kept here too so that a direct call can never index out of bounds.
  TORCH_CHECK(topk_in.scalar_type() == at::kInt && seq_in.scalar_type() == at::kInt &&
                  id_to_slot_in.scalar_type() == at::kInt,
              "offload_cpu::dsa_plan: int32 inputs expected");
  TORCH_CHECK(topk_in.dim() >= 2, "offload_cpu::dsa_plan: top-k must be at least 2-D");
  const int64_t B = topk_in.size(0);
  const int64_t S = raw_seq;
  const int64_t K = topk_in.size(-1);
  TORCH_CHECK(B > 0 && S > 0 && K > 0 && K % kMicrotasks == 0, "offload_cpu::dsa_plan: bad B/S/K");
  TORCH_CHECK(topk_in.numel() == B * S * K, "offload_cpu::dsa_plan: top-k numel must be B*raw_seq*K");
  TORCH_CHECK(seq_in.numel() == B, "offload_cpu::dsa_plan: full_kv_actual_seq must have B entries");
  TORCH_CHECK(id_to_slot_in.dim() == 2 && id_to_slot_in.size(0) == B && id_to_slot_in.size(1) > 0,
              "offload_cpu::dsa_plan: id_to_slot must be [B, IR]");
  TORCH_CHECK(pool_size > 0 && pool_size % kWays == 0, "offload_cpu::dsa_plan: bad pool size");
  const int64_t NS = pool_size / kWays;
  TORCH_CHECK((NS & (NS - 1)) == 0, "offload_cpu::dsa_plan: sets must be a power of two");

  const at::Tensor topk = topk_in.contiguous();
  const at::Tensor seq = seq_in.contiguous();
  const at::Tensor id_to_slot = id_to_slot_in.contiguous();
  const int64_t IR = id_to_slot.size(1);
  const int64_t P = K / kMicrotasks;
  const int64_t R = B * S;

  const int64_t stride = align_up(((K + 7) / 8) * 16, kPage);
  const int64_t MT = R * kMicrotasks;
  const int64_t rec_bytes = align_up(MT * stride, kPage);
  const int64_t cnt_bytes = align_up(MT * 32, kPage);
  const int64_t required = rec_bytes + cnt_bytes;
  TORCH_CHECK(P * 16 <= stride, "offload_cpu::dsa_plan: slab too small");

  at::Tensor plan = at::empty({R * K, 2}, topk.options());
  at::Tensor records = at::zeros({required + kPage - 1}, topk.options().dtype(at::kChar));
  at::Tensor act = at::empty({R}, topk.options());

  const int32_t* ids_all = topk.data_ptr<int32_t>();
  const int32_t* lens = seq.data_ptr<int32_t>();
  const int32_t* i2s = id_to_slot.data_ptr<int32_t>();
  int32_t* plan_p = plan.data_ptr<int32_t>();
  int32_t* act_p = act.data_ptr<int32_t>();
  // Offsets below are multiples of 4 and the allocation is aligned, so int32 access is aligned.
  int32_t* words = reinterpret_cast<int32_t*>(records.data_ptr<int8_t>());
  const int64_t stride_w = stride / 4;
  const int64_t cnt_w = rec_bytes / 4;

  // Rows per task: by default >= 32K top-k entries per task, so that small steps (sub-millisecond
  // work) run inline instead of paying thread wake-ups; `grain` > 0 overrides (tests use 1).
  if (grain <= 0) grain = std::max<int64_t>(1, 32768 / K);
  at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / S;
      const int64_t s = r % S;
      const int64_t Lb = lens[b];
      const int64_t mv = std::max<int64_t>(Lb - S - 1, 0);
      const int64_t ms = Lb - (S - 1 - s) - 1;
      const bool empty = Lb <= 0 || ms < 0;
      const int32_t* row = ids_all + r * K;
      const int32_t* slots = i2s + b * IR;
      int32_t* out = plan_p + r * K * 2;

      int64_t actual = 0;
      if (!empty) {
        for (int64_t k = 0; k < K && row[k] >= 0; ++k) actual += (row[k] <= ms);
      }
      act_p[r] = static_cast<int32_t>(actual);

      for (int64_t m = 0; m < kMicrotasks; ++m) {
        const int64_t mt = r * kMicrotasks + m;
        int32_t* slab = words + mt * stride_w;
        int32_t n = 0;
        bool stopped = m > 0 && row[m * P - 1] < 0;  // one-element look-back only
        for (int64_t k = m * P; k < (m + 1) * P; ++k) {
          const int32_t x = row[k];
          int32_t kind, value;
          if (stopped) {
            kind = kInvalid; value = -1;
          } else if (x < 0) {
            kind = kNegativeStop; value = x; stopped = true;
          } else if (empty || x > ms) {
            kind = kFutureSkip; value = x;
          } else {
            int32_t sl = -1;
            if (x < IR) {
              const int32_t v = slots[x];
              if (v >= 0 && v < pool_size) sl = v;
            }
            if (sl >= 0 && x <= mv) {
              kind = kPoolHit; value = sl;
            } else if (x > mv) {
              kind = kDecodeWindow; value = x;
            } else {
              kind = kFullOldMiss; value = x;
              int32_t* rec = slab + 4 * n;
              rec[0] = static_cast<int32_t>(x & (NS - 1));
              rec[1] = x;
              rec[2] = static_cast<int32_t>(s);
              rec[3] = static_cast<int32_t>(k);
              ++n;
            }
          }
          out[2 * k] = kind;
          out[2 * k + 1] = value;
        }
        words[cnt_w + mt * 8] = n;
      }
    }
  });
  return {plan, records, act};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(offload_cpu, m) {
  m.def("dsa_plan(Tensor selection_topk_indices, Tensor full_kv_actual_seq, Tensor pool_ids, "
        "Tensor id_to_slot, Tensor lru_counter, int raw_seq=1, int group_id=0, int owner_layer=0, "
        "int group_kind=0, int grain=0) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(offload_cpu, CPU, m) { m.impl("dsa_plan", &dsa_plan_cpu); }
