"""Kernel speed, measured side by side in one run and printed as ratios.

Run: ``.venv/bin/python benchmarks/kernels.py [--size 4096] [--repeats 30]``

On CUDA: the Triton kernels against the torch reference (group quantization) and against the dense
cuBLAS product (TEAL's sparse GEMV, decoding: one token) at several sparsities.
On CPU: Triton timing needs a GPU, so it times what runs here — the torch references — and the real
CPU question for TEAL: does gathering the active weight columns beat the dense matrix-vector
product, and by how much at each sparsity?
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.group_quant import reference as gq_reference  # noqa: E402
from kernels.sparse_gemv import reference as sg_reference  # noqa: E402

SPARSITIES = (0.0, 0.25, 0.5, 0.65, 0.8, 0.9)


def timed(fn, repeats: int, cuda: bool) -> float:
    """Median seconds per call after two warm-up calls."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def threshold_for(x: torch.Tensor, sparsity: float) -> float:
    """The |x| value below which a fraction ``sparsity`` of ``x`` lies (0 for dense)."""
    k = int(sparsity * x.numel())
    return 0.0 if k == 0 else float(x.abs().flatten().kthvalue(k).values) + 1e-12


def bench_group_quant(size: int, repeats: int, device: str, use_triton: bool) -> None:
    w = torch.randn(size, size, device=device, dtype=torch.float16 if use_triton else torch.float32) * 0.02
    print(f"\n# group_quant: {size}x{size} {w.dtype}, 4 bits, group 128 ({device})")
    ref_q = timed(lambda: gq_reference.quantize(w, bits=4, group_size=128), repeats, use_triton)
    q, s, z = gq_reference.quantize(w, bits=4, group_size=128)
    ref_d = timed(lambda: gq_reference.dequantize(q, s, z, group_size=128, dtype=w.dtype), repeats, use_triton)
    gb = w.numel() * w.element_size() / 1e9
    print(f"reference  quantize {ref_q * 1e3:8.2f} ms ({gb / ref_q:6.2f} GB/s of weights)   "
          f"dequantize {ref_d * 1e3:8.2f} ms")
    if use_triton:
        from kernels.group_quant import triton as gq_triton

        tq = timed(lambda: gq_triton.quantize(w, bits=4, group_size=128), repeats, True)
        td = timed(lambda: gq_triton.dequantize(q, s, z, group_size=128, dtype=w.dtype), repeats, True)
        print(f"triton     quantize {tq * 1e3:8.2f} ms ({gb / tq:6.2f} GB/s)   dequantize {td * 1e3:8.2f} ms")
        print(f"speed-up over reference: quantize {ref_q / tq:5.1f}x   dequantize {ref_d / td:5.1f}x")


def bench_sparse_gemv(size: int, repeats: int, device: str, use_triton: bool) -> None:
    out_f, in_f = size, int(size * 2.6875)  # an MLP down projection's shape (e.g. 4096 x 11008)
    dtype = torch.float16 if use_triton else torch.float32
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(out_f, in_f, generator=g) / in_f**0.5).to(dtype).to(device)
    w_channel_major = w.t().contiguous().t()  # TEAL's layout: channel i is a contiguous row of w.t()
    x = torch.randn(1, in_f, generator=g).to(dtype).to(device)
    mb = w.numel() * w.element_size() / 2**20
    print(f"\n# sparse_gemv (TEAL): one token, weight {out_f}x{in_f} {dtype} ({mb:.0f} MiB), {device}")
    dense = timed(lambda: x @ w.t(), repeats, use_triton)
    print(f"dense x @ W.T: {dense * 1e3:.3f} ms")
    if use_triton:
        from kernels.sparse_gemv import triton as sg_triton

        print("sparsity  triton_row_ms  triton_chan_ms  speed-up_vs_dense(row, chan)")
        for s in SPARSITIES:
            t = threshold_for(x, s)
            row = timed(lambda: sg_triton.sparse_gemv(x, w, threshold=t), repeats, True)
            chan = timed(lambda: sg_triton.sparse_gemv(x, w_channel_major, threshold=t), repeats, True)
            print(f"{s:8.2f}  {row * 1e3:13.3f}  {chan * 1e3:14.3f}  {dense / row:6.2f}x {dense / chan:6.2f}x")
    print("sparsity  achieved  gather_row_ms  gather_chan_ms  speed-up_vs_dense(row, chan)")
    for s in SPARSITIES:
        t = threshold_for(x, s)
        achieved = float((x.abs() < t).float().mean())
        row = timed(lambda: sg_reference.sparse_gemv(x, w, threshold=t), repeats, use_triton)
        chan = timed(lambda: sg_reference.sparse_gemv(x, w_channel_major, threshold=t), repeats, use_triton)
        print(f"{s:8.2f}  {achieved:8.3f}  {row * 1e3:13.3f}  {chan * 1e3:14.3f}  "
              f"{dense / row:6.2f}x {dense / chan:6.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096, help="d_model of the benchmarked matrices")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    try:
        import triton  # noqa: F401

        have_triton = True
    except ImportError:
        have_triton = False
    use_triton = cuda and have_triton
    device = "cuda" if cuda else "cpu"
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {device}"
          + (f" ({torch.cuda.get_device_name()})" if cuda else ""))
    if not use_triton:
        why = "no CUDA device" if not cuda else "Triton is not installed (pip install triton==3.7.1)"
        print(f"Triton timing needs a GPU ({why}): timing the torch references only.")
    bench_group_quant(args.size, args.repeats, device, use_triton)
    bench_sparse_gemv(args.size, args.repeats, device, use_triton)


if __name__ == "__main__":
    main()
