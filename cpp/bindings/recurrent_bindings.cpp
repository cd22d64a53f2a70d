// Python bindings of the recurrent-state kernels (pyengine/recurrent.h).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>

#include "bindings.h"
#include "kernel_call.h"
#include "pyengine/recurrent.h"

namespace py = pybind11;

namespace pyengine::bindings {

namespace {

KernelCall prepare_gated_delta_rule(const py::handle& out, const py::handle& query,
                                    const py::handle& key, const py::handle& value,
                                    const py::handle& g, const py::handle& beta,
                                    const py::handle& state, const py::handle& state_slots,
                                    const py::handle& has_state,
                                    const py::handle& query_start_loc, float scale,
                                    bool normalize, uintptr_t stream) {
  auto o = shared_view(out, "gated_delta_rule: out");
  auto q = shared_view(query, "gated_delta_rule: query");
  auto k = shared_view(key, "gated_delta_rule: key");
  auto v = shared_view(value, "gated_delta_rule: value");
  auto gates = shared_view(g, "gated_delta_rule: g");
  auto betas = shared_view(beta, "gated_delta_rule: beta");
  auto s = shared_view(state, "gated_delta_rule: state");
  auto slots = shared_view(state_slots, "gated_delta_rule: state_slots");
  auto has = shared_view(has_state, "gated_delta_rule: has_state");
  auto qsl = shared_view(query_start_loc, "gated_delta_rule: query_start_loc");
  return {[=] {
    gated_delta_rule(o->view(), q->view(), k->view(), v->view(), gates->view(), betas->view(),
                     s->view(), slots->view(), has->view(), qsl->view(), scale, normalize,
                     as_stream(stream));
  }};
}

KernelCall prepare_causal_conv1d(const py::handle& out, const py::handle& x,
                                 const py::handle& weight, const py::handle& bias,
                                 const py::handle& state, const py::handle& state_slots,
                                 const py::handle& has_state, const py::handle& query_start_loc,
                                 bool silu, uintptr_t stream) {
  auto o = shared_view(out, "causal_conv1d: out");
  auto in = shared_view(x, "causal_conv1d: x");
  auto w = shared_view(weight, "causal_conv1d: weight");
  auto b = optional_view(bias, "causal_conv1d: bias");
  auto s = shared_view(state, "causal_conv1d: state");
  auto slots = shared_view(state_slots, "causal_conv1d: state_slots");
  auto has = shared_view(has_state, "causal_conv1d: has_state");
  auto qsl = shared_view(query_start_loc, "causal_conv1d: query_start_loc");
  return {[=] {
    causal_conv1d(o->view(), in->view(), w->view(), view_or_empty(b), s->view(), slots->view(),
                  has->view(), qsl->view(), silu, as_stream(stream));
  }};
}

KernelCall prepare_ssm_scan(const py::handle& out, const py::handle& x, const py::handle& dt,
                            const py::handle& A, const py::handle& B, const py::handle& C,
                            const py::handle& D, const py::handle& dt_bias,
                            const py::handle& state, const py::handle& state_slots,
                            const py::handle& has_state, const py::handle& query_start_loc,
                            bool dt_softplus, float dt_min, float dt_max, uintptr_t stream) {
  auto o = shared_view(out, "ssm_scan: out");
  auto in = shared_view(x, "ssm_scan: x");
  auto steps = shared_view(dt, "ssm_scan: dt");
  auto a = shared_view(A, "ssm_scan: A");
  auto b = shared_view(B, "ssm_scan: B");
  auto c = shared_view(C, "ssm_scan: C");
  auto d = optional_view(D, "ssm_scan: D");
  auto bias = optional_view(dt_bias, "ssm_scan: dt_bias");
  auto s = shared_view(state, "ssm_scan: state");
  auto slots = shared_view(state_slots, "ssm_scan: state_slots");
  auto has = shared_view(has_state, "ssm_scan: has_state");
  auto qsl = shared_view(query_start_loc, "ssm_scan: query_start_loc");
  return {[=] {
    ssm_scan(o->view(), in->view(), steps->view(), a->view(), b->view(), c->view(),
             view_or_empty(d), view_or_empty(bias), s->view(), slots->view(), has->view(),
             qsl->view(), dt_softplus, dt_min, dt_max, as_stream(stream));
  }};
}

}  // namespace

void bind_recurrent(py::module_& m) {
  def_kernel(m, "gated_delta_rule", &prepare_gated_delta_rule, py::arg("out"), py::arg("query"),
             py::arg("key"), py::arg("value"), py::arg("g"), py::arg("beta"), py::arg("state"),
             py::arg("state_slots"), py::arg("has_state"), py::arg("query_start_loc"),
             py::arg("scale"), py::arg("normalize"), py::arg("stream") = 0,
             "Gated DeltaNet's recurrence over each request's tokens from its state slot "
             "(zeros where has_state is 0), the slot written back; see "
             "cpp/include/pyengine/recurrent.h.");
  def_kernel(m, "causal_conv1d", &prepare_causal_conv1d, py::arg("out"), py::arg("x"),
             py::arg("weight"), py::arg("bias"), py::arg("state"), py::arg("state_slots"),
             py::arg("has_state"), py::arg("query_start_loc"), py::arg("silu"),
             py::arg("stream") = 0,
             "The depthwise causal convolution over each request's tokens, continued from its "
             "state slot (the K - 1 inputs before them) and written back; then SiLU where "
             "silu. See cpp/include/pyengine/recurrent.h.");
  def_kernel(m, "ssm_scan", &prepare_ssm_scan, py::arg("out"), py::arg("x"), py::arg("dt"),
             py::arg("A"), py::arg("B"), py::arg("C"), py::arg("D"), py::arg("dt_bias"),
             py::arg("state"), py::arg("state_slots"), py::arg("has_state"),
             py::arg("query_start_loc"), py::arg("dt_softplus") = true, py::arg("dt_min") = 0.0f,
             py::arg("dt_max") = std::numeric_limits<float>::infinity(), py::arg("stream") = 0,
             "Mamba-2's state-space recurrence over each request's tokens from its state slot "
             "(zeros where has_state is 0), the slot written back; D and dt_bias may be None. "
             "See cpp/include/pyengine/recurrent.h.");
  m.def("set_recurrent_chunks_from", &set_recurrent_chunks_from, py::arg("tokens"),
        "Runs of at least `tokens` tokens take gated_delta_rule's and ssm_scan's chunked "
        "form on the CPU, shorter ones the recurrence token by token; 0: the default.");
}

}  // namespace pyengine::bindings
