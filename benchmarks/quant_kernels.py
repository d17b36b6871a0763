"""Low-bit matmul kernel speed against fp16 ``torch.matmul``, measured side by side in one run and printed as ratios.

Run: ``.venv/bin/python benchmarks/quant_kernels.py [--out reports/bench] [--repeats 50] [--budget-s 100]
[--shapes 4096x4096,4096x11008] [--no-sweep]``

On CUDA: for each weight shape (out x in) and batch (1 = decoding, 16), the AnyBCQ bit-plane kernel
(:mod:`kernels.bitplane_gemm`) at 2, 3 and 4 bits, the NuBitQ codebook kernel at 3 bits (tensor and
row codebooks) and RTN 4-bit g128 (:mod:`kernels.lut_gemm`) against ``x @ W.T`` in fp16 (cuBLAS).
Every configuration is first checked against the fp32 torch reference (relative error <= 2e-3);
a mismatch or a kernel that fails to compile is reported, not timed, and makes the script exit 1
after everything else has run. Times are medians over ``--repeats`` launches with the L2 cache
flushed before each (a decoding step reads every weight from HBM once; the flush also hides the
Python launch cost, as CUDA graphs would when serving), measured with CUDA events. Default tiles
first, then (unless ``--no-sweep``) a few other tilings of the bit-plane GEMV, within ``--budget-s``
seconds of compiling and timing. Prints the table and the issue's goal (bit-plane GEMV at 3 bits
>= 2x the fp16 GEMV at batch 1) and writes ``<out>/quant_kernels.csv``.

On CPU: Triton timing needs a GPU, so the kernels are only checked in Triton's interpreter on a
small shape, and the torch references (which dequantize, then multiply) are timed against fp32
``x @ W.T`` on small shapes.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # the interpreter must be chosen before any kernel module defines its @triton.jit functions
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.bitplane_gemm import reference as bp_reference  # noqa: E402
from kernels.lut_gemm import reference as lut_reference  # noqa: E402

try:
    import triton  # noqa: F401

    from kernels.bitplane_gemm import triton as bp_triton  # noqa: E402
    from kernels.lut_gemm import triton as lut_triton  # noqa: E402
except ImportError:  # pragma: no cover - Triton missing
    bp_triton = lut_triton = None

GROUP = 128
REL_TOL = 2e-3  # fp16 outputs: the reference rounds once, the kernels accumulate in fp32
DEVICE = "cuda"


@dataclass
class Row:
    shape: str
    batch: int
    kernel: str
    bits: int | None
    tiles: str
    status: str = "ok"
    us: float | None = None
    gb_per_s: float | None = None
    speedup_vs_fp16: float | None = None
    rel_err: float | None = None
    max_abs_err: float | None = None
    note: str = field(default="")


# ---------------------------------------------------------------------------------------------
# Problems: random stored tensors in each format (the kernels' speed does not depend on the values)


def bitplane_problem(out_f: int, in_f: int, device: str, g: torch.Generator) -> dict:
    return {
        "planes": torch.randint(0, 256, (4, out_f, (in_f + 7) // 8), generator=g, dtype=torch.uint8).to(device),
        "scales": {b: (torch.rand(out_f, -(-in_f // GROUP), b, generator=g) * 0.02).half().to(device) for b in (2, 3, 4)},
        "offset": (torch.randn(out_f, -(-in_f // GROUP), generator=g) * 0.002).half().to(device),
    }


def lut_problem(out_f: int, in_f: int, bits: int, device: str, g: torch.Generator) -> dict:
    """Codes and codebooks as stored (fp16), plus the fp32 copies of the codebooks a loader makes once:
    the kernel then skips an fp16-to-fp32 conversion per weight."""
    from kernels.group_quant import pack_codes

    q = torch.randint(0, 2**bits, (out_f, in_f), generator=g, dtype=torch.uint8)
    p = {
        "codes": pack_codes(q, bits).to(device),
        "row_book": (torch.randn(out_f, 2**bits, generator=g) * 0.02).half().to(device),
        "tensor_book": torch.randn(1, 2**bits, generator=g).half().to(device),
        "row_scale": (torch.rand(out_f, generator=g) * 0.02).half().to(device),
        "scales": (torch.rand(out_f, -(-in_f // GROUP), generator=g) * 0.002).half().to(device),
        "zeros": torch.randint(0, 2**bits, (out_f, -(-in_f // GROUP)), generator=g).half().to(device),
    }
    p["row_book32"], p["tensor_book32"] = p["row_book"].float(), p["tensor_book"].float()
    return p


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ---------------------------------------------------------------------------------------------
# Timing


class Timer:
    """Median of CUDA-event times per launch, the L2 flushed (a 256 MiB write) before each one."""

    def __init__(self, repeats: int):
        self.repeats = repeats
        self.flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        pairs = []
        for _ in range(self.repeats):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in pairs) * 1e3  # microseconds


def cpu_time(fn: Callable[[], object], repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def check(y: torch.Tensor, y_ref: torch.Tensor) -> tuple[float, float]:
    diff = (y.float() - y_ref.float())
    rel = (diff.norm() / y_ref.float().norm().clamp_min(1e-12)).item()
    return rel, diff.abs().max().item()


# ---------------------------------------------------------------------------------------------
# The CUDA run


def cases(out_f: int, in_f: int, batch: int, device: str, g: torch.Generator):
    """(kernel, bits, tiles label, kernel fn, reference fn, bytes read), default tiles only."""
    bp = bitplane_problem(out_f, in_f, device, g)
    lut3 = lut_problem(out_f, in_f, 3, device, g)
    rtn4 = lut_problem(out_f, in_f, 4, device, g)
    x = torch.randn(batch, in_f, generator=g).half().to(device)
    path = "gemv" if batch <= bp_triton.GEMV_MAX_TOKENS else "gemm"
    out = []
    for bits in (2, 3, 4):
        s = bp["scales"][bits]
        kw = dict(bits=bits, group_size=GROUP)
        out.append((f"bitplane_{path}", bits, "default",
                    lambda s=s, kw=kw: bp_triton.bitplane_gemm(x, bp["planes"], s, bp["offset"], **kw),
                    lambda s=s, kw=kw: bp_reference.bitplane_gemm(x, bp["planes"], s, bp["offset"], **kw),
                    nbytes(bp["planes"][:bits], s, bp["offset"])))
    for scope, book, rs in (("tensor", lut3["tensor_book32"], lut3["row_scale"]), ("row", lut3["row_book32"], None)):
        kw = dict(bits=3, scope=scope, group_size=GROUP, row_scale=rs)
        out.append((f"lut_{scope}_{path}", 3, "default",
                    lambda book=book, kw=kw: lut_triton.lut_gemm(x, lut3["codes"], book, **kw),
                    lambda book=book, kw=kw: lut_reference.lut_gemm(x, lut3["codes"], book, **kw),
                    nbytes(lut3["codes"], book, *([rs] if rs is not None else []))))
    rtn_args = (x, rtn4["codes"], rtn4["scales"], rtn4["zeros"])
    out.append((f"rtn_{path}", 4, "default",
                lambda: lut_triton.rtn_gemm(*rtn_args, bits=4, group_size=GROUP),
                lambda: lut_reference.rtn_gemm(*rtn_args, bits=4, group_size=GROUP),
                nbytes(*rtn_args[1:])))
    return x, bp, lut3, out


def sweep_cases(x, bp, lut3, out_f: int, in_f: int, batch: int):
    """Other tilings at 3 bits, as (priority, kernel, bits, tiles label, fn): GEMV row x chunk tiles and
    K splits at batch 1 (priority 0: the goal), the codebook GEMV, and GEMM tiles at batch 16."""
    nc = -(-in_f // 32)
    out = []
    s = bp["scales"][3]
    if batch <= bp_triton.GEMV_MAX_TOKENS:
        for bn, bc, warps in ((128, 8, 4), (128, 4, 4), (64, 8, 4), (64, 16, 4), (256, 8, 8), (128, 8, 8)):
            auto = bp_triton._split_for(-(-out_f // bn) * batch, -(-nc // bc), x.device)
            for sk in sorted({max(1, auto // 2), auto, 2 * auto}):
                t = bp_triton.GemvTiles(bn, bc, sk, warps)
                out.append((0, "bitplane_gemv", 3, f"bn{bn}_bc{bc}_split{sk}_w{warps}",
                            lambda t=t: bp_triton.bitplane_gemm(x, bp["planes"], s, bp["offset"], bits=3,
                                                                group_size=GROUP, path="gemv", tiles=t)))
        for bn, bc, warps in ((32, 16, 4), (128, 4, 4), (64, 16, 4)):
            split = lut_triton._split_for(-(-out_f // bn) * batch, -(-nc // bc), x.device)
            t = lut_triton.GemvTiles(bn, bc, split, warps)
            out.append((1, "lut_tensor_gemv", 3, f"bn{bn}_bc{bc}_split{split}_w{warps}",
                        lambda t=t: lut_triton.lut_gemm(x, lut3["codes"], lut3["tensor_book32"], bits=3, scope="tensor",
                                                        row_scale=lut3["row_scale"], path="gemv", tiles=t)))
        out.append((1, "lut_tensor_gemv", 3, "default_fp16_codebook",
                    lambda: lut_triton.lut_gemm(x, lut3["codes"], lut3["tensor_book"], bits=3, scope="tensor",
                                                row_scale=lut3["row_scale"], path="gemv")))
    else:
        for bm, bn, bc, warps in ((16, 128, 4, 4), (16, 32, 4, 4), (16, 64, 2, 4), (16, 128, 4, 8)):
            split = bp_triton._split_for(-(-out_f // bn), -(-nc // bc), x.device)
            t = bp_triton.GemmTiles(bm, bn, bc, split, warps)
            out.append((2, "bitplane_gemm", 3, f"bm{bm}_bn{bn}_bc{bc}_split{split}_w{warps}",
                        lambda t=t: bp_triton.bitplane_gemm(x, bp["planes"], s, bp["offset"], bits=3, group_size=GROUP,
                                                            path="gemm", tiles=t)))
        for bm, bn, bc, warps in ((16, 32, 4, 4), (16, 64, 1, 4), (16, 128, 2, 8)):
            split = lut_triton._split_for(-(-out_f // bn), -(-nc // bc), x.device)
            t = lut_triton.GemmTiles(bm, bn, bc, split, warps, 2)
            out.append((2, "lut_tensor_gemm", 3, f"bm{bm}_bn{bn}_bc{bc}_split{split}_w{warps}",
                        lambda t=t: lut_triton.lut_gemm(x, lut3["codes"], lut3["tensor_book32"], bits=3, scope="tensor",
                                                        row_scale=lut3["row_scale"], path="gemm", tiles=t)))
    return out


def run_cuda(args) -> list[Row]:
    timer = Timer(args.repeats)
    rows: list[Row] = []
    deadline = time.monotonic() + args.budget_s
    g = torch.Generator().manual_seed(0)
    pending_sweeps = []
    fp16_us: dict[tuple[str, int], float] = {}

    def measure(row: Row, fn, ref_fn, read_bytes, base_key) -> None:
        try:
            y = fn()
            torch.cuda.synchronize()
            if ref_fn is not None:
                row.rel_err, row.max_abs_err = check(y, ref_fn())
                if not row.rel_err <= REL_TOL:  # NaN fails too
                    row.status = "MISMATCH"
                    row.note = f"rel_err {row.rel_err:.3g} > {REL_TOL}"
                    return
            row.us = timer(fn)
            row.gb_per_s = read_bytes / (row.us * 1e-6) / 1e9 if read_bytes else None
            base = fp16_us.get(base_key)
            row.speedup_vs_fp16 = base / row.us if base else None
        except Exception as exc:  # a kernel that does not compile or launch: report it, go on
            row.status = "ERROR"
            row.note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            traceback.print_exc()

    for out_f, in_f in args.shapes:
        shape = f"{out_f}x{in_f}"
        for batch in (1, 16):
            key = (shape, batch)
            x, bp, lut3, todo = cases(out_f, in_f, batch, DEVICE, g)
            w16 = (torch.randn(out_f, in_f, generator=g) * 0.02).half().to(DEVICE)
            base = Row(shape, batch, "fp16_matmul", 16, "cublas")
            measure(base, lambda: torch.matmul(x, w16.t()), None, nbytes(w16), None)
            fp16_us[key] = base.us
            base.speedup_vs_fp16 = 1.0
            print_row(base)
            rows.append(base)
            # The one shared reference per problem: the fp32 torch reference (dequantize, multiply).
            ref_cache: dict[str, torch.Tensor] = {}
            for kernel, bits, tiles, fn, ref_fn, read in todo:
                row = Row(shape, batch, kernel, bits, tiles)
                ref_key = f"{kernel}_{bits}"
                ref_cache[ref_key] = ref_fn()
                measure(row, fn, lambda k=ref_key: ref_cache[k], read, key)
                print_row(row)
                rows.append(row)
            if args.sweep:
                read3 = nbytes(bp["planes"][:3], bp["scales"][3], bp["offset"])
                read_lut = nbytes(lut3["codes"], lut3["tensor_book"], lut3["row_scale"])
                for prio, kernel, bits, tiles, fn in sweep_cases(x, bp, lut3, out_f, in_f, batch):
                    ref_key = f"{kernel}_{bits}"
                    pending_sweeps.append((prio, Row(shape, batch, kernel, bits, tiles), fn, ref_cache[ref_key],
                                           read3 if kernel.startswith("bitplane") else read_lut, key))
            del ref_cache
    pending_sweeps.sort(key=lambda item: item[0])  # the goal's GEMV tilings first, on every shape
    pending_sweeps = [item[1:] for item in pending_sweeps]
    if pending_sweeps:
        print("\n# other tilings (3 bits)")
        print_header()
    for row, fn, y_ref, read, key in pending_sweeps:
        if time.monotonic() > deadline:
            row.status = "SKIPPED"
            row.note = f"over --budget-s {args.budget_s}"
            rows.append(row)
            continue
        measure(row, fn, lambda y_ref=y_ref: y_ref, read, key)
        print_row(row)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# The CPU run


def three_bit_products(x, bp: dict, lut3: dict, impl_bp, impl_lut) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """The 3-bit products of one input, through ``impl_bp``/``impl_lut`` (a reference or a Triton module)."""
    return [
        ("bitplane", lambda: impl_bp.bitplane_gemm(x, bp["planes"], bp["scales"][3], bp["offset"], bits=3,
                                                   group_size=GROUP)),
        ("lut_tensor", lambda: impl_lut.lut_gemm(x, lut3["codes"], lut3["tensor_book"], bits=3, scope="tensor",
                                                 row_scale=lut3["row_scale"])),
        ("rtn", lambda: impl_lut.rtn_gemm(x, lut3["codes"], lut3["scales"], lut3["zeros"], bits=3, group_size=GROUP)),
    ]


def run_cpu(args) -> list[Row]:
    rows: list[Row] = []
    print("Triton timing needs a GPU (no CUDA device here): checking the kernels in Triton's interpreter "
          "on a small shape, then timing the torch references against fp32 x @ W.T on small shapes.")
    g = torch.Generator().manual_seed(0)
    if bp_triton is not None and bp_triton.INTERPRETED:
        out_f, in_f = 48, 256
        bp, lut3 = bitplane_problem(out_f, in_f, "cpu", g), lut_problem(out_f, in_f, 3, "cpu", g)
        for batch in (1, 16):
            x = torch.randn(batch, in_f, generator=g)
            kernels = three_bit_products(x, bp, lut3, bp_triton, lut_triton)
            refs = three_bit_products(x, bp, lut3, bp_reference, lut_reference)
            for (kernel, fn), (_, ref_fn) in zip(kernels, refs):
                row = Row(f"{out_f}x{in_f}", batch, f"{kernel}_interpreted", 3, "default", note="correctness only")
                row.rel_err, row.max_abs_err = check(fn(), ref_fn())
                if not row.rel_err <= 1e-5:
                    row.status = "MISMATCH"
                print_row(row)
                rows.append(row)
    else:
        print("(Triton is not installed, or TRITON_INTERPRET was not set before import: no interpreter check; "
              "pip install triton==3.7.1)")
    print("\n# torch references on CPU (dequantize every call, then multiply), fp32; ratios vs fp32 x @ W.T")
    print_header()
    for out_f, in_f in ((512, 512), (512, 1376)):
        bp, lut3 = bitplane_problem(out_f, in_f, "cpu", g), lut_problem(out_f, in_f, 3, "cpu", g)
        w = torch.randn(out_f, in_f, generator=g) * 0.02
        for batch in (1, 16):
            x = torch.randn(batch, in_f, generator=g)
            base = Row(f"{out_f}x{in_f}", batch, "fp32_matmul", 32, "torch")
            base.us = cpu_time(lambda: x @ w.t(), args.repeats)
            base.speedup_vs_fp16 = 1.0
            rows.append(base)
            print_row(base)
            for kernel, fn in three_bit_products(x, bp, lut3, bp_reference, lut_reference):
                row = Row(f"{out_f}x{in_f}", batch, f"{kernel}_reference", 3, "torch", note="ratio vs fp32 matmul")
                row.us = cpu_time(fn, args.repeats)
                row.speedup_vs_fp16 = base.us / row.us
                rows.append(row)
                print_row(row)
    return rows


# ---------------------------------------------------------------------------------------------


def fmt(v, spec):
    return format(v, spec) if v is not None else "-"


def print_header() -> None:
    print(f"{'shape':>11} {'batch':>5} {'kernel':<20} {'bits':>4} {'tiles':<26} {'us':>9} {'GB/s':>7} "
          f"{'x fp16':>7} {'rel_err':>8} {'status':<8} note")


def print_row(r: Row) -> None:
    print(f"{r.shape:>11} {r.batch:>5} {r.kernel:<20} {fmt(r.bits, 'd'):>4} {r.tiles:<26} {fmt(r.us, '9.2f'):>9} "
          f"{fmt(r.gb_per_s, '7.0f'):>7} {fmt(r.speedup_vs_fp16, '7.2f'):>7} {fmt(r.rel_err, '8.1e'):>8} "
          f"{r.status:<8} {r.note}", flush=True)


def goal_lines(rows: list[Row]) -> list[str]:
    out = []
    for shape in sorted({r.shape for r in rows}):
        cands = [r for r in rows if r.shape == shape and r.batch == 1 and r.kernel == "bitplane_gemv" and r.bits == 3
                 and r.status == "ok" and r.speedup_vs_fp16]
        if not cands:
            out.append(f"goal {shape}: no bit-plane GEMV 3-bit timing")
            continue
        default = next((r for r in cands if r.tiles == "default"), None)
        best = max(cands, key=lambda r: r.speedup_vs_fp16)
        verdict = "met" if best.speedup_vs_fp16 >= 2.0 else "NOT met"
        out.append(f"goal {shape}: bit-plane GEMV 3-bit vs fp16 GEMV at batch 1: default tiles "
                   f"{fmt(default.speedup_vs_fp16 if default else None, '.2f')}x, best {best.speedup_vs_fp16:.2f}x "
                   f"({best.tiles}) -> goal (>= 2x) {verdict}")
    return out


def parse_shapes(text: str) -> list[tuple[int, int]]:
    try:
        return [tuple(int(v) for v in s.lower().split("x")) for s in text.split(",") if s]  # type: ignore[misc]
    except ValueError:
        raise SystemExit(f"--shapes: expected OUTxIN[,OUTxIN...], got {text!r}") from None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("reports/bench"), help="folder for quant_kernels.csv")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--budget-s", type=float, default=90.0,
                    help="start no further tiling sweeps after this many seconds from the start")
    ap.add_argument("--shapes", type=parse_shapes, default=[(4096, 4096), (4096, 11008)], help="weights OUTxIN, comma-separated")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false", help="default tiles only")
    args = ap.parse_args()
    t0 = time.monotonic()
    use_triton = CUDA and bp_triton is not None
    import platform

    print(f"torch {torch.__version__}, triton {getattr(sys.modules.get('triton'), '__version__', 'missing')}, "
          f"python {platform.python_version()}, device "
          + (torch.cuda.get_device_name() if CUDA else f"cpu ({torch.get_num_threads()} threads)"))
    if CUDA and not use_triton:
        print("CUDA is here but Triton is not installed (pip install triton==3.7.1): nothing to time.")
        return 1
    if use_triton:
        print(f"weights {', '.join(f'{o}x{i}' for o, i in args.shapes)} (out x in), group size {GROUP}, "
              f"{args.repeats} repeats, L2 flushed before each; x fp16; GEMV for batch <= {bp_triton.GEMV_MAX_TOKENS}\n")
        print_header()
        rows = run_cuda(args)
    else:
        rows = run_cpu(args)
    print()
    for line in goal_lines(rows) if use_triton else []:
        print(line)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "quant_kernels.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(rows[0]).keys()))
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))
    bad = [r for r in rows if r.status in ("MISMATCH", "ERROR")]
    print(f"wrote {path} ({len(rows)} rows) in {time.monotonic() - t0:.0f} s")
    if bad:
        print(f"FAILED: {len(bad)} configuration(s) mismatched the reference or failed to run:")
        for r in bad:
            print(f"  {r.shape} batch {r.batch} {r.kernel} {r.bits} bits {r.tiles}: {r.status} {r.note}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
