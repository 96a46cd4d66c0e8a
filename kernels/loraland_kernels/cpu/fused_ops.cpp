// LoRA-Land's fused CPU ops: the per-layer work around the GEMMs, one pass over memory each.
//
// Built on the machine that runs it (kernels/loraland_kernels/cpu_build.py: g++ -O3 -march=native), loaded with
// torch.ops.load_library, called as torch.ops.loraland.*; kernels/loraland_kernels/fused.py is the Python face
// and keeps a torch fallback for each op. Rounding follows Hugging Face's op order in the model dtype: every
// intermediate that HF rounds to bf16/fp16 is rounded here too (T-typed temporaries), and the build turns off
// fused multiply-add contraction, so fp32 results differ from HF only by the order of long sums.
//
// Threads: at::parallel_for, i.e. torch's own OpenMP team (the same libgomp, torch.get_num_threads()).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <immintrin.h>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

template <typename T>
inline float f32(T x) {
  return static_cast<float>(x);
}

// sum of a[i] * b[i] with 8 independent partial sums (the compiler keeps them in one vector register)
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline float sum_squares(const float* a, int64_t n) { return dot(a, a, n); }

// silu as torch computes it, bit for bit: torch's elementwise loop runs x / (1 + exp(-x)) with Sleef's vector exp
// on blocks of two vectors from each row's start and with libm's expf on the tail, so the same split is kept
// here (vec_bytes: the vector width of torch's CPU capability, 32 for AVX2, 64 for AVX512, 0 for none).
// (GeLU-tanh is not fused: torch's vector formula could not be matched bit for bit.)
#if defined(__AVX2__)
extern "C" __m256 Sleef_expf8_u10(__m256);
#endif
#if defined(__AVX512F__)
extern "C" __m512 Sleef_expf16_u10(__m512);
#endif

inline float silu_scalar(float x) { return x / (1.f + std::exp(-x)); }

// silu over n floats in place, n a multiple of the vector width `lanes` (8 or 16)
inline void silu_vector(float* x, int64_t n, int lanes) {
#if defined(__AVX512F__)
  if (lanes == 16) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), v));
      _mm512_storeu_ps(x + i, _mm512_div_ps(v, _mm512_add_ps(one, e)));
    }
    return;
  }
#endif
#if defined(__AVX2__)
  if (lanes == 8) {
    const __m256 one = _mm256_set1_ps(1.f);
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      const __m256 e = Sleef_expf8_u10(_mm256_sub_ps(_mm256_setzero_ps(), v));
      _mm256_storeu_ps(x + i, _mm256_div_ps(v, _mm256_add_ps(one, e)));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) x[i] = silu_scalar(x[i]);
}

// the element types the vector loads below read (and the vector paths take); fp16 runs the scalar loops
template <typename T>
constexpr bool kVectorT = std::is_same<T, float>::value || std::is_same<T, c10::BFloat16>::value;

#if defined(__AVX2__)
// eight values as fp32 from fp32 or bf16 memory (bf16 is the top half of an fp32: widened by a shift)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float hsum8(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}
// the sums of four vectors, as four lanes: two rounds of horizontal adds
inline __m128 hsum8x4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#endif
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// a 16-lane vector folded to 8 lanes with the same total
inline __m256 fold16(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#endif

// q . k for attention scores: one vector FMA chain where AVX2 is built (attention is not bit-matched to torch:
// its reductions run in another order anyway), the portable sum otherwise
inline float dot_fast(const float* a, const float* b, int64_t n) {
#if defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum8(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
#else
  return dot(a, b, n);
#endif
}

// x[i] = exp(x[i] - m) over n floats, returning their sum (Sleef's vector exp where built)
inline float exp_shifted(float* x, int64_t n, float m) {
  int64_t i = 0;
  float total = 0.f;
#if defined(__AVX2__)
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = Sleef_expf8_u10(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, acc);
  for (float v : lanes) total += v;
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    total += x[i];
  }
  return total;
}

// into L2, not L1: a T0 prefetch holds one of L1's few miss buffers until its line arrives; the expert op's weight
// stream ran ~30 % slower with it (a step's 780 MB fp32 in 34 vs 26 ms on a 2-core Zen 4, any distance tried)
inline void prefetch(const void* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }

#if defined(__AVX2__)
// The query heads that share a KV head (GQA), G <= 4 of them at once: each cached slot's slice is loaded (and
// widened, for bf16) once for all G. q: the G heads' queries, fp32, one after another; d % 8 == 0 (AVX2) or
// d % 16 == 0 (the AVX512 twins below); per head g, its n scores (then probabilities) are s[g * n + i].

// s[g * n + i] = (q_g . (rows[i] + off)) * sc, R slots at a time: G * R sums, R keys and a query fit AVX2's 16
// registers
template <int G, typename T>
inline void group_scores256(const float* q, const T* const* rows, int64_t off, int64_t n, int64_t d, float sc,
                            float* s) {
  constexpr int R = G <= 2 ? 4 : 2;
  const __m128 scv = _mm_set1_ps(sc);
  int64_t i = 0;
  for (; i + R <= n; i += R) {
    __m256 acc[G][R];
    for (auto& a : acc)
      for (auto& v : a) v = _mm256_setzero_ps();
    for (int64_t j = 0; j < d; j += 8) {
      __m256 k[R];
      for (int r = 0; r < R; ++r) k[r] = load8(rows[i + r] + off + j);
      for (int g = 0; g < G; ++g) {
        const __m256 qv = _mm256_loadu_ps(q + g * d + j);
        for (int r = 0; r < R; ++r) acc[g][r] = _mm256_fmadd_ps(qv, k[r], acc[g][r]);
      }
    }
    if constexpr (R == 4) {
      for (int g = 0; g < G; ++g)
        _mm_storeu_ps(s + g * n + i, _mm_mul_ps(hsum8x4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), scv));
    } else {  // two heads' two slots per fold: lanes (g, i), (g, i + 1), (g + 1, i), (g + 1, i + 1)
      int g = 0;
      for (; g + 1 < G; g += 2) {
        const __m128 v = _mm_mul_ps(hsum8x4(acc[g][0], acc[g][1], acc[g + 1][0], acc[g + 1][1]), scv);
        _mm_storel_pi(reinterpret_cast<__m64*>(s + g * n + i), v);
        _mm_storeh_pi(reinterpret_cast<__m64*>(s + (g + 1) * n + i), v);
      }
      if (g < G)
        for (int r = 0; r < R; ++r) s[g * n + i + r] = hsum8(acc[g][r]) * sc;
    }
  }
  for (; i < n; ++i) {
    __m256 acc[G];
    for (auto& v : acc) v = _mm256_setzero_ps();
    for (int64_t j = 0; j < d; j += 8) {
      const __m256 k = load8(rows[i] + off + j);
      for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * d + j), k, acc[g]);
    }
    for (int g = 0; g < G; ++g) s[g * n + i] = hsum8(acc[g]) * sc;
  }
}

// out[g * d + c] = sum_i p[g * n + i] * (rows[i] + off)[c] for the 8 * C columns c from out's start
template <int G, int C, typename T>
inline void group_weighted_cols256(const float* p, const T* const* rows, int64_t off, int64_t n, int64_t d,
                                   float* out) {
  __m256 acc[G][C];
  for (auto& a : acc)
    for (auto& v : a) v = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    __m256 v[C];
    for (int c = 0; c < C; ++c) v[c] = load8(rows[i] + off + 8 * c);
    for (int g = 0; g < G; ++g) {
      const __m256 pv = _mm256_set1_ps(p[g * n + i]);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm256_fmadd_ps(pv, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + g * d + 8 * c, acc[g][c]);
}
#endif

#if defined(__AVX512F__)
// s[g * n + i] = (q_g . (rows[i] + off)) * sc, four slots at a time
template <int G, typename T>
inline void group_scores512(const float* q, const T* const* rows, int64_t off, int64_t n, int64_t d, float sc,
                            float* s) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    __m512 acc[G][4];
    for (auto& a : acc)
      for (auto& v : a) v = _mm512_setzero_ps();
    for (int64_t j = 0; j < d; j += 16) {
      __m512 k[4];
      for (int r = 0; r < 4; ++r) k[r] = load16(rows[i + r] + off + j);
      for (int g = 0; g < G; ++g) {
        const __m512 qv = _mm512_loadu_ps(q + g * d + j);
        for (int r = 0; r < 4; ++r) acc[g][r] = _mm512_fmadd_ps(qv, k[r], acc[g][r]);
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m128 sums = hsum8x4(fold16(acc[g][0]), fold16(acc[g][1]), fold16(acc[g][2]), fold16(acc[g][3]));
      _mm_storeu_ps(s + g * n + i, _mm_mul_ps(sums, _mm_set1_ps(sc)));
    }
  }
  for (; i < n; ++i) {
    __m512 acc[G];
    for (auto& v : acc) v = _mm512_setzero_ps();
    for (int64_t j = 0; j < d; j += 16) {
      const __m512 k = load16(rows[i] + off + j);
      for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * d + j), k, acc[g]);
    }
    for (int g = 0; g < G; ++g) s[g * n + i] = _mm512_reduce_add_ps(acc[g]) * sc;
  }
}

// out[g * d + c] = sum_i p[g * n + i] * (rows[i] + off)[c] for the 16 * C columns c from out's start
template <int G, int C, typename T>
inline void group_weighted_cols512(const float* p, const T* const* rows, int64_t off, int64_t n, int64_t d,
                                   float* out) {
  __m512 acc[G][C];
  for (auto& a : acc)
    for (auto& v : a) v = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = load16(rows[i] + off + 16 * c);
    for (int g = 0; g < G; ++g) {
      const __m512 pv = _mm512_set1_ps(p[g * n + i]);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(pv, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + g * d + 16 * c, acc[g][c]);
}

#endif

#if defined(__AVX2__)
// attention of G query heads over one KV head's slices (at off): scores, softmax, the weighted sum of values,
// each head's d outputs written as T (s: G * n floats of scratch, acc: G * d); 16-lane vectors where built and d
// allows, else 8-lane
template <int G, typename T>
inline void group_attention(const float* q, const T* const* krows, const T* const* vrows, int64_t off, int64_t n,
                            int64_t d, float sc, float* s, float* acc, T* o) {
#if defined(__AVX512F__)
  const bool wide = d % 16 == 0;
  if (wide)
    group_scores512<G>(q, krows, off, n, d, sc, s);
  else
#endif
    group_scores256<G>(q, krows, off, n, d, sc, s);
  float inv[G];
  for (int g = 0; g < G; ++g) {
    float* sg = s + g * n;
    inv[g] = 1.f / exp_shifted(sg, n, *std::max_element(sg, sg + n));
  }
  int64_t j = 0;
#if defined(__AVX512F__)
  if (wide) {  // 64 columns per pass over the slots, then 16
    for (; j + 64 <= d; j += 64) group_weighted_cols512<G, 4>(s, vrows, off + j, n, d, acc + j);
    for (; j < d; j += 16) group_weighted_cols512<G, 1>(s, vrows, off + j, n, d, acc + j);
  }
#endif
  constexpr int C = G == 1 ? 8 : G == 2 ? 4 : 2;  // 8-lane column vectors per pass: G * C sums in 16 registers
  for (; j + 8 * C <= d; j += 8 * C) group_weighted_cols256<G, C>(s, vrows, off + j, n, d, acc + j);
  for (; j < d; j += 8) group_weighted_cols256<G, 1>(s, vrows, off + j, n, d, acc + j);
  for (int g = 0; g < G; ++g)
    for (int64_t c = 0; c < d; ++c) o[g * d + c] = static_cast<T>(acc[g * d + c] * inv[g]);
}
#endif

// Every cache line of n cached slots (`bytes` each) read once, back to back, before the attention math reads them
// again: these loads wait on nothing, so the core keeps many misses in flight, where the math's own loads, queued
// behind its FMA chains, kept few (a decode row's slots sit in blocks scattered over the cache). Measured on a
// 2-core Zen 4 VM, bf16, SmolLM2's shape, 64 rows: the op read its cache at 7 GB/s without this pass and 11-12
// with it; prefetch instructions a chunk of slots ahead, at any distance tried, did not help there.
template <typename T>
inline void touch(const T* const* rows, int64_t n, int64_t bytes) {
  for (int64_t r = 0; r < n; ++r) {
    const volatile char* p = reinterpret_cast<const volatile char*>(rows[r]);
    for (int64_t b = 0; b < bytes; b += 64) static_cast<void>(p[b]);
  }
}

// ---- elementwise vectors: fp32 lanes, loaded from and stored to T, rounded as torch rounds T -------------------

#if defined(__AVX512F__) || defined(__AVX2__)
#if defined(__AVX512F__)
struct Vec {
  using R = __m512;
  static constexpr int64_t lanes = 16;
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static R load(const c10::BFloat16* p) { return load16(p); }
  static void store(float* p, R v) { _mm512_storeu_ps(p, v); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static R zero() { return _mm512_setzero_ps(); }
  // v rounded to bf16 (to nearest, ties to even; NaN to torch's quiet NaN), still in fp32 lanes
  static R round_bf16(R v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
                                       _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_blend_ps(nan, _mm512_castsi512_ps(r), _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)));
  }
  static void store(c10::BFloat16* p, R v) {  // v rounded to bf16 here, then its top halves stored
    const __m512i u = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(u));
  }
};
#else
struct Vec {
  using R = __m256;
  static constexpr int64_t lanes = 8;
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static R load(const c10::BFloat16* p) { return load8(p); }
  static void store(float* p, R v) { _mm256_storeu_ps(p, v); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static R zero() { return _mm256_setzero_ps(); }
  static R round_bf16(R v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))),
                                       _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan);
  }
  static void store(c10::BFloat16* p, R v) {
    const __m256i u = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v)), 16);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
};
#endif
// the value v would have once stored as T (fp32: itself)
template <typename T>
inline Vec::R rounded(Vec::R v) {
  if constexpr (std::is_same<T, float>::value) return v;
  else return Vec::round_bf16(v);
}
#endif

// the first `done` of n elements that the vector loops below cover (the rest run scalar)
template <typename T>
inline int64_t vector_part(int64_t n) {
#if defined(__AVX512F__) || defined(__AVX2__)
  if constexpr (kVectorT<T>) return n - n % Vec::lanes;
#endif
  return 0;
}

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
  if constexpr (kVectorT<T>)
    for (; i < vector_part<T>(n); i += Vec::lanes) Vec::store(dst + i, Vec::load(src + i));
#endif
  for (; i < n; ++i) dst[i] = f32(src[i]);
}

// rows per task of at::parallel_for for rows of `width` elements: about torch's own grain (32k elements), so that
// a small call runs on the calling thread instead of waking (and on a busy machine, waiting for) the team
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, width)); }

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "loraland fused op: ", name, " must be on the CPU");
}

// ---- decode attention over the paged cache -------------------------------------------------------------

// q [T, H, d] (rows may be strided, each row's heads contiguous); kc/vc [blocks, bs, Hkv, d] contiguous;
// decode_idx [Bd] rows of q/out that decode; block_tables [Bd, nb]; ctx_lens [Bd]; out [T, H * d] contiguous.
// Row b attends to positions [max(0, len - window), len) of its own blocks (window 0: no window); only those
// slots are read, so stale or padded slots never enter the sums.
template <typename T>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                           const at::Tensor& decode_idx, const at::Tensor& block_tables,
                           const at::Tensor& ctx_lens, int64_t window, double scale, const at::Tensor& out) {
  const int64_t H = q.size(1), d = q.size(2), Hkv = kc.size(2), bs = kc.size(1);
  const int64_t Bd = decode_idx.size(0), nb = block_tables.size(1), group = H / Hkv;
  const int64_t q_row = q.stride(0), out_row = out.stride(0);
  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* idx = decode_idx.data_ptr<int64_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  constexpr bool is_float = std::is_same<T, float>::value;
  const int64_t kv = Hkv * d;  // one slot's keys (or values) of every KV head: contiguous
  // one task per decode row, all its heads together: its slots are read from memory once, then from cache
  at::parallel_for(0, Bd, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * d), rowf(kv), acc(H * d), scores, m(H), z(H);
    auto slot_of = [&](const T* base, int64_t slot) -> const float* {
      const T* r = base + slot * kv;
      if constexpr (is_float) return reinterpret_cast<const float*>(r);
      to_float(r, rowf.data(), kv);
      return rowf.data();
    };
    std::vector<const T*> krows, vrows;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t row = idx[b], len = lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0, n = len - start;
      const int64_t* table = bt + b * nb;
      to_float(qp + row * q_row, qf.data(), H * d);
      scores.resize(H * n);
#if defined(__AVX2__)
      if constexpr (kVectorT<T>) {
        if (d % 8 == 0) {  // per KV head group, its scores then its weighted sum of values, straight from the cache
          krows.resize(n);
          vrows.resize(n);
          for (int64_t t = start; t < len; ++t) {
            const int64_t slot = table[t / bs] * bs + t % bs;
            krows[t - start] = kp + slot * kv;
            vrows[t - start] = vp + slot * kv;
          }
          T* o = op + row * out_row;
          touch(krows.data(), n, kv * static_cast<int64_t>(sizeof(T)));
          touch(vrows.data(), n, kv * static_cast<int64_t>(sizeof(T)));
          for (int64_t h = 0; h < H;) {  // query head h reads KV head h / group (HF's repeat_kv): a group together
            const int64_t g = std::min<int64_t>(4, (h / group + 1) * group - h), off = (h / group) * d;
            const float* qh = &qf[h * d];
            float *sh = &scores[h * n], *a = &acc[h * d];
            T* oh = o + h * d;
            switch (g) {
              case 4: group_attention<4>(qh, krows.data(), vrows.data(), off, n, d, sc, sh, a, oh); break;
              case 3: group_attention<3>(qh, krows.data(), vrows.data(), off, n, d, sc, sh, a, oh); break;
              case 2: group_attention<2>(qh, krows.data(), vrows.data(), off, n, d, sc, sh, a, oh); break;
              default: group_attention<1>(qh, krows.data(), vrows.data(), off, n, d, sc, sh, a, oh);
            }
            h += g;
          }
          continue;
        }
      }
#endif
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      for (int64_t t = start; t < len; ++t) {
        const float* k = slot_of(kp, table[t / bs] * bs + t % bs);
        for (int64_t h = 0; h < H; ++h) {  // query head h reads KV head h / group (HF's repeat_kv)
          const float s_ = dot_fast(&qf[h * d], k + (h / group) * d, d) * sc;
          scores[h * n + (t - start)] = s_;
          m[h] = std::max(m[h], s_);
        }
      }
      for (int64_t h = 0; h < H; ++h) z[h] = exp_shifted(&scores[h * n], n, m[h]);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = start; t < len; ++t) {
        const float* v = slot_of(vp, table[t / bs] * bs + t % bs);
        for (int64_t h = 0; h < H; ++h) {
          const float p = scores[h * n + (t - start)];
          const float* vh = v + (h / group) * d;
          float* a = &acc[h * d];
          for (int64_t j = 0; j < d; ++j) a[j] += p * vh[j];
        }
      }
      T* o = op + row * out_row;
      for (int64_t h = 0; h < H; ++h) {
        const float inv = 1.f / z[h];
        for (int64_t j = 0; j < d; ++j) o[h * d + j] = static_cast<T>(acc[h * d + j] * inv);
      }
    }
  });
}

void decode_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                      const at::Tensor& decode_idx, const at::Tensor& block_tables, const at::Tensor& ctx_lens,
                      int64_t window, double scale, const at::Tensor& out) {
  for (auto* t : {&q, &kc, &vc, &out}) check_cpu(*t, "attention input");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [T, H, d], rows packed");
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.dim() == 4, "kc/vc must be contiguous 4-D");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(1) == q.size(1) * q.size(2), "out [T, H*d]");
  TORCH_CHECK(q.size(1) % kc.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.scalar_type() == kc.scalar_type() && q.scalar_type() == out.scalar_type(), "dtypes differ");
  const auto idx = decode_idx.to(at::kLong).contiguous();
  const auto bt = block_tables.to(at::kLong).contiguous();
  const auto lens = ctx_lens.to(at::kLong).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    decode_attention_impl<scalar_t>(q, kc, vc, idx, bt, lens, window, scale, out);
  });
}

// ---- rotary on q and k, then k and v into the cache ----------------------------------------------------

// qkv [T, W] (row stride free, columns contiguous): q heads [0, H*d), k heads [H*d, (H+Hkv)*d), v after.
// cos/sin [T, 1, half] (rotates each head's first 2 * half dims, HF's rotate_half convention). Then k and v of
// token t go to cache slot slot_mapping[t] of kc/vc [blocks, bs, Hkv, d].
template <typename T>
void rope_cache_impl(const at::Tensor& qkv, int64_t H, int64_t Hkv, int64_t d, const at::Tensor& cos,
                     const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& kc, const at::Tensor& vc) {
  const int64_t Tn = qkv.size(0), row = qkv.stride(0), half = cos.size(-1);
  T* x = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  T* kcp = kc.data_ptr<T>();
  T* vcp = vc.data_ptr<T>();
  const int64_t kv = Hkv * d;
  at::parallel_for(0, Tn, grain((H + 2 * Hkv) * d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* r = x + t * row;
      const T* c = cp + t * half;
      const T* s = sp + t * half;
      for (int64_t h = 0; h < H + Hkv; ++h) {
        T* x1 = r + h * d;
        T* x2 = x1 + half;
        int64_t j = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
        if constexpr (kVectorT<T>) {
          for (; j < vector_part<T>(half); j += Vec::lanes) {
            const auto u1 = Vec::load(x1 + j), u2 = Vec::load(x2 + j), cv = Vec::load(c + j), sv = Vec::load(s + j);
            const auto a1 = rounded<T>(Vec::mul(u1, cv)), b1 = rounded<T>(Vec::mul(u2, sv));
            const auto a2 = rounded<T>(Vec::mul(u2, cv)), b2 = rounded<T>(Vec::mul(u1, sv));
            Vec::store(x1 + j, Vec::sub(a1, b1));
            Vec::store(x2 + j, Vec::add(a2, b2));
          }
        }
#endif
        for (; j < half; ++j) {
          // HF: x * cos + rotate_half(x) * sin, each product and the sum rounded to T
          const T a1 = static_cast<T>(f32(x1[j]) * f32(c[j])), b1 = static_cast<T>(f32(x2[j]) * f32(s[j]));
          const T a2 = static_cast<T>(f32(x2[j]) * f32(c[j])), b2 = static_cast<T>(f32(x1[j]) * f32(s[j]));
          x1[j] = static_cast<T>(f32(a1) - f32(b1));
          x2[j] = static_cast<T>(f32(a2) + f32(b2));
        }
      }
      const int64_t slot = sl[t];
      std::copy(r + H * d, r + H * d + kv, kcp + slot * kv);
      std::copy(r + H * d + kv, r + H * d + 2 * kv, vcp + slot * kv);
    }
  });
}

void rope_cache(const at::Tensor& qkv, int64_t H, int64_t Hkv, int64_t d, const at::Tensor& cos,
                const at::Tensor& sin, const at::Tensor& slot_mapping, const at::Tensor& kc, const at::Tensor& vc) {
  for (auto* t : {&qkv, &cos, &sin, &kc, &vc}) check_cpu(*t, "rope input");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) >= (H + 2 * Hkv) * d, "qkv [T, W]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == qkv.size(0) * cos.size(-1),
              "cos/sin [T, 1, half] contiguous");
  TORCH_CHECK(2 * cos.size(-1) <= d, "rotary dims exceed head_dim");
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.size(2) * kc.size(3) == Hkv * d, "kc/vc layout");
  TORCH_CHECK(qkv.scalar_type() == cos.scalar_type() && qkv.scalar_type() == kc.scalar_type(), "dtypes differ");
  const auto slots = slot_mapping.to(at::kLong).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_cache", [&] {
    rope_cache_impl<scalar_t>(qkv, H, Hkv, d, cos, sin, slots, kc, vc);
  });
}

// ---- RMSNorm, with the residual add before it ----------------------------------------------------------

// Per row of x [N, n]: if `residual` is given, residual += x first and the norm reads the sum (x is then the
// delta and residual the stream, updated in place). Llama style: w * T(x * rsqrt(mean(x^2) + eps)) with the
// weight multiply in T; gemma style: T(x * rsqrt(...) * w) with w = 1 + weight already formed, in fp32.
template <typename T, typename W>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& residual, bool add, const at::Tensor& w, double eps,
                   bool gemma, const at::Tensor& out) {
  const int64_t N = x.size(0), n = x.size(1);
  const int64_t xs = x.stride(0), rs = add ? residual.stride(0) : 0, os = out.stride(0);
  const T* xp = x.data_ptr<T>();
  T* rp = add ? residual.data_ptr<T>() : nullptr;
  const W* wp = w.data_ptr<W>();
  T* op = out.data_ptr<T>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, N, grain(2 * n), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(n);
    for (int64_t i = begin; i < end; ++i) {
      constexpr bool vector = kVectorT<T> && kVectorT<W>;
      const int64_t done = vector ? vector_part<T>(n) : 0;  // elements the vector loops cover
      if (add) {
        T* r = rp + i * rs;
        const T* dx = xp + i * xs;
        int64_t j = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
        if constexpr (vector)
          for (; j < done; j += Vec::lanes) {
            const auto sum = rounded<T>(Vec::add(Vec::load(r + j), Vec::load(dx + j)));
            Vec::store(r + j, sum);
            Vec::store(buf.data() + j, sum);
          }
#endif
        for (; j < n; ++j) {
          r[j] = static_cast<T>(f32(r[j]) + f32(dx[j]));
          buf[j] = f32(r[j]);
        }
      } else {
        to_float(xp + i * xs, buf.data(), n);
      }
      const float inv = 1.f / std::sqrt(sum_squares(buf.data(), n) / static_cast<float>(n) + e);
      T* o = op + i * os;
      int64_t j = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
      if constexpr (vector) {
        const auto iv = Vec::set1(inv);
        for (; j < done; j += Vec::lanes) {
          const auto xv = Vec::load(buf.data() + j), wv = Vec::load(wp + j);
          Vec::store(o + j, gemma ? Vec::mul(Vec::mul(xv, iv), wv) : Vec::mul(wv, rounded<T>(Vec::mul(xv, iv))));
        }
      }
#endif
      if (gemma) {
        for (; j < n; ++j) o[j] = static_cast<T>(buf[j] * inv * f32(wp[j]));
      } else {
        for (; j < n; ++j) o[j] = static_cast<T>(f32(wp[j]) * f32(static_cast<T>(buf[j] * inv)));
      }
    }
  });
}

void rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& w, double eps,
              bool gemma, const at::Tensor& out) {
  for (auto* t : {&x, &w, &out}) check_cpu(*t, "rms_norm input");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1, "x/out [N, n] rows");
  TORCH_CHECK(w.is_contiguous() && w.numel() == x.size(1), "weight [n]");
  const bool add = residual.has_value();
  at::Tensor r = add ? *residual : x;
  if (add) TORCH_CHECK(r.dim() == 2 && r.stride(1) == 1 && r.scalar_type() == x.scalar_type(), "residual rows");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    if (w.scalar_type() == at::kFloat && x.scalar_type() != at::kFloat) {
      rms_norm_impl<scalar_t, float>(x, r, add, w, eps, gemma, out);
    } else {
      TORCH_CHECK(w.scalar_type() == x.scalar_type(), "weight dtype must be the input's or float32");
      rms_norm_impl<scalar_t, scalar_t>(x, r, add, w, eps, gemma, out);
    }
  });
}

// ---- silu(gate) * up ------------------------------------------------------------------------------------

// gate_up [N, 2I] (gate first) -> out [N, I] = T(T(silu(gate)) * up)
template <typename T>
void silu_mul_impl(const at::Tensor& gu, int64_t vec_bytes, const at::Tensor& out) {
  const int64_t N = gu.size(0), I = gu.size(1) / 2, gs = gu.stride(0), os = out.stride(0);
  const T* gp = gu.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int lanes = static_cast<int>(vec_bytes / 4);  // floats per vector
  // torch's loop takes 2 vectors of T per step: 2 * vec_bytes / sizeof(T) elements; the rest go scalar
  const int64_t step = vec_bytes > 0 ? 2 * vec_bytes / static_cast<int64_t>(sizeof(T)) : 1;
  const int64_t bulk = vec_bytes > 0 ? I - I % step : 0;
  at::parallel_for(0, N, grain(3 * I), [&](int64_t begin, int64_t end) {
    std::vector<float> a(I);
    for (int64_t i = begin; i < end; ++i) {
      const T* g = gp + i * gs;
      const T* u = g + I;
      T* o = op + i * os;
      to_float(g, a.data(), I);
      silu_vector(a.data(), bulk, lanes);
      for (int64_t j = bulk; j < I; ++j) a[j] = silu_scalar(a[j]);
      int64_t j = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
      if constexpr (kVectorT<T>)
        for (; j < vector_part<T>(I); j += Vec::lanes)
          Vec::store(o + j, Vec::mul(rounded<T>(Vec::load(a.data() + j)), Vec::load(u + j)));
#endif
      for (; j < I; ++j) o[j] = static_cast<T>(f32(static_cast<T>(a[j])) * f32(u[j]));
    }
  });
}

void silu_mul(const at::Tensor& gate_up, int64_t vec_bytes, const at::Tensor& out) {
  check_cpu(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0, "gate_up [N, 2I]");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(1) * 2 == gate_up.size(1), "out [N, I]");
  bool ok = vec_bytes == 0;
#if defined(__AVX2__)
  ok = ok || vec_bytes == 32;
#endif
#if defined(__AVX512F__)
  ok = ok || vec_bytes == 64;
#endif
  TORCH_CHECK(ok, "silu_mul: vector width ", vec_bytes, " bytes not built for this CPU");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_impl<scalar_t>(gate_up, vec_bytes, out);
  });
}

// ---- greedy sampling: each row's argmax and whether the row holds inf or NaN -------------------------------

// logits [n, V] fp32 (rows contiguous) -> out [n, 2] int64: torch.argmax's index (the first maximum; a NaN counts
// as the maximum, its first one wins) and 1 if the row holds a non-finite value, else 0. One read of the logits
// for the maximum and the flag, then a scan (from cache) for the first index that holds it.
void greedy_rows(const at::Tensor& logits, const at::Tensor& out) {
  check_cpu(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.scalar_type() == at::kFloat, "logits [n, V] fp32");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == logits.size(0) && out.size(1) == 2 && out.is_contiguous() &&
                  out.scalar_type() == at::kLong, "out [n, 2] int64");
  TORCH_CHECK(logits.size(1) > 0, "greedy_rows: empty rows");
  const int64_t n = logits.size(0), V = logits.size(1), ls = logits.stride(0);
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = lp + r * ls;
      float mx = -std::numeric_limits<float>::infinity();
      bool nan = false, nonfinite = false;
      int64_t j = 0;
#if defined(__AVX512F__)
      __m512 m = _mm512_set1_ps(mx);
      __mmask16 bad = 0;
      const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
      for (; j + 16 <= V; j += 16) {
        const __m512 v = _mm512_loadu_ps(x + j);
        m = _mm512_max_ps(m, v);
        // |v| == inf, or v unordered (NaN): not (|v| < inf)
        bad |= _mm512_cmp_ps_mask(_mm512_abs_ps(v), inf, _CMP_NLT_UQ);
      }
      mx = _mm512_reduce_max_ps(m);
      nonfinite = bad != 0;
#elif defined(__AVX2__)
      __m256 m = _mm256_set1_ps(mx), bad = _mm256_setzero_ps();
      const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
      const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
      for (; j + 8 <= V; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        m = _mm256_max_ps(m, v);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_and_ps(v, abs_mask), inf, _CMP_NLT_UQ));
      }
      float lanes[8];
      _mm256_storeu_ps(lanes, m);
      for (float v : lanes) mx = std::max(mx, v);
      nonfinite = _mm256_movemask_ps(bad) != 0;
#endif
      for (; j < V; ++j) {
        mx = std::max(mx, x[j]);
        nonfinite = nonfinite || !std::isfinite(x[j]);
      }
      if (nonfinite)
        for (int64_t i = 0; i < V && !nan; ++i) nan = std::isnan(x[i]);
      int64_t at = 0;
#if defined(__AVX512F__)
      if (!nan) {  // the first lane equal to the maximum, 16 at a time
        const __m512 mv = _mm512_set1_ps(mx);
        for (; at + 16 <= V; at += 16) {
          const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + at), mv, _CMP_EQ_OQ);
          if (hit) {
            at += __builtin_ctz(hit);
            break;
          }
        }
      }
#elif defined(__AVX2__)
      if (!nan) {  // the first lane equal to the maximum, 8 at a time
        const __m256 mv = _mm256_set1_ps(mx);
        for (; at + 8 <= V; at += 8) {
          const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + at), mv, _CMP_EQ_OQ));
          if (hit) {
            at += __builtin_ctz(hit);
            break;
          }
        }
      }
#endif
      for (; at < V; ++at)
        if (nan ? std::isnan(x[at]) : x[at] == mx) break;
      op[2 * r] = at;
      op[2 * r + 1] = nonfinite ? 1 : 0;
    }
  });
}

// ---- the expert GEMMs of a decode step -------------------------------------------------------------------

// A decode step sends a few rows to each of many experts: every expert's weights are read once from memory for a
// handful of dot products, so the op is bound by streaming weights. One call covers all the experts of a layer
// (no per-expert GEMM call, no per-expert packing), threads take contiguous runs of (expert, row block) items,
// and each weight row is read once and dotted with up to four token rows in registers.

// weight rows read ahead by software prefetch (into L2): one stream per thread does not fill the memory bus from
// two cores (on a 2-core Zen 4 that reads 35 GB/s: 18 GB/s without prefetch, 22 into L1, 29-31 into L2)
constexpr int64_t kAhead = 4;

// res[j] = w . x_j for the M token rows x_j (x + j * K), w of type W (float or bf16), sums in fp32
template <int M, typename W>
inline void row_dots(const W* w, const float* x, int64_t K, float* res) {
  int64_t k = 0;
#if defined(__AVX512F__)
  __m512 a[M];
  for (int j = 0; j < M; ++j) a[j] = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) {
    prefetch(w + kAhead * K + k);
    const __m512 wv = load16(w + k);
    for (int j = 0; j < M; ++j) a[j] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + j * K + k), a[j]);
  }
  for (int j = 0; j < M; ++j) res[j] = _mm512_reduce_add_ps(a[j]);
#elif defined(__AVX2__)
  __m256 a[M];
  for (int j = 0; j < M; ++j) a[j] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    prefetch(w + kAhead * K + k);
    const __m256 wv = load8(w + k);
    for (int j = 0; j < M; ++j) a[j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j * K + k), a[j]);
  }
  for (int j = 0; j < M; ++j) res[j] = hsum8(a[j]);
#else
  for (int j = 0; j < M; ++j) res[j] = 0.f;
#endif
  for (; k < K; ++k) {
    const float wk = f32(w[k]);
    for (int j = 0; j < M; ++j) res[j] += wk * x[j * K + k];
  }
}

// res[j] = w0 . x_j, res[M + j] = w1 . x_j: two weight rows at once (twice the loads in flight)
template <int M, typename W>
inline void row_dots2(const W* w0, const W* w1, const float* x, int64_t K, float* res) {
#if defined(__AVX512F__)
  __m512 a[M], b[M];
  for (int j = 0; j < M; ++j) a[j] = b[j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    prefetch(w0 + kAhead * K + k);
    prefetch(w1 + kAhead * K + k);
    const __m512 v0 = load16(w0 + k), v1 = load16(w1 + k);
    for (int j = 0; j < M; ++j) {
      const __m512 xv = _mm512_loadu_ps(x + j * K + k);
      a[j] = _mm512_fmadd_ps(v0, xv, a[j]);
      b[j] = _mm512_fmadd_ps(v1, xv, b[j]);
    }
  }
  for (int j = 0; j < M; ++j) {
    res[j] = _mm512_reduce_add_ps(a[j]);
    res[M + j] = _mm512_reduce_add_ps(b[j]);
  }
  for (; k < K; ++k)
    for (int j = 0; j < M; ++j) {
      res[j] += f32(w0[k]) * x[j * K + k];
      res[M + j] += f32(w1[k]) * x[j * K + k];
    }
#else
  row_dots<M>(w0, x, K, res);
  row_dots<M>(w1, x, K, res + M);
#endif
}

// x [P, K] (rows sorted by expert), w [E, N, K], spans [S, 3] (expert, first row, end row) -> out [P, N]:
// out[r] = x[r] @ w[e]^T for the rows r of each span
template <typename T>
void expert_matmul_impl(const at::Tensor& x, const at::Tensor& w, const at::Tensor& spans, const at::Tensor& out) {
  const int64_t K = x.size(1), N = w.size(1), S = spans.size(0), os = out.stride(0);
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // the token rows in fp32 once (bf16: widened)
  const float* xp = xf.data_ptr<float>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* sp = spans.data_ptr<int64_t>();
  constexpr int64_t NB = 16;  // weight rows per work item
  const int64_t blocks = (N + NB - 1) / NB;
  at::parallel_for(0, S * blocks, 1, [&](int64_t begin, int64_t end) {
    float res[8];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / blocks, n0 = (item % blocks) * NB, n1 = std::min(N, n0 + NB);
      const int64_t e = sp[3 * s], r0 = sp[3 * s + 1], r1 = sp[3 * s + 2];
      int64_t n = n0;
      for (; n + 2 <= n1; n += 2) {  // two weight rows at a time, the token rows in tiles of four
        const T* w0 = wp + (e * N + n) * K;
        for (int64_t r = r0; r < r1; r += 4) {
          const int64_t m = std::min<int64_t>(4, r1 - r);
          const float* xr = xp + r * K;
          switch (m) {
            case 4: row_dots2<4>(w0, w0 + K, xr, K, res); break;
            case 3: row_dots2<3>(w0, w0 + K, xr, K, res); break;
            case 2: row_dots2<2>(w0, w0 + K, xr, K, res); break;
            default: row_dots2<1>(w0, w0 + K, xr, K, res);
          }
          for (int64_t j = 0; j < m; ++j) {
            op[(r + j) * os + n] = static_cast<T>(res[j]);
            op[(r + j) * os + n + 1] = static_cast<T>(res[m + j]);
          }
        }
      }
      for (; n < n1; ++n) {
        const T* wr = wp + (e * N + n) * K;
        for (int64_t r = r0; r < r1; r += 4) {
          const int64_t m = std::min<int64_t>(4, r1 - r);
          const float* xr = xp + r * K;
          switch (m) {
            case 4: row_dots<4>(wr, xr, K, res); break;
            case 3: row_dots<3>(wr, xr, K, res); break;
            case 2: row_dots<2>(wr, xr, K, res); break;
            default: row_dots<1>(wr, xr, K, res);
          }
          for (int64_t j = 0; j < m; ++j) op[(r + j) * os + n] = static_cast<T>(res[j]);
        }
      }
    }
  });
}

void expert_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& spans, const at::Tensor& out) {
  check_cpu(x, "x");
  check_cpu(w, "w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.is_contiguous() && x.size(1) == w.size(2), "x [P, K], w [E, N, K]");
  TORCH_CHECK(spans.dim() == 2 && spans.size(1) == 3 && spans.scalar_type() == at::kLong && spans.is_contiguous(),
              "spans [S, 3] int64");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == w.size(1) && out.stride(1) == 1,
              "out [P, N]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && out.scalar_type() == w.scalar_type(), "one dtype");
  const int64_t* sp = spans.data_ptr<int64_t>();
  for (int64_t s = 0; s < spans.size(0); ++s)
    TORCH_CHECK(sp[3 * s] >= 0 && sp[3 * s] < w.size(0) && 0 <= sp[3 * s + 1] && sp[3 * s + 1] <= sp[3 * s + 2] &&
                    sp[3 * s + 2] <= x.size(0),
                "expert_matmul: span ", s, " out of range");
  if (w.scalar_type() == at::kFloat)
    expert_matmul_impl<float>(x, w, spans, out);
  else if (w.scalar_type() == at::kBFloat16)
    expert_matmul_impl<c10::BFloat16>(x, w, spans, out);
  else
    TORCH_CHECK(false, "expert_matmul: fp32 or bf16, not ", w.scalar_type());
}

// ---- multi-LoRA over adapter segments (the shrink and the expand of a decode step) ------------------------------

// A decode step brings one or two tokens per adapter: each present adapter's factors are read once from memory for
// a handful of rows. The pools keep PEFT's orientation, w [S, n, m] (A: [in, r], B: [r, out]), so a row of w is m
// contiguous values and out[t] = a[t] @ w[s] is a sum over i of a[t, i] * w[s, i, :]: broadcast-FMAs streaming
// w[s] once for up to four token rows. Each output value sums its n products in two interleaved halves (even i,
// odd i), added at the end: the same order whatever the batch around the row (an answer never depends on which
// other requests share the step), and two FMA chains in flight where a lone token has one.

constexpr int64_t kSegTile = 4;            // token rows per pass over a slot's factors
constexpr int64_t kSegAheadBytes = 8192;   // how far ahead of the reads the slot's factor rows are prefetched

// where a tile's sums go: rows of T (row stride `stride`), written, or with `add` added to what they hold (the sum
// rounded to T first, then the add rounded: torch's out.add_(T(sum)))
template <typename T>
struct SegRows {
  T* p;
  int64_t stride;
  bool add;
  void put(int64_t j, int64_t c, float v) const {
    T* o = p + j * stride + c;
    *o = add ? static_cast<T>(f32(*o) + f32(static_cast<T>(v))) : static_cast<T>(v);
  }
#if defined(__AVX512F__) || defined(__AVX2__)
  void put(int64_t j, int64_t c, Vec::R v) const {
    T* o = p + j * stride + c;
    Vec::store(o, add ? Vec::add(Vec::load(o), rounded<T>(v)) : v);
  }
#endif
};

#if defined(__AVX512F__) || defined(__AVX2__)
// out rows t0..t0+M of columns [c, c + C * lanes): acc over the n rows of ws (row stride m)
template <int M, int C, typename T>
inline void seg_tile(const T* a, int64_t as, const T* ws, int64_t n, int64_t m, int64_t c, int64_t ahead,
                     const SegRows<T>& out) {
  typename Vec::R acc[2][M][C];
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < M; ++j)
      for (int q = 0; q < C; ++q) acc[h][j][q] = Vec::zero();
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {
    for (int h = 0; h < 2; ++h) {
      const T* row = ws + (i + h) * m + c;
      if (i + h + ahead < n) prefetch(row + ahead * m);  // never past the slot: the next one may be unused
      typename Vec::R wv[C];
      for (int q = 0; q < C; ++q) wv[q] = Vec::load(row + q * Vec::lanes);
      for (int j = 0; j < M; ++j) {
        const typename Vec::R av = Vec::set1(f32(a[j * as + i + h]));
        for (int q = 0; q < C; ++q) acc[h][j][q] = Vec::fma(av, wv[q], acc[h][j][q]);
      }
    }
  }
  if (i < n) {  // n odd: the last row to the even half
    const T* row = ws + i * m + c;
    for (int j = 0; j < M; ++j) {
      const typename Vec::R av = Vec::set1(f32(a[j * as + i]));
      for (int q = 0; q < C; ++q) acc[0][j][q] = Vec::fma(av, Vec::load(row + q * Vec::lanes), acc[0][j][q]);
    }
  }
  for (int j = 0; j < M; ++j)
    for (int q = 0; q < C; ++q) out.put(j, c + q * Vec::lanes, Vec::add(acc[0][j][q], acc[1][j][q]));
}

// columns [c, c1) (whole vectors) in tiles of C vectors, the tile's 2 * M * C sums being its FMA chains. AVX2 (16
// registers): 8 chains for a one- or two-row span (a decode span's usual size; with one vector per tile its two
// chains waited on the FMA latency, ~17 GB/s from L3), 6 or 8 for three or four rows. AVX512 (32 registers): two
// vectors at every M, as measured there (one-row spans have 4 chains; four vectors not yet measured on AVX512).
template <int M>
constexpr int seg_cols() {
  if constexpr (Vec::lanes == 16) return 2;
  return M == 1 ? 4 : M == 2 ? 2 : 1;
}
template <int M, typename T>
inline void seg_columns(const T* a, int64_t as, const T* ws, int64_t n, int64_t m, int64_t c, int64_t c1,
                        int64_t ahead, const SegRows<T>& out) {
  constexpr int C = seg_cols<M>();
  for (; c + C * Vec::lanes <= c1; c += C * Vec::lanes) seg_tile<M, C>(a, as, ws, n, m, c, ahead, out);
  for (; c + Vec::lanes <= c1; c += Vec::lanes) seg_tile<M, 1>(a, as, ws, n, m, c, ahead, out);
}
#endif

#if defined(__AVX512F__)
// m == 8 (a rank-8 shrink): rows i and i + 1 of ws are one 16-lane load, the even row in the low half and the odd
// row in the high half, so the two halves of the sum are exactly seg_scalar's even and odd sums (bit for bit)
template <int M, typename T>
inline void seg_pairs8(const T* a, int64_t as, const T* ws, int64_t n, int64_t ahead, const SegRows<T>& out) {
  __m512 acc[M];
  for (int j = 0; j < M; ++j) acc[j] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {
    if (i + ahead < n) prefetch(ws + (i + ahead) * 8);
    const __m512 wv = load16(ws + i * 8);
    for (int j = 0; j < M; ++j) {
      const __m512 av = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(f32(a[j * as + i])),
                                             _mm512_set1_ps(f32(a[j * as + i + 1])));
      acc[j] = _mm512_fmadd_ps(av, wv, acc[j]);
    }
  }
  for (int j = 0; j < M; ++j) {
    float lanes[16];
    _mm512_storeu_ps(lanes, acc[j]);
    for (int64_t c = 0; c < 8; ++c) {
      float h0 = lanes[c], h1 = lanes[8 + c];
      if (i < n) h0 = std::fma(f32(a[j * as + i]), f32(ws[i * 8 + c]), h0);  // n odd: the last row, even half
      out.put(j, c, h0 + h1);
    }
  }
}
#endif

// the columns [c, c1) of m rows-tiles scalar (the ones the vector tiles leave), in the vector tiles' order
template <typename T>
inline void seg_scalar(const T* a, int64_t as, int64_t rows, const T* ws, int64_t n, int64_t m, int64_t c,
                       int64_t c1, const SegRows<T>& out) {
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t col = c; col < c1; ++col) {
      float h0 = 0.f, h1 = 0.f;
      int64_t i = 0;
      for (; i + 2 <= n; i += 2) {
        h0 = std::fma(f32(a[j * as + i]), f32(ws[i * m + col]), h0);
        h1 = std::fma(f32(a[j * as + i + 1]), f32(ws[(i + 1) * m + col]), h1);
      }
      if (i < n) h0 = std::fma(f32(a[j * as + i]), f32(ws[i * m + col]), h0);
      out.put(j, col, h0 + h1);
    }
}

// a [P, n] (row stride as, rows sorted by slot), w [S, n, m], spans [k, 3] (slot, first row, end row; one after
// the other from row 0 to row P) -> out [P, m] (row stride os), written or (add) added to
template <typename T>
void segment_matmul_impl(const at::Tensor& a, const at::Tensor& w, const at::Tensor& spans, const at::Tensor& out,
                         bool add) {
  const int64_t n = w.size(1), m = w.size(2), k = spans.size(0), as = a.stride(0), os = out.stride(0);
  const T* ap = a.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* sp = spans.data_ptr<int64_t>();
  // one work item per span, all m columns: a slot's factors streamed front to back (column blocks, which read a
  // [r, out] factor in strided bands, measured no faster)
  const int64_t ahead = std::max<int64_t>(1, kSegAheadBytes / (m * static_cast<int64_t>(sizeof(T))));
  at::parallel_for(0, k, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const T* ws = wp + sp[3 * s] * n * m;
      for (int64_t r = sp[3 * s + 1]; r < sp[3 * s + 2]; r += kSegTile) {
        const int64_t rows = std::min<int64_t>(kSegTile, sp[3 * s + 2] - r);
        const T* ar = ap + r * as;
        const SegRows<T> orow{op + r * os, os, add};
        int64_t cv = 0;  // the columns the vector tiles cover: [0, cv); the scalar loop takes [cv, m)
#if defined(__AVX512F__)
        if constexpr (kVectorT<T>) {
          if (m == 8) {
            switch (rows) {
              case 4: seg_pairs8<4>(ar, as, ws, n, ahead, orow); break;
              case 3: seg_pairs8<3>(ar, as, ws, n, ahead, orow); break;
              case 2: seg_pairs8<2>(ar, as, ws, n, ahead, orow); break;
              default: seg_pairs8<1>(ar, as, ws, n, ahead, orow);
            }
            continue;
          }
        }
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
        if constexpr (kVectorT<T>) {
          cv = m / Vec::lanes * Vec::lanes;
          switch (rows) {
            case 4: seg_columns<4>(ar, as, ws, n, m, 0, cv, ahead, orow); break;
            case 3: seg_columns<3>(ar, as, ws, n, m, 0, cv, ahead, orow); break;
            case 2: seg_columns<2>(ar, as, ws, n, m, 0, cv, ahead, orow); break;
            default: seg_columns<1>(ar, as, ws, n, m, 0, cv, ahead, orow);
          }
        }
#endif
        seg_scalar(ar, as, rows, ws, n, m, cv, m, orow);
      }
    }
  });
}

void segment_matmul(const at::Tensor& a, const at::Tensor& w, const at::Tensor& spans, const at::Tensor& out,
                    bool add) {
  check_cpu(a, "a");
  check_cpu(w, "w");
  TORCH_CHECK(a.dim() == 2 && a.stride(1) == 1 && w.dim() == 3 && w.is_contiguous() && a.size(1) == w.size(1),
              "segment_matmul: a [P, n] (unit column stride), w [S, n, m] contiguous");
  TORCH_CHECK(spans.dim() == 2 && spans.size(1) == 3 && spans.scalar_type() == at::kLong && spans.is_contiguous(),
              "segment_matmul: spans [k, 3] int64");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == a.size(0) && out.size(1) == w.size(2) && out.stride(1) == 1,
              "segment_matmul: out [P, m] (unit column stride)");
  TORCH_CHECK(a.scalar_type() == w.scalar_type() && out.scalar_type() == w.scalar_type(), "segment_matmul: one dtype");
  const int64_t* sp = spans.data_ptr<int64_t>();
  for (int64_t s = 0; s < spans.size(0); ++s)  // the spans tile the rows in order: every out row is written
    TORCH_CHECK(sp[3 * s] >= 0 && sp[3 * s] < w.size(0) && sp[3 * s + 1] == (s ? sp[3 * s - 1] : 0) &&
                    sp[3 * s + 1] <= sp[3 * s + 2],
                "segment_matmul: span ", s, " out of range or not following the previous one");
  TORCH_CHECK((spans.size(0) ? sp[3 * spans.size(0) - 1] : 0) == a.size(0), "segment_matmul: the spans cover ",
              spans.size(0) ? sp[3 * spans.size(0) - 1] : 0, " of ", a.size(0), " rows");
  if (w.scalar_type() == at::kFloat)
    segment_matmul_impl<float>(a, w, spans, out, add);
  else if (w.scalar_type() == at::kBFloat16)
    segment_matmul_impl<c10::BFloat16>(a, w, spans, out, add);
  else
    TORCH_CHECK(false, "segment_matmul: fp32 or bf16, not ", w.scalar_type());
}

// ---- the MoE's weighted combine -----------------------------------------------------------------------------

// acc[rows[p]] += T(ys[p] * ws[p]) for p = 0, 1, ... in order, acc in fp32: torch's ys.mul_(ws) (the product rounded
// to T) then out.index_add_(0, rows, ys), which adds the rows one after another into each output row held in fp32
// (bf16 rows rounded once at the end: the caller's copy back), without the weighted copy and in parallel over column
// blocks (every element still sees its adds in pair order). ws: T or fp32 (Mixtral).
template <typename T, typename W>
void expert_combine_impl(float* acc, int64_t as, const at::Tensor& ys, const at::Tensor& ws, const at::Tensor& rows) {
  const int64_t P = ys.size(0), H = ys.size(1), ys_s = ys.stride(0);
  const T* yp = ys.data_ptr<T>();
  const W* wp = ws.data_ptr<W>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  constexpr int64_t cb = 256;
  at::parallel_for(0, (H + cb - 1) / cb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t c0 = b * cb, c1 = std::min(H, c0 + cb);
      for (int64_t p = 0; p < P; ++p) {
        const float w = f32(wp[p]);
        const T* y = yp + p * ys_s;
        float* o = acc + rp[p] * as;
        int64_t c = c0;
#if defined(__AVX512F__) || defined(__AVX2__)
        if constexpr (kVectorT<T>) {
          const typename Vec::R wv = Vec::set1(w);
          for (; c + Vec::lanes <= c1; c += Vec::lanes)
            Vec::store(o + c, Vec::add(Vec::load(o + c), rounded<T>(Vec::mul(Vec::load(y + c), wv))));
        }
#endif
        for (; c < c1; ++c) o[c] += f32(static_cast<T>(f32(y[c]) * w));
      }
    }
  });
}

void expert_combine(const at::Tensor& out, const at::Tensor& ys, const at::Tensor& ws, const at::Tensor& rows) {
  check_cpu(out, "out");
  check_cpu(ys, "ys");
  TORCH_CHECK(out.dim() == 2 && ys.dim() == 2 && out.size(1) == ys.size(1) && out.stride(1) == 1 && ys.stride(1) == 1,
              "expert_combine: out [T, H], ys [P, H] (unit column strides)");
  TORCH_CHECK(ws.dim() == 1 && ws.size(0) == ys.size(0) && ws.is_contiguous(), "expert_combine: ws [P]");
  TORCH_CHECK(rows.dim() == 1 && rows.size(0) == ys.size(0) && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "expert_combine: rows [P] int64");
  TORCH_CHECK(out.scalar_type() == ys.scalar_type(), "expert_combine: out and ys of one dtype");
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t p = 0; p < rows.size(0); ++p)
    TORCH_CHECK(rp[p] >= 0 && rp[p] < out.size(0), "expert_combine: row ", rp[p], " out of range");
  if (ys.scalar_type() == at::kFloat && ws.scalar_type() == at::kFloat) {
    expert_combine_impl<float, float>(out.data_ptr<float>(), out.stride(0), ys, ws, rows);
    return;
  }
  const bool bf16_ws = ws.scalar_type() == at::kBFloat16;
  TORCH_CHECK(ys.scalar_type() == at::kBFloat16 && (bf16_ws || ws.scalar_type() == at::kFloat),
              "expert_combine: fp32, or bf16 with bf16 or fp32 weights, not ", ys.scalar_type(), " with ",
              ws.scalar_type());
  at::Tensor acc = out.to(at::kFloat).contiguous();  // index_add_'s fp32 rows, rounded once below
  if (bf16_ws)
    expert_combine_impl<c10::BFloat16, c10::BFloat16>(acc.data_ptr<float>(), acc.stride(0), ys, ws, rows);
  else
    expert_combine_impl<c10::BFloat16, float>(acc.data_ptr<float>(), acc.stride(0), ys, ws, rows);
  out.copy_(acc);
}

}  // namespace

TORCH_LIBRARY(loraland, m) {
  m.def("decode_attention", decode_attention);
  m.def("rope_cache", rope_cache);
  m.def("rms_norm", rms_norm);
  m.def("silu_mul", silu_mul);
  m.def("expert_matmul", expert_matmul);
  m.def("greedy_rows", greedy_rows);
  m.def("segment_matmul", segment_matmul);
  m.def("expert_combine", expert_combine);
}
