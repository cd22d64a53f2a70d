#include "pyengine/cache_ops.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include "pyengine/errors.h"

#ifdef PYENGINE_WITH_CUDA
#include "cuda/copy_blocks_launch.h"
#endif

namespace pyengine {
namespace {

void check_block_mapping(const TensorView& mapping, int64_t num_blocks) {
  check_argument(mapping.dtype == DType::kInt64 && mapping.ndim == 2 && mapping.shape[1] == 2,
                 "copy_blocks: block_mapping must be int64 [num_pairs, 2]");
  check_argument(mapping.device.kind == DeviceKind::kCPU,
                 "copy_blocks: block_mapping must be on the CPU");
  check_argument(mapping.is_contiguous(), "copy_blocks: block_mapping must be contiguous");
  const auto* ids = static_cast<const int64_t*>(mapping.data);
  for (int64_t i = 0; i < mapping.shape[0] * 2; ++i) {
    if (ids[i] < 0 || ids[i] >= num_blocks) {
      throw InvalidArgument("copy_blocks: block_mapping[" + std::to_string(i / 2) +
                            "] holds block " + std::to_string(ids[i]) + ", outside [0, " +
                            std::to_string(num_blocks) + ")");
    }
  }
}

// Elements in one block: the product of the dims after the first.
int64_t block_numel(const TensorView& cache) {
  int64_t n = 1;
  for (int d = 1; d < cache.ndim; ++d) n *= cache.shape[static_cast<size_t>(d)];
  return n;
}

void check_caches(std::span<const TensorView> caches) {
  check_argument(!caches.empty(), "copy_blocks: caches is empty");
  const TensorView& first = caches[0];
  for (size_t i = 0; i < caches.size(); ++i) {
    const TensorView& c = caches[i];
    const std::string name = "copy_blocks: caches[" + std::to_string(i) + "] ";
    if (c.ndim < 1 || !c.is_contiguous_from(1) || c.strides[0] < block_numel(c)) {
      throw InvalidArgument(
          name + "must be [num_blocks, ...] with dense dims after the first, got " + c.describe());
    }
    // Keys and values may differ in layout (keys are stored transposed) but not in
    // what a block is: its size, dtype, device and stride, and the number of blocks.
    if (c.dtype != first.dtype || c.device != first.device || c.shape[0] != first.shape[0] ||
        block_numel(c) != block_numel(first) || c.strides[0] != first.strides[0]) {
      throw InvalidArgument(name + c.describe() + " differs from caches[0] " + first.describe() +
                            " (num_blocks, block size, dtype, device or block stride)");
    }
  }
}

}  // namespace

std::vector<int> copy_block_waves(std::span<const int64_t> pairs) {
  check_argument(pairs.size() % 2 == 0, "copy_block_waves: pairs must hold (src, dst) pairs");
  std::unordered_map<int64_t, int> last_write;
  std::unordered_map<int64_t, int> last_read;
  const auto after = [](const std::unordered_map<int64_t, int>& last, int64_t block) {
    const auto it = last.find(block);
    return it == last.end() ? 0 : it->second + 1;
  };
  std::vector<int> waves(pairs.size() / 2);
  for (size_t p = 0; p < waves.size(); ++p) {
    const int64_t src = pairs[2 * p];
    const int64_t dst = pairs[2 * p + 1];
    const int wave =
        std::max({after(last_write, src), after(last_write, dst), after(last_read, dst)});
    waves[p] = wave;
    last_write[dst] = wave;
    int& read = last_read.try_emplace(src, wave).first->second;
    read = std::max(read, wave);
  }
  return waves;
}

void swap_blocks(const TensorView& src, const TensorView& dst, const TensorView& block_mapping,
                 void* stream) {
  for (const auto& [c, name] : {std::pair{&src, "src"}, std::pair{&dst, "dst"}}) {
    if (c->ndim < 1 || !c->is_contiguous_from(1) || c->strides[0] < block_numel(*c)) {
      throw InvalidArgument(std::string("swap_blocks: ") + name +
                            " must be [num_blocks, ...] with dense dims after the first, got " +
                            c->describe());
    }
  }
  const bool src_on_gpu = src.device.kind == DeviceKind::kCUDA;
  const bool dst_on_gpu = dst.device.kind == DeviceKind::kCUDA;
  if (src_on_gpu && dst_on_gpu && src.device != dst.device) {
    throw InvalidArgument("swap_blocks: src is on " + device_name(src.device) + " and dst on " +
                          device_name(dst.device) + "; one GPU at a time");
  }
  if (src.dtype != dst.dtype || block_numel(src) != block_numel(dst)) {
    throw InvalidArgument("swap_blocks: src " + src.describe() + " and dst " + dst.describe() +
                          " differ in dtype or block size");
  }
  check_argument(block_mapping.dtype == DType::kInt64 && block_mapping.ndim == 2 &&
                     block_mapping.shape[1] == 2 && block_mapping.is_contiguous() &&
                     block_mapping.device.kind == DeviceKind::kCPU,
                 "swap_blocks: block_mapping must be int64 [num_pairs, 2] on the CPU");
  const auto* pairs = static_cast<const int64_t*>(block_mapping.data);
  const int64_t num_pairs = block_mapping.shape[0];
  for (int64_t p = 0; p < num_pairs; ++p) {
    if (pairs[2 * p] < 0 || pairs[2 * p] >= src.shape[0] || pairs[2 * p + 1] < 0 ||
        pairs[2 * p + 1] >= dst.shape[0]) {
      throw InvalidArgument("swap_blocks: block_mapping[" + std::to_string(p) + "] = (" +
                            std::to_string(pairs[2 * p]) + ", " + std::to_string(pairs[2 * p + 1]) +
                            ") is outside src's or dst's blocks");
    }
  }
  const auto element = static_cast<int64_t>(src.element_size());
  const auto bytes = static_cast<size_t>(block_numel(src) * element);
  if (src_on_gpu || dst_on_gpu) {
#ifdef PYENGINE_WITH_CUDA
    cuda::swap_blocks(src.data, src.strides[0] * element, dst.data, dst.strides[0] * element,
                      static_cast<int64_t>(bytes), pairs, num_pairs,
                      (src_on_gpu ? src : dst).device.index, stream);
    return;
#else
    (void)stream;
    throw InvalidArgument(
        "swap_blocks: a cache is on a GPU but pyengine was built without CUDA "
        "(PYENGINE_CUDA=off or no nvcc)");
#endif
  }
  for (int64_t p = 0; p < num_pairs; ++p) {
    std::memmove(static_cast<char*>(dst.data) + pairs[2 * p + 1] * dst.strides[0] * element,
                 static_cast<const char*>(src.data) + pairs[2 * p] * src.strides[0] * element,
                 bytes);
  }
}

bool built_with_cuda() {
#ifdef PYENGINE_WITH_CUDA
  return true;
#else
  return false;
#endif
}

void copy_blocks(std::span<const TensorView> caches, const TensorView& block_mapping,
                 void* stream) {
  check_caches(caches);
  const TensorView& first = caches[0];
  check_block_mapping(block_mapping, first.shape[0]);
  const int64_t num_pairs = block_mapping.shape[0];
  if (num_pairs == 0) return;
  const int64_t block_bytes = block_numel(first) * static_cast<int64_t>(first.element_size());
  const auto* pairs = static_cast<const int64_t*>(block_mapping.data);

  if (first.device.kind == DeviceKind::kCUDA) {
#ifdef PYENGINE_WITH_CUDA
    std::vector<void*> bases;
    bases.reserve(caches.size());
    for (const TensorView& c : caches) bases.push_back(c.data);
    const int64_t stride_bytes = first.strides[0] * static_cast<int64_t>(first.element_size());
    // The kernel copies a wave's pairs in parallel: sort the pairs by wave.
    const std::span<const int64_t> all(pairs, static_cast<size_t>(2 * num_pairs));
    const std::vector<int> waves = copy_block_waves(all);
    const int num_waves = *std::max_element(waves.begin(), waves.end()) + 1;
    std::vector<int64_t> wave_starts(static_cast<size_t>(num_waves) + 1, 0);
    for (const int w : waves) ++wave_starts[static_cast<size_t>(w) + 1];
    for (size_t w = 1; w < wave_starts.size(); ++w) wave_starts[w] += wave_starts[w - 1];
    std::vector<int64_t> sorted(all.size());
    std::vector<int64_t> next(wave_starts.begin(), wave_starts.end() - 1);
    for (size_t p = 0; p < waves.size(); ++p) {
      const auto at = static_cast<size_t>(next[static_cast<size_t>(waves[p])]++);
      sorted[2 * at] = all[2 * p];
      sorted[2 * at + 1] = all[2 * p + 1];
    }
    cuda::copy_blocks(bases.data(), static_cast<int64_t>(bases.size()), stride_bytes, block_bytes,
                      sorted.data(), wave_starts.data(), num_waves, first.device.index, stream);
    return;
#else
    (void)stream;
    throw InvalidArgument("copy_blocks: caches are on " + device_name(first.device) +
                          " but pyengine was built without CUDA (PYENGINE_CUDA=off or no nvcc)");
#endif
  }
  for (const TensorView& c : caches) {
    auto* base = static_cast<unsigned char*>(c.data);
    const int64_t stride = c.strides[0] * static_cast<int64_t>(c.element_size());
    for (int64_t p = 0; p < num_pairs; ++p) {
      // memmove: a pair may name one block twice.
      std::memmove(base + pairs[2 * p + 1] * stride, base + pairs[2 * p] * stride,
                   static_cast<size_t>(block_bytes));
    }
  }
}

}  // namespace pyengine
