// GroupNorm (+ SiLU) over NHWC activations (see group_norm_nhwc_kernels.hpp).
//
// Block layout, shared by every pass: a block takes one image n and a tile of
// consecutive pixels; in NHWC such a tile is one contiguous span of memory.
// Its threads form `rows` rows of `vt` threads; thread (r, col) owns the
// channel chunk col (kVec = 8 channels, 16-byte loads; kVec = 1 when C % 8 != 0
// or a pointer is misaligned) and walks the pixels p0 + r, p0 + r + rows, ...
// of the tile, so a warp reads consecutive chunks of consecutive pixels
// (coalesced whatever C is). rows = min(512 / vt, HW), 240 to 512 threads a
// block for SDXL's widths, padded to whole warps. Channels past 512 chunks
// (C > 4096 with vectors) loop over chunk columns.
//
// Forward (3 kernels, x read twice, y written once):
//   1. stats: each thread keeps a Welford mean/M2 per channel over its pixels
//      (one reciprocal per pixel for all its channels); the block merges the
//      rows per channel, then the channels per group (equal counts: mean of
//      means plus the spread term), and writes (mean, M2) per (n, tile, g).
//      Welford/Chan merges keep bf16 data far from zero mean accurate, unlike
//      sum and sum-of-squares.
//   2. finalize: one warp per (n, g) merges the tiles (lane-strided, then a
//      shuffle tree, fixed order) into mean and rstd.
//   3. normalize: y = act(x * scale + shift), scale = rstd * gamma,
//      shift = beta - mean * scale.
// Backward (4 kernels, x and dy read twice, dx written once):
//   1. reduce: per (n, tile, c) sums of dz and dz * xhat, with dz = dy * act'(z)
//      recomputed from x (rows merged in shared memory, fixed order).
//   2. channel sums: per (n, c) over the tiles (8 tile-strided lanes, then
//      across the lanes in order).
//   3. params: dbeta[c] = sum_n sum dz, dgamma[c] = sum_n sum dz*xhat; per (n, g)
//      the means of dxhat = dz * gamma and dxhat * xhat, which are
//      sum_{c in g} gamma[c] * (per-(n, c) sums) / (HW * cpg).
//   4. dx = rstd * (dz * gamma - mean(dxhat) - xhat * mean(dxhat * xhat)).
// No atomics: every sum has a fixed order, so results are bitwise
// reproducible. Tile sizes depend on the shape only (so do the workspaces).
// Indices are 64-bit: N * HW * C exceeds 2^31 at SDXL sizes.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "group_norm_nhwc_kernels.hpp"
#include "zero/cuda/elements.cuh"

namespace sdxl::cuda {
namespace {

using zero::cuda::from_float;
using zero::cuda::to_float;

constexpr int kMaxThreads = 512;
// Memory-level parallelism: every streaming kernel keeps about 30 KiB of loads
// in flight per SM. The forward kernels (2 pixels of 16 bytes a thread, <= 64
// registers) run two blocks per SM; the backward ones hold 6 per-channel
// constants for 8 channels plus dy and x of 2 pixels (~125 registers) and run
// one block per SM with twice the loads per thread.
constexpr int kStreamBlocks = 2;
constexpr int kWarp = 32;
constexpr std::int64_t kMaxTile = 4096;     // pixels of a block tile, at most
constexpr std::int64_t kForwardBlocks = 1024;  // aimed-for grid of the forward and dx kernels
constexpr std::int64_t kReduceBlocks = 512;    // aimed-for grid of the backward reduction
constexpr std::int64_t kReduceMinTile = 32;    // its per-(tile, c) partials stay <= ~1/16 of its reads
constexpr std::int64_t kMinTileBytes = 48 * 1024;

// ---------------------------------------------------------------- element helpers

template <typename T>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  const T a = from_float<T>(lo), b = from_float<T>(hi);
  unsigned short ua = 0, ub = 0;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) ua = __bfloat16_as_ushort(a), ub = __bfloat16_as_ushort(b);
  else ua = __half_as_ushort(a), ub = __half_as_ushort(b);
  return static_cast<unsigned>(ua) | (static_cast<unsigned>(ub) << 16);
}

template <typename T>
__device__ __forceinline__ void unpack2(unsigned w, float& lo, float& hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
  } else {
    lo = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
    hi = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
  }
}

// kVec consecutive elements at p (16-byte aligned when kVec == 8).
template <typename T, int kVec>
__device__ __forceinline__ void load(const T* __restrict__ p, float (&v)[kVec]) {
  if constexpr (kVec == 1) {
    v[0] = to_float(*p);
  } else if constexpr (std::is_same_v<T, float>) {
    static_assert(kVec == 8);
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
    static_assert(kVec == 8);
    const uint4 w = *reinterpret_cast<const uint4*>(p);
    unpack2<T>(w.x, v[0], v[1]);
    unpack2<T>(w.y, v[2], v[3]);
    unpack2<T>(w.z, v[4], v[5]);
    unpack2<T>(w.w, v[6], v[7]);
  }
}

template <typename T, int kVec>
__device__ __forceinline__ void store(T* __restrict__ p, const float (&v)[kVec]) {
  if constexpr (kVec == 1) {
    *p = from_float<T>(v[0]);
  } else if constexpr (std::is_same_v<T, float>) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    *reinterpret_cast<uint4*>(p) =
        make_uint4(pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]), pack2<T>(v[4], v[5]), pack2<T>(v[6], v[7]));
  }
}

__device__ __forceinline__ float sigmoid(float z) { return 1.0f / (1.0f + __expf(-z)); }

// d silu(z) / dz = s * (1 + z * (1 - s)); saturates to 0 / 1 without NaN.
__device__ __forceinline__ float silu_grad(float z) {
  const float s = sigmoid(z);
  return s * (1.0f + z * (1.0f - s));
}

// Chan et al.'s merge of (count, mean, M2) b into a.
__device__ __forceinline__ void merge(float& na, float& ma, float& m2a, float nb, float mb, float m2b) {
  if (nb == 0.0f) return;
  const float n = na + nb;
  const float f = nb / n;
  const float delta = mb - ma;
  ma += delta * f;
  m2a += m2b + delta * delta * na * f;
  na = n;
}

// Sum over the warp in a fixed order (a shuffle tree), returned to all lanes.
__device__ __forceinline__ float warp_sum(float v) {
  for (int off = kWarp / 2; off > 0; off /= 2) v += __shfl_down_sync(0xffffffffu, v, off);
  return __shfl_sync(0xffffffffu, v, 0);
}

// ---------------------------------------------------------------- block geometry

struct Dims {
  std::int64_t hw;     // pixels per image
  std::int64_t tile;   // pixels per block tile
  std::int64_t tiles;  // tiles per image (gridDim.x)
  int c, groups, cpg;
  int vt;    // threads per row (over channel chunks)
  int rows;  // rows of threads (over pixels)
};

// The thread's place in the block and the block's tile.
struct Place {
  int row, col;
  std::int64_t n, tile, p0, p1;
};

__device__ __forceinline__ Place place(const Dims& d) {
  Place pl;
  pl.row = static_cast<int>(threadIdx.x) / d.vt;
  pl.col = static_cast<int>(threadIdx.x) % d.vt;
  // Blocks are padded to whole warps (for the shuffles); the padding threads
  // get no channel chunk, hence no pixels.
  if (pl.row >= d.rows) pl.col = d.c;
  pl.n = blockIdx.y;
  pl.tile = blockIdx.x;
  pl.p0 = pl.tile * d.tile;
  pl.p1 = min(pl.p0 + d.tile, d.hw);
  return pl;
}

// Per-channel constants of a chunk: the statistics of each channel's group and
// the affine parameters.
template <typename P, int kVec>
struct ChunkParams {
  float mean[kVec], rstd[kVec], gamma[kVec], beta[kVec];

  __device__ __forceinline__ void load(const float* __restrict__ mean_ng, const float* __restrict__ rstd_ng,
                                       const P* __restrict__ g, const P* __restrict__ b, int c0, int cpg) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const int ch = c0 + k;
      const int grp = ch / cpg;
      mean[k] = mean_ng[grp];
      rstd[k] = rstd_ng[grp];
      gamma[k] = to_float(g[ch]);
      beta[k] = to_float(b[ch]);
    }
  }
};

// ---------------------------------------------------------------- forward

template <typename T, int kVec, int kUnroll>
__global__ void __launch_bounds__(kMaxThreads, kStreamBlocks)
    stats_kernel(const T* __restrict__ x, float* __restrict__ partial, Dims d) {
  extern __shared__ float smem[];
  float* s_mean = smem;               // [rows][C]
  float* s_m2 = smem + d.rows * d.c;  // [rows][C]
  const Place pl = place(d);
  const T* xn = x + pl.n * d.hw * d.c;
  const int chunks = d.c / kVec;
  const std::int64_t stride = d.rows;

  for (int v = pl.col; v < chunks; v += d.vt) {
    float mean[kVec], m2[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) mean[k] = m2[k] = 0.0f;
    float count = 0.0f;
    for (std::int64_t p = pl.p0 + pl.row; p < pl.p1; p += stride * kUnroll) {
      float vals[kUnroll][kVec];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (p + u * stride < pl.p1) load<T, kVec>(xn + (p + u * stride) * d.c + v * kVec, vals[u]);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (p + u * stride < pl.p1) {
          count += 1.0f;
          const float inv = __frcp_rn(count);
#pragma unroll
          for (int k = 0; k < kVec; ++k) {
            const float delta = vals[u][k] - mean[k];
            mean[k] += delta * inv;
            m2[k] += delta * (vals[u][k] - mean[k]);
          }
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      s_mean[pl.row * d.c + v * kVec + k] = mean[k];
      s_m2[pl.row * d.c + v * kVec + k] = m2[k];
    }
  }
  __syncthreads();

  // Rows into row 0, per channel, in row order. Row r saw
  // ceil((p1 - p0 - r) / rows) pixels.
  const std::int64_t span = pl.p1 - pl.p0;
  for (int ch = threadIdx.x; ch < d.c; ch += blockDim.x) {
    float n = static_cast<float>((span + d.rows - 1) / d.rows), m = s_mean[ch], m2 = s_m2[ch];
    for (int r = 1; r < d.rows && r < span; ++r)
      merge(n, m, m2, static_cast<float>((span - r + d.rows - 1) / d.rows), s_mean[r * d.c + ch],
            s_m2[r * d.c + ch]);
    s_mean[ch] = m;
    s_m2[ch] = m2;
  }
  __syncthreads();

  // Channels into groups, a warp per group: every channel has `span` samples,
  // so the group's mean is the mean of means and M2 adds
  // span * sum (mean_c - mean_g)^2.
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  for (int g = static_cast<int>(threadIdx.x) / kWarp; g < d.groups; g += static_cast<int>(blockDim.x) / kWarp) {
    const float* cm = s_mean + g * d.cpg;
    const float* cm2 = s_m2 + g * d.cpg;
    float sum = 0.0f;
    for (int j = lane; j < d.cpg; j += kWarp) sum += cm[j];
    const float mg = warp_sum(sum) / static_cast<float>(d.cpg);
    float m2 = 0.0f, spread = 0.0f;
    for (int j = lane; j < d.cpg; j += kWarp) {
      const float dev = cm[j] - mg;
      m2 += cm2[j];
      spread += dev * dev;
    }
    m2 = warp_sum(m2);
    spread = warp_sum(spread);
    if (lane == 0) {
      float* out = partial + ((pl.n * d.tiles + pl.tile) * d.groups + g) * 2;
      out[0] = mg;
      out[1] = m2 + static_cast<float>(span) * spread;
    }
  }
}

// One warp per (n, g): the tiles' (mean, M2) into mean and rstd.
__global__ void stats_finalize_kernel(const float* __restrict__ partial, float* __restrict__ mean,
                                      float* __restrict__ rstd, std::int64_t n_groups, Dims d, float eps) {
  const std::int64_t w = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  if (w >= n_groups) return;  // whole warps
  const std::int64_t n = w / d.groups;
  const int g = static_cast<int>(w % d.groups);
  float cnt = 0.0f, m = 0.0f, m2 = 0.0f;
#pragma unroll 4
  for (std::int64_t t = lane; t < d.tiles; t += kWarp) {
    const std::int64_t px = min((t + 1) * d.tile, d.hw) - t * d.tile;
    const float* in = partial + ((n * d.tiles + t) * d.groups + g) * 2;
    merge(cnt, m, m2, static_cast<float>(px * d.cpg), in[0], in[1]);
  }
  for (int off = kWarp / 2; off > 0; off /= 2) {
    const float cb = __shfl_down_sync(0xffffffffu, cnt, off);
    const float mb = __shfl_down_sync(0xffffffffu, m, off);
    const float m2b = __shfl_down_sync(0xffffffffu, m2, off);
    if (lane + off < kWarp) merge(cnt, m, m2, cb, mb, m2b);
  }
  if (lane == 0) {
    const float var = cnt > 0.0f ? fmaxf(m2 / cnt, 0.0f) : 0.0f;
    mean[w] = m;
    rstd[w] = 1.0f / sqrtf(var + eps);
  }
}

template <typename T, typename P, int kVec, int kUnroll, bool kSilu>
__global__ void __launch_bounds__(kMaxThreads, kStreamBlocks)
    normalize_kernel(const T* __restrict__ x, const P* __restrict__ gamma, const P* __restrict__ beta,
                     const float* __restrict__ mean, const float* __restrict__ rstd, T* __restrict__ y, Dims d) {
  const Place pl = place(d);
  const std::int64_t base = pl.n * d.hw * d.c;
  const int chunks = d.c / kVec;
  const std::int64_t stride = d.rows;
  for (int v = pl.col; v < chunks; v += d.vt) {
    ChunkParams<P, kVec> cp;
    cp.load(mean + pl.n * d.groups, rstd + pl.n * d.groups, gamma, beta, v * kVec, d.cpg);
    // z = x * scale + shift: two constants a channel keep this kernel within
    // 64 registers (rounding as torch's own fused scale and shift).
    float scale[kVec], shift[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      scale[k] = cp.rstd[k] * cp.gamma[k];
      shift[k] = cp.beta[k] - cp.mean[k] * scale[k];
    }
    for (std::int64_t p = pl.p0 + pl.row; p < pl.p1; p += stride * kUnroll) {
      float vals[kUnroll][kVec];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (p + u * stride < pl.p1) load<T, kVec>(x + base + (p + u * stride) * d.c + v * kVec, vals[u]);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (p + u * stride < pl.p1) {
#pragma unroll
          for (int k = 0; k < kVec; ++k) {
            const float z = vals[u][k] * scale[k] + shift[k];
            vals[u][k] = kSilu ? z * sigmoid(z) : z;
          }
          store<T, kVec>(y + base + (p + u * stride) * d.c + v * kVec, vals[u]);
        }
      }
    }
  }
}

// ---------------------------------------------------------------- backward

// dz and xhat of one element.
template <int kVec, bool kSilu>
__device__ __forceinline__ void grad_z(const float (&dy)[kVec], const float (&xv)[kVec], const float (&mean)[kVec],
                                       const float (&rstd)[kVec], const float (&gamma)[kVec],
                                       const float (&beta)[kVec], float (&dz)[kVec], float (&xhat)[kVec]) {
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    xhat[k] = (xv[k] - mean[k]) * rstd[k];
    dz[k] = kSilu ? dy[k] * silu_grad(xhat[k] * gamma[k] + beta[k]) : dy[k];
  }
}

template <typename T, typename P, int kVec, int kUnroll, bool kSilu>
__global__ void __launch_bounds__(kMaxThreads, 1)
    backward_reduce_kernel(const T* __restrict__ dy, const T* __restrict__ x, const P* __restrict__ gamma,
                           const P* __restrict__ beta, const float* __restrict__ mean,
                           const float* __restrict__ rstd, float* __restrict__ partial, Dims d) {
  extern __shared__ float smem[];
  float* s_dz = smem;                 // [rows][C]
  float* s_dzx = smem + d.rows * d.c;  // [rows][C]
  const Place pl = place(d);
  const std::int64_t base = pl.n * d.hw * d.c;
  const int chunks = d.c / kVec;
  const std::int64_t stride = d.rows;

  for (int v = pl.col; v < chunks; v += d.vt) {
    ChunkParams<P, kVec> cp;
    cp.load(mean + pl.n * d.groups, rstd + pl.n * d.groups, gamma, beta, v * kVec, d.cpg);
    float sum_dz[kVec], sum_dzx[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) sum_dz[k] = sum_dzx[k] = 0.0f;
    for (std::int64_t p = pl.p0 + pl.row; p < pl.p1; p += stride * kUnroll) {
      float g[kUnroll][kVec], xv[kUnroll][kVec];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (p + u * stride < pl.p1) {
          const std::int64_t off = base + (p + u * stride) * d.c + v * kVec;
          load<T, kVec>(dy + off, g[u]);
          load<T, kVec>(x + off, xv[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (p + u * stride < pl.p1) {
          float dz[kVec], xhat[kVec];
          grad_z<kVec, kSilu>(g[u], xv[u], cp.mean, cp.rstd, cp.gamma, cp.beta, dz, xhat);
#pragma unroll
          for (int k = 0; k < kVec; ++k) {
            sum_dz[k] += dz[k];
            sum_dzx[k] += dz[k] * xhat[k];
          }
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      s_dz[pl.row * d.c + v * kVec + k] = sum_dz[k];
      s_dzx[pl.row * d.c + v * kVec + k] = sum_dzx[k];
    }
  }
  __syncthreads();

  // partial is [N][tiles][2][C]; rows summed in order (rows without pixels hold 0).
  float* out = partial + (pl.n * d.tiles + pl.tile) * 2 * d.c;
  for (int ch = threadIdx.x; ch < d.c; ch += blockDim.x) {
    float a = 0.0f, b = 0.0f;
    for (int r = 0; r < d.rows; ++r) {
      a += s_dz[r * d.c + ch];
      b += s_dzx[r * d.c + ch];
    }
    out[ch] = a;
    out[d.c + ch] = b;
  }
}

// sums[n][k][c] = sum over tiles of partial[n][t][k][c]. Block (32, kSumLanes)
// for image blockIdx.y: 32 consecutive (k, c) columns, each summed over the
// tiles by kSumLanes threads (tile-strided), then across them in lane order.
constexpr int kSumLanes = 8;
__global__ void __launch_bounds__(kWarp * kSumLanes)
    backward_channel_sums_kernel(const float* __restrict__ partial, float* __restrict__ sums, std::int64_t c,
                                 std::int64_t tiles) {
  __shared__ float part[kSumLanes][kWarp];
  const std::int64_t n = blockIdx.y;
  const std::int64_t kc = static_cast<std::int64_t>(blockIdx.x) * kWarp + threadIdx.x;
  float s = 0.0f;
  if (kc < 2 * c) {
    const float* in = partial + n * tiles * 2 * c + kc;
#pragma unroll 4
    for (std::int64_t t = threadIdx.y; t < tiles; t += kSumLanes) s += in[t * 2 * c];
  }
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && kc < 2 * c) {
    float total = 0.0f;
    for (int l = 0; l < kSumLanes; ++l) total += part[l][threadIdx.x];
    sums[n * 2 * c + kc] = total;
  }
}

// Warps [0, N * G): per (n, g) the means over the group of dxhat = dz * gamma
// and dxhat * xhat, into coef[n][g][2] (lanes over the group's channels).
// The warps after them: dbeta and dgamma, a channel a lane.
template <typename P>
__global__ void backward_params_kernel(const float* __restrict__ sums, const P* __restrict__ gamma,
                                       P* __restrict__ dgamma, P* __restrict__ dbeta, float* __restrict__ coef,
                                       std::int64_t n_batch, Dims d) {
  const std::int64_t warp = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const std::int64_t c = d.c;
  const std::int64_t group_warps = n_batch * d.groups;
  if (warp < group_warps) {
    const std::int64_t n = warp / d.groups;
    const std::int64_t first = (warp % d.groups) * d.cpg;
    float s1 = 0.0f, s2 = 0.0f;
    for (int k = lane; k < d.cpg; k += kWarp) {
      const float w = to_float(gamma[first + k]);
      s1 += w * sums[n * 2 * c + first + k];
      s2 += w * sums[n * 2 * c + c + first + k];
    }
    s1 = warp_sum(s1);
    s2 = warp_sum(s2);
    if (lane == 0) {
      const float count = static_cast<float>(d.hw * d.cpg);
      coef[2 * warp] = count > 0.0f ? s1 / count : 0.0f;
      coef[2 * warp + 1] = count > 0.0f ? s2 / count : 0.0f;
    }
    return;
  }
  const std::int64_t ch = (warp - group_warps) * kWarp + lane;
  if (ch >= c) return;
  float a = 0.0f, b = 0.0f;
  for (std::int64_t n = 0; n < n_batch; ++n) {
    a += sums[n * 2 * c + ch];
    b += sums[n * 2 * c + c + ch];
  }
  dbeta[ch] = from_float<P>(a);
  dgamma[ch] = from_float<P>(b);
}

template <typename T, typename P, int kVec, int kUnroll, bool kSilu>
__global__ void __launch_bounds__(kMaxThreads, 1)
    backward_dx_kernel(const T* __restrict__ dy, const T* __restrict__ x, const P* __restrict__ gamma,
                       const P* __restrict__ beta, const float* __restrict__ mean, const float* __restrict__ rstd,
                       const float* __restrict__ coef, T* __restrict__ dx, Dims d) {
  const Place pl = place(d);
  const std::int64_t base = pl.n * d.hw * d.c;
  const int chunks = d.c / kVec;
  const std::int64_t stride = d.rows;
  for (int v = pl.col; v < chunks; v += d.vt) {
    ChunkParams<P, kVec> cp;
    cp.load(mean + pl.n * d.groups, rstd + pl.n * d.groups, gamma, beta, v * kVec, d.cpg);
    float c1[kVec], c2[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const std::int64_t grp = pl.n * d.groups + (v * kVec + k) / d.cpg;
      c1[k] = coef[2 * grp];
      c2[k] = coef[2 * grp + 1];
    }
    for (std::int64_t p = pl.p0 + pl.row; p < pl.p1; p += stride * kUnroll) {
      float g[kUnroll][kVec], xv[kUnroll][kVec];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (p + u * stride < pl.p1) {
          const std::int64_t off = base + (p + u * stride) * d.c + v * kVec;
          load<T, kVec>(dy + off, g[u]);
          load<T, kVec>(x + off, xv[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (p + u * stride < pl.p1) {
          float dz[kVec], xhat[kVec], out[kVec];
          grad_z<kVec, kSilu>(g[u], xv[u], cp.mean, cp.rstd, cp.gamma, cp.beta, dz, xhat);
#pragma unroll
          for (int k = 0; k < kVec; ++k) out[k] = cp.rstd[k] * (dz[k] * cp.gamma[k] - c1[k] - xhat[k] * c2[k]);
          store<T, kVec>(dx + base + (p + u * stride) * d.c + v * kVec, out);
        }
      }
    }
  }
}

// ---------------------------------------------------------------- host side

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

void check_shape(const GroupNormShape& s, const char* what) {
  auto fail = [&](const std::string& why) {
    throw std::invalid_argument(std::string(what) + ": " + why + " (N " + std::to_string(s.n) + ", HW " +
                                std::to_string(s.hw) + ", C " + std::to_string(s.c) + ", groups " +
                                std::to_string(s.groups) + ")");
  };
  if (s.n < 0 || s.hw < 0 || s.c <= 0 || s.groups <= 0) fail("bad shape");
  if (s.c % s.groups != 0) fail("channels not divisible by groups");
  if (s.c > INT_MAX / 2) fail("too many channels");
  if (s.n > 65535) fail("batch above 65535 (grid.y)");
}

// Threads of a block for chunks of kVec channels: `vt` along the chunks, `rows`
// over pixels (at most hw of them: more would idle).
struct Layout {
  int vt, rows;
};
Layout layout(const GroupNormShape& s, int vec) {
  const std::int64_t chunks = s.c / vec;
  const int vt = static_cast<int>(std::min<std::int64_t>(chunks, kMaxThreads));
  const std::int64_t rows = std::max<std::int64_t>(1, std::min<std::int64_t>(kMaxThreads / vt, s.hw));
  return {vt, static_cast<int>(rows)};
}

bool vector_shape(const GroupNormShape& s) { return s.c % 8 == 0; }

// Pixels per block tile: the batch spread over about `blocks` blocks, at least
// min_tile and kMinTileBytes (at 2 bytes an element: a block's fixed costs,
// the statistics' epilogue above all, want enough data to hide behind),
// rounded up to whole rows of the shape's preferred layout. Depends on the
// shape only, so the workspace sizes do too.
std::int64_t tile_pixels(const GroupNormShape& s, std::int64_t blocks, std::int64_t min_tile) {
  const std::int64_t rows = layout(s, vector_shape(s) ? 8 : 1).rows;
  min_tile = std::min(std::max(min_tile, ceil_div(kMinTileBytes, 2 * s.c)), kMaxTile);
  std::int64_t tile = std::clamp<std::int64_t>(ceil_div(s.n * s.hw, blocks), min_tile, kMaxTile);
  return ceil_div(tile, rows) * rows;
}

Dims dims(const GroupNormShape& s, std::int64_t tile, int vec) {
  const Layout l = layout(s, vec);
  Dims d{};
  d.hw = s.hw;
  d.tile = tile;
  d.tiles = ceil_div(s.hw, tile);
  d.c = static_cast<int>(s.c);
  d.groups = static_cast<int>(s.groups);
  d.cpg = static_cast<int>(s.c / s.groups);
  d.vt = l.vt;
  d.rows = l.rows;
  return d;
}

std::int64_t forward_tile(const GroupNormShape& s) { return tile_pixels(s, kForwardBlocks, 8); }
std::int64_t reduce_tile(const GroupNormShape& s) { return tile_pixels(s, kReduceBlocks, kReduceMinTile); }

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

void check_launch(const char* kernel) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess)
    throw std::runtime_error(std::string("group_norm_nhwc: ") + kernel + " launch failed: " +
                             cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ")");
}

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string("group_norm_nhwc: ") + what + ": " + cudaGetErrorName(status) + " (" +
                             cudaGetErrorString(status) + ")");
}

// Dynamic shared memory of the reducing kernels; above the default 48 KiB
// (C > 6144 with rows == 1) the kernel has to opt in.
template <typename Kernel>
void prepare_smem(Kernel kernel, std::size_t bytes) {
  if (bytes <= 48 * 1024) return;
  int device = 0, limit = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
             "cudaDeviceGetAttribute");
  if (bytes > static_cast<std::size_t>(limit))
    throw std::invalid_argument("group_norm_nhwc: " + std::to_string(bytes) + " bytes of shared memory needed, " +
                                std::to_string(limit) + " available (too many channels)");
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
             "cudaFuncSetAttribute");
}

// vt * rows threads, padded to whole warps.
unsigned block_threads(const Dims& d) { return static_cast<unsigned>(ceil_div(d.vt * d.rows, kWarp) * kWarp); }

std::size_t smem_bytes(const Dims& d) { return static_cast<std::size_t>(d.rows) * d.c * 2 * sizeof(float); }

unsigned blocks_1d(std::int64_t threads, int per_block) {
  return static_cast<unsigned>(ceil_div(threads, per_block));
}

// Calls body with null pointers of the storage types of dtype and param_dtype.
template <typename Body>
void dispatch_type(GroupNormDtype dtype, Body&& body) {
  switch (dtype) {
    case GroupNormDtype::kFloat32: body(static_cast<float*>(nullptr)); return;
    case GroupNormDtype::kBFloat16: body(static_cast<__nv_bfloat16*>(nullptr)); return;
    case GroupNormDtype::kFloat16: body(static_cast<__half*>(nullptr)); return;
  }
  throw std::invalid_argument("group_norm_nhwc: unknown dtype " + std::to_string(static_cast<int>(dtype)));
}

template <typename Body>
void dispatch(GroupNormDtype dtype, GroupNormDtype param_dtype, Body&& body) {
  dispatch_type(dtype, [&](auto* t) {
    dispatch_type(param_dtype, [&](auto* p) { body(t, p); });
  });
}

template <typename T, typename P, int kVec>
void forward_impl(const T* x, const P* gamma, const P* beta, T* y, float* mean, float* rstd, float* partial,
                  const GroupNormShape& s, float eps, bool silu, cudaStream_t stream) {
  const Dims d = dims(s, forward_tile(s), kVec);
  const dim3 grid(static_cast<unsigned>(d.tiles), static_cast<unsigned>(s.n));
  const unsigned threads = block_threads(d);
  if (d.tiles > 0) {
    auto stats = stats_kernel<T, kVec, 2>;
    const std::size_t smem = smem_bytes(d);
    prepare_smem(stats, smem);
    stats<<<grid, threads, smem, stream>>>(x, partial, d);
    check_launch("stats_kernel");
  }
  const std::int64_t n_groups = s.n * s.groups;
  constexpr int kFinalizeThreads = 256;
  stats_finalize_kernel<<<blocks_1d(n_groups * kWarp, kFinalizeThreads), kFinalizeThreads, 0, stream>>>(
      partial, mean, rstd, n_groups, d, eps);
  check_launch("stats_finalize_kernel");
  if (d.tiles > 0) {
    auto normalize = silu ? normalize_kernel<T, P, kVec, 2, true> : normalize_kernel<T, P, kVec, 2, false>;
    normalize<<<grid, threads, 0, stream>>>(x, gamma, beta, mean, rstd, y, d);
    check_launch("normalize_kernel");
  }
}

// Workspace of the backward: partial [N][tiles][2][C], sums [N][2][C], coef [N][G][2].
struct BackwardSpace {
  std::int64_t partial, sums, coef;  // element offsets
  std::int64_t total;
};
BackwardSpace backward_space(const GroupNormShape& s) {
  const std::int64_t tiles = ceil_div(s.hw, reduce_tile(s));
  BackwardSpace b{};
  b.partial = 0;
  b.sums = s.n * tiles * 2 * s.c;
  b.coef = b.sums + s.n * 2 * s.c;
  b.total = b.coef + s.n * s.groups * 2;
  return b;
}

template <typename T, typename P, int kVec>
void backward_impl(const T* dy, const T* x, const float* mean, const float* rstd, const P* gamma, const P* beta,
                   T* dx, P* dgamma, P* dbeta, float* ws, const GroupNormShape& s, bool silu, cudaStream_t stream) {
  const BackwardSpace space = backward_space(s);
  float* partial = ws + space.partial;
  float* sums = ws + space.sums;
  float* coef = ws + space.coef;
  const Dims rd = dims(s, reduce_tile(s), kVec);
  const unsigned threads = block_threads(rd);
  if (rd.tiles > 0) {
    auto reduce = silu ? backward_reduce_kernel<T, P, kVec, 2, true> : backward_reduce_kernel<T, P, kVec, 2, false>;
    const std::size_t smem = smem_bytes(rd);
    prepare_smem(reduce, smem);
    reduce<<<dim3(static_cast<unsigned>(rd.tiles), static_cast<unsigned>(s.n)), threads, smem, stream>>>(
        dy, x, gamma, beta, mean, rstd, partial, rd);
    check_launch("backward_reduce_kernel");
  }
  if (s.n > 0) {
    backward_channel_sums_kernel<<<dim3(static_cast<unsigned>(ceil_div(2 * s.c, kWarp)), static_cast<unsigned>(s.n)),
                                   dim3(kWarp, kSumLanes), 0, stream>>>(partial, sums, s.c, rd.tiles);
    check_launch("backward_channel_sums_kernel");
  }
  constexpr int kParamsThreads = 256;
  const std::int64_t warps = s.n * s.groups + ceil_div(s.c, kWarp);
  backward_params_kernel<P><<<blocks_1d(warps * kWarp, kParamsThreads), kParamsThreads, 0, stream>>>(
      sums, gamma, dgamma, dbeta, coef, s.n, rd);
  check_launch("backward_params_kernel");
  const Dims xd = dims(s, forward_tile(s), kVec);
  if (xd.tiles > 0) {
    auto dx_kernel = silu ? backward_dx_kernel<T, P, kVec, 2, true> : backward_dx_kernel<T, P, kVec, 2, false>;
    dx_kernel<<<dim3(static_cast<unsigned>(xd.tiles), static_cast<unsigned>(s.n)), threads, 0, stream>>>(
        dy, x, gamma, beta, mean, rstd, coef, dx, xd);
    check_launch("backward_dx_kernel");
  }
}

}  // namespace

std::size_t group_norm_nhwc_forward_workspace_bytes(const GroupNormShape& shape) {
  check_shape(shape, "group_norm_nhwc_forward_workspace_bytes");
  const std::int64_t tiles = ceil_div(shape.hw, forward_tile(shape));
  return static_cast<std::size_t>(shape.n * tiles * shape.groups * 2) * sizeof(float);
}

std::size_t group_norm_nhwc_backward_workspace_bytes(const GroupNormShape& shape) {
  check_shape(shape, "group_norm_nhwc_backward_workspace_bytes");
  return static_cast<std::size_t>(backward_space(shape).total) * sizeof(float);
}

void group_norm_nhwc_forward(const void* x, const void* gamma, const void* beta, void* y, float* mean, float* rstd,
                             void* workspace, const GroupNormShape& shape, double eps, bool silu,
                             GroupNormDtype dtype, GroupNormDtype param_dtype, cudaStream_t stream) {
  check_shape(shape, "group_norm_nhwc_forward");
  if (shape.n == 0) return;
  if (mean == nullptr || rstd == nullptr || gamma == nullptr || beta == nullptr ||
      (shape.hw > 0 && (x == nullptr || y == nullptr || workspace == nullptr)))
    throw std::invalid_argument("group_norm_nhwc_forward: null pointer");
  const bool vec = vector_shape(shape) && aligned16(x) && aligned16(y);
  dispatch(dtype, param_dtype, [&](auto* t, auto* p) {
    using T = std::remove_pointer_t<decltype(t)>;
    using P = std::remove_pointer_t<decltype(p)>;
    auto run = [&](auto vec_tag) {
      constexpr int kVec = decltype(vec_tag)::value;
      forward_impl<T, P, kVec>(static_cast<const T*>(x), static_cast<const P*>(gamma), static_cast<const P*>(beta),
                               static_cast<T*>(y), mean, rstd, static_cast<float*>(workspace), shape,
                               static_cast<float>(eps), silu, stream);
    };
    if (vec) run(std::integral_constant<int, 8>{});
    else run(std::integral_constant<int, 1>{});
  });
}

void group_norm_nhwc_backward(const void* dy, const void* x, const float* mean, const float* rstd, const void* gamma,
                              const void* beta, void* dx, void* dgamma, void* dbeta, void* workspace,
                              const GroupNormShape& shape, bool silu, GroupNormDtype dtype,
                              GroupNormDtype param_dtype, cudaStream_t stream) {
  check_shape(shape, "group_norm_nhwc_backward");
  if (mean == nullptr || rstd == nullptr || gamma == nullptr || beta == nullptr || dgamma == nullptr ||
      dbeta == nullptr || workspace == nullptr ||
      (shape.n * shape.hw > 0 && (dy == nullptr || x == nullptr || dx == nullptr)))
    throw std::invalid_argument("group_norm_nhwc_backward: null pointer");
  const bool vec = vector_shape(shape) && aligned16(dy) && aligned16(x) && aligned16(dx);
  dispatch(dtype, param_dtype, [&](auto* t, auto* p) {
    using T = std::remove_pointer_t<decltype(t)>;
    using P = std::remove_pointer_t<decltype(p)>;
    auto run = [&](auto vec_tag) {
      constexpr int kVec = decltype(vec_tag)::value;
      backward_impl<T, P, kVec>(static_cast<const T*>(dy), static_cast<const T*>(x), mean, rstd,
                                static_cast<const P*>(gamma), static_cast<const P*>(beta), static_cast<T*>(dx),
                                static_cast<P*>(dgamma), static_cast<P*>(dbeta), static_cast<float*>(workspace),
                                shape, silu, stream);
    };
    if (vec) run(std::integral_constant<int, 8>{});
    else run(std::integral_constant<int, 1>{});
  });
}

}  // namespace sdxl::cuda
