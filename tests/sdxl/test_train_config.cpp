// The trainer's configuration as checkpoints record it (TrainConfig::to_toml):
// every string reads back as itself, whatever characters it holds.
#include <doctest/doctest.h>

#include <string>

#include "train_config.hpp"

namespace {

// Text that toml++'s own printer did not write back readably: quotes, a
// backslash, control characters, a newline beside "'''", a Windows path,
// UTF-8 and a lone "#".
const std::string kAwkward[] = {
    "a \"quoted\" negative prompt",
    "C:\\runs\\sdxl",
    "line one\nline two with ''' inside",
    "tab\there, bell\x07, delete\x7f, nul-free",
    "caf\xC3\xA9 \xE2\x80\x94 \xF0\x9F\x8E\xA8 # not a comment",
    "'''",
    "\"\"\"",
};

}  // namespace

TEST_CASE("to_toml: strings with quotes, backslashes, newlines and ''' read back as themselves") {
  for (const std::string& text : kAwkward) {
    CAPTURE(text);
    sdxl::TrainConfig c;
    c.synthetic = true;
    c.validation_negative_prompt = text;
    c.freeze = {"*.norm*", text};
    c.validation_prompts = {text, "plain"};
    c.optimizer_groups.push_back({.name = text, .params = {"*.attn1.*", text}, .lr_scale = 0.5});
    const std::string saved = c.to_toml();
    const sdxl::TrainConfig again = sdxl::train_config_from_toml(saved, "saved");
    CHECK(again.validation_negative_prompt == text);
    CHECK(again.freeze == c.freeze);
    CHECK(again.validation_prompts == c.validation_prompts);
    REQUIRE(again.optimizer_groups.size() == 1);
    CHECK(again.optimizer_groups[0].name == text);
    CHECK(again.optimizer_groups[0].params == c.optimizer_groups[0].params);
    CHECK(again.to_toml() == saved);
    const auto freeze = sdxl::saved_freeze(saved);
    REQUIRE(freeze.has_value());
    CHECK(*freeze == c.freeze);
  }
}
