// A decode attention kernel for CPUs, ``tlt_lightning::decode_attention`` (the op is defined in Python):
// grouped-query attention of a few new tokens per row over a key/value cache. Each (row, key/value head)
// is one task: its keys and values are read once, in place (strided views of the cache are not copied),
// for all the query heads and tokens they serve; scores, softmax and the weighted sum in fp32 (with
// AVX-512 BF16 dot products, the probabilities are rounded to bf16 first, as PyTorch's bf16 attention does).
//
// Built at run time by tlt_lightning.kernels with -march=native: AVX-512 code for bf16 with head dims
// 64 and 128 where the CPU has AVX-512 (F, BW, VL), a plain loop the compiler vectorises otherwise.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TLT_AVX512 1
#include <immintrin.h>
#endif

namespace {

using bf16 = c10::BFloat16;
constexpr int64_t kMaxHeadDim = 256;

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

// Where one (row, key/value head) of decode_attention reads and writes: G = g * Q queries (query i is
// head i / Q of the group, token i % Q) over L keys; element strides, rows of D contiguous values.
template <typename T>
struct Task {
  const T *q, *k, *v;
  const bool* mask;
  T* out;
  int64_t q_head, q_token, k_row, v_row, m_token, m_key, o_head, o_token;
  int64_t Q, D, L, G;
  const T* query(int64_t i) const { return q + (i / Q) * q_head + (i % Q) * q_token; }
  const bool* allowed(int64_t i) const { return mask + (i % Q) * m_token; }
  T* output(int64_t i) const { return out + (i / Q) * o_head + (i % Q) * o_token; }
};

// Values per query of probabilities in bf16, for keys taken in pairs: even, with a zero past the last key.
inline int64_t probs_stride(int64_t L) { return L + 2 - L % 2; }

// scores[i * L + l]: query i's softmax over the keys it may attend (0 elsewhere; all 0 if none).
template <typename T>
void softmax_rows(float* scores, const Task<T>& t);

#if defined(TLT_AVX512)
inline __m512 load_float(const bf16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// exp(x) for x <= 0 (and -inf): 2^n * 2^f, f in [-1/2, 1/2], 2^f by its Taylor series to degree 7 (~1e-8 relative).
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  const __m512 out = _mm512_scalef_ps(p, n);
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-200.f), _CMP_LT_OQ), out, _mm512_setzero_ps());
}

using tlt_kernels::sum4;

inline void prefetch_row(const bf16* row, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + at, _MM_HINT_T0);
}
constexpr int64_t kAhead = 16;  // rows prefetched ahead

#if defined(__AVX512BF16__)
// Scores of four queries as bf16 dot products (AVX-512 BF16): products exact, sums in fp32, then scaled.
template <int C>
void scores4(const Task<bf16>& t, int64_t i0, float* scores, float scale) {
  constexpr int P = C / 2;  // 32 bf16 values a register
  __m512bh q[4][P];
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < P; ++c)
      q[r][c] = (__m512bh)(i0 + r < t.G ? _mm512_loadu_si512(t.query(i0 + r) + 32 * c) : _mm512_setzero_si512());
  for (int64_t l = 0; l < t.L; ++l) {
    const bf16* key = t.k + l * t.k_row;
    prefetch_row(key + kAhead * t.k_row, 32 * C);
    __m512bh row[P];
    for (int c = 0; c < P; ++c) row[c] = (__m512bh)_mm512_loadu_si512(key + 32 * c);
    __m512 a[4];
    for (int r = 0; r < 4; ++r) {
      a[r] = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[r][0], row[0]);
      for (int c = 1; c < P; ++c) a[r] = _mm512_dpbf16_ps(a[r], q[r][c], row[c]);
    }
    alignas(16) float sums[4];
    _mm_store_ps(sums, _mm_mul_ps(sum4(a[0], a[1], a[2], a[3]), _mm_set1_ps(scale)));
    for (int64_t r = 0; r < 4 && i0 + r < t.G; ++r) scores[(i0 + r) * t.L + l] = sums[r];
  }
}

// Rows [i0, i0 + rows) of probabilities times the values, two keys a step (AVX-512 BF16): each register
// of the pair's values interleaved (unpacklo/hi) meets the pair's probabilities rounded to bf16 (as the
// batched products' attention rounds them). Lane 4 j + m of register 2 c (2 c + 1) holds
// d = 32 c + 8 j + m (+ 4); the output is put back in order.
template <int C, int QV>
void values_pairs(const Task<bf16>& t, int64_t i0, int64_t rows, const uint16_t* probs, int64_t stride) {
  constexpr int P = C / 2;
  __m512 acc[QV][C];
  for (auto& a : acc)
    for (auto& x : a) x = _mm512_setzero_ps();
  for (int64_t l = 0; l < t.L; l += 2) {
    const bf16* first = t.v + l * t.v_row;
    const bf16* second = l + 1 < t.L ? first + t.v_row : nullptr;
    prefetch_row(first + kAhead * t.v_row, 32 * C);
    prefetch_row(first + (kAhead + 1) * t.v_row, 32 * C);
    __m512i lo[P], hi[P];
    for (int c = 0; c < P; ++c) {
      const __m512i a = _mm512_loadu_si512(first + 32 * c);
      const __m512i b = second ? _mm512_loadu_si512(second + 32 * c) : _mm512_setzero_si512();
      lo[c] = _mm512_unpacklo_epi16(a, b);
      hi[c] = _mm512_unpackhi_epi16(a, b);
    }
    for (int64_t r = 0; r < rows; ++r) {
      uint32_t pair;
      std::memcpy(&pair, probs + (i0 + r) * stride + l, sizeof pair);  // stride even, a zero past L
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int c = 0; c < P; ++c) {
        acc[r][2 * c] = _mm512_dpbf16_ps(acc[r][2 * c], p, (__m512bh)lo[c]);
        acc[r][2 * c + 1] = _mm512_dpbf16_ps(acc[r][2 * c + 1], p, (__m512bh)hi[c]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    bf16* o = t.output(i0 + r);
    for (int c = 0; c < P; ++c) {
      alignas(64) float lo[16], hi[16];
      _mm512_store_ps(lo, acc[r][2 * c]);
      _mm512_store_ps(hi, acc[r][2 * c + 1]);
      for (int i = 0; i < 16; ++i) {
        o[32 * c + 8 * (i / 4) + i % 4] = bf16(lo[i]);
        o[32 * c + 8 * (i / 4) + 4 + i % 4] = bf16(hi[i]);
      }
    }
  }
}
#endif

// The bf16 task with AVX-512 for D = 16 * C: scores four queries at a time (one pass over the keys for
// a decode step of grouped heads), values accumulated in registers, 16 / C queries at a time; with
// AVX-512 BF16, both as bf16 dot products.
template <int C>
void attend_avx512(const Task<bf16>& t, float* scores, float* qf, uint16_t* probs, float scale) {
  constexpr int64_t D = 16 * C, QV = 16 / C;
  const int64_t G = t.G, L = t.L;
#if defined(__AVX512BF16__)
  for (int64_t i0 = 0; i0 < G; i0 += 4) scores4<C>(t, i0, scores, scale);
  softmax_rows(scores, t);
  const int64_t stride = probs_stride(L);
  for (int64_t i = 0; i < G; ++i) {
    const float* s = scores + i * L;
    uint16_t* out = probs + i * stride;
    int64_t l = 0;
    for (; l + 16 <= L; l += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + l), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + l)));
    for (; l < L; ++l) out[l] = bf16(s[l]).x;
    for (; l < stride; ++l) out[l] = 0;
  }
  for (int64_t i0 = 0; i0 < G; i0 += QV) values_pairs<C, QV>(t, i0, std::min(QV, G - i0), probs, stride);
#else
  for (int64_t i = 0; i < (G + 3) / 4 * 4; ++i)
    for (int64_t c = 0; c < C; ++c)
      _mm512_storeu_ps(qf + i * D + 16 * c, i < G ? _mm512_mul_ps(load_float(t.query(i) + 16 * c), _mm512_set1_ps(scale))
                                                  : _mm512_setzero_ps());
  for (int64_t i0 = 0; i0 < G; i0 += 4) {
    const float* qg = qf + i0 * D;
    for (int64_t l = 0; l < L; ++l) {
      const bf16* key = t.k + l * t.k_row;
      prefetch_row(key + kAhead * t.k_row, 2 * D);
      __m512 row[C], a[4];
      for (int c = 0; c < C; ++c) row[c] = load_float(key + 16 * c);
      for (int r = 0; r < 4; ++r) {
        a[r] = _mm512_mul_ps(_mm512_loadu_ps(qg + r * D), row[0]);
        for (int c = 1; c < C; ++c) a[r] = _mm512_fmadd_ps(_mm512_loadu_ps(qg + r * D + 16 * c), row[c], a[r]);
      }
      alignas(16) float sums[4];
      _mm_store_ps(sums, sum4(a[0], a[1], a[2], a[3]));
      for (int64_t r = 0; r < 4 && i0 + r < G; ++r) scores[(i0 + r) * L + l] = sums[r];
    }
  }
  softmax_rows(scores, t);
  for (int64_t i0 = 0; i0 < G; i0 += QV) {
    const int64_t rows = std::min(QV, G - i0);
    __m512 acc[QV][C];
    for (auto& a : acc)
      for (auto& x : a) x = _mm512_setzero_ps();
    for (int64_t l = 0; l < L; ++l) {
      const bf16* value = t.v + l * t.v_row;
      prefetch_row(value + kAhead * t.v_row, 2 * D);
      __m512 row[C];
      for (int c = 0; c < C; ++c) row[c] = load_float(value + 16 * c);
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 p = _mm512_set1_ps(scores[(i0 + r) * L + l]);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(p, row[c], acc[r][c]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      bf16* o = t.output(i0 + r);
      alignas(64) float tmp[D];
      for (int c = 0; c < C; ++c) _mm512_store_ps(tmp + 16 * c, acc[r][c]);
      for (int64_t d = 0; d < D; ++d) o[d] = bf16(tmp[d]);
    }
  }
#endif
}
#endif

template <typename T>
void softmax_rows(float* scores, const Task<T>& t) {
  const int64_t G = t.G, L = t.L, m_key = t.m_key;
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < G; ++i) {
    float* s = scores + i * L;
    const bool* a = t.allowed(i);
    float top = kNone;
    int64_t l = 0;
#if defined(TLT_AVX512)
    if (m_key == 1) {
      __m512 most = _mm512_set1_ps(kNone);
      for (; l + 16 <= L; l += 16) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + l));
        const __m512 x = _mm512_mask_blend_ps(_mm_test_epi8_mask(bytes, bytes), _mm512_set1_ps(kNone), _mm512_loadu_ps(s + l));
        _mm512_storeu_ps(s + l, x);
        most = _mm512_max_ps(most, x);
      }
      top = _mm512_reduce_max_ps(most);
    }
#endif
    for (; l < L; ++l) {
      s[l] = a[l * m_key] ? s[l] : kNone;
      top = std::max(top, s[l]);
    }
    if (top == kNone) {  // no key allowed
      std::fill(s, s + L, 0.f);
      continue;
    }
    float total = 0.f;
    l = 0;
#if defined(TLT_AVX512)
    __m512 sum = _mm512_setzero_ps();
    for (; l + 16 <= L; l += 16) {
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + l), _mm512_set1_ps(top)));
      _mm512_storeu_ps(s + l, e);
      sum = _mm512_add_ps(sum, e);
    }
    total = _mm512_reduce_add_ps(sum);
#endif
    for (; l < L; ++l) {
      s[l] = std::exp(s[l] - top);
      total += s[l];
    }
    const float inv = 1.f / total;
    for (l = 0; l < L; ++l) s[l] *= inv;
  }
}

template <typename T>
void attend(const Task<T>& t, float scale, std::vector<float>& scratch) {
  const int64_t G = t.G, D = t.D, L = t.L;
  const int64_t Gp = (G + 3) / 4 * 4;
  scratch.resize(G * L + Gp * D + G * D + D + (G * probs_stride(L) + 1) / 2);
  float* scores = scratch.data();
  float* qf = scores + G * L;  // the queries in fp32, scaled (padded to a multiple of 4 rows)
  float* acc = qf + Gp * D;
  float* row = acc + G * D;  // one key or value row in fp32
  uint16_t* probs = reinterpret_cast<uint16_t*>(row + D);  // the softmax in bf16 (AVX-512 BF16)
#if defined(TLT_AVX512)
  if constexpr (std::is_same_v<T, bf16>) {
    if (D == 64) return attend_avx512<4>(t, scores, qf, probs, scale);
    if (D == 128) return attend_avx512<8>(t, scores, qf, probs, scale);
  }
#endif
  for (int64_t i = 0; i < G; ++i) {
    to_float(t.query(i), qf + i * D, D);
    for (int64_t d = 0; d < D; ++d) qf[i * D + d] *= scale;
  }
  for (int64_t l = 0; l < L; ++l) {
    to_float(t.k + l * t.k_row, row, D);
    for (int64_t i = 0; i < G; ++i) {
      float sum = 0.f;
      const float* qi = qf + i * D;
#pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < D; ++d) sum += qi[d] * row[d];
      scores[i * L + l] = sum;
    }
  }
  softmax_rows(scores, t);
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t l = 0; l < L; ++l) {
    to_float(t.v + l * t.v_row, row, D);
    for (int64_t i = 0; i < G; ++i) {
      const float p = scores[i * L + l];
      if (p == 0.f) continue;
      float* a = acc + i * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += p * row[d];
    }
  }
  for (int64_t i = 0; i < G; ++i) {
    T* o = t.output(i);
    for (int64_t d = 0; d < D; ++d) o[d] = T(acc[i * D + d]);
  }
}

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const at::Tensor& mask, double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && mask.dim() == 4,
              "decode_attention: query, key, value and mask must be 4-d");
  const int64_t n = query.size(0), heads = query.size(1), Q = query.size(2), D = query.size(3);
  const int64_t kv_heads = key.size(1), L = key.size(2);
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(0) == n && key.size(3) == D,
              "decode_attention: key and value must be [n, H_kv, L, D], got ", key.sizes(), " and ", value.sizes());
  TORCH_CHECK(heads % kv_heads == 0, "decode_attention: query heads must be a multiple of key/value heads");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.size(0) == n && mask.size(1) == 1 && mask.size(2) == Q &&
                  mask.size(3) == L, "decode_attention: mask must be bool [n, 1, Q, L], got ", mask.sizes());
  TORCH_CHECK(D <= kMaxHeadDim, "decode_attention: head dim at most ", kMaxHeadDim);
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
              "decode_attention: query, key and value must share a dtype");
  // Rows of D contiguous values (the cache's layout); copies only where they are not.
  const auto rows = [](const at::Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); };
  const at::Tensor q = rows(query), k = rows(key), v = rows(value);
  at::Tensor out = at::empty({n, heads, Q, D}, query.options());
  const int64_t g = heads / kv_heads;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, query.scalar_type(), "decode_attention", [&] {
    at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / kv_heads, h = task % kv_heads;
        const Task<scalar_t> t{
            q.const_data_ptr<scalar_t>() + b * q.stride(0) + h * g * q.stride(1),
            k.const_data_ptr<scalar_t>() + b * k.stride(0) + h * k.stride(1),
            v.const_data_ptr<scalar_t>() + b * v.stride(0) + h * v.stride(1),
            mask.const_data_ptr<bool>() + b * mask.stride(0),
            out.mutable_data_ptr<scalar_t>() + b * out.stride(0) + h * g * out.stride(1),
            q.stride(1), q.stride(2), k.stride(2), v.stride(2), mask.stride(2), mask.stride(3),
            out.stride(1), out.stride(2), Q, D, L, g * Q};
        attend<scalar_t>(t, static_cast<float>(scale), scratch);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(TLT_NAMESPACE, CPU, m) {
  m.impl("decode_attention", &decode_attention);
}
