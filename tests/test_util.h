// Shared helpers for the tests.
#ifndef INTERLOCK_TESTS_TEST_UTIL_H_
#define INTERLOCK_TESTS_TEST_UTIL_H_

#include <glog/logging.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace interlock::testing {

// A fresh folder per test under TMPDIR (else /tmp), removed at the end.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "interlock_test") {
    const char* base = std::getenv("TMPDIR");
    std::string pattern = absl::StrCat(
        base != nullptr && base[0] ? base : "/tmp", "/", prefix, "_XXXXXX");
    path_ = mkdtemp(pattern.data()) != nullptr ? pattern : "";
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const {
    return absl::StrCat(path_, "/", name);
  }

 private:
  std::string path_;
};

// The whole file ("" when it cannot be read).
// What this process logs (glog) while it lives, one message a line.
class LogCapture : public google::LogSink {
 public:
  LogCapture() { google::AddLogSink(this); }
  ~LogCapture() override { google::RemoveLogSink(this); }
  void send(google::LogSeverity, const char*, const char*, int,
            const google::LogMessageTime&, const char* message,
            size_t length) override {
    std::lock_guard<std::mutex> l(mu_);
    text_.append(message, length).push_back('\n');
  }
  std::string str() {
    std::lock_guard<std::mutex> l(mu_);
    return text_;
  }

 private:
  std::mutex mu_;
  std::string text_;
};

inline std::string ReadFile(const std::string& path) {
  std::stringstream ss;
  ss << std::ifstream(path, std::ios::binary).rdbuf();
  return ss.str();
}

// Parses the --dump-params output: one {"name":...,"values":[...]} per line.
inline std::map<std::string, std::vector<double>> ParseParams(
    const std::string& text) {
  std::map<std::string, std::vector<double>> out;
  std::istringstream in(text);
  std::string line;
  const std::string kName = "{\"name\":\"";
  const std::string kValues = "\"values\":[";
  while (std::getline(in, line)) {
    if (line.rfind(kName, 0) != 0) continue;
    const size_t name_end = line.find('"', kName.size());
    const size_t v = line.find(kValues);
    const size_t v_end = line.rfind(']');
    if (name_end == std::string::npos || v == std::string::npos ||
        v_end == std::string::npos || v_end < v) {
      continue;
    }
    std::vector<double>& values =
        out[line.substr(kName.size(), name_end - kName.size())];
    const std::string list =
        line.substr(v + kValues.size(), v_end - v - kValues.size());
    for (absl::string_view part : absl::StrSplit(list, ',')) {
      double d = 0;
      if (absl::SimpleAtod(part, &d)) values.push_back(d);
    }
  }
  return out;
}

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Runs a shell command and captures its output.
inline CommandResult RunCommand(const std::string& command) {
  CommandResult r;
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// A command that failed with one line, "interlock: error: ..." holding
// `fragment`.
inline void ExpectOneLineError(const CommandResult& r, const std::string& what,
                               const std::string& fragment) {
  EXPECT_NE(r.exit_code, 0) << what;
  EXPECT_NE(r.output.find("interlock: error:"), std::string::npos)
      << what << ": " << r.output;
  EXPECT_NE(r.output.find(fragment), std::string::npos)
      << what << ": " << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1)
      << what << ": " << r.output;
}

// The "digest <hex>" the CLI prints at the end of a run ("" if none).
inline std::string DigestOf(const std::string& output) {
  const auto at = output.find("digest ");
  return at == std::string::npos ? std::string() : output.substr(at + 7, 64);
}

// A top-level or nested field of summary.json, as written ("name": value):
// a number, a quoted string or a [list].
inline std::string SummaryField(const std::string& json,
                                const std::string& name) {
  std::smatch m;
  if (!std::regex_search(
          json, m, std::regex("\"" + name + "\": (\\[[^\\]]*\\]|[^,}\\n]*)"))) {
    return "";
  }
  return m[1];
}

inline bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Occurrences of `what` in `text`.
inline int Count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos;
       at = text.find(what, at + 1)) {
    ++n;
  }
  return n;
}

}  // namespace interlock::testing

#endif  // INTERLOCK_TESTS_TEST_UTIL_H_
