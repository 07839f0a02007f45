// AFT-full, forward and backward: for q, k, v (B, T, D) and biases w (T, T) shared by channels,
//
//   y_t = sigma(q_t) A_t,  A_t = sum_t' exp(k_t' + w_{t,t'}) v_t' / sum_t' exp(k_t' + w_{t,t'})
//
// over the keys t' query t sees (causal: t' <= t; padded keys never). Two matrix products
// on BLAS (at::mm), everything around them fused in at::parallel_for loops over channels.
//
// Factorised path. Ew_{t,t'} = exp(w_{t,t'} - mw_t), mw_t the max of the biases t sees (Ew = 0
// where t' is unseen), and X = [Ek v sc | Ek] (T, B, 2D), Ek_t' = exp(k_t' - mk), give
// [num | den] = Ew @ X and A = num / den / sc (sc = 2^-e, 2^e >= T + 1, value_scale: num never
// overflows). Causal: query blocks [i0, i1) of S rows are multiplied with the keys [0, i1)
// only (Ew's triangle above the diagonal is 0 there). The key shift mk of block i depends on
// the keys [0, i0] only, which every query of the block sees: it is their running max, kept
// while it stays within SLACK of it (so X is recomputed only when a key shift moves, an
// *epoch*). Keys [0, i0) then have Ek <= e^SLACK; the block's own keys [i0, i1) may exceed mk:
// one with Ek > e^SAFE or |Ek v sc| beyond the largest float is *unsafe*: zeroed in X (so the
// queries before it multiply a finite 0 by their Ew = 0), and every row of its batch from it
// on takes the exact path. Non-causal: one block, mk the max of all keys (Ek <= 1).
//
// Exact path. The factorised shift mw_t + mk can exceed the true max_t' (k_t' + w_{t,t'}) by
// any amount when the two maximisers differ (keys and biases of 1e4), and den then underflows
// or loses its precision. A row (b, t) with den < sqrt(tiny) in a channel (or a non-finite num,
// or after an unsafe key) is recomputed here, in the compute dtype, with its own per-(t, c)
// max over the keys it sees; scores are formed in halves (k/2 + w/2) so they never overflow.
//
// Non-finite inputs: a key that is NaN or +inf, or a value that is NaN or +-inf, *poisons*
// its channel: every output that sees it is NaN (pz: its first position per (b, c)), and it
// is kept out of the shifts and of X (0). NaN or +inf biases make their row NaN by the
// product itself. So an output depends only on what it sees: changing any input at p leaves
// every output before p bit-identical.
//
// Backward (R = dA / den, S = dA A / den, dA = g sigma(q); rows without upstream gradient and
// exact-path rows give exactly 0 here):
//   Y = Ew^T @ [R / sc | -S],  dv = Ek * Y_1 * sc,  dk = Xv * Y_1 + Ek * Y_2,
//   dw = Ew * ([R / sc | -S] @ X^T)   (seen pairs only; the rest exactly 0),
// causal per query block (Y accumulated with beta = 1 and applied with the epoch's X; an
// epoch or block that no gradient reaches is skipped, channel by channel). The exact rows
// add dv_t' += P dA, dk_t' += P dA (v_t' - A), dw += sum_c P dA (v_t' - A) per key chunk
// (deterministic, no atomics).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace aftlab {
namespace {

constexpr double SLACK = 20.0;  // a causal key shift is kept while the running max is within
constexpr double SAFE = 44.0;   // largest exponent k - mk of a causal diagonal key

template <typename T>
inline T big() {
  return std::numeric_limits<T>::max();
}
template <typename T>
inline T inf() {
  return std::numeric_limits<T>::infinity();
}
// max that keeps a NaN once it has seen one
template <typename T>
inline T nanmax(T m, T x) {
  return (x > m || x != x) ? x : m;
}

template <typename T>
struct Problem {
  const T *q, *k, *v, *w;
  const bool* mask;
  int64_t B, Tn, D, ldw, S, nblk;
  bool causal;
  int64_t N() const { return 2 * B * D; }
  bool valid(int64_t b, int64_t t) const { return mask == nullptr || mask[b * Tn + t]; }
  int64_t i0(int64_t i) const { return i * S; }
  int64_t i1(int64_t i) const { return std::min(Tn, (i + 1) * S); }
  int64_t seen_end(int64_t t) const { return causal ? t + 1 : Tn; }
  // an input at (b, c) first poisoned at pz poisons the output at t
  bool poisoned(int64_t pz, int64_t t) const { return causal ? pz <= t : pz < Tn; }
};

// pz (B, D): first valid position with a NaN/+inf key or a non-finite value (Tn if none);
// sh (nblk, B, D): the key shift of each query block (see the header).
template <typename T>
void prepass(const Problem<T>& P, int64_t* pz, T* sh) {
  const int64_t D = P.D, Tn = P.Tn, B = P.B;
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<T> rmv(D), spv(D);
    std::vector<int32_t> zv(D), unsetv(D);
    T* __restrict__ rm = rmv.data();
    T* __restrict__ sp = spv.data();
    int32_t* __restrict__ z = zv.data();
    int32_t* __restrict__ unset = unsetv.data();
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t c = 0; c < D; ++c) {
        rm[c] = -inf<T>();
        sp[c] = T(0);
        unset[c] = 1;
        z[c] = int32_t(Tn);
      }
      int64_t blk = 0;
      for (int64_t t = 0; t < Tn; ++t) {
        if (P.valid(b, t)) {
          const T* __restrict__ kr = P.k + (b * Tn + t) * D;
          const T* __restrict__ vr = P.v + (b * Tn + t) * D;
          const int32_t tt = int32_t(t), none = int32_t(Tn);
          #pragma omp simd
          for (int64_t c = 0; c < D; ++c) {
            const bool kok = kr[c] < inf<T>();  // not NaN, not +inf
            const bool bad = !kok || !(std::abs(vr[c]) < inf<T>());
            z[c] = std::min(z[c], bad ? tt : none);
            rm[c] = (kok && kr[c] > rm[c]) ? kr[c] : rm[c];
          }
        }
        if (P.causal && t == blk * P.S) {  // the shift of block blk: keys [0, i0]
          T* __restrict__ s = sh + (blk * B + b) * D;
          #pragma omp simd
          for (int64_t c = 0; c < D; ++c) {
            const T r = rm[c];
            const bool none = r == -inf<T>();
            const T m = none ? T(0) : (unset[c] || r > sp[c] + T(SLACK)) ? r : sp[c];
            sp[c] = m;
            unset[c] = none;
            s[c] = m;
          }
          ++blk;
        }
      }
      for (int64_t c = 0; c < D; ++c) pz[b * D + c] = z[c];
      if (!P.causal)
        for (int64_t c = 0; c < D; ++c) sh[b * D + c] = rm[c] == -inf<T>() ? T(0) : rm[c];
    }
  });
}

// Ew (T, T): exp(w - mw_t) over the keys t sees, 0 for the unseen keys of t's block.
template <typename T>
void bias_factors(const Problem<T>& P, T* Ew) {
  const int64_t Tn = P.Tn;
  at::parallel_for(0, Tn, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* wr = P.w + t * P.ldw;
      T* er = Ew + t * Tn;
      const int64_t n = P.seen_end(t);
      T m = -inf<T>();
      for (int64_t j = 0; j < n; ++j) m = nanmax(m, wr[j]);
      const T mf = m == -inf<T>() ? T(0) : m;
      #pragma omp simd
      for (int64_t j = 0; j < n; ++j) er[j] = exp_nonpos(wr[j] - mf);
      if (P.causal) {
        const int64_t e1 = P.i1(t / P.S);
        for (int64_t j = n; j < e1; ++j) er[j] = T(0);
      }
    }
  });
}

// X rows [r0, r1) (of the batches flagged in `which`, all if null) with the shifts sh (B, D):
// [Ek v sc | Ek], 0 at padded, poisoned and unsafe keys; unsafe keys flagged in uns (B, T).
template <typename T>
void key_factors(const Problem<T>& P, int64_t r0, int64_t r1, const char* which, const T* sh,
                 T sc, T* X, char* uns) {
  const int64_t B = P.B, D = P.D, Tn = P.Tn;
  at::parallel_for(r0, r1, 16, [&](int64_t a, int64_t z) {
    for (int64_t t = a; t < z; ++t)
      for (int64_t b = 0; b < B; ++b) {
        if (which != nullptr && !which[b]) continue;
        T* xr = X + (t * B + b) * 2 * D;
        if (!P.valid(b, t)) {
          std::fill(xr, xr + 2 * D, T(0));
          if (uns != nullptr) uns[b * Tn + t] = 0;
          continue;
        }
        const T *kr = P.k + (b * Tn + t) * D, *vr = P.v + (b * Tn + t) * D, *s = sh + b * D;
        int any = 0;
        #pragma omp simd reduction(+ : any)
        for (int64_t c = 0; c < D; ++c) {
          const T d = kr[c] - s[c];
          const T e = exp_nonpos(std::min(d, T(SAFE)));  // <= e^44: exp_nonpos is exact there
          const T xv = e * (vr[c] * sc);
          const bool ok = d <= T(SAFE) && std::abs(xv) <= big<T>();
          const bool good = kr[c] < inf<T>() && std::abs(vr[c]) < inf<T>();
          const bool keep = good && ok;
          xr[c] = keep ? xv : T(0);
          xr[D + c] = keep ? e : T(0);
          any += (good && !ok) ? 1 : 0;
        }
        if (uns != nullptr) uns[b * Tn + t] = any > 0;
      }
  });
}

// which[b]: the shift of block i differs from block i - 1's in a channel of batch b.
template <typename T>
bool shifts_moved(const Problem<T>& P, const T* sh, int64_t i, char* which) {
  bool any = false;
  for (int64_t b = 0; b < P.B; ++b) {
    const T* now = sh + (i * P.B + b) * P.D;
    which[b] = i > 0 && std::memcmp(now, now - P.B * P.D, P.D * sizeof(T)) != 0;
    any = any || which[b];
  }
  return any;
}

// Brings X to block i's shifts: rows [0, i0) of the batches whose shift moved, rows [i0, i1).
template <typename T>
void advance_keys(const Problem<T>& P, int64_t i, const T* sh, T sc, T* X, char* uns,
                  std::vector<char>& which) {
  const T* shi = sh + i * P.B * P.D;
  if (shifts_moved(P, sh, i, which.data()))
    key_factors(P, 0, P.i0(i), which.data(), shi, sc, X, nullptr);
  key_factors(P, P.i0(i), P.i1(i), nullptr, shi, sc, X, uns);
}

inline at::Tensor rows_of(const at::Tensor& m, int64_t r0, int64_t r1) {
  return m.narrow(0, r0, r1 - r0);
}

// ------------------------------------------------------------------ exact path
// Per row (b, t) and channel: m2 = max over the keys t sees of k/2 + w/2 (halves: no overflow),
// floored to 0 when nothing is seen; den = sum exp(2 (s2 - m2)).
template <typename T>
void exact_row_stats(const Problem<T>& P, int64_t b, int64_t t, T* m2, T* den, T* num, T sc) {
  const int64_t D = P.D, Tn = P.Tn, end = P.seen_end(t);
  const T* wr = P.w + t * P.ldw;
  for (int64_t c = 0; c < D; ++c) m2[c] = -inf<T>();
  for (int64_t j = 0; j < end; ++j) {
    if (!P.valid(b, j)) continue;
    const T hw = wr[j] * T(0.5);
    const T* kr = P.k + (b * Tn + j) * D;
    for (int64_t c = 0; c < D; ++c) m2[c] = nanmax(m2[c], kr[c] * T(0.5) + hw);
  }
  for (int64_t c = 0; c < D; ++c) {
    m2[c] = m2[c] == -inf<T>() ? T(0) : m2[c];
    den[c] = T(0);
    if (num != nullptr) num[c] = T(0);
  }
  for (int64_t j = 0; j < end; ++j) {
    if (!P.valid(b, j)) continue;
    const T hw = wr[j] * T(0.5);
    const T *kr = P.k + (b * Tn + j) * D, *vr = P.v + (b * Tn + j) * D;
    #pragma omp simd
    for (int64_t c = 0; c < D; ++c) {
      const T e = exp_nonpos(T(2) * ((kr[c] * T(0.5) + hw) - m2[c]));
      den[c] += e;
      if (num != nullptr) num[c] += e * (vr[c] * sc);
    }
  }
}

template <typename T>
void exact_forward(const Problem<T>& P, const std::vector<int64_t>& rows, const int64_t* pz,
                   T sc, T* Y, T* A) {
  const int64_t D = P.D, Tn = P.Tn;
  const T unsc = T(1) / sc, nan = std::numeric_limits<T>::quiet_NaN();
  at::parallel_for(0, (int64_t)rows.size(), 1, [&](int64_t r0, int64_t r1) {
    std::vector<T> m2(D), den(D), num(D);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = rows[r] / Tn, t = rows[r] % Tn, o = (b * Tn + t) * D;
      exact_row_stats(P, b, t, m2.data(), den.data(), num.data(), sc);
      for (int64_t c = 0; c < D; ++c) {
        T a = den[c] == T(0) ? T(0) : clamp_abs(num[c] / den[c] * unsc, big<T>());
        a = P.poisoned(pz[b * D + c], t) ? nan : a;
        Y[o + c] = sigmoid(P.q[o + c]) * a;
        if (A != nullptr) A[o + c] = a;
      }
    }
  });
}

// ------------------------------------------------------------------ forward
template <typename T>
void full_fwd(const Problem<T>& P, const int64_t* pz, const T* sh, T* Y, T* A, T* INV, bool* FB,
              at::Tensor& Ew, at::Tensor& X, at::Tensor& out) {
  const int64_t B = P.B, D = P.D, Tn = P.Tn;
  const T sc = value_scale<T>(Tn), unsc = T(1) / sc;
  const T tau = std::sqrt(std::numeric_limits<T>::min()), nan = std::numeric_limits<T>::quiet_NaN();
  T *ew = Ew.data_ptr<T>(), *x = X.data_ptr<T>(), *o = out.data_ptr<T>();
  bias_factors(P, ew);
  std::vector<int64_t> u(B, Tn);  // first unsafe key per batch
  std::vector<char> uns(B * Tn, 0), which(B, 0);
  for (int64_t i = 0; i < P.nblk; ++i) {
    const int64_t i0 = P.i0(i), i1 = P.i1(i), n = i1 - i0;
    advance_keys(P, i, sh, sc, x, uns.data(), which);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = i0; t < i1 && u[b] == Tn; ++t)
        if (uns[b * Tn + t]) u[b] = t;
    auto ob = rows_of(out, 0, n);
    at::mm_out(ob, rows_of(Ew, i0, i1).narrow(1, 0, i1), rows_of(X, 0, i1));
    at::parallel_for(0, n * B, 8, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) {
        const int64_t t = i0 + j / B, b = j % B, off = (b * Tn + t) * D;
        const T* __restrict__ orow = o + j * 2 * D;
        const int64_t* __restrict__ z = pz + b * D;
        int bad = 0;
        #pragma omp simd reduction(+ : bad)
        for (int64_t c = 0; c < D; ++c) {
          const T num = orow[c], den = orow[D + c];
          const bool fine = !(den < tau) && (den != den || std::abs(num) <= big<T>());
          bad += (!fine && !P.poisoned(z[c], t)) ? 1 : 0;
        }
        const bool fb = t >= u[b] || bad > 0;
        FB[b * Tn + t] = fb;
        if (fb) continue;  // the exact path writes this row
        const T* __restrict__ qr = P.q + off;
        T* __restrict__ yr = Y + off;
        const bool save = A != nullptr;
        T* __restrict__ ar = save ? A + off : nullptr;
        T* __restrict__ ir = save ? INV + off : nullptr;
        #pragma omp simd
        for (int64_t c = 0; c < D; ++c) {
          const T inv = T(1) / orow[D + c];
          T a = clamp_abs(orow[c] * inv * unsc, big<T>());
          a = P.poisoned(z[c], t) ? nan : a;
          yr[c] = sigmoid(qr[c]) * a;
          if (save) {
            ir[c] = inv;
            ar[c] = a;
          }
        }
      }
    });
  }
  std::vector<int64_t> rows;
  for (int64_t r = 0; r < B * Tn; ++r)
    if (FB[r]) rows.push_back(r);
  if (!rows.empty()) exact_forward(P, rows, pz, sc, Y, A);
}

// ------------------------------------------------------------------ backward
template <typename T>
void exact_backward(const Problem<T>& P, const std::vector<int64_t>& rows, const T* G,
                    const T* A, T* DK, T* DV, T* DW) {
  const int64_t D = P.D, Tn = P.Tn, nr = rows.size();
  if (nr == 0) return;
  std::vector<T> m2(nr * D), inv(nr * D), da(nr * D);
  at::parallel_for(0, nr, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = rows[r] / Tn, t = rows[r] % Tn, o = (b * Tn + t) * D;
      T* den = inv.data() + r * D;
      exact_row_stats(P, b, t, m2.data() + r * D, den, (T*)nullptr, T(1));
      for (int64_t c = 0; c < D; ++c) {
        den[c] = den[c] == T(0) ? T(0) : T(1) / den[c];
        da[r * D + c] = G[o + c] * sigmoid(P.q[o + c]);
      }
    }
  });
  // keys in chunks: each (key, channel) and dw entry is written by one task, rows in order
  at::parallel_for(0, Tn, 32, [&](int64_t a, int64_t z) {
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t b = rows[r] / Tn, t = rows[r] % Tn, o = (b * Tn + t) * D;
      const int64_t end = std::min(z, P.seen_end(t));
      const T *mr = m2.data() + r * D, *ir = inv.data() + r * D, *dr = da.data() + r * D;
      const T *gr = G + o, *ar = A + o, *wr = P.w + t * P.ldw;
      for (int64_t j = a; j < end; ++j) {
        if (!P.valid(b, j)) continue;
        const T hw = wr[j] * T(0.5);
        const int64_t kj = (b * Tn + j) * D;
        const T *kr = P.k + kj, *vr = P.v + kj;
        T acc = 0;
        #pragma omp simd reduction(+ : acc)
        for (int64_t c = 0; c < D; ++c) {
          const T p = exp_nonpos(T(2) * ((kr[c] * T(0.5) + hw) - mr[c])) * ir[c];
          const bool quiet = gr[c] == T(0);
          const T gv = quiet ? T(0) : p * dr[c];
          const T gk = quiet ? T(0) : p * (dr[c] * (vr[c] - ar[c]));
          DV[kj + c] += gv;
          DK[kj + c] += gk;
          acc += gk;
        }
        DW[t * Tn + j] += acc;
      }
    }
  });
}

template <typename T>
void full_bwd(const Problem<T>& P, const T* G, const T* A, const T* INV, const bool* FB,
              const T* sh, T* DQ, T* DK, T* DV, at::Tensor& DWt, at::Tensor& Ew, at::Tensor& X,
              at::Tensor& Yacc, at::Tensor& RS) {
  const int64_t B = P.B, D = P.D, Tn = P.Tn;
  const T sc = value_scale<T>(Tn), unsc = T(1) / sc;
  T *ew = Ew.data_ptr<T>(), *x = X.data_ptr<T>(), *y = Yacc.data_ptr<T>(), *rs = RS.data_ptr<T>();
  T* DW = DWt.data_ptr<T>();
  bias_factors(P, ew);
  std::vector<char> which(B, 0), live(P.S * B, 0);
  bool epoch_any = false;
  int64_t yv = 0;  // rows of Yacc holding this epoch's sums (the others are not formed)
  for (int64_t i = 0; i < P.nblk; ++i) {
    const int64_t i0 = P.i0(i), i1 = P.i1(i), n = i1 - i0;
    advance_keys(P, i, sh, sc, x, (char*)nullptr, which);
    // dq, and [R / sc | -S] of the block's rows: 0 without gradient or on the exact path
    at::parallel_for(0, n * B, 8, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) {
        const int64_t t = i0 + j / B, b = j % B, off = (b * Tn + t) * D;
        T* __restrict__ rr = rs + j * 2 * D;
        T* __restrict__ dq = DQ + off;
        const T *__restrict__ gr = G + off, *__restrict__ qr = P.q + off;
        const T *__restrict__ ar = A + off, *__restrict__ ir = INV + off;
        const bool fb = FB[b * Tn + t];
        int any = 0;
        #pragma omp simd reduction(+ : any)
        for (int64_t c = 0; c < D; ++c) {
          const T g = gr[c], s = sigmoid(qr[c]), da = g * s * ir[c];
          const bool quiet = g == T(0);
          dq[c] = quiet ? T(0) : g * ar[c] * (s * (T(1) - s));
          const bool off_ = fb || quiet;
          rr[c] = off_ ? T(0) : da * unsc;
          rr[D + c] = off_ ? T(0) : -(da * ar[c]);
          any += off_ ? 0 : 1;
        }
        live[j] = any > 0;
      }
    });
    bool here = false;
    for (int64_t j = 0; j < n * B && !here; ++j) here = live[j];
    auto dwb = rows_of(DWt, i0, i1);
    if (here) {
      auto rsb = rows_of(RS, 0, n);
      auto ewb = rows_of(Ew, i0, i1).narrow(1, 0, i1);
      if (yv == 0) {
        auto yb = rows_of(Yacc, 0, i1);
        at::mm_out(yb, ewb.t(), rsb);
      } else {
        if (yv < i1) rows_of(Yacc, yv, i1).zero_();
        rows_of(Yacc, 0, i1).addmm_(ewb.t(), rsb);
      }
      yv = std::max(yv, i1);
      epoch_any = true;
      auto dwl = dwb.narrow(1, 0, i1);
      at::mm_out(dwl, rsb, rows_of(X, 0, i1).t());
      at::parallel_for(i0, i1, 8, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t end = P.seen_end(t);
          T* __restrict__ dr = DW + t * Tn;
          const T* __restrict__ er = ew + t * Tn;
          #pragma omp simd
          for (int64_t j = 0; j < i1; ++j) dr[j] = j < end ? er[j] * dr[j] : T(0);
          std::fill(dr + i1, dr + Tn, T(0));
        }
      });
    } else {
      dwb.zero_();
    }
    const bool last = i + 1 == P.nblk;
    if (last || shifts_moved(P, sh, i + 1, which.data())) {  // epoch ends: apply Y with its X
      if (epoch_any) {
        at::parallel_for(0, yv, 16, [&](int64_t t0, int64_t t1) {
          for (int64_t t = t0; t < t1; ++t)
            for (int64_t b = 0; b < B; ++b) {
              const T* __restrict__ xr = x + (t * B + b) * 2 * D;
              const T* __restrict__ yr = y + (t * B + b) * 2 * D;
              T* __restrict__ dv = DV + (b * Tn + t) * D;
              T* __restrict__ dk = DK + (b * Tn + t) * D;
              #pragma omp simd
              for (int64_t c = 0; c < D; ++c) {
                const T xk = xr[D + c], y1 = yr[c];
                dv[c] += xk * y1 * sc;
                dk[c] += xr[c] * y1 + xk * yr[D + c];
              }
            }
        });
      }
      epoch_any = false;
      yv = 0;
    }
  }
  std::vector<int64_t> rows;
  for (int64_t r = 0; r < B * Tn; ++r) {
    if (!FB[r]) continue;
    bool any = false;
    for (int64_t c = 0; c < D && !any; ++c) any = G[r * D + c] != T(0);
    if (any) rows.push_back(r);
  }
  exact_backward(P, rows, G, A, DK, DV, DW);
}

// ------------------------------------------------------------------ ops
void check_inputs(const char* where, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& w) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.sizes() == q.sizes(), where,
              ": q, k, v must be (B, T, d) alike");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  q.scalar_type() == w.scalar_type(),
              where, ": q, k, v, w must have one dtype");
  TORCH_CHECK(w.dim() == 2 && w.size(0) == q.size(1) && w.size(1) == q.size(1), where,
              ": w must be (T, T)");
}

template <typename T>
Problem<T> problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& w, const bool* M, bool causal, int64_t block) {
  Problem<T> P;
  P.q = q.data_ptr<T>();
  P.k = k.data_ptr<T>();
  P.v = v.data_ptr<T>();
  P.w = w.data_ptr<T>();
  P.mask = M;
  P.B = q.size(0);
  P.Tn = q.size(1);
  P.D = q.size(2);
  P.ldw = w.stride(0);
  P.causal = causal;
  P.S = causal ? std::max<int64_t>(1, block) : std::max<int64_t>(1, P.Tn);
  P.nblk = causal ? (P.Tn + P.S - 1) / P.S : 1;
  return P;
}

inline at::Tensor rowmajor(const at::Tensor& w) { return w.stride(1) == 1 ? w : w.contiguous(); }

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> full(
    const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& w_,
    const std::optional<at::Tensor>& mask, bool causal, int64_t block, bool save) {
  check_inputs("aftlab::full", q_, k_, v_, w_);
  auto q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous(), w = rowmajor(w_);
  at::Tensor keep;
  const bool* M = mask_ptr(mask, keep, q);
  const int64_t B = q.size(0), Tn = q.size(1), D = q.size(2);
  auto y = at::empty_like(q);
  auto a = save ? at::empty_like(q) : at::empty({0}, q.options());
  auto inv = save ? at::zeros_like(q) : at::empty({0}, q.options());
  auto fb = at::zeros({B, Tn}, q.options().dtype(at::kBool));
  auto pz = at::empty({B, D}, q.options().dtype(at::kLong));
  const int64_t S = causal ? std::max<int64_t>(1, block) : std::max<int64_t>(1, Tn);
  const int64_t nblk = causal ? (Tn + S - 1) / S : 1;
  auto sh = at::empty({nblk, B, D}, q.options());
  if (q.numel() == 0) {
    y.zero_();
    if (save) a.zero_();
    pz.fill_(Tn);
    sh.zero_();
    return {y, a, inv, fb, pz, sh};
  }
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "full", [&] {
    auto P = problem<scalar_t>(q, k, v, w, M, causal, block);
    auto Ew = at::empty({Tn, Tn}, q.options());
    auto X = at::empty({Tn, P.N()}, q.options());
    auto out = at::empty({P.S, P.N()}, q.options());
    prepass(P, pz.data_ptr<int64_t>(), sh.data_ptr<scalar_t>());
    full_fwd(P, pz.data_ptr<int64_t>(), sh.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(),
             save ? a.data_ptr<scalar_t>() : nullptr, save ? inv.data_ptr<scalar_t>() : nullptr,
             fb.data_ptr<bool>(), Ew, X, out);
  });
  return {y, a, inv, fb, pz, sh};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> full_backward(
    const at::Tensor& gy_, const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
    const at::Tensor& w_, const std::optional<at::Tensor>& mask, const at::Tensor& a_,
    const at::Tensor& inv_, const at::Tensor& fb_, const at::Tensor& sh_,
    bool causal, int64_t block) {
  check_inputs("aftlab::full_backward", q_, k_, v_, w_);
  TORCH_CHECK(a_.sizes() == q_.sizes() && inv_.sizes() == q_.sizes(),
              "aftlab::full_backward: A and 1/den were not saved");
  auto gy = gy_.contiguous(), q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  auto w = rowmajor(w_), a = a_.contiguous(), inv = inv_.contiguous();
  auto fb = fb_.contiguous(), sh = sh_.contiguous();
  at::Tensor keep;
  const bool* M = mask_ptr(mask, keep, q);
  const int64_t Tn = q.size(1);
  auto dq = at::empty_like(q), dk = at::zeros_like(q), dv = at::zeros_like(q);
  auto dw = at::empty({Tn, Tn}, q.options());
  if (q.numel() == 0) return {dq.zero_(), dk, dv, dw.zero_()};
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "full_backward", [&] {
    auto P = problem<scalar_t>(q, k, v, w, M, causal, block);
    auto Ew = at::empty({Tn, Tn}, q.options());
    auto X = at::empty({Tn, P.N()}, q.options());
    auto Y = at::empty({Tn, P.N()}, q.options());
    auto RS = at::empty({P.S, P.N()}, q.options());
    full_bwd(P, gy.data_ptr<scalar_t>(), a.data_ptr<scalar_t>(), inv.data_ptr<scalar_t>(),
             fb.data_ptr<bool>(), sh.data_ptr<scalar_t>(), dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(), dw, Ew, X,
             Y, RS);
  });
  return {dq, dk, dv, dw};
}

}  // namespace
}  // namespace aftlab

TORCH_LIBRARY_FRAGMENT(aftlab, m) {
  m.def("full(Tensor q, Tensor k, Tensor v, Tensor w, Tensor? mask, bool causal, int block,"
        " bool save) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("full_backward(Tensor gy, Tensor q, Tensor k, Tensor v, Tensor w, Tensor? mask,"
        " Tensor a, Tensor inv, Tensor fb, Tensor sh, bool causal, int block)"
        " -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(aftlab, CPU, m) {
  m.impl("full", &aftlab::full);
  m.impl("full_backward", &aftlab::full_backward);
}
