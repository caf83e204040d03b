// ``tlt_lightning::few_rows_linear`` (the op is defined in Python): ``F.linear`` for a few input rows (the
// tokens of one row's verify: 2-16), reading each weight row once for all of them. oneDNN's bf16 product
// for a few rows re-streams the weights at well below the memory's speed; here each weight row streams
// from memory once, in order, and meets a tile of up to four input rows (kept in cache) as it goes, with
// AVX-512 BF16 dot products (products exact, sums in fp32), then the bias in fp32 and one rounding to the
// output dtype, as F.linear in bf16 rounds. (Reading four weight rows interleaved streamed at half the speed.)
//
// Built with decode_attention.cpp by tlt_lightning.kernels (-march=native); where the CPU lacks AVX-512
// BF16, or the input size is not a multiple of 32, a plain loop in fp32 (also correct).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "simd.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#define TLT_FEW_ROWS_BF16 1
#endif

namespace {

using bf16 = c10::BFloat16;
constexpr int64_t kTile = 4;  // weight rows summed together (sum4), input rows a tile

// out[m, n] for n in [n0, n1): a plain loop in fp32, any dtype and size.
template <typename T>
void linear_loop(const T* x, const T* w, const T* bias, T* out, int64_t M, int64_t K, int64_t N, int64_t n0,
                 int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float acc = bias ? static_cast<float>(bias[n]) : 0.f;
      for (int64_t k = 0; k < K; ++k) acc += static_cast<float>(x[m * K + k]) * static_cast<float>(w[n * K + k]);
      out[m * N + n] = static_cast<T>(acc);
    }
}

#if defined(TLT_FEW_ROWS_BF16)
using tlt_kernels::sum4;

// sums[t][r] = x[t] . w[r] for T input rows and the kTile weight rows at w (K a multiple of 32), one weight
// row after the other; the loops have fixed trip counts, so the T x kTile accumulators stay in registers.
template <int T>
inline void tile(const bf16* x, const bf16* w, int64_t K, float (*sums)[kTile]) {
  __m512 acc[T][kTile];
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 4
    for (int r = 0; r < kTile; ++r) acc[t][r] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int r = 0; r < kTile; ++r) {
    for (int64_t k = 0; k < K; k += 32) {
      const __m512bh wk = (__m512bh)_mm512_loadu_si512(w + r * K + k);
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t)
        acc[t][r] = _mm512_dpbf16_ps(acc[t][r], wk, (__m512bh)_mm512_loadu_si512(x + t * K + k));
    }
  }
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t) _mm_storeu_ps(sums[t], sum4(acc[t][0], acc[t][1], acc[t][2], acc[t][3]));
}

// Rows [n0, n1) of the output (n1 - n0 a multiple of kTile), K a multiple of 32: each block of kTile weight
// rows is read from memory once, then from cache for the next tiles of input rows (more than four).
void linear_bf16(const bf16* x, const bf16* w, const bf16* bias, bf16* out, int64_t M, int64_t K, int64_t N,
                 int64_t n0, int64_t n1) {
  float sums[kTile][kTile];
  for (int64_t n = n0; n < n1; n += kTile) {
    for (int64_t m = 0; m < M; m += kTile) {
      const int64_t tokens = std::min(kTile, M - m);
      const bf16 *xm = x + m * K, *wn = w + n * K;
      switch (tokens) {
        case 1: tile<1>(xm, wn, K, sums); break;
        case 2: tile<2>(xm, wn, K, sums); break;
        case 3: tile<3>(xm, wn, K, sums); break;
        default: tile<4>(xm, wn, K, sums); break;
      }
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t r = 0; r < kTile; ++r)
          out[(m + t) * N + n + r] = static_cast<bf16>(sums[t][r] + (bias ? static_cast<float>(bias[n + r]) : 0.f));
    }
  }
}
#endif

at::Tensor few_rows_linear(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.device().is_cpu() && weight.device().is_cpu(), "few_rows_linear: CPU tensors only");
  TORCH_CHECK(weight.dim() == 2 && input.size(-1) == weight.size(1), "few_rows_linear: input [..., K] and weight [N, K]");
  TORCH_CHECK(input.scalar_type() == weight.scalar_type(), "few_rows_linear: input and weight of one dtype");
  const int64_t K = weight.size(1), N = weight.size(0), M = input.numel() / K;
  auto sizes = input.sizes().vec();
  sizes.back() = N;
  const at::Tensor x = input.contiguous(), w = weight.contiguous();
  const at::Tensor b = bias.has_value() && bias->defined() ? bias->to(input.scalar_type()).contiguous() : at::Tensor();
  at::Tensor out = at::empty(sizes, input.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "few_rows_linear", [&] {
    const scalar_t* bp = b.defined() ? b.const_data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, (N + kTile - 1) / kTile, 16, [&](int64_t begin, int64_t end) {
      const int64_t n0 = begin * kTile, n1 = std::min(N, end * kTile);
#if defined(TLT_FEW_ROWS_BF16)
      if (std::is_same_v<scalar_t, bf16> && K % 32 == 0) {  // the casts are no-ops where it runs
        const int64_t tiled = n0 + (n1 - n0) / kTile * kTile;  // the rest (N % kTile rows) by the loop
        linear_bf16(x.const_data_ptr<bf16>(), w.const_data_ptr<bf16>(), reinterpret_cast<const bf16*>(bp),
                    out.mutable_data_ptr<bf16>(), M, K, N, n0, tiled);
        linear_loop<scalar_t>(x.const_data_ptr<scalar_t>(), w.const_data_ptr<scalar_t>(), bp,
                              out.mutable_data_ptr<scalar_t>(), M, K, N, tiled, n1);
        return;
      }
#endif
      linear_loop<scalar_t>(x.const_data_ptr<scalar_t>(), w.const_data_ptr<scalar_t>(), bp,
                            out.mutable_data_ptr<scalar_t>(), M, K, N, n0, n1);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(TLT_NAMESPACE, CPU, m) {
  m.impl("few_rows_linear", &few_rows_linear);
}
