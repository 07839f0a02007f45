// The band kernels behind aft-local and (1-D) aft-conv, forward and backward.
//
//   y_t = sigma(q_t) sum_t' exp(k_t' + w'_{t,t'}) v_t' / sum_t' exp(k_t' + w'_{t,t'})
//
// with w'_{t,t'} = w[tb(t), g, t' - t + lo] inside the band t - lo <= t' <= t + hi and 0 outside
// it (global connectivity kept; causal: t' <= t, hi = 0). tb(t) = t for aft-local (a bias row
// per query), 0 for aft-conv (a Toeplitz kernel); g is the channel group (aft-conv's head).
//
// Layout: q, v, y (B, T, D) with D = G C; k (B, T, DK): one key per channel (DK = D) or one
// per group broadcast over its C channels (DK = G, "BC"); w (Tb, G, W), W = lo + hi + 1, in
// float64. Work is split over (batch, group, block of channels) with at::parallel_for.
//
// Numerics: keys, biases and maxima ("log domain") are float64, so k + w neither overflows nor
// rounds at |k|, |w| near float32's maximum; each exponential is of a non-positive float64
// number, evaluated in the value type. Per query and channel the shift M_t is the maximum of
// the visible band exponents k + w, the largest key of the prefix t' < t - lo and the largest key
// of the suffix t' > t + hi, so every exponent is <= 0 and one term is exactly 1 (den >= 1).
// Values enter the sums times the exact power of two sc = 2^-e, 2^e >= T + 1 (value_scale), so
// a sum of at most T weights <= 1 never overflows, and outputs are scaled back; the average is
// clamped to +-vm, the largest scaled |v| the query sees (causal: keys t' <= t; non-causal: all
// keys), which removes only the rounding that would push a mean of values near the largest
// float to inf (as in scan.cpp; docs/kernels.md, "Numerical range").
//
// Forward, per task: (non-causal) a reverse pass stores the suffix state (max, den, num) of the
// keys t' > t + hi at t (in the buffers of M, 1/den and y, overwritten by the next pass); then
// one pass forward folds key t - lo - 1 into the prefix state, reads the band keys straight
// from k, v (in cache) and writes y_t. Saved for the backward: M_t and 1/den_t (B, T, DK), so
// P_{t,t'} = exp(k_t' + w'_{t,t'} - M_t) / den_t.
// Per-channel keys (aft-local) factorise the exponential, exp(w + k - a_t - b) =
// exp(w - a_t) exp(k - b), with a_t = max(0, row t's visible band biases) and b per channel the
// largest key the query may see (causal: valid keys t' <= t, a running maximum; non-causal: all
// keys): the band's exp(k - b) and exp(k - b) v sc are kept in a ring of W key rows (a channel's
// rows are recomputed when its b rises), so the inner loop over (band key, channel) is two FMAs
// and the exponentials are O(T (d + W)), not O(T W d). The prefix keys' sums are kept in the
// same shift b (a key leaving the band adds its ring row; a rising b rescales them), and the
// exact prefix state (m, s, n) is folded lazily, only up to the rows that take the exact path.
// A row takes the exact per-(t, c) path above where any channel's den < FLOOR (2^-64; the
// maximisers of w and k disagree by ~44 or more, e.g. magnitudes ~1e4), where |a_t| or
// |b| > 2^20, or where den is NaN (NaN, inf input):
// exact for every finite input, and still bit-causal (every quantity of query t is of keys the
// query sees). It saves M_t = a_t + b + e ln2 and 1/f with den = f 2^e, f in [1, 2), so the
// backward's exp(k + w - M_t) <= 2 and 1/den <= 1 as on the exact path.
//
// Backward (dO = g sigma(q), E_t = sum_{c of the key} g y = dO . O):
//   dv_t' = sum_t P_{t,t'} dO_t,  dk_t' = sum_c v_t' dv_t' - sum_t P_{t,t'} E_t,
//   dw_j  = sum_{(t, t') at j} P_{t,t'} (dO_t . v_t' - E_t),  dq = g y (1 - sigma(q)).
// Per key t' the queries outside its band are a suffix t >= t' + lo + 1 (and, non-causal, a
// prefix t <= t' - hi - 1) of queries: stable scans with keys -M_t and values dO_t / den_t,
// E_t / den_t (exp(k_t' - M_t) <= 1 for every query that sees t'). One reverse pass over keys
// keeps the band's queries (dO, E, M, 1/den) in a ring of W rows; non-causal, a forward pass
// first writes the query-prefix part into dk, dv. Per-channel keys (aft-local) leave the band to
// a last pass forward over queries by blocks of BQ (Blocks): P = A e_u p_t with one shift b
// per block, the transposed products per key in registers (key_block; docs/kernels.md, "The
// band by blocks"); a query with a live channel outside that range takes the exact P. dw is
// accumulated per task into its own float64 buffer and the buffers are summed in task order:
// deterministic, no atomics.
// A query with no upstream gradient in a key's channels (g = 0; dO = E = 0 by a select) is left
// out of the scans, and in the ring its shift is +inf and 1/den 0, so P = 0 exactly for finite
// keys; a ring row with no gradient in any channel is skipped. Causal, gradients from the
// outputs before p are then bit for bit independent of the inputs at p (NaN, inf included).
// The backward is not value-scaled: finite wherever its sums (e.g. sum_t P |g y|) stay below
// the largest float.
//
// Code: each task runs a Forward (suffix_pass, then per query advance, gather, and group_row,
// fact_row or exact_row) or a Backward (prefix_queries, keys, then with a key per channel
// Blocks: window, query, exact_pairs, key per block), a struct of the task's buffers with a
// function per step; make_geo checks the problem once.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace aftlab {
namespace {

constexpr int64_t CB = 256;  // most channels per task
constexpr double NEG_INF = -std::numeric_limits<double>::infinity();

// exp of a non-positive log-domain (float64) number, evaluated in the value type T.
template <typename T>
AFTLAB_ELEM T expd(double x) {
  return exp_nonpos(static_cast<T>(x));
}

// exp(x) of a float64 x <= 88 in the value type T: float64 range reduction x = n ln2 + r, then
// exp_nonpos(r) 2^n in T, so the result keeps T's relative precision for any |x| (a plain cast
// of x to float32 costs |x| 6e-8 of it). Below -87 (float32; float64: libm) it is 0.
template <typename T>
AFTLAB_ELEM T exp_fine(double x) {
  if constexpr (std::is_same_v<T, double>) {
    return std::exp(x);
  } else {
    const double xc = x < -87.0 ? -87.0 : x;
    const double nf = (xc * 1.4426950408889634 + 6755399441055744.0) - 6755399441055744.0;
    const float r = static_cast<float>(xc - nf * 0.6931471805599453);
    const int32_t bits = (static_cast<int32_t>(nf) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    const float res = exp_nonpos(r) * scale;
    return x < -87.0 ? 0.0f : res;
  }
}

// The factorised path (per-channel keys): den >= FLOOR keeps every term that matters far above
// the range where its two factors could underflow; |shift| <= BIG keeps a + b (float64) exact
// to ~1e-10. Rows outside take the exact path.
template <typename T>
constexpr T FLOOR = std::is_same_v<T, double> ? T(0x1p-600) : T(0x1p-64);
constexpr double BIG = 0x1p20;
// The backward's blocks: BQ queries against the keys of their window, one shift b per block; a
// key of the block above b by more than MARGIN (e^16 ~ 9e6) sends the queries that see it to the
// exact path, so every factor stays far inside float's range.
constexpr int64_t BQ = 64;
constexpr double MARGIN = 16.0;
constexpr int KL = 16;  // channels per step of key_block

// x > 0 finite normal as f 2^e with f in [1, 2): returns e, sets f. The bit layout of float
// (23 mantissa bits, exponent bias 127) or double (52, 1023).
template <typename T>
AFTLAB_ELEM int split2(T x, T& f) {
  using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  constexpr int M = std::numeric_limits<T>::digits - 1;
  constexpr U bias = std::numeric_limits<T>::max_exponent - 1, field = 2 * bias + 1;
  U b;
  std::memcpy(&b, &x, sizeof b);
  const int e = static_cast<int>((b >> M) & field) - static_cast<int>(bias);
  b = (b & ~(field << M)) | (bias << M);
  std::memcpy(&f, &b, sizeof b);
  return e;
}

struct Geo {
  int64_t B, T, D, DK, G, C, Tb, W, lo, hi;
  bool causal;
  int64_t cbs, nsub;  // channels per task, tasks per (batch, group)
  int64_t tasks() const { return B * G * nsub; }
};

struct Task {
  int64_t id, b, g, c0, cn, k0, nk;  // value channels [c0, c0 + cn), key channels [k0, k0 + nk)
};

template <bool BC>
Task task_of(const Geo& geo, int64_t i) {
  Task tk;
  tk.id = i;
  tk.b = i / (geo.G * geo.nsub);
  const int64_t r = i % (geo.G * geo.nsub);
  tk.g = r / geo.nsub;
  const int64_t sub = r % geo.nsub;
  tk.c0 = tk.g * geo.C + sub * geo.cbs;
  tk.cn = std::min(geo.cbs, geo.C - sub * geo.cbs);
  tk.k0 = BC ? tk.g : tk.c0;
  tk.nk = BC ? 1 : tk.cn;
  return tk;
}

// One task's view of the problem: the offsets of its key and value channels at position t, its
// padding, and the index of w[tb(t), g, j] (and of dw). Forward and Backward build on it.
struct View {
  const Geo& geo;
  const Task tk;
  const bool* Mk;
  int64_t kx(int64_t t) const { return (tk.b * geo.T + t) * geo.DK + tk.k0; }
  int64_t vx(int64_t t) const { return (tk.b * geo.T + t) * geo.D + tk.c0; }
  bool valid(int64_t t) const { return Mk == nullptr || Mk[tk.b * geo.T + t]; }
  int64_t wi(int64_t t, int64_t j) const {
    return ((geo.Tb == 1 ? 0 : t) * geo.G + tk.g) * geo.W + j;
  }
};

// Fold key row k (value row v, summed times sc) into the stable state (m, s, n): with
// e = exp(-|k - m|), either k is the new maximum (old sums scale by e, new weight 1) or not (old
// sums kept, weight e).
template <typename T, bool BC>
inline void fold(const T* k, const T* v, T sc, int64_t nk, int64_t cn, double* m, T* s, T* n,
                 T* a, T* w) {
  #pragma omp simd
  for (int64_t i = 0; i < nk; ++i) {
    const double dk = static_cast<double>(k[i]) - m[i];
    const T e = expd<T>(-std::abs(dk));
    const bool up = dk > 0;
    a[i] = up ? e : T(1);
    w[i] = up ? T(1) : e;
    s[i] = s[i] * a[i] + w[i];
    m[i] = up ? static_cast<double>(k[i]) : m[i];
  }
  #pragma omp simd
  for (int64_t c = 0; c < cn; ++c) n[c] = n[c] * a[BC ? 0 : c] + w[BC ? 0 : c] * (v[c] * sc);
}

// vm = max(vm, |v| sc) per channel: the bound of the clamp (a NaN v leaves vm; its output is NaN).
// std::max's by value: the reference it returns kept GCC from vectorising the loop.
template <typename T>
inline void vmax(T* vm, const T* v, T sc, int64_t cn) {
  #pragma omp simd
  for (int64_t c = 0; c < cn; ++c) {
    const T x = std::abs(v[c] * sc);
    vm[c] = vm[c] < x ? x : vm[c];
  }
}

// Key t (keys k, one per key channel) raises the shift b of the channels it exceeds: the ring
// rows of the valid keys u in [t - lo, t) are redone (put) on those channels.
// on_rise(c, b_new) runs first, with bsh[c] still the old shift. Returns whether any rose.
template <typename T, typename Valid, typename Put, typename Rise>
inline bool raise_shift(const T* k, double* bsh, int64_t nk, int64_t t, int64_t lo,
                        const Valid& valid, const Put& put, const Rise& on_rise) {
  int any = 0;  // most keys raise nothing: one vector pass finds out
  #pragma omp simd reduction(| : any)
  for (int64_t c = 0; c < nk; ++c) any |= static_cast<int>(k[c] > bsh[c]);
  if (!any) return false;
  for (int64_t c = 0; c < nk; ++c) {
    if (!(k[c] > bsh[c])) continue;
    on_rise(c, static_cast<double>(k[c]));
    bsh[c] = k[c];
    for (int64_t u = std::max<int64_t>(0, t - lo); u < t; ++u)
      if (valid(u)) put(u, c, c + 1);
  }
  return true;
}

// y = sigma(q) 2^e clamp(num / den, +-vm): the scaled average back to the values' range.
template <typename T>
AFTLAB_ELEM T output(T q, T avg, T vm, T unsc) {
  return sigmoid(q) * (unsc * clamp_abs(avg, vm));
}

constexpr int VL = 16;  // channels kept in registers by the blocked inner loops

// One key per group: y = sigma(q) (np ap + ns as + sum_r e_r v_r sc) inv / sc on channels
// [0, L) (np, ns: scaled sums), the average clamped to +-vm.
template <typename T, int L>
inline void values_block(const T* V, int64_t S, const int64_t* rows, const T* e, int64_t nr,
                         const T* np, T ap, const T* ns, T as, T inv, T sc, const T* vm,
                         const T* q, T* y) {
  T num[L];
  #pragma omp simd
  for (int l = 0; l < L; ++l) num[l] = np[l] * ap + (ns ? ns[l] * as : T(0));
  for (int64_t r = 0; r < nr; ++r) {
    const T* vr = V + rows[r] * S;
    const T er = e[r];
    #pragma omp simd
    for (int l = 0; l < L; ++l) num[l] += er * (vr[l] * sc);
  }
  const T unsc = T(1) / sc;
  #pragma omp simd
  for (int l = 0; l < L; ++l) y[l] = output(q[l], num[l] * inv, vm[l], unsc);
}

// Per-channel keys: den += sum_r e_r ek_r, num += sum_r e_r ekv_r on channels [0, L), the
// ring rows ek + slot_r sk, ekv + slot_r sv; the sums kept in registers over the rows.
template <typename T, int L>
inline void band_sums(const T* ek, int64_t sk, const T* ekv, int64_t sv, const int64_t* slots,
                      const T* e, int64_t nr, T* den, T* num) {
  T d[L], n[L];
  #pragma omp simd
  for (int l = 0; l < L; ++l) {
    d[l] = den[l];
    n[l] = num[l];
  }
  for (int64_t r = 0; r < nr; ++r) {
    const T *er = ek + slots[r] * sk, *evr = ekv + slots[r] * sv;
    const T ew = e[r];
    #pragma omp simd
    for (int l = 0; l < L; ++l) {
      d[l] += ew * er[l];
      n[l] += ew * evr[l];
    }
  }
  #pragma omp simd
  for (int l = 0; l < L; ++l) {
    den[l] = d[l];
    num[l] = n[l];
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// float on AVX2: 32 channels, the 8 sums in registers (GCC keeps the arrays above on the stack).
// Each step is the same fused multiply-add as the generic loop, so the results are identical.
template <>
inline void band_sums<float, 32>(const float* ek, int64_t sk, const float* ekv, int64_t sv,
                                 const int64_t* slots, const float* e, int64_t nr, float* den,
                                 float* num) {
  __m256 d0 = _mm256_loadu_ps(den), d1 = _mm256_loadu_ps(den + 8),
         d2 = _mm256_loadu_ps(den + 16), d3 = _mm256_loadu_ps(den + 24);
  __m256 n0 = _mm256_loadu_ps(num), n1 = _mm256_loadu_ps(num + 8),
         n2 = _mm256_loadu_ps(num + 16), n3 = _mm256_loadu_ps(num + 24);
  for (int64_t r = 0; r < nr; ++r) {
    const float *er = ek + slots[r] * sk, *evr = ekv + slots[r] * sv;
    const __m256 ew = _mm256_set1_ps(e[r]);
    d0 = _mm256_fmadd_ps(ew, _mm256_loadu_ps(er), d0);
    d1 = _mm256_fmadd_ps(ew, _mm256_loadu_ps(er + 8), d1);
    d2 = _mm256_fmadd_ps(ew, _mm256_loadu_ps(er + 16), d2);
    d3 = _mm256_fmadd_ps(ew, _mm256_loadu_ps(er + 24), d3);
    n0 = _mm256_fmadd_ps(ew, _mm256_loadu_ps(evr), n0);
    n1 = _mm256_fmadd_ps(ew, _mm256_loadu_ps(evr + 8), n1);
    n2 = _mm256_fmadd_ps(ew, _mm256_loadu_ps(evr + 16), n2);
    n3 = _mm256_fmadd_ps(ew, _mm256_loadu_ps(evr + 24), n3);
  }
  _mm256_storeu_ps(den, d0), _mm256_storeu_ps(den + 8, d1);
  _mm256_storeu_ps(den + 16, d2), _mm256_storeu_ps(den + 24, d3);
  _mm256_storeu_ps(num, n0), _mm256_storeu_ps(num + 8, n1);
  _mm256_storeu_ps(num + 16, n2), _mm256_storeu_ps(num + 24, n3);
}
#endif

// One key of the backward's block over channels [0, L): accd = sum_r a_r PD_r, acce = sum_r a_r
// PE_r (the rows PD + rows[r] RS), and part_r += PD_r ev - PE_r ek lane by lane (the key's dw
// dot products, summed over the lanes by the caller). One pass over the rows: two loads of
// them per four multiply-adds, the key's ek, ev and sums in registers.
template <typename T, int L>
inline void key_block(const T* PD, const T* PE, int64_t RS, const int64_t* rows, const T* a,
                      int64_t nr, const T* ek, const T* ev, T* accd, T* acce, T* part,
                      int64_t ps = L) {
  T d[L], e[L], kk[L], vv[L];
  #pragma omp simd
  for (int l = 0; l < L; ++l) {
    d[l] = T(0), e[l] = T(0), kk[l] = ek[l], vv[l] = ev[l];
  }
  for (int64_t r = 0; r < nr; ++r) {
    const T *pd = PD + rows[r] * RS, *pe = PE + rows[r] * RS;
    const T ar = a[r];
    T* pr = part + r * ps;
    #pragma omp simd
    for (int l = 0; l < L; ++l) {
      d[l] += ar * pd[l];
      e[l] += ar * pe[l];
      pr[l] += pd[l] * vv[l] - pe[l] * kk[l];
    }
  }
  #pragma omp simd
  for (int l = 0; l < L; ++l) {
    accd[l] = d[l];
    acce[l] = e[l];
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// float on AVX2: the 16 channels' ek, ev and two sums in 8 registers.
template <>
inline void key_block<float, 16>(const float* PD, const float* PE, int64_t RS,
                                 const int64_t* rows, const float* a, int64_t nr,
                                 const float* ek, const float* ev, float* accd, float* acce,
                                 float* part, int64_t ps) {
  const __m256 k0 = _mm256_loadu_ps(ek), k1 = _mm256_loadu_ps(ek + 8);
  const __m256 v0 = _mm256_loadu_ps(ev), v1 = _mm256_loadu_ps(ev + 8);
  __m256 d0 = _mm256_setzero_ps(), d1 = d0, e0 = d0, e1 = d0;
  for (int64_t r = 0; r < nr; ++r) {
    const float *pd = PD + rows[r] * RS, *pe = PE + rows[r] * RS;
    const __m256 ar = _mm256_set1_ps(a[r]);
    const __m256 p0 = _mm256_loadu_ps(pd), p1 = _mm256_loadu_ps(pd + 8);
    const __m256 q0 = _mm256_loadu_ps(pe), q1 = _mm256_loadu_ps(pe + 8);
    d0 = _mm256_fmadd_ps(ar, p0, d0), d1 = _mm256_fmadd_ps(ar, p1, d1);
    e0 = _mm256_fmadd_ps(ar, q0, e0), e1 = _mm256_fmadd_ps(ar, q1, e1);
    float* pr = part + r * ps;
    __m256 s0 = _mm256_fnmadd_ps(q0, k0, _mm256_mul_ps(p0, v0));
    __m256 s1 = _mm256_fnmadd_ps(q1, k1, _mm256_mul_ps(p1, v1));
    _mm256_storeu_ps(pr, _mm256_add_ps(_mm256_loadu_ps(pr), s0));
    _mm256_storeu_ps(pr + 8, _mm256_add_ps(_mm256_loadu_ps(pr + 8), s1));
  }
  _mm256_storeu_ps(accd, d0), _mm256_storeu_ps(accd + 8, d1);
  _mm256_storeu_ps(acce, e0), _mm256_storeu_ps(acce + 8, e1);
}
#endif

// ------------------------------------------------------------------ forward
// The forward's pointers: inputs, y, and the statistics M (float64) and 1/den, saved for the
// backward or (non-causal) the suffix state's scratch; null where neither.
template <typename T>
struct FwdArgs {
  const T *Q, *K, *V;
  const double* Wb;
  const bool* Mk;
  T* Y;
  double* MX;
  T* IV;
  bool save;
};

// One task's forward (batch b, group g, channels [c0, c0 + cn)): suffix_pass (non-causal), then
// one pass over queries: advance (prefix and ring), gather (the band keys), and the row by
// group_row (one key per group), fact_row (the factorised path) or exact_row.
template <typename T, bool BC>
struct Forward : View {
  const FwdArgs<T>& io;
  const int64_t Tn, lo, hi, nk, cn, R, RS;
  const T sc, unsc;
  // the exact stable state (m, s, n) of the prefix (or, in suffix_pass, the suffix); scratch
  std::vector<double> m, M;
  std::vector<T> s, a, w, den, n, num, vm;
  // factorised path (per-channel keys): shift b per channel (causal: the largest valid key
  // t' <= t; non-causal: of all keys), a ring of the band keys' exp(k - b), exp(k - b) v sc
  // (row stride RS: one cache line more than a row, so the rows of a channel block fall in
  // different sets of L1 rather than in the same few), and the prefix keys' sums of the same in
  // the shift b: a key leaving the band adds its ring row (no exponential), a rising b rescales
  std::vector<double> bsh;
  std::vector<T> ek, ekv, sf, nf;
  bool shifts_ok = false;  // every |b| <= BIG (none is -inf, NaN), redone when b changes
  int64_t folded = 0;      // the exact prefix state holds the keys before this one
  // the valid band keys of the current query, their ring slots, biases, exponents k + w (BC)
  std::vector<int64_t> rows, slots;
  std::vector<double> wv, z;
  std::vector<T> e;
  int64_t nr = 0;

  Forward(const FwdArgs<T>& io_, const Geo& g, int64_t i)
      : View{g, task_of<BC>(g, i), io_.Mk}, io(io_), Tn(g.T), lo(g.lo), hi(g.hi), nk(tk.nk),
        cn(tk.cn), R(std::max<int64_t>(1, std::min(g.W, g.T))),
        RS(tk.nk + 64 / static_cast<int64_t>(sizeof(T))), sc(value_scale<T>(g.T)),
        unsc(T(1) / sc), m(nk), M(nk), s(nk), a(nk), w(nk), den(nk), n(cn), num(cn),
        vm(cn, T(0)), bsh(BC ? 0 : nk, NEG_INF), ek(BC ? 0 : R * RS), ekv(BC ? 0 : R * RS),
        sf(BC ? 0 : nk, T(0)), nf(BC ? 0 : cn, T(0)), rows(R), slots(R), wv(R), z(R), e(R) {}

  void reset() {
    std::fill(m.begin(), m.end(), NEG_INF);
    std::fill(s.begin(), s.end(), T(0));
    std::fill(n.begin(), n.end(), T(0));
  }
  void fold_key(int64_t u) {
    fold<T, BC>(io.K + kx(u), io.V + vx(u), sc, nk, cn, m.data(), s.data(), n.data(), a.data(),
                w.data());
  }

  // Non-causal: the suffix state of the keys t' > t + hi, kept at t in (MX, IV, Y) until the
  // forward pass reads it; vm and b over all keys (every query sees every key).
  void suffix_pass() {
    reset();
    for (int64_t t = Tn - 1; t >= 0; --t) {
      const int64_t tn = t + hi + 1;
      if (tn < Tn && valid(tn)) fold_key(tn);
      if (valid(t)) {
        vmax(vm.data(), io.V + vx(t), sc, cn);
        if constexpr (!BC) {
          const T* k = io.K + kx(t);
          for (int64_t c = 0; c < nk; ++c) bsh[c] = k[c] > bsh[c] ? k[c] : bsh[c];
        }
      }
      std::copy(m.begin(), m.end(), io.MX + kx(t));
      std::copy(s.begin(), s.end(), io.IV + kx(t));
      std::copy(n.begin(), n.end(), io.Y + vx(t));
    }
  }

  void check_shifts() {
    int bad = 0;
    #pragma omp simd reduction(+ : bad)
    for (int64_t c = 0; c < nk; ++c) bad += !(std::abs(bsh[c]) <= BIG);
    shifts_ok = bad == 0;
  }
  void rise(int64_t c, double b) {  // b > bsh[c]: the prefix sums into the new shift
    const T f = exp_fine<T>(bsh[c] - b);  // 0 from -inf
    sf[c] *= f;
    nf[c] *= f;
  }
  void put(int64_t u, int64_t c0, int64_t c1) {  // ring row of key u, channels [c0, c1)
    const T *k = io.K + kx(u), *v = io.V + vx(u);
    T *er = ek.data() + (u % R) * RS, *evr = ekv.data() + (u % R) * RS;
    #pragma omp simd
    for (int64_t c = c0; c < c1; ++c) {
      er[c] = exp_fine<T>(static_cast<double>(k[c]) - bsh[c]);
      evr[c] = er[c] * (v[c] * sc);
    }
  }
  // Per-channel keys fold the exact prefix state lazily: only an exact row needs it, and it is
  // brought up to that row's prefix then (amortised O(T) for the task).
  void exact_prefix(int64_t t) {
    for (; folded < t - lo; ++folded)
      if (valid(folded)) fold_key(folded);
  }

  // Before query t: key t - lo - 1 leaves the band for the prefix (one key per group: into the
  // exact state; per channel: its ring row into the prefix sums), vm takes key t (causal), and
  // the ring takes the band's new key (causal: t, raising b where t exceeds it; else t + hi).
  void advance(int64_t t) {
    const int64_t tp = t - lo - 1;
    if (BC && tp >= 0 && valid(tp)) fold_key(tp);
    if (!BC && tp >= 0 && valid(tp)) {  // its ring row, in the current shift
      const T *er = ek.data() + (tp % R) * RS, *evr = ekv.data() + (tp % R) * RS;
      #pragma omp simd
      for (int64_t c = 0; c < cn; ++c) {
        sf[c] += er[c];
        nf[c] += evr[c];
      }
    }
    if (geo.causal && valid(t)) vmax(vm.data(), io.V + vx(t), sc, cn);  // the keys t' <= t
    if (!BC && geo.causal && valid(t)) {
      const bool rose = raise_shift(
          io.K + kx(t), bsh.data(), nk, t, lo, [&](int64_t u) { return valid(u); },
          [&](int64_t u, int64_t c0, int64_t c1) { put(u, c0, c1); },
          [&](int64_t c, double b) { rise(c, b); });
      if (rose) check_shifts();
      put(t, 0, nk);
    } else if (!BC && !geo.causal && t + hi < Tn && valid(t + hi)) {
      put(t + hi, 0, nk);
    }
  }

  // The valid band keys of query t (rows) and their biases (wv).
  void gather(int64_t t) {
    const double* wr = io.Wb + wi(t, 0);
    nr = 0;
    for (int64_t u = std::max<int64_t>(0, t - lo); u <= std::min(Tn - 1, t + hi); ++u) {
      if (!valid(u)) continue;
      rows[nr] = u;
      wv[nr++] = wr[u - t + lo];
    }
  }

  // Query t's pointers: the suffix state (non-causal), the statistics to save, q and y.
  struct Row {
    const double* ms;
    const T *ss, *ns;
    double* Mo;
    T* Io;
    const T* q;
    T* y;
  };
  Row row(int64_t t) const {
    const bool nc = !geo.causal;
    return {nc ? io.MX + kx(t) : nullptr, nc ? io.IV + kx(t) : nullptr,
            nc ? io.Y + vx(t) : nullptr,  io.save ? io.MX + kx(t) : nullptr,
            io.save ? io.IV + kx(t) : nullptr, io.Q + vx(t), io.Y + vx(t)};
  }

  // One key per group: the exponents, shift and weights once per row, then the values.
  void group_row(const Row& r) {
    const T* K0 = io.K + kx(0);
    double Mg = m[0];
    if (r.ms) Mg = std::max(Mg, r.ms[0]);
    for (int64_t j = 0; j < nr; ++j) {
      z[j] = static_cast<double>(K0[rows[j] * geo.DK]) + wv[j];
      Mg = z[j] > Mg ? z[j] : Mg;
    }
    if (Mg == NEG_INF) Mg = 0.0;  // no key at all
    const T ap = expd<T>(m[0] - Mg), as = r.ms ? expd<T>(r.ms[0] - Mg) : T(0);
    T dg = s[0] * ap + (r.ms ? r.ss[0] * as : T(0));
    for (int64_t j = 0; j < nr; ++j) {
      e[j] = expd<T>(z[j] - Mg);
      dg += e[j];
    }
    const T inv = dg == T(0) ? T(0) : T(1) / dg;
    const T* V0 = io.V + vx(0);
    int64_t c = 0;
    for (; c + VL <= cn; c += VL)
      values_block<T, VL>(V0 + c, geo.D, rows.data(), e.data(), nr, n.data() + c, ap,
                          r.ns ? r.ns + c : nullptr, as, inv, sc, vm.data() + c, r.q + c,
                          r.y + c);
    for (; c < cn; ++c)
      values_block<T, 1>(V0 + c, geo.D, rows.data(), e.data(), nr, n.data() + c, ap,
                         r.ns ? r.ns + c : nullptr, as, inv, sc, vm.data() + c, r.q + c,
                         r.y + c);
    if (r.Mo) {
      r.Mo[0] = Mg;
      r.Io[0] = inv;
    }
  }

  // One query row on the factorised path; false (nothing written) where a channel's den is
  // below FLOOR, its shift is not finite or beyond BIG (NaN included): the exact path runs.
  // exp(k + w - a - b) = exp(w - a) exp(k - b), a = max(0, visible band biases):
  //   den = exp(-a) (sf + s_suf exp(m_suf - b)) + sum_r exp(w_r - a) ek_r
  // (num alike with n, ekv); saved M = a + b + e ln2, 1/den' = 1/f with den = f 2^e.
  bool fact_row(const Row& r) {
    double a0 = 0.0;
    for (int64_t j = 0; j < nr; ++j) a0 = wv[j] > a0 ? wv[j] : a0;
    if (!(a0 <= BIG) || !shifts_ok) return false;
    const T e0 = exp_fine<T>(-a0);
    for (int64_t j = 0; j < nr; ++j) {
      e[j] = exp_fine<T>(wv[j] - a0);
      slots[j] = rows[j] % R;
    }
    #pragma omp simd
    for (int64_t c = 0; c < cn; ++c) {
      den[c] = e0 * sf[c];
      num[c] = e0 * nf[c];
    }
    if (r.ms) {
      #pragma omp simd
      for (int64_t c = 0; c < cn; ++c) {
        const T p = exp_fine<T>(r.ms[c] - bsh[c]);
        den[c] += e0 * (r.ss[c] * p);
        num[c] += e0 * (r.ns[c] * p);
      }
    }
    int64_t c = 0;
    for (; c + 32 <= cn; c += 32)
      band_sums<T, 32>(ek.data() + c, RS, ekv.data() + c, RS, slots.data(), e.data(), nr,
                       den.data() + c, num.data() + c);
    for (; c + VL <= cn; c += VL)
      band_sums<T, VL>(ek.data() + c, RS, ekv.data() + c, RS, slots.data(), e.data(), nr,
                       den.data() + c, num.data() + c);
    for (; c < cn; ++c)
      band_sums<T, 1>(ek.data() + c, RS, ekv.data() + c, RS, slots.data(), e.data(), nr,
                      den.data() + c, num.data() + c);
    int bad = 0;
    #pragma omp simd reduction(+ : bad)
    for (int64_t c = 0; c < cn; ++c) bad += !(den[c] >= FLOOR<T>);
    if (bad) return false;
    #pragma omp simd
    for (int64_t c = 0; c < cn; ++c) r.y[c] = output(r.q[c], num[c] / den[c], vm[c], unsc);
    if (r.Mo) {
      #pragma omp simd
      for (int64_t c = 0; c < cn; ++c) {
        T f;
        const int ex = split2(den[c], f);
        r.Mo[c] = (a0 + bsh[c]) + ex * 0.6931471805599453;
        r.Io[c] = T(1) / f;
      }
    }
    return true;
  }

  // The exact row: per channel the shift M = the largest visible exponent (prefix, suffix and
  // band), every exponential of a non-positive number.
  void exact_row(int64_t t, const Row& r) {
    const T *K0 = io.K + kx(0), *V0 = io.V + vx(0);
    exact_prefix(t);
    std::copy(m.begin(), m.end(), M.begin());
    if (r.ms)
      for (int64_t c = 0; c < cn; ++c) M[c] = r.ms[c] > M[c] ? r.ms[c] : M[c];
    for (int64_t j = 0; j < nr; ++j) {
      const T* kr = K0 + rows[j] * geo.DK;
      const double wj = wv[j];
      #pragma omp simd
      for (int64_t c = 0; c < cn; ++c) {
        const double zz = static_cast<double>(kr[c]) + wj;
        M[c] = zz > M[c] ? zz : M[c];
      }
    }
    #pragma omp simd
    for (int64_t c = 0; c < cn; ++c) {
      M[c] = M[c] == NEG_INF ? 0.0 : M[c];  // no key at all
      a[c] = expd<T>(m[c] - M[c]);
      den[c] = s[c] * a[c];
      num[c] = n[c] * a[c];
    }
    if (r.ms) {
      #pragma omp simd
      for (int64_t c = 0; c < cn; ++c) {
        a[c] = expd<T>(r.ms[c] - M[c]);
        den[c] += r.ss[c] * a[c];
        num[c] += r.ns[c] * a[c];
      }
    }
    for (int64_t j = 0; j < nr; ++j) {
      const T *kr = K0 + rows[j] * geo.DK, *vr = V0 + rows[j] * geo.D;
      const double wj = wv[j];
      #pragma omp simd
      for (int64_t c = 0; c < cn; ++c) {
        const T ee = expd<T>(static_cast<double>(kr[c]) + wj - M[c]);
        den[c] += ee;
        num[c] += ee * (vr[c] * sc);
      }
    }
    #pragma omp simd
    for (int64_t c = 0; c < cn; ++c) {
      const T inv = den[c] == T(0) ? T(0) : T(1) / den[c];  // 0: no key; NaN stays NaN
      r.y[c] = output(r.q[c], num[c] * inv, vm[c], unsc);
      w[c] = inv;
    }
    if (r.Mo) {
      std::copy(M.begin(), M.end(), r.Mo);
      std::copy(w.begin(), w.end(), r.Io);
    }
  }

  void run() {
    if (!geo.causal) suffix_pass();
    reset();
    if (!BC && !geo.causal) {
      check_shifts();
      for (int64_t u = 0; u < std::min(hi, Tn); ++u)
        if (valid(u)) put(u, 0, nk);
    }
    for (int64_t t = 0; t < Tn; ++t) {
      advance(t);
      gather(t);
      const Row r = row(t);
      if constexpr (BC) {
        group_row(r);
      } else if (!fact_row(r)) {
        exact_row(t, r);
      }
    }
  }
};

template <typename T, bool BC>
void band_fwd(const FwdArgs<T>& io, const Geo& geo) {
  at::parallel_for(0, geo.tasks(), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) Forward<T, BC>(io, geo, i).run();
  });
}

// ------------------------------------------------------------------ backward
// The backward's pointers: upstream gradient, inputs, the forward's y and statistics, the
// gradients, and the task's float64 dw buffers (one per task, summed by the caller).
template <typename T>
struct BwdArgs {
  const T *GY, *Q, *K, *V;
  const double* Wb;
  const T* Y;
  const double* MX;
  const T* IV;
  const bool* Mk;
  T *DQ, *DK, *DV;
  double* DWP;
};

// One task's backward: prefix_queries (non-causal), then keys (the reverse pass over keys with
// the band's queries in a ring; with one key per group it does the band too), then, with a key
// per channel, the band by blocks (Blocks).
template <typename T, bool BC>
struct Backward : View {
  const BwdArgs<T>& io;
  const int64_t Tn, lo, hi, nk, cn, R;  // R: ring rows, the band's queries
  double* dwp;
  // query-side scan state: max of -M_t, sums of dO_t / den_t and E_t / den_t
  std::vector<double> mq;
  std::vector<T> se, a, w, f, acck, sdo, accv;
  // the ring of band queries: dO, E, 1/den, L, M (slot t mod R); rA: a gradient in some channel
  std::vector<T> rdo, rE, rI, rL;
  std::vector<double> rM;
  std::vector<char> rA;

  Backward(const BwdArgs<T>& io_, const Geo& g, int64_t i)
      : View{g, task_of<BC>(g, i), io_.Mk}, io(io_), Tn(g.T), lo(g.lo), hi(g.hi), nk(tk.nk),
        cn(tk.cn), R(std::max<int64_t>(1, std::min(g.W, g.T))),
        dwp(io_.DWP + i * g.Tb * g.G * g.W), mq(nk), se(nk), a(nk), w(nk), f(nk), acck(nk),
        sdo(cn), accv(cn), rdo(R * cn), rE(R * nk), rI(R * nk), rL(R * nk), rM(R * nk), rA(R) {}


  void reset() {
    std::fill(mq.begin(), mq.end(), NEG_INF);
    std::fill(se.begin(), se.end(), T(0));
    std::fill(sdo.begin(), sdo.end(), T(0));
  }

  // dO = g sigma(q), E = sum over the key's channels of g y; dq = g y (1 - sigma(q)).
  // L = 1 where the query has an upstream gradient in the key's channels (g != 0), else 0:
  // a query with g = 0 contributes exactly nothing (dO = E = 0 by a select, whatever y, q),
  // so a later input reaches no earlier gradient, not even through rounding or NaN.
  void prep(int64_t t, T* dO, T* E, T* L, bool write_dq) {
    const T *g = io.GY + vx(t), *q = io.Q + vx(t), *y = io.Y + vx(t);
    T* dq = io.DQ + vx(t);
    T acc = 0, live = 0;
    #pragma omp simd reduction(+ : acc, live)
    for (int64_t c = 0; c < cn; ++c) {
      const bool has = g[c] != T(0);
      const T sq = sigmoid(q[c]), gy = g[c] * y[c], ge = has ? gy : T(0);
      dO[c] = has ? g[c] * sq : T(0);
      if (write_dq) dq[c] = gy * (T(1) - sq);
      if (!BC) {
        E[c] = ge;
        L[c] = has ? T(1) : T(0);
      }
      acc += ge;
      live += has ? T(1) : T(0);
    }
    if (BC) {
      E[0] = acc;
      L[0] = live > T(0) ? T(1) : T(0);
    }
  }

  // Fold query t (key -M_t, weight 1/den_t; skipped where it has no key, 1/den = 0, or no
  // upstream gradient, L = 0: the state is then kept as it is).
  void qfold(const double* Mt, const T* it, const T* dO, const T* E, const T* L) {
    #pragma omp simd
    for (int64_t j = 0; j < nk; ++j) {
      const bool has = (it[j] > T(0)) & (L[j] != T(0));
      const double x = -Mt[j], d = x - mq[j];
      const T e = expd<T>(-std::abs(d));
      const bool up = d > 0;
      a[j] = has && up ? e : T(1);
      w[j] = has ? (up ? T(1) : e) * it[j] : T(0);
      mq[j] = has && up ? x : mq[j];
      se[j] = se[j] * a[j] + w[j] * E[j];  // L = 0: a = 1, w = 0, E = 0: kept exactly
    }
    #pragma omp simd
    for (int64_t c = 0; c < cn; ++c) sdo[c] = sdo[c] * a[BC ? 0 : c] + w[BC ? 0 : c] * dO[c];
  }

  // The outside-the-band part of key t' from the query state: f = exp(k + max(-M)) <= 1.
  void outside(const T* k) {
    #pragma omp simd
    for (int64_t j = 0; j < nk; ++j) {
      f[j] = expd<T>(static_cast<double>(k[j]) + mq[j]);
      acck[j] = -f[j] * se[j];
    }
    #pragma omp simd
    for (int64_t c = 0; c < cn; ++c) accv[c] = f[BC ? 0 : c] * sdo[c];
  }

  // Non-causal: the queries t <= t' - hi - 1 (key t' is in their suffix), into dk, dv.
  void prefix_queries() {
    reset();
    for (int64_t u = 0; u < Tn; ++u) {
      const int64_t tq = u - hi - 1;
      if (tq >= 0) {
        prep(tq, rdo.data(), rE.data(), rL.data(), false);
        qfold(io.MX + kx(tq), io.IV + kx(tq), rdo.data(), rE.data(), rL.data());
      }
      T *dk = io.DK + kx(u), *dv = io.DV + vx(u);
      if (!valid(u)) {
        std::fill(dk, dk + nk, T(0));
        std::fill(dv, dv + cn, T(0));
        continue;
      }
      outside(io.K + kx(u));
      std::copy(acck.begin(), acck.end(), dk);
      std::copy(accv.begin(), accv.end(), dv);
    }
  }

  // Query t into the ring: where L = 0 its shift is +inf and 1/den 0, so P = exp(-inf) 0 = 0
  // exactly for a finite key (no 0 * NaN); a row with no gradient at all is skipped.
  void load(int64_t t) {
    const int64_t r = t % R;
    const T* L = rL.data() + r * nk;
    prep(t, rdo.data() + r * cn, rE.data() + r * nk, rL.data() + r * nk, true);
    const double* Ms = io.MX + kx(t);
    const T* Is = io.IV + kx(t);
    double* Md = rM.data() + r * nk;
    T* Id = rI.data() + r * nk;
    T live = 0;
    #pragma omp simd reduction(+ : live)
    for (int64_t j = 0; j < nk; ++j) {
      Md[j] = L[j] != T(0) ? Ms[j] : std::numeric_limits<double>::infinity();
      Id[j] = L[j] != T(0) ? Is[j] : T(0);
      live += L[j];
    }
    rA[r] = live > T(0);
  }

  // One key per group: the band's queries t of key u from the ring, into accv, acck and dw.
  void group_band(int64_t u, const T* k, const T* v) {
    const int64_t ta = std::max<int64_t>(0, u - hi), tz = std::min(Tn - 1, u + lo);
    for (int64_t t = ta; t <= tz; ++t) {
      const int64_t r = t % R, j = wi(t, u - t + lo);
      if (!rA[r]) continue;  // no upstream gradient: contributes exactly 0
      const double* Mt = rM.data() + r * nk;
      const T *it = rI.data() + r * nk, *Et = rE.data() + r * nk, *dO = rdo.data() + r * cn;
      const T P = expd<T>(static_cast<double>(k[0]) + io.Wb[j] - Mt[0]) * it[0];
      T sum = 0;  // dw: sum of P (dO . v - E) over the task's channels
      #pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < cn; ++c) {
        const T pd = P * dO[c];
        accv[c] += pd;
        sum += v[c] * pd;
      }
      const T pe = P * Et[0];
      acck[0] -= pe;
      sum -= pe;
      dwp[j] += static_cast<double>(sum);
    }
  }

  // The reverse pass over keys; the ring holds the queries t' - hi .. t' + lo (slot t mod R).
  void keys() {
    reset();
    for (int64_t t = std::max<int64_t>(0, Tn - hi); t < Tn; ++t) load(t);
    for (int64_t u = Tn - 1; u >= 0; --u) {
      const int64_t tl = u + lo + 1;  // leaves the band: key u is in its prefix from now on
      if (tl < Tn) {
        const int64_t r = tl % R;
        qfold(rM.data() + r * nk, rI.data() + r * nk, rdo.data() + r * cn, rE.data() + r * nk,
              rL.data() + r * nk);
      }
      if (u - hi >= 0) load(u - hi);
      T *dk = io.DK + kx(u), *dv = io.DV + vx(u);
      if (!valid(u)) {
        std::fill(dk, dk + nk, T(0));
        std::fill(dv, dv + cn, T(0));
        continue;
      }
      const T *k = io.K + kx(u), *v = io.V + vx(u);
      outside(k);
      if (!geo.causal) {
        for (int64_t j = 0; j < nk; ++j) acck[j] += dk[j];
        for (int64_t c = 0; c < cn; ++c) accv[c] += dv[c];
      }
      if constexpr (BC) group_band(u, k, v);
      std::copy(accv.begin(), accv.end(), dv);
      if constexpr (BC) {
        T vd = 0;
        #pragma omp simd reduction(+ : vd)
        for (int64_t c = 0; c < cn; ++c) vd += v[c] * accv[c];
        dk[0] = acck[0] + vd;
      } else {
        std::copy(acck.begin(), acck.end(), dk);  // the band part follows (Blocks)
      }
    }
  }

  void run();
};

// Per-channel keys: the band part of the backward, by blocks of BQ queries against the keys of
// their window (docs/kernels.md, "The band by blocks"). P = A_{t,u} e_u p_t with A = exp(w - a_t)
// (0 for a padded key), e_u = exp(k_u - b), p_t = exp(a_t + b - M_t) / den_t, and b per channel
// one shift for the block: causal, the largest valid key t' <= t0 (every query of the block sees
// those keys, so no later input reaches it); non-causal, of all keys. Then
//   dv_u += e_u (A^T PD)_u,  dk_u -= e_u (A^T PE)_u,
//   dw_{t,u} = A (PD_t . e_u v_u - PE_t . e_u)
// with PD = p dO, PE = p E: per key over the block's queries (key_block), no exponential per
// (query, key, channel). A query takes the exact P = exp(k + w - M_t) / den_t where a live
// channel is outside that range (p_t would pass 2^65, |b| or |a_t| > 2^20, a key of the block up
// to t above b by more than MARGIN, no key, NaN); a key above b by more than MARGIN is seen only
// by such queries, so its e_u is 0. A key is finished (dk += v dv) after the last block that
// sees it.
template <typename T>
struct Blocks {
  Backward<T, false>& bw;
  const BwdArgs<T>& io;
  const int64_t Tn, lo, hi, cn, W, NW, RS;
  std::vector<double> bsh, brise, qM;  // the block's shift b; the running max up to t; M_t
  // per query of the block: p dO, p E (rows of stride RS: L1 sets) and A; per window key:
  // e_u, e_u v_u
  std::vector<T> PD, PE, EK, EV, A;
  std::vector<T> part, qdo, qE, qL, qI, Pt, accd, acce, av;
  std::vector<int64_t> rows;  // the factorised queries of the block that see the current key
  std::vector<char> good;     // query of the block on the factorised path
  int64_t folded = 0, finished = 0;

  explicit Blocks(Backward<T, false>& b)
      : bw(b), io(b.io), Tn(b.Tn), lo(b.lo), hi(b.hi), cn(b.cn), W(b.geo.W),
        NW(BQ + b.lo + b.hi), RS(b.cn + 64 / static_cast<int64_t>(sizeof(T))), bsh(cn, NEG_INF),
        brise(cn), qM(cn), PD(BQ * RS), PE(BQ * RS), EK(NW * RS), EV(NW * RS), A(BQ * W),
        part(BQ * KL), qdo(cn), qE(cn), qL(cn), qI(cn), Pt(cn), accd(cn), acce(cn), av(BQ),
        rows(BQ), good(BQ) {}

  void fold_max(double* b, int64_t u) {
    const T* k = io.K + bw.kx(u);
    #pragma omp simd
    for (int64_t c = 0; c < cn; ++c) b[c] = k[c] > b[c] ? static_cast<double>(k[c]) : b[c];
  }
  void finish(int64_t u1) {  // dk += v dv for the keys before u1
    for (; finished < u1; ++finished) {
      if (!bw.valid(finished)) continue;
      T *dk = io.DK + bw.kx(finished), *dv = io.DV + bw.vx(finished);
      const T* v = io.V + bw.vx(finished);
      #pragma omp simd
      for (int64_t c = 0; c < cn; ++c) dk[c] += v[c] * dv[c];
    }
  }

  // The window's e_u and e_u v_u (0 for a padded key or one above b by more than MARGIN).
  void window(int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      T *ek = EK.data() + (u - u0) * RS, *ev = EV.data() + (u - u0) * RS;
      if (!bw.valid(u)) {
        std::fill_n(ek, cn, T(0));
        std::fill_n(ev, cn, T(0));
        continue;
      }
      const T *k = io.K + bw.kx(u), *v = io.V + bw.vx(u);
      #pragma omp simd
      for (int64_t c = 0; c < cn; ++c) {
        const double x = static_cast<double>(k[c]) - bsh[c];
        const bool ok = (x <= MARGIN) & (std::abs(bsh[c]) <= BIG);
        ek[c] = ok ? exp_fine<T>(ok ? x : 0.0) : T(0);
        ev[c] = ek[c] * v[c];
      }
    }
  }

  // Query t (row i of the block): its factors A, PD, PE (good[i]), or its exact pairs. Always
  // inlined into run: called out of line, the backward measured 1.3x slower (band_ab, T 1024).
  AFTLAB_ELEM void query(int64_t t, int64_t t0) {
    const int64_t i = t - t0;
    T *pd = PD.data() + i * RS, *pe = PE.data() + i * RS, *ai = A.data() + i * W;
    good[i] = 0;
    std::fill_n(ai, W, T(0));
    if (bw.geo.causal && t > t0 && bw.valid(t)) fold_max(brise.data(), t);
    bw.prep(t, qdo.data(), qE.data(), qL.data(), false);
    const double* wr = io.Wb + bw.wi(t, 0);
    const int64_t ua = std::max<int64_t>(0, t - lo), uz = std::min(Tn - 1, t + hi);
    double a0 = 0.0;  // the forward's a_t
    for (int64_t u = ua; u <= uz; ++u)
      if (bw.valid(u)) a0 = wr[u - t + lo] > a0 ? wr[u - t + lo] : a0;
    const double* Ms = io.MX + bw.kx(t);
    const T* Is = io.IV + bw.kx(t);
    T live = 0, bad = 0;
    #pragma omp simd reduction(+ : live, bad)
    for (int64_t c = 0; c < cn; ++c) {
      const bool on = qL[c] != T(0);
      const double x = a0 + bsh[c] - Ms[c];
      const bool ok = (Is[c] > T(0)) & (std::abs(bsh[c]) <= BIG) & (a0 <= BIG) & (x <= 45.0) &
                      (brise[c] - bsh[c] <= MARGIN);
      Pt[c] = on && ok ? exp_fine<T>(ok ? x : 0.0) * Is[c] : T(0);
      qM[c] = on ? Ms[c] : std::numeric_limits<double>::infinity();
      qI[c] = on ? Is[c] : T(0);
      live += on ? T(1) : T(0);
      bad += on && !ok ? T(1) : T(0);
    }
    if (live == T(0)) {  // no upstream gradient: contributes exactly 0
      std::fill_n(pd, cn, T(0));
      std::fill_n(pe, cn, T(0));
      return;
    }
    if (bad == T(0)) {
      good[i] = 1;
      for (int64_t u = ua; u <= uz; ++u)
        if (bw.valid(u)) ai[u - t + lo] = exp_fine<T>(wr[u - t + lo] - a0);
      #pragma omp simd
      for (int64_t c = 0; c < cn; ++c) {
        pd[c] = Pt[c] * qdo[c];
        pe[c] = Pt[c] * qE[c];
      }
      return;
    }
    std::fill_n(pd, cn, T(0));
    std::fill_n(pe, cn, T(0));
    exact_pairs(t, ua, uz, wr);
  }

  // Query t's exact P = exp(k + w - M_t) / den_t with its band keys [ua, uz], straight into
  // dv, dk and dw.
  void exact_pairs(int64_t t, int64_t ua, int64_t uz, const double* wr) {
    for (int64_t u = ua; u <= uz; ++u) {
      if (!bw.valid(u)) continue;
      const T *__restrict__ v = io.V + bw.vx(u), *__restrict__ k = io.K + bw.kx(u);
      T *__restrict__ dv = io.DV + bw.vx(u), *__restrict__ dk = io.DK + bw.kx(u);
      const double wv = wr[u - t + lo];
      T sum = 0;
      #pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < cn; ++c) {
        const T P = expd<T>(static_cast<double>(k[c]) + wv - qM[c]) * qI[c];
        const T pdc = P * qdo[c], pec = P * qE[c];
        dv[c] += pdc;
        dk[c] -= pec;
        sum += v[c] * pdc - pec;
      }
      bw.dwp[bw.wi(t, u - t + lo)] += static_cast<double>(sum);
    }
  }

  // Key u against the factorised queries of the block [t0, t1) that see it: its sums and dw.
  void key(int64_t u, int64_t t0, int64_t t1, int64_t u0) {
    const int64_t ta = std::max(t0, u - hi), tz = std::min(t1 - 1, u + lo);
    int64_t nr = 0;
    for (int64_t t = ta; t <= tz; ++t) {
      const int64_t i = t - t0;
      if (!good[i]) continue;
      rows[nr] = i;
      av[nr++] = A[i * W + u - t + lo];
    }
    if (nr == 0 || !bw.valid(u)) return;
    const T *ek = EK.data() + (u - u0) * RS, *ev = EV.data() + (u - u0) * RS;
    std::fill_n(part.data(), nr * KL, T(0));
    int64_t c = 0;
    for (; c + KL <= cn; c += KL)
      key_block<T, KL>(PD.data() + c, PE.data() + c, RS, rows.data(), av.data(), nr, ek + c,
                       ev + c, accd.data() + c, acce.data() + c, part.data());
    for (; c < cn; ++c)
      key_block<T, 1>(PD.data() + c, PE.data() + c, RS, rows.data(), av.data(), nr, ek + c,
                      ev + c, accd.data() + c, acce.data() + c, part.data(), KL);
    T *dv = io.DV + bw.vx(u), *dk = io.DK + bw.kx(u);
    #pragma omp simd
    for (int64_t cc = 0; cc < cn; ++cc) {
      dv[cc] += ek[cc] * accd[cc];
      dk[cc] -= ek[cc] * acce[cc];
    }
    for (int64_t r = 0; r < nr; ++r) {  // dw_{t,u} = A (PD_t . e_u v_u - PE_t . e_u)
      T sum = 0;
      for (int l = 0; l < KL; ++l) sum += part[r * KL + l];
      const int64_t t = t0 + rows[r];
      bw.dwp[bw.wi(t, u - t + lo)] += static_cast<double>(av[r] * sum);
    }
  }

  void run() {
    if (!bw.geo.causal)
      for (int64_t u = 0; u < Tn; ++u)
        if (bw.valid(u)) fold_max(bsh.data(), u);
    for (int64_t t0 = 0; t0 < Tn; t0 += BQ) {
      const int64_t t1 = std::min(Tn, t0 + BQ);
      const int64_t u0 = std::max<int64_t>(0, t0 - lo), u1 = std::min(Tn, t1 + hi);
      if (bw.geo.causal) {
        for (; folded <= t0; ++folded)
          if (bw.valid(folded)) fold_max(bsh.data(), folded);
      }
      std::copy(bsh.begin(), bsh.end(), brise.begin());
      window(u0, u1);
      for (int64_t t = t0; t < t1; ++t) query(t, t0);
      for (int64_t u = u0; u < u1; ++u) key(u, t0, t1, u0);
      finish(std::max<int64_t>(0, std::min(Tn, t1 - lo)));
    }
    finish(Tn);
  }
};

template <typename T, bool BC>
void Backward<T, BC>::run() {
  if (!geo.causal) prefix_queries();
  keys();
  if constexpr (!BC) Blocks<T>(*this).run();
}

template <typename T, bool BC>
void band_bwd(const BwdArgs<T>& io, const Geo& geo) {
  at::parallel_for(0, geo.tasks(), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) Backward<T, BC>(io, geo, i).run();
  });
}

// ------------------------------------------------------------------ ATen entry points
// Checks shapes and returns the geometry; bc: one key per group (DK = G < D).
Geo make_geo(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
             const at::Tensor& w, int64_t lo, int64_t hi, bool causal, bool& bc) {
  TORCH_CHECK(q.dim() == 3 && v.sizes() == q.sizes(), op, ": q, v must be (B, T, D), got ",
              q.sizes(), v.sizes());
  TORCH_CHECK(k.dim() == 3 && k.size(0) == q.size(0) && k.size(1) == q.size(1), op,
              ": k must be (B, T, DK), got ", k.sizes());
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), op,
              ": q, k, v must have one dtype");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() &&
                  w.device().is_cpu(),
              op, ": CPU tensors only");
  TORCH_CHECK(lo >= 0 && hi >= 0 && (!causal || hi == 0), op, ": bad band lo=", lo, " hi=", hi);
  Geo g;
  g.B = q.size(0), g.T = q.size(1), g.D = q.size(2), g.DK = k.size(2);
  TORCH_CHECK(w.dim() == 3 && (w.size(0) == 1 || w.size(0) == g.T) && w.size(1) >= 1 &&
                  g.D % w.size(1) == 0 && w.size(2) == lo + hi + 1,
              op, ": w must be (1 or T, G, lo + hi + 1) with G dividing D, got ", w.sizes());
  g.Tb = w.size(0), g.G = w.size(1), g.W = w.size(2), g.C = g.D / g.G;
  g.lo = lo, g.hi = hi, g.causal = causal;
  TORCH_CHECK(g.DK == g.D || g.DK == g.G, op, ": k must have D or G channels, got ", g.DK);
  bc = g.DK != g.D;
  if (bc) {
    g.cbs = g.C, g.nsub = 1;
  } else {  // blocks inside a group, split further only to give every thread a task
    const int64_t groups = std::max<int64_t>(1, g.B * g.G);
    const int64_t per = std::max<int64_t>(1, (at::get_num_threads() + groups - 1) / groups);
    const int64_t cb = ((g.C + per - 1) / per + 15) / 16 * 16;
    g.cbs = std::max<int64_t>(16, std::min(CB, cb));
    g.nsub = (g.C + g.cbs - 1) / g.cbs;
  }
  return g;
}

// y (B, T, D); if save: M (B, T, DK) float64 and 1/den (B, T, DK), else two empty tensors.
std::tuple<at::Tensor, at::Tensor, at::Tensor> band(const at::Tensor& q_, const at::Tensor& k_,
                                                    const at::Tensor& v_, const at::Tensor& w_,
                                                    int64_t lo, int64_t hi, bool causal,
                                                    const std::optional<at::Tensor>& mask,
                                                    bool save) {
  bool bc;
  const Geo geo = make_geo("aftlab::band", q_, k_, v_, w_, lo, hi, causal, bc);
  auto q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  auto w = w_.to(at::kDouble).contiguous();
  at::Tensor keep;
  const bool* M = mask_ptr(mask, keep, q);
  auto y = at::empty_like(q);
  const bool keep_stats = save || !causal;  // non-causal: scratch for the suffix state
  auto mx = keep_stats ? at::empty(k.sizes(), k.options().dtype(at::kDouble))
                       : at::empty({0}, k.options().dtype(at::kDouble));
  auto iv = keep_stats ? at::empty_like(k) : at::empty({0}, k.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "band", [&] {
    const FwdArgs<scalar_t> io{q.data_ptr<scalar_t>(),
                               k.data_ptr<scalar_t>(),
                               v.data_ptr<scalar_t>(),
                               w.data_ptr<double>(),
                               M,
                               y.data_ptr<scalar_t>(),
                               keep_stats ? mx.data_ptr<double>() : nullptr,
                               keep_stats ? iv.data_ptr<scalar_t>() : nullptr,
                               save};
    (bc ? band_fwd<scalar_t, true> : band_fwd<scalar_t, false>)(io, geo);
  });
  if (!save) return {y, at::empty({0}, mx.options()), at::empty({0}, iv.options())};
  return {y, mx, iv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> band_backward(
    const at::Tensor& gy_, const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
    const at::Tensor& w_, const at::Tensor& y_, const at::Tensor& mx_, const at::Tensor& iv_,
    int64_t lo, int64_t hi, bool causal, const std::optional<at::Tensor>& mask) {
  bool bc;
  const Geo geo = make_geo("aftlab::band_backward", q_, k_, v_, w_, lo, hi, causal, bc);
  TORCH_CHECK(mx_.sizes() == k_.sizes() && iv_.sizes() == k_.sizes() &&
                  mx_.scalar_type() == at::kDouble,
              "aftlab::band_backward: the statistics were not saved");
  auto gy = gy_.contiguous().to(q_.scalar_type()), q = q_.contiguous(), k = k_.contiguous(),
       v = v_.contiguous(), y = y_.contiguous(), mx = mx_.contiguous(), iv = iv_.contiguous();
  auto w = w_.to(at::kDouble).contiguous();
  at::Tensor keep;
  const bool* M = mask_ptr(mask, keep, q);
  auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  const int64_t nw = geo.Tb * geo.G * geo.W;
  auto parts = at::zeros({geo.tasks(), nw}, w.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "band_backward", [&] {
    const BwdArgs<scalar_t> io{gy.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(),
                               k.data_ptr<scalar_t>(),  v.data_ptr<scalar_t>(),
                               w.data_ptr<double>(),    y.data_ptr<scalar_t>(),
                               mx.data_ptr<double>(),   iv.data_ptr<scalar_t>(),
                               M,                       dq.data_ptr<scalar_t>(),
                               dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(),
                               parts.data_ptr<double>()};
    (bc ? band_bwd<scalar_t, true> : band_bwd<scalar_t, false>)(io, geo);
  });
  // dw: the tasks' partial sums added in task order (deterministic for a thread count)
  auto dw = at::zeros({nw}, w.options());
  const double* pp = parts.data_ptr<double>();
  double* out = dw.data_ptr<double>();
  for (int64_t t = 0; t < geo.tasks(); ++t)
    for (int64_t j = 0; j < nw; ++j) out[j] += pp[t * nw + j];
  return {dq, dk, dv, dw.view(w_.sizes()).to(w_.scalar_type())};
}

}  // namespace
}  // namespace aftlab

TORCH_LIBRARY_FRAGMENT(aftlab, m) {
  m.def("band(Tensor q, Tensor k, Tensor v, Tensor w, int lo, int hi, bool causal, Tensor? mask,"
        " bool save) -> (Tensor, Tensor, Tensor)");
  m.def("band_backward(Tensor gy, Tensor q, Tensor k, Tensor v, Tensor w, Tensor y, Tensor mx,"
        " Tensor iv, int lo, int hi, bool causal, Tensor? mask) -> (Tensor, Tensor, Tensor,"
        " Tensor)");
}

TORCH_LIBRARY_IMPL(aftlab, CPU, m) {
  m.impl("band", &aftlab::band);
  m.impl("band_backward", &aftlab::band_backward);
}
