// The stable scan behind aft-simple (causal and not) and aft-decay, forward and backward.
//
// Layout: q, k, v, y are contiguous (B, T, d); work is split over (batch, block of CB channels)
// with at::parallel_for, and each task walks T once keeping per-channel state in small arrays
// whose inner loops over channels the compiler vectorises (no -march=native: see kernels.md).
//
// Forward state per channel: the running maximum m of the (decayed) exponents, and the
// numerator n = sum exp(z - m) v 2^-e and denominator s = sum exp(z - m) relative to it. One
// update takes ONE exponential of a non-positive number: with x = exp(-|k - m|), either the key
// is the new maximum (old sums scale by x, new weight 1) or not (old sums kept, new weight x).
// Decay: the maximum is kept as (anchor key ka, steps since it, age): m = ka - age * lambda,
// never t * lambda.
//
// Numerical range (docs/kernels.md): every finite input gives a finite, exact output.
// * No finite "no key yet" sentinel: aft-simple starts m at the lowest finite number (a key
//   equal to it gets weight exp(0) = 1, a key above it becomes the maximum, -inf weighs 0);
//   aft-decay starts its anchor at -inf.
// * Values enter the sums scaled by the exact power of two 2^-e, 2^e >= T + 1, so that n (at
//   most (T + 1) max|v| 2^-e) never overflows; outputs are scaled back. Exact in binary
//   floating point, except that values below about 2^-126 T (float32) lose their last bits.
//   An average is clamped to +-vm, the largest |value| seen (NaN and inf pass through): it
//   removes only the rounding that would push a mean of values at the largest float to inf.
// * aft-decay forms its exponent differences in quarters, dz/4 = (k/4 - ka/4) + u/4 +
//   age lambda/4: the first two terms stay within 3/4 max and the last is >= 0, so the sum
//   never meets inf - inf (NaN) and overflows only towards the right infinity.
//
// Saved for backward (only when a gradient is needed): r_t = exp(k_t - L_t), the weight of the
// newest key in the scan state (L_t its log-sum), and for aft-decay w_t, the weight of the
// current token's bonus term in the output. The gates of the reverse pass are 1 - r_{t+1} and
// 1 - w_{t+1}; the output y is saved by autograd. See docs/kernels.md for the derivation.

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

namespace aftlab {
namespace {

constexpr int64_t CB = 256;  // most channels per task (contiguous rows stream best)

// The "no key yet" maximum of aft-simple: the lowest finite number. A finite key k > m
// becomes the maximum (weight 1; the empty sums scale by exp(m - k), whatever it is, times 0),
// k == m weighs exp(0) = 1, k = -inf weighs 0; k - m never meets inf - inf.
template <typename T>
inline T no_key() {
  return std::numeric_limits<T>::lowest();
}

// Scan update from the difference dk = k - m (> 0: k is the new maximum): fold value v (already
// scaled) into (n, s); returns the new key's weight relative to the new maximum (1 or
// exp(-|dk|) <= 1).
template <typename T>
inline T fold_diff(T dk, T v, T& n, T& s) {
  const T e = exp_nonpos(-std::abs(dk));
  const bool up = dk > T(0);
  const T a = up ? e : T(1);
  const T w = up ? T(1) : e;
  n = n * a + w * v;
  s = s * a + w;
  return w;
}

// One scan update per channel: fold key k (scaled value v) into (m, n, s).
template <typename T>
inline T fold(T k, T v, T& m, T& n, T& s) {
  const T dk = k - m;
  m = dk > T(0) ? k : m;
  return fold_diff(dk, v, n, s);
}

// Channels per task: whole rows up to CB, split further only to give every thread a task.
inline int64_t block_size(int64_t B, int64_t D) {
  const int64_t per_batch = std::max<int64_t>(1, (at::get_num_threads() + B - 1) / std::max<int64_t>(B, 1));
  const int64_t cb = ((D + per_batch - 1) / per_batch + 15) / 16 * 16;
  return std::max<int64_t>(16, std::min(CB, cb));
}

// ------------------------------------------------------------------ aft-simple, causal
template <typename T, bool SAVE>
void simple_causal_fwd(const T* __restrict__ Q, const T* __restrict__ K, const T* __restrict__ V, const bool* __restrict__ M, T* __restrict__ Y, T* __restrict__ R,
                       int64_t B, int64_t Tn, int64_t D) {
  const int64_t cb = block_size(B, D), nb = (D + cb - 1) / cb;
  const T sc = value_scale<T>(Tn), unsc = T(1) / sc;
  at::parallel_for(0, B * nb, 1, [&](int64_t i0, int64_t i1) {
    T m[CB], n[CB], s[CB], vm[CB];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / nb, c0 = (i % nb) * cb, cn = std::min(cb, D - c0);
      for (int64_t c = 0; c < cn; ++c) { m[c] = no_key<T>(); n[c] = 0; s[c] = 0; vm[c] = 0; }
      for (int64_t t = 0; t < Tn; ++t) {
        const int64_t o = (b * Tn + t) * D + c0;
        const T *q = Q + o, *k = K + o, *v = V + o;
        T* y = Y + o;
        T* r = SAVE ? R + o : nullptr;
        const bool valid = M == nullptr || M[b * Tn + t];
        if (valid) {
          #pragma omp simd
          for (int64_t c = 0; c < cn; ++c) {
            const T vs = v[c] * sc;
            vm[c] = std::max(vm[c], std::abs(vs));
            const T w = fold(k[c], vs, m[c], n[c], s[c]);
            const T inv = s[c] > T(0) ? T(1) / s[c] : T(0);
            y[c] = sigmoid(q[c]) * unsc * clamp_abs(n[c] * inv, vm[c]);
            if (SAVE) r[c] = w * inv;
          }
        } else {
          #pragma omp simd
          for (int64_t c = 0; c < cn; ++c) {
            const T inv = s[c] > T(0) ? T(1) / s[c] : T(0);
            y[c] = sigmoid(q[c]) * unsc * clamp_abs(n[c] * inv, vm[c]);
            if (SAVE) r[c] = T(0);
          }
        }
      }
    }
  });
}

// Reverse pass: P^A_t = h_t + (1 - r_{t+1}) P^A_{t+1}, P^e_t = -g_t y_t + (1 - r_{t+1}) P^e_{t+1}
// with h = g sigma(q); dv = r P^A, dk = r (P^e + v P^A), dq = g y (1 - sigma(q)).
template <typename T>
void simple_causal_bwd(const T* __restrict__ G, const T* __restrict__ Q, const T* __restrict__ V, const T* __restrict__ Y, const T* __restrict__ R, T* __restrict__ DQ,
                       T* __restrict__ DK, T* __restrict__ DV, int64_t B, int64_t Tn, int64_t D) {
  const int64_t cb = block_size(B, D), nb = (D + cb - 1) / cb;
  at::parallel_for(0, B * nb, 1, [&](int64_t i0, int64_t i1) {
    T pa[CB], pe[CB], gate[CB];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / nb, c0 = (i % nb) * cb, cn = std::min(cb, D - c0);
      for (int64_t c = 0; c < cn; ++c) { pa[c] = 0; pe[c] = 0; gate[c] = 0; }
      for (int64_t t = Tn - 1; t >= 0; --t) {
        const int64_t o = (b * Tn + t) * D + c0;
        const T *gp = G + o, *qp = Q + o, *vp = V + o, *yp = Y + o, *rp = R + o;
        T *dq = DQ + o, *dk = DK + o, *dv = DV + o;
        #pragma omp simd
        for (int64_t c = 0; c < cn; ++c) {
          const T g = gp[c], sq = sigmoid(qp[c]), gy = g * yp[c], r = rp[c];
          pa[c] = g * sq + gate[c] * pa[c];
          pe[c] = -gy + gate[c] * pe[c];
          dv[c] = r * pa[c];
          dk[c] = r * (pe[c] + vp[c] * pa[c]);
          dq[c] = gy * (T(1) - sq);
          gate[c] = T(1) - r;
        }
      }
    }
  });
}

// ------------------------------------------------------------------ aft-simple, non-causal
// Pass 1 folds every valid key into (m, n, s); pass 2 writes y = sigma(q) A, A = n / s.
// stats (3, B, d) = (m, s, A) for the backward.
template <typename T>
void simple_global_fwd(const T* __restrict__ Q, const T* __restrict__ K, const T* __restrict__ V, const bool* __restrict__ M, T* __restrict__ Y, T* __restrict__ S3,
                       int64_t B, int64_t Tn, int64_t D) {
  const int64_t cb = block_size(B, D), nb = (D + cb - 1) / cb;
  const T sc = value_scale<T>(Tn), unsc = T(1) / sc;
  at::parallel_for(0, B * nb, 1, [&](int64_t i0, int64_t i1) {
    T m[CB], n[CB], s[CB], a[CB], vm[CB];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / nb, c0 = (i % nb) * cb, cn = std::min(cb, D - c0);
      for (int64_t c = 0; c < cn; ++c) { m[c] = no_key<T>(); n[c] = 0; s[c] = 0; vm[c] = 0; }
      for (int64_t t = 0; t < Tn; ++t) {
        if (M != nullptr && !M[b * Tn + t]) continue;
        const int64_t o = (b * Tn + t) * D + c0;
        for (int64_t c = 0; c < cn; ++c) {
          const T vs = V[o + c] * sc;
          vm[c] = std::max(vm[c], std::abs(vs));
          fold(K[o + c], vs, m[c], n[c], s[c]);
        }
      }
      #pragma omp simd
      for (int64_t c = 0; c < cn; ++c) {
        a[c] = s[c] == T(0) ? T(0) : unsc * clamp_abs(n[c] / s[c], vm[c]);  // NaN s: NaN
        S3[(0 * B + b) * D + c0 + c] = m[c];
        S3[(1 * B + b) * D + c0 + c] = s[c];
        S3[(2 * B + b) * D + c0 + c] = a[c];
      }
      for (int64_t t = 0; t < Tn; ++t) {
        const int64_t o = (b * Tn + t) * D + c0;
        for (int64_t c = 0; c < cn; ++c) Y[o + c] = sigmoid(Q[o + c]) * a[c];
      }
    }
  });
}

// H = sum_t g_t sigma(q_t); rho_t = exp(k_t - m) / s (0 if padded);
// dv = rho H, dk = rho (v - A) H, dq = g A sigma (1 - sigma).
template <typename T>
void simple_global_bwd(const T* __restrict__ G, const T* __restrict__ Q, const T* __restrict__ K, const T* __restrict__ V, const T* __restrict__ S3,
                       const bool* __restrict__ M, T* __restrict__ DQ, T* __restrict__ DK, T* __restrict__ DV, int64_t B, int64_t Tn, int64_t D) {
  const int64_t cb = block_size(B, D), nb = (D + cb - 1) / cb;
  at::parallel_for(0, B * nb, 1, [&](int64_t i0, int64_t i1) {
    T h[CB], m[CB], inv[CB], a[CB];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / nb, c0 = (i % nb) * cb, cn = std::min(cb, D - c0);
      #pragma omp simd
      for (int64_t c = 0; c < cn; ++c) {
        h[c] = 0;
        m[c] = S3[(0 * B + b) * D + c0 + c];
        const T s = S3[(1 * B + b) * D + c0 + c];
        inv[c] = s > T(0) ? T(1) / s : T(0);
        a[c] = S3[(2 * B + b) * D + c0 + c];
      }
      for (int64_t t = 0; t < Tn; ++t) {
        const int64_t o = (b * Tn + t) * D + c0;
        #pragma omp simd
        for (int64_t c = 0; c < cn; ++c) {
          const T g = G[o + c], sq = sigmoid(Q[o + c]);
          h[c] += g * sq;
          DQ[o + c] = g * a[c] * sq * (T(1) - sq);
        }
      }
      for (int64_t t = 0; t < Tn; ++t) {
        const int64_t o = (b * Tn + t) * D + c0;
        if (M != nullptr && !M[b * Tn + t]) {
          for (int64_t c = 0; c < cn; ++c) { DK[o + c] = 0; DV[o + c] = 0; }
          continue;
        }
        #pragma omp simd
        for (int64_t c = 0; c < cn; ++c) {
          const T rho = exp_nonpos(K[o + c] - m[c]) * inv[c];
          DV[o + c] = rho * h[c];
          DK[o + c] = rho * (V[o + c] - a[c]) * h[c];
        }
      }
    }
  });
}

// ------------------------------------------------------------------ aft-decay
// Output at t from the past state (sums over t' < t with offsets t - 1 - t') and the bonus term
// exp(u + k_t): with o = max(m, u + k_t), y = sigma(q) (n e^{m-o} + e^{u+k-o} v) / (s e^{m-o}
// + e^{u+k-o}); then the state decays by lambda (age + 1) and folds k_t. Exponent differences
// in quarters (see the header): with d = k/4 - ka/4,
//   (u + k - m) / 4 = (d + u/4) + age lambda/4,   (k - m') / 4 = d + (age + 1) lambda/4.
//
// With a carry (S0/S1 non-null, decay_state): the scan starts from the state (a, b, p) of
// S0 (3, B, D) -- anchor p, age 0, n = a 2^-e, s = b, and |a / b| as the largest value seen (the
// output is a convex combination of a / b and the new values) -- and writes the state after
// the last token to S1: p = 4 (ka/4 - age lambda/4), a = n 2^e, b = s.
template <typename T, bool SAVE>
void decay_fwd(const T* __restrict__ Q, const T* __restrict__ K, const T* __restrict__ V, const T* __restrict__ LAM, const T* __restrict__ U, const bool* __restrict__ M,
               T* __restrict__ Y, T* __restrict__ R, T* __restrict__ W, int64_t B, int64_t Tn, int64_t D,
               const T* __restrict__ S0, T* __restrict__ S1) {
  const int64_t cb = block_size(B, D), nb = (D + cb - 1) / cb;
  const T sc = value_scale<T>(Tn), unsc = T(1) / sc;
  const int64_t BD = B * D;
  at::parallel_for(0, B * nb, 1, [&](int64_t i0, int64_t i1) {
    T ka4[CB], age[CB], n[CB], s[CB], vm[CB], lam4[CB], u4[CB];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / nb, c0 = (i % nb) * cb, cn = std::min(cb, D - c0);
      for (int64_t c = 0; c < cn; ++c) {
        ka4[c] = -std::numeric_limits<T>::infinity();  // no key yet
        age[c] = 0; n[c] = 0; s[c] = 0; vm[c] = 0;
        lam4[c] = T(0.25) * LAM[c0 + c];
        u4[c] = T(0.25) * U[c0 + c];
        if (S0 != nullptr) {
          const int64_t j = b * D + c0 + c;
          const T a0 = S0[j], b0 = S0[BD + j], p0 = S0[2 * BD + j];
          if (b0 > T(0)) {
            ka4[c] = T(0.25) * p0;
            n[c] = a0 * sc;
            s[c] = b0;
            vm[c] = std::abs(a0 / b0) * sc;
          }
        }
      }
      for (int64_t t = 0; t < Tn; ++t) {
        const int64_t o = (b * Tn + t) * D + c0;
        const T *q = Q + o, *k = K + o, *v = V + o;
        T* y = Y + o;
        const bool valid = M == nullptr || M[b * Tn + t];
        if (valid) {
          #pragma omp simd
          for (int64_t c = 0; c < cn; ++c) {
            const T k4 = T(0.25) * k[c], d = k4 - ka4[c];
            const T dz = T(4) * ((d + u4[c]) + age[c] * lam4[c]);
            const T e = exp_nonpos(-std::abs(dz));
            const bool up = dz > T(0);
            const T pw = up ? e : T(1), cw = up ? T(1) : e;
            const T den = s[c] * pw + cw;  // >= 1
            const T wt = cw / den, vs = v[c] * sc;
            vm[c] = std::max(vm[c], std::abs(vs));
            y[c] = sigmoid(q[c]) * unsc * clamp_abs((n[c] * pw + cw * vs) / den, vm[c]);
            const T dk4 = d + (age[c] + T(1)) * lam4[c];
            const T w = fold_diff(T(4) * dk4, vs, n[c], s[c]);
            const bool moved = dk4 > T(0);
            ka4[c] = moved ? k4 : ka4[c];
            age[c] = moved ? T(0) : age[c] + T(1);
            if (SAVE) {
              R[o + c] = w / s[c];
              W[o + c] = wt;
            }
          }
        } else {
          #pragma omp simd
          for (int64_t c = 0; c < cn; ++c) {
            const T inv = s[c] > T(0) ? T(1) / s[c] : T(0);
            y[c] = sigmoid(q[c]) * unsc * clamp_abs(n[c] * inv, vm[c]);
            age[c] += T(1);
            if (SAVE) {
              R[o + c] = T(0);
              W[o + c] = T(0);
            }
          }
        }
      }
      if (S1 != nullptr) {
        for (int64_t c = 0; c < cn; ++c) {
          const int64_t j = b * D + c0 + c;
          const bool any = s[c] > T(0);
          S1[j] = any ? n[c] * unsc : T(0);
          S1[BD + j] = s[c];
          S1[2 * BD + j] = any ? T(4) * (ka4[c] - age[c] * lam4[c])
                               : -std::numeric_limits<T>::infinity();
        }
      }
    }
  });
}

// Reverse pass with G_{t+1} = 1 - r_{t+1}:
//   P_t = h_{t+1} (1 - w_{t+1}) + G_{t+1} P_{t+1}          (P^A; P^e with -g y instead of h)
//   Q_t = G_{t+1} (Q_{t+1} + P_{t+1})                       (offset-weighted, for dlambda)
//   dv = h w + r P^A,  dk = w (h v - g y) + r (P^e + v P^A),  du = sum w (h v - g y),
//   dlambda = -sum r (v Q^A + Q^e),  dq = g y (1 - sigma(q)).
template <typename T>
void decay_bwd(const T* __restrict__ G, const T* __restrict__ Q, const T* __restrict__ V, const T* __restrict__ Y, const T* __restrict__ R, const T* __restrict__ W, T* __restrict__ DQ,
               T* __restrict__ DK, T* __restrict__ DV, T* __restrict__ DLAM, T* __restrict__ DU, int64_t B, int64_t Tn, int64_t D) {
  const int64_t cb = block_size(B, D), nb = (D + cb - 1) / cb;
  at::parallel_for(0, B * nb, 1, [&](int64_t i0, int64_t i1) {
    T pa[CB], pe[CB], qa[CB], qe[CB], ia[CB], ie[CB], gate[CB], du[CB], dl[CB];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / nb, c0 = (i % nb) * cb, cn = std::min(cb, D - c0);
      #pragma omp simd
      for (int64_t c = 0; c < cn; ++c) {
        pa[c] = pe[c] = qa[c] = qe[c] = ia[c] = ie[c] = gate[c] = du[c] = dl[c] = T(0);
      }
      for (int64_t t = Tn - 1; t >= 0; --t) {
        const int64_t o = (b * Tn + t) * D + c0;
        const T *gp = G + o, *qp = Q + o, *vp = V + o, *yp = Y + o, *rp = R + o, *wp = W + o;
        T *dq = DQ + o, *dk = DK + o, *dv = DV + o;
        #pragma omp simd
        for (int64_t c = 0; c < cn; ++c) {
          qa[c] = gate[c] * (qa[c] + pa[c]);
          qe[c] = gate[c] * (qe[c] + pe[c]);
          pa[c] = ia[c] + gate[c] * pa[c];
          pe[c] = ie[c] + gate[c] * pe[c];
          const T g = gp[c], sq = sigmoid(qp[c]), v = vp[c];
          const T h = g * sq, gy = g * yp[c], r = rp[c], w = wp[c];
          const T own = w * (h * v - gy);
          dv[c] = h * w + r * pa[c];
          dk[c] = own + r * (pe[c] + v * pa[c]);
          dq[c] = gy * (T(1) - sq);
          du[c] += own;
          dl[c] -= r * (v * qa[c] + qe[c]);
          ia[c] = h * (T(1) - w);
          ie[c] = -gy * (T(1) - w);
          gate[c] = T(1) - r;
        }
      }
      #pragma omp simd
      for (int64_t c = 0; c < cn; ++c) {
        DLAM[b * D + c0 + c] = dl[c];
        DU[b * D + c0 + c] = du[c];
      }
    }
  });
}

// ------------------------------------------------------------------ ATen entry points
void check_qkv(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 3, op, ": q must be (B, T, d), got ", q.sizes());
  TORCH_CHECK(k.sizes() == q.sizes() && v.sizes() == q.sizes(), op,
              ": q, k, v must have one shape, got ", q.sizes(), k.sizes(), v.sizes());
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), op,
              ": q, k, v must have one dtype");
  TORCH_CHECK(q.device().is_cpu(), op, ": CPU tensors only");
}

std::tuple<at::Tensor, at::Tensor> simple_causal(const at::Tensor& q_, const at::Tensor& k_,
                                                 const at::Tensor& v_,
                                                 const std::optional<at::Tensor>& mask,
                                                 bool save) {
  check_qkv("aftlab::simple_causal", q_, k_, v_);
  auto q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  at::Tensor keep;
  const bool* M = mask_ptr(mask, keep, q);
  auto y = at::empty_like(q);
  auto r = save ? at::empty_like(q) : at::empty({0}, q.options());
  const int64_t B = q.size(0), Tn = q.size(1), D = q.size(2);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "simple_causal", [&] {
    auto f = save ? simple_causal_fwd<scalar_t, true> : simple_causal_fwd<scalar_t, false>;
    f(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), M,
      y.data_ptr<scalar_t>(), save ? r.data_ptr<scalar_t>() : nullptr, B, Tn, D);
  });
  return {y, r};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> simple_causal_backward(
    const at::Tensor& gy_, const at::Tensor& q_, const at::Tensor& v_, const at::Tensor& y_,
    const at::Tensor& r_) {
  check_qkv("aftlab::simple_causal_backward", q_, y_, v_);
  TORCH_CHECK(r_.sizes() == q_.sizes(), "simple_causal_backward: r was not saved");
  auto gy = gy_.contiguous(), q = q_.contiguous(), v = v_.contiguous(), y = y_.contiguous(),
       r = r_.contiguous();
  auto dq = at::empty_like(q), dk = at::empty_like(q), dv = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "simple_causal_backward", [&] {
    simple_causal_bwd<scalar_t>(gy.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(),
                                v.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(),
                                r.data_ptr<scalar_t>(), dq.data_ptr<scalar_t>(),
                                dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(), q.size(0),
                                q.size(1), q.size(2));
  });
  return {dq, dk, dv};
}

std::tuple<at::Tensor, at::Tensor> simple_global(const at::Tensor& q_, const at::Tensor& k_,
                                                 const at::Tensor& v_,
                                                 const std::optional<at::Tensor>& mask) {
  check_qkv("aftlab::simple_global", q_, k_, v_);
  auto q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  at::Tensor keep;
  const bool* M = mask_ptr(mask, keep, q);
  auto y = at::empty_like(q);
  auto stats = at::empty({3, q.size(0), q.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "simple_global", [&] {
    simple_global_fwd<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
                                v.data_ptr<scalar_t>(), M, y.data_ptr<scalar_t>(),
                                stats.data_ptr<scalar_t>(), q.size(0), q.size(1), q.size(2));
  });
  return {y, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> simple_global_backward(
    const at::Tensor& gy_, const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
    const at::Tensor& stats_, const std::optional<at::Tensor>& mask) {
  check_qkv("aftlab::simple_global_backward", q_, k_, v_);
  auto gy = gy_.contiguous(), q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous(),
       stats = stats_.contiguous();
  at::Tensor keep;
  const bool* M = mask_ptr(mask, keep, q);
  auto dq = at::empty_like(q), dk = at::empty_like(q), dv = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "simple_global_backward", [&] {
    simple_global_bwd<scalar_t>(gy.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(),
                                k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                                stats.data_ptr<scalar_t>(), M, dq.data_ptr<scalar_t>(),
                                dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(), q.size(0),
                                q.size(1), q.size(2));
  });
  return {dq, dk, dv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> decay(const at::Tensor& q_, const at::Tensor& k_,
                                                     const at::Tensor& v_,
                                                     const at::Tensor& lam_,
                                                     const at::Tensor& u_,
                                                     const std::optional<at::Tensor>& mask,
                                                     bool save) {
  check_qkv("aftlab::decay", q_, k_, v_);
  TORCH_CHECK(lam_.numel() == q_.size(2) && u_.numel() == q_.size(2),
              "aftlab::decay: decay and bonus must be (d,)");
  auto q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  auto lam = lam_.to(q.scalar_type()).contiguous(), u = u_.to(q.scalar_type()).contiguous();
  at::Tensor keep;
  const bool* M = mask_ptr(mask, keep, q);
  auto y = at::empty_like(q);
  auto r = save ? at::empty_like(q) : at::empty({0}, q.options());
  auto w = save ? at::empty_like(q) : at::empty({0}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "decay", [&] {
    auto f = save ? decay_fwd<scalar_t, true> : decay_fwd<scalar_t, false>;
    f(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
      lam.data_ptr<scalar_t>(), u.data_ptr<scalar_t>(), M, y.data_ptr<scalar_t>(),
      save ? r.data_ptr<scalar_t>() : nullptr, save ? w.data_ptr<scalar_t>() : nullptr,
      q.size(0), q.size(1), q.size(2), nullptr, nullptr);
  });
  return {y, r, w};
}

// Inference only (no autograd): y and the state after the last token, (3, B, D) = (a, b, p),
// continuing the state `state` (3, B, D) or the empty one. No padding.
std::tuple<at::Tensor, at::Tensor> decay_state(const at::Tensor& q_, const at::Tensor& k_,
                                               const at::Tensor& v_, const at::Tensor& lam_,
                                               const at::Tensor& u_,
                                               const std::optional<at::Tensor>& state_) {
  check_qkv("aftlab::decay_state", q_, k_, v_);
  TORCH_CHECK(lam_.numel() == q_.size(2) && u_.numel() == q_.size(2),
              "aftlab::decay_state: decay and bonus must be (d,)");
  auto q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  auto lam = lam_.to(q.scalar_type()).contiguous(), u = u_.to(q.scalar_type()).contiguous();
  at::Tensor s0;
  if (state_.has_value()) {
    s0 = state_->to(q.scalar_type()).contiguous();
    TORCH_CHECK(s0.dim() == 3 && s0.size(0) == 3 && s0.size(1) == q.size(0) &&
                    s0.size(2) == q.size(2),
                "aftlab::decay_state: state must be (3, B, d)");
  }
  auto y = at::empty_like(q);
  auto s1 = at::empty({3, q.size(0), q.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "decay_state", [&] {
    decay_fwd<scalar_t, false>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
                               v.data_ptr<scalar_t>(), lam.data_ptr<scalar_t>(),
                               u.data_ptr<scalar_t>(), nullptr, y.data_ptr<scalar_t>(), nullptr,
                               nullptr, q.size(0), q.size(1), q.size(2),
                               s0.defined() ? s0.data_ptr<scalar_t>() : nullptr,
                               s1.data_ptr<scalar_t>());
  });
  return {y, s1};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> decay_backward(
    const at::Tensor& gy_, const at::Tensor& q_, const at::Tensor& v_, const at::Tensor& y_,
    const at::Tensor& r_, const at::Tensor& w_) {
  check_qkv("aftlab::decay_backward", q_, y_, v_);
  TORCH_CHECK(r_.sizes() == q_.sizes() && w_.sizes() == q_.sizes(),
              "decay_backward: r and w were not saved");
  auto gy = gy_.contiguous(), q = q_.contiguous(), v = v_.contiguous(), y = y_.contiguous(),
       r = r_.contiguous(), w = w_.contiguous();
  auto dq = at::empty_like(q), dk = at::empty_like(q), dv = at::empty_like(q);
  auto dlam = at::empty({q.size(0), q.size(2)}, q.options());
  auto du = at::empty({q.size(0), q.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "decay_backward", [&] {
    decay_bwd<scalar_t>(gy.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                        y.data_ptr<scalar_t>(), r.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
                        dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(),
                        dv.data_ptr<scalar_t>(), dlam.data_ptr<scalar_t>(),
                        du.data_ptr<scalar_t>(), q.size(0), q.size(1), q.size(2));
  });
  return {dq, dk, dv, dlam.sum(0), du.sum(0)};
}

}  // namespace
}  // namespace aftlab

TORCH_LIBRARY_FRAGMENT(aftlab, m) {
  m.def("simple_causal(Tensor q, Tensor k, Tensor v, Tensor? mask, bool save) -> (Tensor, Tensor)");
  m.def("simple_causal_backward(Tensor gy, Tensor q, Tensor v, Tensor y, Tensor r)"
        " -> (Tensor, Tensor, Tensor)");
  m.def("simple_global(Tensor q, Tensor k, Tensor v, Tensor? mask) -> (Tensor, Tensor)");
  m.def("simple_global_backward(Tensor gy, Tensor q, Tensor k, Tensor v, Tensor stats,"
        " Tensor? mask) -> (Tensor, Tensor, Tensor)");
  m.def("decay(Tensor q, Tensor k, Tensor v, Tensor decay, Tensor bonus, Tensor? mask,"
        " bool save) -> (Tensor, Tensor, Tensor)");
  m.def("decay_backward(Tensor gy, Tensor q, Tensor v, Tensor y, Tensor r, Tensor w)"
        " -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("decay_state(Tensor q, Tensor k, Tensor v, Tensor decay, Tensor bonus, Tensor? state)"
        " -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(aftlab, CPU, m) {
  m.impl("simple_causal", &aftlab::simple_causal);
  m.impl("simple_causal_backward", &aftlab::simple_causal_backward);
  m.impl("simple_global", &aftlab::simple_global);
  m.impl("simple_global_backward", &aftlab::simple_global_backward);
  m.impl("decay", &aftlab::decay);
  m.impl("decay_backward", &aftlab::decay_backward);
  m.impl("decay_state", &aftlab::decay_state);
}
