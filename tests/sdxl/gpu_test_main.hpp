// main() of the sdxl kernel tests: doctest, plus `--gpu`, which runs the
// CUDA cases and exits 77 (CTest's "skipped") when LibTorch sees no GPU.
// Included once, after doctest (DOCTEST_CONFIG_IMPLEMENT) and torch.
#pragma once

#include <cstdio>
#include <string_view>
#include <vector>

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
