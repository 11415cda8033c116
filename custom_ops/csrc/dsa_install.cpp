// CPU kernel of custom::dsa_install (docs/ops.md §4.2), in place. Registered as offload_cpu::dsa_install with
// the op's own arguments (plus `grain`); csrc/_entry.cpp runs it as the op's CPU kernel once a call signature
// passed validation (custom_ops/dsa_install.py). The install loop (parallel over batch rows, sequential
// when PS % selection_block_size != 0) is shared with dsa_install_sc.cpp in _install_common.h; this file
// only supplies the victim choice: round-robin FIFO, the set's counter is the next way.
#include <torch/library.h>

#include "_install_common.h"

namespace {

using namespace offload_install;

void dsa_install_cpu(const at::Tensor& records_in, const at::Tensor& sel_kv_in,
                     const at::Tensor& sel_rope_in, const at::Tensor& /*selection_kv_block_table: never read*/,
                     const at::Tensor& pool_kv_arg,
                     const at::Tensor& pool_rope_arg, const at::Tensor& pool_ids_arg,
                     const at::Tensor& id_to_slot_arg, const at::Tensor& lru_arg, int64_t raw_seq,
                     int64_t topk, int64_t sbs, int64_t metadata_update, int64_t grain) {
  const Sizes z = check_install("offload_cpu::dsa_install", nullptr, records_in, sel_kv_in, sel_rope_in,
                                pool_kv_arg, pool_rope_arg, pool_ids_arg, id_to_slot_arg, lru_arg, raw_seq,
                                topk, sbs);
  install_rows(
      z, records_in, sel_kv_in, sel_rope_in, pool_kv_arg, pool_rope_arg, pool_ids_arg, id_to_slot_arg,
      lru_arg, metadata_update, grain, [](int64_t, int32_t*) {},
      [](int32_t* counters, int64_t st) -> int64_t {
        const int32_t c = counters[st];
        counters[st] = ((c & 15) + 1) & 15;  // == (c + 1) & 15 without signed overflow
        return c & 15;
      });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(offload_cpu, m) {
  m.def("dsa_install(Tensor install_records, Tensor selection_kv_cache, Tensor selection_k_rope, "
        "Tensor selection_kv_block_table, Tensor(a!) pool_kv_cache, Tensor(b!) pool_k_rope, "
        "Tensor(c!) pool_ids, Tensor(d!) id_to_slot, Tensor(e!) lru_counter, int raw_seq=1, int topk=2048, "
        "int selection_block_size=128, int metadata_update=1, int grain=0) -> ()");
}

TORCH_LIBRARY_IMPL(offload_cpu, CPU, m) { m.impl("dsa_install", &dsa_install_cpu); }
