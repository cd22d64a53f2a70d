#include <vector>

#include "harness.h"
#include "pyengine/cache_ops.h"
#include "pyengine/errors.h"

using namespace pyengine;

namespace {

// A dense view of `data` as [dims...].
TensorView view(void* data, DType dtype, std::vector<int64_t> dims) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.ndim = static_cast<int>(dims.size());
  int64_t stride = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.shape[static_cast<size_t>(d)] = dims[static_cast<size_t>(d)];
    v.strides[static_cast<size_t>(d)] = stride;
    stride *= dims[static_cast<size_t>(d)];
  }
  return v;
}

}  // namespace

TEST(copies_whole_blocks_in_every_cache) {
  // Two caches of 4 blocks x [2, 3].
  std::vector<float> k(24), v(24);
  for (int i = 0; i < 24; ++i) {
    k[static_cast<size_t>(i)] = static_cast<float>(i);
    v[static_cast<size_t>(i)] = static_cast<float>(-i);
  }
  std::vector<int64_t> mapping = {0, 3, 2, 1};
  const std::vector<TensorView> caches = {view(k.data(), DType::kFloat32, {4, 2, 3}),
                                          view(v.data(), DType::kFloat32, {4, 2, 3})};
  copy_blocks(caches, view(mapping.data(), DType::kInt64, {2, 2}));
  for (int i = 0; i < 6; ++i) {
    CHECK_EQ(k[static_cast<size_t>(18 + i)], static_cast<float>(i));
    CHECK_EQ(v[static_cast<size_t>(6 + i)], static_cast<float>(-(12 + i)));
  }
  CHECK_EQ(k[0], 0.0f);
}

TEST(rejects_mismatched_arguments_before_copying) {
  std::vector<float> k(24, 1.0f);
  std::vector<int16_t> h(24, 0);
  std::vector<int64_t> out_of_range = {0, 4};
  std::vector<int64_t> ok = {0, 1};
  std::vector<int32_t> narrow = {0, 1};
  const TensorView cache = view(k.data(), DType::kFloat32, {4, 6});
  const std::vector<TensorView> one = {cache};
  CHECK_THROWS(InvalidArgument, copy_blocks(one, view(out_of_range.data(), DType::kInt64, {1, 2})));
  CHECK_THROWS(InvalidArgument, copy_blocks(one, view(narrow.data(), DType::kInt32, {1, 2})));
  CHECK_THROWS(InvalidArgument, copy_blocks(one, view(ok.data(), DType::kInt64, {2})));
  const std::vector<TensorView> mixed = {cache, view(h.data(), DType::kFloat16, {4, 6})};
  CHECK_THROWS(InvalidArgument, copy_blocks(mixed, view(ok.data(), DType::kInt64, {1, 2})));
  CHECK_THROWS(InvalidArgument, copy_blocks({}, view(ok.data(), DType::kInt64, {1, 2})));
  TensorView strided = cache;
  strided.strides[1] = 2;  // not dense within a block
  const std::vector<TensorView> bad_layout = {strided};
  CHECK_THROWS(InvalidArgument, copy_blocks(bad_layout, view(ok.data(), DType::kInt64, {1, 2})));
  CHECK_EQ(k[6], 1.0f);
}

TEST(cuda_tensors_without_cuda_are_a_clear_error) {
  if (built_with_cuda()) return;  // a CUDA build would launch on the (fake) pointer
  std::vector<float> k(24);
  std::vector<int64_t> ok = {0, 1};
  TensorView cache = view(k.data(), DType::kFloat32, {4, 6});
  cache.device = {DeviceKind::kCUDA, 0};
  const std::vector<TensorView> caches = {cache};
  CHECK_THROWS(InvalidArgument, copy_blocks(caches, view(ok.data(), DType::kInt64, {1, 2})));
}

TEST_MAIN()
