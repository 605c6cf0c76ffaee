// libFuzzer target for the safetensors reader. Any input must either parse or
// raise zero::IoError; every other exception, crash, sanitizer report, leak or
// hang is a bug. Built by tests/fuzz/CMakeLists.txt (see README.md there).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "zero/core/error.hpp"
#include "zero/io/safetensors.hpp"

namespace {

void check(std::vector<std::byte> bytes) {
  try {
    const auto file = zero::io::SafeTensorsFile::from_bytes(std::move(bytes), "fuzz-input");
    // Touch every byte a successful parse hands out, so that an offset check
    // that is off by one shows up as an ASan report here.
    unsigned sum = 0;
    for (const auto& tensor : file.tensors()) {
      if (file.find(tensor.name) != &tensor) std::abort();
      const auto span = file.data(tensor);
      if (span.size() != tensor.byte_size) std::abort();
      for (std::byte b : span) sum += std::to_integer<unsigned>(b);
      if (tensor.dtype == zero::io::TensorDType::F32 || tensor.dtype == zero::io::TensorDType::F16 ||
          tensor.dtype == zero::io::TensorDType::BF16 || tensor.dtype == zero::io::TensorDType::F64) {
        if (file.read_as_float32(tensor.name).size() != tensor.element_count()) std::abort();
      }
    }
    for (const auto& [key, value] : file.metadata()) sum += static_cast<unsigned>(key.size() + value.size());
    // Keep the reads from being optimised away.
    volatile unsigned sink = sum;
    (void)sink;

    // Writing what was read must give a file that reads back the same.
    std::vector<zero::io::TensorView> views;
    for (const auto& tensor : file.tensors())
      views.push_back({tensor.name, tensor.dtype, tensor.shape, file.data(tensor).data()});
    const auto again = zero::io::SafeTensorsFile::from_bytes(
        zero::io::serialize_safetensors(views, file.metadata()), "fuzz-rewritten");
    if (again.tensors().size() != file.tensors().size() || again.metadata() != file.metadata())
      std::abort();
    for (std::size_t i = 0; i < again.tensors().size(); ++i) {
      const auto a = file.data(file.tensors()[i]);
      const auto b = again.data(again.tensors()[i]);
      if (again.tensors()[i].name != file.tensors()[i].name ||
          again.tensors()[i].shape != file.tensors()[i].shape || a.size() != b.size() ||
          (a.size() && std::memcmp(a.data(), b.data(), a.size()) != 0))
        std::abort();
    }
  } catch (const zero::IoError&) {
    // Malformed input, reported properly.
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // As given: exercises the length prefix and everything after it.
  check(std::vector<std::byte>(reinterpret_cast<const std::byte*>(data),
                               reinterpret_cast<const std::byte*>(data) + size));

  // Mutations of the JSON nearly always break the length prefix, which would
  // keep the fuzzer out of the header checks. So also read the input as
  // "header text, newline, data" and derive a matching prefix.
  const auto* newline = static_cast<const std::uint8_t*>(std::memchr(data, '\n', size));
  if (newline) {
    const std::size_t header = static_cast<std::size_t>(newline - data);
    std::vector<std::byte> framed(8 + size - 1);
    for (int i = 0; i < 8; ++i)
      framed[i] = static_cast<std::byte>((static_cast<std::uint64_t>(header) >> (8 * i)) & 0xffu);
    std::memcpy(framed.data() + 8, data, header);
    std::memcpy(framed.data() + 8 + header, newline + 1, size - header - 1);
    check(std::move(framed));
  }
  return 0;
}
