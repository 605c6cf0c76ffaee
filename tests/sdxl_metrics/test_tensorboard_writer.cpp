// The event files are checked with a decoder written here from the format's
// definition (TFRecord framing, protobuf wire format, event.proto and
// summary.proto field numbers) and a bit-at-a-time CRC-32C, so that it shares
// no code with the writer's table-driven one.
#include "tensorboard_writer.hpp"

#include <doctest/doctest.h>
#include <unistd.h>

#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "../io/temp_dir.hpp"
#include "zero/core/error.hpp"

using namespace sdxl::metrics;
using zero::io::testing::read_text;
using zero::io::testing::TempDir;

namespace {

// ---------------------------------------------------------------- independent decoder

std::uint32_t bitwise_crc32c(std::string_view data) {
  std::uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char byte : data) {
    crc ^= byte;
    for (int bit = 0; bit < 8; ++bit) crc = (crc & 1u) ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
  }
  return crc ^ 0xFFFFFFFFu;
}

std::uint32_t masked(std::uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

std::uint64_t read_le(std::string_view bytes, std::size_t size) {
  std::uint64_t value = 0;
  for (std::size_t i = 0; i < size; ++i)
    value |= static_cast<std::uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  return value;
}

// Splits a TFRecord stream into payloads, checking both CRCs of every record.
std::vector<std::string> read_records(std::string_view file) {
  std::vector<std::string> records;
  std::size_t pos = 0;
  while (pos < file.size()) {
    REQUIRE(file.size() - pos >= 12);
    const std::string_view length_bytes = file.substr(pos, 8);
    const std::uint64_t length = read_le(length_bytes, 8);
    CHECK(read_le(file.substr(pos + 8, 4), 4) == masked(bitwise_crc32c(length_bytes)));
    REQUIRE(file.size() - pos - 12 >= length + 4);
    const std::string_view data = file.substr(pos + 12, length);
    CHECK(read_le(file.substr(pos + 12 + length, 4), 4) == masked(bitwise_crc32c(data)));
    records.emplace_back(data);
    pos += 12 + length + 4;
  }
  return records;
}

// A protobuf message as (field, wire type, value) triples.
struct Field {
  std::uint32_t number;
  int wire_type;
  std::uint64_t integer = 0;  // varint, fixed64 and fixed32 payloads
  std::string bytes;          // length-delimited payloads
};

std::uint64_t read_varint(std::string_view data, std::size_t& pos) {
  std::uint64_t value = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    REQUIRE(pos < data.size());
    const auto byte = static_cast<unsigned char>(data[pos++]);
    value |= static_cast<std::uint64_t>(byte & 0x7F) << shift;
    if (!(byte & 0x80)) return value;
  }
  FAIL("varint longer than 10 bytes");
  return 0;
}

std::vector<Field> parse_message(std::string_view data) {
  std::vector<Field> fields;
  std::size_t pos = 0;
  while (pos < data.size()) {
    const std::uint64_t key = read_varint(data, pos);
    Field field{static_cast<std::uint32_t>(key >> 3), static_cast<int>(key & 7), 0, {}};
    switch (field.wire_type) {
      case 0: field.integer = read_varint(data, pos); break;
      case 1:
        REQUIRE(data.size() - pos >= 8);
        field.integer = read_le(data.substr(pos, 8), 8);
        pos += 8;
        break;
      case 2: {
        const std::uint64_t length = read_varint(data, pos);
        REQUIRE(data.size() - pos >= length);
        field.bytes = std::string(data.substr(pos, length));
        pos += length;
        break;
      }
      case 5:
        REQUIRE(data.size() - pos >= 4);
        field.integer = read_le(data.substr(pos, 4), 4);
        pos += 4;
        break;
      default: FAIL("unexpected wire type " << field.wire_type);
    }
    fields.push_back(std::move(field));
  }
  return fields;
}

struct DecodedValue {
  std::string tag;
  std::optional<float> simple_value;
};

struct DecodedEvent {
  double wall_time = 0.0;
  std::int64_t step = 0;
  std::optional<std::string> file_version;
  std::optional<std::vector<DecodedValue>> summary;
  std::optional<std::uint64_t> session_status;
};

DecodedEvent decode_event(std::string_view data) {
  DecodedEvent event;
  for (const Field& f : parse_message(data)) {
    if (f.number == 1 && f.wire_type == 1) {
      event.wall_time = std::bit_cast<double>(f.integer);
    } else if (f.number == 2 && f.wire_type == 0) {
      event.step = static_cast<std::int64_t>(f.integer);
    } else if (f.number == 3 && f.wire_type == 2) {
      event.file_version = f.bytes;
    } else if (f.number == 5 && f.wire_type == 2) {
      event.summary.emplace();
      for (const Field& v : parse_message(f.bytes)) {
        REQUIRE(v.number == 1);
        REQUIRE(v.wire_type == 2);
        DecodedValue value;
        for (const Field& vf : parse_message(v.bytes)) {
          if (vf.number == 1 && vf.wire_type == 2) value.tag = vf.bytes;
          if (vf.number == 2 && vf.wire_type == 5)
            value.simple_value = std::bit_cast<float>(static_cast<std::uint32_t>(vf.integer));
        }
        event.summary->push_back(value);
      }
    } else if (f.number == 7 && f.wire_type == 2) {
      for (const Field& s : parse_message(f.bytes))
        if (s.number == 1 && s.wire_type == 0) event.session_status = s.integer;
    } else {
      FAIL("unexpected Event field " << f.number << " of wire type " << f.wire_type);
    }
  }
  return event;
}

std::vector<DecodedEvent> decode_file(const std::filesystem::path& path) {
  std::vector<DecodedEvent> events;
  for (const std::string& record : read_records(read_text(path))) events.push_back(decode_event(record));
  return events;
}

double now() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

std::string bytes_of(std::initializer_list<int> values) {
  std::string bytes;
  for (int v : values) bytes.push_back(static_cast<char>(v));
  return bytes;
}

}  // namespace

TEST_CASE("crc32c: known test vectors, both implementations") {
  const std::string digits = "123456789";
  const std::string zeros(32, '\0');
  const std::string ones(32, '\xff');
  std::string ascending;
  for (int i = 0; i < 32; ++i) ascending.push_back(static_cast<char>(i));
  // The check value of CRC-32C and the iSCSI vectors of RFC 3720, B.4.
  for (auto crc : {crc32c(digits), bitwise_crc32c(digits)}) CHECK(crc == 0xE3069283u);
  for (auto crc : {crc32c(zeros), bitwise_crc32c(zeros)}) CHECK(crc == 0x8A9136AAu);
  for (auto crc : {crc32c(ones), bitwise_crc32c(ones)}) CHECK(crc == 0x62A8AB43u);
  for (auto crc : {crc32c(ascending), bitwise_crc32c(ascending)}) CHECK(crc == 0x46DD794Eu);
  CHECK(crc32c(std::string_view{}) == 0u);
  // Continuing from a previous value equals checksumming the concatenation.
  CHECK(crc32c("56789", crc32c("1234")) == 0xE3069283u);
  CHECK(mask_crc32c(0xE3069283u) == masked(0xE3069283u));
}

TEST_CASE("tfrecord framing of a payload") {
  std::string out;
  append_tfrecord(out, "abc");
  REQUIRE(out.size() == 8 + 4 + 3 + 4);
  CHECK(out.substr(0, 8) == bytes_of({3, 0, 0, 0, 0, 0, 0, 0}));
  const auto records = read_records(out);
  REQUIRE(records.size() == 1);
  CHECK(records[0] == "abc");
}

TEST_CASE("scalar Event bytes, encoded by hand from summary.proto") {
  const Scalar x{"x", 1.0};
  const std::string expected =
      bytes_of({0x09, 0, 0, 0, 0, 0, 0, 0xF8, 0x3F,  // wall_time = 1.5 (double, field 1)
                0x10, 0x03,                         // step = 3 (varint, field 2)
                0x2A, 0x0A,                         // summary (field 5), 10 bytes
                0x0A, 0x08,                         //   value (field 1), 8 bytes
                0x0A, 0x01, 'x',                    //     tag = "x"
                0x15, 0x00, 0x00, 0x80, 0x3F});     //     simple_value = 1.0f
  CHECK(encode_scalars_event(1.5, 3, std::span<const Scalar>(&x, 1)) == expected);

  // A negative step is a ten-byte varint; step 0 is left out (proto3 default).
  const DecodedEvent negative = decode_event(encode_scalars_event(2.0, -3, std::span<const Scalar>(&x, 1)));
  CHECK(negative.step == -3);
  const std::string zero_step = encode_scalars_event(2.0, 0, std::span<const Scalar>(&x, 1));
  CHECK(zero_step.find(static_cast<char>(0x10)) == std::string::npos);

  CHECK(encode_file_version_event(1.5, "brain.Event:2") ==
        bytes_of({0x09, 0, 0, 0, 0, 0, 0, 0xF8, 0x3F, 0x1A, 13}) + "brain.Event:2");
  CHECK(encode_session_start_event(1.5, 7) ==
        bytes_of({0x09, 0, 0, 0, 0, 0, 0, 0xF8, 0x3F, 0x10, 7, 0x3A, 0x02, 0x08, 0x01}));
}

TEST_CASE("image Event bytes, encoded by hand from summary.proto") {
  const Image image{.tag = "v/0", .height = 2, .width = 300, .colorspace = 3, .encoded = "PNG"};
  const std::string expected =
      bytes_of({0x09, 0, 0, 0, 0, 0, 0, 0xF8, 0x3F,  // wall_time = 1.5
                0x10, 0x04,                         // step = 4
                0x2A, 0x15,                         // summary (field 5), 21 bytes
                0x0A, 0x13,                         //   value (field 1), 19 bytes
                0x0A, 0x03, 'v', '/', '0',          //     tag = "v/0"
                0x22, 0x0C,                         //     image (field 4), 12 bytes
                0x08, 0x02,                         //       height = 2
                0x10, 0xAC, 0x02,                   //       width = 300
                0x18, 0x03,                         //       colorspace = 3
                0x22, 0x03, 'P', 'N', 'G'});        //       encoded_image_string
  CHECK(encode_image_event(1.5, 4, image) == expected);
}

TEST_CASE("TensorBoardWriter: the file decodes to the scalars written") {
  TempDir dir;
  const double before = now();
  std::filesystem::path path;
  {
    TensorBoardWriter writer(dir / "runs" / "sdxl");  // created with its parents
    path = writer.path();
    writer.add_scalar("train/loss", 0.125, 1);
    writer.add_scalar("train/lr", 1e-5, 1);
    writer.add_scalars({{"train/loss", 0.0}, {"train/grad_norm", -2.5}, {"mem/max_gib", 21.3}}, 2);
    writer.add_scalar("train/loss", std::numeric_limits<double>::quiet_NaN(), 3, 1234.5);
    writer.add_scalar("train/loss", 0.25, std::int64_t{1} << 40);
    writer.add_session_start(11);
    writer.flush();
  }
  const double after = now();

  const std::string name = path.filename().string();
  CHECK(name.rfind("events.out.tfevents.", 0) == 0);
  std::string pid_part = ".";  // built piecewise: GCC 12 warns falsely on "." + string
  pid_part += std::to_string(::getpid());
  pid_part += ".zero";
  CHECK(name.find(pid_part) != std::string::npos);
  CHECK(name.size() > 5);
  CHECK(name.substr(name.size() - 5) == ".zero");
  CHECK(path.parent_path() == dir / "runs" / "sdxl");

  const auto events = decode_file(path);
  REQUIRE(events.size() == 7);
  CHECK(events[0].file_version == "brain.Event:2");
  CHECK(events[0].wall_time >= before - 1);
  CHECK(events[0].wall_time <= after + 1);

  auto expect_scalar = [](const DecodedEvent& e, std::int64_t step, const std::string& tag, float value) {
    REQUIRE(e.summary.has_value());
    REQUIRE(e.summary->size() == 1);
    CHECK(e.step == step);
    CHECK((*e.summary)[0].tag == tag);
    REQUIRE((*e.summary)[0].simple_value.has_value());
    CHECK(*(*e.summary)[0].simple_value == value);
  };
  expect_scalar(events[1], 1, "train/loss", 0.125f);
  expect_scalar(events[2], 1, "train/lr", 1e-5f);
  CHECK(events[1].wall_time >= before - 1);
  CHECK(events[1].wall_time <= after + 1);

  REQUIRE(events[3].summary.has_value());
  REQUIRE(events[3].summary->size() == 3);
  CHECK(events[3].step == 2);
  CHECK((*events[3].summary)[0].tag == "train/loss");
  CHECK((*events[3].summary)[0].simple_value == 0.0f);  // present although 0
  CHECK((*events[3].summary)[1].simple_value == -2.5f);
  CHECK((*events[3].summary)[2].tag == "mem/max_gib");
  CHECK((*events[3].summary)[2].simple_value == 21.3f);

  REQUIRE(events[4].summary.has_value());
  CHECK(events[4].wall_time == 1234.5);
  CHECK(std::isnan(*(*events[4].summary)[0].simple_value));
  expect_scalar(events[5], std::int64_t{1} << 40, "train/loss", 0.25f);

  CHECK(events[6].step == 11);
  CHECK(events[6].session_status == 1u);  // SessionLog.START
  CHECK_FALSE(events[6].summary.has_value());
}

TEST_CASE("TensorBoardWriter: buffered until flush, flushed by the destructor") {
  TempDir dir;
  std::filesystem::path path;
  {
    TensorBoardWriter writer(dir.path(), {.flush_bytes = 1 << 20, .flush_interval = std::chrono::hours(1)});
    path = writer.path();
    CHECK(decode_file(path).size() == 1);  // the version record is written at once
    writer.add_scalar("a", 1.0, 1);
    writer.add_scalar("a", 2.0, 2);
    CHECK(decode_file(path).size() == 1);
    CHECK(writer.bytes() > std::filesystem::file_size(path));
    writer.flush();
    CHECK(decode_file(path).size() == 3);
    CHECK(writer.bytes() == std::filesystem::file_size(path));
    writer.add_scalar("a", 3.0, 3);
  }
  CHECK(decode_file(path).size() == 4);

  // A small size limit writes whole records as they come.
  TensorBoardWriter eager(dir / "eager", {.flush_bytes = 1});
  eager.add_scalar("b", 1.0, 1);
  CHECK(decode_file(eager.path()).size() == 2);
}

TEST_CASE("TensorBoardWriter: two writers in one directory get two files") {
  TempDir dir;
  TensorBoardWriter a(dir.path());
  TensorBoardWriter b(dir.path());
  CHECK(a.path() != b.path());
  a.add_scalar("x", 1.0, 1);
  b.add_scalar("x", 2.0, 1);
  a.flush();
  b.flush();
  CHECK(decode_file(a.path()).size() == 2);
  CHECK(decode_file(b.path()).size() == 2);
  CHECK(dir.entries().size() == 2);

  CHECK_THROWS_AS(a.add_scalar("", 1.0, 1), zero::InvalidArgument);
  CHECK_THROWS_AS(a.add_scalars({{"", 1.0}}, 1), zero::InvalidArgument);
}

TEST_CASE("TensorBoardWriter: an unusable directory is an IoError") {
  TempDir dir;
  zero::io::testing::write_text(dir / "file", "x");
  CHECK_THROWS_AS(TensorBoardWriter(dir / "file" / "runs"), zero::IoError);
}
