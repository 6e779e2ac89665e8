"""The numba plumbing every kernel module shares: compile options, LLVM-IR intrinsics, stack
buffers, the lane sum, CPU-feature queries, the kernels' thread count, and where numba caches them.

Owns: `_JIT` / `_INLINE` (the options every kernel compiles with), the bit-level intrinsics
(E2M1 / E4M3 / BF16 decodes, `_fma`, float bit casts, `_nn`, `_prefetch`), `_stack_f32` /
`_stack_f64`, `_lane_sum` (the fixed pairwise tree over 32 lanes), `_host_has`, the thread
setting (`set_threads`, `get_threads`, `_apply_threads`), and the kernels' cache folder
(`cache_stamp`, `cache_dir`, `KernelCacheLocator`). Does not own the kernels (`fp4.py`,
`fp8.py`, `plain.py`, `attn.py`, `qdq.py`, `sinkhorn.py`), the dispatch (`fast.py`) nor the
markers of a finished warm-up (`warm.py`).

Why the cache folder is keyed here: numba invalidates a cached function only when its own
file changes, and the kernels inline helpers from this file and from `tiles.py`. So every
kernel of this package is cached in one folder named after the hash of every `kernels/*.py`
source, numba's version and the CPU it compiles for: any change to any of them starts an
empty folder and recompiles everything. The locator is installed when this module is
imported, which every kernel module does before its first `@njit`.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import caching, cgutils
from numba.extending import intrinsic

# libgomp (numba's "omp" threading layer) spins idle workers long after each parallel region,
# taking both cores from OpenBLAS and the I/O threads (docs/kernels.md has the figures). Read
# when libgomp loads (the first parallel call), so it must be set before that.
os.environ.setdefault("GOMP_SPINCOUNT", "100000")

_JIT = {"cache": True, "fastmath": False}
_INLINE = {"inline": "always", **_JIT}  # numba-level inlining: stack lanes land in the kernel

# ---- where numba caches the kernels ----------------------------------------------------------------

_HERE = Path(__file__).resolve().parent


def cache_stamp(source: bytes | None = None) -> str:
    """What numba's cached machine code depends on: every `kernels/*.py` source (None: read them
    now), numba's version and the CPU it compiles for (a copied cache or an upgrade leaves index
    files that no longer match, and numba would then compile inside the budgeted process)."""
    import llvmlite.binding as llvm

    if source is None:
        source = b"".join(p.name.encode() + b"\0" + p.read_bytes() for p in sorted(_HERE.glob("*.py")))
    h = hashlib.sha256(source)
    cpu = (llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten())
    env = (os.environ.get("NUMBA_CPU_NAME", ""), os.environ.get("NUMBA_CPU_FEATURES", ""))
    for part in (numba.__version__, *cpu, *env):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """The kernels' cache folder: `dsv4-kernels-<cache_stamp>` under NUMBA_CACHE_DIR (read here,
    not from numba's config, so a child given the variable agrees), else next to the source, else
    (a read-only install) in the user's cache folder."""
    user = os.environ.get("NUMBA_CACHE_DIR")
    if user:
        root = Path(user)
    elif os.access(_HERE, os.W_OK):
        root = _HERE / "__pycache__"
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsv4stream"
    return root / f"dsv4-kernels-{cache_stamp()}"


@functools.cache
def _locator_dir() -> str:
    return str(cache_dir())  # once per process: about 50 functions are decorated at import


# numba 0.68 names them without the underscore; numba 0.60 (the oldest pyproject.toml allows) with it
_CACHE_IMPL = getattr(caching, "CacheImpl", None) or caching._CacheImpl
_USER_LOCATOR = getattr(caching, "UserProvidedCacheLocator", None) or caching._UserProvidedCacheLocator


class KernelCacheLocator(_USER_LOCATOR):
    """numba's locator for this package's functions: `cache_dir()`, whatever NUMBA_CACHE_DIR
    numba itself read. numba keeps its own check per file inside the folder."""

    def __init__(self, py_func, py_file):
        super().__init__(py_func, py_file)
        self._cache_path = _locator_dir()

    @classmethod
    def from_function(cls, py_func, py_file):
        if Path(py_file).resolve().parent != _HERE:
            return None  # not a kernel of this package: numba's own locators
        # UserProvidedCacheLocator's own check wants numba's CACHE_DIR set: skip to the one above it
        # (None when the folder cannot be written: numba's locators then cache per file as usual)
        return super(_USER_LOCATOR, cls).from_function(py_func, py_file)


if KernelCacheLocator not in _CACHE_IMPL._locator_classes:
    _CACHE_IMPL._locator_classes.insert(0, KernelCacheLocator)


_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32, _F64 = ir.FloatType(), ir.DoubleType()


# ---- bit-level helpers (LLVM IR: 16/32-bit integer lanes; numba would widen to int64) ----------


def _half_to_f32(builder, bits, lanes: int = 0):
    """float16 bit patterns (i16, or <lanes x i16>) -> float32, exactly.

    Where the target has F16C this is LLVM's `fpext` (one `vcvtph2ps`). Without it LLVM lowers
    `fpext half` to a call of compiler-rt's `__extendhfsf2`, which numba does not link: the
    process aborts ("Symbol not found"). There the conversion is done on the integer bits: a
    normal or non-finite half is re-biased into float32's exponent (+112, or to 255), a subnormal
    or zero is its 10-bit mantissa (an integer, exact in float32) times 2^-24. Same values."""
    # `_host_has`: a pinned target counts only the features it names (NUMBA_CPU_NAME=haswell with
    # NUMBA_CPU_FEATURES= takes this integer path too: slower, the same values, never an
    # instruction the target may lack)
    if _host_has("f16c"):
        ty = ir.VectorType(ir.HalfType(), lanes) if lanes else ir.HalfType()
        return builder.fpext(builder.bitcast(bits, ty), ir.VectorType(_F32, lanes) if lanes else _F32)

    def ty(t):
        return ir.VectorType(t, lanes) if lanes else t

    def c(k, t=_I32):
        return ir.Constant(ty(t), [k] * lanes if lanes else k)

    h = builder.zext(bits, ty(_I32))
    mag = builder.and_(h, c(0x7FFF))
    sign = builder.shl(builder.and_(h, c(0x8000)), c(16))
    exp = builder.and_(h, c(0x7C00))
    shifted = builder.shl(mag, c(13))
    normal = builder.add(shifted, c(112 << 23))
    special = builder.add(shifted, c(224 << 23))  # exponent 31 (inf / NaN) -> 255
    sub = builder.fmul(builder.sitofp(mag, ty(_F32)), c(2.0**-24, _F32))  # exponent 0: mag is the mantissa
    pick = builder.select(builder.icmp_unsigned("==", exp, c(0x7C00)), special, normal)
    pick = builder.select(builder.icmp_unsigned("==", exp, c(0)), builder.bitcast(sub, ty(_I32)), pick)
    return builder.bitcast(builder.or_(pick, sign), ty(_F32))


def _decode_via_half(builder, byte, mag_shift: int, sign_shift: int, mag_mask: int, lanes: int = 0):
    """uint8 -> float32 through a float16 bit pattern: ((b << mag_shift) & mag_mask) | sign; on a
    vector of `lanes` bytes when lanes > 0."""

    def ty(t):
        return ir.VectorType(t, lanes) if lanes else t

    def const(c):
        return ir.Constant(ty(_I16), [c] * lanes if lanes else c)

    v = builder.zext(byte, ty(_I16))
    mag = builder.and_(builder.shl(v, const(mag_shift)), const(mag_mask))
    sgn = builder.and_(builder.shl(v, const(sign_shift)), const(-0x8000))
    return _half_to_f32(builder, builder.or_(mag, sgn), lanes)


def _item_ptr(context, builder, aryty, ary, inds, elem: ir.Type):
    """Pointer to ary[inds] (no wraparound: indices are >= 0) as elem* (a vector type for vector
    loads and stores)."""
    inds = [context.cast(builder, v, t, types.intp) for v, t in inds]
    ptr = cgutils.get_item_pointer(context, builder, aryty, context.make_array(aryty)(context, builder, ary), inds)
    return builder.bitcast(ptr, elem.as_pointer())


@intrinsic
def _e2m1_lo(typingctx, b):
    """Low nibble of a packed byte as float32, times 2^-14."""

    def codegen(context, builder, sig, args):
        return _decode_via_half(builder, args[0], 9, 12, 0x0E00)

    return types.float32(types.uint8), codegen


@intrinsic
def _e2m1_hi(typingctx, b):
    """High nibble of a packed byte as float32, times 2^-14."""

    def codegen(context, builder, sig, args):
        return _decode_via_half(builder, args[0], 5, 8, 0x0E00)

    return types.float32(types.uint8), codegen


@intrinsic
def _e4m3(typingctx, b):
    """E4M3FN byte as float32, times 2^-8 (S.1111.111 -> NaN)."""

    def codegen(context, builder, sig, args):
        # sign-extended byte << 7 puts the sign at bit 15 (and a copy at bit 14, masked off) and
        # the 7 magnitude bits at 13..7: the float16 pattern in two operations instead of five
        v = builder.sext(args[0], _I16)
        bits = builder.and_(builder.shl(v, ir.Constant(_I16, 7)), ir.Constant(_I16, -0x4080))
        is_nan = builder.icmp_unsigned("==", builder.and_(v, ir.Constant(_I16, 0x7F)), ir.Constant(_I16, 0x7F))
        bits = builder.select(is_nan, ir.Constant(_I16, 0x7E00), bits)
        return _half_to_f32(builder, bits)

    return types.float32(types.uint8), codegen


@intrinsic
def _bf16(typingctx, h):
    """BF16 bit pattern (uint16) as float32."""

    def codegen(context, builder, sig, args):
        v = builder.shl(builder.zext(args[0], _I32), ir.Constant(_I32, 16))
        return builder.bitcast(v, _F32)

    return types.float32(types.uint16), codegen


@intrinsic
def _fma(typingctx, a, b, c):
    """a * b + c, rounded once, whatever the CPU (llvm.fma)."""

    def codegen(context, builder, sig, args):
        fn = builder.module.declare_intrinsic("llvm.fma", [_F32], ir.FunctionType(_F32, [_F32] * 3))
        return builder.call(fn, args)

    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def _f32_bits(typingctx, f):
    def codegen(context, builder, sig, args):
        return builder.zext(builder.bitcast(args[0], _I32), _I64)

    return types.int64(types.float32), codegen


@intrinsic
def _f32_from_bits(typingctx, i):
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.trunc(args[0], _I32), _F32)

    return types.float32(types.int64), codegen


@intrinsic
def _pow2_f64(typingctx, e):
    """2^e as float64 for -1022 <= e <= 1023."""

    def codegen(context, builder, sig, args):
        bits = builder.shl(builder.add(args[0], ir.Constant(_I64, 1023)), ir.Constant(_I64, 52))
        return builder.bitcast(bits, _F64)

    return types.float64(types.int64), codegen


@intrinsic
def _nn(typingctx, i):
    """i, promised to be >= 0: lets LLVM drop numba's negative-index wraparound and vectorise."""

    def codegen(context, builder, sig, args):
        fn = builder.module.declare_intrinsic("llvm.assume", (), ir.FunctionType(ir.VoidType(), [ir.IntType(1)]))
        builder.call(fn, [builder.icmp_signed(">=", args[0], ir.Constant(_I64, 0))])
        return args[0]

    return types.int64(types.int64), codegen


@intrinsic
def _prefetch(typingctx, w, r, j):
    """Ask for the cache line of w[r, j] (a hint: no fault, no result)."""
    sig = types.void(w, r, j)

    def codegen(context, builder, sig, args):
        tw, tr, tj = sig.args
        ptr = _item_ptr(context, builder, tw, args[0], [(args[1], tr), (args[2], tj)], _I8)
        fn = builder.module.declare_intrinsic(
            "llvm.prefetch.p0", (), ir.FunctionType(ir.VoidType(), [ptr.type, _I32, _I32, _I32])
        )
        builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return sig, codegen


def _stack_buffer(n, elem: ir.Type, nbtype):
    """Typing of an n-element stack buffer: a pointer into an array allocated once at the
    enclosing function's entry, 64-byte aligned (a vector load must not span two lines)."""
    if not isinstance(n, types.IntegerLiteral):
        return None

    def codegen(context, builder, sig, args):
        arr = cgutils.alloca_once(builder, ir.ArrayType(elem, n.literal_value))
        arr.align = 64
        return builder.bitcast(arr, elem.as_pointer())

    return types.CPointer(nbtype)(n), codegen


@intrinsic
def _stack_f32(typingctx, n):
    """Pointer to n float32 on the stack of the enclosing function."""
    return _stack_buffer(n, _F32, types.float32)


@intrinsic
def _stack_f64(typingctx, n):
    """Pointer to n float64 on the stack (a row tile's row factors: a heap array per tile was a
    malloc per 4 rows)."""
    return _stack_buffer(n, _F64, types.float64)


# ---- lanes --------------------------------------------------------------------------------------


@intrinsic
def _lane_sum(typingctx, acc, base):
    """Fixed pairwise tree over acc[base : base + 32] (LANES = FP4_LANES = 32): level h adds lane
    k + h to lane k (h = 16, 8, 4, 2, 1). In vector IR: each level adds the upper half of a vector
    to its lower half, which is that tree and what a CPU's own reductions do. numba's scalar version
    (32 loads, each with a negative-index check) cost more than the FMAs of a 1024-column row
    tile."""
    if not (isinstance(acc, types.Array) and acc.ndim == 1 and acc.layout == "C" and acc.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        at = _item_ptr(context, builder, sig.args[0], args[0], [(args[1], sig.args[1])], ir.VectorType(_F32, 32))
        v = builder.load(at, align=4)
        n = 32
        while n > 1:
            n //= 2
            lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
            hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n))))
            v = builder.fadd(lo, hi)
        return builder.extract_element(v, ir.Constant(_I32, 0))

    return types.float32(acc, base), codegen


@njit(**_INLINE)
def _finish(lane_total, fac):
    return np.float32(np.float64(lane_total) * fac)


def _host_has(feature: str) -> bool:
    from llvmlite import binding
    from numba.core import config

    if config.CPU_NAME:  # a pinned target (portable caches): only what it names
        return f"+{feature}" in (config.CPU_FEATURES or "")
    return bool(binding.get_host_cpu_features().get(feature))


# ---- threads ---------------------------------------------------------------------------------------


_threads = [0]  # requested by set_threads (0: numba's default); applied in whichever thread calls


def set_threads(n: int) -> int:
    """Threads for the kernels, clamped to 1..cores; returns the count in effect.

    numba's own setting is per calling thread; this one holds for every thread that calls
    the kernels afterwards.
    """
    _threads[0] = max(1, min(int(n), numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(_threads[0])
    return _threads[0]


def get_threads() -> int:
    return numba.get_num_threads()


def _apply_threads() -> None:
    if _threads[0] and numba.get_num_threads() != _threads[0]:
        numba.set_num_threads(_threads[0])
