// CRC-32C (Castagnoli polynomial, reflected 0x82F63B78): the checksum of
// checkpoint manifests and of TFRecord framing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string_view>

namespace zero::io {

/// CRC-32C of `data`. `crc` is a previous result to continue from, so
/// crc32c(b, crc32c(a)) == crc32c(a + b). crc32c("123456789") == 0xE3069283.
std::uint32_t crc32c(std::span<const std::byte> data, std::uint32_t crc = 0) noexcept;
std::uint32_t crc32c(std::string_view data, std::uint32_t crc = 0) noexcept;

/// CRC-32C of a whole file, read in pieces (constant memory). Throws
/// zero::IoError naming the path when it cannot be opened or read.
std::uint32_t file_crc32c(const std::filesystem::path& path);

}  // namespace zero::io
