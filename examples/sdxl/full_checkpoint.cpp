#include "full_checkpoint.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include "unet_io.hpp"
#include "zero/core/error.hpp"
#include "zero/io/crc32c.hpp"
#include "zero/io/safetensors.hpp"

namespace sdxl {

namespace fs = std::filesystem;
using zero::io::SafeTensorsFile;
using zero::io::TensorInfo;

namespace {

constexpr const char* kUNetPrefix = "model.diffusion_model.";
// Large enough that a multi-GB copy is a few hundred reads, small enough to
// be nothing next to the model the export holds.
constexpr std::size_t kCopyChunkBytes = std::size_t{16} << 20;

bool is_unet_name(const std::string& name) { return name.rfind(kUNetPrefix, 0) == 0; }

std::string errno_message(int error) { return std::error_code(error, std::generic_category()).message(); }

/// A file read with pread(2), closed on destruction.
class ReadOnlyFile {
 public:
  explicit ReadOnlyFile(fs::path path) : path_(std::move(path)) {
    do fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    while (fd_ < 0 && errno == EINTR);
    if (fd_ < 0) ZERO_THROW(zero::IoError, "cannot open '", path_.string(), "': ", errno_message(errno));
  }
  ~ReadOnlyFile() { ::close(fd_); }
  ReadOnlyFile(const ReadOnlyFile&) = delete;
  ReadOnlyFile& operator=(const ReadOnlyFile&) = delete;

  /// Exactly `size` bytes at `offset`; a short file is an error.
  void read_at(std::uint64_t offset, std::byte* into, std::size_t size) const {
    while (size > 0) {
      const ssize_t got = ::pread(fd_, into, size, static_cast<off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0)
        ZERO_THROW(zero::IoError, "cannot read '", path_.string(), "' at byte ", offset, ": ", errno_message(errno));
      if (got == 0)
        ZERO_THROW(zero::IoError, "'", path_.string(), "' ends at byte ", offset, " (", size,
                   " more bytes expected): was it truncated while being read?");
      into += got;
      offset += static_cast<std::uint64_t>(got);
      size -= static_cast<std::size_t>(got);
    }
  }

  /// Reads [offset, offset + size) in chunks of `buffer`, handing each to `use`.
  template <typename Use>
  void for_each_chunk(std::uint64_t offset, std::uint64_t size, std::vector<std::byte>& buffer, Use&& use) const {
    while (size > 0) {
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(size, buffer.size()));
      read_at(offset, buffer.data(), n);
      use(std::span<const std::byte>(buffer.data(), n));
      offset += n;
      size -= n;
    }
  }

 private:
  fs::path path_;
  int fd_ = -1;
};

SafeTensorsFile open_base(const fs::path& base) {
  const std::string where = "[output] export_full_checkpoint: base checkpoint '" + base.string() + "'";
  std::error_code ec;
  if (!fs::exists(base, ec)) ZERO_THROW(zero::IoError, where, " does not exist");
  if (!fs::is_regular_file(base, ec)) ZERO_THROW(zero::IoError, where, " is not a file");
  try {
    return SafeTensorsFile::open(base);
  } catch (const zero::Error& e) {
    ZERO_THROW(zero::IoError, where, " is not a readable safetensors file: ", e.message());
  }
}

/// Original name -> the model's parameter, for every parameter of the model.
std::map<std::string, torch::Tensor> unet_by_original_name(const UNet2DConditionModelImpl& model) {
  std::map<std::string, torch::Tensor> by_diffusers_name;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) by_diffusers_name.emplace(item.key(), item.value());
  std::map<std::string, torch::Tensor> out;
  for (const auto& [diffusers, original] : original_checkpoint_names(model))
    out.emplace(original, by_diffusers_name.at(diffusers));
  return out;
}

FullCheckpointBase check_base(const fs::path& base_path, const SafeTensorsFile& base,
                              const std::map<std::string, torch::Tensor>& unet) {
  std::vector<std::string> missing, misshapen, unexpected;
  std::set<std::string> present;
  FullCheckpointBase found{.tensors = base.tensors().size(), .file_size = base.file_size()};
  for (const TensorInfo& info : base.tensors()) {
    if (!is_unet_name(info.name)) continue;
    ++found.unet_tensors;
    auto it = unet.find(info.name);
    if (it == unet.end()) {
      unexpected.push_back(info.name);
      continue;
    }
    present.insert(info.name);
    const std::vector<std::int64_t> expected(it->second.sizes().begin(), it->second.sizes().end());
    if (info.shape != expected)
      misshapen.push_back(info.name + ": base " + shape_text(info.shape) + ", trained UNet " + shape_text(expected));
  }
  for (const auto& [name, tensor] : unet)
    if (present.count(name) == 0) missing.push_back(name);
  if (!missing.empty() || !misshapen.empty() || !unexpected.empty()) {
    std::ostringstream out;
    out << "[output] export_full_checkpoint: the UNet of base checkpoint '" << base_path.string()
        << "' does not match the trained UNet (" << unet.size()
        << " tensors named \"model.diffusion_model.*\" expected); use the base of the model being trained:";
    append_list(out, "missing tensors", missing);
    append_list(out, "tensors with another shape", misshapen);
    append_list(out, "tensors the trained UNet does not have", unexpected);
    ZERO_THROW(zero::IoError, out.str());
  }
  if (found.tensors == found.unet_tensors)
    ZERO_THROW(zero::IoError, "[output] export_full_checkpoint: base checkpoint '", base_path.string(), "' holds only ",
               found.unet_tensors, " UNet tensors (\"model.diffusion_model.*\"), no VAE (\"first_stage_model.*\") or "
               "text encoders (\"conditioner.*\"): pass a full SDXL checkpoint such as sd_xl_base_1.0.safetensors");
  return found;
}

}  // namespace

FullCheckpointBase check_full_checkpoint_base(const fs::path& base, const UNet2DConditionModelImpl& model) {
  const SafeTensorsFile file = open_base(base);
  return check_base(base, file, unet_by_original_name(model));
}

FullCheckpointWritten write_full_checkpoint(const fs::path& base_path, const UNet2DConditionModelImpl& model,
                                            torch::ScalarType dtype, const fs::path& out) {
  // Checked again: the base may have changed during the hours of training.
  const std::map<std::string, torch::Tensor> unet = unet_by_original_name(model);
  const SafeTensorsFile base = open_base(base_path);
  check_base(base_path, base, unet);
  const zero::io::TensorDType unet_dtype = safetensors_dtype_of(dtype);

  // The base's tensors in its data order; the UNet's with the trained shape in `dtype`.
  std::vector<zero::io::TensorSpec> specs;
  for (const TensorInfo& info : base.tensors())
    specs.push_back({info.name, is_unet_name(info.name) ? unet_dtype : info.dtype, info.shape});

  FullCheckpointWritten written;
  std::vector<std::uint32_t> expected_crc(specs.size());
  std::vector<std::byte> buffer(kCopyChunkBytes);
  {
    zero::io::SafeTensorsStreamWriter writer(out, specs, base.metadata());
    const ReadOnlyFile source(base_path);
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const TensorInfo& info = base.tensors()[i];
      std::uint32_t crc = 0;
      if (is_unet_name(info.name)) {
        // One tensor converted at a time: the export holds one model, not two.
        const torch::Tensor t = unet.at(info.name).detach().to(torch::kCPU, dtype).contiguous();
        const std::span<const std::byte> bytes(static_cast<const std::byte*>(t.data_ptr()), t.nbytes());
        crc = zero::io::crc32c(bytes);
        writer.append(bytes);
        ++written.unet_tensors;
      } else {
        source.for_each_chunk(info.data_offset, info.byte_size, buffer, [&](std::span<const std::byte> chunk) {
          crc = zero::io::crc32c(chunk, crc);
          writer.append(chunk);
        });
        written.copied_bytes += info.byte_size;
      }
      expected_crc[i] = crc;
    }
    writer.commit();
    written.file_size = writer.file_size();
    written.tensors = specs.size();
  }

  // Read back: what a loader will see.
  auto refuse = [&](const std::string& why) {
    std::error_code ec;
    fs::remove(out, ec);
    ZERO_THROW(zero::IoError, "[output] export_full_checkpoint: '", out.string(), "' read back ", why,
               "; the file was removed");
  };
  const SafeTensorsFile back = SafeTensorsFile::open(out);  // validates the header and the layout
  if (back.file_size() != written.file_size)
    refuse("has " + std::to_string(back.file_size()) + " bytes, " + std::to_string(written.file_size) + " were written");
  if (back.metadata() != base.metadata()) refuse("has other metadata than the base");
  if (back.tensors().size() != specs.size())
    refuse("holds " + std::to_string(back.tensors().size()) + " tensors, " + std::to_string(specs.size()) +
           " were written");
  std::uint64_t data_bytes = 0;
  for (const TensorInfo& info : back.tensors()) data_bytes += info.byte_size;
  const ReadOnlyFile readback(out);
  std::uint32_t file_crc = 0;
  // Everything before the data (length and header), then each tensor in file order.
  readback.for_each_chunk(0, back.file_size() - data_bytes, buffer,
                          [&](std::span<const std::byte> chunk) { file_crc = zero::io::crc32c(chunk, file_crc); });
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const TensorInfo& info = back.tensors()[i];
    const zero::io::TensorSpec& spec = specs[i];
    if (info.name != spec.name || info.dtype != spec.dtype || info.shape != spec.shape)
      refuse("has tensor " + std::to_string(i) + " '" + info.name + "' " + std::string(zero::io::name_of(info.dtype)) +
             " " + shape_text(info.shape) + " where '" + spec.name + "' " + std::string(zero::io::name_of(spec.dtype)) +
             " " + shape_text(spec.shape) + " was written");
    std::uint32_t crc = 0;
    readback.for_each_chunk(info.data_offset, info.byte_size, buffer, [&](std::span<const std::byte> chunk) {
      crc = zero::io::crc32c(chunk, crc);
      file_crc = zero::io::crc32c(chunk, file_crc);
    });
    if (crc != expected_crc[i])
      refuse("has other bytes in tensor '" + info.name + "' than " +
             (is_unet_name(info.name) ? "the trained UNet's that were written" : "the base's"));
  }
  written.crc32c = file_crc;
  return written;
}

}  // namespace sdxl
