# Image files for the SDXL tools (prepare reads JPEG/PNG/WebP, sample and the
# trainer's validation write PNG). Two well-kept libraries from Debian:
#   stb (libstb-dev): stb_image / stb_image_write, header-only here: one
#     source file of ours defines the implementation, so nothing is linked
#     and binaries need no libstb at run time.
#   libwebp (libwebp-dev): WebP decoding; the static archive is preferred.
# On a machine without a package manager (the GPU machine), unpack the .debs
# under .deps/stb and .deps/webp (`apt-get download libstb-dev libwebp-dev`,
# `dpkg-deb -x`). Targets: sdxl::stb (always, when found) and sdxl::webp
# (optional: without it WebP files are reported as unsupported by path).
find_path(ZERO_STB_INCLUDE stb_image.h
  HINTS ${PROJECT_SOURCE_DIR}/.deps/stb/usr/include/stb
  PATH_SUFFIXES stb)
if(ZERO_STB_INCLUDE AND NOT TARGET sdxl::stb)
  add_library(sdxl_stb INTERFACE)
  target_include_directories(sdxl_stb SYSTEM INTERFACE ${ZERO_STB_INCLUDE})
  add_library(sdxl::stb ALIAS sdxl_stb)
elseif(NOT ZERO_STB_INCLUDE)
  message(WARNING "sdxl: stb (stb_image.h) not found: prepare, sample and the trainer's validation images are not "
                  "built; install libstb-dev (tools/install-deps.sh) or unpack it under .deps/stb")
endif()

find_path(ZERO_WEBP_INCLUDE webp/decode.h HINTS ${PROJECT_SOURCE_DIR}/.deps/webp/usr/include)
find_library(ZERO_WEBP_LIBRARY NAMES libwebp.a webp
  HINTS ${PROJECT_SOURCE_DIR}/.deps/webp/usr/lib/x86_64-linux-gnu ${PROJECT_SOURCE_DIR}/.deps/webp/usr/lib)
if(ZERO_WEBP_INCLUDE AND ZERO_WEBP_LIBRARY AND NOT TARGET sdxl::webp)
  add_library(sdxl_webp INTERFACE)
  target_include_directories(sdxl_webp SYSTEM INTERFACE ${ZERO_WEBP_INCLUDE})
  target_link_libraries(sdxl_webp INTERFACE ${ZERO_WEBP_LIBRARY})
  target_compile_definitions(sdxl_webp INTERFACE ZERO_HAVE_WEBP=1)
  add_library(sdxl::webp ALIAS sdxl_webp)
elseif(NOT ZERO_WEBP_LIBRARY)
  message(STATUS "sdxl: libwebp not found: prepare reports WebP images as unsupported "
                 "(install libwebp-dev or unpack it under .deps/webp)")
endif()
