#!/usr/bin/env bash
# Installs, as root on Debian 12, everything zero's build, tests, examples and
# benchmarks need. Safe to run again: apt skips what is there.
set -euo pipefail
if [ "$(id -u)" -ne 0 ]; then
  echo "tools/install-deps.sh: run as root (it calls apt-get install)" >&2
  exit 1
fi
packages=(
  g++ cmake ninja-build pkg-config
  libopenmpi-dev openmpi-bin       # MPI: bootstrap and the host communicator
  nlohmann-json3-dev               # safetensors headers, manifests, JSON results
  libcli11-dev                     # command lines of the tools and examples
  libtomlplusplus-dev              # trainer configs
  libutf8proc-dev                  # Unicode categories, case mapping, NFC: the CLIP tokenizer
  libstb-dev                       # stb_image/stb_image_write: image files in prepare, sample, validation
  libwebp-dev                      # WebP images in prepare
  libspdlog-dev libfmt-dev         # logging in the trainer
  doctest-dev                      # unit and MPI tests
  libbenchmark-dev                 # micro benchmarks
  libtorch-dev                     # LibTorch (CPU): zero::torch and the SDXL UNet
  python3                          # fixture generators
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
