// The CLIP byte-level BPE tokenizer of SDXL's two text encoders, read from a
// diffusers pipeline's tokenizer/ or tokenizer_2/ folder. No LibTorch.
//
// It gives the ids of transformers' CLIPTokenizer as SDXL pipelines call it
// (padding="max_length", max_length=model_max_length, truncation=True). Since
// transformers 5 that class is the one backed by the `tokenizers` library (the
// former CLIPTokenizerFast); docs/text-and-images.md lists the steps and how
// they differ from transformers 4's pure-Python class.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace sdxl {

/// One prompt, ready for a CLIP text encoder: max_length() ids (start token,
/// the prompt's tokens truncated to max_length() - 2, end token, then the pad
/// token) and the mask that is 1 up to and including the end token, 0 after.
struct ClipEncoding {
  std::vector<int64_t> input_ids;
  std::vector<int64_t> attention_mask;
};

/// A token matched whole in the text before BPE (the special tokens): its id
/// and whether it is matched after normalisation (lower-casing) or before.
struct ClipSpecialToken {
  std::string content;
  int64_t id = 0;
  bool normalized = false;
};

class ClipTokenizer {
 public:
  /// Reads `folder`/vocab.json, merges.txt and tokenizer_config.json, and
  /// special_tokens_map.json when present. Throws zero::IoError naming the file
  /// and what was expected when one is missing, too large or malformed, or
  /// names a special token that is not in the vocabulary.
  static ClipTokenizer load(const std::filesystem::path& folder);

  /// Tokenizes, truncates and pads one prompt (UTF-8). Throws
  /// zero::InvalidArgument when `prompt` is not valid UTF-8. Thread-safe.
  ClipEncoding encode(std::string_view prompt) const;

  /// The prompt's token ids alone: no start/end tokens, no truncation.
  std::vector<int64_t> token_ids(std::string_view prompt) const;

  std::size_t max_length() const { return max_length_; }
  int64_t bos_id() const { return bos_id_; }
  int64_t eos_id() const { return eos_id_; }
  int64_t pad_id() const { return pad_id_; }
  const std::string& pad_token() const { return pad_token_; }
  std::size_t vocab_size() const { return vocab_size_; }
  const std::vector<ClipSpecialToken>& special_tokens() const { return special_tokens_; }

  ClipTokenizer(ClipTokenizer&&) noexcept;
  ClipTokenizer& operator=(ClipTokenizer&&) noexcept;
  ~ClipTokenizer();

 private:
  struct Impl;
  ClipTokenizer();
  void append_word_ids(std::string_view word, std::vector<int64_t>& ids) const;
  void append_normalized_piece_ids(std::string_view normalized, std::vector<int64_t>& ids) const;

  std::unique_ptr<Impl> impl_;
  std::size_t max_length_ = 0;
  int64_t bos_id_ = 0;
  int64_t eos_id_ = 0;
  int64_t pad_id_ = 0;
  int64_t unk_id_ = 0;
  std::string pad_token_;
  std::size_t vocab_size_ = 0;
  std::vector<ClipSpecialToken> special_tokens_;
};

}  // namespace sdxl
