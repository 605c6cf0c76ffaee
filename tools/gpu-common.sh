# Sourced by tools/gpu-quickstart.sh and tools/gpu-tests.sh (from the
# repository root): checks what a CUDA build of zero needs, each missing piece
# named with how to get it, then configures the `cuda` preset against a CUDA
# LibTorch and builds the targets asked for.
#
# LibTorch, in this order: LIBTORCH=/path (an unpacked libtorch zip or any
# prefix holding share/cmake/Torch), a Torch already on CMAKE_PREFIX_PATH, or
# the one inside python3's PyTorch (torch.utils.cmake_prefix_path).
# Headers not installed system-wide are also taken from .deps/<name>/usr (a
# Debian package unpacked with dpkg -x, as the GPU machine's copy of the repo
# carries toml++ and CLI11), like bench/gpu/run_*_device.sh.
# BUILD_DIR (default build/cuda, the preset's folder) and CUDA_ARCHITECTURES
# (default: the preset's 90a) can be changed.

BUILD_DIR=${BUILD_DIR:-build/cuda}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # no NVLink multicast on shared hosts
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

gpu_say() { echo "== $*"; }
_gpu_missing=()
_gpu_need() { _gpu_missing+=("$1"); }

# _gpu_find_header RELATIVE_PATH: the include folder holding it, or nothing.
_gpu_find_header() {
  local dir
  local -a dirs=(/usr/include /usr/local/include)
  local IFS=:
  for dir in ${CMAKE_PREFIX_PATH:-}; do [ -n "$dir" ] && dirs+=("$dir/include"); done
  unset IFS
  for dir in .deps/*/usr/include; do [ -d "$dir" ] && dirs+=("$dir"); done
  for dir in "${dirs[@]}"; do
    if [ -f "$dir/$1" ]; then echo "$dir"; return 0; fi
  done
  return 1
}

# Sets TORCH_CMAKE_PREFIX (a CMAKE_PREFIX_PATH entry holding Torch's config)
# and TORCH_ORIGIN (where it came from), or records what is missing.
_gpu_find_torch() {
  TORCH_CMAKE_PREFIX="" TORCH_ORIGIN=""
  local dir IFS=:
  if [ -n "${LIBTORCH:-}" ]; then
    if [ -f "$LIBTORCH/share/cmake/Torch/TorchConfig.cmake" ]; then
      TORCH_CMAKE_PREFIX=$LIBTORCH
    elif [ -f "$LIBTORCH/Torch/TorchConfig.cmake" ]; then
      TORCH_CMAKE_PREFIX=$LIBTORCH  # a share/cmake folder itself
    else
      _gpu_need "LibTorch: LIBTORCH=$LIBTORCH holds no share/cmake/Torch/TorchConfig.cmake (point it at the unpacked libtorch folder)"
      return
    fi
    TORCH_ORIGIN="LIBTORCH=$LIBTORCH"
  else
    for dir in ${CMAKE_PREFIX_PATH:-}; do
      if [ -f "$dir/share/cmake/Torch/TorchConfig.cmake" ] || [ -f "$dir/Torch/TorchConfig.cmake" ]; then
        TORCH_CMAKE_PREFIX=$dir TORCH_ORIGIN="CMAKE_PREFIX_PATH ($dir)"
        break
      fi
    done
  fi
  unset IFS
  if [ -z "$TORCH_CMAKE_PREFIX" ]; then
    if dir=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null) && [ -n "$dir" ]; then
      TORCH_CMAKE_PREFIX=$dir
      TORCH_ORIGIN="python3's PyTorch $(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null)"
    else
      _gpu_need "LibTorch with CUDA: none found. pip install torch (a CUDA build, https://pytorch.org/get-started/locally/), or unpack the CUDA libtorch zip from the same page and run with LIBTORCH=/path/to/libtorch"
      return
    fi
  fi
  # CUDA LibTorch ships libc10_cuda next to libtorch (pip: torch/lib, zip: libtorch/lib).
  local root
  for root in "$TORCH_CMAKE_PREFIX" "$TORCH_CMAKE_PREFIX/.." "$TORCH_CMAKE_PREFIX/../.."; do
    if [ -e "$root/lib/libc10_cuda.so" ]; then return; fi
  done
  _gpu_need "LibTorch with CUDA: the one from $TORCH_ORIGIN ($TORCH_CMAKE_PREFIX) has no libc10_cuda.so, so it is CPU-only. Install a CUDA build (pip install torch --index-url https://download.pytorch.org/whl/cu130, or the CUDA libtorch zip with LIBTORCH=/path)"
  TORCH_CMAKE_PREFIX=""
}

# gpu_check_prerequisites: every missing piece at once, then exit 1 if any.
gpu_check_prerequisites() {
  _gpu_missing=()
  if ! command -v nvidia-smi > /dev/null || ! nvidia-smi -L > /dev/null 2>&1; then
    _gpu_need "a visible NVIDIA GPU: nvidia-smi is missing or sees none (install the NVIDIA driver; in a container, run it with the GPUs passed through)"
  fi
  NVCC=${CUDACXX:-}
  [ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
  [ -z "$NVCC" ] && NVCC=$(command -v nvcc || true)
  if [ -z "$NVCC" ]; then
    _gpu_need "nvcc (the CUDA toolkit): not in /usr/local/cuda/bin or on PATH. Install the CUDA toolkit 12.x or 13.x (https://developer.nvidia.com/cuda-downloads), or set CUDACXX=/path/to/nvcc"
  fi
  local cmake_version
  cmake_version=$(cmake --version 2>/dev/null | head -1 | awk '{print $3}')
  if [ -z "$cmake_version" ] || [ "$(printf '%s\n3.25\n' "$cmake_version" | sort -V | head -1)" != "3.25" ]; then
    _gpu_need "CMake >= 3.25 (found: ${cmake_version:-none}): pip install cmake, or apt-get install cmake"
  fi
  # (The headers are left to CMake's FindMPI, which also finds them without mpicxx.)
  if ! command -v mpirun > /dev/null; then
    _gpu_need "MPI (mpirun, the headers and libraries): apt-get install libopenmpi-dev openmpi-bin"
  fi
  local nccl_found=""
  for dir in "${NCCL_ROOT:-}" "${NCCL_HOME:-}" /usr/local/cuda /usr; do
    [ -n "$dir" ] && [ -f "$dir/include/nccl.h" ] && nccl_found=$dir
  done
  if [ -z "$nccl_found" ] && python3 -c 'import nvidia.nccl, os, sys; d = os.path.dirname(nvidia.nccl.__file__); sys.exit(not os.path.exists(os.path.join(d, "include", "nccl.h")))' 2>/dev/null; then
    nccl_found=wheel
  fi
  if [ -z "$nccl_found" ]; then
    _gpu_need "NCCL headers (nccl.h): apt-get install libnccl-dev (NVIDIA's CUDA apt repository), or pip install nvidia-nccl-cu13 (cu12 for CUDA 12), or set NCCL_ROOT to an NCCL folder with include/ and lib/"
  fi
  _gpu_find_header nlohmann/json.hpp > /dev/null ||
    _gpu_need "nlohmann-json: apt-get install nlohmann-json3-dev"
  _gpu_find_header CLI/CLI.hpp > /dev/null ||
    _gpu_need "CLI11: apt-get install libcli11-dev, or where apt cannot install: apt-get download libcli11-dev && dpkg -x libcli11-dev_*.deb .deps/cli11"
  _gpu_find_header toml++/toml.h > /dev/null ||
    _gpu_need "toml++: apt-get install libtomlplusplus-dev, or where apt cannot install: apt-get download libtomlplusplus-dev && dpkg -x libtomlplusplus-dev_*.deb .deps/toml"
  _gpu_find_header doctest/doctest.h > /dev/null ||
    _gpu_need "doctest (the preset builds the tests): apt-get install doctest-dev, or dpkg -x its .deb into .deps/doctest"
  _gpu_find_header benchmark/benchmark.h > /dev/null ||
    _gpu_need "Google Benchmark (the preset builds the benches): apt-get install libbenchmark-dev"
  _gpu_find_torch
  if [ ${#_gpu_missing[@]} -gt 0 ]; then
    echo "Missing for the CUDA build:" >&2
    local item
    for item in "${_gpu_missing[@]}"; do echo "  - $item" >&2; done
    exit 1
  fi
  if [ -n "$NVCC" ]; then
    local nvcc_major torch_cuda
    nvcc_major=$("$NVCC" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
    torch_cuda=$(python3 -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null || true)
    if [ -z "${LIBTORCH:-}" ] && [ -n "$torch_cuda" ] && [ "${torch_cuda%%.*}" != "$nvcc_major" ]; then
      echo "warning: nvcc is CUDA $nvcc_major but PyTorch was built for CUDA $torch_cuda; the build may fail to link" >&2
    fi
  fi
  gpu_say "GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader | head -1)"
  gpu_say "nvcc: $NVCC; LibTorch: $TORCH_ORIGIN ($TORCH_CMAKE_PREFIX)"
}

# gpu_build TARGET...: configures the cuda preset (once, or again when the
# LibTorch changed) and builds the targets (all when none are named).
gpu_build() {
  local deps_prefix="" dir
  for dir in .deps/*/usr; do [ -d "$dir" ] && deps_prefix="$deps_prefix:$PWD/$dir"; done
  export CMAKE_PREFIX_PATH="$TORCH_CMAKE_PREFIX$deps_prefix${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  local -a configure=(cmake --preset cuda -DZERO_WITH_TORCH=ON "-DCMAKE_CUDA_COMPILER=$NVCC")
  [ -n "${CUDA_ARCHITECTURES:-}" ] && configure+=("-DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCHITECTURES")
  if [ "$BUILD_DIR" != build/cuda ]; then configure+=(-B "$BUILD_DIR"); fi
  if ! command -v ninja > /dev/null; then
    # The preset asks for Ninja; make does the same job, in a folder of its own.
    [ "$BUILD_DIR" = build/cuda ] && BUILD_DIR=build/cuda-make && configure+=(-B "$BUILD_DIR")
    configure+=(-G "Unix Makefiles")
  fi
  # A build folder configured against another LibTorch keeps it in its cache
  # (Torch_DIR): start that cache over.
  mkdir -p "$BUILD_DIR"
  local cache=$BUILD_DIR/CMakeCache.txt cached
  if [ -f "$cache" ]; then
    cached=$(sed -n 's/^Torch_DIR:[A-Z]*=//p' "$cache")
    case "$(realpath -m "${cached:-/nowhere}")/" in
      "$(realpath -m "$TORCH_CMAKE_PREFIX")"/*) ;;
      *) gpu_say "$BUILD_DIR was configured with another LibTorch (${cached:-none}); configuring it again"
         rm -rf "$cache" "$BUILD_DIR/CMakeFiles" ;;
    esac
  fi
  if [ ! -f "$cache" ] || { [ ! -f "$BUILD_DIR/build.ninja" ] && [ ! -f "$BUILD_DIR/Makefile" ]; }; then
    gpu_say "configure: CMAKE_PREFIX_PATH=$CMAKE_PREFIX_PATH ${configure[*]}"
    "${configure[@]}" > "$BUILD_DIR/zero-configure.log" 2>&1 ||
      { tail -40 "$BUILD_DIR/zero-configure.log" >&2
        echo "configure failed; the whole log: $BUILD_DIR/zero-configure.log" >&2; exit 1; }
  fi
  local -a targets=()
  local t
  for t in "$@"; do targets+=(--target "$t"); done
  gpu_say "build: cmake --build $BUILD_DIR ${targets[*]}"
  local start=$SECONDS
  cmake --build "$BUILD_DIR" -j "$(nproc)" "${targets[@]}" > "$BUILD_DIR/zero-build.log" 2>&1 ||
    { grep -E "error|Error" -A3 "$BUILD_DIR/zero-build.log" | head -60 >&2
      echo "build failed; the whole log: $BUILD_DIR/zero-build.log" >&2; exit 1; }
  gpu_say "built in $((SECONDS - start)) s"
}
