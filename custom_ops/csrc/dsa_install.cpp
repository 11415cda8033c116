// CPU kernel of custom::dsa_install (spec/ops.md §4.2), in place. Registered as offload_cpu::dsa_install;
// the Python wrapper validates all limits first. Batch rows are independent work items (each owns its
// metadata rows, its seen-bitset and its pool rows), run with at::parallel_for. The only exception is
// PS % selection_block_size != 0, where the NPU destination formula makes batch rows overlap in the flat
// pool: then rows run sequentially (b ascending) so the result stays deterministic.
//
// install_records uses base = 0 (records at byte 0, counts at byte rec_bytes): unlike the NPU kernel the
// decoding never depends on the buffer address.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kPage = 4096;
constexpr int64_t kMicrotasks = 8;
constexpr int64_t kWays = 16;

inline int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));  // the records tensor may start at any byte offset
  return v;
}

// Contiguous working view of a mutated argument; copied back at the end when it is not the argument.
struct Work {
  at::Tensor arg, buf;
  explicit Work(const at::Tensor& t) : arg(t), buf(t.is_contiguous() ? t : t.contiguous()) {}
  void commit() {
    if (!buf.is_same(arg)) arg.copy_(buf);
  }
};

void dsa_install_cpu(const at::Tensor& records_in, const at::Tensor& sel_kv_in,
                     const at::Tensor& sel_rope_in, const at::Tensor& pool_kv_arg,
                     const at::Tensor& pool_rope_arg, const at::Tensor& pool_ids_arg,
                     const at::Tensor& id_to_slot_arg, const at::Tensor& lru_arg, int64_t raw_seq,
                     int64_t topk, int64_t sbs, int64_t metadata_update, int64_t grain) {
  // Shape guards kept here too so that a direct call can never access memory out of bounds.
  TORCH_CHECK(records_in.scalar_type() == at::kChar && records_in.dim() == 1,
              "offload_cpu::dsa_install: records must be 1-D int8");
  TORCH_CHECK(pool_kv_arg.dim() == 3 && pool_rope_arg.dim() == 3 && sel_kv_in.dim() == 3 &&
                  sel_rope_in.dim() == 3,
              "offload_cpu::dsa_install: payload tensors must be 3-D");
  const auto dt = pool_kv_arg.scalar_type();
  TORCH_CHECK(pool_rope_arg.scalar_type() == dt && sel_kv_in.scalar_type() == dt &&
                  sel_rope_in.scalar_type() == dt,
              "offload_cpu::dsa_install: payload dtypes differ");
  TORCH_CHECK(pool_ids_arg.scalar_type() == at::kInt && id_to_slot_arg.scalar_type() == at::kInt &&
                  lru_arg.scalar_type() == at::kInt,
              "offload_cpu::dsa_install: metadata must be int32");
  const int64_t B = pool_kv_arg.size(0);
  const int64_t PS = pool_kv_arg.size(1);
  const int64_t Dkv = pool_kv_arg.size(2);
  const int64_t Dr = pool_rope_arg.size(2);
  const int64_t S = raw_seq;
  const int64_t K = topk;
  TORCH_CHECK(B > 0 && PS > 0 && PS % kWays == 0 && S > 0 && K > 0 && sbs > 0 && K % sbs == 0,
              "offload_cpu::dsa_install: bad sizes");
  const int64_t NS = PS / kWays;
  TORCH_CHECK(pool_rope_arg.size(0) == B && pool_rope_arg.size(1) == PS,
              "offload_cpu::dsa_install: pool_k_rope shape");
  TORCH_CHECK(sel_kv_in.size(2) == Dkv && sel_rope_in.size(2) == Dr,
              "offload_cpu::dsa_install: selection widths differ from the pool's");
  TORCH_CHECK(sel_kv_in.size(0) * sel_kv_in.size(1) >= B * S * K &&
                  sel_rope_in.size(0) * sel_rope_in.size(1) >= B * S * K,
              "offload_cpu::dsa_install: selection buffers too small");
  TORCH_CHECK(pool_ids_arg.dim() == 2 && pool_ids_arg.size(0) == B && pool_ids_arg.size(1) == PS,
              "offload_cpu::dsa_install: pool_ids shape");
  TORCH_CHECK(id_to_slot_arg.dim() == 2 && id_to_slot_arg.size(0) == B && id_to_slot_arg.size(1) > 0,
              "offload_cpu::dsa_install: id_to_slot shape");
  TORCH_CHECK(lru_arg.dim() == 2 && lru_arg.size(0) == B && lru_arg.size(1) == NS,
              "offload_cpu::dsa_install: lru_counter shape");
  const int64_t IR = id_to_slot_arg.size(1);

  const int64_t stride = align_up(((K + 7) / 8) * 16, kPage);
  const int64_t MT = B * S * kMicrotasks;
  const int64_t rec_bytes = align_up(MT * stride, kPage);
  const int64_t cnt_bytes = align_up(MT * 32, kPage);
  TORCH_CHECK(records_in.numel() >= rec_bytes + cnt_bytes,
              "offload_cpu::dsa_install: records buffer too small");
  const int64_t cap = std::min<int64_t>(stride / 16, K);

  const at::Tensor records = records_in.contiguous();
  const at::Tensor sel_kv = sel_kv_in.contiguous();
  const at::Tensor sel_rope = sel_rope_in.contiguous();
  Work pool_kv(pool_kv_arg), pool_rope(pool_rope_arg), pool_ids(pool_ids_arg),
      id_to_slot(id_to_slot_arg), lru(lru_arg);

  const int8_t* rec = records.data_ptr<int8_t>();
  const int64_t esz = pool_kv.buf.element_size();
  const char* skv = static_cast<const char*>(sel_kv.data_ptr());
  const char* srp = static_cast<const char*>(sel_rope.data_ptr());
  char* pkv = static_cast<char*>(pool_kv.buf.data_ptr());
  char* prp = static_cast<char*>(pool_rope.buf.data_ptr());
  int32_t* pid_all = pool_ids.buf.data_ptr<int32_t>();
  int32_t* i2s_all = id_to_slot.buf.data_ptr<int32_t>();
  int32_t* lru_all = lru.buf.data_ptr<int32_t>();
  const int64_t blocks_per_row = (K + sbs - 1) / sbs;
  const int64_t pool_row_base = (PS / sbs) * sbs;  // NPU: dst = b*(PS//sbs)*sbs + slot
  const bool update = metadata_update == 1;

  auto run = [&](int64_t begin, int64_t end) {
    std::vector<uint64_t> seen((IR + 63) / 64);
    std::vector<int32_t> ctr(NS);
    for (int64_t b = begin; b < end; ++b) {
      std::fill(seen.begin(), seen.end(), 0);
      int32_t* lru_b = lru_all + b * NS;
      int32_t* counters = update ? lru_b : ctr.data();
      if (!update) std::copy(lru_b, lru_b + NS, ctr.begin());  // private counters
      int32_t* pid = pid_all + b * PS;
      int32_t* i2s = i2s_all + b * IR;
      for (int64_t s = 0; s < S; ++s) {
        for (int64_t m = 0; m < kMicrotasks; ++m) {
          const int64_t mt = (b * S + s) * kMicrotasks + m;
          const int64_t n = std::min<int64_t>(load_i32(rec + rec_bytes + mt * 32), cap);
          const int8_t* slab = rec + mt * stride;
          for (int64_t i = 0; i < n; ++i) {
            const int64_t st = load_i32(slab + 16 * i);
            const int64_t x = load_i32(slab + 16 * i + 4);
            const int64_t sq = load_i32(slab + 16 * i + 8);
            const int64_t pos = load_i32(slab + 16 * i + 12);
            if (!(x >= 0 && x < IR && st >= 0 && st < NS && sq >= 0 && sq < S && pos >= 0 && pos < K))
              continue;
            uint64_t& word = seen[x >> 6];
            const uint64_t bit = uint64_t{1} << (x & 63);
            if (word & bit) continue;  // dedupe per batch row, first occurrence wins
            word |= bit;
            const int32_t c = counters[st];
            const int64_t way = c & 15;
            counters[st] = ((c & 15) + 1) & 15;  // == (c + 1) & 15 without signed overflow
            const int64_t slot = st * kWays + way;
            if (update) {
              const int32_t old = pid[slot];
              if (old >= 0 && old < IR) i2s[old] = -1;
              pid[slot] = static_cast<int32_t>(x);
              i2s[x] = static_cast<int32_t>(slot);
            }
            const int64_t src = ((b * S + sq) * blocks_per_row + pos / sbs) * sbs + pos % sbs;
            const int64_t dst = b * pool_row_base + slot;
            std::memcpy(pkv + dst * Dkv * esz, skv + src * Dkv * esz, Dkv * esz);
            std::memcpy(prp + dst * Dr * esz, srp + src * Dr * esz, Dr * esz);
          }
        }
      }
    }
  };
  if (PS % sbs == 0) {
    // Batch rows per task: by default enough rows for >= 16K potential records per task, so that
    // small calls run inline; `grain` > 0 overrides (tests use 1).
    if (grain <= 0) grain = std::max<int64_t>(1, 16384 / (S * K));
    at::parallel_for(0, B, grain, run);
  } else {
    run(0, B);
  }
  pool_kv.commit();
  pool_rope.commit();
  pool_ids.commit();
  id_to_slot.commit();
  lru.commit();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(offload_cpu, m) {
  m.def("dsa_install(Tensor install_records, Tensor selection_kv_cache, Tensor selection_k_rope, "
        "Tensor(a!) pool_kv_cache, Tensor(b!) pool_k_rope, Tensor(c!) pool_ids, Tensor(d!) id_to_slot, "
        "Tensor(e!) lru_counter, int raw_seq, int topk, int selection_block_size, "
        "int metadata_update, int grain=0) -> ()");
}

TORCH_LIBRARY_IMPL(offload_cpu, CPU, m) { m.impl("dsa_install", &dsa_install_cpu); }
