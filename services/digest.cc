#include "services/digest.h"

#include <openssl/evp.h>

#include <memory>

#include "absl/strings/str_cat.h"

namespace interlock {
namespace {

struct Hasher {
  Hasher() : ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free) {
    EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr);
  }
  void Update(const void* data, size_t size) {
    EVP_DigestUpdate(ctx.get(), data, size);
  }
  std::string Hex() {
    unsigned char out[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    EVP_DigestFinal_ex(ctx.get(), out, &len);
    static const char* kHex = "0123456789abcdef";
    std::string s;
    for (unsigned int i = 0; i < len; ++i) {
      s.push_back(kHex[out[i] >> 4]);
      s.push_back(kHex[out[i] & 15]);
    }
    return s;
  }
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx;
};

}  // namespace

std::string Sha256Hex(const void* data, size_t size) {
  Hasher h;
  h.Update(data, size);
  return h.Hex();
}

std::string DigestTensors(
    const std::vector<std::pair<std::string, torch::Tensor>>& named) {
  Hasher h;
  for (const auto& [name, tensor] : named) {
    const torch::Tensor t = tensor.detach().contiguous().cpu();
    const std::string header =
        absl::StrCat(name, "|", c10::toString(t.scalar_type()), "|",
                     c10::str(t.sizes()), "|");
    h.Update(header.data(), header.size());
    h.Update(t.data_ptr(), t.numel() * t.element_size());
  }
  return h.Hex();
}

}  // namespace interlock
