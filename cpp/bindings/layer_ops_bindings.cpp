#include <pybind11/pybind11.h>

#include <string>

#include "bindings.h"
#include "dlpack.h"
#include "pyengine/dense.h"
#include "pyengine/block_gemm.h"
#include "pyengine/errors.h"
#include "pyengine/fp8_quantize.h"
#include "pyengine/int8_dense.h"
#include "pyengine/layer_ops.h"

namespace py = pybind11;

namespace pyengine::bindings {
namespace {

QuantParams quant_params(const std::string& name) {
  if (name == "float32") return QuantParams::kFloat32;
  if (name == "float16") return QuantParams::kFloat16;
  if (name == "scale_float16") return QuantParams::kScaleFloat16;
  if (name == "scale_float32") return QuantParams::kScaleFloat32;
  throw InvalidArgument("params must be 'float32', 'float16', 'scale_float16' or "
                        "'scale_float32', got '" + name + "'");
}

const char* quant_params_name(QuantParams params) {
  switch (params) {
    case QuantParams::kFloat32: return "float32";
    case QuantParams::kFloat16: return "float16";
    case QuantParams::kScaleFloat32: return "scale_float32";
    default: return "scale_float16";
  }
}

}  // namespace

void bind_layer_ops(py::module_& m) {
  m.def(
      "rms_norm",
      [](const py::handle& out, const py::handle& x, const py::handle& weight, float eps,
         uintptr_t stream) {
        const DLPackView o(out, "rms_norm: out"), in(x, "rms_norm: x"),
            w(weight, "rms_norm: weight");
        py::gil_scoped_release release;
        rms_norm(o.view(), in.view(), w.view(), eps, as_stream(stream));
      },
      py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("stream") = 0,
      "out = x / sqrt(mean(x^2) + eps) * weight per row; x, out [tokens, hidden].");
  m.def(
      "fused_add_rms_norm",
      [](const py::handle& x, const py::handle& residual, const py::handle& weight, float eps,
         uintptr_t stream) {
        const DLPackView in(x, "fused_add_rms_norm: x");
        const DLPackView res(residual, "fused_add_rms_norm: residual");
        const DLPackView w(weight, "fused_add_rms_norm: weight");
        py::gil_scoped_release release;
        fused_add_rms_norm(in.view(), res.view(), w.view(), eps, as_stream(stream));
      },
      py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"), py::arg("stream") = 0,
      "In place: residual += x, then x = rms_norm(residual) * weight.");
  m.def(
      "rotary_embedding",
      [](const py::handle& positions, const py::handle& query, const py::handle& key,
         const py::handle& cos_sin_cache, bool is_neox, uintptr_t stream) {
        const DLPackView p(positions, "rotary_embedding: positions");
        const DLPackView q(query, "rotary_embedding: query");
        const DLPackView k(key, "rotary_embedding: key");
        const DLPackView cs(cos_sin_cache, "rotary_embedding: cos_sin_cache");
        py::gil_scoped_release release;
        rotary_embedding(p.view(), q.view(), k.view(), cs.view(), is_neox, as_stream(stream));
      },
      py::arg("positions"), py::arg("query"), py::arg("key"), py::arg("cos_sin_cache"),
      py::arg("is_neox") = true, py::arg("stream") = 0,
      "Rotary embedding of query [tokens, heads, d] and key [tokens, kv_heads, d] in place; "
      "cos_sin_cache float32 [max_positions, d] (cos | sin halves). is_neox: rotate-half "
      "pairs (i, i + d/2), else interleaved pairs (2i, 2i + 1) (GPT-J).");
  m.def(
      "silu_and_mul",
      [](const py::handle& out, const py::handle& x, uintptr_t stream) {
        const DLPackView o(out, "silu_and_mul: out"), in(x, "silu_and_mul: x");
        py::gil_scoped_release release;
        silu_and_mul(o.view(), in.view(), as_stream(stream));
      },
      py::arg("out"), py::arg("x"), py::arg("stream") = 0,
      "out [tokens, n] = silu(x[:, :n]) * x[:, n:].");
  m.def("packed_weight_size", &packed_weight_size, py::arg("k"), py::arg("n"),
        "Floats of a panel-packed [k, n] weight.");
  m.def(
      "pack_weight",
      [](const py::handle& packed, const py::handle& w_t) {
        const DLPackView p(packed, "pack_weight: packed"), w(w_t, "pack_weight: w_t");
        py::gil_scoped_release release;
        pack_weight(p.view(), w.view());
      },
      py::arg("packed"), py::arg("w_t"), "Packs w_t [k, n] into panels for dense.");
  m.def(
      "packed_quantized_weight_size",
      [](int64_t k, int64_t n, int bits, int64_t group_rows, const std::string& params) {
        return packed_quantized_weight_size(k, n, bits, group_rows, quant_params(params));
      },
      py::arg("k"), py::arg("n"), py::arg("bits"), py::arg("group_rows") = kQuantBlock,
      py::arg("params") = "float32",
      "Bytes of a block-quantized [k, n] weight, 4 or 8 bits, groups of 32 (or 16) rows, "
      "scales and offsets stored as params (float32, float16 or scale_float16).");
  m.def(
      "narrowest_quant_params",
      [](const py::handle& q_t, const py::handle& scale_t, const py::handle& offset_t) {
        const DLPackView q(q_t, "narrowest_quant_params: q_t");
        const DLPackView s(scale_t, "narrowest_quant_params: scale_t");
        const DLPackView o(offset_t, "narrowest_quant_params: offset_t");
        return quant_params_name(narrowest_quant_params(q.view(), s.view(), o.view()));
      },
      py::arg("q_t"), py::arg("scale_t"), py::arg("offset_t"),
      "The narrowest params (float32, float16, scale_float16) that hold scale_t and "
      "offset_t exactly, for pack_quantized_weight.");
  m.def(
      "pack_quantized_weight",
      [](const py::handle& packed, const py::handle& q_t, const py::handle& scale_t,
         const py::handle& offset_t, bool gate_up, const std::string& params) {
        const DLPackView p(packed, "pack_quantized_weight: packed");
        const DLPackView q(q_t, "pack_quantized_weight: q_t");
        const DLPackView s(scale_t, "pack_quantized_weight: scale_t");
        const DLPackView o(offset_t, "pack_quantized_weight: offset_t");
        const QuantParams form = quant_params(params);
        py::gil_scoped_release release;
        pack_quantized_weight(p.view(), q.view(), s.view(), o.view(), gate_up, form);
      },
      py::arg("packed"), py::arg("q_t"), py::arg("scale_t"), py::arg("offset_t"),
      py::arg("gate_up") = false, py::arg("params") = "float32",
      "Packs q_t [k, n] (uint8 0..15: 4-bit; int8: 8-bit), scale_t and offset_t [k / 32, n] "
      "(w = q * scale + offset a block of 32 rows) for dense (gate_up: for "
      "dense_silu_and_mul).");
  m.def("split_gemm_supported", &split_gemm_supported,
        "Whether this CPU runs split-bfloat16 weights (AMX with bfloat16, allowed by the OS).");
  m.def("packed_split_weight_size", &packed_split_weight_size, py::arg("k"), py::arg("n"),
        py::arg("gate_up") = false, "bfloat16s of a split [k, n] weight (gate_up: n a half).");
  m.def(
      "pack_split_weight",
      [](const py::handle& packed, const py::handle& w_t, bool gate_up) {
        const DLPackView p(packed, "pack_split_weight: packed");
        const DLPackView w(w_t, "pack_split_weight: w_t");
        py::gil_scoped_release release;
        pack_split_weight(p.view(), w.view(), gate_up);
      },
      py::arg("packed"), py::arg("w_t"), py::arg("gate_up") = false,
      "Packs w_t [k, n] (gate_up: [k, 2n], gate columns then up) as split bfloat16s for "
      "dense / dense_silu_and_mul on AMX.");
  m.def(
      "dense",
      [](const py::handle& out, const py::handle& x, const py::handle& packed,
         const py::handle& bias, int64_t n, bool int8_activations) {
        const DLPackView o(out, "dense: out"), in(x, "dense: x");
        const DLPackView p(packed, "dense: packed");
        if (bias.is_none()) {
          py::gil_scoped_release release;
          dense(o.view(), in.view(), p.view(), TensorView{}, n, int8_activations);
          return;
        }
        const DLPackView b(bias, "dense: bias");
        py::gil_scoped_release release;
        dense(o.view(), in.view(), p.view(), b.view(), n, int8_activations);
      },
      py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("n"),
      py::arg("int8_activations") = false,
      "out [m, n] = x [m, k] @ packed weight + bias (or None), for small m; "
      "int8_activations: a decode step's rows quantized to int8 per block of 32 for a "
      "block-quantized weight.");
  m.def("packed_int8_weight_size", &packed_int8_weight_size, py::arg("k"), py::arg("n"),
        "Bytes of a packed int8 [n, k] weight (pack_int8_weight).");
  m.def(
      "pack_int8_weight",
      [](const py::handle& packed, const py::handle& q) {
        const DLPackView p(packed, "pack_int8_weight: packed"), w(q, "pack_int8_weight: q");
        py::gil_scoped_release release;
        pack_int8_weight(p.view(), w.view());
      },
      py::arg("packed"), py::arg("q"), "Packs q [n, k] (int8) for int8_dense.");
  m.def(
      "int8_dense",
      [](const py::handle& out, const py::handle& x, const py::handle& packed,
         const py::handle& scale, const py::handle& bias, int64_t n) {
        const DLPackView o(out, "int8_dense: out"), in(x, "int8_dense: x");
        const DLPackView p(packed, "int8_dense: packed"), s(scale, "int8_dense: scale");
        if (bias.is_none()) {
          py::gil_scoped_release release;
          int8_dense(o.view(), in.view(), p.view(), s.view(), TensorView{}, n);
          return;
        }
        const DLPackView b(bias, "int8_dense: bias");
        py::gil_scoped_release release;
        int8_dense(o.view(), in.view(), p.view(), s.view(), b.view(), n);
      },
      py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("bias"),
      py::arg("n"),
      "out [m, n] = x [m, k], int8-quantized per row, @ a packed int8 weight, times scale "
      "[n] and x's row scales, + bias (or None).");
  m.def("int8_dense_vnni", &int8_dense_vnni, "Whether int8_dense runs on AVX-512 VNNI.");
  m.def("packed_block_gemm_size", &packed_block_gemm_size, py::arg("k"), py::arg("n"),
        py::arg("bits"), "Bytes of a [n, k] weight's integers for block_gemm.");
  m.def(
      "pack_block_gemm_weight",
      [](const py::handle& packed, const py::handle& q, int bits) {
        const DLPackView p(packed, "pack_block_gemm_weight: packed");
        const DLPackView w(q, "pack_block_gemm_weight: q");
        py::gil_scoped_release release;
        pack_block_gemm_weight(p.view(), w.view(), bits);
      },
      py::arg("packed"), py::arg("q"), py::arg("bits"),
      "Reorders q [n, k] (uint8 0..15 or int8) for block_gemm.");
  m.def(
      "block_gemm",
      [](const py::handle& out, const py::handle& x, const py::handle& packed,
         const py::handle& scale, const py::handle& offset, const py::handle& bias, int bits,
         int64_t group, uintptr_t stream) {
        const DLPackView o(out, "block_gemm: out"), in(x, "block_gemm: x");
        const DLPackView p(packed, "block_gemm: packed"), s(scale, "block_gemm: scale");
        const DLPackView f(offset, "block_gemm: offset");
        if (bias.is_none()) {
          py::gil_scoped_release release;
          block_gemm(o.view(), in.view(), p.view(), s.view(), f.view(), TensorView{}, bits, group,
                     as_stream(stream));
          return;
        }
        const DLPackView b(bias, "block_gemm: bias");
        py::gil_scoped_release release;
        block_gemm(o.view(), in.view(), p.view(), s.view(), f.view(), b.view(), bits, group,
                   as_stream(stream));
      },
      py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("offset"),
      py::arg("bias"), py::arg("bits"), py::arg("group"), py::arg("stream") = 0,
      "out [m, n] = x [m, k] @ (q * scale + offset)^T + bias on CUDA (16-bit x).");
  m.def(
      "quantize_fp8_rows",
      [](const py::handle& out, const py::handle& x, const py::handle& scale) {
        const DLPackView o(out, "quantize_fp8_rows: out"), in(x, "quantize_fp8_rows: x");
        if (scale.is_none()) {
          py::gil_scoped_release release;
          quantize_fp8_rows(o.view(), in.view(), TensorView{});
          return;
        }
        const DLPackView s(scale, "quantize_fp8_rows: scale");
        py::gil_scoped_release release;
        quantize_fp8_rows(o.view(), in.view(), s.view());
      },
      py::arg("out"), py::arg("x"), py::arg("scale"),
      "out = e4m3(x / s) * s: s max|row| / 448 per row (scale None) or scale [1].");
  m.def("release_thread_pool", &release_thread_pool,
        "Frees the calling thread's OpenMP workers (before another thread runs the kernels).");
  m.def(
      "packed_columns",
      [](const py::handle& out, const py::handle& packed, const py::handle& ids, int64_t n) {
        const DLPackView o(out, "packed_columns: out");
        const DLPackView p(packed, "packed_columns: packed");
        const DLPackView i(ids, "packed_columns: ids");
        py::gil_scoped_release release;
        packed_columns(o.view(), p.view(), i.view(), n);
      },
      py::arg("out"), py::arg("packed"), py::arg("ids"), py::arg("n"),
      "out [t, k] = columns ids [t] of a packed [k, n] weight, widened to float32.");
  m.def(
      "pack_gate_up_weight",
      [](const py::handle& packed, const py::handle& w_t) {
        const DLPackView p(packed, "pack_gate_up_weight: packed");
        const DLPackView w(w_t, "pack_gate_up_weight: w_t");
        py::gil_scoped_release release;
        pack_gate_up_weight(p.view(), w.view());
      },
      py::arg("packed"), py::arg("w_t"),
      "Packs w_t [k, 2n] (gate columns, then up) for dense_silu_and_mul.");
  m.def(
      "dense_silu_and_mul",
      [](const py::handle& out, const py::handle& x, const py::handle& packed, int64_t n,
         bool int8_activations) {
        const DLPackView o(out, "dense_silu_and_mul: out");
        const DLPackView in(x, "dense_silu_and_mul: x");
        const DLPackView p(packed, "dense_silu_and_mul: packed");
        py::gil_scoped_release release;
        dense_silu_and_mul(o.view(), in.view(), p.view(), n, int8_activations);
      },
      py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("n"),
      py::arg("int8_activations") = false,
      "out [m, n] = silu(x @ gate) * (x @ up) over a pack_gate_up_weight weight.");
}

}  // namespace pyengine::bindings
