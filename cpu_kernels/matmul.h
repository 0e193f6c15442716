// The ISA-independent face of the decode matmul: one problem, and the kernels each ISA offers for it.
#pragma once

#include <cstdint>

namespace s3d {

enum class WeightType { kF32, kBF16, kS8 };

// How W is stored: [K, N] (linears), [N, K] (embedding tables as the LM head), packed for the kernel in
// panels of P = Kernels::panel columns, each panel's K rows one after another (N / P panels, K x P each), or
// (bfloat16, K even) in panels whose K rows come in pairs, a column's two values side by side
// ([N / P, K / 2, P, 2]): one load holds two rows' weights, split by a shift and a mask (or multiplied as pairs
// by AVX-512 BF16's instruction), or (int8, K a multiple of kQuantBlock) in panels whose K rows come in fours
// ([N / P, K / 4, P, 4]), the quads an integer dot product instruction (AVX-512 VNNI's) takes, times x quantized to
// int8 (W8A8).
enum class Layout { kKN, kNK, kPanels, kPairs, kQuads };

// W8A8's x: each row quantized in blocks of this many K (as llama.cpp's Q8_0), one fp32 scale a block.
constexpr int64_t kQuantBlock = 32;

// How a product's loops are blocked, chosen for the CPU at hand (measured once by s3djax.kernel_tuning, else
// configs/defaults.yaml). None of it changes a result: each output element is the same fma chain under every blocking
// (the pair instruction flushes subnormal values, below 1.2e-38, to zero, where the fma pair keeps them).
struct Blocking {
  int64_t prefetch = 0;        // bytes ahead in a weight stream to prefetch into L1 (0: leave it to the hardware)
  int64_t chunk_bytes = 16 << 10;  // K is walked in chunks of this many weight bytes where a tile has several
                                   // register blocks of rows, so later blocks read the chunk from L1
  int64_t tile_rows = 16;      // rows of x a tile holds at most: more rows read each weight fewer times, fewer
                               // give the threads more tiles to share
  int64_t pair_dot = 0;        // 1: bfloat16 pairs (kPairs, x bfloat16) multiplied by the ISA's pair instruction
                               // where it has one (Kernels::pair_dot), which adds a pair's products as the fma pair
                               // does, k + 1 first; it is faster on some CPUs and slower on others
  int64_t row_panels = 1;      // 2: a product of few rows (kernels.inc's kPanelRows) takes tiles of two packed
                               // panels, twice the fma chains in flight and two weight streams
};

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
  Blocking blocking;
  bool x_bf16 = false;  // x's values are all bfloat16 (the model's activations are): a pair of them is exact in 32 bits
  // kQuads: x quantized (QuantizeRows), [M, K] int8 values, [M, K / kQuantBlock] scales and -128 times each block's
  // sum of values. out = sum over blocks of (the block's integer dot) * its scale, in block order, times `scale`.
  const int8_t* xq = nullptr;
  const float* xd = nullptr;
  const int32_t* xo = nullptr;
};

// x [M, K] (K a multiple of kQuantBlock) into `xq`, `xd` and `xo` as Problem holds them: per block,
// d = max |x| * (1 / 127) and q = x * (1 / d) rounded to the nearest integer, ties to even (all zero where the block
// is); the values s3djax's XLA path (cpu_kernels.matmul.quantize_rows) quantizes to, bit for bit.
void QuantizeRows(const float* x, int64_t m, int64_t k, int8_t* xq, float* xd, int32_t* xo);

// Attention of T new query rows over a KV cache: row t of batch b sees every slot below lengths[b], and the
// scratch slot lengths[b] + j where tree[b, t, j] (j < W). q [B, T, H, D], k and v [B, S, KV, D] and out
// [B, T, H, D] each hold fp32 or bfloat16 (q and out one type, k and v one type); a KV head serves H / KV query heads.
struct AttentionProblem {
  const void* q;
  const void* k;
  const void* v;
  const int32_t* lengths;
  const bool* tree;
  void* out;
  int64_t b, t, h, kv, d, s, w;
  float scale;  // multiplies q before its dot products
  WeightType type;     // q's and out's
  WeightType kv_type;  // k's and v's
  int64_t pieces;   // each row's visible keys in pieces of kPieceKeys: enough for the longest row
  int64_t rows;     // query rows a tile takes together (the last block of rows may have fewer)
  float* partials;  // [B, T, H, pieces, D + 2]: each piece's max score, sum of exponentials and weighted values
};

// Keys a piece: a long context's row is split across threads, a piece at a time.
constexpr int64_t kPieceKeys = 256;

// A product's tiles are its column tiles (which depend on N and the ISA only) times groups of rows, and
// each output element is one fixed sequence of fused multiply-adds over K (or, on pairs of bfloat16 values, of
// the vector unit's pair products, one per two K): row i of an M-row product is bit-identical to the same row
// computed alone, and to any split of the tiles across threads.
struct Kernels {
  const char* name;
  int64_t lanes;  // floats per vector
  int64_t panel;  // columns per packed panel
  bool pair_dot;  // the vector unit multiplies bfloat16 pairs in one instruction (Blocking::pair_dot)
  bool int8_dot;  // the vector unit sums int8 quads in one instruction (VNNI); elsewhere kQuads runs on fmas, exactly
  int64_t (*tiles)(const Problem&);
  void (*run)(const Problem&, int64_t first_tile, int64_t end_tile);
  // Attention's tiles are (batch, KV head, query row, piece) tuples, B * KV * T * pieces of them; a head holds at
  // most 16 vectors. `combine` then writes out's B * T * H rows. A row's output depends only on the keys it sees,
  // in slot order, never on T, W, the masked slots or the number of pieces.
  void (*attend)(const AttentionProblem&, int64_t first_tile, int64_t end_tile);
  void (*combine)(const AttentionProblem&, int64_t first_row, int64_t end_row);
};

const Kernels* Avx2Kernels();
const Kernels* Avx512Kernels();
const Kernels* Avx512Bf16Kernels();

// This thread's scratch for the attention tiles, at least `n` elements, owned by ffi.cc (built for the baseline
// ISA): the per-ISA translation units hold no std:: containers, whose inline code each would emit as a weak symbol
// and the linker would keep one of, perhaps the AVX-512 one on an AVX2 CPU.
float* AttentionScratch(int64_t n);
int64_t* SlotScratch(int64_t n);

}  // namespace s3d
