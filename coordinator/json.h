// Minimal JSON output helpers for the run files (we only write JSON).
#ifndef INTERLOCK_COORDINATOR_JSON_H_
#define INTERLOCK_COORDINATOR_JSON_H_

#include <cmath>
#include <string>

#include "absl/strings/str_format.h"

namespace interlock {

// 17 significant digits: reads back as the same double. Non-finite values
// become null.
inline std::string JsonNumber(double v) {
  if (!std::isfinite(v)) return "null";
  return absl::StrFormat("%.17g", v);
}

inline std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        if (c < 0x20) {
          out += absl::StrFormat("\\u%04x", c);
        } else {
          out.push_back(static_cast<char>(c));
        }
    }
  }
  return out + "\"";
}

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_JSON_H_
