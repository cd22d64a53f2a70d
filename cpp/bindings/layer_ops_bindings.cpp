#include <pybind11/pybind11.h>

#include <string>

#include "bindings.h"
#include "dlpack.h"
#include "kernel_call.h"
#include "pyengine/block_gemm.h"
#include "pyengine/dense.h"
#include "pyengine/errors.h"
#include "pyengine/fp8_quantize.h"
#include "pyengine/int8_dense.h"
#include "pyengine/layer_ops.h"
#include "pyengine/lora.h"
#include "pyengine/moe.h"

namespace py = pybind11;

namespace pyengine::bindings {
namespace {

QuantParams quant_params(const std::string& name) {
  if (name == "float32") return QuantParams::kFloat32;
  if (name == "float16") return QuantParams::kFloat16;
  if (name == "scale_float16") return QuantParams::kScaleFloat16;
  if (name == "scale_float32") return QuantParams::kScaleFloat32;
  throw InvalidArgument(
      "params must be 'float32', 'float16', 'scale_float16' or "
      "'scale_float32', got '" +
      name + "'");
}

const char* quant_params_name(QuantParams params) {
  switch (params) {
    case QuantParams::kFloat32: return "float32";
    case QuantParams::kFloat16: return "float16";
    case QuantParams::kScaleFloat32: return "scale_float32";
    default: return "scale_float16";
  }
}

// The kernels of a forward pass, each as its call with the arguments converted.
KernelCall prepare_rms_norm(const py::handle& out, const py::handle& x, const py::handle& weight,
                            float eps, uintptr_t stream) {
  auto o = shared_view(out, "rms_norm: out"), in = shared_view(x, "rms_norm: x");
  auto w = shared_view(weight, "rms_norm: weight");
  return {[=] { rms_norm(o->view(), in->view(), w->view(), eps, as_stream(stream)); }};
}

KernelCall prepare_fused_add_rms_norm(const py::handle& x, const py::handle& residual,
                                      const py::handle& weight, float eps, uintptr_t stream) {
  auto in = shared_view(x, "fused_add_rms_norm: x");
  auto res = shared_view(residual, "fused_add_rms_norm: residual");
  auto w = shared_view(weight, "fused_add_rms_norm: weight");
  return {[=] { fused_add_rms_norm(in->view(), res->view(), w->view(), eps, as_stream(stream)); }};
}

KernelCall prepare_add(const py::handle& out, const py::handle& a, const py::handle& b) {
  auto o = shared_view(out, "add: out"), x = shared_view(a, "add: a"), y = shared_view(b, "add: b");
  return {[=] { add(o->view(), x->view(), y->view()); }};
}

KernelCall prepare_embedding(const py::handle& out, const py::handle& weight,
                             const py::handle& ids) {
  auto o = shared_view(out, "embedding: out"), w = shared_view(weight, "embedding: weight");
  auto i = shared_view(ids, "embedding: ids");
  return {[=] { embedding(o->view(), w->view(), i->view()); }};
}

KernelCall prepare_rotary_embedding(const py::handle& positions, const py::handle& query,
                                    const py::handle& key, const py::handle& cos_sin_cache,
                                    bool is_neox, uintptr_t stream) {
  auto p = shared_view(positions, "rotary_embedding: positions");
  auto q = shared_view(query, "rotary_embedding: query");
  auto k = shared_view(key, "rotary_embedding: key");
  auto cs = shared_view(cos_sin_cache, "rotary_embedding: cos_sin_cache");
  return {[=] {
    rotary_embedding(p->view(), q->view(), k->view(), cs->view(), is_neox, as_stream(stream));
  }};
}

KernelCall prepare_silu_and_mul(const py::handle& out, const py::handle& x, uintptr_t stream) {
  auto o = shared_view(out, "silu_and_mul: out"), in = shared_view(x, "silu_and_mul: x");
  return {[=] { silu_and_mul(o->view(), in->view(), as_stream(stream)); }};
}

KernelCall prepare_dense(const py::handle& out, const py::handle& x, const py::handle& packed,
                         const py::handle& bias, int64_t n, bool int8_activations) {
  auto o = shared_view(out, "dense: out"), in = shared_view(x, "dense: x");
  auto p = shared_view(packed, "dense: packed"), b = optional_view(bias, "dense: bias");
  return {[=] { dense(o->view(), in->view(), p->view(), view_or_empty(b), n, int8_activations); }};
}

KernelCall prepare_dense_silu_and_mul(const py::handle& out, const py::handle& x,
                                      const py::handle& packed, int64_t n, bool int8_activations) {
  auto o = shared_view(out, "dense_silu_and_mul: out");
  auto in = shared_view(x, "dense_silu_and_mul: x");
  auto p = shared_view(packed, "dense_silu_and_mul: packed");
  return {[=] { dense_silu_and_mul(o->view(), in->view(), p->view(), n, int8_activations); }};
}

KernelCall prepare_gelu_tanh_and_mul(const py::handle& out, const py::handle& x) {
  auto o = shared_view(out, "gelu_tanh_and_mul: out");
  auto in = shared_view(x, "gelu_tanh_and_mul: x");
  return {[=] { gelu_tanh_and_mul(o->view(), in->view()); }};
}

KernelCall prepare_scale(const py::handle& out, const py::handle& x, double factor) {
  auto o = shared_view(out, "scale: out"), in = shared_view(x, "scale: x");
  return {[=] { scale(o->view(), in->view(), factor); }};
}

KernelCall prepare_int8_dense(const py::handle& out, const py::handle& x, const py::handle& packed,
                              const py::handle& scale, const py::handle& bias, int64_t n) {
  auto o = shared_view(out, "int8_dense: out"), in = shared_view(x, "int8_dense: x");
  auto p = shared_view(packed, "int8_dense: packed"), s = shared_view(scale, "int8_dense: scale");
  auto b = optional_view(bias, "int8_dense: bias");
  return {[=] { int8_dense(o->view(), in->view(), p->view(), s->view(), view_or_empty(b), n); }};
}

KernelCall prepare_moe_softmax_topk(const py::handle& ids, const py::handle& weights,
                                    const py::handle& logits, bool renormalize,
                                    uintptr_t stream) {
  auto i = shared_view(ids, "moe_softmax_topk: ids");
  auto w = shared_view(weights, "moe_softmax_topk: weights");
  auto l = shared_view(logits, "moe_softmax_topk: logits");
  return {[=] {
    moe_softmax_topk(i->view(), w->view(), l->view(), renormalize, as_stream(stream));
  }};
}

KernelCall prepare_moe_grouped_topk(const py::handle& ids, const py::handle& weights,
                                    const py::handle& logits, const py::handle& bias,
                                    int64_t num_groups, int64_t topk_groups, bool renormalize,
                                    double scaling_factor) {
  auto i = shared_view(ids, "moe_grouped_topk: ids");
  auto w = shared_view(weights, "moe_grouped_topk: weights");
  auto l = shared_view(logits, "moe_grouped_topk: logits");
  auto b = optional_view(bias, "moe_grouped_topk: bias");
  return {[=] {
    moe_grouped_topk(i->view(), w->view(), l->view(), view_or_empty(b), num_groups, topk_groups,
                     renormalize, scaling_factor);
  }};
}

KernelCall prepare_moe_sigmoid_topk(const py::handle& ids, const py::handle& weights,
                                    const py::handle& logits) {
  auto i = shared_view(ids, "moe_sigmoid_topk: ids");
  auto w = shared_view(weights, "moe_sigmoid_topk: weights");
  auto l = shared_view(logits, "moe_sigmoid_topk: logits");
  return {[=] { moe_sigmoid_topk(i->view(), w->view(), l->view()); }};
}

KernelCall prepare_fused_experts(const py::handle& out, const py::handle& x,
                                 const py::handle& ids, const py::handle& weights,
                                 const py::handle& gate_up, const py::handle& down, int64_t n,
                                 bool on_input, bool int8_activations,
                                 const py::handle& shared_gate_up, const py::handle& shared_down,
                                 int64_t shared_n, const py::handle& shared_gate,
                                 int64_t first_expert, int64_t num_experts,
                                 const py::handle& gate_up_bias, const py::handle& down_bias,
                                 bool clamped_swiglu, double alpha, double limit) {
  auto o = shared_view(out, "fused_experts: out"), in = shared_view(x, "fused_experts: x");
  auto i = shared_view(ids, "fused_experts: ids");
  auto w = shared_view(weights, "fused_experts: weights");
  auto gu = shared_view(gate_up, "fused_experts: gate_up");
  auto d = shared_view(down, "fused_experts: down");
  auto sgu = optional_view(shared_gate_up, "fused_experts: shared_gate_up");
  auto sd = optional_view(shared_down, "fused_experts: shared_down");
  auto sg = optional_view(shared_gate, "fused_experts: shared_gate");
  auto gb = optional_view(gate_up_bias, "fused_experts: gate_up_bias");
  auto db = optional_view(down_bias, "fused_experts: down_bias");
  return {[=] {
    const SharedExpert shared{view_or_empty(sgu), view_or_empty(sd), view_or_empty(sg), shared_n};
    const ExpertActivation activation{clamped_swiglu, static_cast<float>(alpha),
                                      static_cast<float>(limit), view_or_empty(gb),
                                      view_or_empty(db)};
    fused_experts(o->view(), in->view(), i->view(), w->view(), gu->view(), d->view(), n, on_input,
                  int8_activations, shared, first_expert, num_experts, activation);
  }};
}

KernelCall prepare_lora_add(const py::handle& out, const py::handle& x, const py::handle& a,
                            const py::handle& b, const py::handle& slots, const py::handle& scale,
                            const py::handle& part_columns, uintptr_t stream) {
  auto o = shared_view(out, "lora_add: out"), in = shared_view(x, "lora_add: x");
  auto va = shared_view(a, "lora_add: a"), vb = shared_view(b, "lora_add: b");
  auto vs = shared_view(slots, "lora_add: slots"), sc = shared_view(scale, "lora_add: scale");
  auto pc = shared_view(part_columns, "lora_add: part_columns");
  return {[=] {
    lora_add(o->view(), in->view(), va->view(), vb->view(), vs->view(), sc->view(), pc->view(),
             as_stream(stream));
  }};
}

KernelCall prepare_lora_embedding_add(const py::handle& out, const py::handle& ids,
                                      const py::handle& a, const py::handle& b,
                                      const py::handle& slots, const py::handle& scale) {
  auto o = shared_view(out, "lora_embedding_add: out"),
       i = shared_view(ids, "lora_embedding_add: ids");
  auto va = shared_view(a, "lora_embedding_add: a"), vb = shared_view(b, "lora_embedding_add: b");
  auto vs = shared_view(slots, "lora_embedding_add: slots");
  auto sc = shared_view(scale, "lora_embedding_add: scale");
  return {[=] {
    lora_embedding_add(o->view(), i->view(), va->view(), vb->view(), vs->view(), sc->view());
  }};
}

KernelCall prepare_quantize_fp8_rows(const py::handle& out, const py::handle& x,
                                     const py::handle& scale) {
  auto o = shared_view(out, "quantize_fp8_rows: out"), in = shared_view(x, "quantize_fp8_rows: x");
  auto s = optional_view(scale, "quantize_fp8_rows: scale");
  return {[=] { quantize_fp8_rows(o->view(), in->view(), view_or_empty(s)); }};
}

KernelCall prepare_packed_columns(const py::handle& out, const py::handle& packed,
                                  const py::handle& ids, int64_t n) {
  auto o = shared_view(out, "packed_columns: out");
  auto p = shared_view(packed, "packed_columns: packed");
  auto i = shared_view(ids, "packed_columns: ids");
  return {[=] { packed_columns(o->view(), p->view(), i->view(), n); }};
}

}  // namespace

void bind_layer_ops(py::module_& m) {
  def_kernel(m, "rms_norm", &prepare_rms_norm, py::arg("out"), py::arg("x"), py::arg("weight"),
             py::arg("eps"), py::arg("stream") = 0,
             "out = x / sqrt(mean(x^2) + eps) * weight per row; x, out [tokens, hidden].");
  def_kernel(m, "fused_add_rms_norm", &prepare_fused_add_rms_norm, py::arg("x"),
             py::arg("residual"), py::arg("weight"), py::arg("eps"), py::arg("stream") = 0,
             "In place: residual += x, then x = rms_norm(residual) * weight.");
  def_kernel(m, "add", &prepare_add, py::arg("out"), py::arg("a"), py::arg("b"),
             "out = a + b, [tokens, hidden] each, on the CPU (the residual stream's sum).");
  def_kernel(m, "embedding", &prepare_embedding, py::arg("out"), py::arg("weight"), py::arg("ids"),
             "out [tokens, hidden] = weight [vocab, hidden] rows ids (int32 or int64 [tokens]), "
             "on the CPU.");
  def_kernel(m, "rotary_embedding", &prepare_rotary_embedding, py::arg("positions"),
             py::arg("query"), py::arg("key"), py::arg("cos_sin_cache"), py::arg("is_neox") = true,
             py::arg("stream") = 0,
             "Rotary embedding of query [tokens, heads, d] and key [tokens, kv_heads, d] in place; "
             "cos_sin_cache float32 [max_positions, d] (cos | sin halves). is_neox: rotate-half "
             "pairs (i, i + d/2), else interleaved pairs (2i, 2i + 1) (GPT-J).");
  def_kernel(m, "silu_and_mul", &prepare_silu_and_mul, py::arg("out"), py::arg("x"),
             py::arg("stream") = 0, "out [tokens, n] = silu(x[:, :n]) * x[:, n:].");
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
  m.def("packed_bf16_weight_size", &packed_bf16_weight_size, py::arg("k"), py::arg("n"),
        "bfloat16s of a [k, n] weight's bfloat16 panels (twice it for a gate/up pair).");
  m.def(
      "pack_bf16_weight",
      [](const py::handle& packed, const py::handle& w_t, bool gate_up) {
        const DLPackView p(packed, "pack_bf16_weight: packed");
        const DLPackView w(w_t, "pack_bf16_weight: w_t");
        py::gil_scoped_release release;
        pack_bf16_weight(p.view(), w.view(), gate_up);
      },
      py::arg("packed"), py::arg("w_t"), py::arg("gate_up") = false,
      "Packs w_t [k, n] (float32; gate_up: [k, 2n], gate columns then up) as bfloat16 "
      "panels, each weight rounded to the nearest bfloat16, for dense / dense_silu_and_mul "
      "with bfloat16 x.");
  m.def("bf16_dot_product", &bf16_dot_product,
        "Whether bfloat16 panels multiply on AVX512-BF16 (the CPU has it and the quantized "
        "kernels are not pinned to a narrower build), not widened in registers.");
  m.def("amx_tiles", &amx_tiles,
        "Whether bfloat16 panels and int8 weights multiply blocks of 16 rows on AMX's tile "
        "unit (the CPU has it, the kernels run their AVX-512 build, set_amx_tiles allows).");
  m.def("set_amx_tiles", &set_amx_tiles, py::arg("enabled"),
        "Lets (the default) or stops bfloat16 panels and int8 weights using AMX, for tests "
        "and benchmarks; turning it on where AMX is not usable raises ValueError.");
  def_kernel(m, "dense", &prepare_dense, py::arg("out"), py::arg("x"), py::arg("packed"),
             py::arg("bias"), py::arg("n"), py::arg("int8_activations") = false,
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
  def_kernel(m, "gelu_tanh_and_mul", &prepare_gelu_tanh_and_mul, py::arg("out"), py::arg("x"),
             "out [t, n] = gelu(x[:, :n]) * x[:, n:], gelu's tanh approximation (the CPU's).");
  def_kernel(m, "scale", &prepare_scale, py::arg("out"), py::arg("x"), py::arg("factor"),
             "out = x * factor (the CPU's).");
  def_kernel(m, "int8_dense", &prepare_int8_dense, py::arg("out"), py::arg("x"), py::arg("packed"),
             py::arg("scale"), py::arg("bias"), py::arg("n"),
             "out [m, n] = x [m, k], int8-quantized per row, @ a packed int8 weight, times "
             "scale [n] and x's row scales, + bias (or None).");
  def_kernel(m, "moe_softmax_topk", &prepare_moe_softmax_topk, py::arg("ids"), py::arg("weights"),
             py::arg("logits"), py::arg("renormalize"), py::arg("stream") = 0,
             "ids [t, top_k] (int32), weights [t, top_k] = each row's top_k experts by "
             "softmax(logits [t, experts]), highest first, renormalised where asked.");
  def_kernel(m, "moe_grouped_topk", &prepare_moe_grouped_topk, py::arg("ids"), py::arg("weights"),
             py::arg("logits"), py::arg("bias"), py::arg("num_groups"), py::arg("topk_groups"),
             py::arg("renormalize"), py::arg("scaling_factor"),
             "DeepSeek-V3's routing: sigmoid scores (+ bias) in groups, the best topk_groups "
             "groups, their top_k experts; see pyengine/moe.h.");
  def_kernel(m, "moe_sigmoid_topk", &prepare_moe_sigmoid_topk, py::arg("ids"), py::arg("weights"),
             py::arg("logits"), "Llama 4's routing: the top_k by logit, weights sigmoid(logit).");
  m.def("moe_max_blocks", &moe_max_blocks, py::arg("slots"), py::arg("experts"),
        "The most aligned blocks moe_align_blocks makes of `slots` slots over `experts`.");
  m.def(
      "moe_align_blocks",
      [](const py::handle& sorted, const py::handle& block_experts, const py::handle& ids,
         int64_t first_expert, int64_t experts, uintptr_t stream) {
        const DLPackView s(sorted, "moe_align_blocks: sorted");
        const DLPackView b(block_experts, "moe_align_blocks: block_experts");
        const DLPackView i(ids, "moe_align_blocks: ids");
        py::gil_scoped_release release;
        moe_align_blocks(s.view(), b.view(), i.view(), first_expert, experts, as_stream(stream));
      },
      py::arg("sorted"), py::arg("block_experts"), py::arg("ids"), py::arg("first_expert"),
      py::arg("experts"), py::arg("stream") = 0,
      "CUDA: the slots of a rank's experts grouped by expert in blocks of 16 (pyengine/moe.h).");
  m.def(
      "moe_expert_gemm",
      [](const py::handle& out, const py::handle& x, const py::handle& w, const py::handle& sorted,
         const py::handle& block_experts, const py::handle& weights, int64_t top_k, bool gate_up,
         bool on_input, uintptr_t stream) {
        const DLPackView o(out, "moe_expert_gemm: out"), in(x, "moe_expert_gemm: x");
        const DLPackView vw(w, "moe_expert_gemm: w"), s(sorted, "moe_expert_gemm: sorted");
        const DLPackView b(block_experts, "moe_expert_gemm: block_experts");
        const DLPackView r(weights, "moe_expert_gemm: weights");
        py::gil_scoped_release release;
        moe_expert_gemm(o.view(), in.view(), vw.view(), s.view(), b.view(), r.view(), top_k,
                        gate_up, on_input, as_stream(stream));
      },
      py::arg("out"), py::arg("x"), py::arg("w"), py::arg("sorted"), py::arg("block_experts"),
      py::arg("weights"), py::arg("top_k"), py::arg("gate_up"), py::arg("on_input") = false,
      py::arg("stream") = 0,
      "CUDA: the experts' gate/up (silu(gate) * up) or down product over the aligned blocks.");
  m.def(
      "moe_combine",
      [](const py::handle& out, const py::handle& y, const py::handle& ids, int64_t first_expert,
         int64_t experts, uintptr_t stream) {
        const DLPackView o(out, "moe_combine: out"), vy(y, "moe_combine: y");
        const DLPackView i(ids, "moe_combine: ids");
        py::gil_scoped_release release;
        moe_combine(o.view(), vy.view(), i.view(), first_expert, experts, as_stream(stream));
      },
      py::arg("out"), py::arg("y"), py::arg("ids"), py::arg("first_expert"), py::arg("experts"),
      py::arg("stream") = 0,
      "CUDA: each row's slots of the rank's experts added in ascending expert order.");
  def_kernel(m, "fused_experts", &prepare_fused_experts, py::arg("out"), py::arg("x"),
             py::arg("ids"), py::arg("weights"), py::arg("gate_up"), py::arg("down"), py::arg("n"),
             py::arg("on_input") = false, py::arg("int8_activations") = false,
             py::arg("shared_gate_up") = py::none(), py::arg("shared_down") = py::none(),
             py::arg("shared_n") = 0, py::arg("shared_gate") = py::none(),
             py::arg("first_expert") = 0, py::arg("num_experts") = 0,
             py::arg("gate_up_bias") = py::none(), py::arg("down_bias") = py::none(),
             py::arg("clamped_swiglu") = false, py::arg("alpha") = 1.702, py::arg("limit") = 7.0,
             "out [t, hidden] = each row's routed experts' weighted sum over stacked packed "
             "weights (gate_up [experts, S1], down [experts, S2]), plus a shared expert's "
             "output (times sigmoid(x . shared_gate)) where one is given; with expert "
             "parallelism, the stacks a rank's experts from first_expert of num_experts; see "
             "pyengine/moe.h.");
  m.def("int8_dense_vnni", &int8_dense_vnni, "Whether int8_dense runs on AVX-512 VNNI.");
  def_kernel(m, "lora_add", &prepare_lora_add, py::arg("out"), py::arg("x"), py::arg("a"),
             py::arg("b"), py::arg("slots"), py::arg("scale"), py::arg("part_columns"),
             py::arg("stream") = 0,
             "out [t, n] += each row's LoRA delta: scale[s] * (x[t] @ a[s].T) @ b[s] over its "
             "part's ranks, s = slots[t] (-1: none); see cpp/include/pyengine/lora.h.");
  def_kernel(m, "lora_embedding_add", &prepare_lora_embedding_add, py::arg("out"), py::arg("ids"),
             py::arg("a"), py::arg("b"), py::arg("slots"), py::arg("scale"),
             "out [t, n] += each row's embedding LoRA delta: scale[s] * a[s, ids[t]] @ b[s], "
             "s = slots[t] (-1: none); see cpp/include/pyengine/lora.h.");
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
  def_kernel(m, "quantize_fp8_rows", &prepare_quantize_fp8_rows, py::arg("out"), py::arg("x"),
             py::arg("scale"),
             "out = e4m3(x / s) * s: s max|row| / 448 per row (scale None) or scale [1].");
  m.def("release_thread_pool", &release_thread_pool,
        "Frees the calling thread's OpenMP workers (before another thread runs the kernels).");
  def_kernel(m, "packed_columns", &prepare_packed_columns, py::arg("out"), py::arg("packed"),
             py::arg("ids"), py::arg("n"),
             "out [t, k] = columns ids (int32 or int64 [t]) of a packed [k, n] weight, "
             "widened to float32.");
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
  def_kernel(m, "dense_silu_and_mul", &prepare_dense_silu_and_mul, py::arg("out"), py::arg("x"),
             py::arg("packed"), py::arg("n"), py::arg("int8_activations") = false,
             "out [m, n] = silu(x @ gate) * (x @ up) over a pack_gate_up_weight weight.");
}

}  // namespace pyengine::bindings
