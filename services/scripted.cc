// The scripted family: a user's network as TorchScript units exported from
// PyTorch by python/interlock. Each unit is loaded with torch::jit::load and
// wrapped in a LibTorch module that shares the TorchScript module's
// parameters and buffers (the same tensors: the optimizer, checkpoints and
// replicas' reductions act on them in place) and passes train/eval on. The
// JIT graph executor's optimisation is off in every process that runs one:
// with it on, the first calls profile and later ones may run fused kernels,
// so a replica that joins late would not compute the bits of one that has
// been running. The switch is per thread in LibTorch, so each call sets it
// on the thread it runs on.
#include "services/scripted.h"

#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/script.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "google/protobuf/text_format.h"
#include "plan/partition.h"
#include "plan/status_macros.h"
#include "services/models.h"
#include "services/models_internal.h"
#include "services/sha256.h"

namespace interlock {
namespace models_internal {
namespace {

using interlock::v1::ModelSpec;
using interlock::v1::ScriptedModel;

constexpr char kManifest[] = "model.pbtxt";

// The first non-empty line of a LibTorch error (they run to many lines).
std::string FirstLine(const std::string& text) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::StripAsciiWhitespace(line).empty()) return std::string(line);
  }
  return text;
}

// What this process was sent, by SHA-256 (StageScriptedFile,
// HoldScriptedFiles). `staged` orders the files not in use, oldest first.
struct Held {
  std::mutex mu;
  std::map<std::string, std::shared_ptr<const std::string>> by_sha;
  std::vector<std::string> staged;
  int64_t bytes = 0;
};
Held& HeldFiles() {
  static Held* held = new Held;
  return *held;
}

std::string Shape(const google::protobuf::RepeatedField<int64_t>& dims) {
  return absl::StrCat("[", absl::StrJoin(dims, ", "), "]");
}
std::string Shape(c10::IntArrayRef dims) {
  return absl::StrCat("[", absl::StrJoin(dims, ", "), "]");
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("model.scripted: cannot read ", path));
  }
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// A file name inside the model folder: no directories, so a manifest (or a
// coordinator) cannot make a worker or the coordinator read elsewhere.
bool PlainName(const std::string& name) {
  return !name.empty() && name.find('/') == std::string::npos &&
         name.find('\\') == std::string::npos && name != "." && name != "..";
}

absl::Status CheckManifest(const ScriptedModel& m, const std::string& where) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.scripted: ", where, ": ", why));
  };
  std::vector<std::string> version = absl::StrSplit(m.torch_version(), '.');
  int major = 0, minor = 0;
  if (version.size() < 2 || !absl::SimpleAtoi(version[0], &major) ||
      !absl::SimpleAtoi(version[1], &minor)) {
    return bad(absl::StrCat("torch_version '", m.torch_version(),
                            "' is not a PyTorch release"));
  }
  if (major != TORCH_VERSION_MAJOR || minor != TORCH_VERSION_MINOR) {
    return bad(absl::StrCat("exported with PyTorch ", m.torch_version(),
                            " but this LibTorch is ", TORCH_VERSION,
                            "; export with PyTorch ", TORCH_VERSION_MAJOR, ".",
                            TORCH_VERSION_MINOR, " (Debian's python3-torch)"));
  }
  if (m.units_size() == 0) return bad("no units");
  if (m.input_shape_size() == 0) return bad("no input_shape");
  for (int64_t d : m.input_shape()) {
    if (d <= 0) return bad("input_shape " + Shape(m.input_shape()));
  }
  if (m.input_dtype() != "float32" && m.input_dtype() != "int64") {
    return bad(absl::StrCat("input_dtype '", m.input_dtype(),
                            "', expected float32 or int64"));
  }
  if (m.loss() != ScriptedModel::CLASSES && m.loss() != ScriptedModel::TOKENS) {
    return bad("loss must be CLASSES or TOKENS");
  }
  if (m.classes() <= 0) return bad("classes must be > 0");
  for (int u = 0; u < m.units_size(); ++u) {
    const auto& unit = m.units(u);
    if (!PlainName(unit.file())) {
      return bad(absl::StrCat("unit ", u, ": file '", unit.file(),
                              "' must be a plain name in the folder"));
    }
    if (unit.sha256().size() != 64) {
      return bad(absl::StrCat("unit ", u, ": no SHA-256"));
    }
    if (unit.output_shape_size() == 0) {
      return bad(absl::StrCat("unit ", u, ": no output_shape"));
    }
    for (int64_t d : unit.output_shape()) {
      if (d <= 0) {
        return bad(absl::StrCat("unit ", u, ": output_shape ",
                                Shape(unit.output_shape())));
      }
    }
  }
  const auto& last = m.units(m.units_size() - 1).output_shape();
  if (last[last.size() - 1] != m.classes() ||
      last.size() != (m.loss() == ScriptedModel::TOKENS ? 2 : 1)) {
    return bad(absl::StrCat(
        "the last unit's output ", Shape(last), " is not ",
        m.loss() == ScriptedModel::TOKENS ? "[T, classes]" : "[classes]",
        " with classes = ", m.classes()));
  }
  for (const auto& h : m.heads()) {
    if (h.after_unit() < 0 || h.after_unit() + 1 >= m.units_size()) {
      return bad(absl::StrCat("a head after unit ", h.after_unit(),
                              ": outside [0, ", m.units_size() - 1, ")"));
    }
    if (!PlainName(h.file()) || h.sha256().size() != 64) {
      return bad(absl::StrCat("the head after unit ", h.after_unit(),
                              ": needs a plain file name and a SHA-256"));
    }
  }
  return absl::OkStatus();
}

// The spec's manifest: the resolved one, else read from the folder.
absl::StatusOr<ScriptedModel> Manifest(const ModelSpec& spec) {
  if (spec.scripted().model().units_size() > 0) {
    // Resolved by the coordinator and sent with Configure: checked as the
    // file would be.
    RETURN_IF_ERROR(CheckManifest(spec.scripted().model(), "model.pbtxt"));
    return spec.scripted().model();
  }
  if (spec.scripted().path().empty()) {
    return absl::InvalidArgumentError(
        "model.scripted.path: empty; give the folder that "
        "interlock.export_model wrote");
  }
  const std::string file = absl::StrCat(spec.scripted().path(), "/", kManifest);
  ASSIGN_OR_RETURN(const std::string text, ReadFile(file));
  ScriptedModel m;
  if (!google::protobuf::TextFormat::ParseFromString(text, &m)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.scripted: ", file,
        " is not a model.pbtxt of interlock.export_model (text format)"));
  }
  RETURN_IF_ERROR(CheckManifest(m, file));
  return m;
}

// The bytes of a file of the model: held (sent with Configure) or read
// from the folder, and checked against the manifest's hash either way.
absl::StatusOr<std::shared_ptr<const std::string>> FileBytes(
    const ModelSpec& spec, const std::string& name, const std::string& sha) {
  {
    Held& held = HeldFiles();
    std::lock_guard<std::mutex> l(held.mu);
    auto it = held.by_sha.find(sha);
    if (it != held.by_sha.end()) return it->second;
  }
  if (spec.scripted().path().empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "model.scripted: ", name,
        " was not sent to this worker and there is no model folder"));
  }
  const std::string path = absl::StrCat(spec.scripted().path(), "/", name);
  ASSIGN_OR_RETURN(std::string bytes, ReadFile(path));
  if (Sha256Hex(bytes.data(), bytes.size()) != sha) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.scripted: ", path,
        " does not match the SHA-256 in model.pbtxt (changed after export?)"));
  }
  return std::make_shared<const std::string>(std::move(bytes));
}

// Loads a TorchScript module and checks that its forward takes one tensor
// and returns one.
absl::StatusOr<torch::jit::Module> LoadModule(const std::string& bytes,
                                              const std::string& what) {
  torch::jit::Module m;
  try {
    std::istringstream in(bytes);
    m = torch::jit::load(in);
  } catch (const std::exception& e) {
    const std::string why = FirstLine(e.what());
    return absl::InvalidArgumentError(
        absl::StrCat("model.scripted: ", what, " is not TorchScript that ",
                     "LibTorch ", TORCH_VERSION, " loads: ", why));
  }
  auto forward = m.find_method("forward");
  if (!forward) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.scripted: ", what, " has no forward method"));
  }
  const c10::FunctionSchema& schema = forward->function().getSchema();
  // arguments()[0] is self.
  const bool one_in =
      schema.arguments().size() == 2 &&
      schema.arguments()[1].type()->kind() == c10::TypeKind::TensorType;
  const bool one_out =
      schema.returns().size() == 1 &&
      schema.returns()[0].type()->kind() == c10::TypeKind::TensorType;
  if (!one_in || !one_out) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.scripted: ", what, "'s forward takes ",
        schema.arguments().size() - 1, " argument(s) and returns ",
        schema.returns().size(), " value(s) (", c10::toString(schema),
        "); a unit takes one tensor and returns one tensor"));
  }
  return m;
}

// A TorchScript module as a LibTorch module: the same parameter and buffer
// tensors, registered under their dotted names with '.' spelled "__".
struct ScriptedUnitImpl : nn::Module {
  explicit ScriptedUnitImpl(torch::jit::Module m) : module(std::move(m)) {
    for (const auto& p : module.named_parameters(/*recurse=*/true)) {
      register_parameter(Flat(p.name), p.value, p.value.requires_grad());
    }
    for (const auto& b : module.named_buffers(/*recurse=*/true)) {
      register_buffer(Flat(b.name), b.value);
    }
    module.train(is_training());
  }
  static std::string Flat(const std::string& name) {
    return absl::StrJoin(absl::StrSplit(name, '.'), "__");
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::jit::GraphOptimizerEnabledGuard unoptimised(false);
    torch::Tensor out = module.forward({x}).toTensor();
    // The gradient reaching a unit's output is made contiguous: LibTorch
    // 1.13's float GELU backward returns garbage for a strided gradient of
    // a contiguous input (a unit whose output is a convolution of permuted
    // values hands its input a channels-last gradient). Same values.
    if (out.requires_grad()) {
      out.register_hook([](torch::Tensor g) { return g.contiguous(); });
    }
    return out;
  }
  void train(bool on) override {
    nn::Module::train(on);
    module.train(on);
  }
  torch::jit::Module module;
};
TORCH_MODULE(ScriptedUnit);

// A unit this process does not hold (a worker keeps one block's).
struct AbsentUnitImpl : nn::Module {
  explicit AbsentUnitImpl(int unit) : unit(unit) {}
  torch::Tensor forward(const torch::Tensor&) {
    throw std::runtime_error(
        absl::StrCat("scripted unit ", unit, " is not held by this process"));
  }
  int unit;
};
TORCH_MODULE(AbsentUnit);

torch::Tensor ZeroSample(c10::IntArrayRef dims, bool tokens) {
  std::vector<int64_t> batch = {1};
  batch.insert(batch.end(), dims.begin(), dims.end());
  return tokens ? torch::zeros(batch, torch::kInt64) : torch::zeros(batch);
}

// Runs one zero sample through a loaded unit in eval mode: the output must
// have the declared shape and be float32, and every trained parameter must
// get a gradient from it. Leaves no gradient behind.
absl::Status CheckUnit(ScriptedUnit& unit, const torch::Tensor& input,
                       c10::IntArrayRef declared, const std::string& what) {
  const bool was_training = unit->is_training();
  unit->eval();
  absl::Status status = absl::OkStatus();
  try {
    torch::Tensor out = unit->forward(input);
    if (out.scalar_type() != torch::kFloat32) {
      status = absl::InvalidArgumentError(
          absl::StrCat("model.scripted: ", what, " returns ",
                       c10::toString(out.scalar_type()), ", not float32"));
    } else if (out.sizes().slice(1) != declared) {
      status = absl::InvalidArgumentError(absl::StrCat(
          "model.scripted: ", what, " returns ", Shape(out.sizes().slice(1)),
          " per sample but model.pbtxt declares ", Shape(declared)));
    } else {
      std::vector<torch::Tensor> trained;
      for (const auto& p : unit->parameters()) {
        if (p.requires_grad()) trained.push_back(p);
      }
      if (!trained.empty()) {
        if (!out.requires_grad()) {
          status = absl::InvalidArgumentError(absl::StrCat(
              "model.scripted: ", what,
              "'s output does not depend on its parameters (no gradient)"));
        } else {
          auto grads = torch::autograd::grad({out.sum()}, trained, {},
                                             /*retain_graph=*/false,
                                             /*create_graph=*/false,
                                             /*allow_unused=*/true);
          for (size_t i = 0; i < grads.size(); ++i) {
            if (!grads[i].defined()) {
              status = absl::InvalidArgumentError(absl::StrCat(
                  "model.scripted: ", what,
                  ": a parameter gets no gradient from the output"));
              break;
            }
          }
        }
      }
    }
  } catch (const std::exception& e) {
    std::string why = e.what();
    status = absl::InvalidArgumentError(
        absl::StrCat("model.scripted: ", what, " fails on a sample of ",
                     Shape(input.sizes().slice(1)), ": ", FirstLine(why)));
  }
  unit->train(was_training);
  return status;
}

models_internal::Shape ShapeOf(
    const google::protobuf::RepeatedField<int64_t>& d) {
  using S = models_internal::Shape;
  if (d.size() == 3) return S{S::kImage, d[0], d[1], d[2]};
  if (d.size() == 2) return S{S::kSequence, d[1], 1, 1};
  return S{S::kVector, d[d.size() - 1], 1, 1};
}

class Scripted : public Family {
 public:
  const char* name() const override { return "scripted"; }
  bool Describes(const ModelSpec& spec) const override {
    return spec.has_scripted();
  }
  absl::Status Resolve(ModelSpec* spec) const override {
    if (spec->scripted().model().units_size() > 0) return absl::OkStatus();
    std::error_code ec;
    const auto dir = std::filesystem::absolute(spec->scripted().path(), ec);
    if (!ec) spec->mutable_scripted()->set_path(dir.string());
    ASSIGN_OR_RETURN(*spec->mutable_scripted()->mutable_model(),
                     Manifest(*spec));
    return absl::OkStatus();
  }
  absl::StatusOr<int> NumUnits(const ModelSpec& spec) const override {
    ASSIGN_OR_RETURN(const ScriptedModel m, Manifest(spec));
    return m.units_size();
  }
  absl::StatusOr<std::vector<std::vector<int64_t>>> UnitOutputShapes(
      const ModelSpec& spec) const override {
    ASSIGN_OR_RETURN(const ScriptedModel m, Manifest(spec));
    std::vector<std::vector<int64_t>> out;
    for (const auto& u : m.units()) {
      out.emplace_back(u.output_shape().begin(), u.output_shape().end());
    }
    return out;
  }
  absl::StatusOr<std::vector<Unit>> Units(
      const ModelSpec& spec, const DataShape& data,
      const std::vector<bool>& wanted) const override {
    ASSIGN_OR_RETURN(const ScriptedModel m, Manifest(spec));
    RETURN_IF_ERROR(CheckModelShape(m, data));
    std::vector<Unit> units;
    for (int u = 0; u < m.units_size(); ++u) {
      const auto& declared = m.units(u);
      Unit unit{nn::AnyModule(AbsentUnit(u)), ShapeOf(declared.output_shape())};
      if (wanted[u]) {
        const std::string what = absl::StrCat(
            "unit ", u, " (", declared.name().empty() ? "?" : declared.name(),
            ", ", declared.file(), ")");
        ASSIGN_OR_RETURN(auto bytes,
                         FileBytes(spec, declared.file(), declared.sha256()));
        ASSIGN_OR_RETURN(torch::jit::Module module, LoadModule(*bytes, what));
        ScriptedUnit adapter(std::move(module));
        const auto& in =
            u == 0 ? m.input_shape() : m.units(u - 1).output_shape();
        RETURN_IF_ERROR(
            CheckUnit(adapter,
                      ZeroSample(std::vector<int64_t>(in.begin(), in.end()),
                                 u == 0 && m.input_dtype() == "int64"),
                      std::vector<int64_t>(declared.output_shape().begin(),
                                           declared.output_shape().end()),
                      what));
        unit.module = nn::AnyModule(adapter);
      }
      units.push_back(std::move(unit));
    }
    return units;
  }
  bool HasUserHead(const ModelSpec& spec, int unit) const override {
    auto m = Manifest(spec);
    if (!m.ok()) return false;
    for (const auto& h : m->heads()) {
      if (h.after_unit() == unit) return true;
    }
    return false;
  }
  absl::StatusOr<nn::Sequential> UserHead(const ModelSpec& spec,
                                          int unit) const override {
    ASSIGN_OR_RETURN(const ScriptedModel m, Manifest(spec));
    for (const auto& h : m.heads()) {
      if (h.after_unit() != unit) continue;
      const std::string what =
          absl::StrCat("the head after unit ", unit, " (", h.file(), ")");
      ASSIGN_OR_RETURN(auto bytes, FileBytes(spec, h.file(), h.sha256()));
      ASSIGN_OR_RETURN(torch::jit::Module module, LoadModule(*bytes, what));
      ScriptedUnit adapter(std::move(module));
      const auto& in = m.units(unit).output_shape();
      std::vector<int64_t> logits;
      if (m.loss() == ScriptedModel::TOKENS) logits.push_back(in[0]);
      logits.push_back(m.classes());
      RETURN_IF_ERROR(CheckUnit(
          adapter,
          ZeroSample(std::vector<int64_t>(in.begin(), in.end()), false), logits,
          what));
      return nn::Sequential(adapter);
    }
    return absl::NotFoundError(
        absl::StrCat("model.scripted: no head after unit ", unit));
  }
  int64_t TextContext(const ModelSpec& spec) const override {
    auto m = Manifest(spec);
    if (!m.ok() || m->input_dtype() != "int64") return 1;
    return m->input_shape(0);
  }
  absl::Status CheckData(const ModelSpec& spec,
                         interlock::v1::DataSpec::Kind kind) const override {
    ASSIGN_OR_RETURN(const ScriptedModel m, Manifest(spec));
    const bool text = IsTextKind(kind);
    if (text != (m.loss() == ScriptedModel::TOKENS)) {
      return absl::InvalidArgumentError(
          absl::StrCat("data.kind: the scripted model's loss is ",
                       ScriptedModel::Loss_Name(m.loss()), ", which needs ",
                       text ? "class-labelled (not text) data"
                            : "TEXT, SYNTHETIC_TEXT or TOKEN_FILE data"));
    }
    return absl::OkStatus();
  }

 private:
  static absl::Status CheckModelShape(const ScriptedModel& m,
                                      const DataShape& data) {
    std::vector<int64_t> sample;
    if (data.is_text) {
      sample = {data.context};
    } else if (data.is_vector) {
      sample = {data.channels};
    } else {
      sample = {data.channels, data.height, data.width};
    }
    if (c10::IntArrayRef(sample) !=
        c10::IntArrayRef(m.input_shape().data(), m.input_shape_size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model.scripted: the model takes samples of ", Shape(m.input_shape()),
          " but the data gives ", Shape(sample)));
    }
    if (data.classes != m.classes()) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.scripted: the model has ", m.classes(),
                       " classes but the data has ", data.classes));
    }
    return absl::OkStatus();
  }
};

}  // namespace

const Family& ScriptedFamily() {
  static const Scripted* family = new Scripted;
  return *family;
}

}  // namespace models_internal

absl::StatusOr<std::vector<ScriptedFile>> ScriptedFilesOfBlock(
    const interlock::v1::ModelSpec& spec, int block) {
  if (!spec.has_scripted()) return std::vector<ScriptedFile>{};
  const interlock::v1::ScriptedModel& m = spec.scripted().model();
  if (m.units_size() == 0) {
    return absl::FailedPreconditionError(
        "model.scripted: the spec is not resolved (ResolveModelSpec)");
  }
  ASSIGN_OR_RETURN(
      const std::vector<int> counts,
      ParsePartition(spec.partition(), m.units_size(), spec.blocks()));
  if (block < 0 || block >= static_cast<int>(counts.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", block, " outside [0, ", counts.size(), ")"));
  }
  int first = 0;
  for (int k = 0; k < block; ++k) first += counts[k];
  const int last = first + counts[block] - 1;
  std::vector<std::pair<std::string, std::string>> wanted;
  for (int u = first; u <= last; ++u) {
    wanted.emplace_back(m.units(u).file(), m.units(u).sha256());
  }
  if (block + 1 < static_cast<int>(counts.size())) {
    for (const auto& h : m.heads()) {
      if (h.after_unit() == last) wanted.emplace_back(h.file(), h.sha256());
    }
  }
  std::vector<ScriptedFile> files;
  for (const auto& [name, sha] : wanted) {
    ASSIGN_OR_RETURN(auto bytes, models_internal::FileBytes(spec, name, sha));
    files.push_back({name, sha, *bytes});
  }
  return files;
}

namespace {

absl::Status CheckHash(const ScriptedFile& f) {
  if (Sha256Hex(f.bytes.data(), f.bytes.size()) != f.sha256) {
    return absl::InvalidArgumentError(absl::StrCat("model file ", f.name,
                                                   ": its bytes do not match ",
                                                   "its SHA-256 ", f.sha256));
  }
  return absl::OkStatus();
}

}  // namespace

bool HoldsScriptedFile(const std::string& sha256) {
  auto& held = models_internal::HeldFiles();
  std::lock_guard<std::mutex> l(held.mu);
  return held.by_sha.count(sha256) > 0;
}

absl::Status StageScriptedFile(ScriptedFile file, int64_t max_bytes) {
  RETURN_IF_ERROR(CheckHash(file));
  const int64_t size = static_cast<int64_t>(file.bytes.size());
  auto& held = models_internal::HeldFiles();
  std::lock_guard<std::mutex> l(held.mu);
  if (held.by_sha.count(file.sha256)) return absl::OkStatus();
  while (held.bytes + size > max_bytes && !held.staged.empty()) {
    auto it = held.by_sha.find(held.staged.front());
    held.bytes -= static_cast<int64_t>(it->second->size());
    held.by_sha.erase(it);
    held.staged.erase(held.staged.begin());
  }
  if (held.bytes + size > max_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("model file ", file.name, ": ", size, " bytes, with the ",
                     held.bytes, " this worker holds more than the ", max_bytes,
                     " it accepts (--max_model_bytes)"));
  }
  held.bytes += size;
  held.staged.push_back(file.sha256);
  held.by_sha[file.sha256] =
      std::make_shared<const std::string>(std::move(file.bytes));
  return absl::OkStatus();
}

absl::Status HoldScriptedFiles(std::vector<ScriptedFile> files,
                               int64_t max_bytes) {
  auto& held = models_internal::HeldFiles();
  std::lock_guard<std::mutex> l(held.mu);
  std::map<std::string, std::shared_ptr<const std::string>> kept;
  int64_t total = 0;
  for (auto& f : files) {
    std::shared_ptr<const std::string> bytes;
    if (!f.bytes.empty()) {
      RETURN_IF_ERROR(CheckHash(f));
      bytes = std::make_shared<const std::string>(std::move(f.bytes));
    } else if (auto it = held.by_sha.find(f.sha256); it != held.by_sha.end()) {
      bytes = it->second;
    } else {
      return absl::FailedPreconditionError(
          absl::StrCat("model file ", f.name, " (SHA-256 ", f.sha256,
                       ") was not sent to this worker before Configure"));
    }
    if (!kept.count(f.sha256)) total += static_cast<int64_t>(bytes->size());
    kept[f.sha256] = std::move(bytes);
  }
  if (total > max_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("model files: ", total, " bytes, more than the ",
                     max_bytes, " this worker accepts"));
  }
  held.by_sha = std::move(kept);
  held.staged.clear();
  held.bytes = total;
  return absl::OkStatus();
}

namespace {

// The TorchScript module under a scripted unit (null for any other module).
const torch::jit::Module* ScriptOf(
    const std::shared_ptr<torch::nn::Module>& m) {
  auto unit = std::dynamic_pointer_cast<models_internal::ScriptedUnitImpl>(m);
  return unit ? &unit->module : nullptr;
}

// One TorchScript module running `parts` in order, in eval mode, carrying
// `info` (NetworkInfo).
torch::jit::Module Chain(const std::vector<torch::jit::Module>& parts,
                         const NetworkInfo& info) {
  torch::jit::Module net(c10::QualifiedName("__torch__.interlock.Network"));
  net.register_attribute("input_shape", c10::ListType::ofInts(),
                         c10::List<int64_t>(info.input_shape));
  net.register_attribute("input_dtype", c10::StringType::get(),
                         info.input_dtype);
  net.register_attribute("class_names", c10::ListType::ofStrings(),
                         c10::List<std::string>(info.class_names));
  net.register_attribute("language_model", c10::BoolType::get(),
                         info.language_model);
  const bool normalise = !info.mean.empty();
  net.register_attribute("normalise", c10::BoolType::get(), normalise);
  // As training prepared the bytes (services/data_images.cc): float32
  // values of the double constants.
  const int64_t c = static_cast<int64_t>(info.mean.size());
  net.register_buffer("mean", torch::tensor(info.mean, torch::kDouble)
                                  .to(torch::kFloat)
                                  .view({c, 1, 1}));
  net.register_buffer("std", torch::tensor(info.std, torch::kDouble)
                                 .to(torch::kFloat)
                                 .view({c, 1, 1}));
  std::string source = "def forward(self, x):\n";
  if (normalise)
    absl::StrAppend(&source, "    x = (x - self.mean) / self.std\n");
  for (size_t i = 0; i < parts.size(); ++i) {
    net.register_module(absl::StrCat("part", i), parts[i].deepcopy());
    // Module::define does not call a submodule itself: name its forward.
    absl::StrAppend(&source, "    x = self.part", i, ".forward(x)\n");
  }
  absl::StrAppend(&source, "    return x\n");
  net.define(source);
  net.eval();
  return net;
}

}  // namespace

absl::StatusOr<std::vector<std::pair<std::string, int>>> WriteScriptedNetworks(
    const std::vector<BlockModules>& blocks, const NetworkInfo& info,
    const std::string& dir) {
  if (info.mean.size() != info.std.size()) {
    return absl::InvalidArgumentError("export: mean and std differ in length");
  }
  try {
    std::vector<std::pair<std::string, int>> written;
    std::vector<torch::jit::Module> chain;
    std::vector<std::pair<int, torch::jit::Module>> exits;
    for (size_t k = 0; k < blocks.size(); ++k) {
      for (const auto& child : blocks[k].block->children()) {
        const torch::jit::Module* unit = ScriptOf(child);
        if (unit == nullptr) {
          return absl::FailedPreconditionError(absl::StrCat(
              "block ", k, " holds a unit that is not TorchScript"));
        }
        chain.push_back(*unit);
      }
      if (k + 1 == blocks.size() || !blocks[k].head) continue;
      const auto children = blocks[k].head->children();
      const torch::jit::Module* head =
          children.size() == 1 ? ScriptOf(children[0]) : nullptr;
      if (head == nullptr) continue;  // built from model.head
      std::vector<torch::jit::Module> exit = chain;
      exit.push_back(*head);
      exits.emplace_back(static_cast<int>(k), Chain(exit, info));
    }
    Chain(chain, info).save(dir + "/network.pt");
    written.emplace_back("network.pt", -1);
    for (auto& [k, net] : exits) {
      const std::string name = absl::StrCat("exit_", k, ".pt");
      net.save(dir + "/" + name);
      written.emplace_back(name, k);
    }
    return written;
  } catch (const std::exception& e) {
    return absl::InternalError(
        absl::StrCat("writing TorchScript to ", dir, ": ",
                     models_internal::FirstLine(e.what())));
  }
}

}  // namespace interlock
