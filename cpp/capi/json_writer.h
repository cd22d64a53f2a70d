// A small JSON writer: what the C side sends bridge.py (requests, options) is JSON text,
// which Python reads in one json.loads.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace pyengine::capi {

class JsonWriter {
 public:
  JsonWriter& begin_object() { return open('{'); }
  JsonWriter& end_object() { return close('}'); }
  JsonWriter& begin_array() { return open('['); }
  JsonWriter& end_array() { return close(']'); }

  JsonWriter& key(std::string_view name) {
    separate();
    quote(name);
    out_ += ':';
    fresh_ = true;  // (the value takes no comma)
    return *this;
  }
  JsonWriter& value(std::string_view text) {
    separate();
    quote(text);
    return *this;
  }
  JsonWriter& value(const char* text) {
    if (text == nullptr) return null();
    return value(std::string_view(text));
  }
  JsonWriter& value(bool flag) { return raw(flag ? "true" : "false"); }
  JsonWriter& value(std::int64_t number) { return raw(std::to_string(number)); }
  JsonWriter& value(std::int32_t number) { return value(static_cast<std::int64_t>(number)); }
  JsonWriter& value(double number) {
    if (!std::isfinite(number)) return raw(number != number ? "NaN" : number > 0 ? "Infinity" : "-Infinity");
    char text[32];
    std::snprintf(text, sizeof text, "%.9g", number);
    return raw(text);
  }
  JsonWriter& null() { return raw("null"); }
  // Text that is JSON already (a caller's object), written as it is.
  JsonWriter& raw(std::string_view json) {
    separate();
    out_ += json;
    return *this;
  }

  const std::string& text() const { return out_; }

 private:
  JsonWriter& open(char bracket) {
    separate();
    out_ += bracket;
    fresh_ = true;
    return *this;
  }
  JsonWriter& close(char bracket) {
    out_ += bracket;
    fresh_ = false;
    return *this;
  }
  void separate() {
    if (!fresh_) out_ += ',';
    fresh_ = false;
  }
  void quote(std::string_view text) {
    out_ += '"';
    for (const char c : text) {
      const auto byte = static_cast<unsigned char>(c);
      if (c == '"' || c == '\\') {
        out_ += '\\';
        out_ += c;
      } else if (byte < 0x20) {
        char escaped[8];
        std::snprintf(escaped, sizeof escaped, "\\u%04x", byte);
        out_ += escaped;
      } else {
        out_ += c;  // UTF-8 as it is (bridge.py refuses bytes that are not)
      }
    }
    out_ += '"';
  }

  std::string out_;
  bool fresh_ = true;
};

}  // namespace pyengine::capi
