// A kernel call whose arguments are converted once: run at once, or appended to a
// KernelProgram that replays a decode step's calls with no Python between them (the
// module calls, views and DLPack conversions around each kernel cost a CPU decode step of
// a small model as much as its kernels do).
#pragma once

#include <pybind11/pybind11.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dlpack.h"

namespace pyengine::bindings {

// The call holds its views, and so keeps its tensors alive (and at their addresses).
struct KernelCall {
  std::function<void()> run;
  std::string name;  // the kernel's (set by def_kernel's prepare_<name>)
};

// A view shared by the copies of a call (std::function copies what it captures).
using SharedView = std::shared_ptr<const DLPackView>;

inline SharedView shared_view(const pybind11::handle& obj, const std::string& name) {
  return std::make_shared<const DLPackView>(obj, name);
}

// None: no view (the kernel's optional argument left out).
inline SharedView optional_view(const pybind11::handle& obj, const std::string& name) {
  return obj.is_none() ? nullptr : shared_view(obj, name);
}

inline TensorView view_or_empty(const SharedView& v) { return v ? v->view() : TensorView{}; }

// Calls recorded in order, replayed by run() on the calling thread without the GIL.
class KernelProgram {
 public:
  void append(KernelCall call) { calls_.push_back(std::move(call)); }
  void run() const {
    for (const KernelCall& call : calls_) call.run();
  }
  size_t size() const { return calls_.size(); }

  // Runs the program `repeats` times; each call's name and mean seconds per run, in order.
  std::vector<std::pair<std::string, double>> profile(int64_t repeats) const {
    std::vector<double> seconds(calls_.size(), 0.0);
    for (int64_t r = 0; r < repeats; ++r) {
      for (size_t i = 0; i < calls_.size(); ++i) {
        const auto start = std::chrono::steady_clock::now();
        calls_[i].run();
        const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
        seconds[i] += took.count();
      }
    }
    std::vector<std::pair<std::string, double>> out;
    out.reserve(calls_.size());
    for (size_t i = 0; i < calls_.size(); ++i) {
      out.emplace_back(calls_[i].name, seconds[i] / static_cast<double>(repeats));
    }
    return out;
  }

 private:
  std::vector<KernelCall> calls_;
};

// Binds kernel `name` from `prepare` (its arguments to a call) twice: `name` converts and
// runs at once, the GIL released while the kernel runs; `prepare_<name>` returns the
// call, for a KernelProgram.
template <typename... Args, typename... Extra>
void def_kernel(pybind11::module_& m, const char* name, KernelCall (*prepare)(Args...),
                const Extra&... extra) {
  m.def(
      name,
      [prepare](Args... args) {
        const KernelCall call = prepare(std::forward<Args>(args)...);
        pybind11::gil_scoped_release release;
        call.run();
      },
      extra...);
  m.def(
      ("prepare_" + std::string(name)).c_str(),
      [prepare, name](Args... args) {
        KernelCall call = prepare(std::forward<Args>(args)...);
        call.name = name;
        return call;
      },
      extra...);
}

}  // namespace pyengine::bindings
