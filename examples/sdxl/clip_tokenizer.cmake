# The CLIP tokenizer (clip_tokenizer.cpp) as the static library sdxl_tokenizer:
# plain C++ on zero::zero and utf8proc (Unicode categories, lower-case mapping,
# NFC), no LibTorch, so it builds and is tested in every configuration.
# Included by examples/sdxl/CMakeLists.txt, or by tests/sdxl_tokenizer when the
# example is not built (no LibTorch). utf8proc is Debian's libutf8proc-dev
# (tools/install-deps.sh), or its .deb unpacked under .deps/utf8proc where
# nothing can be installed (the GPU machine; README.md says how). The static
# archive is preferred so that binaries need no libutf8proc at run time.
if(TARGET sdxl_tokenizer)
  return()
endif()
find_path(ZERO_UTF8PROC_INCLUDE utf8proc.h HINTS ${PROJECT_SOURCE_DIR}/.deps/utf8proc/usr/include)
find_library(ZERO_UTF8PROC_LIBRARY NAMES libutf8proc.a utf8proc
  HINTS ${PROJECT_SOURCE_DIR}/.deps/utf8proc/usr/lib/x86_64-linux-gnu ${PROJECT_SOURCE_DIR}/.deps/utf8proc/usr/lib)
if(NOT ZERO_UTF8PROC_INCLUDE OR NOT ZERO_UTF8PROC_LIBRARY)
  message(WARNING "sdxl: utf8proc not found: the CLIP tokenizer (sdxl_tokenizer) and its test are not built; "
                  "install libutf8proc-dev (tools/install-deps.sh) or unpack it under .deps/utf8proc")
  return()
endif()
add_library(sdxl_tokenizer STATIC ${CMAKE_CURRENT_LIST_DIR}/clip_tokenizer.cpp)
target_include_directories(sdxl_tokenizer PUBLIC ${CMAKE_CURRENT_LIST_DIR} PRIVATE ${ZERO_UTF8PROC_INCLUDE})
target_link_libraries(sdxl_tokenizer PUBLIC zero::zero PRIVATE nlohmann_json::nlohmann_json ${ZERO_UTF8PROC_LIBRARY})
target_compile_features(sdxl_tokenizer PUBLIC cxx_std_20)
target_compile_options(sdxl_tokenizer PRIVATE -Wall -Wextra)
