#include "rpc/state_chunks.h"

#include <algorithm>
#include <exception>

#include "absl/strings/str_cat.h"

namespace interlock {

StateChunker::StateChunker(const BlockStateArchive* header,
                           const std::string* bytes, int64_t chunk_bytes)
    : state_(header),
      bytes_(bytes),
      chunk_bytes_(std::clamp<int64_t>(chunk_bytes, 1, kMaxStateChunkBytes)) {}

bool StateChunker::Next(v1::StateChunk* chunk) {
  const int64_t size = static_cast<int64_t>(bytes_->size());
  if (started_ && offset_ >= size) return false;
  chunk->Clear();
  if (!started_) {
    started_ = true;
    chunk->set_run_id(state_->run_id);
    chunk->set_generation(state_->generation);
    chunk->set_block(state_->block);
    chunk->set_step(state_->step);
    chunk->set_total_bytes(size);
    chunk->set_sha256(state_->sha256);
  }
  const int64_t n = std::min(chunk_bytes_, size - offset_);
  chunk->set_data(bytes_->substr(offset_, n));
  offset_ += n;
  return true;
}

void StateAssembler::Start(const v1::StateChunk& first) {
  started_ = true;
  total_ = first.total_bytes();
  state_.run_id = first.run_id();
  state_.generation = first.generation();
  state_.block = first.block();
  state_.step = first.step();
  state_.sha256 = first.sha256();
}

absl::Status StateAssembler::Reserve() {
  try {
    state_.bytes.reserve(total_);
  } catch (const std::exception&) {  // bad_alloc, length_error
    return absl::ResourceExhaustedError(
        absl::StrCat(what_, ": cannot reserve the ", total_,
                     " bytes announced (out of memory)"));
  }
  return absl::OkStatus();
}

absl::Status StateAssembler::Append(const v1::StateChunk& chunk) {
  if (static_cast<int64_t>(state_.bytes.size() + chunk.data().size()) >
      total_) {
    return absl::InvalidArgumentError(
        absl::StrCat(what_, ": more than the ", total_, " bytes announced"));
  }
  try {
    state_.bytes.append(chunk.data());
  } catch (const std::exception&) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what_, ": out of memory buffering the state"));
  }
  return absl::OkStatus();
}

absl::StatusOr<BlockStateArchive> StateAssembler::Finish() {
  if (!started_) {
    return absl::InvalidArgumentError(
        absl::StrCat(what_, ": no state received"));
  }
  if (static_cast<int64_t>(state_.bytes.size()) != total_) {
    return absl::DataLossError(
        absl::StrCat(what_, ": received ", state_.bytes.size(),
                     " bytes of the ", total_, " announced"));
  }
  return std::move(state_);
}

void StateAssembler::Release() { std::string().swap(state_.bytes); }

}  // namespace interlock
