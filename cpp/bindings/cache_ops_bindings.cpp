#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <vector>

#include "bindings.h"
#include "dlpack.h"
#include "pyengine/cache_ops.h"

namespace py = pybind11;

namespace pyengine::bindings {

void bind_cache_ops(py::module_& m) {
  m.def("built_with_cuda", &built_with_cuda, "Whether the CUDA kernels were compiled in.");

  m.def(
      "copy_blocks",
      [](const py::sequence& caches, const py::handle& block_mapping) {
        std::vector<DLPackView> holders;
        holders.reserve(caches.size());
        for (size_t i = 0; i < caches.size(); ++i) {
          holders.emplace_back(caches[i], "copy_blocks: caches[" + std::to_string(i) + "]");
        }
        std::vector<TensorView> views;
        views.reserve(holders.size());
        for (const DLPackView& h : holders) views.push_back(h.view());
        // The mapping is read by the host: any integer array-like on the CPU will do.
        const py::array given = py::module_::import("numpy").attr("asarray")(block_mapping);
        if (given.dtype().kind() != 'i' && given.dtype().kind() != 'u' && given.size() > 0) {
          throw py::type_error("copy_blocks: block_mapping must hold integers, got dtype " +
                               std::string(py::str(given.dtype())));
        }
        const auto mapping =
            py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(given);
        const bool no_pairs = mapping.size() == 0 && mapping.ndim() == 1;  // [] is no pairs
        if (!no_pairs && (mapping.ndim() != 2 || mapping.shape(1) != 2)) {
          throw py::value_error("copy_blocks: block_mapping must be int64 [num_pairs, 2]");
        }
        // Owned: the ids are checked and then read without the GIL, when another thread
        // could change the caller's array in between.
        std::vector<int64_t> pairs(mapping.data(), mapping.data() + mapping.size());
        TensorView mapping_view;
        mapping_view.data = pairs.data();
        mapping_view.dtype = DType::kInt64;
        mapping_view.ndim = 2;
        mapping_view.shape = {static_cast<int64_t>(pairs.size() / 2), 2};
        mapping_view.strides = {2, 1};
        py::gil_scoped_release release;
        copy_blocks(views, mapping_view, nullptr);
      },
      py::arg("caches"), py::arg("block_mapping"),
      R"doc(Copies whole KV-cache blocks: for each row (src, dst) of block_mapping, block dst
of every cache becomes a copy of block src.

caches:        sequence of tensors [num_blocks, ...] (DLPack: torch or numpy), one
               shape, dtype and device; dims after the first dense
block_mapping: integer [num_pairs, 2] on the CPU (a list of pairs, numpy or torch))doc");
}

}  // namespace pyengine::bindings
