// The decode matmul for AVX-512 (16 floats a vector).
#include <immintrin.h>


#include "kernels.inc"
#include "attention.inc"

namespace {

struct Avx512 {
  using V = __m512;
  static constexpr int W = 16;
  static constexpr int kRows = 6;
  static constexpr int kTileVectors = 4;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float a) { return _mm512_set1_ps(a); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V loadf(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const uint16_t* p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static V load(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static void storef(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V min(V a, V b) { return _mm512_min_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V fnma(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b
  static V round(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V ldexp(V y, V n) { return _mm512_scalef_ps(y, n); }  // y 2^n, n a whole number
  static float hsum(V v) { return _mm512_reduce_add_ps(v); }
  // Lane r: the sum of a[r]'s lanes, for W vectors at once, in four rounds of pairwise adds.
  static V hsums(const V* a) {
    V x[8];
    // 256-bit halves: x[r]'s 128-bit quarters 0, 1 hold a[2r]'s partials, quarters 2, 3 a[2r + 1]'s.
    for (int r = 0; r < 8; ++r)
      x[r] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * r], a[2 * r + 1], 0x44),
                           _mm512_shuffle_f32x4(a[2 * r], a[2 * r + 1], 0xEE));
    // Quarters: x[r]'s quarter q (r < 4) holds 4 partials of a[4r + q].
    for (int r = 0; r < 4; ++r)
      x[r] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * r], x[2 * r + 1], 0x88),
                           _mm512_shuffle_f32x4(x[2 * r], x[2 * r + 1], 0xDD));
    // Inside each quarter q: pairs, then the sums of a[q], a[4 + q], a[8 + q], a[12 + q].
    V u0 = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
    V u1 = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
    V sums = _mm512_add_ps(_mm512_shuffle_ps(u0, u1, 0x44), _mm512_shuffle_ps(u0, u1, 0xEE));
    // Lane 4q + j holds a[4j + q]'s sum: lane r takes lane 4 (r % 4) + r / 4.
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
  }
};

const s3d::Kernels kAvx512 = {"avx512", Avx512::W, Loops<Avx512>::kPanel, &Loops<Avx512>::Tiles, &Loops<Avx512>::Run,
                               &Attention<Avx512>::Run, &Attention<Avx512>::Combine};

}  // namespace

const s3d::Kernels* s3d::Avx512Kernels() { return &kAvx512; }
