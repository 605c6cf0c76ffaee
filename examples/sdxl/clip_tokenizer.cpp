// CLIP tokenizer: the steps of transformers 5's CLIPTokenizer (a `tokenizers`
// pipeline), one function each, in the order they run:
//   1. split out the special tokens declared "not normalized", on the raw text;
//   2. normalise each remaining piece: NFC, every run of Unicode White_Space
//      becomes one space, each character lower-cased on its own;
//   3. split out the special tokens declared "normalized", on the normalised text;
//   4. pre-tokenize with CLIP's pattern (contractions, letter runs, single
//      digits, runs of anything else; whitespace dropped), then GPT-2's pattern
//      (the byte-level step's own split, which only splits "<|endoftext|>"-like
//      pieces further);
//   5. map each piece's UTF-8 bytes to the printable byte alphabet, add "</w>"
//      to its last symbol and apply the BPE merges by rank;
//   6. truncate to max_length - 2, add start and end tokens, pad.
// Unicode properties (categories, simple lower-case mapping, NFC) come from
// utf8proc. docs/text-and-images.md says why each rule is what it is.
#include "clip_tokenizer.hpp"

#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <unordered_map>

#include "zero/core/error.hpp"
#include "zero/io/json_limits.hpp"

namespace sdxl {
namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;

// Bounds on the files, well above the real ones (CLIP's vocab.json is about
// 1.6 MB with 49408 entries, its merges.txt about 0.5 MB).
constexpr std::size_t kMaxVocabBytes = 32u << 20;
constexpr std::size_t kMaxVocabEntries = 1u << 21;
constexpr std::size_t kMaxMergesBytes = 32u << 20;
constexpr std::size_t kMaxConfigBytes = 1u << 20;
constexpr std::size_t kMaxModelLength = 1u << 16;
// The merge cache is cleared when it holds this many words, so a long run of
// distinct prompts cannot grow it without bound.
constexpr std::size_t kMaxCachedWords = 1u << 16;

std::string quoted(const fs::path& path) { return "'" + path.string() + "'"; }

std::string read_bounded_file(const fs::path& path, std::size_t max_bytes, std::string_view expected) {
  std::error_code error;
  const auto status = fs::status(path, error);
  if (error || !fs::exists(status))
    ZERO_THROW(zero::IoError, "tokenizer file ", quoted(path), " is missing; expected ", expected);
  if (!fs::is_regular_file(status))
    ZERO_THROW(zero::IoError, "tokenizer file ", quoted(path), " is not a regular file; expected ", expected);
  const auto size = fs::file_size(path, error);
  if (error) ZERO_THROW(zero::IoError, "tokenizer file ", quoted(path), ": cannot read its size: ", error.message());
  if (size > max_bytes)
    ZERO_THROW(zero::IoError, "tokenizer file ", quoted(path), ": ", size, " bytes exceed the limit of ", max_bytes,
               " bytes; expected ", expected);
  std::ifstream in(path, std::ios::binary);
  std::string text(size, '\0');
  if (!in || !in.read(text.data(), static_cast<std::streamsize>(size)))
    ZERO_THROW(zero::IoError, "tokenizer file ", quoted(path), ": read failed");
  return text;
}

Json parse_bounded_json(const fs::path& path, std::size_t max_bytes, std::size_t max_values, std::size_t max_depth,
                        std::string_view expected) {
  const std::string text = read_bounded_file(path, max_bytes, expected);
  zero::io::check_json_limits(text, {.max_bytes = max_bytes, .max_values = max_values, .max_depth = max_depth},
                              "tokenizer file " + quoted(path));
  Json json = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) ZERO_THROW(zero::IoError, "tokenizer file ", quoted(path), ": not valid JSON");
  if (!json.is_object())
    ZERO_THROW(zero::IoError, "tokenizer file ", quoted(path), ": expected a JSON object (", expected, ")");
  return json;
}

// ---------------------------------------------------------------- Unicode

bool is_letter(utf8proc_int32_t cp) {
  switch (utf8proc_category(cp)) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO:
      return true;
    default:
      return false;
  }
}

bool is_number(utf8proc_int32_t cp) {
  switch (utf8proc_category(cp)) {
    case UTF8PROC_CATEGORY_ND: case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_NO:
      return true;
    default:
      return false;
  }
}

// Unicode's White_Space property, which is what `\s` matches in the
// tokenizers library's regular expressions (Oniguruma): the space separators
// (Zs), the line and paragraph separators, and the controls TAB..CR and NEL.
bool is_white_space(utf8proc_int32_t cp) {
  if ((cp >= 0x09 && cp <= 0x0D) || cp == 0x85) return true;
  switch (utf8proc_category(cp)) {
    case UTF8PROC_CATEGORY_ZS: case UTF8PROC_CATEGORY_ZL: case UTF8PROC_CATEGORY_ZP:
      return true;
    default:
      return false;
  }
}

void append_utf8(std::string& out, utf8proc_int32_t cp) {
  utf8proc_uint8_t buffer[4];
  const auto length = utf8proc_encode_char(cp, buffer);
  out.append(reinterpret_cast<const char*>(buffer), static_cast<std::size_t>(length));
}

// Decodes one code point at `text[offset]`; the text was validated as UTF-8.
utf8proc_int32_t next_code_point(std::string_view text, std::size_t& offset) {
  utf8proc_int32_t cp = 0;
  const auto length = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(text.data() + offset),
                                       static_cast<utf8proc_ssize_t>(text.size() - offset), &cp);
  offset += static_cast<std::size_t>(length);
  return cp;
}

// The byte offset of the first invalid UTF-8 sequence in `text`, or npos.
std::size_t first_invalid_utf8(std::string_view text) {
  std::size_t offset = 0;
  while (offset < text.size()) {
    utf8proc_int32_t cp = 0;
    const auto length = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(text.data() + offset),
                                         static_cast<utf8proc_ssize_t>(text.size() - offset), &cp);
    if (length <= 0) return offset;
    offset += static_cast<std::size_t>(length);
  }
  return std::string_view::npos;
}

// Step 2. Lower-casing is per character with the full mapping, as Rust's
// char::to_lowercase: the only full mapping longer than one character is
// U+0130 (capital I with dot above) -> "i" + U+0307; no final-sigma rule
// (a per-character mapping has no context), so capital sigma always becomes
// U+03C3.
std::string normalize(std::string_view piece) {
  utf8proc_uint8_t* composed = nullptr;
  const auto composed_length =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(piece.data()), static_cast<utf8proc_ssize_t>(piece.size()),
                   &composed, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  const std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owner(composed, &std::free);
  if (composed_length < 0)
    ZERO_THROW(zero::InvalidArgument, "CLIP tokenizer: NFC normalisation failed: ", utf8proc_errmsg(composed_length));
  const std::string_view nfc(reinterpret_cast<const char*>(composed), static_cast<std::size_t>(composed_length));
  std::string out;
  out.reserve(nfc.size());
  bool in_space_run = false;
  for (std::size_t offset = 0; offset < nfc.size();) {
    const utf8proc_int32_t cp = next_code_point(nfc, offset);
    if (is_white_space(cp)) {
      if (!in_space_run) out.push_back(' ');
      in_space_run = true;
      continue;
    }
    in_space_run = false;
    if (cp == 0x130) {
      out.push_back('i');
      append_utf8(out, 0x307);
    } else {
      append_utf8(out, utf8proc_tolower(cp));
    }
  }
  return out;
}

// ---------------------------------------------------------------- pre-tokenization

enum class CharClass { space, letter, number, other };

struct CodePoint {
  std::size_t offset;  // in bytes
  CharClass kind;
};

std::vector<CodePoint> classify(std::string_view text) {
  std::vector<CodePoint> out;
  for (std::size_t offset = 0; offset < text.size();) {
    const std::size_t start = offset;
    const utf8proc_int32_t cp = next_code_point(text, offset);
    const CharClass kind = is_white_space(cp) ? CharClass::space
                           : is_letter(cp)    ? CharClass::letter
                           : is_number(cp)    ? CharClass::number
                                              : CharClass::other;
    out.push_back({start, kind});
  }
  return out;
}

constexpr std::array<std::string_view, 7> kContractions = {"'s", "'t", "'re", "'ve", "'m", "'ll", "'d"};

// Step 4, first pattern: "<|startoftext|>|<|endoftext|>|'s|'t|'re|'ve|'m|'ll|'d|
// [\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+", its matches kept (in order, leftmost
// alternative first), the whitespace between them dropped.
// `clip_pattern` false gives GPT-2's pattern for text without whitespace (the byte-level
// step's: no special-token alternatives, runs of numbers).
template <typename Emit>
void split_by_pattern(std::string_view text, bool clip_pattern, Emit&& emit) {
  const std::vector<CodePoint> points = classify(text);
  const auto byte_at = [&](std::size_t index) { return index < points.size() ? points[index].offset : text.size(); };
  std::size_t i = 0;
  while (i < points.size()) {
    if (points[i].kind == CharClass::space) {
      ++i;
      continue;
    }
    const std::string_view rest = text.substr(points[i].offset);
    std::size_t literal = 0;
    if (clip_pattern) {
      for (std::string_view special : {std::string_view("<|startoftext|>"), std::string_view("<|endoftext|>")})
        if (literal == 0 && rest.starts_with(special)) literal = special.size();
    }
    for (std::string_view contraction : kContractions)
      if (literal == 0 && rest.starts_with(contraction)) literal = contraction.size();
    if (literal > 0) {  // ASCII: one code point per byte
      emit(rest.substr(0, literal));
      i += literal;
      continue;
    }
    std::size_t end = i + 1;
    const CharClass kind = points[i].kind;
    if (kind != CharClass::number || !clip_pattern)
      while (end < points.size() && points[end].kind == kind) ++end;
    emit(text.substr(points[i].offset, byte_at(end) - points[i].offset));
    i = end;
  }
}

// GPT-2's byte alphabet: the printable bytes stand for themselves, the other
// 68 (controls, space, soft hyphen, ...) for U+0100 upwards in byte order.
std::array<std::string, 256> make_byte_symbols() {
  std::array<std::string, 256> symbols;
  utf8proc_int32_t next_unprintable = 256;
  for (int byte = 0; byte < 256; ++byte) {
    const bool printable = (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) || (byte >= 0xAE);
    append_utf8(symbols[static_cast<std::size_t>(byte)], printable ? byte : next_unprintable++);
  }
  return symbols;
}

struct ParsedSpecial {
  ClipSpecialToken token;
  std::string source;  // file and key, for messages
};

std::optional<ParsedSpecial> parse_special(const Json& json, const std::string& key, const fs::path& file) {
  if (!json.contains(key) || json.at(key).is_null()) return std::nullopt;
  const Json& value = json.at(key);
  const std::string where = quoted(file) + " key '" + key + "'";
  ParsedSpecial out;
  out.source = where;
  if (value.is_string()) {
    out.token.content = value.get<std::string>();
  } else if (value.is_object() && value.contains("content") && value.at("content").is_string()) {
    out.token.content = value.at("content").get<std::string>();
    if (value.contains("normalized")) {
      if (!value.at("normalized").is_boolean())
        ZERO_THROW(zero::IoError, "tokenizer file ", where, ": 'normalized' should be true or false");
      out.token.normalized = value.at("normalized").get<bool>();
    }
    for (const char* flag : {"lstrip", "rstrip", "single_word"})
      if (value.contains(flag) && value.at(flag) != false)
        ZERO_THROW(zero::IoError, "tokenizer file ", where, ": '", flag,
                   "' true is not supported; expected false, as in SDXL's CLIP tokenizers");
  } else {
    ZERO_THROW(zero::IoError, "tokenizer file ", where,
               ": expected a token string or an object with a string 'content'");
  }
  if (out.token.content.empty()) ZERO_THROW(zero::IoError, "tokenizer file ", where, ": the token is empty");
  return out;
}

// vocab.json: {"token": id, ...}, ids distinct integers in [0, 2^31).
std::unordered_map<std::string, int64_t> load_vocab(const fs::path& path) {
  const Json vocab = parse_bounded_json(path, kMaxVocabBytes, kMaxVocabEntries + 1, 1,
                                        "a JSON object mapping each BPE token to its integer id");
  std::unordered_map<std::string, int64_t> out;
  std::unordered_map<int64_t, std::string> owner_of_id;
  for (const auto& [token, id] : vocab.items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
      ZERO_THROW(zero::IoError, "tokenizer file ", quoted(path), ": the id of '", token,
                 "' should be an integer in [0, 2^31); got ", id.dump());
    const int64_t value = id.get<int64_t>();
    if (auto [it, inserted] = owner_of_id.emplace(value, token); !inserted)
      ZERO_THROW(zero::IoError, "tokenizer file ", quoted(path), ": id ", value, " is given to both '", it->second,
                 "' and '", token, "'; expected one token per id");
    out.emplace(token, value);
  }
  if (out.empty()) ZERO_THROW(zero::IoError, "tokenizer file ", quoted(path), ": the vocabulary is empty");
  return out;
}

// merges.txt: a "#version" line, then "first second" per line, by rank; both
// tokens and their concatenation must be in the vocabulary (as tokenizers
// requires). Keys of the result are the lines, "first second".
std::unordered_map<std::string, std::size_t> load_merge_ranks(const fs::path& path, const fs::path& vocab_path,
                                                              const std::unordered_map<std::string, int64_t>& vocab) {
  const std::string merges = read_bounded_file(path, kMaxMergesBytes, "CLIP's BPE merges text file");
  std::unordered_map<std::string, std::size_t> ranks;
  std::istringstream lines(merges);
  std::string line;
  std::size_t line_number = 0;
  std::size_t rank = 0;
  while (std::getline(lines, line)) {
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line_number == 1) {
      if (!line.starts_with("#version"))
        ZERO_THROW(zero::IoError, "tokenizer file ", quoted(path),
                   ": line 1 should be the '#version: ...' header of a BPE merges file; got '", line.substr(0, 80),
                   "'");
      continue;
    }
    if (line.empty()) continue;
    const auto space = line.find(' ');
    if (space == std::string::npos || space == 0 || line.find(' ', space + 1) != std::string::npos ||
        space + 1 == line.size())
      ZERO_THROW(zero::IoError, "tokenizer file ", quoted(path), ": line ", line_number,
                 " should be two tokens separated by one space; got '", line.substr(0, 80), "'");
    const std::string first = line.substr(0, space);
    const std::string second = line.substr(space + 1);
    for (const std::string& token : {first, second, first + second}) {
      if (!vocab.contains(token))
        ZERO_THROW(zero::IoError, "tokenizer file ", quoted(path), ": line ", line_number, ": '", token,
                   "' is not in ", quoted(vocab_path), "; expected the merges of that vocabulary");
    }
    // A pair listed twice keeps its later rank, as transformers does.
    ranks[line] = rank++;
  }
  if (line_number == 0)
    ZERO_THROW(zero::IoError, "tokenizer file ", quoted(path),
               " is empty; expected a '#version: ...' header and the BPE merges");
  return ranks;
}

struct Piece {
  std::string_view text;
  int64_t special_id = -1;  // >= 0: a special token, already an id
};

// Steps 1 and 3: leftmost-longest matches of the given tokens.
void split_special(std::string_view text, const std::vector<ClipSpecialToken>& tokens, bool normalized,
                   std::vector<Piece>& out) {
  std::size_t start = 0;
  std::size_t i = 0;
  while (i < text.size()) {
    const ClipSpecialToken* best = nullptr;
    for (const ClipSpecialToken& token : tokens)
      if (token.normalized == normalized && text.substr(i).starts_with(token.content) &&
          (best == nullptr || token.content.size() > best->content.size()))
        best = &token;
    if (best == nullptr) {
      ++i;
      continue;
    }
    if (i > start) out.push_back({text.substr(start, i - start)});
    out.push_back({text.substr(i, best->content.size()), best->id});
    i += best->content.size();
    start = i;
  }
  if (start < text.size()) out.push_back({text.substr(start)});
}

}  // namespace

struct ClipTokenizer::Impl {
  std::unordered_map<std::string, int64_t> vocab;
  std::unordered_map<std::string, std::size_t> merge_ranks;  // key: "first second"
  std::array<std::string, 256> byte_symbols = make_byte_symbols();
  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache;
};

ClipTokenizer::ClipTokenizer() : impl_(std::make_unique<Impl>()) {}
ClipTokenizer::ClipTokenizer(ClipTokenizer&&) noexcept = default;
ClipTokenizer& ClipTokenizer::operator=(ClipTokenizer&&) noexcept = default;
ClipTokenizer::~ClipTokenizer() = default;

ClipTokenizer ClipTokenizer::load(const fs::path& folder) {
  ClipTokenizer tokenizer;
  Impl& impl = *tokenizer.impl_;

  const fs::path vocab_path = folder / "vocab.json";
  impl.vocab = load_vocab(vocab_path);
  tokenizer.vocab_size_ = impl.vocab.size();
  impl.merge_ranks = load_merge_ranks(folder / "merges.txt", vocab_path, impl.vocab);

  // tokenizer_config.json (+ special_tokens_map.json): length and special tokens.
  const fs::path config_path = folder / "tokenizer_config.json";
  const Json config = parse_bounded_json(config_path, kMaxConfigBytes, 1u << 16, 8,
                                         "a transformers tokenizer config with 'model_max_length'");
  const fs::path map_path = folder / "special_tokens_map.json";
  Json special_map = Json::object();
  if (fs::exists(map_path))
    special_map = parse_bounded_json(map_path, kMaxConfigBytes, 1u << 16, 8, "a transformers special tokens map");

  if (!config.contains("model_max_length") || !config.at("model_max_length").is_number_integer() ||
      config.at("model_max_length").get<int64_t>() < 2 ||
      config.at("model_max_length").get<int64_t>() > static_cast<int64_t>(kMaxModelLength))
    ZERO_THROW(zero::IoError, "tokenizer file ", quoted(config_path),
               ": 'model_max_length' should be the text encoder's context length, an integer in [2, ",
               kMaxModelLength, "] (77 for SDXL); got ",
               config.contains("model_max_length") ? config.at("model_max_length").dump() : std::string("nothing"));
  tokenizer.max_length_ = static_cast<std::size_t>(config.at("model_max_length").get<int64_t>());

  // Tokens declared in several places share one entry; the last declaration
  // sets whether it is matched before or after normalisation, in the order
  // transformers registers them (added_tokens_decoder, then bos, eos, unk,
  // pad). With SDXL's files that makes "<|endoftext|>" un-normalized in
  // tokenizer/ (its pad_token is the bare string) and normalized in
  // tokenizer_2/ (pad is "!"), as transformers 5 does.
  const auto declare = [&](const ClipSpecialToken& token, const std::string& source) -> int64_t {
    const auto in_vocab = impl.vocab.find(token.content);
    if (in_vocab == impl.vocab.end())
      ZERO_THROW(zero::IoError, "tokenizer file ", source, ": the token '", token.content, "' is not in ",
                 quoted(vocab_path), "; expected a token of that vocabulary");
    for (ClipSpecialToken& known : tokenizer.special_tokens_)
      if (known.content == token.content) {
        known.normalized = token.normalized;
        return known.id;
      }
    tokenizer.special_tokens_.push_back({token.content, in_vocab->second, token.normalized});
    return in_vocab->second;
  };
  if (config.contains("added_tokens_decoder")) {
    const Json& added = config.at("added_tokens_decoder");
    if (!added.is_object())
      ZERO_THROW(zero::IoError, "tokenizer file ", quoted(config_path), ": 'added_tokens_decoder' should be an object");
    std::map<int64_t, ParsedSpecial> by_id;
    for (const auto& [id_text, value] : added.items()) {
      Json holder = Json::object({{"token", value}});
      auto parsed = parse_special(holder, "token", config_path);
      int64_t id = -1;
      try {
        id = std::stoll(id_text);
      } catch (const std::exception&) {
      }
      if (!parsed || id < 0)
        ZERO_THROW(zero::IoError, "tokenizer file ", quoted(config_path), ": 'added_tokens_decoder' entry '", id_text,
                   "' should map an integer id to a token object");
      if (const auto it = impl.vocab.find(parsed->token.content); it == impl.vocab.end() || it->second != id)
        ZERO_THROW(zero::IoError, "tokenizer file ", quoted(config_path), ": added token '", parsed->token.content,
                   "' with id ", id, " is not that entry of ", quoted(vocab_path),
                   "; tokens beyond the vocabulary are not supported");
      by_id.emplace(id, std::move(*parsed));
    }
    for (const auto& [id, parsed] : by_id) declare(parsed.token, parsed.source);
  }
  const auto special = [&](const std::string& key, std::string_view default_content) -> int64_t {
    auto from_config = parse_special(config, key, config_path);
    auto from_map = parse_special(special_map, key, map_path);
    if (from_config && from_map && from_config->token.content != from_map->token.content)
      ZERO_THROW(zero::IoError, "tokenizer files ", from_config->source, " and ", from_map->source,
                 " disagree: '", from_config->token.content, "' vs '", from_map->token.content,
                 "'; expected the same token");
    const auto& chosen = from_config ? from_config : from_map;
    if (!chosen) return declare({std::string(default_content), 0, false}, quoted(config_path) + " (default " + key + ")");
    if (key == "pad_token") tokenizer.pad_token_ = chosen->token.content;
    return declare(chosen->token, chosen->source);
  };
  tokenizer.bos_id_ = special("bos_token", "<|startoftext|>");
  tokenizer.eos_id_ = special("eos_token", "<|endoftext|>");
  tokenizer.unk_id_ = special("unk_token", "<|endoftext|>");
  if (tokenizer.pad_token_.empty()) tokenizer.pad_token_ = "<|endoftext|>";
  tokenizer.pad_id_ = special("pad_token", "<|endoftext|>");
  return tokenizer;
}

void ClipTokenizer::append_word_ids(std::string_view word, std::vector<int64_t>& ids) const {
  Impl& impl = *impl_;
  const std::string key(word);
  {
    std::lock_guard lock(impl.cache_mutex);
    if (const auto it = impl.cache.find(key); it != impl.cache.end()) {
      ids.insert(ids.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  // Step 5: byte symbols, "</w>" on the last one, then the lowest-ranked
  // adjacent pair merged everywhere (left to right) until none is a merge.
  std::vector<std::string> symbols;
  symbols.reserve(word.size());
  for (unsigned char byte : word) symbols.push_back(impl.byte_symbols[byte]);
  symbols.back() += "</w>";
  std::string pair;
  while (symbols.size() > 1) {
    std::size_t best_rank = std::numeric_limits<std::size_t>::max();
    std::string best_first;
    std::string best_second;
    for (std::size_t i = 0; i + 1 < symbols.size(); ++i) {
      pair.assign(symbols[i]).append(" ").append(symbols[i + 1]);
      if (const auto it = impl.merge_ranks.find(pair); it != impl.merge_ranks.end() && it->second < best_rank) {
        best_rank = it->second;
        best_first = symbols[i];
        best_second = symbols[i + 1];
      }
    }
    if (best_rank == std::numeric_limits<std::size_t>::max()) break;
    std::vector<std::string> merged;
    merged.reserve(symbols.size());
    for (std::size_t i = 0; i < symbols.size();) {
      if (i + 1 < symbols.size() && symbols[i] == best_first && symbols[i + 1] == best_second) {
        merged.push_back(best_first + best_second);
        i += 2;
      } else {
        merged.push_back(std::move(symbols[i]));
        i += 1;
      }
    }
    symbols = std::move(merged);
  }
  std::vector<int64_t> word_ids;
  word_ids.reserve(symbols.size());
  for (const std::string& symbol : symbols) {
    const auto it = impl.vocab.find(symbol);
    word_ids.push_back(it == impl.vocab.end() ? unk_id_ : it->second);
  }
  ids.insert(ids.end(), word_ids.begin(), word_ids.end());
  std::lock_guard lock(impl.cache_mutex);
  if (impl.cache.size() >= kMaxCachedWords) impl.cache.clear();
  impl.cache.emplace(key, std::move(word_ids));
}

void ClipTokenizer::append_normalized_piece_ids(std::string_view normalized, std::vector<int64_t>& ids) const {
  split_by_pattern(normalized, /*clip_pattern=*/true, [&](std::string_view clip_piece) {
    split_by_pattern(clip_piece, /*clip_pattern=*/false, [&](std::string_view word) { append_word_ids(word, ids); });
  });
}

std::vector<int64_t> ClipTokenizer::token_ids(std::string_view prompt) const {
  if (const std::size_t bad = first_invalid_utf8(prompt); bad != std::string_view::npos)
    ZERO_THROW(zero::InvalidArgument, "CLIP tokenizer: the prompt is not valid UTF-8 (at byte ", bad,
               "); expected UTF-8 text");
  std::vector<int64_t> ids;
  std::vector<Piece> raw_pieces;
  split_special(prompt, special_tokens_, /*normalized=*/false, raw_pieces);
  for (const Piece& raw : raw_pieces) {
    if (raw.special_id >= 0) {
      ids.push_back(raw.special_id);
      continue;
    }
    const std::string normalized = normalize(raw.text);
    std::vector<Piece> pieces;
    split_special(normalized, special_tokens_, /*normalized=*/true, pieces);
    for (const Piece& piece : pieces) {
      if (piece.special_id >= 0)
        ids.push_back(piece.special_id);
      else
        append_normalized_piece_ids(piece.text, ids);
    }
  }
  return ids;
}

ClipEncoding ClipTokenizer::encode(std::string_view prompt) const {
  std::vector<int64_t> ids = token_ids(prompt);
  if (ids.size() > max_length_ - 2) ids.resize(max_length_ - 2);
  ClipEncoding out;
  out.input_ids.reserve(max_length_);
  out.input_ids.push_back(bos_id_);
  out.input_ids.insert(out.input_ids.end(), ids.begin(), ids.end());
  out.input_ids.push_back(eos_id_);
  out.attention_mask.assign(out.input_ids.size(), 1);
  out.input_ids.resize(max_length_, pad_id_);
  out.attention_mask.resize(max_length_, 0);
  return out;
}

}  // namespace sdxl
