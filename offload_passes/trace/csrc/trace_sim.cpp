// Trace-driven replacement-policy simulator (offload-sim). One IndexShare group at a time.
//
// Input: topk int32 [T, B, S, P] (columns 0..K-1 = the top-k the kernels see, K..P-1 = extra ranks,
// score order), lengths int32 [T, B] (cache length incl. the step's S tokens).
// Output: int64 [T, NCOL] per-step counters, summed over batch rows (column meaning in COLS below).
//
// Classification follows dsa_plan (docs/ops.md §2.4) for suffix-padded rows: per query row, the
// prefix before the first negative; ids > max_sel skipped, max_valid < id <= max_sel = decode window
// (never cached), id <= max_valid = eligible (hit if resident at step start, else miss). Hits are
// decided on the state at step start; then hit updates (entry order), then installs of the misses in
// record order (s, k) with per-row dedupe (first occurrence wins), as dsa_install does.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

enum Col { HIT_E, MISS_E, WIN_E, UHIT, UMISS, WRITES, SCANS, PREFETCH, NCOL };
constexpr int64_t INF = INT64_MAX / 4;

struct Policy {
  int64_t writes = 0, scans = 0;
  virtual ~Policy() = default;
  virtual bool resident(int x) const = 0;
  virtual void hit(int x) = 0;
  virtual void insert(int x) = 0;  // x is not resident
  // rank: the entry's column in its query row (score order when the indexer's top-k is sorted)
  virtual void insert_ranked(int x, int /*rank*/) { insert(x); }
  virtual void begin_step(int64_t /*t*/) {}
};

// ---- set-associative policies (slot = set * W + way; set = x & (NS - 1), as dsa_plan's records)
struct SetAssoc : Policy {
  int PS, W, NS, IR;
  std::vector<int> slot_of, ids;
  SetAssoc(int ps, int w, int ir) : PS(ps), W(w), NS(ps / w), IR(ir), slot_of(ir, -1), ids(ps, -1) {}
  bool resident(int x) const override { return x < IR && slot_of[x] >= 0; }
  void place(int x, int slot) {
    int old = ids[slot];
    if (old >= 0) slot_of[old] = -1;
    ids[slot] = x;
    slot_of[x] = slot;
  }
  int set_of(int x) const { return x & (NS - 1); }
};

struct SaFifo : SetAssoc {  // the reference: round-robin pointer per set, hits never touch metadata
  std::vector<int> ctr;
  SaFifo(int ps, int w, int ir) : SetAssoc(ps, w, ir), ctr(NS, 0) {}
  void hit(int) override {}
  void insert(int x) override {
    int st = set_of(x);
    int way = ctr[st] % W;
    ctr[st] = (ctr[st] + 1) % W;
    scans += 1;
    place(x, st * W + way);
  }
};

struct SaLru : SetAssoc {
  std::vector<int64_t> ts;
  int64_t clock = 0;
  SaLru(int ps, int w, int ir) : SetAssoc(ps, w, ir), ts(ps, -1) {}
  void hit(int x) override { ts[slot_of[x]] = ++clock; writes += 1; }
  void insert(int x) override {
    int base = set_of(x) * W, best = base;
    for (int w = 0; w < W; ++w) {
      scans += 1;
      if (ids[base + w] < 0) { best = base + w; break; }
      if (ts[base + w] < ts[best]) best = base + w;
    }
    place(x, best);
    ts[best] = ++clock;
  }
};

struct SaClock : SetAssoc {  // second-chance FIFO per set: one reference bit per way
  std::vector<int> ctr;
  std::vector<uint8_t> ref;
  SaClock(int ps, int w, int ir) : SetAssoc(ps, w, ir), ctr(NS, 0), ref(ps, 0) {}
  void hit(int x) override {
    int sl = slot_of[x];
    if (!ref[sl]) { ref[sl] = 1; writes += 1; }
  }
  void insert(int x) override {
    int st = set_of(x), base = st * W;
    for (;;) {
      int sl = base + ctr[st];
      scans += 1;
      ctr[st] = (ctr[st] + 1) % W;
      if (ids[sl] >= 0 && ref[sl]) { ref[sl] = 0; continue; }
      place(x, sl);
      ref[sl] = 0;
      return;
    }
  }
};

struct SaRrip : SetAssoc {  // 2-bit RRPV; SRRIP inserts at 2, BRRIP at 3 except every 32nd insert
  std::vector<uint8_t> rrpv;
  bool bimodal;
  int64_t n_ins = 0;
  SaRrip(int ps, int w, int ir, bool bi) : SetAssoc(ps, w, ir), rrpv(ps, 3), bimodal(bi) {}
  void hit(int x) override {
    int sl = slot_of[x];
    if (rrpv[sl]) { rrpv[sl] = 0; writes += 1; }
  }
  void insert(int x) override {
    int base = set_of(x) * W;
    int victim = -1;
    while (victim < 0) {
      for (int w = 0; w < W; ++w) {
        scans += 1;
        if (ids[base + w] < 0 || rrpv[base + w] >= 3) { victim = base + w; break; }
      }
      if (victim < 0)
        for (int w = 0; w < W; ++w) { rrpv[base + w] += 1; writes += 1; }
    }
    place(x, victim);
    rrpv[victim] = (bimodal && (n_ins++ % 32) != 0) ? 3 : 2;
  }
};

// ---- fully associative policies
struct Lru : Policy {  // doubly linked list over ids (head = most recent)
  int cap, IR, size = 0, head = -1, tail = -1;
  std::vector<int> prv, nxt;
  std::vector<uint8_t> in;
  Lru(int ps, int ir) : cap(ps), IR(ir), prv(ir, -1), nxt(ir, -1), in(ir, 0) {}
  bool resident(int x) const override { return x < IR && in[x]; }
  void unlink(int x) {
    if (prv[x] >= 0) nxt[prv[x]] = nxt[x]; else head = nxt[x];
    if (nxt[x] >= 0) prv[nxt[x]] = prv[x]; else tail = prv[x];
  }
  void push_front(int x) {
    prv[x] = -1; nxt[x] = head;
    if (head >= 0) prv[head] = x;
    head = x;
    if (tail < 0) tail = x;
  }
  void hit(int x) override { unlink(x); push_front(x); writes += 1; }
  void insert(int x) override {
    scans += 1;
    if (size == cap) { int v = tail; unlink(v); in[v] = 0; --size; }
    push_front(x); in[x] = 1; ++size;
  }
};

struct Clock : Policy {
  int cap, IR, hand = 0;
  std::vector<int> slot_of, ids;
  std::vector<uint8_t> ref;
  Clock(int ps, int ir) : cap(ps), IR(ir), slot_of(ir, -1), ids(ps, -1), ref(ps, 0) {}
  bool resident(int x) const override { return x < IR && slot_of[x] >= 0; }
  void hit(int x) override {
    int sl = slot_of[x];
    if (!ref[sl]) { ref[sl] = 1; writes += 1; }
  }
  void insert(int x) override {
    for (;;) {
      int sl = hand;
      hand = (hand + 1) % cap;
      scans += 1;
      if (ids[sl] >= 0 && ref[sl]) { ref[sl] = 0; continue; }
      if (ids[sl] >= 0) slot_of[ids[sl]] = -1;
      ids[sl] = x; slot_of[x] = sl; ref[sl] = 0;
      return;
    }
  }
};

struct S3Fifo : Policy {  // small FIFO (10 %) + main FIFO with 2-bit frequency + ghost FIFO of ids
  int cap, IR, scap, mcap;
  std::deque<int> S, M;
  std::deque<std::pair<int, int64_t>> G;
  std::vector<uint8_t> where, freq;  // where: 0 none, 1 small, 2 main
  std::vector<int64_t> gstamp;
  int64_t gseq = 0;
  S3Fifo(int ps, int ir)
      : cap(ps), IR(ir), scap(std::max(1, ps / 10)), mcap(ps - std::max(1, ps / 10)),
        where(ir, 0), freq(ir, 0), gstamp(ir, -1) {}
  bool resident(int x) const override { return x < IR && where[x] != 0; }
  void hit(int x) override {
    if (freq[x] < 3) { freq[x] += 1; writes += 1; }
  }
  void ghost_add(int x) {
    G.emplace_back(x, ++gseq);
    gstamp[x] = gseq;
    while ((int)G.size() > mcap) {
      auto [y, s] = G.front();
      G.pop_front();
      if (gstamp[y] == s) gstamp[y] = -1;
    }
  }
  void evict_main() {
    for (;;) {
      int y = M.front();
      M.pop_front();
      scans += 1;
      if (freq[y] > 0) { freq[y] -= 1; M.push_back(y); continue; }
      where[y] = 0;
      return;
    }
  }
  void evict_small() {
    while (!S.empty()) {
      int y = S.front();
      S.pop_front();
      scans += 1;
      if (freq[y] > 0) {
        if ((int)M.size() >= mcap) evict_main();
        freq[y] = 0; where[y] = 2; M.push_back(y);
      } else {
        where[y] = 0; ghost_add(y);
        return;
      }
    }
  }
  void insert(int x) override {
    if ((int)(S.size() + M.size()) >= cap) {
      if ((int)S.size() >= scap || M.empty()) evict_small(); else evict_main();
    }
    freq[x] = 0;
    if (gstamp[x] >= 0) {
      gstamp[x] = -1;
      if ((int)M.size() >= mcap) evict_main();
      where[x] = 2; M.push_back(x);
    } else {
      where[x] = 1; S.push_back(x);
    }
  }
};


// ---- study candidates (docs/trace-science.md §3): set-associative, per-set state only, except the
// set-dueling ones, which add one counter per pool (PSEL, updated on device: no host sync).

struct GClock : SetAssoc {  // generalised CLOCK: 2-bit counter per way, +1 on hit, sweep decrements
  std::vector<int> ctr;
  std::vector<uint8_t> cnt;
  GClock(int ps, int w, int ir) : SetAssoc(ps, w, ir), ctr(NS, 0), cnt(ps, 0) {}
  void hit(int x) override {
    int sl = slot_of[x];
    if (cnt[sl] < 3) { cnt[sl] += 1; writes += 1; }
  }
  void insert(int x) override {
    int st = set_of(x), base = st * W;
    for (;;) {  // at most 3 * W + 1 probes
      int sl = base + ctr[st];
      scans += 1;
      ctr[st] = (ctr[st] + 1) % W;
      if (ids[sl] >= 0 && cnt[sl]) { cnt[sl] -= 1; writes += 1; continue; }
      place(x, sl);
      cnt[sl] = 0;
      return;
    }
  }
};

// 2-bit RRPV with a single pass over the set: the victim is the first way with the largest RRPV (the
// way a multi-pass search stops at), and every way ages by (3 - that RRPV) at once. Same decisions as
// SaRrip (srrip), W probes per search; writes = RRPV changes (hit resets, aging, insert).
// Variants: set dueling SRRIP / BRRIP (drrip), or the insertion RRPV from the entry's rank (srrip_rank:
// rank < K/8 -> 1, rank < K/2 -> 2, else 3; needs the top-k in score order).
struct SaRrip1 : SetAssoc {
  std::vector<uint8_t> rrpv;
  int mode;      // 0 srrip, 1 drrip, 2 srrip_rank
  int K;
  int64_t n_ins = 0;
  int psel = 512;  // drrip: 10-bit saturating counter, misses in SRRIP leaders up, BRRIP leaders down
  SaRrip1(int ps, int w, int ir, int mode_, int k) : SetAssoc(ps, w, ir), rrpv(ps, 3), mode(mode_), K(k) {}
  void hit(int x) override {
    int sl = slot_of[x];
    if (rrpv[sl]) { rrpv[sl] = 0; writes += 1; }
  }
  int leader(int st) const { return NS >= 64 ? (st % 32 == 0 ? 1 : st % 32 == 1 ? 2 : 0) : (st == 0 ? 1 : st == 1 ? 2 : 0); }
  void place_rrpv(int x, int rank) {
    int st = set_of(x), base = st * W, victim = -1, mx = -1;
    for (int w = 0; w < W; ++w) {
      scans += 1;
      if (ids[base + w] < 0) { victim = base + w; mx = 3; break; }
      if (rrpv[base + w] > mx) { mx = rrpv[base + w]; victim = base + w; }
    }
    if (mx < 3)
      for (int w = 0; w < W; ++w) { rrpv[base + w] += 3 - mx; writes += 1; }
    place(x, victim);
    int ins = 2;
    if (mode == 1) {
      int l = leader(st);
      if (l == 1) psel = std::min(1023, psel + 1);
      if (l == 2) psel = std::max(0, psel - 1);
      if (l == 1 || l == 2) writes += 1;
      bool bimodal = l == 2 || (l == 0 && psel > 512);
      ins = (bimodal && (n_ins++ % 32) != 0) ? 3 : 2;
    } else if (mode == 2) {
      ins = rank < K / 8 ? 1 : rank < K / 2 ? 2 : 3;
    }
    if (rrpv[victim] != ins) writes += 1;
    rrpv[victim] = ins;
  }
  void insert(int x) override { place_rrpv(x, K); }
  void insert_ranked(int x, int rank) override { place_rrpv(x, rank); }
};

// S3-FIFO inside each set: a small FIFO of WS ways and a main region (the rest) swept by a hand that
// gives each way with a non-zero 2-bit frequency another round; a per-set ring of G 8-bit tags of ids
// evicted from the small FIFO (ghost): a missed id whose tag is there enters main directly. Tags alias
// (tag = (id / sets) mod 256), which can only send an id to main by mistake.
struct SaS3Fifo : SetAssoc {
  int WS, G;
  std::vector<uint8_t> freq, small, sseq;  // per way: frequency, in-small flag, small-FIFO order
  std::vector<int> hand, nsmall, gpos;
  std::vector<int> ghost;                  // per set: G tags, -1 = empty
  std::vector<uint8_t> seq;                // per set: next small-FIFO sequence number
  int shift;
  SaS3Fifo(int ps, int w, int ir, int ws, int g)
      : SetAssoc(ps, w, ir), WS(ws), G(g), freq(ps, 0), small(ps, 0), sseq(ps, 0), hand(NS, 0),
        nsmall(NS, 0), gpos(NS, 0), ghost((size_t)NS * g, -1), seq(NS, 0) {
    shift = 0;
    while ((1 << shift) < NS) ++shift;
  }
  int tag(int x) const { return (x >> shift) & 255; }
  void hit(int x) override {
    int sl = slot_of[x];
    if (freq[sl] < 3) { freq[sl] += 1; writes += 1; }
  }
  bool in_ghost(int st, int t) {
    for (int i = 0; i < G; ++i) { scans += 1; if (ghost[(size_t)st * G + i] == t) { ghost[(size_t)st * G + i] = -1; writes += 1; return true; } }
    return false;
  }
  int oldest_small(int st) {  // largest sequence distance from the set's counter; a pass over the set
    int base = st * W, best = -1, bd = 1 << 30;
    scans += W;
    for (int w = 0; w < W; ++w) {
      if (ids[base + w] < 0 || !small[base + w]) continue;
      int d = (uint8_t)(seq[st] - sseq[base + w]);
      if (best < 0 || d > bd || (d == bd && w < best - base)) { bd = d; best = base + w; }
    }
    return best;
  }
  int free_way(int st) {
    int base = st * W;
    for (int w = 0; w < W; ++w) { scans += 1; if (ids[base + w] < 0) return base + w; }
    // evict: from small while it holds WS or more ways (promoting referenced ones), else from main
    for (;;) {
      if (nsmall[st] >= WS || nsmall[st] == W) {
        int y = oldest_small(st);
        if (freq[y] > 0) {  // promote: stays in its way, joins main
          small[y] = 0; freq[y] = 0; nsmall[st] -= 1; writes += 2;
          continue;
        }
        ghost[(size_t)st * G + gpos[st]] = tag(ids[y]);
        gpos[st] = (gpos[st] + 1) % G;
        writes += 1;
        nsmall[st] -= 1; small[y] = 0;
        return y;
      }
      for (;;) {  // main: CLOCK with 2-bit counters over the main ways
        int sl = base + hand[st];
        hand[st] = (hand[st] + 1) % W;
        if (small[sl]) continue;
        scans += 1;
        if (freq[sl] > 0) { freq[sl] -= 1; writes += 1; continue; }
        return sl;
      }
    }
  }
  void insert(int x) override {
    int st = set_of(x);
    bool g = in_ghost(st, tag(x));
    int sl = free_way(st);
    place(x, sl);
    freq[sl] = 0;
    if (g) { small[sl] = 0; }
    else { small[sl] = 1; nsmall[st] += 1; sseq[sl] = seq[st]; seq[st] = (uint8_t)(seq[st] + 1); }
    writes += 1;
  }
};

// LRFU per set (Lee et al., 2001): each way's combined recency-frequency value decays by 2^-lambda per
// step, +1 per reference; the victim is the way with the smallest value. Set dueling picks lambda per
// pool between LAMBDA_A (frequency-like) and LAMBDA_B (recency-like). State per way: the value at the
// last reference and that step.
struct SaLrfu : SetAssoc {
  std::vector<double> crf;
  std::vector<int64_t> last;
  int64_t now = 0;
  int psel = 512;
  double la, lb;
  SaLrfu(int ps, int w, int ir, double a, double b)
      : SetAssoc(ps, w, ir), crf(ps, 0.0), last(ps, 0), la(a), lb(b) {}
  void begin_step(int64_t t) override { now = t; }
  int leader(int st) const { return NS >= 64 ? (st % 32 == 0 ? 1 : st % 32 == 1 ? 2 : 0) : (st == 0 ? 1 : st == 1 ? 2 : 0); }
  double lam(int st) const {
    int l = leader(st);
    return l == 1 ? la : l == 2 ? lb : (psel > 512 ? lb : la);
  }
  double value(int sl, double lm) const { return crf[sl] * std::exp2(-lm * (double)(now - last[sl])); }
  void hit(int x) override {
    int sl = slot_of[x];
    crf[sl] = value(sl, lam(set_of(x))) + 1.0; last[sl] = now;
    writes += 1;
  }
  void insert(int x) override {
    int st = set_of(x), base = st * W, victim = -1;
    double lm = lam(st), best = 0;
    for (int w = 0; w < W; ++w) {
      scans += 1;
      if (ids[base + w] < 0) { victim = base + w; break; }
      double v = value(base + w, lm);
      if (victim < 0 || v < best) { best = v; victim = base + w; }
    }
    int l = leader(st);
    if (l == 1) psel = std::min(1023, psel + 1);
    if (l == 2) psel = std::max(0, psel - 1);
    if (l) writes += 1;
    place(x, victim);
    crf[victim] = 1.0; last[victim] = now;
    writes += 1;
  }
};

std::unique_ptr<Policy> make_policy(const std::string& name, int PS, int W, int IR, int K) {
  if (name == "sa_fifo") return std::make_unique<SaFifo>(PS, W, IR);
  if (name == "sa_lru") return std::make_unique<SaLru>(PS, W, IR);
  if (name == "sa_clock") return std::make_unique<SaClock>(PS, W, IR);
  if (name == "srrip") return std::make_unique<SaRrip>(PS, W, IR, false);
  if (name == "brrip") return std::make_unique<SaRrip>(PS, W, IR, true);
  if (name == "lru") return std::make_unique<Lru>(PS, IR);
  if (name == "clock") return std::make_unique<Clock>(PS, IR);
  if (name == "s3fifo") return std::make_unique<S3Fifo>(PS, IR);
  if (name == "gclock") return std::make_unique<GClock>(PS, W, IR);
  if (name == "srrip_1p") return std::make_unique<SaRrip1>(PS, W, IR, 0, K);
  if (name == "drrip") return std::make_unique<SaRrip1>(PS, W, IR, 1, K);
  if (name == "srrip_rank") return std::make_unique<SaRrip1>(PS, W, IR, 2, K);
  if (name == "sa_s3fifo") return std::make_unique<SaS3Fifo>(PS, W, IR, std::max(1, W / 8), std::max(1, W / 2));
  if (name == "sa_lrfu") return std::make_unique<SaLrfu>(PS, W, IR, 0.01, 0.5);
  throw std::invalid_argument("offload-sim: unknown policy '" + name + "'");
}

struct Step {  // one batch row, one step
  std::vector<int> ent;    // eligible ids, entry order (s, k)
  std::vector<int> col;    // each entry's column k (its rank when the top-k is in score order)
  std::vector<int> uniq;   // distinct eligible ids, first-occurrence order
  std::vector<int> extra;  // ranks K..P-1 (eligible ids, score order) of all query rows, for rank policies
  int64_t window = 0;
};

struct Trace {
  const int32_t* topk;
  const int32_t* len;
  int T, B, S, P, K, IR;
  std::vector<int64_t> mark;  // per id: last step+1 it was seen (dedupe)
  void collect(int t, int b, Step& st, bool want_extra) {
    st.ent.clear(); st.col.clear(); st.uniq.clear(); st.extra.clear(); st.window = 0;
    int64_t L = len[(int64_t)t * B + b];
    int64_t mv = std::max<int64_t>(L - S - 1, 0);
    int64_t stamp = (int64_t)t * 2 + 1;
    for (int s = 0; s < S; ++s) {
      int64_t ms = L - (S - 1 - s) - 1;
      const int32_t* row = topk + (((int64_t)t * B + b) * S + s) * P;
      if (L <= 0 || ms < 0) continue;
      for (int k = 0; k < K; ++k) {
        int x = row[k];
        if (x < 0) break;
        if (x > ms) continue;
        if (x > mv) { st.window += 1; continue; }
        st.ent.push_back(x);
        st.col.push_back(k);
        if (x < IR && mark[x] != stamp) { mark[x] = stamp; st.uniq.push_back(x); }
        else if (x >= IR) st.uniq.push_back(x);  // never resident; counted per entry
      }
    }
    if (want_extra) {
      int64_t stamp2 = stamp + 1;
      for (int s = 0; s < S; ++s) {
        int64_t ms = L - (S - 1 - s) - 1;
        const int32_t* row = topk + (((int64_t)t * B + b) * S + s) * P;
        if (L <= 0 || ms < 0) continue;
        for (int k = K; k < P; ++k) {
          int x = row[k];
          if (x < 0) break;
          if (x > mv || x >= IR) continue;
          if (mark[x] != stamp && mark[x] != stamp2) { mark[x] = stamp2; st.extra.push_back(x); }
        }
      }
    }
  }
};

void run_online(Trace& tr, const std::string& name, int PS, int W, int64_t* out) {
  Step st;
  std::vector<uint8_t> hitflag;
  std::vector<int64_t> seen(tr.IR, -1);
  for (int b = 0; b < tr.B; ++b) {
    auto pol = make_policy(name, PS, W, tr.IR, tr.K);
    std::fill(tr.mark.begin(), tr.mark.end(), -1);
    for (int t = 0; t < tr.T; ++t) {
      tr.collect(t, b, st, false);
      int64_t* o = out + (int64_t)t * NCOL;
      int64_t w0 = pol->writes, s0 = pol->scans;
      pol->begin_step(t);
      hitflag.resize(st.ent.size());
      for (size_t i = 0; i < st.ent.size(); ++i) hitflag[i] = pol->resident(st.ent[i]);
      for (int x : st.uniq) (pol->resident(x) ? o[UHIT] : o[UMISS]) += 1;
      for (size_t i = 0; i < st.ent.size(); ++i) {
        if (hitflag[i]) { o[HIT_E] += 1; pol->hit(st.ent[i]); } else { o[MISS_E] += 1; }
      }
      const int64_t stamp = (int64_t)t * tr.B + b;
      for (size_t i = 0; i < st.ent.size(); ++i) {
        int x = st.ent[i];
        if (hitflag[i] || x >= tr.IR || seen[x] == stamp) continue;
        seen[x] = stamp;
        if (!pol->resident(x)) pol->insert_ranked(x, st.col[i]);
      }
      o[WIN_E] += st.window;
      o[WRITES] += pol->writes - w0;
      o[SCANS] += pol->scans - s0;
    }
    std::fill(seen.begin(), seen.end(), -1);
  }
}

// Basic gather's selection buffer (docs/ops.md §1.4, bsz = 1): each query row keeps last step's ids.
void run_adjacent(Trace& tr, int64_t* out) {
  std::vector<std::vector<int64_t>> prev(tr.S, std::vector<int64_t>(tr.IR, -2));
  std::vector<int64_t> uniq_mark(tr.IR, -1);
  for (int b = 0; b < tr.B; ++b) {
    for (auto& p : prev) std::fill(p.begin(), p.end(), -2);
    std::fill(uniq_mark.begin(), uniq_mark.end(), -1);
    for (int t = 0; t < tr.T; ++t) {
      int64_t* o = out + (int64_t)t * NCOL;
      int64_t L = tr.len[(int64_t)t * tr.B + b];
      int64_t mv = std::max<int64_t>(L - tr.S - 1, 0);
      for (int s = 0; s < tr.S; ++s) {
        int64_t ms = L - (tr.S - 1 - s) - 1;
        const int32_t* row = tr.topk + (((int64_t)t * tr.B + b) * tr.S + s) * tr.P;
        if (L <= 0 || ms < 0) continue;
        for (int k = 0; k < tr.K; ++k) {
          int x = row[k];
          if (x < 0) break;
          if (x > ms || x >= tr.IR) continue;
          bool hit = x <= mv && prev[s][x] == t - 1;
          if (x > mv) o[WIN_E] += 1; else (hit ? o[HIT_E] : o[MISS_E]) += 1;
          if (x <= mv && uniq_mark[x] != t) { uniq_mark[x] = t; (hit ? o[UHIT] : o[UMISS]) += 1; }
          prev[s][x] = t;
          if (hit) o[WRITES] += 0;  // the ledger is rewritten every step regardless (K writes per row)
        }
      }
      o[WRITES] += (int64_t)tr.S * tr.K;
    }
  }
}

// Lazy binary heap of (key, id): stale entries (key[id] != entry key) are skipped when they surface;
// rebuilt from the live keys when it grows past 4x the pool. Max-heap when MaxTop, else min-heap.
template <bool MaxTop>
struct LazyHeap {
  std::vector<std::pair<int64_t, int>> h;
  static bool less(const std::pair<int64_t, int>& a, const std::pair<int64_t, int>& b) {
    return MaxTop ? a < b : b < a;
  }
  void push(int64_t k, int x) { h.emplace_back(k, x); std::push_heap(h.begin(), h.end(), less); }
  // top live entry (pops stale ones); h must contain one
  std::pair<int64_t, int> top(const std::vector<int64_t>& key) {
    while (key[h.front().second] != h.front().first) { std::pop_heap(h.begin(), h.end(), less); h.pop_back(); }
    return h.front();
  }
  void pop() { std::pop_heap(h.begin(), h.end(), less); h.pop_back(); }
  void maybe_rebuild(const std::vector<int64_t>& key, int cap) {
    if ((int64_t)h.size() <= 4 * (int64_t)cap + 4096) return;
    h.clear();
    for (int x = 0; x < (int)key.size(); ++x) if (key[x] >= 0) h.emplace_back(key[x], x);
    std::make_heap(h.begin(), h.end(), less);
  }
};

// Belady's MIN with bypass over distinct ids, run independently in each of NS = PS / W sets
// (set = id & (NS - 1), as dsa_plan's records; NS = 1 is the fully associative MIN, ``belady``): after
// each step keep, per set, the W candidates (the set's old contents plus this step's eligible ids of
// the set) whose next use is soonest. Optimal for the distinct-id hit count of that geometry: ids of a
// step are demanded together, so ties in next use cannot change the count (either id hits at that
// step and both are candidates again after it).
void run_min(Trace& tr, int PS, int W, int64_t* out) {
  const int NS = PS / W;
  Step st;
  std::vector<int64_t> key(tr.IR, -1);  // next use of a resident id, -1 = absent
  std::vector<int64_t> nxt(tr.IR, INF);
  std::vector<int> touched;
  std::vector<uint8_t> is_touched(NS, 0);
  for (int b = 0; b < tr.B; ++b) {
    std::fill(tr.mark.begin(), tr.mark.end(), -1);
    std::vector<std::vector<int>> U(tr.T);
    std::vector<std::vector<int>> E(tr.T);
    std::vector<int64_t> win(tr.T);
    for (int t = 0; t < tr.T; ++t) {
      tr.collect(t, b, st, false);
      U[t] = st.uniq; E[t] = st.ent; win[t] = st.window;
    }
    std::vector<std::vector<int64_t>> nextuse(tr.T);
    std::fill(nxt.begin(), nxt.end(), INF);
    for (int t = tr.T - 1; t >= 0; --t) {
      nextuse[t].resize(U[t].size());
      for (size_t i = 0; i < U[t].size(); ++i) {
        int x = U[t][i];
        if (x >= tr.IR) { nextuse[t][i] = INF; continue; }
        nextuse[t][i] = nxt[x];
        nxt[x] = t;
      }
    }
    std::fill(key.begin(), key.end(), -1);
    std::vector<LazyHeap<true>> heap(NS);
    std::vector<int> n(NS, 0);
    for (int t = 0; t < tr.T; ++t) {
      int64_t* o = out + (int64_t)t * NCOL;
      for (int x : E[t]) ((x < tr.IR && key[x] >= 0) ? o[HIT_E] : o[MISS_E]) += 1;
      o[WIN_E] += win[t];
      for (size_t i = 0; i < U[t].size(); ++i) {
        int x = U[t][i];
        bool hit = x < tr.IR && key[x] >= 0;
        (hit ? o[UHIT] : o[UMISS]) += 1;
        if (x >= tr.IR) continue;
        int s = x & (NS - 1);
        if (hit) { key[x] = -1; --n[s]; }
        if (nextuse[t][i] < INF) {
          key[x] = nextuse[t][i]; ++n[s]; heap[s].push(key[x], x);
          if (!is_touched[s]) { is_touched[s] = 1; touched.push_back(s); }
        }
      }
      for (int s : touched) {
        while (n[s] > W) {
          auto [k, x] = heap[s].top(key);
          heap[s].pop();
          key[x] = -1; --n[s];
        }
        if ((int64_t)heap[s].h.size() > 4 * (int64_t)W + 4096) {  // drop stale entries: the set's ids only
          heap[s].h.clear();
          for (int x = s; x < tr.IR; x += NS) if (key[x] >= 0) heap[s].h.emplace_back(key[x], x);
          std::make_heap(heap[s].h.begin(), heap[s].h.end(), LazyHeap<true>::less);
        }
        is_touched[s] = 0;
      }
      touched.clear();
    }
  }
}

// Score-informed pools from the indexer's top-P ranks (columns K..P-1 of the trace).
//   rank_keep: on a miss evict the resident id whose latest top-P appearance is oldest (ties: worst
//              rank); ids in this step's top-P are refreshed. No prefetch.
//   rank_prefetch: like rank_keep, and in addition ids of ranks K..P-1 that are not resident are
//              installed (prefetched from host; counted in PREFETCH) in score order while they fit
//              without evicting anything ranked better.
void run_rank(Trace& tr, int PS, bool prefetch, int64_t* out) {
  Step st;
  std::vector<int64_t> key(tr.IR, -1);
  std::vector<int64_t> seen(tr.IR, -1);
  std::vector<uint8_t> hitflag;
  for (int b = 0; b < tr.B; ++b) {
    std::fill(tr.mark.begin(), tr.mark.end(), -1);
    std::fill(key.begin(), key.end(), -1);
    LazyHeap<false> heap;  // smallest key evicted first
    int n = 0;
    for (int t = 0; t < tr.T; ++t) {
      tr.collect(t, b, st, true);
      int64_t* o = out + (int64_t)t * NCOL;
      hitflag.resize(st.ent.size());
      for (size_t i = 0; i < st.ent.size(); ++i) hitflag[i] = st.ent[i] < tr.IR && key[st.ent[i]] >= 0;
      for (int x : st.uniq) ((x < tr.IR && key[x] >= 0) ? o[UHIT] : o[UMISS]) += 1;
      for (size_t i = 0; i < st.ent.size(); ++i) (hitflag[i] ? o[HIT_E] : o[MISS_E]) += 1;
      o[WIN_E] += st.window;
      // key = (step + 1) * 2^20 + (2^20 - 1 - rank position): newer appearances win, better rank wins
      const int64_t base = (int64_t)(t + 1) << 20;
      int64_t pos = 0;
      const int64_t stamp = (int64_t)t * tr.B + b;
      auto rank_key = [&]() { return base + ((1 << 20) - 1 - std::min<int64_t>(pos++, (1 << 20) - 1)); };
      auto touch = [&](int x, int64_t k) { key[x] = k; heap.push(k, x); };
      for (int x : st.ent) {
        if (x >= tr.IR) { ++pos; continue; }
        if (seen[x] == stamp) continue;
        seen[x] = stamp;
        int64_t k = rank_key();
        if (key[x] >= 0) { touch(x, k); o[WRITES] += 1; continue; }
        if (n >= PS) { auto [vk, v] = heap.top(key); heap.pop(); key[v] = -1; --n; }
        o[SCANS] += 1;
        touch(x, k); ++n;
      }
      for (int x : st.extra) {
        int64_t k = rank_key();
        if (key[x] >= 0) { touch(x, k); o[WRITES] += 1; continue; }
        if (!prefetch) continue;
        if (n >= PS) {
          auto [vk, v] = heap.top(key);
          if (vk >= k) continue;  // never evict something ranked better
          heap.pop(); key[v] = -1; --n;
        }
        o[SCANS] += 1; o[PREFETCH] += 1;
        touch(x, k); ++n;
      }
      heap.maybe_rebuild(key, PS);
    }
    std::fill(seen.begin(), seen.end(), -1);
  }
}

}  // namespace

torch::Tensor simulate(torch::Tensor topk, torch::Tensor lengths, int64_t K, std::string policy,
                       int64_t pool_size, int64_t ways, int64_t id_range) {
  TORCH_CHECK(topk.dtype() == torch::kInt32 && topk.dim() == 4 && topk.is_contiguous(),
              "offload-sim: topk must be contiguous int32 [T, B, S, P]");
  TORCH_CHECK(lengths.dtype() == torch::kInt32 && lengths.dim() == 2 && lengths.is_contiguous(),
              "offload-sim: lengths must be contiguous int32 [T, B]");
  Trace tr;
  tr.T = topk.size(0); tr.B = topk.size(1); tr.S = topk.size(2); tr.P = topk.size(3);
  TORCH_CHECK(lengths.size(0) == tr.T && lengths.size(1) == tr.B, "offload-sim: lengths must be [T, B]");
  TORCH_CHECK(K > 0 && K <= tr.P, "offload-sim: K must be in (0, P=", tr.P, "], got ", K);
  TORCH_CHECK(id_range > 0, "offload-sim: id_range must be > 0");
  TORCH_CHECK(pool_size > 0, "offload-sim: pool_size must be > 0, got ", pool_size);
  tr.K = K; tr.IR = id_range;
  tr.topk = topk.data_ptr<int32_t>();
  tr.len = lengths.data_ptr<int32_t>();
  tr.mark.assign(tr.IR, -1);
  auto out = torch::zeros({tr.T, NCOL}, torch::kInt64);
  int64_t* o = out.data_ptr<int64_t>();
  if (policy == "adjacent") run_adjacent(tr, o);
  else if (policy == "belady") run_min(tr, pool_size, pool_size, o);
  else if (policy == "min_per_set") {
    TORCH_CHECK(ways > 0 && pool_size % ways == 0, "offload-sim: pool_size must be a multiple of ways=", ways);
    int64_t ns = pool_size / ways;
    TORCH_CHECK((ns & (ns - 1)) == 0, "offload-sim: pool_size / ways must be a power of two, got ", ns);
    run_min(tr, pool_size, ways, o);
  }
  else if (policy == "rank_keep") run_rank(tr, pool_size, false, o);
  else if (policy == "rank_prefetch") run_rank(tr, pool_size, true, o);
  else {
    bool sa = policy.rfind("sa_", 0) == 0 || policy.find("rrip") != std::string::npos || policy == "gclock";
    if (sa) {
      TORCH_CHECK(ways > 0 && pool_size % ways == 0, "offload-sim: pool_size must be a multiple of ways=", ways);
      int64_t ns = pool_size / ways;
      TORCH_CHECK((ns & (ns - 1)) == 0, "offload-sim: pool_size / ways must be a power of two, got ", ns);
    }
    try {
      run_online(tr, policy, pool_size, ways, o);
    } catch (const std::invalid_argument& e) {
      TORCH_CHECK(false, e.what());
    }
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("simulate", &simulate, "replay one group's trace through a policy; per-step counters [T, 8]");
}
