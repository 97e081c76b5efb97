#include "analysis/simulate.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "analysis/run_files.h"
#include "analysis/unit_costs.h"
#include "plan/replica_routes.h"
#include "plan/status_macros.h"

namespace interlock {
namespace {

// Errors of a profile naming the file and the field.
absl::Status Missing(const std::string& where, const std::string& key) {
  return absl::InvalidArgumentError(
      absl::StrCat(where, ": missing field '", key, "'"));
}
absl::Status Wrong(const std::string& where, const std::string& key,
                   const std::string& what) {
  return absl::InvalidArgumentError(
      absl::StrCat(where, ": field '", key, "' must be ", what));
}

// A present, finite, non-negative value of an optional field.
absl::StatusOr<double> Cost(const std::string& where, const std::string& key,
                            bool has, double value) {
  if (!has) return Missing(where, key);
  if (!std::isfinite(value) || value < 0) {
    return Wrong(where, key, "a non-negative number");
  }
  return value;
}

// Byte counts: finite, non-negative integers.
absl::StatusOr<std::vector<int64_t>> Counts(
    const std::string& where, const std::string& key,
    const google::protobuf::RepeatedField<double>& values, size_t size) {
  const std::string what = absl::StrCat("an array of ", size, " numbers");
  if (static_cast<size_t>(values.size()) != size) {
    return Wrong(where, key, what);
  }
  std::vector<int64_t> out;
  for (double d : values) {
    if (!std::isfinite(d) || d < 0) return Wrong(where, key, what);
    out.push_back(static_cast<int64_t>(std::llround(d)));
  }
  return out;
}

// Optional per-block counts (replicas, units): absent, or one >= 1 each.
absl::StatusOr<std::vector<int>> BlockCounts(
    const std::string& where, const std::string& key,
    const google::protobuf::RepeatedField<int32_t>& values, int blocks) {
  if (values.empty()) return std::vector<int>{};
  if (values.size() != blocks ||
      std::any_of(values.begin(), values.end(), [](int c) { return c < 1; })) {
    return Wrong(where, key,
                 absl::StrCat("an array of ", blocks, " integers >= 1"));
  }
  return std::vector<int>(values.begin(), values.end());
}

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

// How the backward passes a profile did not run are costed: the run's own
// calibration where it has one (blocks 1.., per block), else fixed shares.
std::string PassModel(const Profile& p) {
  std::vector<std::string> extra, share;
  for (int k = 1; k < p.blocks; ++k) {
    const size_t i = static_cast<size_t>(k);
    if (i < p.shared_extra.size() && p.shared_extra[i] >= 0 &&
        i < p.input_share.size() && p.input_share[i] >= 0) {
      extra.push_back(absl::StrFormat("%.2f", p.shared_extra[i]));
      share.push_back(absl::StrFormat("%.2f", p.input_share[i]));
    }
  }
  if (!extra.empty() && extra.size() == static_cast<size_t>(p.blocks - 1)) {
    return absl::StrCat(
        "Backward passes, as the run calibrated them for blocks 1..",
        p.blocks - 1,
        ": a parameter pass that also yields the input gradient costs ",
        absl::StrJoin(extra, "/"), " of one more; an input-gradient-only pass ",
        absl::StrJoin(share, "/"),
        " of a parameter pass (or what the profile measured, where its mode "
        "ran some)");
  }
  return absl::StrFormat(
      "Backward passes (the profile has no calibration): an "
      "input-gradient-only pass costs what the profile measured, or %.2f of "
      "the parameter pass where it ran none; a parameter pass that also "
      "yields the input gradient %.2f of one more",
      kInputOnlyShare, kSharedInputShare);
}

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
  auto read = ReadProfileFile(file);
  if (absl::IsNotFound(read.status())) {
    return absl::NotFoundError(absl::StrCat(
        "--profile: cannot read ", file,
        " (give the --out folder of an `interlock train` or `interlock "
        "compare` mode run)"));
  }
  if (!read.ok()) return read.status();
  const v1::RunProfile& f = *read;
  Profile p;
  p.path = file;
  p.blocks = f.blocks();
  if (p.blocks < 1) return Wrong(file, "blocks", "an integer >= 1");
  p.microbatches = f.microbatches();
  if (p.microbatches < 1) {
    return Wrong(file, "microbatches", "an integer >= 1");
  }
  p.batch_size = f.batch_size();
  if (f.mode() == "e2e") {
    p.mode.e2e = true;
  } else if (f.mode() == "interlock") {
    p.mode.n = f.n();
    if (p.mode.n < 1 || p.mode.n > p.blocks) {
      return Wrong(file, "n", absl::StrCat("an integer in 1..", p.blocks));
    }
    if (f.rule() != "furthest" && f.rule() != "sum") {
      return Wrong(file, "rule", "\"furthest\" or \"sum\"");
    }
    p.mode.sum = f.rule() == "sum";
  } else {
    return Wrong(file, "mode", "\"e2e\" or \"interlock\"");
  }
  ASSIGN_OR_RETURN(const double input_bytes,
                   Cost(file, "input_bytes", true, f.input_bytes()));
  p.input_bytes = static_cast<int64_t>(input_bytes);
  ASSIGN_OR_RETURN(p.down_bytes,
                   Counts(file, "down_bytes", f.down_bytes(), p.blocks - 1));
  ASSIGN_OR_RETURN(p.up_bytes,
                   Counts(file, "up_bytes", f.up_bytes(), p.blocks - 1));
  p.wire = f.wire().empty() ? "fp32" : f.wire();

  if (!f.has_link()) return Missing(file, "link");
  const std::string link = file + ": link";
  ASSIGN_OR_RETURN(p.link.latency_seconds,
                   Cost(link, "latency_seconds", f.link().has_latency_seconds(),
                        f.link().latency_seconds()));
  ASSIGN_OR_RETURN(
      p.link.bytes_per_second,
      Cost(link, "bytes_per_second", f.link().has_bytes_per_second(),
           f.link().bytes_per_second()));

  if (f.per_block_size() != p.blocks) {
    return Wrong(file, "per_block",
                 absl::StrCat("an array of ", p.blocks,
                              " objects with forward, head, backward and "
                              "optimizer seconds"));
  }
  for (int k = 0; k < p.blocks; ++k) {
    const v1::BlockCosts& c = f.per_block(k);
    const std::string where = absl::StrCat(file, ": per_block[", k, "]");
    BlockProfile bp;
    ASSIGN_OR_RETURN(bp.forward,
                     Cost(where, "forward", c.has_forward(), c.forward()));
    ASSIGN_OR_RETURN(bp.head, Cost(where, "head", c.has_head(), c.head()));
    ASSIGN_OR_RETURN(bp.backward,
                     Cost(where, "backward", c.has_backward(), c.backward()));
    // Optional: profiles without it model every input-only pass.
    bp.input_grad = -1.0;
    if (c.has_input_grad()) {
      ASSIGN_OR_RETURN(bp.input_grad,
                       Cost(where, "input_grad", true, c.input_grad()));
    }
    ASSIGN_OR_RETURN(bp.optimizer, Cost(where, "optimizer", c.has_optimizer(),
                                        c.optimizer()));
    p.per_block.push_back(bp);
    // Optional: the calibrated pass ratios.
    p.shared_extra.push_back(-1.0);
    p.input_share.push_back(-1.0);
    if (c.has_shared_extra()) {
      ASSIGN_OR_RETURN(p.shared_extra.back(),
                       Cost(where, "shared_extra", true, c.shared_extra()));
    }
    if (c.has_input_share()) {
      ASSIGN_OR_RETURN(p.input_share.back(),
                       Cost(where, "input_share", true, c.input_share()));
    }
    // Optional, but for every block or none.
    if (c.has_parameters() != f.per_block(0).has_parameters()) {
      return Wrong(where, "parameters", "given for every block or for none");
    }
    if (c.has_parameters()) {
      ASSIGN_OR_RETURN(const double n,
                       Cost(where, "parameters", true, c.parameters()));
      p.parameters.push_back(std::llround(n));
    }
  }
  ASSIGN_OR_RETURN(p.replicas,
                   BlockCounts(file, "replicas", f.replicas(), p.blocks));
  if (f.reduction() != "" && f.reduction() != "ordered" &&
      f.reduction() != "ring") {
    return Wrong(file, "reduction", "\"ordered\" or \"ring\"");
  }
  p.ring_reduction = f.reduction() == "ring";
  ASSIGN_OR_RETURN(p.partition,
                   BlockCounts(file, "partition", f.partition(), p.blocks));
  if (!f.has_step_seconds()) return Missing(file, "step_seconds");
  const std::string step = file + ": step_seconds";
  ASSIGN_OR_RETURN(p.step_wall, Cost(step, "wall", f.step_seconds().has_wall(),
                                     f.step_seconds().wall()));
  ASSIGN_OR_RETURN(p.step_virtual,
                   Cost(step, "virtual", f.step_seconds().has_virtual_(),
                        f.step_seconds().virtual_()));
  return p;
}

ReplicaSpec ProfileReplicas(const Profile& profile) {
  return {profile.replicas, profile.ring_reduction};
}

ScaledPipeline ScaleProfile(const Profile& p, int blocks, int microbatches,
                            const LinkModel& link, const ModeSpec& mode,
                            const ReplicaSpec& replicas) {
  const int kp = p.blocks;
  const PipelineShape measured = ListsOf(p.mode, kp);
  const double scale =
      static_cast<double>(p.microbatches) / static_cast<double>(microbatches);
  std::vector<double> forward(kp), backward(kp), pass(kp), optimizer(kp);
  // What yielding the input gradient adds to a parameter pass, per block:
  // calibrated in the run, else the model's default.
  std::vector<double> extra(kp, kSharedInputShare);
  double mean_extra = 0;
  for (int k = 0; k < kp; ++k) {
    const BlockProfile& b = p.per_block[k];
    forward[k] = b.forward;
    backward[k] = b.backward;
    optimizer[k] = b.optimizer;
    if (static_cast<size_t>(k) < p.shared_extra.size() &&
        p.shared_extra[k] >= 0) {
      extra[k] = p.shared_extra[k];
    }
    // Block 0's input gradient is never needed (nor calibrated).
    if (k > 0) mean_extra += extra[k] / (kp - 1);
    // The parameter pass alone, where it also yielded the input gradient
    // of an entry that goes upstream.
    if (measured.Shared(k) >= 0) backward[k] = b.backward / (1.0 + extra[k]);
    // One input-gradient-only pass: measured where the profile's mode ran
    // some, else calibrated, else modelled, as a share of the parameter
    // pass.
    const int early = measured.EarlyCount(k);
    const double share =
        static_cast<size_t>(k) < p.input_share.size() && p.input_share[k] >= 0
            ? p.input_share[k]
            : kInputOnlyShare;
    pass[k] = early > 0 && b.input_grad >= 0 ? b.input_grad / early
                                             : share * backward[k];
  }
  if (kp == 1) mean_extra = kSharedInputShare;
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
  s.replicas = replicas.replicas;
  s.ring_reduction = replicas.ring;
  // Same K: the measured block k; else block k of K equal ones.
  const bool same = blocks == kp;
  if (!p.parameters.empty()) {
    double total = 0;
    for (int64_t n : p.parameters) total += static_cast<double>(n);
    for (int k = 0; k < blocks; ++k) {
      s.parameters.push_back(same ? p.parameters[k]
                                  : std::llround(total / blocks));
    }
  }
  auto cost = [&](const std::vector<double>& v, int k) {
    return same ? v[k] : Sum(v) / blocks;
  };
  for (int k = 0; k < blocks; ++k) {
    BlockProfile b;
    const bool last = k + 1 == blocks;
    b.forward = cost(forward, k) * scale;
    b.backward =
        cost(backward, k) *
        (s.Shared(k) >= 0 ? 1.0 + (same ? extra[k] : mean_extra) : 1.0) * scale;
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
                      const LinkModel& link, const ModeSpec& mode,
                      const ReplicaSpec& replicas) {
  ScaledPipeline sp =
      ScaleProfile(profile, blocks, microbatches, link, mode, replicas);
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
  if (!o.reduction.empty() && o.reduction != "ordered" &&
      o.reduction != "ring") {
    return fail(absl::StrCat("--reduction: '", o.reduction,
                             "', expected ordered or ring"),
                2);
  }
  auto loaded = LoadProfile(o.profile);
  if (!loaded.ok()) return fail(std::string(loaded.status().message()), 1);
  // A unit profile is cut as --partition says or, for another K, balanced;
  // the cut's blocks are then "measured".
  std::string cut;
  const int measured_blocks = loaded->blocks;
  const bool unit_profile = UnitCostsOf(*loaded).ok();
  if (!o.partition.empty() ||
      (unit_profile && o.blocks > 0 && o.blocks != loaded->blocks)) {
    auto costs = UnitCostsOf(*loaded);
    if (!costs.ok()) {
      return fail(absl::StrCat("--partition: ", costs.status().message()), 1);
    }
    auto counts = o.partition.empty()
                      ? BalancedPartition(*costs, o.blocks)
                      : ParsePartition(o.partition, loaded->blocks, o.blocks);
    if (!counts.ok()) {
      return fail(
          absl::StrCat(o.partition.empty() ? "--blocks: " : "--partition: ",
                       counts.status().message()),
          2);
    }
    cut = absl::StrCat(o.partition.empty() ? "the balanced cut " : "the cut ",
                       PartitionString(*counts), " of the profile's units");
    *loaded = CutProfile(*loaded, *counts);
  }
  const Profile& p = *loaded;
  const int k = o.blocks > 0 ? o.blocks : p.blocks;
  const int m = o.microbatches > 0 ? o.microbatches : p.microbatches;
  if (o.has_mode && !o.mode.e2e && o.mode.n > k) {
    return fail(absl::StrCat("--n ", o.mode.n, ": n must be <= K = ", k), 2);
  }
  // Replicas: --replicas, else the profile's run's where K is its K.
  ReplicaSpec rs;
  rs.ring = o.reduction.empty() ? p.ring_reduction : o.reduction == "ring";
  if (!o.replicas.empty()) {
    if (auto st = CheckReplicas(o.replicas, k, m, "--replicas"); !st.ok()) {
      return fail(std::string(st.message()), 2);
    }
    rs.replicas = o.replicas;
  } else if (k == p.blocks && Replicated(p.replicas)) {
    if (auto st = CheckReplicas(p.replicas, k, m, "the profile's replicas");
        !st.ok()) {
      return fail(absl::StrCat(st.message(), "; give --replicas"), 2);
    }
    rs.replicas = p.replicas;
  }
  const bool replicated = Replicated(rs.replicas);
  LinkModel link = p.link;
  if (o.bandwidth >= 0) link.bytes_per_second = o.bandwidth;
  if (o.latency >= 0) link.latency_seconds = o.latency;
  if (p.mode.e2e) {
    err << "interlock: warning: " << p.path
        << " comes from an E2E run, which has no auxiliary heads: the "
           "interlocking predictions leave the heads' cost out\n";
  }
  if (replicated && p.parameters.empty()) {
    err << "interlock: warning: " << p.path
        << " records no parameter counts (an older profile): the replicas' "
           "reduction costs only its latency\n";
  }

  out << absl::StrFormat(
      "Profile %s: K=%d, M=%d, batch %d, %s, wire %s; measured step %.4f s "
      "wall, %.4f s virtual\n",
      p.path, measured_blocks, p.microbatches, p.batch_size, p.mode.Label(),
      p.wire, p.step_wall, p.step_virtual);
  out << absl::StrFormat(
      "Predicted for K=%d (%s), M=%d, link %.0f us + bytes / %.3g B/s\n", k,
      !cut.empty()    ? cut
      : k == p.blocks ? "measured block costs"
                      : "blocks of equal cost",
      m, link.latency_seconds * 1e6, link.bytes_per_second);
  out << PassModel(p) << "\n";
  if (replicated) {
    out << absl::StrFormat(
        "Replicas %s, reduction %s: a block's replicas split its "
        "micro-batches; before each optimizer step they all-reduce (a ring: "
        "2(R-1) x (latency + bytes / (R x bandwidth)), for the metadata and "
        "then the gradients: ORDERED M x P x 4 bytes, RING P x 4)\n",
        absl::StrJoin(rs.replicas, ","), rs.ring ? "ring" : "ordered");
    PipelineShape sh = ScaleProfile(p, k, m, link, ModeSpec{}, rs).shape;
    sh.parameters.resize(k, 0);
    for (int b = 0; b < k; ++b) {
      if (sh.Replicas(b) == 1) continue;
      sh.ring_reduction = false;
      const int64_t ordered_bytes = sh.ReductionBytes(b);
      const double ordered = sh.ReductionSeconds(b);
      sh.ring_reduction = true;
      out << absl::StrFormat(
          "  block %d: %d replicas, P = %d parameters; per step ORDERED "
          "reduces %.3g MB in %.5f s, RING %.3g MB in %.5f s\n",
          b, sh.Replicas(b), sh.parameters[b], ordered_bytes / 1e6, ordered,
          sh.ReductionBytes(b) / 1e6, sh.ReductionSeconds(b));
    }
  }
  out << "\n";
  if (replicated) {
    out << absl::StrFormat("  %-16s %12s %9s %11s %10s %11s  %s\n", "mode",
                           "step (s)", "vs e2e", "samples/s", "vs 1 rep.",
                           "utilisation",
                           "idle per block (0..K-1, replicas a/b)");
  } else {
    out << absl::StrFormat("  %-16s %12s %9s %11s  %s\n", "mode", "step (s)",
                           "vs e2e", "utilisation", "idle per block (0..K-1)");
  }
  double e2e_step = 0;
  bool chosen_found = false;
  for (const ModeSpec& mode : ModesFor(k)) {
    const SimResult r = PredictMode(p, k, m, link, mode, rs);
    if (r.step_seconds <= 0) {
      return fail(absl::StrCat("the replay of ", mode.Label(),
                               " did not finish its steps"),
                  1);
    }
    if (mode.e2e) e2e_step = r.step_seconds;
    const bool chosen = o.has_mode && mode == o.mode;
    chosen_found |= chosen;
    std::string idle;
    for (const auto& replicas : r.replica_busy_ratio) {
      std::string block;
      for (double b : replicas) {
        absl::StrAppend(&block, block.empty() ? "" : "/", Percent(1.0 - b));
      }
      absl::StrAppend(&idle, idle.empty() ? "" : " ", block);
    }
    if (replicated) {
      const SimResult one = PredictMode(p, k, m, link, mode);
      out << absl::StrFormat(
          "%s %-16s %12.5f %8.2fx %11.1f %9.2fx %11s  %s\n", chosen ? "*" : " ",
          mode.Label(), r.step_seconds, e2e_step / r.step_seconds,
          p.batch_size / r.step_seconds, one.step_seconds / r.step_seconds,
          Percent(r.utilisation), idle);
    } else {
      out << absl::StrFormat("%s %-16s %12.5f %8.2fx %11s  %s\n",
                             chosen ? "*" : " ", mode.Label(), r.step_seconds,
                             e2e_step / r.step_seconds, Percent(r.utilisation),
                             idle);
    }
  }
  if (o.has_mode && !chosen_found) {
    // n = 1 or a rule that costs the same as FURTHEST: its row stands for it.
    out << absl::StrFormat("  (%s costs what the %s row shows)\n",
                           o.mode.Label(),
                           ModeSpec{false, o.mode.n, false}.Label());
  }
  // A row of step times for e2e and 1-, 2-, 3-way.
  auto sweep_row = [&](int sk, const ReplicaSpec& replicas) {
    std::string line;
    for (int n : {0, 1, 2, 3}) {
      if (n > sk) {
        absl::StrAppend(&line, absl::StrFormat(" %12s", "-"));
        continue;
      }
      ModeSpec mode;
      mode.e2e = n == 0;
      mode.n = std::max(1, n);
      mode.sum = o.sum_rule;
      const SimResult r = PredictMode(p, sk, m, link, mode, replicas);
      absl::StrAppend(&line, absl::StrFormat(" %12.5f", r.step_seconds));
    }
    return line;
  };
  if (o.sweep) {
    out << absl::StrFormat(
        "\nStep time (s) of the profiled model cut into K blocks of equal "
        "cost, M=%d, rule %s%s:\n",
        m, o.sum_rule ? "sum" : "furthest",
        replicated ? ", one replica each" : "");
    out << absl::StrFormat("  %4s %12s %12s %12s %12s\n", "K", "e2e", "1-way",
                           "2-way", "3-way");
    for (int sk : {2, 4, 8, 16}) {
      out << absl::StrFormat("  %4d", sk) << sweep_row(sk, {}) << "\n";
    }
  }
  if (o.sweep && replicated) {
    // The block with the most replicas, from one replica up to M.
    const int grown = static_cast<int>(
        std::max_element(rs.replicas.begin(), rs.replicas.end()) -
        rs.replicas.begin());
    out << absl::StrFormat(
        "\nStep time (s) against block %d's replicas (the others as given), "
        "K=%d, M=%d, rule %s:\n",
        grown, k, m, o.sum_rule ? "sum" : "furthest");
    out << absl::StrFormat("  %4s %12s %12s %12s %12s\n", "R", "e2e", "1-way",
                           "2-way", "3-way");
    for (int r : {1, 2, 3, 4, 6, 8}) {
      if (r > m) break;
      ReplicaSpec spec = rs;
      spec.replicas[grown] = r;
      out << absl::StrFormat("  %4d", r) << sweep_row(k, spec) << "\n";
    }
  }
  return 0;
}

}  // namespace interlock
