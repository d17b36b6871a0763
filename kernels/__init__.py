"""scalelab's compute kernels: one folder per op, each with a torch reference beside its Triton version.

Layout of ``kernels/<op>/``:

* ``reference.py`` — plain torch, computed in fp32: the definition of the op and what tests compare with;
* ``triton.py`` — ``@triton.jit`` kernel -> host launcher (grid, strides, allocation) -> public
  function with the same keyword signature as the reference and a docstring giving shapes;
* ``__init__.py`` — the public entry point; it asks :func:`kernels._dispatch.backend` which
  implementation runs: compiled Triton for CUDA tensors, the reference for CPU tensors, and
  Triton's interpreter when ``SCALELAB_TRITON=interpret`` or ``TRITON_INTERPRET=1`` is set.

Ops:

* :mod:`kernels.group_quant` — per-group asymmetric integer quantization and dequantization
  (round-to-nearest weight quantization, stage 3);
* :mod:`kernels.sparse_gemv` — TEAL's activation-sparse matrix-vector product, which reads only the
  weight columns of active input channels (stage 4);
* :mod:`kernels.sparse_attention` — sparse prefill attention over given key lists: QuoKA's gathered
  KV subset per query chunk and ProxyAttn's block-sparse attention per query block (stage 4).

The top-level name ``kernels`` is also the name of a Hugging Face package; transformers must not
mistake this one for it (``tests/kernels/test_transformers_probe.py`` checks), so nothing here
defines the attributes that package exports.
"""

from kernels._dispatch import Backend, backend

__all__ = ["Backend", "backend"]
