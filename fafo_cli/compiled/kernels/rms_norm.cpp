// fafo::rms_norm: y = weight * bf16(x * rsqrt(mean(x^2) + eps)) over the last dimension, for bf16 rows on the CPU.
//
// Why: eager steps and compiled packages must compute the same bits. torch's eager reduction and the one
// inductor generates add a row's squares in different orders; their float32 sums part in the last bits, and about
// one bf16 row in 1,700 then rounds apart (docs/benchmarks.md, "Why compiled and eager bf16 steps part"). Both paths
// call this op instead (RMSNorm in runtime/llama.py), so each row is summed in one fixed order: kLanes running
// sums over the row's columns taken in turn, then added lane by lane. Each row depends on its own values alone.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>

#include <cmath>

namespace {

constexpr int64_t kLanes = 16;  // running sums per row (the compiler keeps them in one vector; the order is fixed)

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "fafo::rms_norm takes bf16 rows and a bf16 weight");
  const int64_t size = x.size(-1);
  TORCH_CHECK(weight.numel() == size, "fafo::rms_norm: the weight's size is not the rows'");
  const at::Tensor rows_in = x.contiguous(), w = weight.contiguous();
  at::Tensor out = at::empty_like(rows_in);
  const int64_t rows = size ? rows_in.numel() / size : 0;
  const auto* xp = rows_in.data_ptr<at::BFloat16>();
  const auto* wp = w.data_ptr<at::BFloat16>();
  auto* yp = out.data_ptr<at::BFloat16>();
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const at::BFloat16* row = xp + r * size;
      float lanes[kLanes] = {};
      int64_t i = 0;
      for (; i + kLanes <= size; i += kLanes)
        for (int64_t l = 0; l < kLanes; ++l) {
          const float v = static_cast<float>(row[i + l]);
          lanes[l] += v * v;
        }
      for (int64_t l = 0; i < size; ++i, ++l) {
        const float v = static_cast<float>(row[i]);
        lanes[l] += v * v;
      }
      float sum = 0.0f;
      for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
      const float scale = 1.0f / std::sqrt(sum / static_cast<float>(size) + epsilon);
      for (int64_t j = 0; j < size; ++j) {
        const at::BFloat16 normed(static_cast<float>(row[j]) * scale);  // rounded to bf16, as the module's cast
        yp[r * size + j] = at::BFloat16(static_cast<float>(wp[j]) * static_cast<float>(normed));
      }
    }
  });
  return out.view(x.sizes());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fafo, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(fafo, CPU, m) {
  m.impl("rms_norm", &rms_norm);
}
