// The decode matmul for AVX-512 (16 floats a vector).
#include "avx512.inc"

namespace {

const s3d::Kernels kAvx512 = {"avx512", Avx512::W, Loops<Avx512>::kPanel, Avx512::kDotPairs, Avx512::kInt8Dot,
                               &Loops<Avx512>::Tiles, &Loops<Avx512>::Run, &Attention<Avx512>::Run,
                               &Attention<Avx512>::Combine};

}  // namespace

const s3d::Kernels* s3d::Avx512Kernels() { return &kAvx512; }
