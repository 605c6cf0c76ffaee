// doctest and main() of the sdxl kernel tests. Include after LibTorch's
// headers, in place of doctest: LibTorch builds with glog (Debian's 1.13)
// define CHECK* macros through c10/util/Logging.h, and doctest's must win.
// `--gpu` runs the CUDA cases and exits 77 (CTest's "skipped") when LibTorch
// sees no GPU.
#pragma once

#include <cstdio>
#include <string_view>
#include <vector>

#define DOCTEST_CONFIG_IMPLEMENT
#include "../doctest_after_torch.hpp"  // after LibTorch: doctest's CHECK, not glog's

int main(int argc, char** argv) {
  std::vector<char*> args;
  bool gpu = false;
  for (int i = 0; i < argc; ++i) {
    if (i > 0 && std::string_view(argv[i]) == "--gpu") gpu = true;
    else args.push_back(argv[i]);
  }
  if (gpu && !torch::cuda::is_available()) {
    std::printf("skipped: no CUDA device visible to LibTorch\n");
    return 77;
  }
  doctest::Context context(static_cast<int>(args.size()), args.data());
  return context.run();
}
