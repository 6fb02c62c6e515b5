"""The values of constant operands, as the passes read them.

- `scalar_constant`: a scalar constant or a broadcast of one (the all-reduce simplifier's
  `x / n` and `x * (1/n)`);
- `folded_scalar_constant`: a scalar constant expression, folded (distributed-batch-norm's
  counts, which `jnp.var` computes as `108 - 0`);
- `constant_array`: the array of a constant, also through converts (weight-update-sharding's
  reducer identities, which TF converts: `reduce(x, convert(constant(0)))`).
"""
from __future__ import annotations

import math

import numpy as np

from hlo_tools import HloInstruction
from hlo_tools.ir.literal import numpy_dtype

# Opcodes that change only the shape of a one-element value.
UNIT_SHAPE_OPS = frozenset({"reshape", "bitcast"})

_FOLDED = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply, "divide": np.divide}


def scalar_constant(instr: HloInstruction) -> float | None:
    """The value of a scalar constant, or of a broadcast of one; None for anything else."""
    if instr.opcode == "broadcast":
        instr = instr.operand(0)
    if instr.opcode != "constant" or instr.shape.rank != 0:
        return None
    return float(instr.literal.to_numpy())


def folded_scalar_constant(instr: HloInstruction, depth: int = 0) -> float | None:
    """The value of a scalar constant expression (constants, convert, broadcast and reshape of one,
    + - * / of two: `jnp.var` computes its count as `108 - 0`); None for anything else."""
    if depth > 8:
        return None
    while True:
        if instr.opcode == "get-tuple-element" and instr.operand(0).opcode == "tuple":
            instr = instr.operand(0).operand(instr.attrs["index"])
        elif instr.opcode in ("broadcast", "convert") or instr.opcode in UNIT_SHAPE_OPS:
            instr = instr.operand(0)
        else:
            break
    if instr.shape.rank != 0 and math.prod(instr.shape.dims) != 1:
        return None
    if instr.opcode == "constant":
        return float(np.asarray(instr.literal.to_numpy()).reshape(()))
    if instr.opcode in _FOLDED:
        a, b = (folded_scalar_constant(o, depth + 1) for o in instr.operands)
        if a is None or b is None or (instr.opcode == "divide" and b == 0):
            return None
        return float(_FOLDED[instr.opcode](np.float64(a), np.float64(b)))
    return None


def constant_array(instr: HloInstruction) -> np.ndarray | None:
    """The value of a constant, also through the converts TF puts between a constant and its use
    (`reduce(x, convert(constant(0)))`); None when `instr` is not one."""
    if instr.opcode == "convert":
        value = constant_array(instr.operand(0))
        return None if value is None else np.asarray(value).astype(numpy_dtype(instr.shape.dtype))
    if instr.opcode != "constant" or instr.literal is None:
        return None
    try:
        return instr.literal.to_numpy()
    except ValueError:
        return None
