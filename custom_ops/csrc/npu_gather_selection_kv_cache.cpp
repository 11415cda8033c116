// CPU kernel of custom::npu_gather_selection_kv_cache (docs/ops.md §1), exposed as
// offload_cpu::npu_gather_selection_kv_cache.
//
// Query rows r = b*S + s are independent (each owns its status row and its selection blocks), so
// they are split across threads. Per row the ledger logic follows §1.4 (K > 32, bsz == 1) or §1.5
// (K <= 32) exactly as the pure-torch reference in npu_gather_selection_kv_cache.py does; payload
// moves are byte copies (bf16, fp16, int8; rope skipped in the 1-D empty "no-rope" mode).
//
// Every block-table entry that could be dereferenced is range-checked in a serial pre-pass, before
// anything is written, with the same messages as the reference. The user-facing limits are validated once
// per call signature (csrc/_entry.cpp); the structural checks below keep direct calls memory-safe.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace {

constexpr int64_t kSmallTopk = 32;
constexpr int64_t kDefaultBlockSize = 64;  // replaces selection_topk_block_size <= 0 (DEFAULT_BLOCK_SIZE)
constexpr int64_t kPrefetchAhead = 8;  // ids ahead whose full-cache rows are prefetched
const char* kOp = "custom::npu_gather_selection_kv_cache: ";

struct Payload {
  char* sel;          // selection base
  const char* full;   // full-cache base
  int64_t tok_bytes;  // bytes per token (D * element size)
};

struct Ctx {
  int64_t B, S, K, bsz, SBS, FBS, n_sel_blocks, n_full_blocks, sbt_cols, fbt_cols;
  const int32_t* topk;
  int32_t* status;
  const int32_t* sbt;
  const int32_t* fbt;
  const int32_t* kv_len;
  int32_t* act;
  Payload pay[2];
  int n_pay;

  // Byte offset of selection position p (unit = one bsz block) of row r, and of full token t of b.
  int64_t sel_tok(int64_t r, int64_t p) const {
    const int64_t tok = p * bsz;
    return static_cast<int64_t>(sbt[r * sbt_cols + tok / SBS]) * SBS + tok % SBS;
  }
  int64_t full_tok(int64_t b, int64_t x) const {
    const int64_t tok = x * bsz;
    return static_cast<int64_t>(fbt[b * fbt_cols + tok / FBS]) * FBS + tok % FBS;
  }
  void copy_from_full(int64_t r, int64_t b, int64_t dst, int64_t x, int64_t len) const {
    const int64_t d = sel_tok(r, dst), s = full_tok(b, x);
    for (int i = 0; i < n_pay; ++i) {
      const Payload& P = pay[i];
      std::memcpy(P.sel + d * P.tok_bytes, P.full + s * P.tok_bytes, len * P.tok_bytes);
    }
  }
  void prefetch_full(int64_t b, int64_t x) const {
    const int64_t s = full_tok(b, x);
    for (int i = 0; i < n_pay; ++i) {
      __builtin_prefetch(pay[i].full + s * pay[i].tok_bytes);
      __builtin_prefetch(pay[i].full + s * pay[i].tok_bytes + 64);
    }
  }
  void copy_within(int64_t r, int64_t dst, int64_t src, int64_t len) const {
    const int64_t d = sel_tok(r, dst), s = sel_tok(r, src);
    for (int i = 0; i < n_pay; ++i) {
      const Payload& P = pay[i];
      std::memmove(P.sel + d * P.tok_bytes, P.sel + s * P.tok_bytes, len * P.tok_bytes);
    }
  }
};

// Row geometry: returns false for an empty row (nothing written, actual_seq 0).
bool row_limits(const Ctx& c, int64_t r, int64_t* b, int64_t* Lr, int64_t* max_sel) {
  *b = r / c.S;
  const int64_t s = r % c.S;
  const int64_t Lb = c.kv_len[*b];
  *Lr = Lb - (c.S - 1 - s);
  if (Lb <= 0 || *Lr <= 0) return false;
  *max_sel = (*Lr + c.bsz - 1) / c.bsz - 1;
  return true;
}

void check_tables(const Ctx& c) {
  const int64_t need_blk = (c.K * c.bsz + c.SBS - 1) / c.SBS;
  for (int64_t r = 0; r < c.B * c.S; ++r) {
    int64_t b, Lr, max_sel;
    if (!row_limits(c, r, &b, &Lr, &max_sel)) continue;
    for (int64_t j = 0; j < need_blk; ++j) {
      const int64_t e = c.sbt[r * c.sbt_cols + j];
      TORCH_CHECK(e >= 0 && e < c.n_sel_blocks, kOp, "selection_kv_block_table[", r,
                  "] has an entry outside [0, ", c.n_sel_blocks, ") in its first ", need_blk, " columns");
    }
    const int32_t* row = c.topk + r * c.K;
    int64_t max_id = -1;
    bool cols_ok = true;
    for (int64_t k = 0; k < c.K; ++k) {
      const int64_t x = row[k];
      if (x < 0 || x > max_sel) continue;
      max_id = std::max(max_id, x);
      if (x * c.bsz / c.FBS >= c.fbt_cols) cols_ok = false;
    }
    TORCH_CHECK(cols_ok, kOp, "full_kv_block_table[", b, "] has ", c.fbt_cols,
                " columns, too few for id ", max_id, " (full_kv_actual_seq[", b, "] = ", c.kv_len[b], ")");
    for (int64_t k = 0; k < c.K; ++k) {
      const int64_t x = row[k];
      if (x < 0 || x > max_sel) continue;
      const int64_t e = c.fbt[b * c.fbt_cols + x * c.bsz / c.FBS];
      TORCH_CHECK(e >= 0 && e < c.n_full_blocks, kOp, "full_kv_block_table[", b,
                  "] has an entry outside [0, ", c.n_full_blocks, ") for a valid id");
    }
  }
}

// Open-addressing map from a non-negative id to the lowest ledger position holding it.
struct FirstPosTable {
  std::vector<int32_t> keys, vals;
  uint32_t mask = 0;
  void reset(int64_t n) {
    uint32_t cap = 16;
    while (cap < 2 * n) cap <<= 1;  // load factor <= 1/2
    keys.assign(cap, -1);
    vals.resize(cap);
    mask = cap - 1;
  }
  static uint32_t hash(int32_t x) { return static_cast<uint32_t>(x) * 2654435761u; }
  void insert_first(int32_t x, int32_t p) {  // callers insert in ascending p: keep the first
    for (uint32_t h = hash(x) & mask;; h = (h + 1) & mask) {
      if (keys[h] == x) return;
      if (keys[h] < 0) {
        keys[h] = x;
        vals[h] = p;
        return;
      }
    }
  }
  int32_t find(int32_t x) const {
    for (uint32_t h = hash(x) & mask;; h = (h + 1) & mask) {
      if (keys[h] == x) return vals[h];
      if (keys[h] < 0) return -1;
    }
  }
};

struct Scratch {
  std::vector<int32_t> ids, old;
  FirstPosTable table;
  std::vector<int32_t> keep, moved_from;
  std::vector<char> kept_j;
  std::vector<char> tmp_a, tmp_b;
};

// Both ledger paths: with w.keep[p] = j (old position p keeps new id j), kept entries at/after
// position n must move below n. Fills w.moved_from[j] (their old position) and w.kept_j[j].
void evict_tail(Scratch& w, int64_t K, int64_t n) {
  int64_t top = -1;
  for (int64_t p = K - 1; p >= 0; --p) {
    if (w.keep[p] >= 0) { top = p; break; }
  }
  w.moved_from.assign(n, -1);
  if (top + 1 - n > 0) {
    for (int64_t p = top; p >= n; --p) {
      if (w.keep[p] >= 0) {
        w.moved_from[w.keep[p]] = static_cast<int32_t>(p);
        w.keep[p] = -1;
      }
    }
  }
  w.kept_j.assign(n, 0);
  for (int64_t p = 0; p < K; ++p) {
    if (w.keep[p] >= 0) w.kept_j[w.keep[p]] = 1;
  }
}

// §1.4: K > 32, bsz == 1 (one id = one token).
void ledger_row_large(const Ctx& c, Scratch& w, int64_t r, int64_t b, int64_t max_sel) {
  const int64_t K = c.K, s = r % c.S;
  const int64_t max_reuse = std::max<int64_t>(max_sel - s - 1, 0);
  const int32_t* row = c.topk + r * K;
  int32_t* st = c.status + r * (K + 1);
  w.ids.clear();
  for (int64_t k = 0; k < K; ++k) {
    const int32_t x = row[k];
    if (x >= 0 && x <= max_sel) w.ids.push_back(x);  // all K scanned; negatives anywhere dropped
  }
  const int64_t n = static_cast<int64_t>(w.ids.size());
  // Only old entries in [0, max_reuse] can be kept: hash them (id -> lowest position), then look
  // every candidate id up.
  w.table.reset(K);
  for (int64_t p = 0; p < K; ++p) {
    if (st[p] >= 0 && st[p] <= max_reuse) w.table.insert_first(st[p], static_cast<int32_t>(p));
  }
  w.keep.assign(K, -1);
  for (int64_t j = 0; j < n; ++j) {
    const int32_t x = w.ids[j];
    if (x > max_reuse) continue;
    const int32_t p = w.table.find(x);
    if (p >= 0) w.keep[p] = static_cast<int32_t>(j);
  }
  evict_tail(w, K, n);
  int64_t cur = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (j + kPrefetchAhead < n) c.prefetch_full(b, w.ids[j + kPrefetchAhead]);  // scattered rows
    if (w.kept_j[j]) continue;
    while (w.keep[cur] >= 0) ++cur;  // next free position; always < n
    const int64_t dst = cur++;
    const int32_t x = w.ids[j];
    if (w.moved_from[j] >= 0) {
      c.copy_within(r, dst, w.moved_from[j], 1);  // source >= n, destination < n: no overlap
    } else {
      c.copy_from_full(r, b, dst, x, 1);
    }
    st[dst] = x;
  }
  for (int64_t p = n; p < K; ++p) st[p] = -1;
  st[K] = static_cast<int32_t>(n);
  c.act[r] = static_cast<int32_t>(n);
}

// §1.5: K <= 32, any bsz.
void ledger_row_small(const Ctx& c, Scratch& w, int64_t r, int64_t b, int64_t Lr, int64_t max_sel) {
  const int64_t K = c.K, bsz = c.bsz;
  const int32_t* row = c.topk + r * K;
  int32_t* st = c.status + r * (K + 1);
  w.ids.clear();
  for (int64_t k = 0; k < K; ++k) {
    const int32_t x = row[k];
    if (x < 0) break;  // scanning stops at the first negative id
    if (x <= max_sel) w.ids.push_back(x);
  }
  const int64_t n = static_cast<int64_t>(w.ids.size());
  const int64_t old_actual = st[K];
  const int64_t eligible = old_actual > 0 ? std::min<int64_t>(old_actual / bsz, K) : 0;
  w.keep.assign(K, -1);
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t p = 0; p < eligible; ++p) {
      if (st[p] == w.ids[j]) {
        w.keep[p] = static_cast<int32_t>(j);
        break;
      }
    }
  }
  evict_tail(w, K, n);
  const int64_t tail_len = Lr - max_sel * bsz;
  auto blen = [&](int64_t x) { return x == max_sel ? tail_len : bsz; };
  int64_t cur = 0, actual = 0;
  for (int64_t j = 0; j < n; ++j) {
    const int32_t x = w.ids[j];
    actual += blen(x);
    if (w.kept_j[j]) continue;
    while (w.keep[cur] >= 0) ++cur;
    const int64_t dst = cur++;
    if (w.moved_from[j] >= 0) {
      c.copy_within(r, dst, w.moved_from[j], blen(x));
    } else {
      c.copy_from_full(r, b, dst, x, blen(x));
    }
    st[dst] = x;
  }
  if (n > 0) {
    const int32_t mx = *std::max_element(w.ids.begin(), w.ids.end());
    if (st[n - 1] != mx) {  // the max (possibly partial) block must end the selection
      int64_t pm = 0;
      while (st[pm] != mx) ++pm;
      const int64_t ln = blen(mx);
      const int64_t a = c.sel_tok(r, pm), z = c.sel_tok(r, n - 1);
      for (int i = 0; i < c.n_pay; ++i) {
        const Payload& P = c.pay[i];
        w.tmp_a.assign(P.sel + a * P.tok_bytes, P.sel + (a + ln) * P.tok_bytes);
        w.tmp_b.assign(P.sel + z * P.tok_bytes, P.sel + (z + bsz) * P.tok_bytes);
        std::memcpy(P.sel + z * P.tok_bytes, w.tmp_a.data(), w.tmp_a.size());
        std::memcpy(P.sel + a * P.tok_bytes, w.tmp_b.data(), w.tmp_b.size());
      }
      std::swap(st[pm], st[n - 1]);
    }
  }
  for (int64_t p = n; p < K; ++p) st[p] = -1;
  st[K] = static_cast<int32_t>(actual);
  c.act[r] = static_cast<int32_t>(actual);
}

void check_index(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kInt, kOp, name, " must be a CPU int32 tensor");
}

// The kernel on dense tensors; B, S, bsz resolved by the caller.
at::Tensor gather_dense(const at::Tensor& sel_rope, const at::Tensor& sel_kv, const at::Tensor& sbt,
                        const at::Tensor& status, const at::Tensor& topk, const at::Tensor& full_rope,
                        const at::Tensor& full_kv, const at::Tensor& fbt, const at::Tensor& kv_len, int64_t B,
                        int64_t S, int64_t bsz) {
  TORCH_CHECK(sel_kv.dim() == 3 && full_kv.dim() == 3 && sel_kv.device().is_cpu() && full_kv.device().is_cpu(),
              kOp, "kv caches must be 3-D CPU tensors");
  const at::ScalarType dt = sel_kv.scalar_type();
  TORCH_CHECK(full_kv.scalar_type() == dt && sel_rope.scalar_type() == dt && full_rope.scalar_type() == dt,
              kOp, "payload dtypes differ");
  const bool no_rope = sel_rope.dim() == 1;
  if (no_rope) {
    TORCH_CHECK(sel_rope.numel() == 0 && full_rope.dim() == 1 && full_rope.numel() == 0, kOp,
                "no-rope mode needs both rope tensors 1-D empty");
  } else {
    TORCH_CHECK(sel_rope.dim() == 3 && full_rope.dim() == 3 && sel_rope.size(0) == sel_kv.size(0) &&
                    sel_rope.size(1) == sel_kv.size(1) && full_rope.size(0) == full_kv.size(0) &&
                    full_rope.size(1) == full_kv.size(1) && full_rope.size(2) == sel_rope.size(2),
                kOp, "rope tensors must be 3-D and match the kv caches");
  }
  TORCH_CHECK(full_kv.size(2) == sel_kv.size(2), kOp, "kv dims differ");
  TORCH_CHECK(B > 0 && S > 0 && bsz > 0, kOp, "B, S and bsz must be positive");
  const int64_t K = topk.size(-1);
  const int64_t R = B * S;
  TORCH_CHECK(topk.dim() >= 1 && K > 0 && topk.numel() == R * K, kOp, "selection_topk_indices must hold B*S*K entries");
  TORCH_CHECK(status.numel() == R * (K + 1), kOp, "selection_kv_block_status must hold B*S*(K+1) entries");
  TORCH_CHECK(K <= kSmallTopk || bsz == 1, kOp, "bsz must be 1 when K > 32");
  TORCH_CHECK(kv_len.dim() == 1 && kv_len.size(0) >= B, kOp, "full_kv_actual_seq must hold B entries");
  TORCH_CHECK(fbt.dim() == 2 && fbt.size(0) >= B, kOp, "full_kv_block_table must have B rows");
  TORCH_CHECK(sbt.dim() == 2 && sbt.size(0) >= R, kOp, "selection_kv_block_table must have B*S rows");
  const int64_t SBS = sel_kv.size(1), FBS = full_kv.size(1);
  TORCH_CHECK(SBS > 0 && FBS > 0 && SBS % bsz == 0 && FBS % bsz == 0, kOp,
              "block sizes must be positive multiples of bsz");
  TORCH_CHECK(sbt.size(1) >= (K * bsz + SBS - 1) / SBS, kOp, "selection_kv_block_table has too few columns");

  at::Tensor act = at::zeros({sbt.size(0)}, sbt.options());
  Ctx c;
  c.B = B; c.S = S; c.K = K; c.bsz = bsz; c.SBS = SBS; c.FBS = FBS;
  c.n_sel_blocks = sel_kv.size(0);
  c.n_full_blocks = full_kv.size(0);
  c.sbt_cols = sbt.size(1);
  c.fbt_cols = fbt.size(1);
  c.topk = topk.data_ptr<int32_t>();
  c.status = status.data_ptr<int32_t>();
  c.sbt = sbt.data_ptr<int32_t>();
  c.fbt = fbt.data_ptr<int32_t>();
  c.kv_len = kv_len.data_ptr<int32_t>();
  c.act = act.data_ptr<int32_t>();
  const int64_t es = static_cast<int64_t>(sel_kv.element_size());
  c.n_pay = 0;
  c.pay[c.n_pay++] = {static_cast<char*>(sel_kv.data_ptr()), static_cast<const char*>(full_kv.data_ptr()),
                      sel_kv.size(2) * es};
  if (!no_rope && sel_rope.size(2) > 0) {  // a zero-width 3-D rope is the no-rope mode too (docs/ops.md §1.2)
    c.pay[c.n_pay++] = {static_cast<char*>(sel_rope.data_ptr()), static_cast<const char*>(full_rope.data_ptr()),
                        sel_rope.size(2) * es};
  }
  check_tables(c);  // before any write

  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    for (int64_t r = begin; r < end; ++r) {
      int64_t b, Lr, max_sel;
      if (!row_limits(c, r, &b, &Lr, &max_sel)) continue;
      if (K > kSmallTopk) {
        ledger_row_large(c, w, r, b, max_sel);
      } else {
        ledger_row_small(c, w, r, b, Lr, max_sel);
      }
    }
  });
  return act;
}

// The op's own arguments (csrc/_entry.cpp runs this as the op's CPU kernel once a call signature passed
// validation, custom_ops/npu_gather_selection_kv_cache.py). B and S come from the top-k (BSND) or the full
// block table (TND), bsz <= 0 means 64, as in validation; full_q_actual_seq is not read (docs/ops.md §1.4).
// Strided arguments go through dense copies; the mutated ones are copied back after the kernel.
at::Tensor gather_cpu(const at::Tensor& sel_rope_arg, const at::Tensor& sel_kv_arg, const at::Tensor& sbt,
                      const at::Tensor& status_arg, const at::Tensor& topk, const at::Tensor& full_rope,
                      const at::Tensor& full_kv, const at::Tensor& fbt, const at::Tensor& kv_len,
                      const at::Tensor& /*full_q_actual_seq*/, int64_t selection_topk_block_size) {
  check_index(sbt, "selection_kv_block_table");
  check_index(status_arg, "selection_kv_block_status");
  check_index(topk, "selection_topk_indices");
  check_index(fbt, "full_kv_block_table");
  check_index(kv_len, "full_kv_actual_seq");
  TORCH_CHECK(topk.dim() == 3 || topk.dim() == 4, kOp, "selection_topk_indices must be 3-D or 4-D");
  TORCH_CHECK(fbt.dim() == 2 && fbt.size(0) > 0, kOp, "full_kv_block_table must be 2-D with rows");
  int64_t B, S;
  if (topk.dim() == 4) {
    B = topk.size(0);
    S = topk.size(1);
  } else {
    B = fbt.size(0);
    TORCH_CHECK(topk.size(0) % B == 0, kOp, "selection_topk_indices.size(0) must be a multiple of B");
    S = topk.size(0) / B;
  }
  const int64_t bsz = selection_topk_block_size > 0 ? selection_topk_block_size : kDefaultBlockSize;
  const at::Tensor sel_rope = sel_rope_arg.contiguous(), sel_kv = sel_kv_arg.contiguous(),
                   status = status_arg.contiguous();
  at::Tensor act = gather_dense(sel_rope, sel_kv, sbt.contiguous(), status, topk.contiguous(),
                                full_rope.contiguous(), full_kv.contiguous(), fbt.contiguous(), kv_len.contiguous(),
                                B, S, bsz);
  if (!sel_rope.is_same(sel_rope_arg)) sel_rope_arg.copy_(sel_rope);
  if (!sel_kv.is_same(sel_kv_arg)) sel_kv_arg.copy_(sel_kv);
  if (!status.is_same(status_arg)) status_arg.copy_(status);
  return act;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(offload_cpu, m) {
  m.def(
      "npu_gather_selection_kv_cache(Tensor(a!) selection_k_rope, Tensor(b!) selection_kv_cache, "
      "Tensor(c!) selection_kv_block_table, Tensor(d!) selection_kv_block_status, "
      "Tensor selection_topk_indices, Tensor full_k_rope, Tensor full_kv_cache, "
      "Tensor full_kv_block_table, Tensor full_kv_actual_seq, Tensor full_q_actual_seq, "
      "int selection_topk_block_size=64) -> Tensor");
}

TORCH_LIBRARY_IMPL(offload_cpu, CPU, m) {
  m.impl("npu_gather_selection_kv_cache", &gather_cpu);
}
