// ``tlt_lightning::adamw_bf16_`` (the op is defined in Python): one AdamW step of a bf16 parameter, fused
// into one pass over the parameter, its gradient and its two bf16 moments. In fp32 as torchao's AdamW
// computes it (the moments by lerp, rounded to nearest when stored; the update from their fp32 values), the
// parameter rounded to bf16 stochastically: away from zero with the probability of its fp32 value's distance
// from the bf16 next to it toward zero, so that an update smaller than a bf16 step is kept in expectation. The random bits are a
// hash of the element's index and the step's seed: the result depends on neither the thread count nor the
// order. No temporaries; the loop vectorises (-O3 -march=native). Built with decode_attention.cpp by
// tlt_lightning.kernels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace {

inline float widen(uint16_t x) {
  const uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint32_t bits_of(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

inline uint16_t round_nearest(float f) {  // to nearest, ties to even (as torch's bf16 conversion)
  const uint32_t bits = bits_of(f);
  return uint16_t((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

inline uint32_t mix(uint32_t h) {  // murmur3's finalizer: every input bit moves every output bit
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

// Adding 16 uniform bits to the low half carries into the bf16 with the probability of the low half / 2^16.
inline uint16_t round_stochastic(float f, uint32_t random) {
  return uint16_t((bits_of(f) + (random >> 16)) >> 16);
}

void adamw_bf16_(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                 double lr, double beta1, double beta2, double weight_decay, double eps, double step, int64_t seed) {
  for (const at::Tensor* t : {&param, &grad, &exp_avg, &exp_avg_sq}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16 && t->is_contiguous(),
                "adamw_bf16_: contiguous bf16 CPU tensors only");
    TORCH_CHECK(t->numel() == param.numel(), "adamw_bf16_: the gradient and moments have the parameter's size");
  }
  uint16_t* p = reinterpret_cast<uint16_t*>(param.data_ptr());
  const uint16_t* g = reinterpret_cast<const uint16_t*>(grad.const_data_ptr());
  uint16_t* m = reinterpret_cast<uint16_t*>(exp_avg.data_ptr());
  uint16_t* v = reinterpret_cast<uint16_t*>(exp_avg_sq.data_ptr());
  const float decay = float(1.0 - lr * weight_decay), w1 = float(1.0 - beta1), w2 = float(1.0 - beta2);
  const float step_size = float(lr / (1.0 - std::pow(beta1, step)));
  const float bias2_sqrt = float(std::sqrt(1.0 - std::pow(beta2, step))), epsf = float(eps);
  const uint32_t seed_lo = uint32_t(uint64_t(seed)), seed_hi = uint32_t(uint64_t(seed) >> 32);
  at::parallel_for(0, param.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
#pragma GCC ivdep
    for (int64_t i = begin; i < end; ++i) {
      const float gi = widen(g[i]), mi_old = widen(m[i]), vi_old = widen(v[i]);
      const float mi = mi_old + w1 * (gi - mi_old), vi = vi_old + w2 * (gi * gi - vi_old);
      m[i] = round_nearest(mi);
      v[i] = round_nearest(vi);
      const float pi = widen(p[i]) * decay - step_size * mi / (std::sqrt(vi) / bias2_sqrt + epsf);
      p[i] = round_stochastic(pi, mix(mix(uint32_t(i) ^ seed_lo) + seed_hi));
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(TLT_NAMESPACE, CPU, m) {
  m.impl("adamw_bf16_", &adamw_bf16_);
}
