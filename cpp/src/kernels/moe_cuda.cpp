// The glue of the CUDA mixture-of-experts kernels (see pyengine/moe.h; the kernels are in
// cuda/moe_kernels.cuh): every argument checked before the launch. Without a CUDA build
// the checks still run, and a CUDA tensor is refused by name (detail::on_cuda).
#include <algorithm>
#include <string>

#include "moe_cuda.h"
#include "pyengine/errors.h"
#include "pyengine/moe.h"
#include "tensor_checks.h"
#ifdef PYENGINE_WITH_CUDA
#include "cuda/moe_launch.h"
#endif

namespace pyengine {
namespace {

using detail::arg;

// The kernels' bounds (cuda/moe_launch.h's, which only a CUDA build includes).
constexpr int64_t kMaxExperts = 1024;
constexpr int64_t kMaxTopK = 32;
#ifdef PYENGINE_WITH_CUDA
static_assert(kMaxExperts == cuda::kMoeMaxExperts && kMaxTopK == cuda::kMoeMaxTopK &&
              kMoeBlockRows == cuda::kMoeBlockRows);
#endif

// The device of `first`, a CUDA one, or InvalidArgument naming the op's CPU form.
Device cuda_device(const TensorView& first, const char* op, const char* name) {
  if (!detail::on_cuda(first.device, op)) {
    throw InvalidArgument(arg(op, name) + " is on the CPU; this op runs on CUDA tensors (the " +
                          "CPU's experts are multiplied by fused_experts)");
  }
  return first.device;
}

// A dense [rows, columns] tensor of `dtype` on `device` (columns < 0: any).
void check_dense(const TensorView& t, const Device& device, const char* op, const char* name,
                 DType dtype, int64_t rows, int64_t columns) {
  detail::check_device(t, device, op, name);
  if (t.ndim != 2 || t.dtype != dtype || t.shape[0] != rows ||
      (columns >= 0 && t.shape[1] != columns) || !t.is_contiguous()) {
    throw InvalidArgument(arg(op, name) + " must be dense " + dtype_name(dtype) + " [" +
                          std::to_string(rows) + ", " +
                          (columns >= 0 ? std::to_string(columns) : std::string("...")) +
                          "], got " + t.describe());
  }
}

// A dense int32 [size] on `device` (the aligned blocks' slots or experts).
void check_blocks(const TensorView& t, const Device& device, const char* op, const char* name,
                  int64_t size) {
  detail::check_device(t, device, op, name);
  if (t.ndim != 1 || t.dtype != DType::kInt32 || t.shape[0] != size ||
      (size > 1 && t.strides[0] != 1)) {
    throw InvalidArgument(arg(op, name) + " must be dense int32 [" + std::to_string(size) +
                          "] (moe_max_blocks), got " + t.describe());
  }
}

// ids int32 [t, top_k] dense, and the rank's experts [first, first + experts) within
// the kernels' bounds.
void check_ids(const TensorView& ids, const Device& device, const char* op, int64_t first,
               int64_t experts) {
  detail::check_device(ids, device, op, "ids");
  if (ids.ndim != 2 || ids.dtype != DType::kInt32 || !ids.is_contiguous() || ids.shape[1] < 1 ||
      ids.shape[1] > kMaxTopK || ids.shape[0] * ids.shape[1] > (int64_t{1} << 30)) {
    throw InvalidArgument(arg(op, "ids") + " must be dense int32 [t, top_k], top_k in [1, " +
                          std::to_string(kMaxTopK) + "], got " + ids.describe());
  }
  if (first < 0 || experts < 1 || experts > kMaxExperts) {
    throw InvalidArgument(std::string(op) + ": a rank's experts must be 1 to " +
                          std::to_string(kMaxExperts) + " from first_expert >= 0, got " +
                          std::to_string(experts) + " from " + std::to_string(first));
  }
}

bool is_16_bit(DType dtype) { return dtype == DType::kFloat16 || dtype == DType::kBFloat16; }

}  // namespace

namespace detail {

void moe_softmax_topk_cuda(const TensorView& ids, const TensorView& weights,
                           const TensorView& logits, bool renormalize, void* stream) {
  constexpr const char* op = "moe_softmax_topk";
  const Device device = logits.device;
  if (logits.ndim != 2 || !(is_16_bit(logits.dtype) || logits.dtype == DType::kFloat32) ||
      (logits.strides[1] != 1 && logits.shape[1] > 1) || logits.shape[0] > (int64_t{1} << 30)) {
    throw InvalidArgument(arg(op, "logits") + " must be float32, float16 or bfloat16 [t, " +
                          "experts] with dense rows, got " + logits.describe());
  }
  const int64_t t = logits.shape[0], experts = logits.shape[1];
  check_dense(ids, device, op, "ids", DType::kInt32, t, -1);
  const int64_t top_k = ids.shape[1];
  check_dense(weights, device, op, "weights", DType::kFloat32, t, top_k);
  if (top_k < 1 || top_k > experts) {
    throw InvalidArgument(std::string(op) + ": top_k (ids' columns) must be in [1, " +
                          std::to_string(experts) + "], got " + std::to_string(top_k));
  }
#ifdef PYENGINE_WITH_CUDA
  cuda::moe_softmax_topk(ids, weights, logits, renormalize, stream);
#else
  (void)renormalize, (void)stream;
#endif
}

}  // namespace detail

int64_t moe_max_blocks(int64_t slots, int64_t experts) {
  if (slots < 0 || experts < 1) {
    throw InvalidArgument("moe_max_blocks: slots must be >= 0 and experts >= 1, got " +
                          std::to_string(slots) + " and " + std::to_string(experts));
  }
  // (each used block holds a slot at least; an expert's last block may be part empty)
  return std::min(slots, (slots + kMoeBlockRows - 1) / kMoeBlockRows + experts);
}

void moe_align_blocks(const TensorView& sorted, const TensorView& block_experts,
                      const TensorView& ids, int64_t first_expert, int64_t experts,
                      void* stream) {
  constexpr const char* op = "moe_align_blocks";
  const Device device = cuda_device(ids, op, "ids");
  check_ids(ids, device, op, first_expert, experts);
  const int64_t blocks = moe_max_blocks(ids.shape[0] * ids.shape[1], experts);
  check_blocks(sorted, device, op, "sorted", blocks * kMoeBlockRows);
  check_blocks(block_experts, device, op, "block_experts", blocks);
#ifdef PYENGINE_WITH_CUDA
  cuda::moe_align_blocks(sorted, block_experts, ids, static_cast<int>(first_expert),
                         static_cast<int>(experts), stream);
#else
  (void)stream;
#endif
}

void moe_expert_gemm(const TensorView& out, const TensorView& x, const TensorView& w,
                     const TensorView& sorted, const TensorView& block_experts,
                     const TensorView& weights, int64_t top_k, bool gate_up, bool on_input,
                     void* stream) {
  constexpr const char* op = "moe_expert_gemm";
  const Device device = cuda_device(x, op, "x");
  if (!is_16_bit(x.dtype) || x.ndim != 2 || x.strides[1] != 1 || x.strides[0] % 2 != 0) {
    throw InvalidArgument(arg(op, "x") + " must be float16 or bfloat16 [rows, k] with dense " +
                          "rows an even number of elements apart, got " + x.describe());
  }
  const int64_t k = x.shape[1];
  if (top_k < 1 || top_k > kMaxTopK || weights.ndim != 2 || weights.shape[1] != top_k) {
    throw InvalidArgument(std::string(op) + ": top_k must be weights' columns, in [1, " +
                          std::to_string(kMaxTopK) + "], got " + std::to_string(top_k) +
                          " and weights " + weights.describe());
  }
  const int64_t t = weights.shape[0], slots = t * top_k;
  check_dense(weights, device, op, "weights", DType::kFloat32, t, top_k);
  detail::check_device(w, device, op, "w");
  if (w.ndim != 3 || w.dtype != x.dtype || !w.is_contiguous() || w.shape[2] != k ||
      k % 16 != 0 || w.shape[0] < 1 || w.shape[0] > kMaxExperts ||
      (gate_up && w.shape[1] % 2 != 0)) {
    throw InvalidArgument(arg(op, "w") + " must be dense [experts, " +
                          (gate_up ? "2n" : "n") + ", " + std::to_string(k) + "] of x's " +
                          "dtype, k a multiple of 16 and at most " + std::to_string(kMaxExperts) +
                          " experts, got " + w.describe());
  }
  const int64_t n = gate_up ? w.shape[1] / 2 : w.shape[1];
  if (x.shape[0] != (gate_up ? t : slots)) {
    throw InvalidArgument(arg(op, "x") + " must have " + std::to_string(gate_up ? t : slots) +
                          (gate_up ? " rows (a token each)" : " rows (a slot each)") + ", got " +
                          x.describe());
  }
  detail::check_rows_on(out, device, op, "out", 2, gate_up ? x.dtype : DType::kFloat32);
  detail::check_writable(out, op, "out");
  if (out.shape[0] != slots || out.shape[1] != n) {
    throw InvalidArgument(arg(op, "out") + " must be [" + std::to_string(slots) + ", " +
                          std::to_string(n) + "], got " + out.describe());
  }
  const int64_t blocks = moe_max_blocks(slots, w.shape[0]);
  check_blocks(sorted, device, op, "sorted", blocks * kMoeBlockRows);
  check_blocks(block_experts, device, op, "block_experts", blocks);
#ifdef PYENGINE_WITH_CUDA
  cuda::moe_expert_gemm(out, x, w, sorted, block_experts, weights, static_cast<int>(top_k),
                        gate_up, on_input, stream);
#else
  (void)on_input, (void)stream;
#endif
}

void moe_combine(const TensorView& out, const TensorView& y, const TensorView& ids,
                 int64_t first_expert, int64_t experts, void* stream) {
  constexpr const char* op = "moe_combine";
  const Device device = cuda_device(out, op, "out");
  check_ids(ids, device, op, first_expert, experts);
  const int64_t t = ids.shape[0];
  if (!is_16_bit(out.dtype)) {
    throw InvalidArgument(arg(op, "out") + " must be float16 or bfloat16, got " + out.describe());
  }
  detail::check_rows_on(out, device, op, "out", 2, out.dtype);
  detail::check_writable(out, op, "out");
  if (out.shape[0] != t) {
    throw InvalidArgument(arg(op, "out") + " must have ids' " + std::to_string(t) +
                          " rows, got " + out.describe());
  }
  detail::check_rows_on(y, device, op, "y", 2, DType::kFloat32);
  if (y.shape[0] != t * ids.shape[1] || y.shape[1] != out.shape[1]) {
    throw InvalidArgument(arg(op, "y") + " must be [" + std::to_string(t * ids.shape[1]) + ", " +
                          std::to_string(out.shape[1]) + "] (a row a slot), got " + y.describe());
  }
#ifdef PYENGINE_WITH_CUDA
  cuda::moe_combine(out, y, ids, static_cast<int>(first_expert), static_cast<int>(experts),
                    stream);
#else
  (void)stream;
#endif
}

}  // namespace pyengine
