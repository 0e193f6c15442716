// The XLA FFI handlers `s3djax_matmul` and `s3djax_attention`: each checks its buffers, and splits its tiles
// (the output's column tiles; attention's query rows) between helper threads and the calling thread. The ISA
// is picked once.
#include <immintrin.h>

#include <sched.h>

#include <atomic>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <vector>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "matmul.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

int64_t Env(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoll(v) : fallback;
}

const s3d::Kernels* ChooseKernels() {
  // S3DJAX_CPU_ISA forces a narrower ISA ("avx2", "avx512"), to measure one against the other.
  const char* want = std::getenv("S3DJAX_CPU_ISA");
  auto narrower = [want](const char* isa) { return want && std::strcmp(want, isa) == 0; };
  __builtin_cpu_init();
  // Every flag each translation unit is compiled with (CMakeLists.txt), so no instruction it may hold is missing.
  bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && !narrower("avx2");
  if (avx512 && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni") && !narrower("avx512"))
    return s3d::Avx512Bf16Kernels();
  if (avx512) return s3d::Avx512Kernels();
  if (avx2) return s3d::Avx2Kernels();
  return nullptr;
}

const s3d::Kernels* Chosen() {
  static const s3d::Kernels* kernels = ChooseKernels();
  return kernels;
}


// A spin-wait's step. Every 64th gives the core away: with more runnable threads than cores (XLA's own
// threads beside ours), a waiter that never yields can hold the core the awaited thread needs.
inline void Pause(int spins) {
  if (spins % 64 == 0) sched_yield();
  else _mm_pause();
}

// Chunks of tiles are claimed from a shared counter by the calling thread and by helpers alike. The
// caller never waits for a helper to start: it works until nothing is left to claim, then waits only for
// chunks already being worked on. A helper that starts after the call returned finds nothing to claim
// and touches only the shared counters.
struct Job {
  std::function<void(int64_t, int64_t)> run;  // over a range of tiles
  int64_t tiles, chunk, chunks;
  std::atomic<int64_t> next{0}, done{0};

  void Work() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      run(c * chunk, std::min(tiles, (c + 1) * chunk));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Helpers of our own, which spin for a while after each job before they sleep: decode calls the matmul
// hundreds of times a step, a few hundred microseconds apart, and a sleeping thread (XLA's intra-op pool
// threads, when a task is scheduled there) wakes too late to take a share of work that short.
class Helpers {
 public:
  explicit Helpers(int n) {
    for (int i = 0; i < n; ++i) std::thread([this] { Loop(); }).detach();
    count_ = n;
  }
  int count() const { return count_; }

  void Offer(const std::shared_ptr<Job>& job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = job;
      generation_.fetch_add(1, std::memory_order_release);
    }
    if (sleepers_.load() > 0) wake_.notify_all();
  }

 private:
  void Loop() {
    uint64_t seen = 0;
    for (;;) {
      auto since = std::chrono::steady_clock::now();
      for (int spins = 0; generation_.load(std::memory_order_acquire) == seen; ++spins) {
        Pause(spins);
        if ((spins & 1023) == 0 && std::chrono::steady_clock::now() - since > kSpin) {
          std::unique_lock<std::mutex> lock(mu_);
          ++sleepers_;
          wake_.wait(lock, [&] { return generation_.load() != seen; });
          --sleepers_;
        }
      }
      std::shared_ptr<Job> job;
      {
        std::lock_guard<std::mutex> lock(mu_);
        job = job_;
        seen = generation_.load();
      }
      if (job) job->Work();
    }
  }

  static constexpr std::chrono::microseconds kSpin{2000};
  int count_ = 0;
  std::mutex mu_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> sleepers_{0};
  std::shared_ptr<Job> job_;
};

int Cores() {
  cpu_set_t set;
  return sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
}

int Threads() {
  static const int threads = static_cast<int>(std::max<int64_t>(1, Env("S3DJAX_CPU_THREADS", Cores())));
  return threads;
}

Helpers& OwnHelpers() {
  static Helpers* helpers = new Helpers(Threads() - 1);  // never destroyed: its threads outlive main
  return *helpers;
}

// The blocking every product takes, set by s3d_cpu_set_blocking (Python sets it once, before the first product).
struct SharedBlocking {
  std::atomic<int64_t> prefetch{s3d::Blocking{}.prefetch}, chunk_bytes{s3d::Blocking{}.chunk_bytes},
      tile_rows{s3d::Blocking{}.tile_rows}, pair_dot{s3d::Blocking{}.pair_dot}, row_panels{s3d::Blocking{}.row_panels};
  s3d::Blocking Get() const {
    s3d::Blocking b;
    b.prefetch = prefetch.load(std::memory_order_relaxed);
    b.chunk_bytes = chunk_bytes.load(std::memory_order_relaxed);
    b.tile_rows = tile_rows.load(std::memory_order_relaxed);
    b.pair_dot = pair_dot.load(std::memory_order_relaxed);
    b.row_panels = row_panels.load(std::memory_order_relaxed);
    return b;
  }
};
SharedBlocking& CurrentBlocking() {
  static SharedBlocking blocking;
  return blocking;
}

// Below this many weight bytes a product is not worth waking another thread for.
constexpr int64_t kParallelBytes = 1 << 16;

// Runs `run` over [0, tiles) on the calling thread, and on helpers too where `worth_it`.
// `pool`: XLA's, or null outside a call from XLA (a timing run of the blocking).
void Parallel(ffi::ThreadPool* pool, int64_t tiles, bool worth_it, std::function<void(int64_t, int64_t)> run) {
  auto job = std::make_shared<Job>();
  job->run = std::move(run);
  job->tiles = tiles;
  static const bool env_pool = Env("S3DJAX_CPU_POOL", 0) == 1;
  const bool xla_pool = env_pool && pool;
  int64_t helpers = worth_it ? Threads() - 1 : 0;
  if (xla_pool) helpers = std::min<int64_t>(helpers, pool->num_threads() - 1);
  helpers = std::max<int64_t>(0, std::min(helpers, tiles - 1));
  // Tiles one at a time where they are few (an even split matters more than the claims' cost), else a few
  // dozen chunks per thread, so a thread that starts late still gets a share.
  job->chunks = std::min(tiles, std::max<int64_t>(256, (helpers + 1) * 32));
  job->chunk = (tiles + job->chunks - 1) / job->chunks;
  job->chunks = (tiles + job->chunk - 1) / job->chunk;
  if (helpers && xla_pool) {
    for (int64_t i = 0; i < helpers; ++i) pool->Schedule([job] { job->Work(); });
  } else if (helpers) {
    OwnHelpers().Offer(job);
  }
  job->Work();
  for (int spins = 1; job->done.load(std::memory_order_acquire) < job->chunks; ++spins) Pause(spins);
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scale,
                  ffi::ResultBuffer<ffi::F32> out, int32_t layout_attr, int32_t x_bf16) {
  const s3d::Kernels* kernels = Chosen();
  if (!kernels) return ffi::Error::Internal("s3djax_matmul: this CPU has neither AVX2 with FMA nor AVX-512");
  if (layout_attr < 0 || layout_attr > 4) return ffi::Error::InvalidArgument("s3djax_matmul: unknown layout");
  auto layout = static_cast<s3d::Layout>(layout_attr);
  auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || od.size() != 2)
    return ffi::Error::InvalidArgument("s3djax_matmul: x, w and out must be 2-D");
  bool nk = layout == s3d::Layout::kNK;
  int64_t m = xd[0], k = xd[1], n = nk ? wd[0] : wd[1], wk = nk ? wd[1] : wd[0];
  const bool quads = layout == s3d::Layout::kQuads;
  bool panels = layout == s3d::Layout::kPanels || layout == s3d::Layout::kPairs || quads;
  if (panels && n % kernels->panel != 0)
    return ffi::Error::InvalidArgument("s3djax_matmul: packed panels do not divide N");
  if (wk != k) return ffi::Error::InvalidArgument("s3djax_matmul: x and w disagree on K");
  if (od[0] != m || od[1] != n) return ffi::Error::InvalidArgument("s3djax_matmul: out is not [M, N]");
  if (scale.element_count() != 0 && scale.element_count() != static_cast<size_t>(n))
    return ffi::Error::InvalidArgument("s3djax_matmul: scale must be empty or hold one value per output column");
  s3d::WeightType type;
  switch (w.element_type()) {
    case ffi::DataType::F32: type = s3d::WeightType::kF32; break;
    case ffi::DataType::BF16: type = s3d::WeightType::kBF16; break;
    case ffi::DataType::S8: type = s3d::WeightType::kS8; break;
    default: return ffi::Error::InvalidArgument("s3djax_matmul: weights must be float32, bfloat16 or int8");
  }
  if (layout == s3d::Layout::kPairs && (type != s3d::WeightType::kBF16 || k % 2))
    return ffi::Error::InvalidArgument("s3djax_matmul: weights packed in pairs must be bfloat16 with K even");
  if (quads && (type != s3d::WeightType::kS8 || k % s3d::kQuantBlock))
    return ffi::Error::InvalidArgument("s3djax_matmul: weights packed in quads must be int8 with K a multiple of 32");
  if (m == 0 || n == 0) return ffi::Error::Success();
  s3d::Problem p{x.typed_data(), w.untyped_data(), scale.element_count() ? scale.typed_data() : nullptr,
                 out->typed_data(), m, k, n, type, layout, CurrentBlocking().Get(), x_bf16 != 0};
  if (k == 0) {
    std::memset(p.out, 0, sizeof(float) * m * n);
    return ffi::Error::Success();
  }
  thread_local std::vector<int8_t> x_values;
  thread_local std::vector<float> x_scales;
  thread_local std::vector<int32_t> x_offsets;
  if (quads) {  // once for every tile: a few thousand values
    x_values.resize(static_cast<size_t>(m * k));
    x_scales.resize(static_cast<size_t>(m * k / s3d::kQuantBlock));
    x_offsets.resize(x_scales.size());
    s3d::QuantizeRows(p.x, m, k, x_values.data(), x_scales.data(), x_offsets.data());
    p.xq = x_values.data();
    p.xd = x_scales.data();
    p.xo = x_offsets.data();
  }

  Parallel(&pool, kernels->tiles(p), static_cast<int64_t>(w.size_bytes()) >= kParallelBytes,
           [kernels, p](int64_t first, int64_t end) { kernels->run(p, first, end); });
  return ffi::Error::Success();
}

// Below this many reads (visible keys x query rows x heads x head size) attention stays on the calling thread.
constexpr int64_t kParallelAttention = 1 << 18;
constexpr int64_t kTileRows = 8;

ffi::Error Attend(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                  ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::PRED> tree, ffi::Result<ffi::AnyBuffer> out,
                  float scale) {
  const s3d::Kernels* kernels = Chosen();
  if (!kernels) return ffi::Error::Internal("s3djax_attention: this CPU has neither AVX2 with FMA nor AVX-512");
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), td = tree.dimensions(), od = out->dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || td.size() != 3 || od.size() != 4 ||
      lengths.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("s3djax_attention: q, k, v, out must be 4-D, tree 3-D and lengths 1-D");
  int64_t b = qd[0], t = qd[1], h = qd[2], d = qd[3], s = kd[1], kv = kd[2];
  bool same_kv = kd[0] == b && kd[3] == d && vd[0] == kd[0] && vd[1] == kd[1] && vd[2] == kd[2] && vd[3] == kd[3];
  if (!same_kv || kv == 0 || h % kv != 0)
    return ffi::Error::InvalidArgument("s3djax_attention: k and v must be [B, S, KV, D] with KV dividing q's heads");
  if (d > 16 * kernels->lanes)
    return ffi::Error::InvalidArgument("s3djax_attention: heads wider than 16 vectors are not supported");
  if (lengths.dimensions()[0] != b || td[0] != b || td[1] != t)
    return ffi::Error::InvalidArgument("s3djax_attention: lengths must be [B] and tree [B, T, W]");
  for (int i = 0; i < 4; ++i)
    if (od[i] != qd[i]) return ffi::Error::InvalidArgument("s3djax_attention: out must have q's shape");
  // uint16: a cache of bfloat16 held as its bits (s3djax.cache.BITS), which XLA updates in place.
  auto float_type = [](ffi::DataType t, s3d::WeightType* type) {
    bool bf16 = t == ffi::DataType::BF16 || t == ffi::DataType::U16;
    *type = bf16 ? s3d::WeightType::kBF16 : s3d::WeightType::kF32;
    return bf16 || t == ffi::DataType::F32;
  };
  s3d::WeightType type, kv_type;
  if (!float_type(q.element_type(), &type) || q.element_type() == ffi::DataType::U16 ||
      !float_type(k.element_type(), &kv_type))
    return ffi::Error::InvalidArgument("s3djax_attention: q must be float32 or bfloat16, k and v those or bfloat16 bits");
  if (v.element_type() != k.element_type() || out->element_type() != q.element_type())
    return ffi::Error::InvalidArgument("s3djax_attention: v must have k's dtype and out q's");
  if (b * t * h * d == 0) return ffi::Error::Success();
  int64_t keys = 0, longest = 1;
  for (int64_t i = 0; i < b; ++i) {
    const int64_t length = std::min<int64_t>(std::max<int32_t>(lengths.typed_data()[i], 0), s);
    keys += length + td[2];
    longest = std::max(longest, length + std::min<int64_t>(td[2], s - length));
  }
  const int64_t pieces = (longest + s3d::kPieceKeys - 1) / s3d::kPieceKeys;
  thread_local std::vector<float> partials;
  partials.resize(static_cast<size_t>(b * t * h * pieces * (d + 2)));
  const bool worth_it = keys * t * h * d >= kParallelAttention;
  // Rows share a tile, and so each chunk of keys read into L1, up to kTileRows of them; the rows are split
  // further while there are fewer tiles than two a thread, so that the threads end together.
  int64_t blocks = (t + kTileRows - 1) / kTileRows;
  while (worth_it && blocks < t && b * kv * pieces * blocks < 2 * Threads()) ++blocks;
  const int64_t rows = (t + blocks - 1) / blocks;
  blocks = (t + rows - 1) / rows;
  s3d::AttentionProblem p{q.untyped_data(), k.untyped_data(), v.untyped_data(), lengths.typed_data(),
                          tree.typed_data(), out->untyped_data(), b, t, h, kv, d, s, td[2], scale, type, kv_type,
                          pieces, rows, partials.data()};
  Parallel(&pool, b * kv * blocks * pieces, worth_it,
           [kernels, p](int64_t first, int64_t end) { kernels->attend(p, first, end); });
  kernels->combine(p, 0, b * t * h);  // a few floats a row: not worth a thread
  return ffi::Error::Success();
}

}  // namespace

namespace s3d {

void QuantizeRows(const float* x, int64_t m, int64_t k, int8_t* xq, float* xd, int32_t* xo) {
  for (int64_t b = 0; b < m * k / kQuantBlock; ++b) {
    const float* xb = x + b * kQuantBlock;
    float amax = 0.0f;
    for (int64_t i = 0; i < kQuantBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax * (1.0f / 127.0f), id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int64_t i = 0; i < kQuantBlock; ++i) {
      // Rounded to the nearest integer, ties to even, as nearbyint in the default mode does for |v| < 2^22, without
      // its call. An infinity makes d infinite and v NaN: the block's values are then 0 and the output NaN. A NaN is
      // passed over by the max and quantized to 0 (XLA's path, quantize_rows, gives NaN there).
      const float v = (xb[i] * id + 12582912.0f) - 12582912.0f;
      const int32_t q = std::fabs(v) <= 127.0f ? static_cast<int32_t>(v) : 0;
      xq[b * kQuantBlock + i] = static_cast<int8_t>(q);
      sum += q;
    }
    xd[b] = d;
    xo[b] = -128 * sum;
  }
}

float* AttentionScratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

int64_t* SlotScratch(int64_t n) {
  thread_local std::vector<int64_t> slots;
  if (static_cast<int64_t>(slots.size()) < n) slots.resize(n);
  return slots.data();
}

}  // namespace s3d

XLA_FFI_DEFINE_HANDLER_SYMBOL(S3dAttention, Attend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(S3dMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("layout")
                                  .Attr<int32_t>("x_bf16"));

// The vector unit the kernels run on here, or null: Python asks before registering the handler.
extern "C" const char* s3d_cpu_isa() {
  const s3d::Kernels* k = Chosen();
  return k ? k->name : nullptr;
}

// Columns per packed panel on this ISA.
extern "C" int64_t s3d_cpu_panel() {
  const s3d::Kernels* k = Chosen();
  return k ? k->panel : 0;
}

// Whether the vector unit here multiplies bfloat16 pairs in one instruction (Blocking::pair_dot): 1 or 0.
extern "C" int s3d_cpu_pair_dot() {
  const s3d::Kernels* k = Chosen();
  return k && k->pair_dot;
}

// Whether the vector unit here sums int8 quads in one instruction (W8A8's products, Kernels::int8_dot): 1 or 0.
extern "C" int s3d_cpu_int8_dot() {
  const s3d::Kernels* k = Chosen();
  return k && k->int8_dot;
}

// Sets the blocking of every later product; -1 where a value is out of range (nothing changes then).
extern "C" int s3d_cpu_set_blocking(int64_t prefetch, int64_t chunk_bytes, int64_t tile_rows, int64_t pair_dot,
                                    int64_t row_panels) {
  if (prefetch < 0 || prefetch > (1 << 20) || chunk_bytes < 64 || chunk_bytes > (1 << 22) || tile_rows < 1 ||
      tile_rows > 1024 || pair_dot < 0 || pair_dot > 1 || row_panels < 1 || row_panels > 2)
    return -1;
  SharedBlocking& b = CurrentBlocking();
  b.prefetch = prefetch;
  b.chunk_bytes = chunk_bytes;
  b.tile_rows = tile_rows;
  b.pair_dot = pair_dot;
  b.row_panels = row_panels;
  return 0;
}

// The blocking products take now, as five values: prefetch bytes, chunk bytes, tile rows, pair_dot, row_panels.
extern "C" void s3d_cpu_blocking(int64_t* out) {
  s3d::Blocking b = CurrentBlocking().Get();
  out[0] = b.prefetch;
  out[1] = b.chunk_bytes;
  out[2] = b.tile_rows;
  out[3] = b.pair_dot;
  out[4] = b.row_panels;
}

// Milliseconds for the fastest of `repeats` passes of M-row products over `bytes` of weights at `w`, read as packed
// [k, n] panels one product after another, as a decode step reads its layers: fp32 panels, or (bf16 1) bfloat16
// panels in pairs of rows times bfloat16 x; -1 on bad arguments. What the blocking is chosen by
// (s3djax.kernel_tuning), under the blocking set now.
extern "C" double s3d_cpu_time_products(const void* w, int64_t bytes, int64_t m, int64_t k, int64_t n,
                                        int64_t repeats, int32_t bf16) {
  const s3d::Kernels* kernels = Chosen();
  const int64_t size = bf16 ? 2 : 4;
  if (!kernels || !w || m < 1 || m > 256 || k < 1 || n < 1 || n % kernels->panel || repeats < 1 ||
      (bf16 && k % 2) || bytes < size * k * n)
    return -1;
  const int64_t products = bytes / (size * k * n);
  std::vector<float> x(static_cast<size_t>(m * k), 0.0078125f), out(static_cast<size_t>(m * n));
  double best = -1;
  for (int64_t r = 0; r < repeats; ++r) {
    auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < products; ++i) {
      s3d::Problem p{x.data(), static_cast<const char*>(w) + i * size * k * n, nullptr, out.data(), m, k, n,
                     bf16 ? s3d::WeightType::kBF16 : s3d::WeightType::kF32,
                     bf16 ? s3d::Layout::kPairs : s3d::Layout::kPanels, CurrentBlocking().Get(), bf16 != 0};
      Parallel(nullptr, kernels->tiles(p), true,
               [kernels, p](int64_t first, int64_t end) { kernels->run(p, first, end); });
    }
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (best < 0 || ms < best) best = ms;
  }
  return best;
}
