#include "jsonl_writer.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iterator>
#include <utility>

#include "zero/core/error.hpp"
#include "zero/io/atomic_file.hpp"

namespace sdxl::metrics {
namespace {

using nlohmann::json;

// The fixed fields in the order a line shows them: step first so that lines
// read well with `grep`/`less`, the run's timing last.
constexpr std::array<const char*, 12> kFieldNames = {
    "step",          "loss",          "lr",          "grad_norm",
    "images_per_s",  "mem_max_bytes", "mem_min_bytes", "loss_scale",
    "skipped_steps", "elapsed_s",     "time",        "extra"};

double unix_time_now() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

// Non-ASCII tags from a caller that are not valid UTF-8 must not make a
// logging call throw in the middle of a training run.
std::string dump_value(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

using Fields = std::vector<std::pair<std::string, json>>;

Fields ordered_fields(const StepRecord& r) {
  Fields fields;
  fields.emplace_back("step", r.step);
  auto put = [&](const char* name, const auto& field) {
    if (field) fields.emplace_back(name, *field);
  };
  put("loss", r.loss);
  put("lr", r.lr);
  put("grad_norm", r.grad_norm);
  put("images_per_s", r.images_per_s);
  put("mem_max_bytes", r.mem_max_bytes);
  put("mem_min_bytes", r.mem_min_bytes);
  put("loss_scale", r.loss_scale);
  put("skipped_steps", r.skipped_steps);
  put("elapsed_s", r.elapsed_s);
  put("time", r.time);
  for (const auto& [key, value] : r.extra) {
    for (const char* fixed : kFieldNames)
      ZERO_CHECK(key != fixed, "StepRecord::extra key \"", key,
                 "\" collides with a field of StepRecord; set the field instead");
    fields.emplace_back(key, value);
  }
  return fields;
}

std::string serialize(const Fields& fields) {
  std::string line = "{";
  for (std::size_t i = 0; i < fields.size(); ++i) {
    if (i) line += ',';
    line += dump_value(json(fields[i].first));
    line += ':';
    line += dump_value(fields[i].second);
  }
  line += "}\n";
  return line;
}

std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) ZERO_THROW(zero::IoError, "cannot read ", path.string(), ": ", std::strerror(errno));
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

bool is_blank(std::string_view text) {
  return text.find_first_not_of(" \t\r") == std::string_view::npos;
}

struct ScannedLine {
  std::int64_t step;
  std::size_t begin;
  std::size_t end;  // one past the '\n'
};

struct Scan {
  std::vector<ScannedLine> lines;
  // Bytes up to and including the last '\n'; what follows is a torn line.
  std::size_t complete_bytes = 0;
};

Scan scan_lines(const std::string& content, const std::filesystem::path& path) {
  Scan scan;
  std::size_t begin = 0;
  std::size_t number = 0;
  while (begin < content.size()) {
    std::size_t newline = content.find('\n', begin);
    if (newline == std::string::npos) break;  // torn: the writer died mid-line
    ++number;
    std::string_view text(content.data() + begin, newline - begin);
    if (!is_blank(text)) {
      json object = json::parse(text, nullptr, /*allow_exceptions=*/false);
      if (!object.is_object() || !object.contains("step") || !object["step"].is_number_integer())
        ZERO_THROW(zero::IoError, path.string(), ":", number,
                   ": not a JSON object with an integer \"step\": ",
                   std::string(text.substr(0, 120)));
      scan.lines.push_back({object["step"].get<std::int64_t>(), begin, newline + 1});
    }
    begin = newline + 1;
    scan.complete_bytes = begin;
  }
  return scan;
}

int open_for_append(const std::filesystem::path& path) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0)
    ZERO_THROW(zero::IoError, "cannot open ", path.string(), " for appending: ",
               std::strerror(errno));
  return fd;
}

}  // namespace

nlohmann::json StepRecord::to_json() const {
  json object = json::object();
  for (auto& [key, value] : ordered_fields(*this)) object[key] = std::move(value);
  return object;
}

JsonlWriter::JsonlWriter(std::filesystem::path path) : path_(std::move(path)) {
  fd_ = open_for_append(path_);
  try {
    std::string content = read_text(path_);
    Scan scan = scan_lines(content, path_);
    if (scan.complete_bytes < content.size() &&
        ::ftruncate(fd_, static_cast<off_t>(scan.complete_bytes)) != 0)
      ZERO_THROW(zero::IoError, "cannot cut the torn last line of ", path_.string(), ": ",
                 std::strerror(errno));
    line_count_ = scan.lines.size();
    if (!scan.lines.empty()) last_step_ = scan.lines.back().step;
  } catch (...) {
    close();
    throw;
  }
}

JsonlWriter::~JsonlWriter() { close(); }

JsonlWriter::JsonlWriter(JsonlWriter&& other) noexcept
    : path_(std::move(other.path_)),
      fd_(std::exchange(other.fd_, -1)),
      last_step_(other.last_step_),
      line_count_(other.line_count_) {}

JsonlWriter& JsonlWriter::operator=(JsonlWriter&& other) noexcept {
  if (this != &other) {
    close();
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    last_step_ = other.last_step_;
    line_count_ = other.line_count_;
  }
  return *this;
}

void JsonlWriter::close() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void JsonlWriter::write(const StepRecord& record) {
  ZERO_CHECK(!last_step_ || record.step > *last_step_, "step ", record.step,
             " is not after the last logged step ", *last_step_, " in ", path_.string(),
             "; a resumed run calls truncate_after(resume_step) first");
  Fields fields = ordered_fields(record);
  if (!record.time) {
    // Before the extra scalars, where the field order puts it.
    std::size_t extra_begin = fields.size() - record.extra.size();
    fields.insert(fields.begin() + static_cast<std::ptrdiff_t>(extra_begin),
                  {"time", unix_time_now()});
  }
  append_line(serialize(fields));
  last_step_ = record.step;
}

void JsonlWriter::write(const nlohmann::json& object) {
  ZERO_CHECK(object.is_object(), "JsonlWriter::write takes a JSON object, got ",
             object.type_name());
  auto step_it = object.find("step");
  ZERO_CHECK(step_it != object.end() && step_it->is_number_integer(),
             "JsonlWriter::write: the object needs an integer \"step\"");
  const auto step = step_it->get<std::int64_t>();
  ZERO_CHECK(!last_step_ || step > *last_step_, "step ", step,
             " is not after the last logged step ", *last_step_, " in ", path_.string(),
             "; a resumed run calls truncate_after(resume_step) first");
  Fields fields;
  fields.emplace_back("step", step);
  for (const auto& [key, value] : object.items())
    if (key != "step") fields.emplace_back(key, value);
  if (!object.contains("time")) fields.emplace_back("time", unix_time_now());
  append_line(serialize(fields));
  last_step_ = step;
}

void JsonlWriter::append_line(const std::string& line) {
  ZERO_CHECK(fd_ >= 0, "JsonlWriter was moved from");
  // One write(2) per line: with O_APPEND the line lands whole at the end of
  // the file unless the disk fills up; the loop only handles short writes.
  std::size_t done = 0;
  while (done < line.size()) {
    ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      ZERO_THROW(zero::IoError, "cannot append to ", path_.string(), ": ", std::strerror(errno));
    }
    done += static_cast<std::size_t>(n);
  }
  ++line_count_;
}

std::size_t JsonlWriter::truncate_after(std::int64_t step) {
  ZERO_CHECK(fd_ >= 0, "JsonlWriter was moved from");
  std::string content = read_text(path_);
  Scan scan = scan_lines(content, path_);
  std::string kept;
  kept.reserve(scan.complete_bytes);
  std::optional<std::int64_t> last;
  std::size_t kept_lines = 0;
  for (const ScannedLine& line : scan.lines) {
    if (line.step > step) continue;
    kept.append(content, line.begin, line.end - line.begin);
    last = line.step;
    ++kept_lines;
  }
  const std::size_t removed = scan.lines.size() - kept_lines;
  if (removed == 0 && scan.complete_bytes == content.size()) return 0;

  zero::io::write_file_atomically(path_, std::as_bytes(std::span<const char>(kept)));
  // The rename put a new file under the name; our descriptor still points at
  // the old one, so reopen before closing it (a failure keeps the old state).
  int fresh = open_for_append(path_);
  close();
  fd_ = fresh;
  last_step_ = last;
  line_count_ = kept_lines;
  return removed;
}

std::vector<nlohmann::json> JsonlWriter::read_all(const std::filesystem::path& path) {
  std::string content = read_text(path);
  std::vector<json> objects;
  std::size_t begin = 0;
  std::size_t number = 0;
  while (begin < content.size()) {
    std::size_t newline = content.find('\n', begin);
    std::size_t end = newline == std::string::npos ? content.size() : newline;
    ++number;
    std::string_view text(content.data() + begin, end - begin);
    if (!is_blank(text)) {
      json object = json::parse(text, nullptr, /*allow_exceptions=*/false);
      if (!object.is_object())
        ZERO_THROW(zero::IoError, path.string(), ":", number, ": not a JSON object");
      objects.push_back(std::move(object));
    }
    begin = end + 1;
  }
  return objects;
}

}  // namespace sdxl::metrics
