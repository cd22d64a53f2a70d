// A minimal test harness (no dependency to install): TEST registers a case, CHECK and
// CHECK_THROWS record failures with file and line, main runs every case and returns
// non-zero if any failed. Each test executable is one ctest test.
#pragma once

#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <vector>

namespace pyengine::testing {

struct Case {
  const char* name;
  std::function<void()> body;
};

inline std::vector<Case>& cases() {
  static std::vector<Case> all;
  return all;
}

inline int& failures() {
  static int count = 0;
  return count;
}

struct Register {
  Register(const char* name, std::function<void()> body) {
    cases().push_back({name, std::move(body)});
  }
};

inline void fail(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "%s:%d: FAILED: %s\n", file, line, what.c_str());
  ++failures();
}

inline int run_all() {
  int failed_cases = 0;
  for (const Case& c : cases()) {
    const int before = failures();
    try {
      c.body();
    } catch (const std::exception& e) {
      fail(c.name, 0, std::string("unexpected exception: ") + e.what());
    }
    const bool ok = failures() == before;
    failed_cases += ok ? 0 : 1;
    std::printf("[%s] %s\n", ok ? "  OK  " : "FAILED", c.name);
  }
  std::printf("%zu passed, %d failed\n", cases().size() - static_cast<size_t>(failed_cases),
              failed_cases);
  return failed_cases == 0 ? 0 : 1;
}

}  // namespace pyengine::testing

#define PYE_CONCAT_INNER(a, b) a##b
#define PYE_CONCAT(a, b) PYE_CONCAT_INNER(a, b)
#define TEST(name)                                                                     \
  static void name();                                                                  \
  static const ::pyengine::testing::Register PYE_CONCAT(register_, name)(#name, name); \
  static void name()
#define CHECK(condition)                                                         \
  do {                                                                           \
    if (!(condition)) ::pyengine::testing::fail(__FILE__, __LINE__, #condition); \
  } while (0)
#define CHECK_EQ(a, b)                                                              \
  do {                                                                              \
    if (!((a) == (b))) ::pyengine::testing::fail(__FILE__, __LINE__, #a " == " #b); \
  } while (0)
#define CHECK_THROWS(exception_type, statement)                                             \
  do {                                                                                      \
    bool thrown_ = false;                                                                   \
    try {                                                                                   \
      statement;                                                                            \
    } catch (const exception_type&) {                                                       \
      thrown_ = true;                                                                       \
    }                                                                                       \
    if (!thrown_) {                                                                         \
      ::pyengine::testing::fail(__FILE__, __LINE__, #statement " throws " #exception_type); \
    }                                                                                       \
  } while (0)
#define TEST_MAIN() \
  int main() { return ::pyengine::testing::run_all(); }
