// Image folders (DataSpec IMAGE_FOLDER), torchvision's ImageFolder layout:
// ROOT/train/CLASS/*.png|*.jpg|*.jpeg and ROOT/test/CLASS/..., decoded with
// libpng and libjpeg(-turbo) at load, converted to the configured [C, H, W]
// and held in memory as bytes; a batch is scaled to [0, 1].
//
// Both libraries report errors by longjmp: each decoder keeps everything that
// changes after its setjmp in a struct the caller owns, and only C frames
// (the library's) lie between setjmp and longjmp.
#include <png.h>
// jpeglib.h needs FILE and size_t declared before it.
// clang-format off
#include <stdio.h>
#include <jpeglib.h>
#include <jerror.h>
// clang-format on

#include <algorithm>
#include <cmath>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "plan/status_macros.h"
#include "services/data.h"
#include "services/data_info.h"
#include "services/data_internal.h"

namespace interlock {
namespace data_internal {
namespace {

namespace fs = std::filesystem;
using v1::DataSpec;

// Images with more pixels than this are refused rather than decoded (a
// corrupt or hostile header could ask for any size).
constexpr int64_t kMaxPixels = int64_t{1} << 28;
// Largest side of the configured shape.
constexpr int64_t kMaxSide = 1 << 14;

// 8-bit pixels, rows top to bottom, channels interleaved: 1 (grey) or 3 (RGB).
struct Image {
  int64_t width = 0;
  int64_t height = 0;
  int channels = 0;
  std::vector<unsigned char> pixels;
};

// ---------------------------------------------------------------- PNG

struct PngState {
  const std::string* bytes = nullptr;
  size_t pos = 0;
  std::string error;
  std::vector<png_bytep> rows;
  Image* image = nullptr;
};

void PngError(png_structp png, png_const_charp message) {
  auto* state = static_cast<PngState*>(png_get_error_ptr(png));
  state->error = message != nullptr ? message : "unknown error";
  png_longjmp(png, 1);
}

void PngWarning(png_structp, png_const_charp) {}

void PngRead(png_structp png, png_bytep out, size_t length) {
  auto* state = static_cast<PngState*>(png_get_io_ptr(png));
  if (state->bytes->size() - state->pos < length) {
    png_error(png, "file ends early (truncated)");
  }
  std::memcpy(out, state->bytes->data() + state->pos, length);
  state->pos += length;
}

// Decodes to 8-bit grey or RGB: palettes expanded, 16-bit samples cut to
// their high byte, alpha and transparency dropped (as PIL's convert does).
bool DecodePngInto(PngState* state) {
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, state,
                                           PngError, PngWarning);
  if (png == nullptr) {
    state->error = "cannot create a libpng reader";
    return false;
  }
  png_infop info = png_create_info_struct(png);
  if (info == nullptr) {
    png_destroy_read_struct(&png, nullptr, nullptr);
    state->error = "cannot create a libpng reader";
    return false;
  }
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_read_struct(&png, &info, nullptr);
    return false;
  }
  png_set_read_fn(png, state, PngRead);
  png_read_info(png, info);
  const png_uint_32 width = png_get_image_width(png, info);
  const png_uint_32 height = png_get_image_height(png, info);
  if (static_cast<int64_t>(width) * height > kMaxPixels) {
    png_error(png, "image too large");
  }
  const int color = png_get_color_type(png, info);
  if (png_get_bit_depth(png, info) == 16) png_set_strip_16(png);
  if (color == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(png);
  if (color == PNG_COLOR_TYPE_GRAY && png_get_bit_depth(png, info) < 8) {
    png_set_expand_gray_1_2_4_to_8(png);
  }
  // Expanding a palette turns its tRNS chunk into alpha; drop that too.
  if ((color & PNG_COLOR_MASK_ALPHA) ||
      png_get_valid(png, info, PNG_INFO_tRNS)) {
    png_set_strip_alpha(png);
  }
  png_set_interlace_handling(png);
  png_read_update_info(png, info);
  const int channels = png_get_channels(png, info);
  if (channels != 1 && channels != 3) png_error(png, "unexpected channels");
  Image* image = state->image;
  image->width = width;
  image->height = height;
  image->channels = channels;
  const size_t row_bytes = png_get_rowbytes(png, info);
  image->pixels.resize(row_bytes * height);
  state->rows.resize(height);
  for (png_uint_32 y = 0; y < height; ++y) {
    state->rows[y] = image->pixels.data() + y * row_bytes;
  }
  png_read_image(png, state->rows.data());
  png_read_end(png, nullptr);
  png_destroy_read_struct(&png, &info, nullptr);
  return true;
}

// ---------------------------------------------------------------- JPEG

struct JpegError {
  jpeg_error_mgr mgr;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
  bool truncated;
};

void JpegExit(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<JpegError*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, err->message);
  std::longjmp(err->jump, 1);
}

// Warnings are silent, but a file that ends early is an error (libjpeg
// would fill the rest with grey).
void JpegMessage(j_common_ptr cinfo, int level) {
  auto* err = reinterpret_cast<JpegError*>(cinfo->err);
  if (level < 0 && cinfo->err->msg_code == JWRN_JPEG_EOF) err->truncated = true;
}

struct JpegState {
  jpeg_decompress_struct cinfo;
  JpegError err;
  std::vector<JSAMPROW> rows;
  Image* image = nullptr;
};

bool DecodeJpegInto(const std::string& bytes, JpegState* state,
                    std::string* error) {
  jpeg_decompress_struct* cinfo = &state->cinfo;
  cinfo->err = jpeg_std_error(&state->err.mgr);
  state->err.mgr.error_exit = JpegExit;
  state->err.mgr.emit_message = JpegMessage;
  state->err.truncated = false;
  state->err.message[0] = '\0';
  if (setjmp(state->err.jump)) {
    jpeg_destroy_decompress(cinfo);
    *error = state->err.message;
    return false;
  }
  jpeg_create_decompress(cinfo);
  jpeg_mem_src(cinfo, reinterpret_cast<const unsigned char*>(bytes.data()),
               static_cast<unsigned long>(bytes.size()));
  jpeg_read_header(cinfo, TRUE);
  if (cinfo->num_components == 1) {
    cinfo->out_color_space = JCS_GRAYSCALE;
  } else if (cinfo->jpeg_color_space == JCS_YCbCr ||
             cinfo->jpeg_color_space == JCS_RGB) {
    cinfo->out_color_space = JCS_RGB;
  } else {
    jpeg_destroy_decompress(cinfo);
    *error = "CMYK / YCCK JPEGs are not taken (save it as RGB)";
    return false;
  }
  jpeg_start_decompress(cinfo);
  const int64_t width = cinfo->output_width;
  const int64_t height = cinfo->output_height;
  if (width * height > kMaxPixels) {
    jpeg_destroy_decompress(cinfo);
    *error = "image too large";
    return false;
  }
  Image* image = state->image;
  image->width = width;
  image->height = height;
  image->channels = cinfo->output_components;
  const size_t row_bytes = static_cast<size_t>(width) * image->channels;
  image->pixels.resize(row_bytes * height);
  while (cinfo->output_scanline < cinfo->output_height) {
    JSAMPROW row = image->pixels.data() + cinfo->output_scanline * row_bytes;
    jpeg_read_scanlines(cinfo, &row, 1);
  }
  jpeg_finish_decompress(cinfo);
  jpeg_destroy_decompress(cinfo);
  if (state->err.truncated) {
    *error = "file ends early (truncated)";
    return false;
  }
  return true;
}

// ---------------------------------------------------------------- Any image

absl::StatusOr<Image> DecodeImage(const std::string& path) {
  ASSIGN_OR_RETURN(std::string bytes, ReadFile(path));
  static constexpr unsigned char kPng[8] = {0x89, 'P',  'N',  'G',
                                            '\r', '\n', 0x1A, '\n'};
  Image image;
  if (bytes.size() >= 8 && std::memcmp(bytes.data(), kPng, 8) == 0) {
    auto state = std::make_unique<PngState>();
    state->bytes = &bytes;
    state->image = &image;
    if (!DecodePngInto(state.get())) {
      return absl::DataLossError(
          absl::StrCat(path, ": cannot decode PNG: ", state->error));
    }
  } else if (bytes.size() >= 3 &&
             static_cast<unsigned char>(bytes[0]) == 0xFF &&
             static_cast<unsigned char>(bytes[1]) == 0xD8 &&
             static_cast<unsigned char>(bytes[2]) == 0xFF) {
    auto state = std::make_unique<JpegState>();
    state->image = &image;
    std::string error;
    if (!DecodeJpegInto(bytes, state.get(), &error)) {
      return absl::DataLossError(
          absl::StrCat(path, ": cannot decode JPEG: ", error));
    }
  } else {
    return absl::DataLossError(
        absl::StrCat(path, ": not a PNG or JPEG image (unknown signature)"));
  }
  if (image.width == 0 || image.height == 0) {
    return absl::DataLossError(absl::StrCat(path, ": empty image"));
  }
  return image;
}

// Converts to `c` channels as PIL does: grey repeated into RGB; RGB to grey
// by ITU-R 601-2 luma, L = (19595 R + 38470 G + 7471 B + 2^15) >> 16.
void ConvertChannels(Image* image, int c) {
  if (image->channels == c) return;
  const int64_t n = image->width * image->height;
  std::vector<unsigned char> out(static_cast<size_t>(n * c));
  const unsigned char* in = image->pixels.data();
  if (c == 3) {
    for (int64_t i = 0; i < n; ++i)
      out[3 * i] = out[3 * i + 1] = out[3 * i + 2] = in[i];
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t l = 19595u * in[3 * i] + 38470u * in[3 * i + 1] +
                         7471u * in[3 * i + 2] + 0x8000u;
      out[i] = static_cast<unsigned char>(l >> 16);
    }
  }
  image->pixels = std::move(out);
  image->channels = c;
}

// Centre crop to the aspect ratio w:h, then (if the size differs)
// antialiased bilinear resize to [c, h, w], rounded to bytes, into `out`.
void FitImage(const Image& image, int64_t c, int64_t h, int64_t w,
              uint8_t* out) {
  // HWC bytes viewed as [1, C, H, W].
  torch::Tensor t =
      torch::from_blob(const_cast<unsigned char*>(image.pixels.data()),
                       {1, image.height, image.width, c}, torch::kByte)
          .permute({0, 3, 1, 2});
  int64_t crop_h = image.height;
  int64_t crop_w = image.width;
  // Compare image.width / image.height with w / h without rounding.
  if (image.width * h > w * image.height) {
    crop_w = std::max<int64_t>(
        1, std::llround(static_cast<double>(image.height) * w / h));
  } else if (image.width * h < w * image.height) {
    crop_h = std::max<int64_t>(
        1, std::llround(static_cast<double>(image.width) * h / w));
  }
  t = t.narrow(2, (image.height - crop_h) / 2, crop_h)
          .narrow(3, (image.width - crop_w) / 2, crop_w);
  torch::Tensor dest = torch::from_blob(out, {1, c, h, w}, torch::kByte);
  if (crop_h == h && crop_w == w) {
    dest.copy_(t);
    return;
  }
  namespace F = torch::nn::functional;
  const torch::Tensor resized =
      F::interpolate(t.to(torch::kFloat), F::InterpolateFuncOptions()
                                              .size(std::vector<int64_t>{h, w})
                                              .mode(torch::kBilinear)
                                              .align_corners(false)
                                              .antialias(true));
  dest.copy_(resized.round().clamp_(0, 255));
}

bool IsImageName(const std::string& name) {
  const std::string lower = absl::AsciiStrToLower(name);
  for (const char* ext : {".png", ".jpg", ".jpeg"}) {
    const size_t n = std::strlen(ext);
    if (lower.size() > n && lower.compare(lower.size() - n, n, ext) == 0) {
      return true;
    }
  }
  return false;
}

// Sorted names of the entries of `dir` that are folders (want_dirs) or
// image files; names starting with '.' are left out.
absl::StatusOr<std::vector<std::string>> ListEntries(const std::string& dir,
                                                     bool want_dirs) {
  std::vector<std::string> names;
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  const fs::directory_iterator end;
  for (; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.empty() || name[0] == '.') continue;
    std::error_code type_ec;
    if (want_dirs ? it->is_directory(type_ec)
                  : it->is_regular_file(type_ec) && IsImageName(name)) {
      names.push_back(name);
    }
  }
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat(dir, ": cannot list: ", ec.message()));
  }
  std::sort(names.begin(), names.end());
  return names;
}

struct FolderSplit {
  std::vector<std::string> files;
  std::vector<int64_t> labels;
};

absl::StatusOr<FolderSplit> ListSplit(const std::string& dir,
                                      const std::vector<std::string>& classes) {
  FolderSplit s;
  for (size_t k = 0; k < classes.size(); ++k) {
    const std::string class_dir = JoinPath(dir, classes[k]);
    ASSIGN_OR_RETURN(std::vector<std::string> files,
                     ListEntries(class_dir, /*want_dirs=*/false));
    if (files.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          class_dir, ": class folder without images (*.png, *.jpg, *.jpeg)"));
    }
    for (const std::string& f : files) {
      s.files.push_back(JoinPath(class_dir, f));
      s.labels.push_back(static_cast<int64_t>(k));
    }
  }
  return s;
}

// Bytes [N, C, H, W], scaled to [0, 1] per batch.
class ByteImageDataset : public Dataset {
 public:
  ByteImageDataset(torch::Tensor pixels, torch::Tensor targets)
      : pixels_(std::move(pixels)), targets_(std::move(targets)) {}

  int64_t size() const override { return pixels_.size(0); }

  std::pair<torch::Tensor, torch::Tensor> Gather(
      const std::vector<int64_t>& indices) const override {
    const torch::Tensor index =
        torch::from_blob(const_cast<int64_t*>(indices.data()),
                         {static_cast<int64_t>(indices.size())}, torch::kLong);
    return {pixels_.index_select(0, index).to(torch::kFloat).div_(255.0f),
            targets_.index_select(0, index)};
  }

 private:
  torch::Tensor pixels_;
  torch::Tensor targets_;
};

absl::StatusOr<std::unique_ptr<Dataset>> DecodeSplit(const FolderSplit& s,
                                                     int64_t c, int64_t h,
                                                     int64_t w, int64_t cap) {
  const int64_t kept = Capped(static_cast<int64_t>(s.files.size()), cap);
  torch::Tensor pixels = torch::empty({kept, c, h, w}, torch::kByte);
  torch::Tensor targets = torch::empty({kept}, torch::kLong);
  uint8_t* out = pixels.data_ptr<uint8_t>();
  int64_t* labels = targets.data_ptr<int64_t>();
  for (int64_t i = 0; i < kept; ++i) {
    ASSIGN_OR_RETURN(Image image, DecodeImage(s.files[i]));
    ConvertChannels(&image, static_cast<int>(c));
    FitImage(image, c, h, w, out + i * c * h * w);
    labels[i] = s.labels[i];
  }
  return std::unique_ptr<Dataset>(
      new ByteImageDataset(std::move(pixels), std::move(targets)));
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ImageFolderClasses(
    const std::string& root) {
  const std::string train = JoinPath(root, "train");
  RETURN_IF_ERROR(CheckExists(train, /*want_dir=*/true));
  ASSIGN_OR_RETURN(std::vector<std::string> classes,
                   ListEntries(train, /*want_dirs=*/true));
  if (classes.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        train, ": no class folders (expected ", train, "/CLASS/IMAGE files)"));
  }
  return classes;
}

absl::StatusOr<DataSplits> LoadImageFolder(const DataSpec& spec) {
  if (spec.path().empty()) {
    return absl::InvalidArgumentError(
        "IMAGE_FOLDER needs data.path: the folder holding train/ and test/");
  }
  const auto& shape = spec.synthetic_shape();
  if (shape.size() != 3 || (shape[0] != 1 && shape[0] != 3) || shape[1] < 1 ||
      shape[2] < 1 || shape[1] > kMaxSide || shape[2] > kMaxSide) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "IMAGE_FOLDER: synthetic_shape [%s], expected [C, H, W] with C 1 "
        "(grey) or 3 (RGB) and sides in 1..%d",
        absl::StrJoin(shape, ","), kMaxSide));
  }
  const int64_t c = shape[0], h = shape[1], w = shape[2];
  const std::string& root = spec.path();
  RETURN_IF_ERROR(CheckExists(root, /*want_dir=*/true));
  ASSIGN_OR_RETURN(std::vector<std::string> classes, ImageFolderClasses(root));
  const std::string test_dir = JoinPath(root, "test");
  RETURN_IF_ERROR(CheckExists(test_dir, /*want_dir=*/true));
  ASSIGN_OR_RETURN(std::vector<std::string> test_classes,
                   ListEntries(test_dir, /*want_dirs=*/true));
  if (test_classes != classes) {
    return absl::InvalidArgumentError(absl::StrCat(
        test_dir, ": class folders [", absl::StrJoin(test_classes, ", "),
        "], expected those of ", JoinPath(root, "train"), ": [",
        absl::StrJoin(classes, ", "), "]"));
  }
  if (spec.synthetic_classes() != 0 &&
      spec.synthetic_classes() != static_cast<int64_t>(classes.size())) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "IMAGE_FOLDER: synthetic_classes %d, but %s has %d class folders",
        spec.synthetic_classes(), JoinPath(root, "train"), classes.size()));
  }
  ASSIGN_OR_RETURN(FolderSplit train,
                   ListSplit(JoinPath(root, "train"), classes));
  ASSIGN_OR_RETURN(FolderSplit test, ListSplit(test_dir, classes));

  DataSplits splits;
  splits.shape.channels = c;
  splits.shape.height = h;
  splits.shape.width = w;
  splits.shape.classes = static_cast<int64_t>(classes.size());
  ASSIGN_OR_RETURN(splits.train, DecodeSplit(train, c, h, w, spec.max_train()));
  ASSIGN_OR_RETURN(splits.test, DecodeSplit(test, c, h, w, spec.max_test()));
  return splits;
}

}  // namespace data_internal

absl::StatusOr<torch::Tensor> ReadInputs(const std::string& path,
                                         const v1::DataSpec& spec,
                                         const DataShape& shape,
                                         std::vector<std::string>* names) {
  using namespace data_internal;  // NOLINT
  if (shape.is_text) {
    return absl::InvalidArgumentError(
        "inputs from a file are for classifiers, not language models");
  }
  std::vector<int64_t> sample = {shape.channels};
  if (!shape.is_vector) {
    sample.push_back(shape.height);
    sample.push_back(shape.width);
  }
  std::error_code ec;
  const bool dir = fs::is_directory(path, ec);
  torch::Tensor x;
  names->clear();
  if (!dir && absl::EndsWith(absl::AsciiStrToLower(path), ".npy")) {
    ASSIGN_OR_RETURN(x, ReadNpyInputs(path, sample));
    for (int64_t i = 0; i < x.size(0); ++i) {
      names->push_back(absl::StrCat(path, "[", i, "]"));
    }
  } else {
    std::vector<std::string> files;
    if (dir) {
      ASSIGN_OR_RETURN(std::vector<std::string> listed,
                       ListEntries(path, /*want_dirs=*/false));
      if (listed.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": no .png, .jpg or .jpeg files"));
      }
      for (const auto& name : listed) files.push_back(JoinPath(path, name));
    } else if (IsImageName(path)) {
      RETURN_IF_ERROR(CheckExists(path, /*want_dir=*/false));
      files.push_back(path);
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          path,
          ": expected a .npy file, an image (.png, .jpg, .jpeg) or a "
          "folder of images"));
    }
    if (shape.is_vector || (shape.channels != 1 && shape.channels != 3)) {
      return absl::InvalidArgumentError(absl::StrCat(
          path,
          ": images need a model of grey or RGB images; this one takes "
          "[",
          absl::StrJoin(sample, ", "), "]"));
    }
    const int64_t c = shape.channels, h = shape.height, w = shape.width;
    torch::Tensor pixels = torch::empty(
        {static_cast<int64_t>(files.size()), c, h, w}, torch::kByte);
    for (size_t i = 0; i < files.size(); ++i) {
      ASSIGN_OR_RETURN(Image image, DecodeImage(files[i]));
      ConvertChannels(&image, static_cast<int>(c));
      FitImage(image, c, h, w, pixels.data_ptr<uint8_t>() + i * c * h * w);
      names->push_back(fs::path(files[i]).filename().string());
    }
    x = pixels.to(torch::kFloat).div_(255.0f);
  }
  const DataInfo info = DataInfoOf(spec);
  if (!info.mean.empty()) {
    // As the data set's loader prepares its bytes (data_images.cc).
    const int64_t c = static_cast<int64_t>(info.mean.size());
    const torch::Tensor m = torch::tensor(info.mean, torch::kDouble)
                                .to(torch::kFloat)
                                .view({1, c, 1, 1});
    const torch::Tensor sd = torch::tensor(info.std, torch::kDouble)
                                 .to(torch::kFloat)
                                 .view({1, c, 1, 1});
    x = x.sub_(m).div_(sd);
  }
  return x;
}

}  // namespace interlock
