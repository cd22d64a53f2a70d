// Launchers of the tensor-core paged-attention kernel (flash_attention.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "cuda/flash_attention.cuh"
#include "cuda/flash_attention_launch.h"
#include "cuda/runtime_guards.h"

namespace pyengine::cuda {
namespace {

using flash::flash_attention_kernel;

// Sets, once for each device it runs on, a kernel's dynamic shared memory (over the
// default 48 KB for eight-warp blocks) and its wish for shared memory over L1.
void configure(const void* kernel, unsigned shared_bytes, std::atomic<uint64_t>& devices) {
  int device = 0;
  check_cuda("paged_attention", cudaGetDevice(&device), "cudaGetDevice");
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;  // past 64: every launch
  if (bit != 0 && (devices.load(std::memory_order_relaxed) & bit) != 0) return;
  check_cuda("paged_attention",
             cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(shared_bytes)),
             "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  check_cuda("paged_attention",
             cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                  cudaSharedmemCarveoutMaxShared),
             "cudaFuncSetAttribute(PreferredSharedMemoryCarveout)");
  devices.fetch_or(bit, std::memory_order_relaxed);
}

template <typename T, int D, int kWarps>
void launch_kernel(const AttentionParams& p, const dim3& grid, cudaStream_t stream) {
  const auto kernel = flash_attention_kernel<T, D, kWarps>;
  constexpr unsigned kSharedBytes = flash::shared_bytes<T, D, kWarps>();
  static std::atomic<uint64_t> configured_devices{0};
  configure(reinterpret_cast<const void*>(kernel), kSharedBytes, configured_devices);
  kernel<<<grid, kWarps * kWarp, kSharedBytes, stream>>>(p);
}

template <typename T, int kWarps>
void launch_for_head_size(const AttentionParams& p, const dim3& grid, cudaStream_t stream) {
  switch (p.head_size) {
    case 64: return launch_kernel<T, 64, kWarps>(p, grid, stream);
    case 80: return launch_kernel<T, 80, kWarps>(p, grid, stream);
    case 96: return launch_kernel<T, 96, kWarps>(p, grid, stream);
    case 128: return launch_kernel<T, 128, kWarps>(p, grid, stream);
    case 256: return launch_kernel<T, 256, kWarps>(p, grid, stream);
    default: throw std::invalid_argument("flash_attention (CUDA): unsupported head size");
  }
}

template <typename T>
void launch(const AttentionParams& p, int warps, const dim3& grid, cudaStream_t stream) {
  switch (warps) {
    case 1: return launch_for_head_size<T, 1>(p, grid, stream);
    case 4: return launch_for_head_size<T, 4>(p, grid, stream);
    default: return launch_for_head_size<T, 8>(p, grid, stream);
  }
}

// PYENGINE_FLASH_PREFILL_WARPS=4 runs prefills in four-warp blocks instead of eight-warp
// ones: a switch for comparing the two on a device (bench/gpu/run.sh), read once.
int prefill_warps() {
  static const int warps = [] {
    const char* value = std::getenv("PYENGINE_FLASH_PREFILL_WARPS");
    const std::string text = value == nullptr ? "" : value;
    if (text.empty()) return flash::kPrefillWarps;
    if (text == "4" || text == "8") return std::stoi(text);
    throw std::invalid_argument("PYENGINE_FLASH_PREFILL_WARPS must be 4 or 8, not '" + text + "'");
  }();
  return warps;
}

// The eight-warp blocks' shared memory for a head size (the same for both 16-bit types).
unsigned eight_warp_shared_bytes(int head_size) {
  switch (head_size) {
    case 64: return flash::shared_bytes<__half, 64, 8>();
    case 80: return flash::shared_bytes<__half, 80, 8>();
    case 96: return flash::shared_bytes<__half, 96, 8>();
    case 128: return flash::shared_bytes<__half, 128, 8>();
    default: return flash::shared_bytes<__half, 256, 8>();
  }
}

// The most shared memory a block may opt into on the current device, read once a device.
int max_shared_bytes() {
  static std::array<std::atomic<int>, 64> known{};  // 0: not read yet
  int device = 0;
  check_cuda("paged_attention", cudaGetDevice(&device), "cudaGetDevice");
  if (device < 64 && known[device].load(std::memory_order_relaxed) > 0) return known[device];
  int bytes = 0;
  check_cuda("paged_attention",
             cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
             "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
  if (device < 64) known[device].store(bytes, std::memory_order_relaxed);
  return bytes;
}

// Eight-warp prefill blocks where the device gives them their shared memory (108 KB at
// head size 128: an A100 or H100 does, an sm_86/89 card's 99 KB does not), else four.
int prefill_warps_for(int head_size) {
  if (prefill_warps() == 4) return 4;
  return eight_warp_shared_bytes(head_size) <= static_cast<unsigned>(max_shared_bytes()) ? 8 : 4;
}

}  // namespace

bool flash_attention_supports(DType dtype, int head_size, int block_size, int group_size) {
  const bool sixteen_bit = dtype == DType::kFloat16 || dtype == DType::kBFloat16;
  const bool head =
      head_size == 64 || head_size == 80 || head_size == 96 || head_size == 128 || head_size == 256;
  // Blocks of a power of two, at least 8, keys: 8 keys of one copy never straddle blocks,
  // and a key's block and offset are a shift and a mask.
  const bool block = block_size >= 8 && (block_size & (block_size - 1)) == 0;
  return sixteen_bit && head && block && group_size >= 1 && group_size <= flash::kMaxGroupSize;
}

void flash_attention(AttentionParams p, DType dtype, int64_t max_query_len, cudaStream_t stream) {
  const flash::Launch shape = flash::plan_launch(p, max_query_len, prefill_warps_for(p.head_size));
  const dim3 grid(shape.grid_x, shape.grid_y, shape.grid_z);
  if (dtype == DType::kFloat16) {
    launch<__half>(p, shape.warps, grid, stream);
  } else {
    launch<__nv_bfloat16>(p, shape.warps, grid, stream);
  }
  check_cuda("paged_attention", cudaGetLastError(), "flash kernel launch");
}

}  // namespace pyengine::cuda
