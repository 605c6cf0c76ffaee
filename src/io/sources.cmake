# File I/O: safetensors reader/writer, crash-safe file replacement, CRC-32C.
# nlohmann_json stays a PRIVATE dependency of zero: the public headers under
# include/zero/io/ do not include it, so installed consumers need not have it.
target_sources(zero PRIVATE
  ${PROJECT_SOURCE_DIR}/src/io/safetensors_reader.cpp
  ${PROJECT_SOURCE_DIR}/src/io/safetensors_writer.cpp
  ${PROJECT_SOURCE_DIR}/src/io/atomic_file.cpp
  ${PROJECT_SOURCE_DIR}/src/io/crc32c.cpp
  ${PROJECT_SOURCE_DIR}/src/io/json_limits.cpp)
