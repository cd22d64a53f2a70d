#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bindings.h"
#include "dlpack.h"
#include "kernel_call.h"
#include "pyengine/attention.h"
#include "pyengine/dense.h"
#include "pyengine/mla.h"

namespace py = pybind11;

namespace pyengine::bindings {

namespace {

CpuIsa parse_isa(const std::string& name) {
  if (name == "auto") return CpuIsa::kAuto;
  if (name == "generic") return CpuIsa::kGeneric;
  if (name == "avx2") return CpuIsa::kAvx2;
  if (name == "avx512") return CpuIsa::kAvx512;
  throw py::value_error("isa must be 'auto', 'generic', 'avx2' or 'avx512', got '" + name + "'");
}

const char* isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAuto: return "auto";
    case CpuIsa::kGeneric: return "generic";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
  }
  return "generic";
}


KernelCall prepare_reshape_and_cache(const py::handle& key, const py::handle& value,
                                     const py::handle& key_cache, const py::handle& value_cache,
                                     const py::handle& slot_mapping, float k_scale, float v_scale,
                                     uintptr_t stream) {
  auto k = shared_view(key, "reshape_and_cache: key");
  auto v = shared_view(value, "reshape_and_cache: value");
  auto kc = shared_view(key_cache, "reshape_and_cache: key_cache");
  auto vc = shared_view(value_cache, "reshape_and_cache: value_cache");
  auto slots = shared_view(slot_mapping, "reshape_and_cache: slot_mapping");
  return {[=] {
    reshape_and_cache(k->view(), v->view(), kc->view(), vc->view(), slots->view(), k_scale,
                      v_scale, as_stream(stream));
  }};
}

KernelCall prepare_paged_attention(const py::handle& out, const py::handle& query,
                                   const py::handle& key_cache, const py::handle& value_cache,
                                   const py::handle& block_tables, const py::handle& seq_lens,
                                   const py::handle& query_start_loc, float scale,
                                   int sliding_window, float logit_soft_cap, int64_t max_seq_len,
                                   int64_t max_query_len, const py::handle& sinks,
                                   int attention_chunk, uintptr_t stream) {
  auto o = shared_view(out, "paged_attention: out");
  auto q = shared_view(query, "paged_attention: query");
  auto kc = shared_view(key_cache, "paged_attention: key_cache");
  auto vc = shared_view(value_cache, "paged_attention: value_cache");
  auto tables = shared_view(block_tables, "paged_attention: block_tables");
  auto lens = shared_view(seq_lens, "paged_attention: seq_lens");
  auto qsl = shared_view(query_start_loc, "paged_attention: query_start_loc");
  auto sink = optional_view(sinks, "paged_attention: sinks");
  return {[=] {
    AttentionOptions options;
    options.scale = scale;
    options.sliding_window = sliding_window;
    options.attention_chunk = attention_chunk;
    options.logit_soft_cap = logit_soft_cap;
    options.max_seq_len = max_seq_len;
    options.max_query_len = max_query_len;
    options.sinks = view_or_empty(sink);
    paged_attention(o->view(), q->view(), kc->view(), vc->view(), tables->view(), lens->view(),
                    qsl->view(), options, as_stream(stream));
  }};
}

KernelCall prepare_mla_attention(const py::handle& out, const py::handle& query,
                                 const py::handle& latent_cache, const py::handle& block_tables,
                                 const py::handle& seq_lens, const py::handle& query_start_loc,
                                 float scale, int64_t value_dim, uintptr_t stream) {
  auto o = shared_view(out, "mla_attention: out");
  auto q = shared_view(query, "mla_attention: query");
  auto cache = shared_view(latent_cache, "mla_attention: latent_cache");
  auto tables = shared_view(block_tables, "mla_attention: block_tables");
  auto lens = shared_view(seq_lens, "mla_attention: seq_lens");
  auto qsl = shared_view(query_start_loc, "mla_attention: query_start_loc");
  return {[=] {
    mla_attention(o->view(), q->view(), cache->view(), tables->view(), lens->view(), qsl->view(),
                  scale, value_dim, as_stream(stream));
  }};
}

}  // namespace

void bind_attention(py::module_& m) {
  m.def(
      "set_attention_isa", [](const std::string& isa) { set_attention_isa(parse_isa(isa)); },
      py::arg("isa"),
      "Pins the CPU attention kernel build ('auto', 'generic', 'avx2', 'avx512'); for tests.");
  m.def(
      "attention_isa", [] { return isa_name(attention_isa()); },
      "The CPU attention kernel build in use.");
  m.def(
      "set_quantized_dense_isa",
      [](const std::string& isa) { set_quantized_dense_isa(parse_isa(isa)); }, py::arg("isa"),
      "Pins the widening of quantized dense weights ('auto', 'generic', 'avx512'); for tests.");
  m.def(
      "quantized_dense_isa", [] { return isa_name(quantized_dense_isa()); },
      "The widening of quantized dense weights in use.");
  m.def(
      "cpu_supports", [](const std::string& isa) { return cpu_supports(parse_isa(isa)); },
      py::arg("isa"), "Whether this CPU and build can run the named attention kernel.");
  m.def(
      "attention_head_sizes",
      [] { return std::vector<int>(kSupportedHeadSizes.begin(), kSupportedHeadSizes.end()); },
      "The head sizes paged_attention runs (on every device).");
  def_kernel(
      m, "reshape_and_cache", &prepare_reshape_and_cache, py::arg("key"), py::arg("value"),
      py::arg("key_cache"), py::arg("value_cache"),
      py::arg("slot_mapping"), py::arg("k_scale") = 0.0f, py::arg("v_scale") = 0.0f,
      py::arg("stream") = 0,
      R"doc(Writes new tokens' K and V into their cache slots (slot -1: skip).

key, value:    [num_tokens, num_kv_heads, head_size]
key_cache:     [num_blocks, num_kv_heads, head_size, block_size] (keys transposed)
value_cache:   [num_blocks, num_kv_heads, block_size, head_size], the same dtype
slot_mapping:  int64 [num_tokens], block * block_size + offset
stream:        a CUDA stream handle for CUDA tensors (0: the default stream))doc");

  m.def("mla_bf16_build", &mla_attention_bf16_build, py::arg("num_heads"),
        py::arg("latent_dim"), py::arg("value_dim"), py::arg("block_size"),
        "The build of mla_attention that runs a bfloat16 query over a bfloat16 cache of these "
        "shapes on this CPU: 'amx', 'avx512_bf16' or 'portable' (as every other dtype).");
  def_kernel(
      m, "mla_attention", &prepare_mla_attention, py::arg("out"), py::arg("query"),
      py::arg("latent_cache"), py::arg("block_tables"), py::arg("seq_lens"),
      py::arg("query_start_loc"), py::arg("scale"), py::arg("value_dim"), py::arg("stream") = 0,
      R"doc(Multi-head latent attention (DeepSeek's MLA) in the absorbed form, into `out`.

Each token's cached latent vector [c_kv (value_dim); k_pe] is every head's key, and its
first value_dim numbers every head's value; request i's query tokens attend causally as
in paged_attention. (CPU; CUDA with the query and cache of one 16- or 32-bit dtype.)

out:             [num_tokens, num_heads, value_dim], query's dtype
query:           [num_tokens, num_heads, latent_dim] (q_nope W_UK, then q_pe), float32
                 or the cache's dtype (float32 over an fp8 cache)
latent_cache:    [num_blocks, block_size, latent_dim], float32, float16, bfloat16 or
                 fp8 e4m3 as uint8 (CPU)
block_tables:    int32 [num_reqs, max_blocks_per_request]
seq_lens:        int32 [num_reqs]
query_start_loc: int32 [num_reqs + 1]
stream:          a CUDA stream handle for CUDA tensors (0: the default stream))doc");

  def_kernel(
      m, "paged_attention", &prepare_paged_attention, py::arg("out"), py::arg("query"),
      py::arg("key_cache"), py::arg("value_cache"),
      py::arg("block_tables"), py::arg("seq_lens"), py::arg("query_start_loc"), py::arg("scale"),
      py::arg("sliding_window") = 0, py::arg("logit_soft_cap") = 0.0f, py::arg("max_seq_len") = 0,
      py::arg("max_query_len") = 0, py::arg("sinks") = py::none(), py::arg("attention_chunk") = 0,
      py::arg("stream") = 0,
      R"doc(Variable-length causal attention through block tables, into `out`.

Request i's query tokens query[query_start_loc[i]:query_start_loc[i+1]] are the last
positions of its seq_lens[i] tokens; they attend causally to them (and, with
sliding_window > 0, only to the last sliding_window of them; with attention_chunk > 0,
only to those of their own chunk). Table entries before a request's first query's first
visible block are never read (a window's KV-cache group may hold -1 there).

out, query:              [num_tokens, num_heads, head_size], the cache dtype
key_cache:               [num_blocks, num_kv_heads, head_size, block_size] (transposed)
value_cache:             [num_blocks, num_kv_heads, block_size, head_size]
block_tables:            int32 [num_reqs, max_blocks_per_request]
seq_lens:                int32 [num_reqs]
query_start_loc:         int32 [num_reqs + 1]
max_seq_len:             the longest seq_len where the caller knows it (0: unknown); CUDA
                         splits long contexts by it (a wrong one costs speed, not results)
max_query_len:           the most query tokens of any request where the caller knows it
                         (0: unknown); sizes the CUDA grid (a wrong one costs speed only)
sinks:                   float32 [num_heads], each head's sink logit (gpt-oss's), or None;
                         the CPU's
stream:                  a CUDA stream handle for CUDA tensors (0: the default stream))doc");
}

}  // namespace pyengine::bindings
