#include "jsonl_writer.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>

#include "../io/temp_dir.hpp"
#include "zero/core/error.hpp"

using sdxl::metrics::JsonlWriter;
using sdxl::metrics::StepRecord;
using zero::io::testing::read_text;
using zero::io::testing::TempDir;
using zero::io::testing::write_text;

namespace {

StepRecord record_at(std::int64_t step) {
  StepRecord r;
  r.step = step;
  r.loss = 1.0 / static_cast<double>(step + 1);
  r.lr = 1e-5;
  return r;
}

std::vector<std::int64_t> steps_in(const std::filesystem::path& path) {
  std::vector<std::int64_t> steps;
  for (const auto& object : JsonlWriter::read_all(path)) steps.push_back(object["step"].get<std::int64_t>());
  return steps;
}

}  // namespace

TEST_CASE("jsonl: a full record is one line with step first and every field") {
  TempDir dir;
  const auto path = dir / "metrics.jsonl";
  {
    JsonlWriter writer(path);
    StepRecord r;
    r.step = 120;
    r.loss = 0.1234;
    r.lr = 1e-5;
    r.grad_norm = 0.75;
    r.images_per_s = 3.21;
    r.mem_max_bytes = 22870700032ull;
    r.mem_min_bytes = 22441824256ull;
    r.loss_scale = 65536.0;
    r.skipped_steps = 2;
    r.elapsed_s = 37.5;
    r.extra = {{"timing/forward_s", 0.25}, {"timing/backward_s", 0.5}};
    writer.write(r);
    CHECK(writer.last_step() == 120);
    CHECK(writer.line_count() == 1);
    // Every write reaches the file at once, before any close.
    const std::string text = read_text(path);
    REQUIRE(!text.empty());
    CHECK(text.back() == '\n');
    CHECK(text.rfind("{\"step\":120,\"loss\":0.1234,", 0) == 0);
  }
  const auto objects = JsonlWriter::read_all(path);
  REQUIRE(objects.size() == 1);
  const auto& o = objects[0];
  CHECK(o["step"] == 120);
  CHECK(o["grad_norm"] == 0.75);
  CHECK(o["mem_max_bytes"] == 22870700032ull);
  CHECK(o["mem_min_bytes"] == 22441824256ull);
  CHECK(o["loss_scale"] == 65536.0);
  CHECK(o["skipped_steps"] == 2);
  CHECK(o["elapsed_s"] == 37.5);
  CHECK(o["timing/forward_s"] == 0.25);
  CHECK(o["timing/backward_s"] == 0.5);
  REQUIRE(o.contains("time"));  // filled in by the writer
  CHECK(o["time"].get<double>() > 1.6e9);
}

TEST_CASE("jsonl: empty fields are left out, non-finite values are null") {
  TempDir dir;
  JsonlWriter writer(dir / "m.jsonl");
  StepRecord r;
  r.step = 3;
  r.loss = std::numeric_limits<double>::quiet_NaN();
  r.grad_norm = std::numeric_limits<double>::infinity();
  r.time = 1700000000.5;
  writer.write(r);
  const auto o = JsonlWriter::read_all(writer.path()).at(0);
  CHECK(o.size() == 4);
  CHECK(o["loss"].is_null());
  CHECK(o["grad_norm"].is_null());
  CHECK(o["time"] == 1700000000.5);
  CHECK_FALSE(o.contains("lr"));

  const auto j = r.to_json();
  CHECK(j["step"] == 3);
  CHECK(j.contains("loss"));
  CHECK_FALSE(j.contains("mem_max_bytes"));
}

TEST_CASE("jsonl: nlohmann::json objects, step first and time added") {
  TempDir dir;
  JsonlWriter writer(dir / "m.jsonl");
  writer.write(nlohmann::json{{"loss", 0.5}, {"step", 7}, {"phase", "warmup"}});
  writer.write(nlohmann::json{{"step", 8}, {"time", 12.0}});
  const std::string text = read_text(writer.path());
  CHECK(text.rfind("{\"step\":7,", 0) == 0);
  const auto objects = JsonlWriter::read_all(writer.path());
  REQUIRE(objects.size() == 2);
  CHECK(objects[0]["phase"] == "warmup");
  CHECK(objects[0].contains("time"));
  CHECK(objects[1]["time"] == 12.0);

  CHECK_THROWS_AS(writer.write(nlohmann::json::array({1, 2})), zero::InvalidArgument);
  CHECK_THROWS_AS(writer.write(nlohmann::json{{"loss", 1.0}}), zero::InvalidArgument);
  CHECK_THROWS_AS(writer.write(nlohmann::json{{"step", 9.5}}), zero::InvalidArgument);
  // Invalid UTF-8 from a caller is replaced, never thrown mid-run.
  writer.write(nlohmann::json{{"step", 9}, {"note", std::string("bad \xff byte")}});
  CHECK(steps_in(writer.path()) == std::vector<std::int64_t>{7, 8, 9});
}

TEST_CASE("jsonl: steps must increase; an extra key may not shadow a field") {
  TempDir dir;
  JsonlWriter writer(dir / "m.jsonl");
  writer.write(record_at(5));
  CHECK_THROWS_AS(writer.write(record_at(5)), zero::InvalidArgument);
  CHECK_THROWS_AS(writer.write(record_at(4)), zero::InvalidArgument);
  try {
    writer.write(record_at(1));
  } catch (const zero::InvalidArgument& e) {
    CHECK(std::string(e.what()).find("truncate_after") != std::string::npos);
  }
  StepRecord shadow = record_at(6);
  shadow.extra["loss"] = 1.0;
  CHECK_THROWS_AS(writer.write(shadow), zero::InvalidArgument);
  CHECK(steps_in(writer.path()) == std::vector<std::int64_t>{5});
}

TEST_CASE("jsonl: reopening appends; resume truncates the steps after the checkpoint") {
  TempDir dir;
  const auto path = dir / "metrics.jsonl";
  {
    JsonlWriter first_run(path);
    for (std::int64_t step = 1; step <= 10; ++step) first_run.write(record_at(step));
  }
  // The crashed run had logged up to step 10; its last checkpoint was step 6.
  JsonlWriter resumed(path);
  CHECK(resumed.last_step() == 10);
  CHECK(resumed.line_count() == 10);
  CHECK(resumed.truncate_after(6) == 4);
  CHECK(resumed.last_step() == 6);
  CHECK(resumed.line_count() == 6);
  for (std::int64_t step = 7; step <= 12; ++step) resumed.write(record_at(step));
  CHECK(steps_in(path) == std::vector<std::int64_t>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12});
  // The atomic replacement leaves no temporary file behind.
  CHECK(dir.entries() == std::vector<std::string>{"metrics.jsonl"});

  CHECK(resumed.truncate_after(100) == 0);
  CHECK(resumed.truncate_after(0) == 12);
  CHECK_FALSE(resumed.last_step().has_value());
  resumed.write(record_at(1));  // any step is after an empty file
  CHECK(steps_in(path) == std::vector<std::int64_t>{1});
}

TEST_CASE("jsonl: a line torn by a crash is cut off at open") {
  TempDir dir;
  const auto path = dir / "m.jsonl";
  write_text(path, "{\"step\":1,\"loss\":0.5}\n{\"step\":2,\"loss\":0.4}\n{\"step\":3,\"lo");
  JsonlWriter writer(path);
  CHECK(writer.last_step() == 2);
  writer.write(record_at(3));
  CHECK(steps_in(path) == std::vector<std::int64_t>{1, 2, 3});
  CHECK(read_text(path).find("{\"step\":2,\"loss\":0.4}\n{\"step\":3,") != std::string::npos);
}

TEST_CASE("jsonl: a malformed line is an IoError naming the file and line") {
  TempDir dir;
  const auto path = dir / "m.jsonl";
  write_text(path, "{\"step\":1}\n\nnot json\n");
  try {
    JsonlWriter writer(path);
    FAIL("expected zero::IoError");
  } catch (const zero::IoError& e) {
    CHECK(std::string(e.what()).find("m.jsonl:3") != std::string::npos);
  }
  write_text(path, "{\"loss\":1}\n");
  CHECK_THROWS_AS(JsonlWriter{path}, zero::IoError);
  CHECK_THROWS_AS(JsonlWriter{dir / "missing" / "m.jsonl"}, zero::IoError);
}

TEST_CASE("jsonl: a moved writer keeps appending to the same file") {
  TempDir dir;
  JsonlWriter a(dir / "m.jsonl");
  a.write(record_at(1));
  JsonlWriter b = std::move(a);
  b.write(record_at(2));
  CHECK(b.last_step() == 2);
  CHECK(steps_in(b.path()) == std::vector<std::int64_t>{1, 2});
}
