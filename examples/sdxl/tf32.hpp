// TF32 on CUDA: whether fp32 matmuls and convolutions may run on the tensor
// cores with inputs rounded to TF32 (10-bit mantissa, fp32 range and
// accumulation). LibTorch's defaults differ by library: cuBLAS matmuls strict
// fp32, cuDNN convolutions TF32. The trainer ([device] tf32) and unet_forward
// (--tf32) set both the same way, strict unless asked. Only fp32 computation
// is affected: bf16 and fp16 kernels never use TF32.
#pragma once

#include <ATen/Context.h>

namespace sdxl {

/// Both switches exist in every LibTorch from 1.7 on. setAllowTF32CuBLAS also
/// sets the fp32 matmul precision (HIGH or HIGHEST, what
/// setFloat32MatmulPrecision("high"/"highest") sets for CUDA) and, from 2.9
/// on, the newer per-backend precision (cuda/matmul), and setAllowTF32CuDNN
/// the cuda/conv and cuda/rnn ones: the legacy and new flags stay consistent,
/// which LibTorch 2.9+ checks when it reads them. setFloat32MatmulPrecision
/// itself is not called: from 2.9 on it also changes oneDNN's matmul precision.
inline void allow_tf32(bool allow) {
  at::globalContext().setAllowTF32CuBLAS(allow);
  at::globalContext().setAllowTF32CuDNN(allow);
}

}  // namespace sdxl
