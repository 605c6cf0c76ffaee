# CUDA part of zero: kernels, CudaBackend, NcclCommunicator, StagedCommunicator
# and the zero-info tool. Included by the top-level CMakeLists.txt; does
# nothing unless ZERO_WITH_CUDA is ON.
if(NOT ZERO_WITH_CUDA)
  return()
endif()

# Hopper by default: sm_90a machine code (wgmma, setmaxnreg available) plus
# compute_90 PTX so that later GPUs can still JIT the kernels.
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES 90a-real 90-virtual)
endif()
if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
  set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
endif()
enable_language(CUDA)
# CMake 3.25 does not know that nvcc 12+ takes -std=c++20; tell it, so that
# the C++20 of zero's headers carries over to .cu files.
if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
endif()
set(CMAKE_CUDA_STANDARD 20)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
set(CMAKE_CUDA_EXTENSIONS OFF)
find_package(CUDAToolkit REQUIRED)
find_package(NCCL REQUIRED)
message(STATUS "zero: CUDA ${CUDAToolkit_VERSION}, NCCL ${NCCL_VERSION} (${NCCL_LIBRARY}), CUDA architectures ${CMAKE_CUDA_ARCHITECTURES}")

# The .cu files build in an object library of their own: zero's C++ warning
# flags (-Wall -Wextra) are not nvcc options, and the kernels want their own.
add_library(zero_cuda_objects OBJECT
  ${PROJECT_SOURCE_DIR}/src/cuda/optimizer_kernels.cu
  ${PROJECT_SOURCE_DIR}/src/cuda/grad_stats_kernels.cu
  ${PROJECT_SOURCE_DIR}/src/cuda/cuda_backend.cu)
target_include_directories(zero_cuda_objects PRIVATE ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/src/cuda)
target_link_libraries(zero_cuda_objects PRIVATE CUDA::cudart NCCL::NCCL MPI::MPI_CXX)
# --fmad=false: the optimizer math is specified without contraction (the CPU
# kernels build with -ffp-contract=off); with IEEE sqrt and division (nvcc's
# defaults) the GPU then computes the same bits as the CPU, and the kernels are
# memory-bound, so FMA would buy nothing. --expt-relaxed-constexpr: core's
# constexpr helpers (size_of, ...) work in device code. -lineinfo costs nothing
# at run time and lets profilers map SASS back to source.
target_compile_options(zero_cuda_objects PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:--fmad=false --expt-relaxed-constexpr -lineinfo -Xcompiler=-Wall,-Wextra>)
set_target_properties(zero_cuda_objects PROPERTIES
  POSITION_INDEPENDENT_CODE ON
  CUDA_RUNTIME_LIBRARY Shared)

target_sources(zero PRIVATE
  $<TARGET_OBJECTS:zero_cuda_objects>
  ${PROJECT_SOURCE_DIR}/src/cuda/nccl_communicator.cpp
  ${PROJECT_SOURCE_DIR}/src/cuda/staged_communicator.cpp)
target_include_directories(zero PRIVATE ${PROJECT_SOURCE_DIR}/src/cuda)
# Public headers (check.hpp, nccl_communicator.hpp) include cuda_runtime_api.h
# and nccl.h, so both are part of zero's interface.
target_link_libraries(zero PUBLIC CUDA::cudart NCCL::NCCL)
target_compile_definitions(zero PUBLIC ZERO_WITH_CUDA=1)
install(FILES ${PROJECT_SOURCE_DIR}/cmake/FindNCCL.cmake DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/zero)

# ---------------------------------------------------------------- zero-info
add_executable(zero-info ${PROJECT_SOURCE_DIR}/tools/zero_info.cpp)
# Headers only from zero: the tool must run (and explain what is wrong) even
# where the library's own setup would fail.
target_include_directories(zero-info PRIVATE ${PROJECT_SOURCE_DIR}/include)
target_compile_features(zero-info PRIVATE cxx_std_20)
target_link_libraries(zero-info PRIVATE CUDA::cudart NCCL::NCCL MPI::MPI_CXX)
target_compile_options(zero-info PRIVATE -Wall -Wextra)
list(APPEND ZERO_EXTRA_INSTALL_TARGETS zero-info)
