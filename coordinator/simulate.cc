#include "coordinator/simulate.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "services/status_macros.h"

namespace interlock {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

// Typed access to a parsed JSON object; errors name the file and field.
class JsonFields {
 public:
  JsonFields(const Struct& s, std::string where)
      : s_(s), where_(std::move(where)) {}

  absl::StatusOr<const Value*> Get(const std::string& key) const {
    auto it = s_.fields().find(key);
    if (it == s_.fields().end()) return Missing(key);
    return &it->second;
  }
  bool Has(const std::string& key) const { return s_.fields().count(key) > 0; }
  absl::StatusOr<double> Number(const std::string& key) const {
    auto v = Get(key);
    if (!v.ok()) return v.status();
    return AsNumber(**v, key);
  }
  absl::StatusOr<std::string> String(const std::string& key) const {
    auto v = Get(key);
    if (!v.ok()) return v.status();
    if ((*v)->kind_case() != Value::kStringValue) return Wrong(key, "a string");
    return (*v)->string_value();
  }
  absl::StatusOr<double> AsNumber(const Value& v,
                                  const std::string& key) const {
    if (v.kind_case() != Value::kNumberValue ||
        !std::isfinite(v.number_value()) || v.number_value() < 0) {
      return Wrong(key, "a non-negative number");
    }
    return v.number_value();
  }
  absl::StatusOr<std::vector<int64_t>> Counts(const std::string& key,
                                              size_t size) const {
    auto v = Get(key);
    if (!v.ok()) return v.status();
    const std::string what = absl::StrCat("an array of ", size, " numbers");
    if ((*v)->kind_case() != Value::kListValue ||
        static_cast<size_t>((*v)->list_value().values_size()) != size) {
      return Wrong(key, what);
    }
    std::vector<int64_t> out;
    for (const Value& e : (*v)->list_value().values()) {
      auto d = AsNumber(e, key);
      if (!d.ok()) return Wrong(key, what);
      out.push_back(static_cast<int64_t>(std::llround(*d)));
    }
    return out;
  }
  absl::Status Missing(const std::string& key) const {
    return absl::InvalidArgumentError(
        absl::StrCat(where_, ": missing field '", key, "'"));
  }
  absl::Status Wrong(const std::string& key, const std::string& what) const {
    return absl::InvalidArgumentError(
        absl::StrCat(where_, ": field '", key, "' must be ", what));
  }

 private:
  const Struct& s_;
  std::string where_;
};

double Sum(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return s;
}

// The gradient lists of a mode (how many entries travel, which are early
// input-gradient passes), as the virtual clock models them.
PipelineShape ListsOf(const ModeSpec& m, int blocks) {
  PipelineShape s;
  s.blocks = blocks;
  s.e2e = m.e2e;
  s.n = m.e2e ? blocks : m.n;
  s.sum_rule = m.sum;
  return s;
}

std::string Percent(double r) { return absl::StrFormat("%.0f%%", 100.0 * r); }

}  // namespace

std::string ModeSpec::Label() const {
  if (e2e) return "e2e";
  return absl::StrCat(n, "-way ", sum ? "sum" : "furthest");
}

std::string ModeSpec::Dir() const {
  if (e2e) return "e2e";
  return absl::StrCat(n, sum ? "sum" : "way");
}

absl::StatusOr<std::vector<ModeSpec>> ParseModes(absl::string_view list,
                                                 int blocks) {
  std::vector<ModeSpec> out;
  const std::string expected =
      "expected e2e, N (N-way FURTHEST) or Nsum (N-way SUM), e.g. "
      "e2e,1,2,2sum";
  for (absl::string_view raw : absl::StrSplit(list, ',')) {
    const std::string entry =
        absl::AsciiStrToLower(absl::StripAsciiWhitespace(raw));
    if (entry.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--modes: empty entry in '", list, "'; ", expected));
    }
    ModeSpec m;
    if (entry == "e2e") {
      m.e2e = true;
    } else {
      absl::string_view digits = entry;
      if (absl::ConsumeSuffix(&digits, "sum")) {
        m.sum = true;
      } else {
        absl::ConsumeSuffix(&digits, "way");
      }
      if (digits.empty() || !absl::ascii_isdigit(digits[0]) ||
          !absl::SimpleAtoi(digits, &m.n)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--modes: '", entry, "' is not a mode; ", expected));
      }
      if (m.n < 1 || m.n > blocks) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--modes: '", entry,
            "' needs 1 <= n <= K, and the model has K = ", blocks, " blocks"));
      }
    }
    if (std::find(out.begin(), out.end(), m) != out.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--modes: '", entry, "' (", m.Label(), ") is listed twice"));
    }
    out.push_back(m);
  }
  return out;
}

absl::StatusOr<Profile> LoadProfile(const std::string& path) {
  std::string file = path;
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) file = path + "/profile.json";
  std::ifstream in(file);
  if (!in) {
    return absl::NotFoundError(absl::StrCat(
        "--profile: cannot read ", file,
        " (give the --out folder of an `interlock train` or `interlock "
        "compare` mode run)"));
  }
  std::stringstream text;
  text << in.rdbuf();
  Struct root;
  auto parsed = google::protobuf::util::JsonStringToMessage(text.str(), &root);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": not a JSON object: ", parsed.ToString()));
  }
  JsonFields f(root, file);
  Profile p;
  p.path = file;
  double d = 0;
  ASSIGN_OR_RETURN(d, f.Number("blocks"));
  p.blocks = static_cast<int>(d);
  if (p.blocks < 1 || p.blocks != d)
    return f.Wrong("blocks", "an integer >= 1");
  ASSIGN_OR_RETURN(d, f.Number("microbatches"));
  p.microbatches = static_cast<int>(d);
  if (p.microbatches < 1 || p.microbatches != d) {
    return f.Wrong("microbatches", "an integer >= 1");
  }
  ASSIGN_OR_RETURN(d, f.Number("batch_size"));
  p.batch_size = static_cast<int64_t>(d);
  std::string mode;
  ASSIGN_OR_RETURN(mode, f.String("mode"));
  if (mode == "e2e") {
    p.mode.e2e = true;
  } else if (mode == "interlock") {
    ASSIGN_OR_RETURN(d, f.Number("n"));
    p.mode.n = static_cast<int>(d);
    if (p.mode.n < 1 || p.mode.n > p.blocks || p.mode.n != d) {
      return f.Wrong("n", absl::StrCat("an integer in 1..", p.blocks));
    }
    std::string rule;
    ASSIGN_OR_RETURN(rule, f.String("rule"));
    if (rule != "furthest" && rule != "sum") {
      return f.Wrong("rule", "\"furthest\" or \"sum\"");
    }
    p.mode.sum = rule == "sum";
  } else {
    return f.Wrong("mode", "\"e2e\" or \"interlock\"");
  }
  ASSIGN_OR_RETURN(d, f.Number("input_bytes"));
  p.input_bytes = static_cast<int64_t>(d);
  ASSIGN_OR_RETURN(p.down_bytes, f.Counts("down_bytes", p.blocks - 1));
  ASSIGN_OR_RETURN(p.up_bytes, f.Counts("up_bytes", p.blocks - 1));

  const Value* v = nullptr;
  ASSIGN_OR_RETURN(v, f.Get("link"));
  if (v->kind_case() != Value::kStructValue) {
    return f.Wrong("link", "an object");
  }
  JsonFields link(v->struct_value(), file + ": link");
  ASSIGN_OR_RETURN(p.link.latency_seconds, link.Number("latency_seconds"));
  ASSIGN_OR_RETURN(p.link.bytes_per_second, link.Number("bytes_per_second"));

  ASSIGN_OR_RETURN(v, f.Get("per_block"));
  const std::string per_block_what = absl::StrCat(
      "an array of ", p.blocks,
      " objects with forward, head, backward and optimizer seconds");
  if (v->kind_case() != Value::kListValue ||
      v->list_value().values_size() != p.blocks) {
    return f.Wrong("per_block", per_block_what);
  }
  for (int k = 0; k < p.blocks; ++k) {
    const Value& e = v->list_value().values(k);
    if (e.kind_case() != Value::kStructValue) {
      return f.Wrong("per_block", per_block_what);
    }
    JsonFields b(e.struct_value(), absl::StrCat(file, ": per_block[", k, "]"));
    BlockProfile bp;
    ASSIGN_OR_RETURN(bp.forward, b.Number("forward"));
    ASSIGN_OR_RETURN(bp.head, b.Number("head"));
    ASSIGN_OR_RETURN(bp.backward, b.Number("backward"));
    // Optional: profiles without it model every input-only pass.
    bp.input_grad = -1.0;
    if (b.Has("input_grad")) {
      ASSIGN_OR_RETURN(bp.input_grad, b.Number("input_grad"));
    }
    ASSIGN_OR_RETURN(bp.optimizer, b.Number("optimizer"));
    p.per_block.push_back(bp);
  }
  ASSIGN_OR_RETURN(v, f.Get("step_seconds"));
  if (v->kind_case() != Value::kStructValue) {
    return f.Wrong("step_seconds", "an object with wall and virtual");
  }
  JsonFields step(v->struct_value(), file + ": step_seconds");
  ASSIGN_OR_RETURN(p.step_wall, step.Number("wall"));
  ASSIGN_OR_RETURN(p.step_virtual, step.Number("virtual"));
  return p;
}

ScaledPipeline ScaleProfile(const Profile& p, int blocks, int microbatches,
                            const LinkModel& link, const ModeSpec& mode) {
  const int kp = p.blocks;
  const PipelineShape measured = ListsOf(p.mode, kp);
  const double scale =
      static_cast<double>(p.microbatches) / static_cast<double>(microbatches);
  std::vector<double> forward(kp), backward(kp), pass(kp), optimizer(kp);
  for (int k = 0; k < kp; ++k) {
    const BlockProfile& b = p.per_block[k];
    forward[k] = b.forward;
    backward[k] = b.backward;
    optimizer[k] = b.optimizer;
    // One input-gradient-only pass: measured where the profile's mode ran
    // some, else modelled as a share of the parameter pass.
    const int early = measured.EarlyCount(k);
    pass[k] = early > 0 && b.input_grad >= 0 ? b.input_grad / early
                                             : kInputOnlyShare * b.backward;
    // The parameter pass alone: where it also yielded the input gradient
    // of an entry that goes upstream, that part costs about one pass.
    if (measured.Shared(k) >= 0) {
      backward[k] = std::max(0.0, b.backward - pass[k]);
    }
  }
  // Bytes of one gradient entry on link k -> k-1: measured where the
  // profile's mode sent gradients, else the activation's size (a gradient
  // has its activation's shape).
  std::vector<double> entry(std::max(0, kp - 1));
  for (int k = 1; k < kp; ++k) {
    const int e = measured.Up(k);
    entry[k - 1] = e > 0 && p.up_bytes[k - 1] > 0
                       ? static_cast<double>(p.up_bytes[k - 1]) / e
                       : static_cast<double>(p.down_bytes[k - 1]);
  }
  double aux_head = 0, mean_down = 0, mean_entry = 0;
  for (int k = 0; k + 1 < kp; ++k) {
    aux_head += p.per_block[k].head / (kp - 1);
    mean_down += static_cast<double>(p.down_bytes[k]) / (kp - 1);
    mean_entry += entry[k] / (kp - 1);
  }
  ScaledPipeline out;
  out.shape = ListsOf(mode, blocks);
  PipelineShape& s = out.shape;
  s.microbatches = microbatches;
  // The runner's default: 2 K M micro-batches in flight.
  s.window = 2 * blocks * microbatches;
  s.link = link;
  s.input_bytes = std::llround(p.input_bytes * scale);
  // Same K: the measured block k; else block k of K equal ones.
  const bool same = blocks == kp;
  auto cost = [&](const std::vector<double>& v, int k) {
    return same ? v[k] : Sum(v) / blocks;
  };
  for (int k = 0; k < blocks; ++k) {
    BlockProfile b;
    const bool last = k + 1 == blocks;
    b.forward = cost(forward, k) * scale;
    b.backward =
        (cost(backward, k) + (s.Shared(k) >= 0 ? cost(pass, k) : 0.0)) * scale;
    b.input_grad = cost(pass, k) * scale * s.EarlyCount(k);
    b.optimizer = cost(optimizer, k);
    if (last) {
      b.head = p.per_block[kp - 1].head * scale;  // the model's own loss
    } else if (!mode.e2e) {
      b.head = (same ? p.per_block[k].head : aux_head) * scale;
    }
    out.costs.push_back(b);
    if (!last) {
      s.down_bytes.push_back(
          std::llround((same ? p.down_bytes[k] : mean_down) * scale));
      s.up_bytes.push_back(
          std::llround((same ? entry[k] : mean_entry) * scale * s.Up(k + 1)));
    }
  }
  return out;
}

SimResult PredictMode(const Profile& profile, int blocks, int microbatches,
                      const LinkModel& link, const ModeSpec& mode) {
  ScaledPipeline sp = ScaleProfile(profile, blocks, microbatches, link, mode);
  return Simulate(sp.shape, sp.costs, kSimSteps, kSimWarmup);
}

std::vector<ModeSpec> ModesFor(int blocks) {
  std::vector<ModeSpec> out;
  ModeSpec e2e;
  e2e.e2e = true;
  out.push_back(e2e);
  for (int n = 1; n <= blocks; ++n) {
    ModeSpec f;
    f.n = n;
    out.push_back(f);
    ModeSpec s = f;
    s.sum = true;
    const PipelineShape lf = ListsOf(f, blocks), ls = ListsOf(s, blocks);
    for (int k = 0; k < blocks; ++k) {
      if (lf.Shared(k) != ls.Shared(k) ||
          lf.EarlyCount(k) != ls.EarlyCount(k)) {
        out.push_back(s);
        break;
      }
    }
  }
  return out;
}

int SimulateMain(const SimulateOptions& o, std::ostream& out,
                 std::ostream& err) {
  auto fail = [&err](const std::string& message, int code) {
    err << "interlock: error: " << message << "\n";
    return code;
  };
  if (o.profile.empty()) return fail("--profile is required", 2);
  if (o.blocks < 0) return fail("--blocks: must be >= 1", 2);
  if (o.microbatches < 0) return fail("--microbatches: must be >= 1", 2);
  auto loaded = LoadProfile(o.profile);
  if (!loaded.ok()) return fail(std::string(loaded.status().message()), 1);
  const Profile& p = *loaded;
  const int k = o.blocks > 0 ? o.blocks : p.blocks;
  const int m = o.microbatches > 0 ? o.microbatches : p.microbatches;
  if (o.has_mode && !o.mode.e2e && o.mode.n > k) {
    return fail(absl::StrCat("--n ", o.mode.n, ": n must be <= K = ", k), 2);
  }
  LinkModel link = p.link;
  if (o.bandwidth >= 0) link.bytes_per_second = o.bandwidth;
  if (o.latency >= 0) link.latency_seconds = o.latency;
  if (p.mode.e2e) {
    err << "interlock: warning: " << p.path
        << " comes from an E2E run, which has no auxiliary heads: the "
           "interlocking predictions leave the heads' cost out\n";
  }

  out << absl::StrFormat(
      "Profile %s: K=%d, M=%d, batch %d, %s; measured step %.4f s wall, %.4f "
      "s virtual\n",
      p.path, p.blocks, p.microbatches, p.batch_size, p.mode.Label(),
      p.step_wall, p.step_virtual);
  out << absl::StrFormat(
      "Predicted for K=%d (%s), M=%d, link %.0f us + bytes / %.3g B/s; an "
      "input-gradient-only pass costs what the profile measured, or %.1f of "
      "the parameter pass where it ran none\n\n",
      k, k == p.blocks ? "measured block costs" : "blocks of equal cost", m,
      link.latency_seconds * 1e6, link.bytes_per_second, kInputOnlyShare);
  out << absl::StrFormat("  %-16s %12s %9s %11s  %s\n", "mode", "step (s)",
                         "vs e2e", "utilisation", "idle per block (0..K-1)");
  double e2e_step = 0;
  bool chosen_found = false;
  for (const ModeSpec& mode : ModesFor(k)) {
    const SimResult r = PredictMode(p, k, m, link, mode);
    if (r.step_seconds <= 0) {
      return fail(absl::StrCat("the replay of ", mode.Label(),
                               " did not finish its steps"),
                  1);
    }
    if (mode.e2e) e2e_step = r.step_seconds;
    const bool chosen = o.has_mode && mode == o.mode;
    chosen_found |= chosen;
    std::string idle;
    for (double b : r.busy_ratio) {
      absl::StrAppend(&idle, idle.empty() ? "" : " ", Percent(1.0 - b));
    }
    out << absl::StrFormat("%s %-16s %12.5f %8.2fx %11s  %s\n",
                           chosen ? "*" : " ", mode.Label(), r.step_seconds,
                           e2e_step / r.step_seconds, Percent(r.utilisation),
                           idle);
  }
  if (o.has_mode && !chosen_found) {
    // n = 1 or a rule that costs the same as FURTHEST: its row stands for it.
    out << absl::StrFormat("  (%s costs what the %s row shows)\n",
                           o.mode.Label(),
                           ModeSpec{false, o.mode.n, false}.Label());
  }
  if (o.sweep) {
    out << absl::StrFormat(
        "\nStep time (s) of the profiled model cut into K blocks of equal "
        "cost, M=%d, rule %s:\n",
        m, o.sum_rule ? "sum" : "furthest");
    out << absl::StrFormat("  %4s %12s %12s %12s %12s\n", "K", "e2e", "1-way",
                           "2-way", "3-way");
    for (int sk : {2, 4, 8, 16}) {
      std::string line = absl::StrFormat("  %4d", sk);
      for (int n : {0, 1, 2, 3}) {
        if (n > sk) {
          absl::StrAppend(&line, absl::StrFormat(" %12s", "-"));
          continue;
        }
        ModeSpec mode;
        mode.e2e = n == 0;
        mode.n = std::max(1, n);
        mode.sum = o.sum_rule;
        const SimResult r = PredictMode(p, sk, m, link, mode);
        absl::StrAppend(&line, absl::StrFormat(" %12.5f", r.step_seconds));
      }
      out << line << "\n";
    }
  }
  return 0;
}

}  // namespace interlock
