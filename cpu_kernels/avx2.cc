// The decode matmul for AVX2 and FMA (8 floats a vector).
#include <immintrin.h>


#include "kernels.inc"
#include "attention.inc"

namespace {

struct Avx2 {
  using V = __m256;
  static constexpr int W = 8;
  // 3 rows: 12 accumulators and 4 weight vectors fill the 16 registers. Measured against 2 and 4 rows in
  // benchmarks/results/small_m_matmul-avx2-cpu-2026-11-25.md (M = 3 to 32: 10-45% faster than 2 rows, M = 1 unchanged).
  static constexpr int kRows = 3;
  static constexpr int kTileVectors = 4;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float a) { return _mm256_set1_ps(a); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V loadf(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const uint16_t* p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static V load(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  // W columns' bfloat16 pairs (k, k + 1), and each half of them as floats.
  using VI = __m256i;
  static constexpr bool kDotPairs = false;
  static VI loadi(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static VI loadi(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  // int8 quads (Layout::kQuads): byte t of each lane, sign-extended, as a float (no int8 dot instruction here).
  static constexpr bool kInt8Dot = false;
  template <int t>
  static V quad_byte(VI v) { return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * t), 24)); }
  static V even(VI v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
  static V odd(VI v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(-65536))); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static void storef(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V fnma(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a b
  static V round(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V ldexp(V y, V n) {  // y 2^n for a whole n in [-126, 127], built in the exponent bits
    __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(two_n));
  }
  static float hsum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static V hsums(const V* a) {  // lane r: the sum of a[r]'s lanes, for W vectors at once
    V t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    V t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    V lanes0 = _mm256_hadd_ps(t0, t1), lanes4 = _mm256_hadd_ps(t2, t3);  // each 128-bit half: 4 vectors' partials
    return _mm256_add_ps(_mm256_permute2f128_ps(lanes0, lanes4, 0x20), _mm256_permute2f128_ps(lanes0, lanes4, 0x31));
  }
};

const s3d::Kernels kAvx2 = {"avx2", Avx2::W, Loops<Avx2>::kPanel, Avx2::kDotPairs, Avx2::kInt8Dot, &Loops<Avx2>::Tiles,
                             &Loops<Avx2>::Run, &Attention<Avx2>::Run, &Attention<Avx2>::Combine};

}  // namespace

const s3d::Kernels* s3d::Avx2Kernels() { return &kAvx2; }
