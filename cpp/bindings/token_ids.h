// Token ids from Python (a list, a tuple or a 1-D integer numpy array) as a span.
// An int32 contiguous array is viewed without a copy; anything else is copied after a
// range check, so an int64 id that does not fit is an error, never a silent wrap.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "pyengine/prefix_hash.h"

namespace pyengine::bindings {

class TokenIds {
 public:
  TokenIds(const pybind11::handle& obj, const char* name);
  std::span<const TokenId> span() const { return view_; }

 private:
  pybind11::object keep_alive_;
  std::vector<TokenId> copy_;
  std::span<const TokenId> view_;
};

}  // namespace pyengine::bindings
