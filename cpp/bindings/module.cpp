#include <pybind11/pybind11.h>

#include "bindings.h"
#include "pyengine/errors.h"

namespace py = pybind11;

namespace pyengine::bindings {

void bind_errors(py::module_& m) {
  (void)m;
  // Tried before pybind11's defaults, which would turn std::out_of_range into IndexError.
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const UnknownRequest& e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    } catch (const InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const InvalidState& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });
}

}  // namespace pyengine::bindings

PYBIND11_MODULE(_C, m) {
  m.doc() = "pyengine's native core: KV-cache manager, prefix hashing and cache kernels";
  pyengine::bindings::bind_errors(m);
  pyengine::bindings::bind_prefix_hash(m);
  pyengine::bindings::bind_kv_cache(m);
  pyengine::bindings::bind_cache_ops(m);
  pyengine::bindings::bind_scheduler(m);
  pyengine::bindings::bind_attention(m);
  pyengine::bindings::bind_layer_ops(m);
  pyengine::bindings::bind_kernel_program(m);
  pyengine::bindings::bind_recurrent(m);
}
