#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "dlpack.h"
#include "pyengine/errors.h"
#include "pyengine/prefix_hash.h"
#include "token_ids.h"

namespace py = pybind11;

namespace pyengine::bindings {

void bind_prefix_hash(py::module_& m) {
  m.def(
      "xxhash64",
      [](py::bytes data, uint64_t seed) {
        const std::string_view bytes = data;
        return xxhash64(bytes.data(), bytes.size(), seed);
      },
      py::arg("data"), py::arg("seed") = 0, "xxHash64 of `data` (the hash prefix keys use).");

  m.def(
      "block_content_hashes",
      [](const py::handle& tokens, int block_size, const py::handle& out, uintptr_t stream) {
        const DLPackView t(tokens, "block_content_hashes: tokens");
        const DLPackView o(out, "block_content_hashes: out");
        py::gil_scoped_release release;
        block_content_hashes(t.view(), block_size, o.view(), as_stream(stream));
      },
      py::arg("tokens"), py::arg("block_size"), py::arg("out"), py::arg("stream") = 0,
      R"doc(The content hash of each full block of `tokens` (int32 [n]) into `out` (int64
[n // block_size], the same device): on a GPU every block in parallel, bit-identical to
the CPU. These are the first level of compute_block_keys' keys.)doc");

  m.def(
      "compute_block_keys",
      [](const py::handle& token_ids, int block_size, int64_t adapter_id,
         const std::string& cache_salt) {
        check_argument(block_size > 0 && (block_size & (block_size - 1)) == 0,
                       "block_size must be a positive power of two");
        const TokenIds tokens(token_ids, "token_ids");
        const size_t num_blocks = tokens.span().size() / static_cast<size_t>(block_size);
        py::array_t<uint64_t> keys({static_cast<py::ssize_t>(num_blocks), py::ssize_t{2}});
        auto* out = reinterpret_cast<BlockKey*>(keys.mutable_data());
        static_assert(sizeof(BlockKey) == 2 * sizeof(uint64_t));
        const uint64_t extras = hash_extras(BlockExtras{adapter_id, cache_salt});
        {
          py::gil_scoped_release release;
          hash_blocks(tokens.span(), block_size, extras, kRootBlockKey, {out, num_blocks});
        }
        return keys;
      },
      py::arg("token_ids"), py::arg("block_size") = 16, py::arg("adapter_id") = 0,
      py::arg("cache_salt") = "",
      R"doc(Prefix-cache keys of the full blocks of a prompt.

token_ids: [num_tokens] ints; returns uint64 [num_tokens // block_size, 2], row i the
128-bit (hi, lo) key of block i, which depends on every token before it and on the
extra keys (adapter_id, cache_salt).)doc");
}

}  // namespace pyengine::bindings
