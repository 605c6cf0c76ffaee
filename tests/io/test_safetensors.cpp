#include "zero/io/safetensors.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>

#include "io_error_of.hpp"
#include "temp_dir.hpp"
#include "zero/core/error.hpp"

using namespace zero::io;
using zero::io::testing::read_bytes;
using zero::io::testing::TempDir;

namespace {

const std::filesystem::path kFixtures = ZERO_TEST_FIXTURES;

// A fresh seed per run, printed on failure, so that repeated runs cover more
// values but a failure can still be replayed.
std::uint64_t fresh_seed() {
  std::random_device device;
  return (static_cast<std::uint64_t>(device()) << 32) | device();
}

std::vector<std::byte> random_payload(std::mt19937_64& rng, TensorDType dtype, std::uint64_t count) {
  std::vector<std::byte> bytes(count * size_of(dtype));
  for (auto& b : bytes) b = static_cast<std::byte>(rng() & 0xffu);
  if (dtype == TensorDType::BOOL) {
    for (auto& b : bytes) b = static_cast<std::byte>(std::to_integer<int>(b) & 1);
  }
  return bytes;
}

std::uint64_t element_count(const std::vector<std::int64_t>& shape) {
  std::uint64_t n = 1;
  for (auto d : shape) n *= static_cast<std::uint64_t>(d);
  return n;
}

std::vector<std::byte> with_header(const std::string& header, const std::vector<std::byte>& data) {
  std::vector<std::byte> out(8 + header.size());
  std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<std::byte>((n >> (8 * i)) & 0xff);
  std::memcpy(out.data() + 8, header.data(), header.size());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

using zero::testing::io_error_of;

}  // namespace

TEST_CASE("TensorDType names, sizes and zero::DType mapping") {
  CHECK(size_of(TensorDType::F64) == 8);
  CHECK(size_of(TensorDType::BF16) == 2);
  CHECK(size_of(TensorDType::BOOL) == 1);
  for (TensorDType dtype : kAllTensorDTypes) {
    CHECK(is_valid(dtype));
    CHECK(parse_tensor_dtype(name_of(dtype)) == dtype);
  }
  CHECK_FALSE(parse_tensor_dtype("f32"));
  CHECK_FALSE(parse_tensor_dtype("F8_E4M3"));
  CHECK_FALSE(parse_tensor_dtype(""));
  CHECK(to_dtype(TensorDType::F32) == zero::DType::fp32);
  CHECK(to_dtype(TensorDType::BF16) == zero::DType::bf16);
  CHECK(to_dtype(TensorDType::F16) == zero::DType::fp16);
  CHECK_FALSE(to_dtype(TensorDType::F64));
  CHECK_FALSE(to_dtype(TensorDType::I8));
  for (zero::DType dtype : zero::kAllDTypes) {
    CHECK(to_dtype(to_tensor_dtype(dtype)) == dtype);
    CHECK(size_of(to_tensor_dtype(dtype)) == zero::size_of(dtype));
  }
}

TEST_CASE("round trip of every dtype and odd shapes, file and memory") {
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const std::vector<std::vector<std::int64_t>> shapes = {
      {}, {0}, {3, 0, 2}, {1}, {7}, {3, 5, 7}, {1, 1, 1, 1, 1}, {257, 129}};

  std::vector<std::vector<std::byte>> payloads;
  std::vector<TensorView> views;
  for (TensorDType dtype : kAllTensorDTypes) {
    for (std::size_t s = 0; s < shapes.size(); ++s) {
      payloads.push_back(random_payload(rng, dtype, element_count(shapes[s])));
      TensorView view;
      view.name = std::string("layer.") + std::string(name_of(dtype)) + "." + std::to_string(s);
      view.dtype = dtype;
      view.shape = shapes[s];
      view.data = payloads.back().empty() ? nullptr : payloads.back().data();
      views.push_back(std::move(view));
    }
  }
  // Interleave dtypes of different sizes so that offsets are not all aligned.
  std::shuffle(views.begin(), views.end(), rng);

  TempDir dir;
  const auto path = dir / "all.safetensors";
  write_safetensors(path, views);
  const auto in_memory = serialize_safetensors(views);
  CHECK(read_bytes(path) == in_memory);
  CHECK(dir.entries() == std::vector<std::string>{"all.safetensors"});

  for (int source = 0; source < 2; ++source) {
    CAPTURE(source);
    SafeTensorsFile file = source == 0 ? SafeTensorsFile::open(path)
                                       : SafeTensorsFile::from_bytes(in_memory, "in-memory");
    REQUIRE(file.tensors().size() == views.size());
    CHECK(file.metadata().empty());
    CHECK(file.file_size() == in_memory.size());
    // Header padding: the data section starts 8-byte aligned.
    CHECK(file.tensors().front().data_offset % 8 == 0);
    std::uint64_t expected_offset = file.tensors().front().data_offset;
    for (std::size_t i = 0; i < views.size(); ++i) {
      const TensorView& view = views[i];
      const TensorInfo& info = file.tensors()[i];  // file order = written order
      CAPTURE(view.name);
      CHECK(info.name == view.name);
      CHECK(info.dtype == view.dtype);
      CHECK(info.shape == view.shape);
      CHECK(info.data_offset == expected_offset);
      CHECK(info.byte_size == element_count(view.shape) * size_of(view.dtype));
      CHECK(info.element_count() == element_count(view.shape));
      CHECK(file.find(view.name) == &info);
      const auto bytes = file.data(info);
      REQUIRE(bytes.size() == info.byte_size);
      if (!bytes.empty()) CHECK(std::memcmp(bytes.data(), view.data, bytes.size()) == 0);
      expected_offset += info.byte_size;
    }
    CHECK(expected_offset == file.file_size());
    CHECK(file.find("missing") == nullptr);
  }
}

TEST_CASE("scalar and empty tensors round trip with exact shapes") {
  const double scalar = -0.1;
  TempDir dir;
  write_safetensors(dir / "s.safetensors",
                    {TensorView{"scalar", TensorDType::F64, {}, &scalar},
                     TensorView{"empty", TensorDType::F32, {4, 0}, nullptr},
                     TensorView{"empty_too", TensorDType::I8, {0}, nullptr}});
  const auto file = SafeTensorsFile::open(dir / "s.safetensors");
  REQUIRE(file.tensors().size() == 3);
  CHECK(file.at("scalar").shape.empty());
  CHECK(file.at("scalar").element_count() == 1);
  CHECK(file.read_as_float32("scalar") == std::vector<float>{static_cast<float>(scalar)});
  CHECK(file.at("empty").shape == std::vector<std::int64_t>{4, 0});
  CHECK(file.data(file.at("empty")).empty());
  CHECK(file.read_as_float32("empty").empty());
  CHECK(file.at("empty_too").byte_size == 0);
}

TEST_CASE("metadata round trip") {
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {"empty", ""},
      {"config", R"({"block_out_channels": [32, 64], "nested": {"q": "\"x\""}})"},
      {"unicode \xce\xbb", "caf\xc3\xa9 \xe2\x9c\x93"},
      {"newlines", "a\nb\tc\\"}};
  const float w[2] = {1.0f, 2.0f};
  TempDir dir;
  write_safetensors(dir / "m.safetensors", {TensorView{"w", TensorDType::F32, {2}, w}}, metadata);
  const auto file = SafeTensorsFile::open(dir / "m.safetensors");
  CHECK(file.metadata() == metadata);
  CHECK(file.read_as_float32("w") == std::vector<float>{1.0f, 2.0f});

  // Only metadata, no tensors.
  const auto bytes = serialize_safetensors({}, {{"k", "v"}});
  const auto only = SafeTensorsFile::from_bytes(bytes, "only-metadata");
  CHECK(only.tensors().empty());
  CHECK(only.metadata() == std::map<std::string, std::string>{{"k", "v"}});
}

TEST_CASE("read_as_float32 converts the float dtypes and rejects the others") {
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 3.0);
  const std::size_t n = 1001;
  std::vector<double> f64(n);
  std::vector<float> f32(n);
  std::vector<std::uint16_t> f16(n), bf16(n);
  for (std::size_t i = 0; i < n; ++i) {
    f64[i] = normal(rng);
    f32[i] = static_cast<float>(normal(rng));
    f16[i] = zero::float_to_fp16_bits(static_cast<float>(normal(rng)));
    bf16[i] = zero::float_to_bf16_bits(static_cast<float>(normal(rng)));
  }
  const std::int32_t ints[3] = {1, 2, 3};
  const std::int64_t shape = static_cast<std::int64_t>(n);
  const auto bytes = serialize_safetensors({
      {"f64", TensorDType::F64, {shape}, f64.data()},
      {"f32", TensorDType::F32, {shape}, f32.data()},
      {"f16", TensorDType::F16, {shape}, f16.data()},
      {"bf16", TensorDType::BF16, {shape}, bf16.data()},
      {"ints", TensorDType::I32, {3}, ints},
  });
  const auto file = SafeTensorsFile::from_bytes(bytes, "floats.safetensors");
  const auto r64 = file.read_as_float32("f64");
  const auto r32 = file.read_as_float32("f32");
  const auto r16 = file.read_as_float32("f16");
  const auto rb16 = file.read_as_float32("bf16");
  REQUIRE(r64.size() == n);
  for (std::size_t i = 0; i < n; ++i) {
    CHECK(r64[i] == static_cast<float>(f64[i]));
    CHECK(r32[i] == f32[i]);
    CHECK(r16[i] == zero::fp16_bits_to_float(f16[i]));
    CHECK(rb16[i] == zero::bf16_bits_to_float(bf16[i]));
  }
  const std::string wrong_dtype = io_error_of([&] { (void)file.read_as_float32("ints"); });
  CHECK(wrong_dtype.find("floats.safetensors") != std::string::npos);
  CHECK(wrong_dtype.find("'ints'") != std::string::npos);
  CHECK(wrong_dtype.find("I32") != std::string::npos);
  const std::string missing = io_error_of([&] { (void)file.read_as_float32("nope"); });
  CHECK(missing.find("'nope'") != std::string::npos);
  CHECK(missing.find("floats.safetensors") != std::string::npos);
}

TEST_CASE("writer rejects bad input and leaves no file behind") {
  const float w[4] = {};
  TempDir dir;
  const auto path = dir / "bad.safetensors";
  using Views = std::vector<TensorView>;
  CHECK_THROWS_AS(write_safetensors(path, Views{{"a", TensorDType::F32, {4}, w},
                                                {"a", TensorDType::F32, {4}, w}}),
                  zero::InvalidArgument);
  CHECK_THROWS_AS(write_safetensors(path, Views{{"a", TensorDType::F32, {-1, -4}, w}}),
                  zero::InvalidArgument);
  CHECK_THROWS_AS(write_safetensors(path, Views{{"__metadata__", TensorDType::F32, {4}, w}}),
                  zero::InvalidArgument);
  CHECK_THROWS_AS(write_safetensors(path, Views{{"a", TensorDType::F32, {4}, nullptr}}),
                  zero::InvalidArgument);
  CHECK_THROWS_AS(write_safetensors(path, Views{{"a", TensorDType::F32,
                                                 {std::int64_t{1} << 62, std::int64_t{1} << 62},
                                                 w}}),
                  zero::InvalidArgument);
  CHECK_THROWS_AS(write_safetensors(path, Views{{"a", static_cast<TensorDType>(42), {4}, w}}),
                  zero::InvalidArgument);
  CHECK_THROWS_AS(write_safetensors(path, Views{{"bad\xff", TensorDType::F32, {4}, w}}),
                  zero::InvalidArgument);
  CHECK_THROWS_AS(write_safetensors(path, Views{}, {{"k", "bad\xc3"}}), zero::InvalidArgument);
  CHECK(dir.entries().empty());
}

TEST_CASE("tensors() is in data order even when the header lists them otherwise") {
  std::vector<std::byte> data(24);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::byte>(i);
  // Zero-sized tensors at the same offset keep their header order.
  const std::string header =
      R"({"c":{"dtype":"U8","shape":[8],"data_offsets":[16,24]},)"
      R"("z2":{"dtype":"F32","shape":[0],"data_offsets":[8,8]},)"
      R"("a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
      R"("z1":{"dtype":"F32","shape":[2,0],"data_offsets":[8,8]},)"
      R"("b":{"dtype":"I16","shape":[2,2],"data_offsets":[8,16]}})";
  const auto file = SafeTensorsFile::from_bytes(with_header(header, data), "order");
  std::vector<std::string> names;
  for (const auto& t : file.tensors()) names.push_back(t.name);
  CHECK(names == std::vector<std::string>{"a", "z2", "z1", "b", "c"});
  CHECK(std::to_integer<int>(file.data(*file.find("c"))[0]) == 16);
  CHECK(file.find("b")->data_offset == 8 + header.size() + 8);
}

TEST_CASE("SDXL tiny fixtures") {
  const auto weights = SafeTensorsFile::open(kFixtures / "sdxl/tiny_a_weights.safetensors");
  CHECK(weights.tensors().size() > 100);
  REQUIRE(weights.metadata().count("config") == 1);
  const auto config = nlohmann::json::parse(weights.metadata().at("config"));
  CHECK(config.at("block_out_channels") == nlohmann::json::array({32, 64}));
  CHECK(config.at("cross_attention_dim") == 64);
  std::uint64_t params = 0;
  for (const auto& t : weights.tensors()) {
    CHECK(t.dtype == TensorDType::F32);
    params += t.element_count();
  }
  CHECK(params * 4 + weights.tensors().front().data_offset == weights.file_size());
  const TensorInfo* bias = weights.find("add_embedding.linear_1.bias");
  REQUIRE(bias != nullptr);
  CHECK(bias->shape == std::vector<std::int64_t>{128});

  const auto io = SafeTensorsFile::open(kFixtures / "sdxl/tiny_a_io.safetensors");
  const TensorInfo& sample = io.at("sample");
  CHECK(sample.dtype == TensorDType::F32);
  CHECK(sample.shape == std::vector<std::int64_t>{2, 4, 32, 32});
  const TensorInfo& expected_f64 = io.at("expected_f64");
  CHECK(expected_f64.dtype == TensorDType::F64);
  CHECK(expected_f64.shape == std::vector<std::int64_t>{2, 4, 32, 32});
  CHECK(io.at("timestep").shape == std::vector<std::int64_t>{2});
  CHECK(io.at("encoder_hidden_states").shape == std::vector<std::int64_t>{2, 7, 64});
  // The float32 output is the float64 one rounded: the two must agree closely.
  const auto expected = io.read_as_float32("expected");
  const auto expected_from_f64 = io.read_as_float32("expected_f64");
  REQUIRE(expected.size() == 2 * 4 * 32 * 32);
  REQUIRE(expected_from_f64.size() == expected.size());
  double max_diff = 0, max_abs = 0;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    max_diff = std::max(max_diff, std::abs(double(expected[i]) - double(expected_from_f64[i])));
    max_abs = std::max(max_abs, std::abs(double(expected[i])));
  }
  CHECK(max_abs > 0.0);  // not all zeros
  CHECK(max_diff <= 1e-5 * std::max(1.0, max_abs));
}

TEST_CASE("good corpus files have their known contents") {
  const auto dir = kFixtures / "safetensors/good";
  const auto mixed = SafeTensorsFile::open(dir / "mixed_dtypes.safetensors");
  CHECK(mixed.metadata().at("format") == "pt");
  CHECK(mixed.tensors().size() == 7);
  CHECK(mixed.read_as_float32("scalar_f64") == std::vector<float>{-2.5f});
  CHECK(mixed.read_as_float32("weight_f32") ==
        std::vector<float>{-1.0f, -0.5f, 0.0f, 0.5f, 1.0f, 1.5f});
  CHECK(mixed.read_as_float32("bias_bf16") == std::vector<float>{1.0f, -2.0f, 0.125f, 0.0f});
  CHECK(mixed.read_as_float32("half_f16") == std::vector<float>{1.0f, -0.5f, 65504.0f});
  const auto steps = mixed.data(mixed.at("steps_i64"));
  std::int64_t i64[2];
  REQUIRE(steps.size() == sizeof i64);
  std::memcpy(i64, steps.data(), sizeof i64);
  CHECK(i64[0] == -7);
  CHECK(i64[1] == std::int64_t{1} << 40);
  const auto mask = mixed.data(mixed.at("mask_bool"));
  CHECK(std::to_integer<int>(mask[0]) == 1);
  CHECK(std::to_integer<int>(mask[1]) == 0);
  CHECK(mixed.at("empty_u8").shape == std::vector<std::int64_t>{0, 3});

  const auto empty = SafeTensorsFile::open(dir / "empty.safetensors");
  CHECK(empty.tensors().empty());
  CHECK(empty.metadata().empty());

  const auto unaligned = SafeTensorsFile::open(dir / "unaligned.safetensors");
  CHECK(unaligned.at("w").data_offset % 2 == 1);
  CHECK(unaligned.read_as_float32("w") == std::vector<float>{1.5f, -3.0f, 1e-3f});
}

TEST_CASE("every malformed corpus file is rejected with a clear IoError") {
  const auto root = kFixtures / "safetensors";
  std::ifstream manifest(root / "bad_expected.tsv");
  REQUIRE(manifest);
  std::map<std::string, std::string> expected;
  for (std::string line; std::getline(manifest, line);) {
    if (line.empty() || line[0] == '#') continue;
    const auto tab = line.find('\t');
    REQUIRE(tab != std::string::npos);
    expected.emplace(line.substr(0, tab), line.substr(tab + 1));
  }
  std::set<std::string> seen;
  for (const auto& entry : std::filesystem::directory_iterator(root / "bad")) {
    const std::string name = entry.path().filename().string();
    seen.insert(name);
    CAPTURE(name);
    REQUIRE_MESSAGE(expected.count(name) == 1, "file missing from bad_expected.tsv");
    const std::string message = io_error_of([&] { (void)SafeTensorsFile::open(entry.path()); });
    CAPTURE(message);
    CHECK(message.find(entry.path().string()) != std::string::npos);
    CHECK(message.find(expected[name]) != std::string::npos);
    CHECK(message.find("expected") != std::string::npos);
    // The in-memory path reports the same defect under the given name.
    const std::string from_memory = io_error_of(
        [&] { (void)SafeTensorsFile::from_bytes(read_bytes(entry.path()), "mem:" + name); });
    CHECK(from_memory.find("mem:" + name) != std::string::npos);
    CHECK(from_memory.find(expected[name]) != std::string::npos);
  }
  CHECK(seen.size() >= 20);
  CHECK(seen.size() == expected.size());
}

TEST_CASE("open reports missing files and directories") {
  TempDir dir;
  const std::string missing = io_error_of([&] { (void)SafeTensorsFile::open(dir / "nope.safetensors"); });
  CHECK(missing.find((dir / "nope.safetensors").string()) != std::string::npos);
  CHECK(missing.find("No such file or directory") != std::string::npos);
  const std::string directory = io_error_of([&] { (void)SafeTensorsFile(dir.path()); });
  CHECK(directory.find("not a regular file") != std::string::npos);
  zero::io::testing::write_text(dir / "empty.safetensors", "");
  const std::string empty = io_error_of([&] { (void)SafeTensorsFile::open(dir / "empty.safetensors"); });
  CHECK(empty.find("file is 0 bytes") != std::string::npos);
}

TEST_CASE("every truncation and every single-byte corruption of a good file is handled") {
  const auto good = read_bytes(kFixtures / "safetensors/good/mixed_dtypes.safetensors");
  for (std::size_t length = 0; length < good.size(); ++length) {
    CAPTURE(length);
    std::vector<std::byte> prefix(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(length));
    CHECK_THROWS_AS((void)SafeTensorsFile::from_bytes(std::move(prefix), "truncated"), zero::IoError);
  }
  // One extra byte at the end is a hole.
  auto longer = good;
  longer.push_back(std::byte{0});
  CHECK_THROWS_AS((void)SafeTensorsFile::from_bytes(longer, "longer"), zero::IoError);

  // Corrupting a byte either keeps the file valid (e.g. inside tensor data or
  // a metadata string) or gives IoError: nothing else may escape.
  const std::uint8_t replacements[] = {0x00, 0x7b, 0x22, 0x2c, 0x5d, 0x30, 0x39, 0xff};
  std::size_t rejected = 0;
  for (std::size_t pos = 0; pos < good.size(); ++pos) {
    for (std::uint8_t r : replacements) {
      auto mutated = good;
      mutated[pos] = static_cast<std::byte>(r);
      try {
        const auto file = SafeTensorsFile::from_bytes(std::move(mutated), "mutated");
        for (const auto& t : file.tensors()) CHECK(file.data(t).size() == t.byte_size);
      } catch (const zero::IoError&) {
        ++rejected;
      } catch (const std::exception& e) {
        FAIL("position " << pos << " byte " << int(r) << ": " << e.what());
      }
    }
  }
  CHECK(rejected > 0);
}

TEST_CASE("files are movable and data() refuses foreign tensors") {
  const auto bytes = serialize_safetensors({});
  auto small = SafeTensorsFile::from_bytes(bytes, "small");
  auto big = SafeTensorsFile::open(kFixtures / "safetensors/good/mixed_dtypes.safetensors");
  const TensorInfo foreign = big.at("weight_f32");
  CHECK_THROWS_AS((void)small.data(foreign), zero::InvalidArgument);

  SafeTensorsFile moved(std::move(big));
  CHECK(moved.read_as_float32("weight_f32").size() == 6);
  small = std::move(moved);
  CHECK(small.read_as_float32("weight_f32").size() == 6);
  CHECK(small.path().filename() == "mixed_dtypes.safetensors");
}

TEST_CASE("hostile headers: deep nesting and many tensors") {
  // A million nested arrays in every kind of field: rejected, and neither
  // parsing nor rendering the message may recurse that deep.
  const std::string deep = std::string(1'000'000, '[') + std::string(1'000'000, ']');
  for (const std::string& header :
       {R"({"w":{"dtype":"F32","shape":)" + deep + R"(,"data_offsets":[0,0]}})",
        R"({"w":{"dtype":)" + deep + R"(,"shape":[0],"data_offsets":[0,0]}})",
        R"({"w":{"dtype":"F32","shape":[0],"data_offsets":)" + deep + "}}",
        R"({"__metadata__":{"k":)" + deep + "}}", R"({"w":)" + deep + "}"}) {
    const std::string message =
        io_error_of([&] { (void)SafeTensorsFile::from_bytes(with_header(header, {}), "deep"); });
    CHECK(message.size() < 1000);
  }

  // 50,000 tensors: reading and writing stay near-linear (an O(n^2) header
  // would take minutes here).
  const std::size_t n = 50'000;
  std::vector<std::uint8_t> values(n);
  std::vector<TensorView> views;
  views.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    values[i] = static_cast<std::uint8_t>(i * 7);
    views.push_back({"t." + std::to_string(n - i), TensorDType::U8, {1}, &values[i]});
  }
  const auto file = SafeTensorsFile::from_bytes(serialize_safetensors(views), "many");
  REQUIRE(file.tensors().size() == n);
  for (std::size_t i = 0; i < n; i += 997) {
    CHECK(file.tensors()[i].name == views[i].name);
    CHECK(std::to_integer<std::uint8_t>(file.data(file.tensors()[i])[0]) == values[i]);
  }
}

TEST_CASE("hostile headers: limits named before anything grows") {
  // 65 dimensions: over kMaxTensorRank, however valid the sizes.
  std::string shape = "[";
  for (int i = 0; i < 65; ++i) shape += i ? ",1" : "1";
  shape += "]";
  const std::string rank_message = io_error_of([&] {
    (void)SafeTensorsFile::from_bytes(
        with_header(R"({"w":{"dtype":"U8","shape":)" + shape + R"(,"data_offsets":[0,1]}})", {std::byte{0}}), "rank");
  });
  CHECK(rank_message.find("65 dimensions; expected at most 64 (kMaxTensorRank)") != std::string::npos);

  // 70,000 metadata strings: over kMaxMetadataValues, refused while reading.
  std::string metadata = R"({"__metadata__":{)";
  for (int i = 0; i < 70'000; ++i) metadata += (i ? ",\"k" : "\"k") + std::to_string(i) + "\":\"\"";
  metadata += "}}";
  const std::string metadata_message =
      io_error_of([&] { (void)SafeTensorsFile::from_bytes(with_header(metadata, {}), "metadata"); });
  CHECK(metadata_message.find("kMaxMetadataValues") != std::string::npos);

  // A repeated name is still found without a set of names: after the entries, by sorting.
  const std::string twice = io_error_of([&] {
    (void)SafeTensorsFile::from_bytes(
        with_header(R"({"b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                    R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]},)"
                    R"("b":{"dtype":"U8","shape":[1],"data_offsets":[2,3]}})",
                    {std::byte{0}, std::byte{0}, std::byte{0}}),
        "twice");
  });
  CHECK(twice.find("names 'b' more than once") != std::string::npos);
}
