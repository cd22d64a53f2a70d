// The block-quantized CUDA GEMM's glue (see pyengine/block_gemm.h): the reorder of the
// integers at load (CPU), and the checks before the launch.
#include "pyengine/block_gemm.h"

#include <cstring>
#include <string>

#include "tensor_checks.h"
#ifdef PYENGINE_WITH_CUDA
#include "cuda/block_gemm_launch.h"
#endif

namespace pyengine {
namespace {

using detail::arg;

constexpr int64_t kTileColumns = 8, kBlockK = 32, kLanes = 32;

void check_bits(const char* op, int bits) {
  if (bits != 4 && bits != 8) {
    throw InvalidArgument(std::string(op) + ": bits must be 4 or 8, got " + std::to_string(bits));
  }
}

// Where lane l's value p of k block b lies (block_gemm.cuh): the k within the block.
int64_t k_of(int64_t lane, int64_t p) {
  const int64_t t = lane % 4, half = p / 4, pair = p % 4 / 2, e = p % 2;
  return half * 16 + 2 * t + 8 * pair + e;
}

}  // namespace

int64_t packed_block_gemm_size(int64_t k, int64_t n, int bits) {
  constexpr const char* op = "packed_block_gemm_size";
  check_bits(op, bits);
  if (k < 0 || n < 0 || k % kBlockK != 0) {
    throw InvalidArgument(std::string(op) + ": k must be a multiple of 32 and n >= 0, got k " +
                          std::to_string(k) + ", n " + std::to_string(n));
  }
  return (n + kTileColumns - 1) / kTileColumns * kTileColumns * k * bits / 8;
}

void pack_block_gemm_weight(const TensorView& packed, const TensorView& q, int bits) {
  constexpr const char* op = "pack_block_gemm_weight";
  check_bits(op, bits);
  detail::check_rows(q, op, "q", 2, bits == 4 ? DType::kUInt8 : DType::kInt8);
  const int64_t n = q.shape[0], k = q.shape[1];
  const int64_t size = packed_block_gemm_size(k, n, bits);
  detail::check_cpu(packed, op, "packed");
  detail::check_dtype(packed, DType::kUInt8, op, "packed");
  if (packed.ndim != 1 || packed.shape[0] != size || packed.strides[0] != 1) {
    throw InvalidArgument(arg(op, "packed") + " must be dense uint8 [" + std::to_string(size) +
                          "], got " + packed.describe());
  }
  const auto* src = static_cast<const uint8_t*>(q.data);
  if (bits == 4) {
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t i = 0; i < k; ++i) {
        if (src[j * q.strides[0] + i] > 15) {
          throw InvalidArgument(std::string(op) + ": a 4-bit q holds values 0..15, row " +
                                std::to_string(j) + " has more");
        }
      }
    }
  }
  auto* dst = static_cast<uint8_t*>(packed.data);
  std::memset(dst, 0, static_cast<size_t>(size));
  const int64_t k_blocks = k / kBlockK, lane_bytes = 8 * bits / 8;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t tile = j / kTileColumns, g = j % kTileColumns;
    for (int64_t b = 0; b < k_blocks; ++b) {
      for (int64_t t = 0; t < 4; ++t) {
        const int64_t lane = g * 4 + t;
        uint8_t* word = dst + ((tile * k_blocks + b) * kLanes + lane) * lane_bytes;
        for (int64_t p = 0; p < 8; ++p) {
          const uint8_t value = src[j * q.strides[0] + b * kBlockK + k_of(lane, p)];
          if (bits == 4) {
            word[p / 2] |= static_cast<uint8_t>((value & 15) << (4 * (p % 2)));
          } else {
            word[p] = value;
          }
        }
      }
    }
  }
}

void block_gemm(const TensorView& out, const TensorView& x, const TensorView& packed,
                const TensorView& scale, const TensorView& offset, const TensorView& bias,
                int bits, int64_t group, void* stream) {
  constexpr const char* op = "block_gemm";
  check_bits(op, bits);
  const Device& device = x.device;
  if (!detail::on_cuda(device, op)) {
    throw InvalidArgument(std::string(op) + ": runs on CUDA tensors (the CPU multiplies " +
                          "blocks through dense), got x " + x.describe());
  }
  for (const auto& [t, name] : {std::pair{&out, "out"}, std::pair{&x, "x"}}) {
    detail::check_rows_on(*t, device, op, name, 2, x.dtype);
  }
  if (x.dtype != DType::kFloat16 && x.dtype != DType::kBFloat16) {
    throw InvalidArgument(arg(op, "x") + " must be float16 or bfloat16, got " + x.describe());
  }
  detail::check_writable(out, op, "out");
  const int64_t m = x.shape[0], k = x.shape[1], n = out.shape[1];
  if (out.shape[0] != m) {
    throw InvalidArgument(std::string(op) + ": out must have x's " + std::to_string(m) +
                          " rows, got " + out.describe());
  }
  // (the launch's grid: 16 rows a block in y, at most 65535 blocks; int sizes)
  if (m > int64_t{65535} * 16 || n > (int64_t{1} << 30) || k > (int64_t{1} << 30)) {
    throw InvalidArgument(std::string(op) + ": at most 1048560 rows and 2^30 columns, got x " +
                          x.describe() + ", out " + out.describe());
  }
  if (group != 32 && !(bits == 8 && group == 16)) {
    throw InvalidArgument(std::string(op) + ": group must be 32 (or 16 at 8 bits), got " +
                          std::to_string(group));
  }
  const int64_t size = packed_block_gemm_size(k, n, bits);
  detail::check_device(packed, device, op, "packed");
  if (packed.dtype != DType::kUInt8 || packed.ndim != 1 || packed.shape[0] != size ||
      packed.strides[0] != 1) {
    throw InvalidArgument(arg(op, "packed") + " must be dense uint8 [" + std::to_string(size) +
                          "] (pack_block_gemm_weight of a [" + std::to_string(n) + ", " +
                          std::to_string(k) + "] weight), got " + packed.describe());
  }
  for (const auto& [t, name] : {std::pair{&scale, "scale"}, std::pair{&offset, "offset"}}) {
    detail::check_device(*t, device, op, name);
    if (t->dtype != DType::kFloat32 || t->ndim != 2 || t->shape[0] != n ||
        t->shape[1] != k / group || !t->is_contiguous()) {
      throw InvalidArgument(arg(op, name) + " must be dense float32 [" + std::to_string(n) +
                            ", " + std::to_string(k / group) + "], got " + t->describe());
    }
  }
  if (bias.data != nullptr) {
    detail::check_device(bias, device, op, "bias");
    if (bias.dtype != DType::kFloat32 || bias.ndim != 1 || bias.shape[0] != n ||
        bias.strides[0] != 1) {
      throw InvalidArgument(arg(op, "bias") + " must be dense float32 [" + std::to_string(n) +
                            "], got " + bias.describe());
    }
  }
#ifdef PYENGINE_WITH_CUDA
  cuda::block_gemm(out, x, packed, scale, offset, bias, bits, static_cast<int>(group), stream);
#else
  (void)stream;
#endif
}

}  // namespace pyengine
