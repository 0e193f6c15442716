// The decode matmul for AVX-512 with BF16: where x's values are bfloat16 (a bfloat16 model's activations) and the
// blocking says so (measured: faster on some CPUs, slower on others), a bfloat16 weight pair (k, k + 1) and x's pair
// meet in one vdpbf16ps, 32 products an instruction with no widening.
#include "avx512.inc"

namespace {

struct Avx512Bf16 : Avx512 {
  static constexpr bool kDotPairs = true;
  static VI set1i(uint32_t bits) { return _mm512_set1_epi32(static_cast<int>(bits)); }
  // acc + x's pair times each lane's pair, the products added as the instruction adds them.
  static V dot(V acc, VI x, VI w) { return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w); }
};

const s3d::Kernels kAvx512Bf16 = {"avx512-bf16", Avx512Bf16::W, Loops<Avx512Bf16>::kPanel, Avx512Bf16::kDotPairs,
                                  &Loops<Avx512Bf16>::Tiles, &Loops<Avx512Bf16>::Run, &Attention<Avx512Bf16>::Run,
                                  &Attention<Avx512Bf16>::Combine};

}  // namespace

const s3d::Kernels* s3d::Avx512Bf16Kernels() { return &kAvx512Bf16; }
