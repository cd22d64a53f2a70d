// Exceptions raised at pyengine_core's public entry points. The bindings map each to
// one Python exception type, so a caller can tell bad input from misuse of state.
#pragma once

#include <stdexcept>
#include <string>

namespace pyengine {

// An argument is out of its documented range (maps to Python ValueError).
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A request id that the component does not know (maps to Python KeyError).
class UnknownRequest : public std::out_of_range {
 public:
  explicit UnknownRequest(const std::string& request_id)
      : std::out_of_range("unknown request id '" + request_id + "'") {}
};

// A call that is valid in general but not in the component's current state
// (maps to Python RuntimeError).
class InvalidState : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

// Throws InvalidArgument with `message` unless `condition` holds. Takes a literal so
// that a passing check on a hot path builds no string.
inline void check_argument(bool condition, const char* message) {
  if (!condition) throw InvalidArgument(message);
}

}  // namespace pyengine
