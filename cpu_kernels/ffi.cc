// The XLA FFI handler `s3djax_matmul`: checks its buffers, picks the ISA once, and splits the output's column
// tiles between XLA's intra-op thread pool and the calling thread.
#include <immintrin.h>

#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <cstdlib>
#include <cstring>
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
  const char* want = std::getenv("S3DJAX_CPU_ISA");  // force a narrower ISA, to measure one against the other
  __builtin_cpu_init();
  bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx512 && !(want && std::strcmp(want, "avx2") == 0)) return s3d::Avx512Kernels();
  if (avx2) return s3d::Avx2Kernels();
  return nullptr;
}

const s3d::Kernels* Chosen() {
  static const s3d::Kernels* kernels = ChooseKernels();
  return kernels;
}


// Chunks of tiles are claimed from a shared counter by the calling thread and by helpers alike. The
// caller never waits for a helper to start: it works until nothing is left to claim, then waits only for
// chunks already being worked on. A helper that starts after the call returned finds nothing to claim
// and touches only the shared counters.
struct Job {
  s3d::Problem problem;
  const s3d::Kernels* kernels;
  int64_t tiles, chunk, chunks;
  std::atomic<int64_t> next{0}, done{0};

  void Work() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      kernels->run(problem, c * chunk, std::min(tiles, (c + 1) * chunk));
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
        _mm_pause();
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

// Below this many weight bytes a product is not worth waking another thread for.
constexpr int64_t kParallelBytes = 1 << 16;

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scale,
                  ffi::ResultBuffer<ffi::F32> out, int32_t layout_attr) {
  const s3d::Kernels* kernels = Chosen();
  if (!kernels) return ffi::Error::Internal("s3djax_matmul: this CPU has neither AVX2 with FMA nor AVX-512");
  if (layout_attr < 0 || layout_attr > 2) return ffi::Error::InvalidArgument("s3djax_matmul: unknown layout");
  auto layout = static_cast<s3d::Layout>(layout_attr);
  auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || od.size() != 2)
    return ffi::Error::InvalidArgument("s3djax_matmul: x, w and out must be 2-D");
  bool nk = layout == s3d::Layout::kNK;
  int64_t m = xd[0], k = xd[1], n = nk ? wd[0] : wd[1], wk = nk ? wd[1] : wd[0];
  if (layout == s3d::Layout::kPanels && n % kernels->panel != 0)
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
  if (m == 0 || n == 0) return ffi::Error::Success();
  s3d::Problem p{x.typed_data(), w.untyped_data(), scale.element_count() ? scale.typed_data() : nullptr,
                 out->typed_data(), m, k, n, type, layout};
  if (k == 0) {
    std::memset(p.out, 0, sizeof(float) * m * n);
    return ffi::Error::Success();
  }

  auto job = std::make_shared<Job>();
  job->problem = p;
  job->kernels = kernels;
  job->tiles = kernels->tiles(p);
  static const bool xla_pool = Env("S3DJAX_CPU_POOL", 0) == 1;
  int64_t helpers = static_cast<int64_t>(w.size_bytes()) >= kParallelBytes ? Threads() - 1 : 0;
  if (xla_pool) helpers = std::min<int64_t>(helpers, pool.num_threads() - 1);
  helpers = std::max<int64_t>(0, std::min(helpers, job->tiles - 1));
  // A few chunks per thread, so a thread that starts late still gets a share.
  job->chunks = std::min(job->tiles, (helpers + 1) * 4);
  job->chunk = (job->tiles + job->chunks - 1) / job->chunks;
  job->chunks = (job->tiles + job->chunk - 1) / job->chunk;
  if (helpers && xla_pool) {
    for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->Work(); });
  } else if (helpers) {
    OwnHelpers().Offer(job);
  }
  job->Work();
  while (job->done.load(std::memory_order_acquire) < job->chunks) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(S3dMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("layout"));

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
