// CPU kernel of offload_ref::dsa_install_sc: dsa_install (docs/ops.md §4.2) with 16-way second-chance
// replacement instead of round-robin FIFO. Opt-in only; custom::dsa_install (FIFO) is untouched.
//
// State layout: no new tensor. lru_counter[b, set] keeps the FIFO pointer in bits 0..3 (as FIFO) and one
// reference bit per way in bits 4..19. Per batch row:
//   1. every POOL_HIT plan row (kind 1, value = slot) of the row sets the reference bit of its slot;
//   2. records are installed in record order with the same validity filter and per-row dedupe as
//      dsa_install; the victim is found from the set's pointer: a way whose bit is set has it cleared
//      and is skipped (second chance), the first way with a clear bit is taken, the pointer moves past it.
// metadata_update == 0 works on a private copy of the counters (same ways as the update == 1 call).
// Step 2's loop and everything but the victim choice is shared with dsa_install.cpp (_install_common.h).
#include <torch/library.h>

#include "_install_common.h"
#include "plan_kind.h"

namespace {

using namespace offload_install;

constexpr int32_t kRefShift = 4;

void dsa_install_sc_cpu(const at::Tensor& plan_in, const at::Tensor& records_in, const at::Tensor& sel_kv_in,
                        const at::Tensor& sel_rope_in, const at::Tensor& /*selection_kv_block_table*/,
                        const at::Tensor& pool_kv_arg,
                        const at::Tensor& pool_rope_arg, const at::Tensor& pool_ids_arg,
                        const at::Tensor& id_to_slot_arg, const at::Tensor& lru_arg, int64_t raw_seq,
                        int64_t topk, int64_t sbs, int64_t metadata_update) {
  const Sizes z = check_install("offload_cpu::dsa_install_sc", &plan_in, records_in, sel_kv_in, sel_rope_in,
                                pool_kv_arg, pool_rope_arg, pool_ids_arg, id_to_slot_arg, lru_arg, raw_seq,
                                topk, sbs);
  const at::Tensor plan = plan_in.contiguous();
  const int32_t* pl = plan.data_ptr<int32_t>();
  const int64_t SK = z.S * z.K, PS = z.PS;
  // 1. reference bits of this row's hits
  auto mark_hits = [pl, SK, PS](int64_t b, int32_t* counters) {
    const int32_t* prow = pl + b * SK * 2;
    for (int64_t q = 0; q < SK; ++q) {
      if (prow[2 * q] != offload_plan_kind::kPoolHit) continue;
      const int64_t slot = prow[2 * q + 1];
      if (slot < 0 || slot >= PS) continue;
      counters[slot / kWays] |= int32_t{1} << (kRefShift + slot % kWays);
    }
  };
  // 2. victim: clear and skip referenced ways from the pointer; at most 16 bits to clear, so the loop
  // ends within 17 probes
  auto second_chance = [](int32_t* counters, int64_t st) -> int64_t {
    int32_t c = counters[st];
    int64_t way = c & 15;
    while (c & (int32_t{1} << (kRefShift + way))) {
      c &= ~(int32_t{1} << (kRefShift + way));
      way = (way + 1) & 15;
    }
    counters[st] = (c & ~int32_t{15}) | static_cast<int32_t>((way + 1) & 15);
    return way;
  };
  install_rows(z, records_in, sel_kv_in, sel_rope_in, pool_kv_arg, pool_rope_arg, pool_ids_arg,
               id_to_slot_arg, lru_arg, metadata_update, /*grain=*/0, mark_hits, second_chance);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(offload_cpu, m) {
  m.def("dsa_install_sc(Tensor plan, Tensor install_records, Tensor selection_kv_cache, "
        "Tensor selection_k_rope, Tensor selection_kv_block_table, Tensor(a!) pool_kv_cache, "
        "Tensor(b!) pool_k_rope, Tensor(c!) pool_ids, Tensor(d!) id_to_slot, Tensor(e!) lru_counter, "
        "int raw_seq=1, int topk=2048, int selection_block_size=128, int metadata_update=1) -> ()");
}

TORCH_LIBRARY_IMPL(offload_cpu, CPU, m) { m.impl("dsa_install_sc", &dsa_install_sc_cpu); }
