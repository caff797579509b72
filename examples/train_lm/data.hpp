// The training text: loaded whole, split into train (the first 90% of the bytes) and validation
// (the rest), and cut into batches of (context, target) pairs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "rng.hpp"

namespace train_lm {

struct TokenBatch {
  std::vector<std::uint8_t> contexts;  // token_count rows of context_bytes bytes
  std::vector<std::uint8_t> targets;   // token_count bytes
  std::size_t token_count() const { return targets.size(); }
};

class Corpus {
 public:
  // Reads `path` whole. On failure returns false and sets `error` to one line naming the path.
  bool load(const std::string& path, std::string* error);
  // Uses `text` as the corpus (tests).
  void assign(std::string text);

  const std::string& text() const { return text_; }
  // Validation starts at 90% of the text.
  std::size_t split_offset() const { return text_.size() - text_.size() / 10; }

  // `sequences` windows of `sequence_bytes` consecutive targets, each at a start drawn from
  // `rng` in the train split; every target has its `context_bytes` bytes before it, also in the
  // train split.
  // REQUIRES: the train split is longer than context_bytes + sequence_bytes.
  void sample_train(Rng& rng, std::size_t sequences, std::size_t sequence_bytes,
                    std::size_t context_bytes, TokenBatch* batch) const;

  // `token_count` targets spread evenly over the validation split (the same every call), each
  // with the context_bytes bytes before it (which may reach back into the train split).
  void validation_batch(std::size_t token_count, std::size_t context_bytes,
                        TokenBatch* batch) const;

 private:
  void append(std::size_t target_offset, std::size_t context_bytes, TokenBatch* batch) const;
  std::string text_;
};

}  // namespace train_lm
