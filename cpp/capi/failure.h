// A failed C API call: its status and its text, which the entry point hands to
// pyengine_last_error() (c_api.cpp's guarded()).
#pragma once

#include <stdexcept>
#include <string>

#include "pyengine/pyengine_c.h"

namespace pyengine::capi {

class Failure : public std::runtime_error {
 public:
  Failure(pyengine_status status, const std::string& message)
      : std::runtime_error(message), status_(status) {}
  pyengine_status status() const { return status_; }

 private:
  pyengine_status status_;
};

[[noreturn]] inline void fail(pyengine_status status, const std::string& message) {
  throw Failure(status, message);
}

// Throws PYENGINE_ERROR_INVALID_ARGUMENT with `message` unless `condition` holds.
inline void require(bool condition, const char* message) {
  if (!condition) fail(PYENGINE_ERROR_INVALID_ARGUMENT, message);
}

}  // namespace pyengine::capi
