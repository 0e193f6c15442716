// The decode matmul for AVX-512 with BF16 and VNNI (every CPU with the first has the second): where x's values are
// bfloat16 (a bfloat16 model's activations) and the blocking says so (measured: faster on some CPUs, slower on
// others), a bfloat16 weight pair (k, k + 1) and x's pair meet in one vdpbf16ps, 32 products an instruction with no
// widening; and W8A8's int8 quads meet x's in one vpdpbusd, 64 products an instruction.
#include "avx512.inc"

namespace {

struct Avx512Bf16 : Avx512 {
  static constexpr bool kDotPairs = true;
  static constexpr bool kInt8Dot = true;
  // acc + x's pair times each lane's pair, the products added as the instruction adds them.
  static V dot(V acc, VI x, VI w) { return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w); }
  // vpdpbusd multiplies unsigned bytes by signed ones: the weights go in as w + 128 (their top bit flipped), and each
  // block's sums start at -128 times its sum of x's values (Problem::xo), so what comes out is the signed dot.
  static VI quad_weights(const int8_t* p) { return _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_set1_epi8(-128)); }
  static VI int8_dot(VI acc, VI w_u8, VI x) { return _mm512_dpbusd_epi32(acc, w_u8, x); }
  static V to_float(VI v) { return _mm512_cvtepi32_ps(v); }
};

const s3d::Kernels kAvx512Bf16 = {"avx512-bf16",          Avx512Bf16::W,
                                  Loops<Avx512Bf16>::kPanel, Avx512Bf16::kDotPairs,
                                  Avx512Bf16::kInt8Dot,   &Loops<Avx512Bf16>::Tiles,
                                  &Loops<Avx512Bf16>::Run, &Attention<Avx512Bf16>::Run,
                                  &Attention<Avx512Bf16>::Combine};

}  // namespace

const s3d::Kernels* s3d::Avx512Bf16Kernels() { return &kAvx512Bf16; }
