// The run files through their schema (proto/report.proto): each file
// round-trips through its writer and reader, keeps the keys users script
// against (listed here as the hand-written writers printed them before), and
// prints numbers as JSON numbers, never quoted.
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "analysis/run_files.h"
#include "analysis/simulate.h"
#include "analysis/timeline.h"
#include "coordinator/run_report.h"

namespace interlock {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;
using Keys = std::set<std::string>;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

class ReportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (std::filesystem::temp_directory_path() /
            ("interlock_report_" + std::to_string(getpid())))
               .string();
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string ReadText(const std::string& path) {
    std::stringstream s;
    s << std::ifstream(path).rdbuf();
    return s.str();
  }

  std::string dir_;
};

// Any JSON object, as protobuf's generic JSON value.
Struct Parse(const std::string& json) {
  Struct s;
  EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(json, &s).ok())
      << json;
  return s;
}

Keys KeysOf(const Struct& s) {
  Keys out;
  for (const auto& [key, value] : s.fields()) out.insert(key);
  return out;
}

// The keys of the first object of the list s[key].
Keys KeysOfFirst(const Struct& s, const std::string& key) {
  const auto& list = s.fields().at(key).list_value();
  if (list.values_size() == 0) return {};
  return KeysOf(list.values(0).struct_value());
}

// Every number in `v` is a JSON number (not a quoted string) unless it is
// one of the keys that hold text.
void ExpectNumbers(const Struct& s, const Keys& text_keys,
                   const std::string& where) {
  for (const auto& [key, value] : s.fields()) {
    SCOPED_TRACE(where + "." + key);
    if (value.has_struct_value()) {
      ExpectNumbers(value.struct_value(), text_keys, where + "." + key);
    } else if (value.has_list_value()) {
      for (const Value& e : value.list_value().values()) {
        if (e.has_struct_value()) {
          ExpectNumbers(e.struct_value(), text_keys, where + "." + key);
        } else {
          EXPECT_TRUE(e.has_number_value()) << e.ShortDebugString();
        }
      }
    } else if (text_keys.count(key)) {
      EXPECT_TRUE(value.has_string_value());
    } else {
      EXPECT_TRUE(value.has_number_value()) << value.ShortDebugString();
    }
  }
}

TEST_F(ReportTest, MetricsLineKeepsItsKeysAndRoundTrips) {
  v1::MetricsLine line;
  line.set_step(3);
  line.set_wall_seconds(0.1);
  line.set_virtual_seconds(0.05);
  line.set_lr(0.01);
  line.add_loss(kNaN);  // a block without a head
  line.add_loss(2.25);
  line.set_samples_per_second(640);
  const std::string json = JsonLine(line);
  // One compact line, "step" first: readers and tests match its start.
  EXPECT_EQ(json.rfind("{\"step\":3,", 0), 0u) << json;
  EXPECT_EQ(json.find('\n'), std::string::npos);
  EXPECT_NE(json.find("\"loss\":[\"NaN\",2.25]"), std::string::npos) << json;
  const Struct s = Parse(json);
  EXPECT_EQ(KeysOf(s), (Keys{"step", "wall_seconds", "virtual_seconds", "lr",
                             "loss", "samples_per_second"}));
  EXPECT_TRUE(s.fields().at("step").has_number_value());

  auto back = ParseMetricsLine(json);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->step(), 3);
  EXPECT_EQ(back->wall_seconds(), 0.1);
  ASSERT_EQ(back->loss_size(), 2);
  EXPECT_TRUE(std::isnan(back->loss(0)));
  EXPECT_EQ(back->loss(1), 2.25);
  EXPECT_EQ(back->samples_per_second(), 640);
}

// Lines of the hand-written writer before report.proto (%.17g, null for
// non-finite numbers) still give their step: a resume cuts old files and
// replays old checkpoints' pending lines.
TEST(RunFiles, OlderMetricsLinesStillParse) {
  auto line = ParseMetricsLine(
      "{\"step\":7,\"wall_seconds\":0.10000000000000001,\"virtual_seconds\":"
      "null,\"lr\":0.10000000000000001,\"loss\":[2.5,1.25],"
      "\"samples_per_second\":12}");
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_EQ(line->step(), 7);
  EXPECT_EQ(line->lr(), 0.1);
  EXPECT_FALSE(ParseMetricsLine("{\"step\":8,\"wall_sec").ok());
}

TEST_F(ReportTest, CutMetricsLinesKeepsLinesAsWritten) {
  const std::string path = dir_ + "/metrics.jsonl";
  std::string text;
  for (int s = 0; s < 5; ++s) {
    v1::MetricsLine line;
    line.set_step(s);
    line.set_lr(0.1 * s);
    text += JsonLine(line) + "\n";
  }
  std::ofstream(path) << text << "{\"step\":5,\"wall_s";  // cut by a crash
  ASSERT_TRUE(CutMetricsLines(path, [](int64_t s) { return s < 3; }).ok());
  std::string kept;
  std::istringstream lines(text);
  std::string l;
  for (int s = 0; s < 3 && std::getline(lines, l); ++s) kept += l + "\n";
  EXPECT_EQ(ReadText(path), kept);
  auto read = ReadMetrics(path);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), 3u);
  EXPECT_EQ((*read)[2].step(), 2);
  EXPECT_TRUE(
      CutMetricsLines(dir_ + "/none.jsonl", [](int64_t) { return true; }).ok());
}

TrainResult SomeResult() {
  TrainResult r;
  r.steps = 20;
  r.wall_seconds = 1.5;
  r.virtual_seconds = 0.75;
  r.mean_step_wall = 0.07;
  r.mean_step_virtual = 0.03;
  r.utilisation = 0.6;
  r.busy_ratio = {0.5, 0.7};
  r.skipped_steps = {0, 1};
  HeadResult aux{0, false, 1.5, 0.4, kNaN};
  HeadResult fin{1, true, 0.5, 0.9, kNaN};
  r.eval = {aux, fin};
  r.evals = {EvalPoint{10, 0.7, 0.3, {aux, fin}},
             EvalPoint{20, 1.5, 0.75, {aux, fin}}};
  r.block_digests = {"aa", "bb"};
  r.head_digests = {"cc", ""};
  r.digest = "dd";
  r.accounting.microbatches_per_step = 2;
  // Above 2^31: int32 would not hold it, int64 would print it quoted.
  r.accounting.microbatches_applied = 3000000000;
  r.accounting.block_steps = 40;
  r.accounting.steps_not_exactly_once = {4};
  r.accounting.resumed_from_step = -1;
  r.accounting.checkpoints = 3;
  r.accounting.failovers = 1;
  r.topology = {TopologyEvent{
      7, 2, {{MemberChangeKind::kJoin, 1, "10.0.0.9:50051", ""}}, {1, 2}}};
  return r;
}

v1::RunConfig SomeConfig() {
  v1::RunConfig c;
  c.set_name("tiny");
  c.mutable_training()->set_n(2);
  c.mutable_training()->set_microbatches(2);
  c.mutable_training()->set_batch_size(16);
  c.mutable_training()->set_seed(1234);
  return c;
}

TEST_F(ReportTest, SummaryKeepsItsKeysAndRoundTrips) {
  const std::string path = dir_ + "/summary.json";
  const v1::RunSummary summary =
      SummaryOf(SomeConfig(), "2-way furthest", 2, SomeResult());
  ASSERT_TRUE(WriteSummary(path, summary).ok());
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  const std::string text = ReadText(path);
  // Indented, one key a line; tests read fields as `"name": value`.
  EXPECT_NE(text.find("\n \"name\": \"tiny\",\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\"microbatches_applied\": 3000000000,"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("\"resumed_from_step\": -1,"), std::string::npos);
  EXPECT_NE(text.find("\"seed\": 1234,"), std::string::npos);
  EXPECT_NE(text.find("\"perplexity\": \"NaN\""), std::string::npos);

  const Struct s = Parse(text);
  EXPECT_EQ(KeysOf(s), (Keys{"name",
                             "mode",
                             "blocks",
                             "n",
                             "microbatches",
                             "batch_size",
                             "seed",
                             "steps",
                             "skipped_steps",
                             "wall_seconds",
                             "virtual_seconds",
                             "mean_step_seconds",
                             "utilisation",
                             "busy_ratio",
                             "eval",
                             "digests",
                             "digest",
                             "accounting",
                             "replicas",
                             "reduction",
                             "wire",
                             "replica_busy_ratio",
                             "topology",
                             "insecure"}));
  EXPECT_EQ(KeysOf(s.fields().at("mean_step_seconds").struct_value()),
            (Keys{"wall", "virtual"}));
  EXPECT_EQ(KeysOfFirst(s, "eval"),
            (Keys{"block", "head", "loss", "accuracy", "perplexity"}));
  EXPECT_EQ(KeysOfFirst(s, "digests"), (Keys{"block", "params", "head"}));
  EXPECT_EQ(KeysOfFirst(s, "topology"),
            (Keys{"step", "generation", "changes", "replicas", "state_bytes"}));
  EXPECT_NE(text.find("\"kind\": \"join\""), std::string::npos) << text;
  EXPECT_NE(text.find("\"failovers\": 1"), std::string::npos) << text;
  EXPECT_EQ(
      KeysOf(s.fields().at("accounting").struct_value()),
      (Keys{"microbatches_per_step", "microbatches_applied", "block_steps",
            "steps_not_exactly_once", "recoveries", "microbatches_replayed",
            "duplicates_acknowledged", "resumed_from_step", "checkpoints",
            "failovers", "adoptions"}));
  // Numbers are JSON numbers; only these keys hold text (and "NaN").
  Struct numbers = s;
  for (auto& e : *(*numbers.mutable_fields())["eval"]
                      .mutable_list_value()
                      ->mutable_values()) {
    e.mutable_struct_value()->mutable_fields()->erase("perplexity");
  }
  // The one flag: a JSON boolean, false unless the run had --insecure.
  EXPECT_TRUE(s.fields().at("insecure").has_bool_value());
  EXPECT_FALSE(s.fields().at("insecure").bool_value());
  numbers.mutable_fields()->erase("insecure");
  ExpectNumbers(numbers,
                {"name", "mode", "head", "params", "digest", "reduction",
                 "wire", "kind", "address"},
                "summary");

  auto back = ReadSummary(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->steps(), 20);
  EXPECT_EQ(back->accounting().microbatches_applied(), 3000000000.0);
  EXPECT_EQ(back->accounting().resumed_from_step(), -1);
  EXPECT_EQ(back->wire(), "fp32");
  EXPECT_EQ(back->mean_step_seconds().virtual_(), 0.03);
  ASSERT_EQ(back->eval_size(), 2);
  EXPECT_EQ(back->eval(1).head(), "final");
  EXPECT_TRUE(std::isnan(back->eval(1).perplexity()));
  EXPECT_EQ(back->digests(1).head(), "");
  v1::RunSummary no_nan = summary;
  v1::RunSummary back_no_nan = *back;
  for (auto* m : {&no_nan, &back_no_nan}) {
    for (auto& h : *m->mutable_eval()) h.set_perplexity(0);
  }
  EXPECT_EQ(no_nan.SerializeAsString(), back_no_nan.SerializeAsString());
}

TEST_F(ReportTest, EvalLinesKeepTheirKeysAndRoundTrip) {
  const std::string path = dir_ + "/eval.jsonl";
  const auto lines = EvalLinesOf(SomeResult().evals);
  ASSERT_EQ(lines.size(), 4u);
  ASSERT_TRUE(WriteEval(path, lines).ok());
  std::istringstream text(ReadText(path));
  std::string first;
  std::getline(text, first);
  EXPECT_EQ(first.rfind("{\"step\":10,\"wall_seconds\":0.7,", 0), 0u) << first;
  EXPECT_NE(first.find("\"head\":\"aux\""), std::string::npos) << first;
  const Struct s = Parse(first);
  EXPECT_EQ(KeysOf(s), (Keys{"step", "wall_seconds", "virtual_seconds", "block",
                             "head", "loss", "accuracy", "perplexity"}));
  auto back = ReadEval(path);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->size(), 4u);
  EXPECT_EQ((*back)[3].step(), 20);
  EXPECT_EQ((*back)[3].head(), "final");
  EXPECT_EQ((*back)[3].accuracy(), 0.9);
}

TEST_F(ReportTest, ProfileKeepsItsKeysAndRoundTrips) {
  PipelineShape shape;
  shape.blocks = 2;
  shape.microbatches = 2;
  shape.input_bytes = 1000;
  shape.down_bytes = {5000000000};  // above 2^32 bytes: a JSON number still
  shape.up_bytes = {6000};
  PipelineSim sim(shape);
  RunInfo info;
  info.name = "tiny";
  info.n = 2;
  info.batch_size = 16;
  info.steps = 4;
  info.mean_step_wall = 0.2;
  info.mean_step_virtual = 0.1;
  info.wire = "bf16:int8";
  ASSERT_TRUE(WriteProfile(sim, info, dir_ + "/profile.json").ok());
  const std::string text = ReadText(dir_ + "/profile.json");
  EXPECT_NE(text.find("5000000000"), std::string::npos) << text;
  const Struct s = Parse(text);
  EXPECT_EQ(KeysOf(s),
            (Keys{"name", "blocks", "microbatches", "batch_size", "mode", "n",
                  "rule", "steps", "input_bytes", "down_bytes", "up_bytes",
                  "link", "per_block", "step_seconds", "wire", "replicas",
                  "reduction", "partition"}));
  EXPECT_EQ(KeysOf(s.fields().at("link").struct_value()),
            (Keys{"latency_seconds", "bytes_per_second"}));
  EXPECT_EQ(KeysOfFirst(s, "per_block"),
            (Keys{"forward", "head", "backward", "input_grad", "optimizer"}));
  EXPECT_EQ(KeysOf(s.fields().at("step_seconds").struct_value()),
            (Keys{"wall", "virtual"}));
  ExpectNumbers(s, {"name", "mode", "rule", "wire", "reduction"}, "profile");

  auto p = LoadProfile(dir_);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->blocks, 2);
  EXPECT_EQ(p->microbatches, 2);
  EXPECT_EQ(p->batch_size, 16);
  EXPECT_EQ(p->wire, "bf16:int8");
  EXPECT_FALSE(p->mode.e2e);
  EXPECT_EQ(p->mode.n, 2);
  EXPECT_EQ(p->input_bytes, 1000);
  EXPECT_EQ(p->down_bytes, std::vector<int64_t>{5000000000});
  EXPECT_EQ(p->up_bytes, std::vector<int64_t>{6000});
  EXPECT_EQ(p->link.bytes_per_second, shape.link.bytes_per_second);
  ASSERT_EQ(p->per_block.size(), 2u);
  EXPECT_EQ(p->per_block[1].input_grad, 0.0);  // present: measured
  EXPECT_EQ(p->step_wall, 0.2);
  EXPECT_EQ(p->step_virtual, 0.1);
  EXPECT_TRUE(p->parameters.empty());  // the clock was not told any
  EXPECT_TRUE(p->replicas.empty());
  EXPECT_FALSE(p->ring_reduction);

  // With replicas: their counts, the reduction and the parameters the
  // clock was given come back; the optimizer cost is per replica.
  shape.replicas = {2, 1};
  shape.parameters = {1234, 56};
  shape.ring_reduction = true;
  PipelineSim replicated(shape);
  for (int64_t step = 0; step < 4; ++step) {
    for (int mb = 0; mb < 2; ++mb) {
      replicated.SetMicrobatch(step, mb, {{1, 0, 2, 0}, {1, 0, 2, 0}});
    }
    replicated.SetOptimizer(step, 0, 0.5);
    replicated.SetOptimizer(step, 1, 0.5);
  }
  replicated.SetSubmitted(8);
  replicated.Finish();
  replicated.Advance();
  ASSERT_EQ(replicated.steps_finished(), 4);
  ASSERT_TRUE(WriteProfile(replicated, info, dir_ + "/profile.json").ok());
  p = LoadProfile(dir_);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->replicas, (std::vector<int>{2, 1}));
  EXPECT_EQ(p->parameters, (std::vector<int64_t>{1234, 56}));
  EXPECT_TRUE(p->ring_reduction);
  EXPECT_DOUBLE_EQ(p->per_block[0].optimizer, 0.5);
  EXPECT_DOUBLE_EQ(p->per_block[0].forward, 1.0);
  EXPECT_DOUBLE_EQ(p->per_block[0].backward, 2.0);
}

TEST_F(ReportTest, ProfileFieldsMissingOrWrongAreNamed) {
  const std::string path = dir_ + "/profile.json";
  const std::string head =
      "{\"blocks\": 1, \"microbatches\": 1, \"batch_size\": 8, "
      "\"mode\": \"e2e\", \"input_bytes\": 10, \"down_bytes\": [], "
      "\"up_bytes\": [], \"link\": {\"latency_seconds\": 0, "
      "\"bytes_per_second\": 0}, ";
  std::ofstream(path) << head
                      << "\"per_block\": [{\"forward\": 1, \"head\": 0, "
                         "\"optimizer\": 0}], \"step_seconds\": {\"wall\": "
                         "1, \"virtual\": 1}}";
  auto p = LoadProfile(path);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("per_block[0]: missing field 'backward'"),
            std::string::npos)
      << p.status();
  // An older profile without input_grad models every input-only pass.
  std::ofstream(path, std::ios::trunc)
      << head
      << "\"per_block\": [{\"forward\": 1, \"head\": 0, \"backward\": 2, "
         "\"optimizer\": 0}], \"step_seconds\": {\"wall\": 1, \"virtual\": "
         "1}}";
  p = LoadProfile(path);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->per_block[0].input_grad, -1.0);
  std::ofstream(path, std::ios::trunc) << "{\"blocks\": 1.5}";
  p = LoadProfile(path);
  EXPECT_NE(p.status().message().find("blocks"), std::string::npos)
      << p.status();
}

TEST(RunFiles, ParamDumpIsOneJsonLinePerTensor) {
  std::string out;
  AppendParamDump("block0.w", torch::tensor({0.5, -1.0}).view({1, 2}), &out);
  EXPECT_EQ(out,
            "{\"name\":\"block0.w\",\"shape\":[1,2],"
            "\"values\":[0.5,-1]}\n");
}

}  // namespace
}  // namespace interlock
