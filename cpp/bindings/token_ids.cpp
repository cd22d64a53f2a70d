#include "token_ids.h"

#include <algorithm>
#include <limits>

namespace py = pybind11;

namespace pyengine::bindings {
namespace {

[[noreturn]] void fail(const char* name, const std::string& why) {
  throw py::value_error(std::string(name) + " " + why);
}

void check_range(int64_t value, const char* name) {
  if (value < 0 || value > std::numeric_limits<TokenId>::max()) {
    fail(name, "holds token id " + std::to_string(value) + ", outside [0, 2**31)");
  }
}

}  // namespace

TokenIds::TokenIds(const py::handle& obj, const char* name) {
  if (py::isinstance<py::list>(obj) || py::isinstance<py::tuple>(obj)) {
    const auto seq = py::reinterpret_borrow<py::sequence>(obj);
    copy_.reserve(seq.size());
    for (const py::handle item : seq) {
      if (!PyLong_Check(item.ptr()) || PyBool_Check(item.ptr())) {
        throw py::type_error(std::string(name) + " must hold ints, got " +
                             std::string(py::str(py::type::of(item).attr("__name__"))));
      }
      int overflow = 0;
      const long long value = PyLong_AsLongLongAndOverflow(item.ptr(), &overflow);
      if (overflow != 0) fail(name, "holds a token id outside [0, 2**31)");
      check_range(value, name);
      copy_.push_back(static_cast<TokenId>(value));
    }
    view_ = copy_;
    return;
  }
  if (!py::isinstance<py::array>(obj)) {
    throw py::type_error(std::string(name) + " must be a list, tuple or 1-D numpy array of ints");
  }
  const auto array = py::reinterpret_borrow<py::array>(obj);
  if (array.ndim() != 1) fail(name, "must be 1-D, got " + std::to_string(array.ndim()) + "-D");
  const char kind = array.dtype().kind();
  if (kind != 'i' && kind != 'u') {
    fail(name, "must have an integer dtype, got " + std::string(py::str(array.dtype())));
  }
  const bool aligned = reinterpret_cast<uintptr_t>(array.data()) % alignof(TokenId) == 0;
  if (aligned && py::isinstance<py::array_t<TokenId, py::array::c_style>>(array)) {
    keep_alive_ = array;
    const auto typed = py::reinterpret_borrow<py::array_t<TokenId>>(array);
    view_ = std::span<const TokenId>(typed.data(), static_cast<size_t>(typed.size()));
    // Reject negatives here too, so that every path gives the same message. A branch-free
    // minimum vectorizes; checking each element would cost more than hashing them.
    TokenId smallest = 0;
    for (const TokenId t : view_) smallest = std::min(smallest, t);
    if (smallest < 0) check_range(smallest, name);
    return;
  }
  const auto wide = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(
      array.attr("astype")("int64"));
  copy_.reserve(static_cast<size_t>(wide.size()));
  for (py::ssize_t i = 0; i < wide.size(); ++i) {
    check_range(wide.data()[i], name);
    copy_.push_back(static_cast<TokenId>(wide.data()[i]));
  }
  view_ = copy_;
}

}  // namespace pyengine::bindings
