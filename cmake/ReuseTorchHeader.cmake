# zero_reuse_torch_header(<target>...): compile the targets' C++ sources with
# sdxl_unet's precompiled <torch/torch.h> (examples/sdxl/CMakeLists.txt).
#
# Why: parsing LibTorch's headers is a third of each translation unit that
# includes them (train_export.cpp on the 2-core CI machine: 37.8 s, 25.4 s with
# the precompiled header), and some 50 of them do; the CPU build's time is most
# of CI's. GCC accepts a precompiled header only under the same code-generation
# flags: the library is built -fPIC, so executables that reuse it are compiled
# -fPIC as well instead of CMake's -fPIE (they still link as position
# independent executables, the toolchain's default). Where the header does not
# fit after all, GCC says so (-Winvalid-pch) and reads the headers: slower,
# never wrong. No-op where sdxl_unet does not exist (no LibTorch).
function(zero_reuse_torch_header)
  if(NOT TARGET sdxl_unet)
    return()
  endif()
  foreach(target IN LISTS ARGN)
    get_target_property(type ${target} TYPE)
    if(type STREQUAL "EXECUTABLE")
      set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE OFF)
      target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-fPIC>)
    endif()
    target_precompile_headers(${target} REUSE_FROM sdxl_unet)
  endforeach()
endfunction()
