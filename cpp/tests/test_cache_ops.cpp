#include <vector>

#include "dense_view.h"
#include "harness.h"
#include "pyengine/cache_ops.h"
#include "pyengine/errors.h"

using namespace pyengine;
using pyengine::testing::view;

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

TEST(waves_order_dependent_pairs) {
  // Regression: the CUDA kernel ran all pairs at once, but copy-on-write can queue a
  // block as one pair's source and a later pair's destination.
  const std::vector<int64_t> chain = {0, 2, 1, 0};  // block 0 read, then overwritten
  CHECK((copy_block_waves(chain) == std::vector<int>{0, 1}));
  const std::vector<int64_t> independent = {0, 3, 1, 4, 2, 5};
  CHECK((copy_block_waves(independent) == std::vector<int>{0, 0, 0}));
  const std::vector<int64_t> same_dst = {0, 5, 1, 5};  // the later write wins
  CHECK((copy_block_waves(same_dst) == std::vector<int>{0, 1}));
  const std::vector<int64_t> read_after_write = {0, 1, 1, 2, 3, 4};
  CHECK((copy_block_waves(read_after_write) == std::vector<int>{0, 1, 0}));
  CHECK_THROWS(InvalidArgument, copy_block_waves(std::vector<int64_t>{1, 2, 3}));
}

TEST(pairs_apply_in_order_on_the_cpu) {
  std::vector<float> cache = {10, 10, 20, 20, 0, 0};  // 3 blocks of 2
  std::vector<int64_t> mapping = {0, 2, 1, 0};
  const std::vector<TensorView> caches = {view(cache.data(), DType::kFloat32, {3, 2})};
  copy_blocks(caches, view(mapping.data(), DType::kInt64, {2, 2}));
  CHECK((cache == std::vector<float>{20, 20, 20, 20, 10, 10}));
}

TEST(caches_must_share_a_block_stride) {
  std::vector<float> keys(32), values(16);
  std::vector<int64_t> ok = {0, 1};
  TensorView padded = view(keys.data(), DType::kFloat32, {4, 4});
  padded.strides[0] = 8;  // every other row of a [4, 8] buffer
  const std::vector<TensorView> caches = {padded, view(values.data(), DType::kFloat32, {4, 4})};
  CHECK_THROWS(InvalidArgument, copy_blocks(caches, view(ok.data(), DType::kInt64, {1, 2})));
}

TEST_MAIN()
