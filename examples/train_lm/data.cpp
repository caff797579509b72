#include "data.hpp"

#include <algorithm>
#include <cassert>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

namespace train_lm {

bool Corpus::load(const std::string& path, std::string* error) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    *error = "cannot read data file " + path + ": " + std::strerror(errno);
    return false;
  }
  std::ostringstream contents;
  contents << file.rdbuf();
  text_ = std::move(contents).str();
  if (text_.size() < 4096) {
    *error = "data file " + path + " holds " + std::to_string(text_.size()) +
             " bytes; it needs at least 4096";
    return false;
  }
  return true;
}

void Corpus::assign(std::string text) { text_ = std::move(text); }

void Corpus::append(std::size_t target_offset, std::size_t context_bytes, TokenBatch* batch) const {
  assert(target_offset >= context_bytes && target_offset < text_.size());
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(text_.data());
  batch->contexts.insert(batch->contexts.end(), bytes + target_offset - context_bytes,
                         bytes + target_offset);
  batch->targets.push_back(bytes[target_offset]);
}

void Corpus::sample_train(Rng& rng, std::size_t sequences, std::size_t sequence_bytes,
                          std::size_t context_bytes, TokenBatch* batch) const {
  const std::size_t train_bytes = split_offset();
  assert(train_bytes > context_bytes + sequence_bytes);
  batch->contexts.clear();
  batch->targets.clear();
  const std::size_t starts = train_bytes - context_bytes - sequence_bytes + 1;
  for (std::size_t s = 0; s < sequences; ++s) {
    const std::size_t first = context_bytes + rng.below(starts);
    for (std::size_t t = 0; t < sequence_bytes; ++t) append(first + t, context_bytes, batch);
  }
}

void Corpus::validation_batch(std::size_t token_count, std::size_t context_bytes,
                              TokenBatch* batch) const {
  batch->contexts.clear();
  batch->targets.clear();
  const std::size_t begin = split_offset();
  const std::size_t span = text_.size() - begin;
  // Runs of 64 consecutive targets at evenly spaced starts: contiguous text, as in training.
  constexpr std::size_t kRun = 64;
  const std::size_t runs = (token_count + kRun - 1) / kRun;
  for (std::size_t r = 0; r < runs; ++r) {
    const std::size_t start = begin + (span - kRun) * r / runs;
    for (std::size_t t = 0; t < kRun && batch->token_count() < token_count; ++t) {
      append(std::max(start + t, context_bytes), context_bytes, batch);
    }
  }
}

}  // namespace train_lm
