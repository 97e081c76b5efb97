// The report of `interlock compare` (coordinator/compare.h runs the modes):
// from each mode's run folder (summary.json, eval.jsonl, metrics.jsonl) it
// writes DIR/report.md (a table of steps, step times on the wall and
// virtual clocks, utilisation and the final test metric of every head) and
// PNG plots drawn with gnuplot.
#ifndef INTERLOCK_ANALYSIS_COMPARE_REPORT_H_
#define INTERLOCK_ANALYSIS_COMPARE_REPORT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "analysis/simulate.h"
#include "proto/report.pb.h"

namespace interlock {

// One mode of a comparison (with its wire codecs, when the comparison
// has several) and what its run left.
struct ModeReport {
  ModeSpec mode;
  // `compare --wire` entry ("bf16", "bf16:int8"); empty without --wire.
  std::string wire;
  // `compare --seeds` entry; -1 without --seeds (the run's seed is then the
  // comparison's one).
  int64_t seed = -1;
  std::string dir;  // the run's --out folder
  bool tried = false;
  // OK once the run finished and its files were read.
  absl::Status status = absl::UnknownError("not run");
  interlock::v1::RunSummary summary;
  std::vector<interlock::v1::EvalLine> evals;  // eval.jsonl

  // The row's name: the mode's label, "/" and the codecs with --wire, and
  // the seed with --seeds ("2-way furthest/bf16 seed 2").
  std::string Label() const;
  // The label without the seed: what the runs of one mode over the seeds
  // share.
  std::string GroupLabel() const;
  // Its folder under the comparison's: the mode's, "-" and the codecs
  // with --wire, "-seedS" with --seeds ("2way-bf16", "2way-bf16_int8",
  // "2way-seed3").
  std::string Dir() const;
};

// Mean and sample standard deviation (n - 1 in the denominator) of the
// finite values; sd is NaN below two values, mean NaN for none.
struct MeanSd {
  double mean = 0.0;
  double sd = 0.0;
  int n = 0;
};
MeanSd MeanAndSd(const std::vector<double>& values);

// The finished runs of one mode (a GroupLabel) over the seeds.
struct SeedAggregate {
  std::string label;  // GroupLabel
  int runs = 0;       // finished runs aggregated
  MeanSd steps, step_wall, step_virtual, utilisation;
  // Per block: its head's final test metric as tabulated (accuracy in %,
  // or perplexity); n = 0 where the block has no head.
  std::vector<MeanSd> metric;
};

// Groups the finished runs by GroupLabel, in order of first appearance.
std::vector<SeedAggregate> AggregateSeeds(const std::vector<ModeReport>& runs,
                                          int blocks, bool text);

// "85.00% ± 1.23" (accuracy) or "6.512 ± 0.041" (perplexity); "-" for no
// value, "± -" for one.
std::string FormatMeanSd(const MeanSd& m, bool percent, int decimals);

// Reads the summary and evaluations of a finished run from report.dir; the
// status says what could not be read.
absl::Status ReadModeFiles(ModeReport& report);

// What the report says about the comparison as a whole.
struct ReportHeader {
  std::string command_line;  // as typed
  std::string config_path;
  std::string name;  // the config's
  int blocks = 0;
  int batch_size = 0;
  int microbatches = 0;
  uint64_t seed = 0;
  // `compare --seeds`: every mode ran once per seed (empty: `seed` only).
  std::vector<int64_t> seeds;
  std::string partition;  // the model's units per block (empty: not said)
  std::string engine;     // how the modes ran
  std::string wire;       // which codecs the links used (empty: not said)
  std::string limit;      // steps and budgets
  std::string cadence;    // of evaluations
  LinkModel link;
};

// Whether the runs are of a text model (perplexity is the metric).
bool IsText(const std::vector<ModeReport>& runs);
// The final head's metrics; nullptr for none.
const interlock::v1::HeadMetrics* FinalHead(
    const interlock::v1::RunSummary& summary);
// The test metric as tabulated: accuracy (%) or perplexity (text).
std::string FormatMetric(const interlock::v1::HeadMetrics& head, bool text);

// Writes the plot data (DIR/plots/*.dat), DIR/plots.gp and draws the plots;
// an error says why there are none (no finished mode, gnuplot missing, a
// script error, or a picture it did not write).
absl::Status WritePlots(const std::string& dir, const std::string& name,
                        const std::vector<ModeReport>& runs, int blocks);

// Writes DIR/report.md; `plots` is what WritePlots returned.
absl::Status WriteReport(const std::string& dir, const ReportHeader& header,
                         const std::vector<ModeReport>& runs,
                         const absl::Status& plots);

}  // namespace interlock

#endif  // INTERLOCK_ANALYSIS_COMPARE_REPORT_H_
