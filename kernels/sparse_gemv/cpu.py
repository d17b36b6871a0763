"""TEAL's sparse GEMV on CPU: a C++ kernel (built on first use with ``torch.utils.cpp_extension``).

Same op and signature as :mod:`kernels.sparse_gemv.reference`: ``y = W s_t(x)``,
``s_t(x)_i = x_i if |x_i| >= t else 0``, reading only the weight columns of active channels.

Per token the active channels are compacted into (index, value) lists, then, for a channel-major
weight (``w_t.t()`` with ``w_t = weight.t().contiguous()``, TEAL's layout, where channel ``i`` is
the contiguous row ``w_t[i]``):

* the active rows are split across torch's intra-op threads; each thread sums its rows into a
  private fp32 accumulator of ``out`` floats, and the accumulators are added at the end — every
  thread streams whole rows, the access pattern hardware prefetchers follow best (splitting by
  output columns instead, as an ``embedding_bag`` per half does, cuts each row into short pieces);
* rows go eight at a time through a loop over output tiles of 4096 floats, so each accumulator
  tile is loaded and stored once per eight rows and the compiler vectorises the fused multiply-adds
  (``-O3 -march=native``).

A row-major weight (``(out, in)`` contiguous, ``nn.Linear``'s) is handled by a gather per output
row: correct and never touching an inactive entry, but every cache line of the weight is still
fetched at moderate sparsity — store the weight channel-major to skip reads. fp32 only: other dtypes
and strides go to the reference. The split, tile and row group were chosen on a 2-core AMD EPYC
(Zen 4) among split-by-rows vs split-by-output-columns, 4 vs 8 rows per pass, tiles of 4096 vs whole
rows, with and without software prefetch: split by rows, 8 rows, 4096-float tiles, no prefetch was
fastest or within noise at the 7B and SmolLM2 shapes (``benchmarks/sparse_speed.py`` times it).

The build needs a C++ compiler (``g++``) with OpenMP; without one, or if the build fails,
:func:`available` is False, one warning says why, and the dispatcher keeps the reference.
"""

from __future__ import annotations

import functools
import shutil
import warnings
from types import ModuleType

import torch

from kernels.sparse_gemv import reference
from kernels.sparse_gemv.reference import _check

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int kRows = 8;         // rows summed per pass over an accumulator tile
constexpr int64_t kTile = 4096;  // output floats per tile (16 KiB of accumulator)

// acc[j0:j1] += sum_r val[r] * w[idx[r] * ldw + j] over rows r in [b, e)
inline void add_rows(float* __restrict__ acc, const float* __restrict__ w, int64_t ldw,
                     const int64_t* idx, const float* val, int64_t b, int64_t e, int64_t j0, int64_t j1) {
  int64_t r = b;
  for (; r + kRows <= e; r += kRows) {
    const float* p[kRows];
    float a[kRows];
    for (int u = 0; u < kRows; ++u) { p[u] = w + idx[r + u] * ldw; a[u] = val[r + u]; }
#pragma omp simd
    for (int64_t j = j0; j < j1; ++j) {
      float s = acc[j];
      for (int u = 0; u < kRows; ++u) s += a[u] * p[u][j];
      acc[j] = s;
    }
  }
  for (; r < e; ++r) {
    const float* p0 = w + idx[r] * ldw;
    const float a0 = val[r];
#pragma omp simd
    for (int64_t j = j0; j < j1; ++j) acc[j] += a0 * p0[j];
  }
}

int64_t compact(const float* x, int64_t k, double threshold, int64_t* idx, float* val) {
  int64_t m = 0;
  for (int64_t i = 0; i < k; ++i) {
    const float v = x[i];
    if (std::fabs(v) >= threshold) { idx[m] = i; val[m] = v; ++m; }
  }
  return m;
}

}  // namespace

// x (T, K) contiguous fp32; w_t (K, N) fp32 with unit stride along N (row i = channel i's column).
torch::Tensor channel_major(torch::Tensor x, torch::Tensor w_t, double threshold) {
  const int64_t T = x.size(0), K = x.size(1), N = w_t.size(1), ldw = w_t.stride(0);
  auto y = torch::empty({T, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w_t.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::vector<int64_t> idx(std::max<int64_t>(K, 1));
  std::vector<float> val(std::max<int64_t>(K, 1));
  const int threads = at::get_num_threads();
  std::vector<float> part(static_cast<size_t>(threads) * std::max<int64_t>(N, 1));
  // at least ~32k multiply-adds per thread, so small products stay on one thread
  const int64_t grain = std::max<int64_t>(kRows, 32768 / std::max<int64_t>(N, 1));
  for (int64_t t = 0; t < T; ++t) {
    const int64_t m = compact(xp + t * K, K, threshold, idx.data(), val.data());
    float* yt = yp + t * N;
    std::fill(part.begin(), part.end(), 0.f);
    at::parallel_for(0, m, grain, [&](int64_t b, int64_t e) {
      float* acc = part.data() + static_cast<size_t>(at::get_thread_num()) * N;
      for (int64_t j0 = 0; j0 < N; j0 += kTile)
        add_rows(acc, wp, ldw, idx.data(), val.data(), b, e, j0, std::min(N, j0 + kTile));
    });
    at::parallel_for(0, N, 8192, [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; ++j) {
        float s = 0.f;
        for (int u = 0; u < threads; ++u) s += part[static_cast<size_t>(u) * N + j];
        yt[j] = s;
      }
    });
  }
  return y;
}

// x (T, K) contiguous fp32; w (N, K) fp32 with unit stride along K (nn.Linear's layout).
torch::Tensor row_major(torch::Tensor x, torch::Tensor w, double threshold) {
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0), ldw = w.stride(0);
  auto y = torch::empty({T, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::vector<int64_t> idx(std::max<int64_t>(K, 1));
  std::vector<float> val(std::max<int64_t>(K, 1));
  for (int64_t t = 0; t < T; ++t) {
    const int64_t m = compact(xp + t * K, K, threshold, idx.data(), val.data());
    float* yt = yp + t * N;
    at::parallel_for(0, N, std::max<int64_t>(1, 32768 / std::max<int64_t>(m, 1)), [&](int64_t b, int64_t e) {
      for (int64_t o = b; o < e; ++o) {
        const float* row = wp + o * ldw;
        float s = 0.f;
        for (int64_t r = 0; r < m; ++r) s += val[r] * row[idx[r]];
        yt[o] = s;
      }
    });
  }
  return y;
}
"""

_FLAGS = ["-O3", "-march=native", "-fopenmp"]


@functools.cache
def _extension() -> ModuleType | None:
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        warnings.warn("kernels.sparse_gemv.cpu: no C++ compiler on PATH, so the CPU sparse GEMV uses the torch "
                      "reference; install one (apt-get install g++) for the C++ kernel", RuntimeWarning, stacklevel=3)
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline("scalelab_sparse_gemv_cpu", cpp_sources=_SOURCE, functions=["channel_major", "row_major"],
                           extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as err:  # a broken toolchain must not fail a run: say why and keep the reference
        warnings.warn(f"kernels.sparse_gemv.cpu: building the C++ kernel with {compiler} failed ({err}); the CPU "
                      "sparse GEMV uses the torch reference", RuntimeWarning, stacklevel=3)
        return None


def available() -> bool:
    """True when the C++ kernel is built (building it on the first call, ~1 min, cached afterwards)."""
    return _extension() is not None


def sparse_gemv(x: torch.Tensor, weight: torch.Tensor, *, threshold: float) -> torch.Tensor:
    """``y = weight @ (x where |x| >= threshold else 0)``, reading only active columns of ``weight``.

    x: (in,) or (..., in); weight: (out, in), fp32 on CPU — channel-major (``w_t.t()``) for the fast
    path, row-major handled by a gather; anything else (other dtypes or strides, no compiler) runs
    :func:`kernels.sparse_gemv.reference.sparse_gemv`. Returns (..., out) in ``x.dtype``.

    >>> w_t = torch.randn(11008, 4096)                       # (in, out): channel-major storage
    >>> y = sparse_gemv(torch.randn(11008), w_t.t(), threshold=0.67)   # ~50% of channels active
    """
    _check(x, weight)
    ext = _extension()
    if (ext is None or x.device.type != "cpu" or weight.device.type != "cpu" or x.dtype != torch.float32
            or weight.dtype != torch.float32):
        return reference.sparse_gemv(x, weight, threshold=threshold)
    lead, out_f = x.shape[:-1], weight.shape[0]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if weight.stride(0) == 1 or out_f == 1:  # channel-major: weight.t() has unit stride along out
        y = ext.channel_major(x2, weight.t(), float(threshold))
    elif weight.stride(1) == 1:
        y = ext.row_major(x2, weight, float(threshold))
    else:
        return reference.sparse_gemv(x, weight, threshold=threshold)
    return y.reshape(*lead, out_f)
