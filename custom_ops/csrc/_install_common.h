// Shared body of the CPU install kernels: offload_cpu::dsa_install (FIFO, dsa_install.cpp) and
// offload_cpu::dsa_install_sc (second chance, dsa_install_sc.cpp). Everything but the victim choice lives
// here once: argument guards, record decoding, validity filter, per-row dedupe, metadata updates and the row
// copy into the pool. Each kernel passes its policy as two callables (see install_rows).
//
// Batch rows are independent work items (each owns its metadata rows, its seen-bitset and its pool rows),
// run with at::parallel_for. The only exception is PS % selection_block_size != 0, where the NPU destination
// formula makes batch rows overlap in the flat pool: then rows run sequentially (b ascending) so the result
// stays deterministic.
//
// Records use base = 0 (records at byte 0, counts at byte rec_bytes): unlike the NPU kernel the decoding
// never depends on the buffer address.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace offload_install {

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

// Sizes of one call, checked.
struct Sizes {
  int64_t B, PS, Dkv, Dr, S, K, sbs, NS, IR;
  int64_t stride, rec_bytes, cap;
};

// Shape guards, kept in C++ too (the ops' limits are validated once per call signature first,
// csrc/_entry.cpp) so that a direct call can never access memory out of bounds. `op` prefixes every message; `plan` (second chance only, else null)
// adds its own two checks.
inline Sizes check_install(const char* op, const at::Tensor* plan, const at::Tensor& records,
                           const at::Tensor& sel_kv, const at::Tensor& sel_rope, const at::Tensor& pool_kv,
                           const at::Tensor& pool_rope, const at::Tensor& pool_ids,
                           const at::Tensor& id_to_slot, const at::Tensor& lru, int64_t raw_seq,
                           int64_t topk, int64_t sbs) {
  TORCH_CHECK(records.scalar_type() == at::kChar && records.dim() == 1, op, ": records must be 1-D int8");
  if (plan) {
    TORCH_CHECK(plan->scalar_type() == at::kInt && plan->dim() == 2 && plan->size(1) == 2, op,
                ": plan must be [rows, 2] int32");
  }
  TORCH_CHECK(pool_kv.dim() == 3 && pool_rope.dim() == 3 && sel_kv.dim() == 3 && sel_rope.dim() == 3, op,
              ": payload tensors must be 3-D");
  const auto dt = pool_kv.scalar_type();
  TORCH_CHECK(pool_rope.scalar_type() == dt && sel_kv.scalar_type() == dt && sel_rope.scalar_type() == dt,
              op, ": payload dtypes differ");
  TORCH_CHECK(pool_ids.scalar_type() == at::kInt && id_to_slot.scalar_type() == at::kInt &&
                  lru.scalar_type() == at::kInt,
              op, ": metadata must be int32");
  Sizes z;
  z.B = pool_kv.size(0);
  z.PS = pool_kv.size(1);
  z.Dkv = pool_kv.size(2);
  z.Dr = pool_rope.size(2);
  z.S = raw_seq;
  z.K = topk;
  z.sbs = sbs;
  const int64_t B = z.B, PS = z.PS, S = z.S, K = z.K;
  TORCH_CHECK(B > 0 && PS > 0 && PS % kWays == 0 && S > 0 && K > 0 && sbs > 0 && K % sbs == 0, op,
              ": bad sizes");
  if (plan) {
    TORCH_CHECK(plan->size(0) == B * S * K, op, ": plan rows must be B*S*K");
  }
  z.NS = PS / kWays;
  TORCH_CHECK(pool_rope.size(0) == B && pool_rope.size(1) == PS, op, ": pool_k_rope shape");
  TORCH_CHECK(sel_kv.size(2) == z.Dkv && sel_rope.size(2) == z.Dr, op,
              ": selection widths differ from the pool's");
  TORCH_CHECK(sel_kv.size(0) * sel_kv.size(1) >= B * S * K && sel_rope.size(0) * sel_rope.size(1) >= B * S * K,
              op, ": selection buffers too small");
  TORCH_CHECK(pool_ids.dim() == 2 && pool_ids.size(0) == B && pool_ids.size(1) == PS, op, ": pool_ids shape");
  TORCH_CHECK(id_to_slot.dim() == 2 && id_to_slot.size(0) == B && id_to_slot.size(1) > 0, op,
              ": id_to_slot shape");
  TORCH_CHECK(lru.dim() == 2 && lru.size(0) == B && lru.size(1) == z.NS, op, ": lru_counter shape");
  z.IR = id_to_slot.size(1);

  z.stride = align_up(((K + 7) / 8) * 16, kPage);
  const int64_t MT = B * S * kMicrotasks;
  z.rec_bytes = align_up(MT * z.stride, kPage);
  const int64_t cnt_bytes = align_up(MT * 32, kPage);
  TORCH_CHECK(records.numel() >= z.rec_bytes + cnt_bytes, op, ": records buffer too small");
  z.cap = std::min<int64_t>(z.stride / 16, K);
  return z;
}

// Installs every valid, first-seen record of each batch row, in record order, and commits the mutated
// arguments. The policy:
//   begin_row(b, counters): once per batch row, before its records (second chance sets reference bits);
//   pick_way(counters, set) -> way: the victim way of `set`, advancing counters[set].
// `counters` is the row's lru_counter row, or a private copy of it when metadata_update != 1.
// grain <= 0: enough batch rows per task for >= 16K potential records, so that small calls run inline.
template <class BeginRow, class PickWay>
void install_rows(const Sizes& z, const at::Tensor& records_in, const at::Tensor& sel_kv_in,
                  const at::Tensor& sel_rope_in, const at::Tensor& pool_kv_arg, const at::Tensor& pool_rope_arg,
                  const at::Tensor& pool_ids_arg, const at::Tensor& id_to_slot_arg, const at::Tensor& lru_arg,
                  int64_t metadata_update, int64_t grain, BeginRow begin_row, PickWay pick_way) {
  const int64_t B = z.B, PS = z.PS, Dkv = z.Dkv, Dr = z.Dr, S = z.S, K = z.K, sbs = z.sbs, NS = z.NS,
                IR = z.IR, stride = z.stride, rec_bytes = z.rec_bytes, cap = z.cap;
  const at::Tensor records = records_in.contiguous();
  const at::Tensor sel_kv = sel_kv_in.contiguous();
  const at::Tensor sel_rope = sel_rope_in.contiguous();
  Work pool_kv(pool_kv_arg), pool_rope(pool_rope_arg), pool_ids(pool_ids_arg), id_to_slot(id_to_slot_arg),
      lru(lru_arg);

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
      begin_row(b, counters);
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
            const int64_t slot = st * kWays + pick_way(counters, st);
            if (update) {
              const int32_t old = pid[slot];
              if (old >= 0 && old < IR) i2s[old] = -1;
              pid[slot] = static_cast<int32_t>(x);
              i2s[x] = static_cast<int32_t>(slot);
            }
            const int64_t src = ((b * S + sq) * blocks_per_row + pos / sbs) * sbs + pos % sbs;
            const int64_t dst = b * pool_row_base + slot;
            std::memcpy(pkv + dst * Dkv * esz, skv + src * Dkv * esz, Dkv * esz);
            if (Dr) std::memcpy(prp + dst * Dr * esz, srp + src * Dr * esz, Dr * esz);  // Dr = 0: no-rope mode
          }
        }
      }
    }
  };
  if (PS % sbs == 0) {
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

}  // namespace offload_install
