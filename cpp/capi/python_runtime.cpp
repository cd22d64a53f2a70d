// Finding and starting the interpreter. libpyengine links no libpython: it finds the
// environment pyengine was installed into from its own path
// (<prefix>/lib/pythonX.Y/site-packages/pyengine/lib/libpyengine.so), or the one whose
// python PYENGINE_PYTHON names, opens that Python's shared libpython (PYENGINE_LIBPYTHON
// overrides where it lies), starts it with the environment's python as its program
// (so that sys.prefix, site-packages and sys.executable, which spawned workers run, are
// the environment's), and imports pyengine.capi.bridge, which fills in the bridge table.
// A process that already runs Python lends its own interpreter instead.
#include "python_runtime.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <cwchar>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <vector>

#include "events.h"
#include "failure.h"

#ifndef PYENGINE_PYTHON_VERSION
#error "PYENGINE_PYTHON_VERSION (\"3.11\") comes from CMake"
#endif

namespace pyengine::capi {
namespace {

namespace fs = std::filesystem;

// The few libpython functions the library calls itself; the rest goes through ctypes.
struct PythonApi {
  int (*is_initialized)() = nullptr;
  void (*initialize_ex)(int) = nullptr;
  wchar_t* (*decode_locale)(const char*, std::size_t*) = nullptr;
  void (*set_program_name)(const wchar_t*) = nullptr;  // (optional: deprecated in 3.11)
  void* (*save_thread)() = nullptr;
  int (*gil_ensure)() = nullptr;
  void (*gil_release)(int) = nullptr;
  int (*run_simple_string)(const char*) = nullptr;
};

struct Environment {
  fs::path python;  // the environment's own python (a venv's, not its base's)
  fs::path prefix;
  fs::path base_prefix;  // a venv's base installation, which holds libpython
};

std::string variable(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? std::string() : std::string(value);
}

fs::path this_library() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&pyengine_version), &info) == 0 || info.dli_fname == nullptr)
    return {};
  return fs::weakly_canonical(fs::absolute(info.dli_fname));
}

fs::path python_in(const fs::path& prefix) {
  for (const char* name : {"python" PYENGINE_PYTHON_VERSION, "python3", "python"}) {
    const fs::path candidate = prefix / "bin" / name;
    if (fs::exists(candidate)) return candidate;
  }
  return {};
}

Environment find_environment() {
  Environment env;
  const std::string named = variable("PYENGINE_PYTHON");
  if (!named.empty()) {
    env.python = fs::absolute(named);  // (not resolved: a venv's python links to its base's)
    if (!fs::exists(env.python))
      fail(PYENGINE_ERROR_ENVIRONMENT, "PYENGINE_PYTHON names " + named + ", which does not exist");
    env.prefix = env.python.parent_path().parent_path();
  } else {
    const fs::path library = this_library();
    const fs::path package = library.parent_path().parent_path();
    const fs::path site = package.parent_path();
    const bool installed = library.parent_path().filename() == "lib" &&
                           package.filename() == "pyengine" &&
                           (site.filename() == "site-packages" || site.filename() == "dist-packages");
    if (!installed)
      fail(PYENGINE_ERROR_ENVIRONMENT,
           "libpyengine at " + library.string() +
               " is not inside an installed pyengine package (.../site-packages/pyengine/lib): "
               "set PYENGINE_PYTHON to the python of an environment where pyengine is installed");
    env.prefix = site.parent_path().parent_path().parent_path();
    env.python = python_in(env.prefix);
    if (env.python.empty())
      fail(PYENGINE_ERROR_ENVIRONMENT,
           "no python in " + (env.prefix / "bin").string() +
               ", the environment libpyengine was installed into: set PYENGINE_PYTHON to its python");
  }
  env.base_prefix = env.prefix;
  std::ifstream config(env.prefix / "pyvenv.cfg");  // a venv's: "home = <base>/bin"
  for (std::string line; std::getline(config, line);) {
    const auto equals = line.find('=');
    if (equals == std::string::npos || line.rfind("home", 0) != 0) continue;
    std::string home = line.substr(equals + 1);
    home.erase(0, home.find_first_not_of(" \t"));
    home.erase(home.find_last_not_of(" \t\r") + 1);
    env.base_prefix = fs::path(home).parent_path();
  }
  return env;
}

void* open_libpython(const Environment& env) {
  std::vector<std::string> candidates;
  const std::string named = variable("PYENGINE_LIBPYTHON");
  if (!named.empty()) {
    candidates.push_back(named);
  } else {
    for (const fs::path& dir : {env.base_prefix / "lib", env.base_prefix / "lib64", env.prefix / "lib"})
      for (const char* name : {"libpython" PYENGINE_PYTHON_VERSION ".so.1.0",
                               "libpython" PYENGINE_PYTHON_VERSION ".so"})
        if (fs::exists(dir / name)) candidates.push_back((dir / name).string());
    candidates.push_back("libpython" PYENGINE_PYTHON_VERSION ".so.1.0");  // the system's paths
  }
  std::ostringstream tried;
  for (const std::string& candidate : candidates) {
    if (void* handle = dlopen(candidate.c_str(), RTLD_NOW | RTLD_GLOBAL)) return handle;
    tried << "\n  " << dlerror();
  }
  fail(PYENGINE_ERROR_ENVIRONMENT,
       "no shared libpython" PYENGINE_PYTHON_VERSION " for " + env.python.string() +
           " (pyengine's C API needs a Python built with --enable-shared; "
           "PYENGINE_LIBPYTHON may name it). Tried:" + tried.str());
}

template <typename Function>
void bind(void* handle, const char* name, Function& function, bool required = true) {
  function = reinterpret_cast<Function>(dlsym(handle, name));
  if (function == nullptr && required)
    fail(PYENGINE_ERROR_ENVIRONMENT, std::string("libpython lacks ") + name);
}

void bind_api(void* handle, PythonApi& api) {
  bind(handle, "Py_IsInitialized", api.is_initialized);
  bind(handle, "Py_InitializeEx", api.initialize_ex);
  bind(handle, "Py_DecodeLocale", api.decode_locale);
  bind(handle, "Py_SetProgramName", api.set_program_name, false);
  bind(handle, "PyEval_SaveThread", api.save_thread);
  bind(handle, "PyGILState_Ensure", api.gil_ensure);
  bind(handle, "PyGILState_Release", api.gil_release);
  bind(handle, "PyRun_SimpleString", api.run_simple_string);
}

// A Python string literal of `text` (paths, in the bootstrap's source).
std::string quoted(const std::string& text) {
  std::string out = "'";
  for (const unsigned char c : text) {
    char escaped[8];
    std::snprintf(escaped, sizeof escaped, "\\x%02x", c);
    out += (c == '\\' || c == '\'' || c < 0x20 || c >= 0x7f) ? std::string(escaped)
                                                             : std::string(1, static_cast<char>(c));
  }
  return out + "'";
}

void put_result(void* result, const char* data, std::size_t size) {
  static_cast<std::string*>(result)->assign(data, size);
}

class Runtime {
 public:
  const BridgeTable& table() {
    if (attached_.load(std::memory_order_acquire)) return table_;
    std::lock_guard<std::mutex> lock(mutex_);
    if (!attached_.load(std::memory_order_relaxed)) {
      start();
      attach();
      attached_.store(true, std::memory_order_release);
    }
    return table_;
  }

 private:
  void start() {
    if (api_.is_initialized != nullptr) return;  // (a bootstrap that failed is retried)
    auto running = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "Py_IsInitialized"));
    if (running != nullptr && running() != 0) {
      bind_api(RTLD_DEFAULT, api_);  // this process runs Python already: its interpreter
      return;
    }
    env_ = find_environment();
    PythonApi api;
    bind_api(open_libpython(env_), api);
    if (api.set_program_name != nullptr) {
      // Python keeps the pointer: the name lives as long as the process.
      wchar_t* name = api.decode_locale(env_.python.c_str(), nullptr);
      if (name != nullptr) api.set_program_name(name);
    }
    api.initialize_ex(0);  // (0: no signal handlers; the program keeps its own)
    api.save_thread();     // the GIL is free from here on; ctypes takes it per call
    api_ = api;
  }

  void attach() {
    table_.put_result = &put_result;
    table_.deliver = &deliver_event;
    char error[4096] = {};
    std::ostringstream code;
    code << "def _pyengine_attach():\n"
            "    import ctypes, sys\n"
            "    try:\n";
    if (!env_.python.empty())  // (spawned workers run sys.executable: the environment's)
      code << "        sys.executable = " << quoted(env_.python.string()) << "\n";
    code << "        from pyengine.capi import bridge\n"
            "        bridge.attach("
         << reinterpret_cast<std::uintptr_t>(&table_) << ", " << PYENGINE_ABI_VERSION
         << ", '" PYENGINE_PYTHON_VERSION "')\n"
            "    except BaseException as e:\n"
            "        text = f'{type(e).__name__}: {e}'.encode('utf-8', 'replace')[:4095]\n"
            "        ctypes.memmove("
         << reinterpret_cast<std::uintptr_t>(error)
         << ", text, len(text))\n"
            "_pyengine_attach()\n"
            "del _pyengine_attach\n";
    const int gil = api_.gil_ensure();
    const int ran = api_.run_simple_string(code.str().c_str());
    api_.gil_release(gil);
    const std::string where = env_.python.empty() ? std::string("this process's Python")
                                                  : "the Python of " + env_.python.string();
    if (ran != 0)
      fail(PYENGINE_ERROR_ENVIRONMENT,
           where + " could not start pyengine's C API (its error is printed on stderr)");
    if (error[0] != '\0' || table_.op == nullptr)
      fail(PYENGINE_ERROR_ENVIRONMENT,
           where + " could not start pyengine's C API: " + std::string(error));
  }

  std::mutex mutex_;
  std::atomic<bool> attached_{false};
  PythonApi api_;
  Environment env_;
  BridgeTable table_;
};

Runtime& runtime() {
  static Runtime instance;
  return instance;
}

}  // namespace

std::string call(std::int64_t engine, Op op, std::string_view in) {
  const BridgeTable& table = runtime().table();
  std::string result;
  const std::int32_t status =
      table.op(engine, static_cast<std::int32_t>(op), in.data(), in.size(), &result);
  if (status != PYENGINE_OK) fail(static_cast<pyengine_status>(status), result);
  return result;
}

}  // namespace pyengine::capi
