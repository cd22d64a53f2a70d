// The interpreter that runs pyengine's Python layer inside the caller's process: found,
// started once, and reached only through the bridge table (bridge.h).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "bridge.h"

namespace pyengine::capi {

// Runs `op` on `engine` through the bridge (starting the interpreter on first use); the
// operation's result. Throws Failure: PYENGINE_ERROR_ENVIRONMENT where no interpreter
// with pyengine could be started, else the status and text the operation failed with.
std::string call(std::int64_t engine, Op op, std::string_view in);

}  // namespace pyengine::capi
