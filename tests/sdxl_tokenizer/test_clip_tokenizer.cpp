// sdxl.tokenizer: the CLIP tokenizer against transformers' CLIPTokenizer.
// expected.jsonl holds, per corpus prompt, the ids transformers gave for the
// fixture's tokenizer/ and tokenizer_2/ up to the attention mask's length
// (tests/fixtures/clip_tokenizer/README.md says how they were made); the rest
// of the 77 must be the folder's pad token with mask 0.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "clip_tokenizer.hpp"
#include "zero/core/error.hpp"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

const fs::path kFixture = CLIP_TOKENIZER_FIXTURE;

std::vector<json> read_jsonl(const fs::path& path) {
  std::ifstream in(path);
  REQUIRE_MESSAGE(in, "cannot open ", path.string());
  std::vector<json> rows;
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) rows.push_back(json::parse(line));
  return rows;
}

std::string dump_ids(const std::vector<int64_t>& ids) { return json(ids).dump(); }

// A copy of one fixture folder that a test may break.
class ScratchTokenizer {
 public:
  explicit ScratchTokenizer(const std::string& folder) {
    std::string pattern = (fs::temp_directory_path() / "clip_tokenizer_test.XXXXXX").string();
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    root_ = pattern;
    fs::copy(kFixture / folder, root_ / "t", fs::copy_options::recursive);
  }
  ~ScratchTokenizer() {
    std::error_code ignored;
    fs::remove_all(root_, ignored);
  }
  fs::path dir() const { return root_ / "t"; }
  void write(const std::string& name, const std::string& text) const { std::ofstream(dir() / name) << text; }
  std::string read(const std::string& name) const {
    std::ifstream in(dir() / name);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }

 private:
  fs::path root_;
};

std::string load_error(const fs::path& dir) {
  try {
    (void)sdxl::ClipTokenizer::load(dir);
  } catch (const zero::IoError& error) {
    return error.message();
  }
  return "(loaded without error)";
}

}  // namespace

TEST_CASE("both SDXL tokenizers give transformers' ids and masks on the whole corpus") {
  const std::vector<json> corpus = read_jsonl(kFixture / "corpus.jsonl");
  const std::vector<json> expected = read_jsonl(kFixture / "expected.jsonl");
  REQUIRE(corpus.size() >= 2000);
  REQUIRE(corpus.size() == expected.size());
  for (const std::string folder : {"tokenizer", "tokenizer_2"}) {
    CAPTURE(folder);
    const auto tokenizer = sdxl::ClipTokenizer::load(kFixture / folder);
    CHECK(tokenizer.max_length() == 77);
    CHECK(tokenizer.pad_token() == (folder == "tokenizer" ? "<|endoftext|>" : "!"));
    std::size_t mismatches = 0;
    std::size_t truncated = 0;
    for (std::size_t i = 0; i < corpus.size(); ++i) {
      const auto want = expected[i].at(folder).get<std::vector<int64_t>>();
      const sdxl::ClipEncoding got = tokenizer.encode(corpus[i].get<std::string>());
      std::vector<int64_t> want_ids = want;
      want_ids.resize(77, tokenizer.pad_id());
      std::vector<int64_t> want_mask(want.size(), 1);
      want_mask.resize(77, 0);
      truncated += want.size() == 77;
      if (got.input_ids != want_ids || got.attention_mask != want_mask) {
        if (++mismatches <= 5)
          FAIL_CHECK("prompt ", i, " ", corpus[i].dump(), "\n  want ", dump_ids(want_ids), "\n  got  ",
                     dump_ids(got.input_ids), "\n  mask ", dump_ids(got.attention_mask));
      }
    }
    CHECK(mismatches == 0);
    CHECK(truncated > 50);  // the corpus does reach the truncation
  }
}

TEST_CASE("special tokens: ids, and where SDXL's two folders differ") {
  const auto first = sdxl::ClipTokenizer::load(kFixture / "tokenizer");
  const auto second = sdxl::ClipTokenizer::load(kFixture / "tokenizer_2");
  CHECK(first.bos_id() == second.bos_id());
  CHECK(first.eos_id() == first.pad_id());
  CHECK(second.pad_id() == 0);  // "!" is the vocabulary's first entry
  // tokenizer_2 declares "!" a special token: each "!" is id 0, never merged.
  CHECK(second.token_ids("hi!!") == std::vector<int64_t>{second.token_ids("hi")[0], second.token_ids("hi")[1], 0, 0});
  CHECK(first.token_ids("!!").size() == 1);
  CHECK(first.token_ids("x<|endoftext|>y")[1] == first.eos_id());
  CHECK(first.encode("").input_ids[1] == first.eos_id());
  CHECK(first.encode(" \t\n").attention_mask[2] == 0);
}

TEST_CASE("invalid UTF-8 in a prompt is refused") {
  const auto tokenizer = sdxl::ClipTokenizer::load(kFixture / "tokenizer");
  CHECK_THROWS_AS(tokenizer.encode(std::string("caf\xC3", 4)), zero::InvalidArgument);
  CHECK_THROWS_AS(tokenizer.encode(std::string("\xED\xA0\x80", 3)), zero::InvalidArgument);  // a surrogate
}

TEST_CASE("bad tokenizer folders: the error names the file and what was expected") {
  SUBCASE("missing vocab.json") {
    ScratchTokenizer scratch("tokenizer");
    fs::remove(scratch.dir() / "vocab.json");
    const std::string message = load_error(scratch.dir());
    CHECK(message.find("vocab.json") != std::string::npos);
    CHECK(message.find("missing") != std::string::npos);
  }
  SUBCASE("missing folder") { CHECK(load_error(kFixture / "no_such_folder").find("missing") != std::string::npos); }
  SUBCASE("broken JSON in vocab.json") {
    ScratchTokenizer scratch("tokenizer");
    scratch.write("vocab.json", "{\"a\": 1, ");
    const std::string message = load_error(scratch.dir());
    CHECK(message.find("vocab.json") != std::string::npos);
    CHECK(message.find("JSON") != std::string::npos);
  }
  SUBCASE("vocab.json with a non-integer id") {
    ScratchTokenizer scratch("tokenizer");
    scratch.write("vocab.json", "{\"a\": \"one\"}");
    CHECK(load_error(scratch.dir()).find("should be an integer") != std::string::npos);
  }
  SUBCASE("vocab.json too deep for a vocabulary") {
    ScratchTokenizer scratch("tokenizer");
    scratch.write("vocab.json", "{\"a\": {\"b\": 1}}");
    CHECK(load_error(scratch.dir()).find("vocab.json") != std::string::npos);
  }
  SUBCASE("broken tokenizer_config.json") {
    ScratchTokenizer scratch("tokenizer");
    scratch.write("tokenizer_config.json", "[1, 2");
    CHECK(load_error(scratch.dir()).find("tokenizer_config.json") != std::string::npos);
  }
  SUBCASE("merges.txt without its #version header") {
    ScratchTokenizer scratch("tokenizer");
    const std::string merges = scratch.read("merges.txt");
    scratch.write("merges.txt", merges.substr(merges.find('\n') + 1));
    const std::string message = load_error(scratch.dir());
    CHECK(message.find("merges.txt") != std::string::npos);
    CHECK(message.find("#version") != std::string::npos);
  }
  SUBCASE("merges.txt with a line that is not two tokens") {
    ScratchTokenizer scratch("tokenizer");
    scratch.write("merges.txt", "#version: 0.2\na b c\n");
    CHECK(load_error(scratch.dir()).find("line 2") != std::string::npos);
  }
  SUBCASE("merges.txt naming a token outside the vocabulary") {
    ScratchTokenizer scratch("tokenizer");
    scratch.write("merges.txt", "#version: 0.2\nzzzz qqqq\n");
    CHECK(load_error(scratch.dir()).find("'zzzz' is not in") != std::string::npos);
  }
  SUBCASE("unknown pad token") {
    ScratchTokenizer scratch("tokenizer_2");
    for (const std::string name : {"tokenizer_config.json", "special_tokens_map.json"}) {
      json config = json::parse(scratch.read(name));
      config["pad_token"] = "<|pad|>";
      scratch.write(name, config.dump());
    }
    const std::string message = load_error(scratch.dir());
    CHECK(message.find("'<|pad|>' is not in") != std::string::npos);
    CHECK(message.find("pad_token") != std::string::npos);
  }
  SUBCASE("the two config files disagree on the pad token") {
    ScratchTokenizer scratch("tokenizer_2");
    json config = json::parse(scratch.read("special_tokens_map.json"));
    config["pad_token"] = "<|endoftext|>";
    scratch.write("special_tokens_map.json", config.dump());
    CHECK(load_error(scratch.dir()).find("disagree") != std::string::npos);
  }
  SUBCASE("model_max_length missing or absurd") {
    ScratchTokenizer scratch("tokenizer");
    json config = json::parse(scratch.read("tokenizer_config.json"));
    config["model_max_length"] = 1e30;  // transformers' placeholder when a config sets none
    scratch.write("tokenizer_config.json", config.dump());
    CHECK(load_error(scratch.dir()).find("model_max_length") != std::string::npos);
  }
  SUBCASE("a vocab.json larger than any real one is refused before parsing") {
    ScratchTokenizer scratch("tokenizer");
    fs::resize_file(scratch.dir() / "vocab.json", (32u << 20) + 1);
    CHECK(load_error(scratch.dir()).find("exceed the limit") != std::string::npos);
  }
}
