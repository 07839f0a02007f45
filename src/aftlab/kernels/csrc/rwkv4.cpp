// One RWKV-4 block's decoding step in one call (aftlab.models.rwkv4.RWKV4Block._step):
//
//   u  = LN_1(x);   x_m = lerp(last_att, u, mu_m) for m = r, k, v
//   r, k, v = W_r x_r, W_k x_k, W_v x_v
//   o = max(p, u_b + k),  wkv = (e^{p-o} a + e^{u_b+k-o} v) / (e^{p-o} b + e^{u_b+k-o})
//   p' = max(p - lambda, k),  a' = e^{p-lambda-p'} a + e^{k-p'} v,  b' = e^{p-lambda-p'} b + e^{k-p'}
//   h  = x + s W_o (sigma(r) wkv)
//   u2 = LN_2(h);   c_m = lerp(last_ffn, u2, nu_m) for m = k, r
//   out = h + s sigma(W'_r c_r) * W'_v relu(W'_k c_k)^2
//
// with lambda = exp(min(time_decay, 30)) and u_b = time_bonus. The matrix products and layer
// norms are ATen's (for one token they read each weight once: the step is bound by that; the
// products in float32, bfloat16 and float16 are this file's `step_linear`); the elementwise work
// between them is fused into five loops, in the inputs' dtype where the Python step rounds to
// it and in float32 (float64 for float64 inputs) for the WKV, whose state (a, b, p) is kept in
// that dtype. The Python step is the reference (tests/kernels).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define AFTLAB_RWKV4_AVX2 1
#endif

namespace aftlab {
namespace {

constexpr int64_t GRAIN = 1 << 14;  // elements per task: one token's vectors run serially

// torch.lerp's formula (ATen's lerp kernel), so that the mixes round as the Python step's do.
template <typename A>
inline A lerp(A start, A end, A w) {
  const A diff = end - start;
  return std::abs(w) < A(0.5) ? start + w * diff : end - diff * (A(1) - w);
}

// out_m = lerp(last, u, mu_m) for each of the n mixes, (B, D) each, mu_m (D).
template <typename T>
void mixes(const T* u, const T* last, const std::vector<const T*>& mu, const std::vector<T*>& out,
           int64_t B, int64_t D) {
  using A = at::opmath_type<T>;
  at::parallel_for(0, B * D, GRAIN, [&](int64_t i0, int64_t i1) {
    for (size_t m = 0; m < mu.size(); ++m) {
      for (int64_t i = i0; i < i1; ++i) {
        out[m][i] = T(lerp<A>(A(last[i]), A(u[i]), A(mu[m][i % D])));
      }
    }
  });
}

// The WKV of one token and its state update, in the state's dtype S; y = sigma(r) wkv in T;
// lambda = exp(min(time_decay, 30)) from `decay` (D) in S, or `decay` itself if `is_lambda`
// (std::exp: within an ulp of ATen's vectorised exp, as are the WKV's own exponentials).
template <typename T, typename S>
void wkv_step(const T* r, const T* k, const T* v, const S* decay, bool is_lambda,
              const S* bonus, const S* a, const S* b, const S* p, T* y, S* a1, S* b1, S* p1,
              int64_t B, int64_t D) {
  std::vector<S> lam(decay, decay + D);
  for (int64_t c = 0; c < D && !is_lambda; ++c) lam[c] = std::exp(std::min(decay[c], S(30)));
  at::parallel_for(0, B * D, GRAIN, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t c = i % D;
      const S kk = S(k[i]), vv = S(v[i]), uk = bonus[c] + kk;
      const S o = std::max(p[i], uk);
      const S e1 = exp_nonpos(p[i] - o), e2 = exp_nonpos(uk - o);
      const S wkv = (e1 * a[i] + e2 * vv) / (e1 * b[i] + e2);
      y[i] = T(sigmoid(S(r[i])) * wkv);
      const S carried = p[i] - lam[c];
      const S pn = std::max(carried, kk);
      const S eo = exp_nonpos(carried - pn), en = exp_nonpos(kk - pn);
      a1[i] = eo * a[i] + en * vv;
      b1[i] = eo * b[i] + en;
      p1[i] = pn;
    }
  });
}

// out = x + s y, the product rounded to T as in the Python step (s = 2^-j: exact).
template <typename T>
void residual(const T* x, const T* y, T* out, double s, int64_t n) {
  using A = at::opmath_type<T>;
  at::parallel_for(0, n, GRAIN, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const T scaled = s == 1.0 ? y[i] : T(A(y[i]) * A(s));
      out[i] = T(A(x[i]) + A(scaled));
    }
  });
}

// k <- relu(k)^2 in place (the Python step: relu, then k * k, each rounded to T).
template <typename T>
void relu_square(T* k, int64_t n) {
  using A = at::opmath_type<T>;
  at::parallel_for(0, n, GRAIN, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const T z = k[i] > T(0) ? k[i] : T(0);
      k[i] = T(A(z) * A(z));
    }
  });
}

// out = h + s (sigma(r) * v), each product rounded to T as in the Python step (s = 2^-j: exact).
template <typename T>
void gated_residual(const T* h, const T* r, const T* v, T* out, double s, int64_t n) {
  using A = at::opmath_type<T>;
  at::parallel_for(0, n, GRAIN, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const T g = T(sigmoid(A(r[i])));
      const T gv = T(A(g) * A(v[i]));
      const T scaled = s == 1.0 ? gv : T(A(gv) * A(s));
      out[i] = T(A(h[i]) + A(scaled));
    }
  });
}

// sum_k w[k] x[k], w in float32, bfloat16 or float16, x float32, accumulated in float32.
template <typename T>
inline float dot_scalar(const T* w, const float* x, int64_t k0, int64_t K) {
  float s = 0.0f;
  for (int64_t k = k0; k < K; ++k) s += float(w[k]) * x[k];
  return s;
}

#ifdef AFTLAB_RWKV4_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // bfloat16 -> float32: the bits shifted up by 16
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// out[r] = sum_k w[r K + k] x[k] for R consecutive rows of W (the loads of x shared), in
// float32, each row prefetched 512 bytes ahead. On the Xeon, over the 12 blocks' matrices of
// the 169M model (median of 15): float32 19.0-19.9 GB/s against ATen's 17.5-17.8; bfloat16
// 12.1-13.7 against 6.4-6.5. (1, 2 or 4 rows at once and 1-2 KiB ahead were not faster
// beyond the run-to-run spread.)
template <int R, typename T>
inline void dots(const T* w, const float* x, int64_t K, float* out) {
#ifdef AFTLAB_RWKV4_AVX2
  constexpr int64_t ahead = 512 / sizeof(T);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
    for (int r = 0; r < R; ++r) {
      const T* row = w + r * K + k;
      _mm_prefetch(reinterpret_cast<const char*>(row + ahead), _MM_HINT_T0);
      acc[r] = _mm256_fmadd_ps(load8(row + 8), x1, _mm256_fmadd_ps(load8(row), x0, acc[r]));
    }
  }
  for (; k + 8 <= K; k += 8) {
    const __m256 x0 = _mm256_loadu_ps(x + k);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(load8(w + r * K + k), x0, acc[r]);
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + dot_scalar(w + r * K, x, k, K);
#else
  for (int r = 0; r < R; ++r) out[r] = dot_scalar(w + r * K, x, 0, K);
#endif
}

// y = x W^T, x (B, K) float32, W (N, K), y (B, N): groups of 8 rows of W over the threads.
template <typename T>
void few_rows(const at::Tensor& xf, const at::Tensor& W, at::Tensor& y) {
  constexpr int R = 8;
  const int64_t B = xf.size(0), K = xf.size(1), N = W.size(0);
  const T* w = W.data_ptr<T>();
  const float* xp = xf.data_ptr<float>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, (N + R - 1) / R, 1, [&](int64_t g0, int64_t g1) {
    float out[R];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * R, rows = std::min<int64_t>(R, N - n0);
      for (int64_t b = 0; b < B; ++b) {
        if (rows == R) {
          dots<R>(w + n0 * K, xp + b * K, K, out);
        } else {
          for (int64_t r = 0; r < rows; ++r) dots<1>(w + (n0 + r) * K, xp + b * K, K, out + r);
        }
        for (int64_t r = 0; r < rows; ++r) yp[b * N + n0 + r] = T(out[r]);
      }
    }
  });
}

// x W^T for x (B, K), W (N, K). A step's B is small: its products read each weight once and
// are bound by that. ATen's bfloat16/float16 product of a few rows runs well below the
// bandwidth on some CPUs (the Xeon: half of its float32's), and its float32 one a little
// below, so for B <= 16 these read W, 8 rows at a time, themselves (`dots`), with
// float32 accumulation and one rounding to T per output, as ATen's; float64, a larger B, or
// a build without AVX2, stay on ATen (MKL).
at::Tensor step_linear(const at::Tensor& x, const at::Tensor& W) {
  TORCH_CHECK(W.dim() == 2 && W.size(1) == x.size(1), "aftlab::rwkv4: weight shape");
  const auto dt = x.scalar_type();
#ifdef AFTLAB_RWKV4_AVX2
  const bool ours = dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf;
#else
  const bool ours = false;  // a scalar loop would be slower than ATen's
#endif
  if (!ours || x.size(0) > 16 || W.scalar_type() != dt) return at::linear(x, W);
  const at::Tensor xf = x.to(at::kFloat).contiguous(), Wc = W.contiguous();
  at::Tensor y = at::empty({x.size(0), W.size(0)}, x.options());
  if (dt == at::kFloat) {
    few_rows<float>(xf, Wc, y);
  } else if (dt == at::kBFloat16) {
    few_rows<at::BFloat16>(xf, Wc, y);
  } else {
    few_rows<at::Half>(xf, Wc, y);
  }
  return y;
}

// The op aftlab::rwkv4_linear: step_linear on its own, for the head (x (B, d), W (V, d)).
at::Tensor rwkv4_linear(const at::Tensor& x, const at::Tensor& W) {
  TORCH_CHECK(x.dim() == 2, "aftlab::rwkv4_linear: x must be (B, d)");
  return step_linear(x.contiguous(), W);
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "aftlab::rwkv4_step: ", what); }

// state: [last_att, a, b, p, last_ffn]; weights: [ln1_w, ln1_b, mix_r, mix_k, mix_v, W_r, W_k,
// W_v, W_o, time_decay, time_bonus, ln2_w, ln2_b, ffn_mix_k, ffn_mix_r, W'_k, W'_r, W'_v].
// Returns [out, u (the next last_att), a', b', p', u2 (the next last_ffn)].
std::vector<at::Tensor> rwkv4_step(const at::Tensor& x_in, at::TensorList state,
                                   at::TensorList w, double eps, double scale) {
  check(state.size() == 5 && w.size() == 18, "expects 5 state tensors and 18 weights");
  check(x_in.dim() == 2, "x must be (B, d)");
  const at::Tensor x = x_in.contiguous();
  const int64_t B = x.size(0), D = x.size(1);
  const auto st = at::toOpMathType(x.scalar_type());  // the WKV state's dtype
  for (const auto& t : state) check(t.dim() == 2 && t.size(0) == B && t.size(1) == D, "state shape");
  check(state[0].scalar_type() == x.scalar_type() && state[4].scalar_type() == x.scalar_type(),
        "the token-shift states must have x's dtype");
  for (int i = 1; i < 4; ++i) check(state[i].scalar_type() == st, "a, b, p must be float32 (float64)");
  for (const auto& t : w) check(t.scalar_type() == x.scalar_type() || t.dim() == 1, "weight dtype");

  const at::Tensor last_att = state[0].contiguous(), last_ffn = state[4].contiguous();
  const at::Tensor a = state[1].contiguous(), b = state[2].contiguous(), p = state[3].contiguous();
  // lambda in the loop when time_decay is S (as usual), else rounded as the Python step does
  const bool is_lambda = w[9].scalar_type() != st;
  const at::Tensor decay =
      is_lambda ? at::exp(w[9].clamp_max(30.0)).to(st).contiguous() : w[9].contiguous();
  const at::Tensor bonus = w[10].to(st).contiguous();
  auto vec = [&](const at::Tensor& t) { return t.to(x.scalar_type()).contiguous(); };
  const at::Tensor mr = vec(w[2]), mk = vec(w[3]), mv = vec(w[4]), fk = vec(w[13]), fr = vec(w[14]);

  const at::Tensor u = at::layer_norm(x, {D}, w[0], w[1], eps);
  at::Tensor xr = at::empty_like(u), xk = at::empty_like(u), xv = at::empty_like(u);
  at::Tensor a1 = at::empty_like(a), b1 = at::empty_like(b), p1 = at::empty_like(p);
  at::Tensor y = at::empty_like(u), h, u2, cr = at::empty_like(u), ck = at::empty_like(u), out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rwkv4_step", [&] {
    using S = at::opmath_type<scalar_t>;
    mixes<scalar_t>(u.data_ptr<scalar_t>(), last_att.data_ptr<scalar_t>(),
                    {mr.data_ptr<scalar_t>(), mk.data_ptr<scalar_t>(), mv.data_ptr<scalar_t>()},
                    {xr.data_ptr<scalar_t>(), xk.data_ptr<scalar_t>(), xv.data_ptr<scalar_t>()}, B, D);
    const at::Tensor r = step_linear(xr, w[5]), k = step_linear(xk, w[6]),
                     v = step_linear(xv, w[7]);
    wkv_step<scalar_t, S>(r.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                          decay.data_ptr<S>(), is_lambda, bonus.data_ptr<S>(), a.data_ptr<S>(), b.data_ptr<S>(),
                          p.data_ptr<S>(), y.data_ptr<scalar_t>(), a1.data_ptr<S>(),
                          b1.data_ptr<S>(), p1.data_ptr<S>(), B, D);
    const at::Tensor att = step_linear(y, w[8]);
    h = at::empty_like(x);
    residual<scalar_t>(x.data_ptr<scalar_t>(), att.data_ptr<scalar_t>(), h.data_ptr<scalar_t>(),
                       scale, B * D);
    u2 = at::layer_norm(h, {D}, w[11], w[12], eps);
    mixes<scalar_t>(u2.data_ptr<scalar_t>(), last_ffn.data_ptr<scalar_t>(),
                    {fk.data_ptr<scalar_t>(), fr.data_ptr<scalar_t>()},
                    {ck.data_ptr<scalar_t>(), cr.data_ptr<scalar_t>()}, B, D);
    at::Tensor kf = step_linear(ck, w[15]);
    relu_square<scalar_t>(kf.data_ptr<scalar_t>(), kf.numel());
    const at::Tensor rf = step_linear(cr, w[16]), vf = step_linear(kf, w[17]);
    out = at::empty_like(h);
    gated_residual<scalar_t>(h.data_ptr<scalar_t>(), rf.data_ptr<scalar_t>(),
                             vf.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), scale, B * D);
  });
  return {out, u, a1, b1, p1, u2};
}

}  // namespace
}  // namespace aftlab

TORCH_LIBRARY_FRAGMENT(aftlab, m) {
  m.def("rwkv4_step(Tensor x, Tensor[] state, Tensor[] weights, float eps, float scale)"
        " -> Tensor[]");
  m.def("rwkv4_linear(Tensor x, Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(aftlab, CPU, m) {
  m.impl("rwkv4_step", &aftlab::rwkv4_step);
  m.impl("rwkv4_linear", &aftlab::rwkv4_linear);
}
