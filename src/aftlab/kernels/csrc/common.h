// Shared by the kernels: exponentials of non-positive numbers, the sigmoid, value scaling and
// the padding-mask pointer.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

namespace aftlab {

// Element functions called inside `omp simd` loops: always inlined, so that a loop never falls
// back to scalar calls when its caller grows past the compiler's inlining budget.
#if defined(__GNUC__) || defined(__clang__)
#define AFTLAB_ELEM inline __attribute__((always_inline))
#else
#define AFTLAB_ELEM inline
#endif

// exp(x) for x <= 0 (-inf -> 0, NaN -> NaN). double: libm. float: Cephes' polynomial with the
// round-to-nearest magic constant, branch-free so loops over channels vectorise; values below
// exp(-87) (about 1.6e-38) are flushed to 0.
AFTLAB_ELEM double exp_nonpos(double x) { return std::exp(x); }
AFTLAB_ELEM float exp_nonpos(float x) {
  const float lo = -87.0f;
  const float xc = x < lo ? lo : x;
  const float t = xc * 1.44269504088896341f + 12582912.0f;  // 1.5 * 2^23: round to integer
  const float nf = t - 12582912.0f;
  int32_t ti;
  std::memcpy(&ti, &t, 4);
  const int32_t n = ti - 0x4B400000;
  const float r = xc - nf * 0.693359375f + nf * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * (r * r) + r + 1.0f;
  const int32_t bits = (n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  const float res = e * scale;
  return x < lo ? 0.0f : res;
}

// 2^-e with 2^e >= n + 1: values are summed times this, so that a sum of n weights <= 1 times
// values never overflows (docs/kernels.md, "Numerical range").
template <typename T>
inline T value_scale(int64_t n) {
  int e = 0;
  while (e < 62 && (int64_t(1) << e) < n + 1) ++e;
  return T(std::ldexp(1.0, -e));
}

// x clamped to [-vm, vm]; a NaN x stays NaN (std::max/min return their first argument then).
template <typename T>
AFTLAB_ELEM T clamp_abs(T x, T vm) {
  return std::min(std::max(x, -vm), vm);
}

// sigma(x) = 1 / (1 + exp(-x)) with only exp of -|x|.
template <typename T>
AFTLAB_ELEM T sigmoid(T x) {
  const T e = exp_nonpos(-std::abs(x));
  const T inv = T(1) / (T(1) + e);
  return x >= T(0) ? inv : e * inv;
}

// The padding mask (B, T) as a contiguous bool buffer kept alive in `keep`; nullptr if absent.
inline const bool* mask_ptr(const std::optional<at::Tensor>& mask, at::Tensor& keep,
                     const at::Tensor& q) {
  if (!mask.has_value()) return nullptr;
  keep = mask->to(at::kBool).contiguous();
  TORCH_CHECK(keep.dim() == 2 && keep.size(0) == q.size(0) && keep.size(1) == q.size(1),
              "padding mask must be (B, T)");
  return keep.data_ptr<bool>();
}

}  // namespace aftlab
