// CPU kernel of offload_ref::dsa_install_sc: dsa_install (spec/ops.md §4.2) with 16-way second-chance
// replacement instead of round-robin FIFO. Opt-in only; custom::dsa_install (FIFO) is untouched.
//
// State layout: no new tensor. lru_counter[b, set] keeps the FIFO pointer in bits 0..3 (as FIFO) and one
// reference bit per way in bits 4..19. Per batch row:
//   1. every POOL_HIT plan row (kind 1, value = slot) of the row sets the reference bit of its slot;
//   2. records are installed in record order with the same validity filter and per-row dedupe as
//      dsa_install; the victim is found from the set's pointer: a way whose bit is set has it cleared
//      and is skipped (second chance), the first way with a clear bit is taken, the pointer moves past it.
// metadata_update == 0 works on a private copy of the counters (same ways as the update == 1 call).
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
constexpr int32_t kRefShift = 4;

inline int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

struct Work {
  at::Tensor arg, buf;
  explicit Work(const at::Tensor& t) : arg(t), buf(t.is_contiguous() ? t : t.contiguous()) {}
  void commit() {
    if (!buf.is_same(arg)) arg.copy_(buf);
  }
};

void dsa_install_sc_cpu(const at::Tensor& plan_in, const at::Tensor& records_in, const at::Tensor& sel_kv_in,
                        const at::Tensor& sel_rope_in, const at::Tensor& pool_kv_arg,
                        const at::Tensor& pool_rope_arg, const at::Tensor& pool_ids_arg,
                        const at::Tensor& id_to_slot_arg, const at::Tensor& lru_arg, int64_t raw_seq,
                        int64_t topk, int64_t sbs, int64_t metadata_update) {
  TORCH_CHECK(records_in.scalar_type() == at::kChar && records_in.dim() == 1,
              "offload_cpu::dsa_install_sc: records must be 1-D int8");
  TORCH_CHECK(plan_in.scalar_type() == at::kInt && plan_in.dim() == 2 && plan_in.size(1) == 2,
              "offload_cpu::dsa_install_sc: plan must be [rows, 2] int32");
  TORCH_CHECK(pool_kv_arg.dim() == 3 && pool_rope_arg.dim() == 3 && sel_kv_in.dim() == 3 &&
                  sel_rope_in.dim() == 3,
              "offload_cpu::dsa_install_sc: payload tensors must be 3-D");
  const auto dt = pool_kv_arg.scalar_type();
  TORCH_CHECK(pool_rope_arg.scalar_type() == dt && sel_kv_in.scalar_type() == dt &&
                  sel_rope_in.scalar_type() == dt,
              "offload_cpu::dsa_install_sc: payload dtypes differ");
  TORCH_CHECK(pool_ids_arg.scalar_type() == at::kInt && id_to_slot_arg.scalar_type() == at::kInt &&
                  lru_arg.scalar_type() == at::kInt,
              "offload_cpu::dsa_install_sc: metadata must be int32");
  const int64_t B = pool_kv_arg.size(0);
  const int64_t PS = pool_kv_arg.size(1);
  const int64_t Dkv = pool_kv_arg.size(2);
  const int64_t Dr = pool_rope_arg.size(2);
  const int64_t S = raw_seq;
  const int64_t K = topk;
  TORCH_CHECK(B > 0 && PS > 0 && PS % kWays == 0 && S > 0 && K > 0 && sbs > 0 && K % sbs == 0,
              "offload_cpu::dsa_install_sc: bad sizes");
  TORCH_CHECK(plan_in.size(0) == B * S * K, "offload_cpu::dsa_install_sc: plan rows must be B*S*K");
  const int64_t NS = PS / kWays;
  TORCH_CHECK(pool_rope_arg.size(0) == B && pool_rope_arg.size(1) == PS,
              "offload_cpu::dsa_install_sc: pool_k_rope shape");
  TORCH_CHECK(sel_kv_in.size(2) == Dkv && sel_rope_in.size(2) == Dr,
              "offload_cpu::dsa_install_sc: selection widths differ from the pool's");
  TORCH_CHECK(sel_kv_in.size(0) * sel_kv_in.size(1) >= B * S * K &&
                  sel_rope_in.size(0) * sel_rope_in.size(1) >= B * S * K,
              "offload_cpu::dsa_install_sc: selection buffers too small");
  TORCH_CHECK(pool_ids_arg.dim() == 2 && pool_ids_arg.size(0) == B && pool_ids_arg.size(1) == PS,
              "offload_cpu::dsa_install_sc: pool_ids shape");
  TORCH_CHECK(id_to_slot_arg.dim() == 2 && id_to_slot_arg.size(0) == B && id_to_slot_arg.size(1) > 0,
              "offload_cpu::dsa_install_sc: id_to_slot shape");
  TORCH_CHECK(lru_arg.dim() == 2 && lru_arg.size(0) == B && lru_arg.size(1) == NS,
              "offload_cpu::dsa_install_sc: lru_counter shape");
  const int64_t IR = id_to_slot_arg.size(1);

  const int64_t stride = align_up(((K + 7) / 8) * 16, kPage);
  const int64_t MT = B * S * kMicrotasks;
  const int64_t rec_bytes = align_up(MT * stride, kPage);
  const int64_t cnt_bytes = align_up(MT * 32, kPage);
  TORCH_CHECK(records_in.numel() >= rec_bytes + cnt_bytes,
              "offload_cpu::dsa_install_sc: records buffer too small");
  const int64_t cap = std::min<int64_t>(stride / 16, K);

  const at::Tensor records = records_in.contiguous();
  const at::Tensor plan = plan_in.contiguous();
  const at::Tensor sel_kv = sel_kv_in.contiguous();
  const at::Tensor sel_rope = sel_rope_in.contiguous();
  Work pool_kv(pool_kv_arg), pool_rope(pool_rope_arg), pool_ids(pool_ids_arg), id_to_slot(id_to_slot_arg),
      lru(lru_arg);

  const int8_t* rec = records.data_ptr<int8_t>();
  const int32_t* pl = plan.data_ptr<int32_t>();
  const int64_t esz = pool_kv.buf.element_size();
  const char* skv = static_cast<const char*>(sel_kv.data_ptr());
  const char* srp = static_cast<const char*>(sel_rope.data_ptr());
  char* pkv = static_cast<char*>(pool_kv.buf.data_ptr());
  char* prp = static_cast<char*>(pool_rope.buf.data_ptr());
  int32_t* pid_all = pool_ids.buf.data_ptr<int32_t>();
  int32_t* i2s_all = id_to_slot.buf.data_ptr<int32_t>();
  int32_t* lru_all = lru.buf.data_ptr<int32_t>();
  const int64_t blocks_per_row = (K + sbs - 1) / sbs;
  const int64_t pool_row_base = (PS / sbs) * sbs;
  const bool update = metadata_update == 1;

  auto run = [&](int64_t begin, int64_t end) {
    std::vector<uint64_t> seen((IR + 63) / 64);
    std::vector<int32_t> ctr(NS);
    for (int64_t b = begin; b < end; ++b) {
      std::fill(seen.begin(), seen.end(), 0);
      int32_t* lru_b = lru_all + b * NS;
      int32_t* counters = update ? lru_b : ctr.data();
      if (!update) std::copy(lru_b, lru_b + NS, ctr.begin());
      // 1. reference bits of this row's hits
      const int32_t* prow = pl + b * S * K * 2;
      for (int64_t q = 0; q < S * K; ++q) {
        if (prow[2 * q] != 1) continue;
        const int64_t slot = prow[2 * q + 1];
        if (slot < 0 || slot >= PS) continue;
        counters[slot / kWays] |= int32_t{1} << (kRefShift + slot % kWays);
      }
      int32_t* pid = pid_all + b * PS;
      int32_t* i2s = i2s_all + b * IR;
      // 2. installs, record order
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
            if (word & bit) continue;
            word |= bit;
            int32_t c = counters[st];
            int64_t way = c & 15;
            // at most 16 bits to clear: the loop ends within 17 probes
            while (c & (int32_t{1} << (kRefShift + way))) {
              c &= ~(int32_t{1} << (kRefShift + way));
              way = (way + 1) & 15;
            }
            c = (c & ~int32_t{15}) | static_cast<int32_t>((way + 1) & 15);
            counters[st] = c;
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
    at::parallel_for(0, B, std::max<int64_t>(1, 16384 / (S * K)), run);
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
  m.def("dsa_install_sc(Tensor plan, Tensor install_records, Tensor selection_kv_cache, "
        "Tensor selection_k_rope, Tensor(a!) pool_kv_cache, Tensor(b!) pool_k_rope, Tensor(c!) pool_ids, "
        "Tensor(d!) id_to_slot, Tensor(e!) lru_counter, int raw_seq, int topk, int selection_block_size, "
        "int metadata_update) -> ()");
}

TORCH_LIBRARY_IMPL(offload_cpu, CPU, m) { m.impl("dsa_install_sc", &dsa_install_sc_cpu); }
