#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>

#include "bindings.h"
#include "kernel_call.h"

namespace py = pybind11;

namespace pyengine::bindings {

void bind_kernel_program(py::module_& m) {
  py::class_<KernelCall>(m, "KernelCall",
                         "A kernel call with its arguments converted (prepare_<kernel>).")
      .def(
          "__call__",
          [](const KernelCall& call) {
            py::gil_scoped_release release;
            call.run();
          },
          "Runs the kernel on the tensors it was prepared with.")
      .def_readonly("name", &KernelCall::name, "The kernel's name.");
  py::class_<KernelProgram>(
      m, "KernelProgram",
      "Kernel calls recorded in order, and the tensors they read and write kept alive: "
      "run() replays them without Python in between.")
      .def(py::init<>())
      .def("append", &KernelProgram::append, py::arg("call"))
      .def(
          "run",
          [](const KernelProgram& program) {
            py::gil_scoped_release release;
            program.run();
          },
          "Runs every call in order, without the GIL.")
      .def(
          "profile",
          [](const KernelProgram& program, int64_t repeats) {
            if (repeats < 1) {
              throw std::invalid_argument("profile: repeats must be at least 1, got " +
                                          std::to_string(repeats));
            }
            py::gil_scoped_release release;
            return program.profile(repeats);
          },
          py::arg("repeats"),
          "Runs every call in order `repeats` times, timing each: a list of (kernel name, "
          "mean seconds per run), one per call.")
      .def("__len__", &KernelProgram::size);
}

}  // namespace pyengine::bindings
