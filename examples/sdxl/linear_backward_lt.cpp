// weight_and_bias_grad(): dW = dY^T X with the bias gradient in the GEMM's
// epilogue (cuBLASLt, CUBLASLT_EPILOGUE_BGRADB). See linear_backward_lt.hpp.
//
// In cuBLASLt's column-major terms the row-major dW [out, in] is D (in x out),
// X [tokens, in] is A (in x tokens, not transposed) and dY [tokens, out] is B
// stored (out x tokens) and transposed, so k = tokens and the bias gradient
// (one value per column of D) is B summed over k: BGRADB.

#include "linear_backward_lt.hpp"

#include <cublasLt.h>

#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <utility>

#include "zero/core/error.hpp"

namespace sdxl::cuda {

namespace {

void check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    ZERO_THROW(::zero::DeviceError, "cuBLASLt ", what, " failed: ", cublasLtGetStatusName(status), " (",
               cublasLtGetStatusString(status), ")");
}

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    ZERO_THROW(::zero::DeviceError, what, " failed: ", cudaGetErrorName(status), " (", cudaGetErrorString(status), ")");
}

// The largest power of two (at most 256) that divides the address: what the
// chosen algorithm may assume of each pointer.
std::uint32_t alignment_of(const void* p) {
  const auto address = reinterpret_cast<std::uintptr_t>(p);
  std::uint32_t a = 256;
  while (a > 1 && address % a != 0) a /= 2;
  return a;
}

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool supported = false;
  ~Plan() {
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

using PlanKey = std::tuple<int, int, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                           std::uint32_t, std::uint32_t, std::uint32_t, std::uint32_t, std::size_t>;

struct Cache {
  std::mutex mutex;
  std::map<int, cublasLtHandle_t> handles;  // by device
  std::map<PlanKey, std::unique_ptr<Plan>> plans;
};

Cache& cache() {
  static Cache* c = new Cache;  // never destroyed: handles may be in use until exit
  return *c;
}

}  // namespace

bool weight_and_bias_grad(const void* x, std::int64_t ldx, const void* dy, std::int64_t ldy, void* dw, void* db,
                          std::int64_t tokens, std::int64_t in, std::int64_t out, LtDtype dtype, void* workspace,
                          std::size_t workspace_bytes, cudaStream_t stream) {
  if (tokens <= 0 || in <= 0 || out <= 0 || ldx < in || ldy < out) return false;
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  const cudaDataType_t type = dtype == LtDtype::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
  const PlanKey key{device,          static_cast<int>(dtype), tokens,           in,
                    out,             ldx,                     ldy,              alignment_of(x),
                    alignment_of(dy), alignment_of(dw),       alignment_of(db), workspace_bytes};

  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  cublasLtHandle_t& handle = c.handles[device];
  if (!handle) check(cublasLtCreate(&handle), "cublasLtCreate");
  std::unique_ptr<Plan>& slot = c.plans[key];
  if (!slot) {
    auto plan = std::make_unique<Plan>();
    check(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    const cublasOperation_t op_a = CUBLAS_OP_N, op_b = CUBLAS_OP_T;
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BGRADB;
    check(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)), "TRANSA");
    check(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)), "TRANSB");
    check(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)),
          "EPILOGUE");
    check(cublasLtMatrixLayoutCreate(&plan->a, type, static_cast<std::uint64_t>(in),
                                     static_cast<std::uint64_t>(tokens), ldx),
          "layout of x");
    check(cublasLtMatrixLayoutCreate(&plan->b, type, static_cast<std::uint64_t>(out),
                                     static_cast<std::uint64_t>(tokens), ldy),
          "layout of dy");
    check(cublasLtMatrixLayoutCreate(&plan->d, type, static_cast<std::uint64_t>(in), static_cast<std::uint64_t>(out),
                                     in),
          "layout of dw");
    cublasLtMatmulPreference_t preference = nullptr;
    check(cublasLtMatmulPreferenceCreate(&preference), "cublasLtMatmulPreferenceCreate");
    const std::uint64_t max_workspace = workspace_bytes;
    const std::uint32_t align_a = std::get<7>(key), align_b = std::get<8>(key), align_d = std::get<9>(key);
    cublasStatus_t status = cublasLtMatmulPreferenceSetAttribute(
        preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_workspace, sizeof(max_workspace));
    // The operands' alignments, so that the algorithm chosen holds for every
    // call with this key (C is D: the same alignment).
    const std::pair<cublasLtMatmulPreferenceAttributes_t, std::uint32_t> alignments[] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_d},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d}};
    for (const auto& [attribute, bytes] : alignments)
      if (status == CUBLAS_STATUS_SUCCESS)
        status = cublasLtMatmulPreferenceSetAttribute(preference, attribute, &bytes, sizeof(bytes));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    if (status == CUBLAS_STATUS_SUCCESS)
      status = cublasLtMatmulAlgoGetHeuristic(handle, plan->desc, plan->a, plan->b, plan->d, plan->d, preference, 1,
                                              &result, &found);
    cublasLtMatmulPreferenceDestroy(preference);
    // No algorithm for this epilogue, shape or alignment: the caller's
    // unfused path, remembered so that the question is asked once.
    plan->supported = status == CUBLAS_STATUS_SUCCESS && found > 0 && result.state == CUBLAS_STATUS_SUCCESS;
    if (status != CUBLAS_STATUS_SUCCESS && status != CUBLAS_STATUS_NOT_SUPPORTED) check(status, "heuristic");
    if (plan->supported) plan->algo = result.algo;
    slot = std::move(plan);
  }
  Plan& plan = *slot;
  if (!plan.supported) return false;
  // The descriptor is shared by every call of this shape: the bias pointer is
  // set under the lock, and cublasLtMatmul reads it before returning.
  check(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &db, sizeof(db)),
        "BIAS_POINTER");
  const float alpha = 1.0f, beta = 0.0f;
  check(cublasLtMatmul(handle, plan.desc, &alpha, x, plan.a, dy, plan.b, &beta, dw, plan.d, dw, plan.d, &plan.algo,
                       workspace, workspace_bytes, stream),
        "cublasLtMatmul (weight and bias gradient)");
  return true;
}

}  // namespace sdxl::cuda
