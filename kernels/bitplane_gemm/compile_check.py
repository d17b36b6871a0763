"""Compile the low-bit matmul kernels for an NVIDIA GPU on a machine without one, to catch what only fails compiled.

Run: ``.venv/bin/python -m kernels.bitplane_gemm.compile_check [--arch 90] [--quick]`` (without
``TRITON_INTERPRET``/``SCALELAB_TRITON=interpret``: the kernels must be defined for compilation).

The interpreter runs kernels as numpy and accepts things the compiler refuses (a ``.to`` on an
integer argument Triton specialised to a constant, a non-constexpr block size, a dtype clash in a
shift). This goes through each public Triton entry point of :mod:`kernels.bitplane_gemm` and
:mod:`kernels.lut_gemm` with CPU tensors of real layer shapes, and where a kernel would be launched
builds it exactly as a launch on an sm_``arch`` GPU would (Triton's own argument specialisation,
then ``triton.compile`` down to a cubin with the bundled ptxas); nothing runs. Prints each variant
with its shared memory, registers and spill stack (``cuobjdump -res-usage``), and exits 1 if any
fails to compile, 2 if this Triton's launch internals are not the ones this relies on (3.7).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from kernels.group_quant import pack_codes


def _resource_usage(cubin: bytes) -> str:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    regs, stack = re.findall(r"REG:(\d+)", out), re.findall(r"STACK:(\d+)", out)
    return f"regs {regs[0] if regs else '?'} stack {stack[0] if stack else '?'}"


@contextlib.contextmanager
def compile_instead_of_launch(arch: int, log: list):
    """Within the block, ``kernel[grid](...)`` compiles for ``cuda:arch`` and returns without running."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    real_run = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        binder = create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization, options)
        flags = {self.arg_names[k[0]]: v for k, v in constexprs.items() if self.arg_names[k[0]].isupper()}
        t0 = time.monotonic()
        try:
            kernel = triton.compile(ASTSource(self, signature, constexprs, attrs), target=target,
                                    options=options.__dict__)
        except Exception as exc:
            log.append((self.__name__, flags, exc))
            print(f"FAILED  {self.__name__} {flags}\n{traceback.format_exc()}", flush=True)
            return None
        log.append((self.__name__, flags, None))
        print(f"ok      {self.__name__} {flags} {time.monotonic() - t0:.1f}s shared {kernel.metadata.shared} "
              f"{_resource_usage(kernel.asm['cubin'])}", flush=True)
        return None

    JITFunction.run = run
    try:
        yield
    finally:
        JITFunction.run = real_run


def variants(quick: bool):
    """(label, thunk) pairs: calls of the public Triton functions on CPU tensors."""
    import torch

    # lazy: these import triton (optional) and define the kernels, which must wait until main() has
    # checked that TRITON_INTERPRET is unset and that this Triton has the launch internals patched here
    from kernels.bitplane_gemm import triton as bp
    from kernels.lut_gemm import triton as lut

    g = torch.Generator().manual_seed(0)
    shapes = [(4096, 4096), (63, 500)] if quick else [(4096, 4096), (4096, 11008), (63, 500)]
    for rows, cols in shapes:
        groups = -(-cols // 128)
        planes = torch.randint(0, 256, (4, rows, (cols + 7) // 8), generator=g, dtype=torch.uint8)
        x1, x16 = torch.randn(1, cols).half(), torch.randn(16, cols).half()
        for bits in ((3,) if quick or rows < 100 else (2, 3, 4)):
            sc, off = torch.rand(rows, groups, bits).half(), torch.rand(rows, groups).half()
            kw = dict(bits=bits, group_size=128)
            yield "bitplane gemv split", lambda: bp.bitplane_gemm(x1, planes, sc, off, path="gemv",
                                                                  tiles=bp.GemvTiles(128, 8, 8), **kw)
            yield "bitplane gemv", lambda: bp.bitplane_gemm(x1, planes, sc, None, path="gemv",
                                                            tiles=bp.GemvTiles(128, 8, 1), **kw)
            yield "bitplane gemm", lambda: bp.bitplane_gemm(x16, planes, sc, off, path="gemm", **kw)
            if rows < 100:
                yield "bitplane gemm fp32 unaligned", lambda: bp.bitplane_gemm(
                    x16.float(), planes, torch.rand(rows, -(-cols // 48), bits).half(), None, bits=bits,
                    group_size=48, path="gemm")
                yield "bitplane gemm bf16 split", lambda: bp.bitplane_gemm(
                    x16.bfloat16(), planes, sc, off, path="gemm", tiles=bp.GemmTiles(16, 64, 4, 2), **kw)
        for bits in ((3,) if quick else (3, 4)) if rows > 100 else (3, 5):
            codes = pack_codes(torch.randint(0, 2**bits, (rows, cols), generator=g, dtype=torch.uint8), bits)
            books = {"row": torch.rand(rows, 2**bits), "group": torch.rand(rows * groups, 2**bits),
                     "tensor": torch.rand(1, 2**bits)}
            rs = torch.rand(rows).half()
            for scope, book in books.items():
                for x, path in ((x1, "gemv"), (x16, "gemm")):
                    yield f"lut {scope} {path}", lambda: lut.lut_gemm(
                        x, codes, book, bits=bits, scope=scope, group_size=128,
                        row_scale=rs if scope == "tensor" else None, path=path)
            sc, zr = torch.rand(rows, groups).half(), torch.rand(rows, groups).half()
            for x, path in ((x1, "gemv"), (x16, "gemm")):
                yield f"rtn {path}", lambda: lut.rtn_gemm(x, codes, sc, zr, bits=bits, group_size=128, path=path,
                                                          tiles=lut.GemvTiles(64, 8, 4) if path == "gemv" else None)
            if rows < 100:
                yield "rtn gemm unaligned", lambda: lut.rtn_gemm(
                    x16, codes, torch.rand(rows, -(-cols // 48)).half(), None, bits=bits, group_size=48)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 (H100/H200), 80 (A100)")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and bit widths")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or os.environ.get("SCALELAB_TRITON", "") == "interpret":
        print("compile_check: unset TRITON_INTERPRET / SCALELAB_TRITON=interpret (kernels must be defined for compilation)")
        return 2
    try:
        from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: F401

        if not hasattr(JITFunction, "_pack_args"):
            raise ImportError("JITFunction._pack_args")
    except ImportError as exc:
        print(f"compile_check: this Triton lacks the launch internals it relies on ({exc}); pin triton==3.7.1")
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    log: list = []
    t0 = time.monotonic()
    with compile_instead_of_launch(args.arch, log):
        for label, thunk in variants(args.quick):
            try:
                thunk()
            except Exception as exc:  # a host-side error before any compile
                log.append((label, {}, exc))
                print(f"FAILED  {label} (host side): {type(exc).__name__}: {exc}", flush=True)
    failed = [entry for entry in log if entry[2] is not None]
    print(f"{len(log) - len(failed)} variants compiled for sm_{args.arch}, {len(failed)} failed, "
          f"{time.monotonic() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
