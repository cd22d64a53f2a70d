#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <vector>

#include "bindings.h"
#include "dlpack.h"
#include "pyengine/cache_ops.h"

namespace py = pybind11;

namespace pyengine::bindings {

namespace {

// (src, dst) block pairs from any integer array-like on the CPU (a list of pairs, numpy,
// torch), as an owned int64 [num_pairs, 2] view. Owned: the ids are checked and then read
// without the GIL, when another thread could change the caller's array in between.
class BlockMapping {
 public:
  BlockMapping(const py::handle& block_mapping, const char* op) {
    const py::array given = py::module_::import("numpy").attr("asarray")(block_mapping);
    if (given.dtype().kind() != 'i' && given.dtype().kind() != 'u' && given.size() > 0) {
      throw py::type_error(std::string(op) + ": block_mapping must hold integers, got dtype " +
                           std::string(py::str(given.dtype())));
    }
    const auto mapping =
        py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(given);
    const bool no_pairs = mapping.size() == 0 && mapping.ndim() == 1;  // [] is no pairs
    if (!no_pairs && (mapping.ndim() != 2 || mapping.shape(1) != 2)) {
      throw py::value_error(std::string(op) + ": block_mapping must be int64 [num_pairs, 2]");
    }
    pairs_.assign(mapping.data(), mapping.data() + mapping.size());
    view_.data = pairs_.data();
    view_.dtype = DType::kInt64;
    view_.ndim = 2;
    view_.shape = {static_cast<int64_t>(pairs_.size() / 2), 2};
    view_.strides = {2, 1};
  }
  const TensorView& view() const { return view_; }

 private:
  std::vector<int64_t> pairs_;
  TensorView view_;
};

}  // namespace

void bind_cache_ops(py::module_& m) {
  m.def("built_with_cuda", &built_with_cuda, "Whether the CUDA kernels were compiled in.");

  m.def(
      "swap_blocks",
      [](const py::handle& src, const py::handle& dst, const py::handle& block_mapping,
         uintptr_t stream) {
        const DLPackView s(src, "swap_blocks: src");
        const DLPackView d(dst, "swap_blocks: dst");
        const BlockMapping mapping(block_mapping, "swap_blocks");
        py::gil_scoped_release release;
        swap_blocks(s.view(), d.view(), mapping.view(), as_stream(stream));
      },
      py::arg("src"), py::arg("dst"), py::arg("block_mapping"), py::arg("stream") = 0,
      R"doc(Copies blocks between two caches: for each row (s, d) of block_mapping, block d of
dst becomes block s of src.

src, dst:       [num_blocks, ...] of one dtype and block size (their num_blocks may differ);
                each on the CPU or one GPU (pin host memory for asynchronous copies)
block_mapping:  int64 [num_pairs, 2] on the CPU
stream:         a CUDA stream handle where a cache is on a GPU (0: the default stream))doc");

  m.def(
      "copy_blocks",
      [](const py::sequence& caches, const py::handle& block_mapping, uintptr_t stream) {
        std::vector<DLPackView> holders;
        holders.reserve(caches.size());
        for (size_t i = 0; i < caches.size(); ++i) {
          holders.emplace_back(caches[i], "copy_blocks: caches[" + std::to_string(i) + "]");
        }
        std::vector<TensorView> views;
        views.reserve(holders.size());
        for (const DLPackView& h : holders) views.push_back(h.view());
        const BlockMapping mapping(block_mapping, "copy_blocks");
        py::gil_scoped_release release;
        copy_blocks(views, mapping.view(), as_stream(stream));
      },
      py::arg("caches"), py::arg("block_mapping"), py::arg("stream") = 0,
      R"doc(Copies whole KV-cache blocks: for each row (src, dst) of block_mapping, block dst
of every cache becomes a copy of block src.

caches:        sequence of tensors [num_blocks, ...] (DLPack: torch or numpy), one
               shape, dtype and device; dims after the first dense
block_mapping: integer [num_pairs, 2] on the CPU (a list of pairs, numpy or torch)
stream:        a CUDA stream handle for CUDA caches (0: the default stream))doc");
}

}  // namespace pyengine::bindings
