"""LLVM IR building blocks shared by the fast-numerics kernels (`q8.py`, `bf16.py`).

numba `@intrinsic` code generators emit these: typed pointers into array arguments, vector
loads, x86 intrinsic declarations, a fixed-order horizontal sum, and the `bfloat` IR type that
llvmlite lacks (LLVM 17+ declares the AVX-512 BF16 intrinsics on `<N x bfloat>`; the installed
llvmlite's LLVM is checked where those are declared). Nothing here decides which instructions
a CPU has: `cpu.py` does, and only kernels it allows are ever compiled.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types

I8, I16, I32, I64, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
LLVM_MAJOR = llvm.llvm_version_info[0]
STAMP = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:10]  # in the kernels' cache names


class _BFloat(ir.Type):
    """LLVM's `bfloat` (llvmlite has no such type; only its name is needed in IR text)."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


BF = _BFloat()


def vec(elem: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(elem, n)


def c64(v: int) -> ir.Constant:
    return ir.Constant(I64, v)


def splat(elem: ir.Type, n: int, v) -> ir.Constant:
    return ir.Constant(vec(elem, n), [v] * n)


def base(context, builder, aryty, ary, elem: ir.Type):
    """Pointer to the first element of array argument `ary` as elem*."""
    a = context.make_array(aryty)(context, builder, ary)
    return builder.bitcast(a.data, elem.as_pointer())


def shape(context, builder, aryty, ary, axis: int):
    return builder.extract_value(context.make_array(aryty)(context, builder, ary).shape, axis)


def index(context, builder, v, ty):
    """An integer argument as i64."""
    return context.cast(builder, v, ty, types.intp)


def load(builder, ptr, off, vty: ir.VectorType, align: int = 1):
    """Vector of type vty at ptr + off elements (ptr's element type)."""
    return builder.load(builder.bitcast(builder.gep(ptr, [off]), vty.as_pointer()), align=align)


def declare(builder, name: str, ret: ir.Type, args: list[ir.Type]):
    return builder.module.declare_intrinsic(name, (), ir.FunctionType(ret, args))


def hsum(builder, v, n: int):
    """Sum of the n lanes of float vector v in a fixed tree order (halves added lane-wise)."""
    while n > 1:
        h = n // 2
        a = builder.shuffle_vector(v, v, ir.Constant(vec(I32, h), list(range(h))))
        b = builder.shuffle_vector(v, v, ir.Constant(vec(I32, h), list(range(h, n))))
        v = builder.fadd(a, b)
        n = h
    return builder.extract_element(v, ir.Constant(I32, 0))


def fma(builder, a, b, c, lanes: int):
    f = declare(builder, f"llvm.fma.v{lanes}f32", vec(F32, lanes), [vec(F32, lanes)] * 3)
    return builder.call(f, [a, b, c])


def dpbf16(builder):
    """vdpbf16ps zmm: acc <16 x float> + pairs of <32 x bfloat> (LLVM 17+ types it on bfloat,
    older LLVM on <16 x i32>)."""
    if LLVM_MAJOR < 17:
        raise RuntimeError(f"the AVX-512 BF16 kernels are written for LLVM >= 17, found {LLVM_MAJOR}")
    return declare(builder, "llvm.x86.avx512bf16.dpbf16ps.512", vec(F32, 16), [vec(F32, 16), vec(BF, 32), vec(BF, 32)])
