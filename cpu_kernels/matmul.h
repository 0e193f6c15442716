// The ISA-independent face of the decode matmul: one problem, and the kernels each ISA offers for it.
#pragma once

#include <cstdint>

namespace s3d {

enum class WeightType { kF32, kBF16, kS8 };

// How W is stored: [K, N] (linears), [N, K] (embedding tables as the LM head), or packed for the kernel in
// panels of P = Kernels::panel columns, each panel's K rows one after another (N / P panels, K x P each).
enum class Layout { kKN, kNK, kPanels };

// out[M, N] = x[M, K] @ W, times scale[N] where `scale` is not null (int8's per-output-channel scales),
// accumulated in fp32.
struct Problem {
  const float* x;
  const void* w;
  const float* scale;
  float* out;
  int64_t m, k, n;
  WeightType type;
  Layout layout;
};

// The output columns fall into tiles that depend on N and the ISA only, never on M, and each output
// element is one fixed sequence of fused multiply-adds over K: row i of an M-row product is bit-identical
// to the same row computed alone, and to any split of the tiles across threads.
struct Kernels {
  const char* name;
  int64_t panel;  // columns per packed panel
  int64_t (*tiles)(const Problem&);
  void (*run)(const Problem&, int64_t first_tile, int64_t end_tile);
};

const Kernels* Avx2Kernels();
const Kernels* Avx512Kernels();

}  // namespace s3d
