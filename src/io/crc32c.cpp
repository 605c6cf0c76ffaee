#include "zero/io/crc32c.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <vector>

#include "zero/core/error.hpp"

namespace zero::io {
namespace {

// Slicing-by-8 tables, built at compile time: table[0] is the byte-at-a-time
// table, table[k][i] the CRC of byte i followed by k zero bytes. Checkpoint
// shards run to gigabytes, so the 8-bytes-per-step loop is worth its 8 KiB.
constexpr std::array<std::array<std::uint32_t, 256>, 8> make_tables() {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t crc = i;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1u) ? 0x82F63B78u : 0u);
    t[0][i] = crc;
  }
  for (std::uint32_t i = 0; i < 256; ++i)
    for (int k = 1; k < 8; ++k) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFFu];
  return t;
}
constexpr auto kTables = make_tables();

}  // namespace

std::uint32_t crc32c(std::span<const std::byte> data, std::uint32_t crc) noexcept {
  crc = ~crc;
  const auto* p = reinterpret_cast<const std::uint8_t*>(data.data());
  std::size_t n = data.size();
  while (n >= 8) {
    // Little-endian assembly by hand: no alignment or byte-order assumption.
    const std::uint32_t lo = crc ^ (std::uint32_t{p[0]} | std::uint32_t{p[1]} << 8 | std::uint32_t{p[2]} << 16 |
                                    std::uint32_t{p[3]} << 24);
    crc = kTables[7][lo & 0xFFu] ^ kTables[6][(lo >> 8) & 0xFFu] ^ kTables[5][(lo >> 16) & 0xFFu] ^
          kTables[4][lo >> 24] ^ kTables[3][p[4]] ^ kTables[2][p[5]] ^ kTables[1][p[6]] ^ kTables[0][p[7]];
    p += 8;
    n -= 8;
  }
  while (n--) crc = kTables[0][(crc ^ *p++) & 0xFFu] ^ (crc >> 8);
  return ~crc;
}

std::uint32_t crc32c(std::string_view data, std::uint32_t crc) noexcept {
  return crc32c(std::as_bytes(std::span<const char>(data.data(), data.size())), crc);
}

std::uint32_t file_crc32c(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) ZERO_THROW(IoError, "cannot open ", path.string(), " to checksum it: ", std::strerror(errno));
  std::vector<std::byte> buffer(std::size_t{4} << 20);
  std::uint32_t crc = 0;
  for (;;) {
    const ssize_t got = ::read(fd, buffer.data(), buffer.size());
    if (got < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      ZERO_THROW(IoError, "cannot read ", path.string(), " to checksum it: ", std::strerror(err));
    }
    if (got == 0) break;
    crc = crc32c(std::span<const std::byte>(buffer.data(), static_cast<std::size_t>(got)), crc);
  }
  ::close(fd);
  return crc;
}

}  // namespace zero::io
