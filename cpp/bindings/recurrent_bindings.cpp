// Python bindings of the recurrent-state kernels (pyengine/recurrent.h).
#include <pybind11/pybind11.h>

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
                                    bool normalize) {
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
                     s->view(), slots->view(), has->view(), qsl->view(), scale, normalize);
  }};
}

KernelCall prepare_causal_conv1d(const py::handle& out, const py::handle& x,
                                 const py::handle& weight, const py::handle& bias,
                                 const py::handle& state, const py::handle& state_slots,
                                 const py::handle& has_state, const py::handle& query_start_loc,
                                 bool silu) {
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
                  has->view(), qsl->view(), silu);
  }};
}

}  // namespace

void bind_recurrent(py::module_& m) {
  def_kernel(m, "gated_delta_rule", &prepare_gated_delta_rule, py::arg("out"), py::arg("query"),
             py::arg("key"), py::arg("value"), py::arg("g"), py::arg("beta"), py::arg("state"),
             py::arg("state_slots"), py::arg("has_state"), py::arg("query_start_loc"),
             py::arg("scale"), py::arg("normalize"),
             "Gated DeltaNet's recurrence over each request's tokens from its state slot "
             "(zeros where has_state is 0), the slot written back; see "
             "cpp/include/pyengine/recurrent.h.");
  def_kernel(m, "causal_conv1d", &prepare_causal_conv1d, py::arg("out"), py::arg("x"),
             py::arg("weight"), py::arg("bias"), py::arg("state"), py::arg("state_slots"),
             py::arg("has_state"), py::arg("query_start_loc"), py::arg("silu"),
             "The depthwise causal convolution over each request's tokens, continued from its "
             "state slot (the K - 1 inputs before them) and written back; then SiLU where "
             "silu. See cpp/include/pyengine/recurrent.h.");
}

}  // namespace pyengine::bindings
