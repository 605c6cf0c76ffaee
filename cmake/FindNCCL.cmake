# FindNCCL: locates NCCL's header and library and provides the imported target
# NCCL::NCCL.
#
# Looked for, in order: NCCL_ROOT / $ENV{NCCL_ROOT} / $ENV{NCCL_HOME}, the CUDA
# toolkit's folders, the system folders (Debian/Ubuntu packages put NCCL under
# /usr/include and /usr/lib/<arch>), and the Python wheel nvidia-nccl-cu13 /
# -cu12 (pip's CUDA builds of PyTorch bring NCCL that way).
#
# Sets NCCL_FOUND, NCCL_INCLUDE_DIR, NCCL_LIBRARY, NCCL_VERSION.

set(_nccl_hints)
foreach(_root IN ITEMS "${NCCL_ROOT}" "$ENV{NCCL_ROOT}" "$ENV{NCCL_HOME}")
  if(_root)
    list(APPEND _nccl_hints "${_root}")
  endif()
endforeach()
if(CUDAToolkit_LIBRARY_ROOT)
  list(APPEND _nccl_hints "${CUDAToolkit_LIBRARY_ROOT}")
endif()
if(CUDAToolkit_TARGET_DIR)
  list(APPEND _nccl_hints "${CUDAToolkit_TARGET_DIR}")
endif()
list(APPEND _nccl_hints /usr/local/cuda)

# The wheel's folder, when a Python with it is at hand (quietly skipped otherwise).
if(NOT NCCL_INCLUDE_DIR OR NOT NCCL_LIBRARY)
  find_program(_nccl_python NAMES python3 python)
  if(_nccl_python)
    execute_process(
      COMMAND "${_nccl_python}" -c "import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))"
      OUTPUT_VARIABLE _nccl_wheel OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _nccl_rc)
    if(_nccl_rc EQUAL 0 AND IS_DIRECTORY "${_nccl_wheel}")
      list(APPEND _nccl_hints "${_nccl_wheel}")
    endif()
  endif()
endif()

find_path(NCCL_INCLUDE_DIR NAMES nccl.h
  HINTS ${_nccl_hints}
  PATH_SUFFIXES include targets/x86_64-linux/include targets/sbsa-linux/include)
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2
  HINTS ${_nccl_hints}
  PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu targets/x86_64-linux/lib targets/sbsa-linux/lib)

if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_version_lines REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
  foreach(_part IN ITEMS MAJOR MINOR PATCH)
    string(REGEX MATCH "NCCL_${_part} ([0-9]+)" _match "${_nccl_version_lines}")
    set(_nccl_${_part} "${CMAKE_MATCH_1}")
  endforeach()
  if(NOT _nccl_MAJOR STREQUAL "")
    set(NCCL_VERSION "${_nccl_MAJOR}.${_nccl_MINOR}.${_nccl_PATCH}")
  endif()
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL
  REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR
  VERSION_VAR NCCL_VERSION)

if(NCCL_FOUND AND NOT TARGET NCCL::NCCL)
  add_library(NCCL::NCCL UNKNOWN IMPORTED)
  set_target_properties(NCCL::NCCL PROPERTIES
    IMPORTED_LOCATION "${NCCL_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
