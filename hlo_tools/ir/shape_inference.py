"""Result shapes of HLO instructions, as XLA's ShapeInference computes them.

    infer_shape("add", [f32_2x10, f32_2x10], {})                  -> f32[2,10]{1,0}
    infer_shape("dot", [lhs, rhs], {"lhs_contracting_dims": (1,), "rhs_contracting_dims": (0,)})
    infer_shape("reduce", [x, init], {"dimensions": (1,), "to_apply": add_computation})

The rules (and the error cases) follow xla/service/shape_inference.cc. Layouts follow what XLA's
parser produces: a result derived from an operand keeps the operand's layout (elementwise ops,
reverse, select, a transpose permutes it), a freshly built result (dot, reduce, concatenate, pad,
slice, ...) gets the default layout `{rank-1,...,0}`, and an operand written without a layout counts
as having the default layout, as XLA assigns it. Scalars carry no layout (XLA prints `f32[]`).

Opcodes whose result cannot be derived from operands and attributes (parameter, constant, iota,
reshape, bitcast, convert, custom-call, rng, infeed, ...) raise ShapeInferenceError; pass
`element_type=` for those whose only unknown is the element type (convert, bitcast-convert,
stochastic-convert) and to give dot/convolution a preferred result type.

XLA's own parser infers fewer opcodes than this module does (it insists on a written shape for
slice, dynamic-slice, collectives, fusion, ...): `PARSER_INFERABLE` lists the ones it infers.
"""
from __future__ import annotations

from hlo_tools.ir.attributes import (AttrValueError, ConvDimensionNumbers, PaddingConfig, Raw, SliceSpec, Window,
                                     attr_bool, attr_int, attr_ints)
from hlo_tools.ir.shape import COMPLEX_DTYPES, DTYPE_BITS, FLOAT_DTYPES, INTEGRAL_DTYPES, SIGNED_DTYPES, Layout, Shape


class ShapeInferenceError(Exception):
    """The operands and attributes do not determine a valid result shape."""


# Opcodes XLA's HLO parser accepts without a written shape (CanInferShape in hlo_parser.cc).
PARSER_INFERABLE = frozenset({
    "abs", "add", "add-dependency", "after-all", "atan2", "batch-norm-grad", "batch-norm-inference",
    "batch-norm-training", "broadcast", "call", "ceil", "cholesky", "clamp", "count-leading-zeros", "compare",
    "complex", "concatenate", "conditional", "convolution", "copy", "cosine", "opt-barrier", "divide",
    "domain", "dot", "erf", "exponential", "exponential-minus-one", "fft", "floor", "gather",
    "get-dimension-size", "set-dimension-size", "get-tuple-element", "imag", "is-finite", "log",
    "log-plus-one", "logistic", "and", "not", "or", "xor", "map", "maximum", "minimum", "multiply",
    "negate", "pad", "partition-id", "popcnt", "power", "ragged-dot", "real", "reduce", "remainder",
    "replica-id", "reverse", "round-nearest-afz", "round-nearest-even", "rsqrt", "scatter", "select",
    "shift-left", "shift-right-arithmetic", "shift-right-logical", "sign", "sine", "sqrt", "cbrt",
    "reduce-window", "select-and-scatter", "sort", "subtract", "tan", "tanh", "transpose",
    "triangular-solve", "tuple", "while", "topk",
})

_FLOAT_UNARY = frozenset({"floor", "ceil", "round-nearest-afz", "round-nearest-even"})
_FLOAT_OR_COMPLEX_UNARY = frozenset({
    "cosine", "sine", "tan", "exponential", "exponential-minus-one", "log", "log-plus-one", "logistic",
    "rsqrt", "sqrt", "cbrt", "tanh", "erf",
})
_PASS_THROUGH_UNARY = frozenset({"copy", "domain", "opt-barrier"})
UNARY_OPS = (_FLOAT_UNARY | _FLOAT_OR_COMPLEX_UNARY | _PASS_THROUGH_UNARY | frozenset({
    "real", "imag", "abs", "count-leading-zeros", "clz", "negate", "popcnt", "sign", "not", "is-finite",
}))
_ARITH_BINARY = frozenset({"add", "maximum", "minimum", "multiply"})
_NO_PRED_BINARY = frozenset({
    "subtract", "atan2", "power", "divide", "remainder", "shift-left", "shift-right-arithmetic",
    "shift-right-logical",
})
_LOGICAL_BINARY = frozenset({"and", "or", "xor"})
BINARY_OPS = _ARITH_BINARY | _NO_PRED_BINARY | _LOGICAL_BINARY | frozenset({"compare", "complex"})

_NEEDS_SHAPE = {
    "parameter": "a parameter", "constant": "a constant", "iota": "an iota", "reshape": "a reshape",
    "bitcast": "a bitcast", "dynamic-reshape": "a dynamic-reshape", "custom-call": "a custom-call",
    "rng": "an rng", "rng-bit-generator": "an rng-bit-generator", "infeed": "an infeed", "recv": "a recv",
    "async-start": "an async-start", "scan": "a scan",
}


# ------------------------------------------------------------------------------------------------
# small helpers
# ------------------------------------------------------------------------------------------------
def _fail(message: str):
    raise ShapeInferenceError(message)


def _is_float(dtype: str) -> bool:
    return dtype in FLOAT_DTYPES


def _is_complex(dtype: str) -> bool:
    return dtype in COMPLEX_DTYPES


def _is_integral(dtype: str) -> bool:
    return dtype in INTEGRAL_DTYPES


def _is_signed(dtype: str) -> bool:  # ShapeUtil::ElementIsSigned: signed integers and floats
    return dtype in SIGNED_DTYPES or dtype in FLOAT_DTYPES


def _component_type(dtype: str) -> str:
    return {"c64": "f32", "c128": "f64"}[dtype]


def _same_type_ignoring_fp(a: Shape, b: Shape) -> bool:
    return a.dtype == b.dtype or (_is_float(a.dtype) and _is_float(b.dtype))


def compatible(a: Shape, b: Shape, ignore_fp_precision: bool = False, ignore_element_type: bool = False) -> bool:
    """XLA's ShapeUtil::Compatible: equal ignoring layouts and dynamic-dimension markers."""
    if a.is_tuple or b.is_tuple:
        return (a.is_tuple and b.is_tuple and len(a.tuple_shapes) == len(b.tuple_shapes)
                and all(compatible(x, y, ignore_fp_precision, ignore_element_type)
                        for x, y in zip(a.tuple_shapes, b.tuple_shapes)))
    if not a.is_array or not b.is_array:
        return a.dtype == b.dtype
    if a.dims != b.dims:
        return False
    if ignore_element_type or a.dtype == b.dtype:
        return True
    return ignore_fp_precision and _is_float(a.dtype) and _is_float(b.dtype)


def _higher_precision(a: Shape, b: Shape) -> str:
    """ShapeUtil::HigherPrecisionElementType."""
    if a.dtype == b.dtype or not (_is_float(a.dtype) and _is_float(b.dtype)):
        return a.dtype
    if DTYPE_BITS[a.dtype] != DTYPE_BITS[b.dtype]:
        return a.dtype if DTYPE_BITS[a.dtype] > DTYPE_BITS[b.dtype] else b.dtype
    return a.dtype


def _dyn(shape: Shape, i: int) -> bool:
    return shape.dynamic is not None and bool(shape.dynamic[i])


def _make(dtype: str, dims, dynamic=None, layout=None) -> Shape:
    """A fresh array shape (XLA's MakeShape); no layout unless given, so it gets the default one."""
    dims = tuple(dims)
    if dtype not in DTYPE_BITS:
        _fail(f"unknown element type {dtype!r}")
    if any(d < 0 for d, dyn in zip(dims, dynamic or [False] * len(dims)) if not dyn):
        _fail(f"negative dimension in {dtype}{list(dims)}")
    return Shape(dtype, dims, dynamic, layout)


def _change_type(shape: Shape, dtype: str) -> Shape:
    return Shape(dtype, shape.dims, shape.dynamic, shape.layout)


def _with_dynamic(shape: Shape, dynamic) -> Shape:
    return Shape(shape.dtype, shape.dims, dynamic, shape.layout)


def default_layout(shape: Shape) -> Shape:
    """Give every array leaf without a layout XLA's default one (scalars keep none)."""
    if shape.is_tuple:
        elements = tuple(default_layout(s) for s in shape.tuple_shapes)
        if all(e is s for e, s in zip(elements, shape.tuple_shapes)):
            return shape
        return Shape.tuple(elements)
    if not shape.is_array or shape.layout is not None or not shape.dims:
        return shape
    return Shape(shape.dtype, shape.dims, shape.dynamic, Layout(range(len(shape.dims) - 1, -1, -1)))


def _finalize(shape: Shape) -> Shape:
    """Default layouts on array leaves, and no `{}` layout on scalars (XLA prints `f32[]`)."""
    if shape.is_tuple:
        return Shape.tuple(_finalize(s) for s in shape.tuple_shapes)
    if not shape.is_array:
        return shape
    if not shape.dims:
        if shape.layout is None or shape.layout.extra:  # e.g. u32[]{:S(2)} keeps its memory space
            return shape
        return Shape(shape.dtype, (), None, None)
    return default_layout(shape)


def _expect_array(shape: Shape, what: str):
    if not shape.is_array:
        _fail(f"Expected array argument for {what}, but got {shape.to_text(False)}.")


def _shape_text(shape: Shape) -> str:
    return shape.to_text(False)


def _required(attrs: dict, key: str, opcode: str):
    if attrs.get(key) is None:
        _fail(f"{opcode} needs the attribute {key}")
    return attrs[key]


def _computation(attrs: dict, key: str, opcode: str):
    comp = _required(attrs, key, opcode)
    if isinstance(comp, tuple):
        if len(comp) != 1:
            _fail(f"{opcode} expects one computation in {key}")
        comp = comp[0]
    if not hasattr(comp, "instructions"):
        _fail(f"attribute {key} of {opcode} is not a computation")
    return comp


def program_shape(comp) -> tuple[list[Shape], Shape]:
    """(parameter shapes, result shape) of a computation, with XLA's default layouts."""
    if comp.root is None:
        _fail(f"computation {comp.name} has no root")
    params = sorted((i for i in comp.instructions if i.opcode == "parameter"),
                    key=lambda p: p.parameter_number)
    return [default_layout(p.shape) for p in params], default_layout(comp.root.shape)


# ------------------------------------------------------------------------------------------------
# the entry point
# ------------------------------------------------------------------------------------------------
def infer_shape(opcode: str, operand_shapes, attrs: dict | None = None, literal=None, *,
                element_type: str | None = None) -> Shape:
    """The shape XLA infers for `opcode` applied to operands of `operand_shapes` with `attrs`.

    `element_type` supplies what the operands cannot tell: the target type of convert,
    bitcast-convert and stochastic-convert, or the preferred result type of dot and convolution.
    Raises ShapeInferenceError when the shape cannot be inferred or the operands are invalid.
    """
    try:
        return _infer_shape(opcode, operand_shapes, attrs or {}, literal, element_type)
    except AttrValueError as e:
        raise ShapeInferenceError(str(e)) from None


def _infer_shape(opcode: str, operand_shapes, attrs: dict, literal, element_type: str | None) -> Shape:
    shapes = [default_layout(s) for s in operand_shapes]
    if opcode == "constant" and literal is not None and getattr(literal, "shape", None) is not None:
        return _finalize(literal.shape)
    rule = _RULES.get(opcode)
    if rule is None:
        if opcode in _NEEDS_SHAPE:
            _fail(f"the shape of {_NEEDS_SHAPE[opcode]} must be given")
        from hlo_tools.ir.opcodes import async_wrapped_opcode
        wrapped = async_wrapped_opcode(opcode)
        if wrapped is not None:
            if opcode.endswith("-update"):
                return _finalize(_async_update(opcode, shapes, attrs, element_type))
            if opcode.endswith("-done"):
                return _finalize(_async_done(opcode, shapes, attrs, element_type))
            _fail(f"the shape of {opcode} must be given (its async state is not implied by its operands)")
        _fail(f"cannot infer the shape of {opcode}")
    return _finalize(rule(opcode, shapes, attrs, element_type))


def _arity(opcode: str, shapes, n: int):
    if len(shapes) != n:
        _fail(f"{opcode} expects {n} operand{'s' if n != 1 else ''}, but has {len(shapes)}")


# -- elementwise ------------------------------------------------------------------------------------
def _unary(opcode, shapes, attrs, _et):
    _arity(opcode, shapes, 1)
    s = shapes[0]
    if opcode in _PASS_THROUGH_UNARY:
        return s
    _expect_array(s, "operand of unary operation")
    t = s.dtype
    if opcode in _FLOAT_UNARY:
        if not _is_float(t):
            _fail(f"Expected element type in shape to be floating for {opcode} operation; got {t}.")
        return s
    if opcode in _FLOAT_OR_COMPLEX_UNARY:
        if not (_is_float(t) or _is_complex(t)):
            _fail(f"Expected element type in shape to be floating or complex for {opcode} operation; got {t}.")
        return s
    if opcode in ("real", "imag"):
        if _is_complex(t):
            return _change_type(s, _component_type(t))
        if _is_float(t):
            return s
        _fail(f"Expected element type in shape to be floating or complex for {opcode} operation; got {t}.")
    if opcode == "abs":
        if _is_complex(t):
            return _change_type(s, _component_type(t))
        if _is_signed(t):
            return s
        _fail(f"Expected element type in shape to be floating or complex for abs operation; got {t}.")
    if opcode in ("count-leading-zeros", "clz", "popcnt"):
        if not _is_integral(t):
            _fail(f"Expected an integral element type in argument to {opcode} operation; got {t}.")
        return s
    if opcode == "negate":
        if not (_is_integral(t) or _is_float(t) or _is_complex(t)):
            _fail(f"Expected element type in shape to be integral, floating or complex for negate operation; got {t}.")
        return s
    if opcode == "sign":
        if not (_is_signed(t) or _is_complex(t)):
            _fail(f"Expected element type in shape to be signed or complex for sign operation; got {t}.")
        return s
    if opcode == "not":
        if t != "pred" and not _is_integral(t):
            _fail(f"Expected pred or an integral element type in argument to Not operation; got {t}.")
        return s
    if opcode == "is-finite":
        if not _is_float(t):
            _fail(f"Expected element type in shape to be floating point for IsFinite operation; got {t}.")
        return _change_type(s, "pred")
    _fail(f"Unknown operation for unary shape inference: {opcode}")


def _elementwise_binary(opcode, lhs: Shape, rhs: Shape) -> Shape:
    _expect_array(lhs, f"lhs of binary operation {opcode}")
    _expect_array(rhs, f"rhs of binary operation {opcode}")
    if not _same_type_ignoring_fp(lhs, rhs):
        _fail(f"Binary op {opcode} with different element types: {_shape_text(lhs)} and {_shape_text(rhs)}.")
    if lhs.dims != rhs.dims:
        # XLA's shape inference would broadcast scalars and size-1 dimensions here, but HLO forbids
        # implicit broadcasts (the verifier refuses them), so no HLO instruction may rely on it.
        _fail(f"Binary op {opcode} with incompatible shapes: {_shape_text(lhs)} and {_shape_text(rhs)} "
              f"(implicit broadcast is not allowed in HLO)")
    result = _change_type(lhs, _higher_precision(lhs, rhs))
    if rhs.dynamic is not None:
        dyn = [_dyn(lhs, i) or _dyn(rhs, i) for i in range(lhs.rank)]
        result = _with_dynamic(result, dyn)
    return result


def _binary(opcode, shapes, attrs, _et):
    _arity(opcode, shapes, 2)
    lhs, rhs = shapes
    _expect_array(lhs, f"lhs of binary operation {opcode}")
    _expect_array(rhs, f"rhs of binary operation {opcode}")
    if opcode in _NO_PRED_BINARY and "pred" in (lhs.dtype, rhs.dtype):
        _fail(f"Expected element type in shape to be arithmetic type for operation {opcode}; got PRED.")
    if opcode in _LOGICAL_BINARY and lhs.dtype != "pred" and not _is_integral(lhs.dtype):
        _fail(f"Expected pred or integral type in argument to and/or operation; got {lhs.dtype}.")
    if opcode == "complex":
        if not _is_float(lhs.dtype):
            _fail(f"Expected element type in shape to be floating for complex compose operation; got {lhs.dtype}.")
        result = _elementwise_binary(opcode, lhs, rhs)
        if lhs.dtype == rhs.dtype == "f32":
            return _change_type(result, "c64")
        if lhs.dtype == rhs.dtype == "f64":
            return _change_type(result, "c128")
        _fail("Complex component type is not implemented.")
    result = _elementwise_binary(opcode, lhs, rhs)
    if opcode == "compare":
        return _change_type(result, "pred")
    return result


def _select(opcode, shapes, attrs, _et):
    _arity(opcode, shapes, 3)
    pred, on_true, on_false = shapes
    for s, what in ((pred, "select pred"), (on_true, "select on-true"), (on_false, "select on-false")):
        _expect_array(s, what)
    if not compatible(on_true, on_false, ignore_fp_precision=True):
        _fail(f"Operands to select must be the same shape; got {_shape_text(on_true)} and {_shape_text(on_false)}.")
    if pred.dtype != "pred":
        _fail(f"Select's pred operand must have PRED element type; got {_shape_text(pred)}.")
    dtype = _higher_precision(on_true, on_false)
    if pred.rank == 0 and on_true.rank != 0:
        return _change_type(on_true, dtype)
    if pred.dims != on_true.dims:
        _fail(f"Operands to select and predicate must be the same shape; got {_shape_text(on_true)} and "
              f"{_shape_text(pred)}.")
    return _change_type(pred, dtype)


def _clamp(opcode, shapes, attrs, _et):
    _arity(opcode, shapes, 3)
    lo, operand, hi = shapes
    for s, what in ((lo, "clamp min"), (operand, "clamp operand"), (hi, "clamp max")):
        _expect_array(s, what)
    if not (_same_type_ignoring_fp(lo, operand) and _same_type_ignoring_fp(hi, operand)):
        _fail(f"Clamp with different shapes: {_shape_text(lo)}, {_shape_text(operand)}, {_shape_text(hi)}.")
    for bound in (lo, hi):
        if not (compatible(bound, operand, ignore_fp_precision=True) or bound.rank == 0):
            _fail(f"Clamp with incompatible shapes: {_shape_text(lo)}, {_shape_text(operand)}, {_shape_text(hi)}.")
    return operand


def _fma(opcode, shapes, attrs, _et):
    _arity(opcode, shapes, 3)
    for s in shapes:
        _expect_array(s, "fma operand")
    a, b, c = shapes
    if a.dtype not in FLOAT_DTYPES or not all(compatible(s, a) for s in (b, c)):
        _fail(f"Fma needs floating-point operands of one shape; got {_shape_text(a)}, {_shape_text(b)} and "
              f"{_shape_text(c)}.")
    return a


def _convert(opcode, shapes, attrs, element_type):
    if element_type is None:
        _fail(f"the shape of a {opcode} must be given (its result element type is not implied)")
    if opcode == "stochastic-convert":
        _arity(opcode, shapes, 2)
        operand, random = shapes
        _expect_array(operand, "lhs of stochastic convert operation")
        _expect_array(random, "rhs of stochastic convert operation")
        if random.dtype[0] != "u":
            _fail(f"Random numbers for stochastic convert must be unsigned integers, but got: {_shape_text(random)}")
        if not _is_float(operand.dtype):
            _fail("Stochastic convert supports only floating point operand conversion")
        if DTYPE_BITS[operand.dtype] != DTYPE_BITS[random.dtype]:
            _fail("The random number is required to have same bits as the operand.")
        if operand.dims != random.dims:
            _fail("Stochastic convert operand shape does not match random tensor shape")
        return _change_type(operand, element_type)
    _arity(opcode, shapes, 1)
    operand = shapes[0]
    if element_type not in DTYPE_BITS:
        _fail(f"{opcode} to non-array type {element_type}")
    if opcode == "convert":
        if not operand.is_array:
            _fail(f"Convert does not allow non-arrays, so cannot convert from {_shape_text(operand)} to {element_type}.")
        return _change_type(operand, element_type)
    # bitcast-convert
    old = operand.dtype
    if _is_complex(old) != _is_complex(element_type):
        _fail(f"Conversion between complex and real type {_shape_text(operand)} => {element_type}.")
    if not operand.is_array:
        _fail(f"Cannot convert from or to tuple type; requested conversion: {_shape_text(operand)} => {element_type}.")
    in_bits, out_bits = DTYPE_BITS[old], DTYPE_BITS[element_type]
    if max(in_bits, out_bits) % min(in_bits, out_bits):
        _fail(f"Cannot bitcast types with undivisible bit-widths: {old} => {element_type}.")
    ratio = max(in_bits, out_bits) // min(in_bits, out_bits)
    if in_bits > out_bits:
        layout = None
        if operand.layout is not None:  # AppendMinorDimension: the new dimension is most minor
            layout = Layout((operand.rank,) + operand.layout.minor_to_major, operand.layout.extra)
        dyn = None if operand.dynamic is None else tuple(operand.dynamic) + (False,)
        return Shape(element_type, operand.dims + (ratio,), dyn, layout)
    if in_bits < out_bits:
        if operand.rank < 1 or operand.dims[-1] != ratio:
            last = operand.dims[-1] if operand.dims else 0
            _fail(f"Last dimension of input shape={last} is not equal to ratio of bit-widths={ratio} for "
                  f"bitcast-convert from {_shape_text(operand)} to {element_type}")
        layout = None
        if operand.layout is not None:
            m2m = tuple(d for d in operand.layout.minor_to_major if d != operand.rank - 1)
            layout = Layout(m2m, operand.layout.extra)
        dyn = None if operand.dynamic is None else tuple(operand.dynamic[:-1])
        return Shape(element_type, operand.dims[:-1], dyn, layout)
    return _change_type(operand, element_type)


def _reduce_precision(opcode, shapes, attrs, _et):
    _arity(opcode, shapes, 1)
    s = shapes[0]
    if not s.is_array or not _is_float(s.dtype):
        _fail(f"Expected element type in shape to be floating point for ReducePrecision operation; got {s.dtype}.")
    exponent, mantissa = attr_int(attrs, "exponent_bits"), attr_int(attrs, "mantissa_bits")
    if exponent is None or mantissa is None:
        _fail("reduce-precision needs exponent_bits and mantissa_bits")
    if exponent < 1:
        _fail(f"Expected exponent_bits >= 1; got {exponent}.")
    if mantissa < 0:
        _fail(f"Expected non-negative mantissa_bits; got {mantissa}.")
    return s


# -- structural ---------------------------------------------------------------------------------------
def _tuple(opcode, shapes, attrs, _et):
    return Shape.tuple(shapes)


def _get_tuple_element(opcode, shapes, attrs, _et):
    _arity(opcode, shapes, 1)
    arg = shapes[0]
    index = attr_int(attrs, "index")
    if index is None:
        _fail("get-tuple-element needs the attribute index")
    if not arg.is_tuple:
        _fail(f"Cannot infer shape: attempting to index into non-tuple: {_shape_text(arg)}.")
    if not 0 <= index < len(arg.tuple_shapes):
        _fail(f"Cannot infer shape: attempt to index out of tuple bounds: {index} >= {len(arg.tuple_shapes)} "
              f"in shape {_shape_text(arg)}.")
    return arg.tuple_shapes[index]


def _broadcast(opcode, shapes, attrs, _et):
    # XLA's parser infers a broadcast's shape with InferBroadcastShape(operand, sizes=dimensions):
    # the `dimensions` values become the sizes of new major dimensions. Only the scalar case
    # (no dimensions: a scalar result) makes sense; others are what XLA's parser produces.
    _arity(opcode, shapes, 1)
    operand = shapes[0]
    _expect_array(operand, "operand of broadcast")
    sizes = attr_ints(attrs, "dimensions")
    if sizes is None:
        if operand.rank != 0:
            _fail("attribute dimensions is expected but not seen")
        sizes = ()
    for size in sizes:
        if size < 0:
            _fail(f"Broadcast with negative dimension size {size}.")
    dyn = [False] * len(sizes) + [_dyn(operand, i) for i in range(operand.rank)]
    return _make(operand.dtype, tuple(sizes) + operand.dims, dyn if any(dyn) else None)


def _transpose(opcode, shapes, attrs, _et):
    _arity(opcode, shapes, 1)
    operand = shapes[0]
    _expect_array(operand, "transpose")
    perm = attr_ints(attrs, "dimensions")
    if perm is None or sorted(perm) != list(range(operand.rank)):
        _fail(f"Transpose dimensions [{','.join(map(str, perm or ()))}] are not a permutation of the operand "
              f"dimensions (operand shape is {_shape_text(operand)}).")
    dims = tuple(operand.dims[p] for p in perm)
    dyn = None if operand.dynamic is None else tuple(operand.dynamic[p] for p in perm)
    layout = None
    if operand.layout is not None and len(operand.layout.minor_to_major) == operand.rank:
        inverse = [0] * len(perm)
        for out_dim, in_dim in enumerate(perm):
            inverse[in_dim] = out_dim
        layout = Layout((inverse[d] for d in operand.layout.minor_to_major), operand.layout.extra)
    return Shape(operand.dtype, dims, dyn, layout)


def _reverse(opcode, shapes, attrs, _et):
    _arity(opcode, shapes, 1)
    operand = shapes[0]
    _expect_array(operand, "operand of reverse")
    dims = attr_ints(attrs, "dimensions")
    if dims is None:
        _fail("reverse needs the attribute dimensions")
    if len(set(dims)) != len(dims):
        _fail("a dimension number is duplicated in reverse")
    for d in dims:
        if not 0 <= d < operand.rank:
            _fail(f"One of the reverse dimensions ({d}) is out-of-bounds in shape {_shape_text(operand)}.")
    return operand


def _concatenate(opcode, shapes, attrs, _et):
    if not shapes:
        _fail("Concatenate expects at least one argument.")
    dims = attr_ints(attrs, "dimensions")
    if dims is None or len(dims) != 1:
        _fail("concatenate needs exactly one dimension in its dimensions attribute")
    dim = dims[0]
    if dim < 0 or dim >= shapes[0].rank:
        _fail(f"Concatenate dimension out of bounds: {dim}.")
    first = shapes[0]
    element_type = first.dtype
    for s in shapes:
        _expect_array(s, "operand of concatenation")
    for s in shapes[1:]:
        if s.rank != first.rank:
            _fail(f"Cannot concatenate arrays with different ranks: {first.rank} ({_shape_text(first)}) vs "
                  f"{s.rank} ({_shape_text(s)}).")
        if not _same_type_ignoring_fp(first, s):
            _fail(f"Cannot concatenate arrays with different element types: {first.dtype} vs {s.dtype}.")
        for i in range(first.rank):
            if i != dim and first.dims[i] != s.dims[i]:
                _fail(f"Cannot concatenate arrays that differ in dimensions other than the one being "
                      f"concatenated. Dimension {i} in both shapes must be equal: {_shape_text(first)} vs "
                      f"{_shape_text(s)}.")
        element_type = _higher_precision(Shape(element_type), s)
    new_dims = list(first.dims)
    new_dims[dim] = sum(s.dims[dim] for s in shapes)
    dyn = [any(_dyn(s, i) for s in shapes) for i in range(first.rank)]
    return _make(element_type, new_dims, dyn if any(dyn) else None)


def _slice(opcode, shapes, attrs, _et):
    _arity(opcode, shapes, 1)
    arg = shapes[0]
    _expect_array(arg, "operand of slice")
    spec = attrs.get("slice")
    if isinstance(spec, Raw):
        spec = SliceSpec.parse(spec.text)
    if spec is None:
        _fail("slice needs the attribute slice")
    if len(spec.dims) != arg.rank:
        _fail(f"Slice index count does not match argument rank: {len(spec.dims)} vs {arg.rank}.")
    sizes, dyn = [], []
    for i, (start, limit, stride) in enumerate(spec.dims):
        if start < 0:
            _fail(f"Negative start index to slice: {start}.")
        if limit > arg.dims[i]:
            _fail(f"limit index ({limit}) must be less than or equal to dimension size ({arg.dims[i]}) in slice "
                  f"operation; argument shape: {_shape_text(arg)}.")
        if start > limit:
            _fail(f"limit index ({limit}) must be greater or equal to start index ({start}) in slice with "
                  f"positive stride")
        if stride <= 0:
            _fail(f"Stride ({stride}) must be positive.")
        size = (limit - start + stride - 1) // stride
        sizes.append(size)
        dyn.append(size != 1 and _dyn(arg, i))
    return _make(arg.dtype, sizes, dyn if any(dyn) else None)


def _check_index_operands(what: str, operand: Shape, indices):
    if len(indices) >= 1 and indices[0].is_array and indices[0].rank == 1:
        if len(indices) != 1:
            _fail(f"{what} should have exactly 1 index operand, has {len(indices)}.")
        idx = indices[0]
        if not _is_integral(idx.dtype):
            _fail(f"{what} start indices must be of integral type.")
        if idx.dims[0] != operand.rank:
            _fail(f"{what} start number of dimensions {idx.dims[0]} ({_shape_text(idx)}) must match rank "
                  f"{operand.rank} of slice input ({_shape_text(operand)}).")
        return
    if len(indices) != operand.rank:
        _fail(f"{what} start number of dimensions {len(indices)} must match rank {operand.rank} of slice input "
              f"({_shape_text(operand)}).")
    if indices:
        first = indices[0]
        if not first.is_array or first.rank != 0:
            _fail(f"{what} indices must be scalar, not {_shape_text(first)}.")
        if not _is_integral(first.dtype):
            _fail(f"{what} start indices must be of integral type.")
        for idx in indices:
            if not compatible(first, idx):
                _fail(f"{what} start indices must all have the same shape, got mismatching indices with shapes "
                      f"{_shape_text(first)} and {_shape_text(idx)}.")


def _dynamic_slice(opcode, shapes, attrs, _et):
    if not shapes:
        _fail("Expected at least one operand.")
    operand, indices = shapes[0], shapes[1:]
    _expect_array(operand, "operand of dynamic slice")
    _check_index_operands("Dynamic slice", operand, indices)
    sizes = attr_ints(attrs, "dynamic_slice_sizes")
    if sizes is None:
        _fail("dynamic-slice needs the attribute dynamic_slice_sizes")
    if len(sizes) != operand.rank:
        _fail(f"Dynamic slice index count does not match argument rank: {len(sizes)} vs {operand.rank}.")
    for size, bound in zip(sizes, operand.dims):
        if size < 0:
            _fail(f"Negative size index to dynamic slice: {size}.")
        if size > bound:
            _fail(f"Slice dim size {size} greater than dynamic slice dimension: {bound}.")
    dyn = [_dyn(operand, i) and sizes[i] == operand.dims[i] for i in range(operand.rank)]
    return _make(operand.dtype, sizes, dyn if any(dyn) else None)


def _dynamic_update_slice(opcode, shapes, attrs, _et):
    if len(shapes) < 2:
        _fail("Expected at least two operands.")
    operand, update, indices = shapes[0], shapes[1], shapes[2:]
    _expect_array(operand, "operand of dynamic update slice")
    _expect_array(update, "update of dynamic update slice")
    _check_index_operands("Dynamic update slice", operand, indices)
    if update.rank != operand.rank:
        _fail(f"Dynamic update slice update rank does not match argument rank: {update.rank} vs {operand.rank}.")
    if not _same_type_ignoring_fp(operand, update):
        _fail(f"Dynamic update slice update element type does not match argument. operand.element_type: "
              f"{operand.dtype} vs update.element_type: {update.dtype}.")
    for u, o in zip(update.dims, operand.dims):
        if u > o:
            _fail(f"Update dim size {u} greater than dynamic slice dimension: {o}.")
    dyn = [_dyn(operand, i) or (_dyn(update, i) and update.dims[i] == operand.dims[i]) for i in range(operand.rank)]
    return _with_dynamic(operand, dyn) if any(dyn) else operand


def _pad(opcode, shapes, attrs, _et):
    _arity(opcode, shapes, 2)
    operand, value = shapes
    if not operand.is_array:
        _fail("Pad operation does not support tuple-shape operands.")
    if not value.is_array or value.rank != 0:
        _fail("Pad operation does not support non-scalar padding values.")
    config = attrs.get("padding")
    if isinstance(config, Raw):
        config = PaddingConfig.parse(config.text)
    if config is None:
        _fail("pad needs the attribute padding")
    if len(config.dims) != operand.rank:
        _fail(f"The rank of the operand and the padding configuration do not match: {_shape_text(operand)} vs {config}.")
    if not _same_type_ignoring_fp(operand, value):
        _fail("The element types of the operands to Pad do not match.")
    if any(interior < 0 for _, _, interior in config.dims):
        _fail(f"Interior padding cannot be negative: {config}")
    dims = []
    for i, (lo, hi, interior) in enumerate(config.dims):
        d = operand.dims[i] + lo + hi + max(operand.dims[i] - 1, 0) * interior
        if d < 0:
            _fail(f"Padding result in negative size for dimension {i}")
        dims.append(d)
    return _make(_higher_precision(operand, value), dims, operand.dynamic)


# -- dot and convolution -------------------------------------------------------------------------------
def _maybe_upcast(from_type: str, preferred: str | None) -> str:
    if preferred is None or preferred == from_type:
        return from_type
    if not _is_float(from_type) and DTYPE_BITS[preferred] < DTYPE_BITS[from_type]:
        _fail("`preferred_element_type` must not be narrower than the original type.")
    return preferred


def _dot(opcode, shapes, attrs, element_type):
    if len(shapes) < 2:
        _fail(f"dot expects 2 operands, but has {len(shapes)}")
    lhs, rhs = shapes[0], shapes[1]
    _expect_array(lhs, "lhs of dot")
    _expect_array(rhs, "rhs of dot")
    lc = attr_ints(attrs, "lhs_contracting_dims") or ()
    rc = attr_ints(attrs, "rhs_contracting_dims") or ()
    lb = attr_ints(attrs, "lhs_batch_dims") or ()
    rb = attr_ints(attrs, "rhs_batch_dims") or ()
    return _dot_shape(lhs, rhs, lc, rc, lb, rb, element_type)


def _dot_shape(lhs, rhs, lc, rc, lb, rb, element_type, rhs_skip=()):
    def fail(addendum):
        _fail(f"Cannot infer shape for dot operation: {_shape_text(lhs)} <dot> {_shape_text(rhs)}. {addendum}")

    for dims, rank in ((lc, lhs.rank), (lb, lhs.rank), (rc, rhs.rank), (rb, rhs.rank)):
        if any(not 0 <= d < rank for d in dims):
            _fail("A dimension number is out of range in Dot.")
    if len(set(lc) | set(lb)) != len(lc) + len(lb) or len(set(rc) | set(rb)) != len(rc) + len(rb):
        _fail("A dimension number is not unique in Dot.")
    if len(lc) != len(rc):
        fail("Must specify the same number of contracting dimensions for lhs and rhs.")
    for a, b in zip(lc, rc):
        if lhs.dims[a] != rhs.dims[b]:
            fail("Contracting dimension sizes do not match.")
    if len(lb) != len(rb):
        fail("Must the same number of batch dimensions for lhs and rhs.")
    for a, b in zip(lb, rb):
        if lhs.dims[a] != rhs.dims[b]:
            fail("Batch dimension sizes must match for lhs/rhs.")
    dims, dyn = [], []
    for d in lb:
        dims.append(lhs.dims[d])
        dyn.append(_dyn(lhs, d))
    for i in range(lhs.rank):
        if i not in lc and i not in lb:
            dims.append(lhs.dims[i])
            dyn.append(_dyn(lhs, i))
    for i in range(rhs.rank):
        if i not in rc and i not in rb and i not in rhs_skip:
            dims.append(rhs.dims[i])
            dyn.append(_dyn(rhs, i))
    dtype = _maybe_upcast(_higher_precision(lhs, rhs), element_type)
    return _make(dtype, dims, dyn if any(dyn) else None)


def _ragged_dot(opcode, shapes, attrs, element_type):
    _arity(opcode, shapes, 3)
    lhs, rhs, group_sizes = shapes
    lc = attr_ints(attrs, "lhs_contracting_dims") or ()
    rc = attr_ints(attrs, "rhs_contracting_dims") or ()
    lb = attr_ints(attrs, "lhs_batch_dims") or ()
    rb = attr_ints(attrs, "rhs_batch_dims") or ()
    ragged = attr_ints(attrs, "lhs_ragged_dims") or ()
    group = attr_ints(attrs, "rhs_group_dims") or ()
    if len(ragged) != 1:
        _fail("ragged-dot needs exactly one lhs_ragged_dims entry")
    result = _dot_shape(lhs, rhs, lc, rc, lb, rb, element_type, rhs_skip=tuple(group))
    if ragged[0] in lc:  # ragged contracting dimension: the result gains a leading group dimension
        g = group_sizes.dims[-1] if group_sizes.dims else 1
        return _make(result.dtype, (g,) + result.dims)
    return result


def _window_output(base: Shape, window: Window, dtype: str) -> Shape:
    if len(window.dimensions) != base.rank:
        _fail(f"Window has dimension {len(window.dimensions)} but base shape has dimension {base.rank}.")
    dims, dyn = [], []
    for i, w in enumerate(window.dimensions):
        if w.size <= 0:
            _fail(f"Window {window} has a non-positive dimension.")
        if w.stride <= 0:
            _fail(f"Window {window} has a non-positive stride.")
        if w.base_dilation < 1:
            _fail(f"Window {window} has a non-positive base area dilation factor.")
        if w.window_dilation < 1:
            _fail(f"Window {window} has a non-positive window dilation factor.")
        b = base.dims[i]
        dilated_base = 0 if b == 0 else (b - 1) * w.base_dilation + 1
        padded = w.padding_low + dilated_base + w.padding_high
        dilated_window = (w.size - 1) * w.window_dilation + 1
        out = 0 if padded < dilated_window else (padded - dilated_window) // w.stride + 1
        dims.append(out)
        dyn.append(_dyn(base, i))
    return _make(dtype, dims, dyn if any(dyn) else None)


def _window_attr(attrs: dict) -> Window:
    window = attrs.get("window")
    if isinstance(window, Raw):
        window = Window.parse(window.text)
    return window if window is not None else Window(())


def _convolution(opcode, shapes, attrs, element_type):
    _arity(opcode, shapes, 2)
    lhs, rhs = shapes
    _expect_array(lhs, "lhs of convolution")
    _expect_array(rhs, "rhs of convolution")
    fgc = attr_int(attrs, "feature_group_count", 1)
    bgc = attr_int(attrs, "batch_group_count", 1)
    dn = attrs.get("dim_labels")
    if isinstance(dn, Raw):
        dn = ConvDimensionNumbers.parse(dn.text)
    if dn is None:
        _fail("convolution needs the attribute dim_labels")
    window = _window_attr(attrs)
    if fgc <= 0:
        _fail(f"feature_group_count must be a positive number, got {fgc}")
    if bgc <= 0:
        _fail(f"batch_group_count must be a positive number, got {bgc}")
    if bgc > 1 and fgc > 1:
        _fail(f"both batch_group_count {bgc} and feature_group_count {fgc} cannot be greater than 1")
    n = dn.num_spatial
    if len(window.dimensions) != n:
        _fail(f"Window must have same number of dimensions as dimension numbers.\nWindow: {window}\n"
              f"Dimension numbers: {dn}.")
    if lhs.rank != n + 2:
        _fail(f"The LHS argument to a convolution should have rank {n + 2}; lhs: {_shape_text(lhs)}.")
    if rhs.rank != n + 2:
        _fail(f"The RHS argument to a convolution should have rank {n + 2}; rhs: {_shape_text(rhs)}.")
    expected = list(range(n + 2))
    for dims, what in (((dn.input_batch, dn.input_feature) + dn.input_spatial, "Input"),
                       ((dn.kernel_input_feature, dn.kernel_output_feature) + dn.kernel_spatial, "Window"),
                       ((dn.output_batch, dn.output_feature) + dn.output_spatial, "Output")):
        if sorted(dims) != expected:
            _fail(f"{what} dimensions of convolution must contain each dimension exactly once: {dn}.")
    input_spatial = [lhs.dims[d] for d in dn.input_spatial]
    input_features = lhs.dims[dn.input_feature]
    input_batch = lhs.dims[dn.input_batch]
    kernel_spatial = [rhs.dims[d] for d in dn.kernel_spatial]
    kernel_in = rhs.dims[dn.kernel_input_feature]
    kernel_out = rhs.dims[dn.kernel_output_feature]
    pair = f"<conv>({_shape_text(lhs)}, {_shape_text(rhs)})"
    if kernel_out % bgc:
        _fail(f"Expected output feature dimension size (value {kernel_out}) to be a multiple of batch group "
              f"count {bgc}; got {pair}")
    if input_features % fgc or input_features // fgc != kernel_in:
        _fail(f"Expected LHS feature dimension (value {input_features}) to be a multiple of feature_group_count "
              f"(value {fgc}), and LHS feature dimension / feature_group_count = RHS feature dimension (value "
              f"{kernel_in}); got {pair}")
    if kernel_out % fgc:
        _fail(f"Expected output feature dimension (value {kernel_out}) to be divisible by feature_group_count "
              f"(value {fgc}); got {pair}")
    if input_batch % bgc:
        _fail(f"Expected input batch dimension (value {input_batch}) to be divisible by batch_group_count (value "
              f"{bgc}); got {pair}")
    if kernel_spatial != [w.size for w in window.dimensions]:
        _fail(f"Window dimensions do not match RHS shape:\n\tRHS shape: {_shape_text(rhs)}\n\tWindow: {window}")
    spatial_out = _window_output(_make(lhs.dtype, input_spatial), window, lhs.dtype)
    dims = [0] * (n + 2)
    dims[dn.output_batch] = input_batch // bgc
    dims[dn.output_feature] = kernel_out
    for i in range(n):
        dims[dn.output_spatial[i]] = spatial_out.dims[i]
    dyn = [False] * (n + 2)
    for i in range(n + 2):
        if _dyn(lhs, i):
            if i == dn.input_batch:
                dyn[dn.output_batch] = True
            elif i != dn.input_feature:
                dyn[dn.output_spatial[dn.input_spatial.index(i)]] = True
        if _dyn(rhs, i):
            if i == dn.kernel_output_feature:
                _fail("Dynamic output feature dim on convolution kernel is not supported")
            if i != dn.kernel_input_feature:
                dyn[dn.output_spatial[dn.kernel_spatial.index(i)]] = True
    dtype = _maybe_upcast(_higher_precision(lhs, rhs), element_type)
    return _make(dtype, dims, dyn if any(dyn) else None)


# -- reductions ---------------------------------------------------------------------------------------
def verify_reducer(comp, init_shapes, input_types, inputs: int):
    """XLA's VerifyReducerShape: `comp` must reduce `inputs` values of the given types."""
    params, result = program_shape(comp)
    if len(params) != inputs * 2:
        _fail(f"Reduction function must take {inputs * 2} parameters, but takes {len(params)} parameter(s).")
    if result.is_array:
        if inputs != 1:
            _fail(f"Reduction function must produce a tuple with {inputs} elements, but produces a scalar")
        accumulators = [result]
    elif result.is_tuple:
        if len(result.tuple_shapes) != inputs:
            _fail(f"Reduction function must produce a tuple with {inputs} elements, but has "
                  f"{len(result.tuple_shapes)} elements")
        accumulators = list(result.tuple_shapes)
    else:
        _fail(f"Reduction function must produce a scalar or tuple of scalars, but has shape: {_shape_text(result)}")
    for acc in accumulators:
        if not acc.is_array or acc.rank != 0:
            _fail(f"Reduction function must return a scalar or tuple of scalars but returns shape: "
                  f"{_shape_text(result)}")
    for i in range(inputs):
        if not compatible(accumulators[i], params[i]):
            _fail(f"Reduction function's {i}-th parameter shape differs from the result shape: "
                  f"{_shape_text(params[i])} vs {_shape_text(accumulators[i])}")
        if not compatible(accumulators[i], init_shapes[i], ignore_fp_precision=True):
            _fail(f"Reduction function's accumulator shape at index {i} differs from the init_value shape: "
                  f"{_shape_text(accumulators[i])} vs {_shape_text(init_shapes[i])}")
        element = Shape(input_types[i])
        if not compatible(element, params[inputs + i], ignore_fp_precision=True):
            _fail(f"Reduction function's {inputs + i}-th parameter shape differs from the input type element "
                  f"type: {_shape_text(params[inputs + i])} vs {_shape_text(element)}")
        if not compatible(accumulators[i], params[inputs + i], ignore_fp_precision=True):
            _fail(f"Reduction function's {inputs + i}-th parameter shape must match the result shape, but got "
                  f"{_shape_text(params[inputs + i])} vs {_shape_text(accumulators[i])}.")
    return result


def _reduce(opcode, shapes, attrs, _et):
    if not shapes:
        _fail("Reduce must have at least 2 arguments, has 0")
    if len(shapes) % 2:
        _fail(f"Reduce must have an even number of arguments, has {len(shapes)}")
    n = len(shapes) // 2
    inputs, inits = shapes[:n], shapes[n:]
    for s in shapes:
        _expect_array(s, "operand of reduce")
    for i in range(1, n):
        if inputs[i].dims != inputs[0].dims:
            _fail(f"All reduced tensors must have the same dimension. Tensor 0 has shape "
                  f"{_shape_text(inputs[0])}, Tensor {i} has shape {_shape_text(inputs[i])}")
    arg = inputs[0]
    dims = attr_ints(attrs, "dimensions")
    if dims is None:
        _fail("reduce needs the attribute dimensions")
    for d in dims:
        if not 0 <= d < arg.rank:
            _fail(f"Reducing out-of-bounds dimension {d} in shape {_shape_text(arg)}.")
    comp = _computation(attrs, "to_apply", opcode)
    result = verify_reducer(comp, inits, [s.dtype for s in inputs], n)
    if len(set(dims)) != len(dims):
        _fail(f"Duplicate reduction dimension: {dims}")
    kept = [i for i in range(arg.rank) if i not in dims]
    new_dims = [arg.dims[i] for i in kept]
    dyn = [_dyn(arg, i) for i in kept]
    dyn = dyn if any(dyn) else None
    if result.is_array:
        return _make(result.dtype, new_dims, dyn)
    return Shape.tuple(_make(s.dtype, new_dims, dyn) for s in result.tuple_shapes)


def _reduce_window(opcode, shapes, attrs, _et):
    if not shapes or len(shapes) % 2:
        _fail(f"expects an even number of operands, but has {len(shapes)} operands")
    n = len(shapes) // 2
    inputs, inits = shapes[:n], shapes[n:]
    for i in range(1, n):
        if inputs[i].dims != inputs[0].dims:
            _fail(f"All reduced tensors must have the same dimension. Tensor 0 has shape "
                  f"{_shape_text(inputs[0])}, Tensor {i} has shape {_shape_text(inputs[i])}")
    comp = _computation(attrs, "to_apply", opcode)
    result = verify_reducer(comp, inits, [s.dtype for s in inputs], n)
    window = _window_attr(attrs)
    outs = []
    for operand, init in zip(inputs, inits):
        _expect_array(operand, "operand of reduce-window")
        outs.append(_window_output(operand, window, init.dtype))
    if result.is_array:
        return outs[0]
    return Shape.tuple(outs)


def _select_and_scatter(opcode, shapes, attrs, _et):
    _arity(opcode, shapes, 3)
    operand, source, init = shapes
    _expect_array(operand, "operand of select-and-scatter")
    select = _computation(attrs, "select", opcode)
    scatter = _computation(attrs, "scatter", opcode)
    sel_params, sel_result = program_shape(select)
    if len(sel_params) != 2:
        _fail(f"Select function must take 2 parameters, but takes {len(sel_params)} parameter(s).")
    if not compatible(sel_result, Shape("pred")):
        _fail("Select function must have rank-0 PRED result.")
    element = Shape(operand.dtype)
    for i, which in enumerate(("first", "second")):
        if not compatible(element, sel_params[i], ignore_fp_precision=True):
            _fail(f"Select function's {which} parameter shape currently must match the operand element shape, "
                  f"but got {_shape_text(sel_params[i])} vs {_shape_text(element)}.")
    verify_reducer(scatter, [init], [source.dtype], 1)
    window_result = _window_output(operand, _window_attr(attrs), operand.dtype)
    if not compatible(source, window_result, ignore_fp_precision=True):
        _fail(f"Source shape does not match the shape of window-reduced operand: source({_shape_text(source)}), "
              f"window-reduced operand({_shape_text(window_result)}).")
    return operand


def _map(opcode, shapes, attrs, _et):
    if not shapes:
        _fail("Map expects at least one argument.")
    arg = shapes[0]
    for s in shapes[1:]:
        _expect_array(s, "operand of map")
        if compatible(s, arg, ignore_element_type=True):
            continue
        if _same_type_ignoring_fp(s, arg):
            if s.rank == 0:
                continue
            if arg.rank == 0:
                arg = s
                continue
        _fail("Map operation requires all operands to have the same shape; got: "
              + ", ".join(_shape_text(x) for x in shapes) + ".")
    dims = attr_ints(attrs, "dimensions")
    if dims is None:
        dims = tuple(range(max(s.rank for s in shapes)))
    if len(dims) != arg.rank:
        _fail(f"Map applied to a subset of dimensions currently not supported: arg_dimension_size: {arg.rank}, "
              f"requested_map_dimensions_size: {len(dims)}.")
    if list(dims) != list(range(len(dims))):
        _fail(f"Map requires monotonically increasing dimension numbers; got: {', '.join(map(str, dims))}.")
    comp = _computation(attrs, "to_apply", opcode)
    params, result = program_shape(comp)
    if len(params) != len(shapes):
        _fail(f"Map applied function arity must match number of arguments; got: arity: {len(params)}, "
              f"arguments: {len(shapes)}.")
    if not result.is_array or result.rank != 0:
        _fail(f"Mapped computation's result has to be a scalar; got: {_shape_text(result)}.")
    for i, p in enumerate(params):
        if not p.is_array or p.rank != 0:
            _fail(f"Mapped computation's parameter has to be a scalar; got parameter {i} shape: {_shape_text(p)}.")
        if not _same_type_ignoring_fp(p, shapes[i]):
            _fail(f"Mapped computation's parameter type has to match argument element type; got parameter {i} "
                  f"shape: {_shape_text(p)}, argument shape: {_shape_text(arg)}.")
    return _make(result.dtype, arg.dims)


def _sort(opcode, shapes, attrs, _et):
    if not shapes:
        _fail("Expected at least 1 operand for sort instruction")
    if len(shapes) == 1:
        return shapes[0]
    for i, s in enumerate(shapes[1:], 1):
        if s.dims != shapes[0].dims:
            _fail(f"Sort keys and values dimensions must match. Keys shape is: {_shape_text(shapes[0])}\n, Values "
                  f"shape (operand index {i}) is: {_shape_text(s)}")
    return Shape.tuple(shapes)


def _topk(opcode, shapes, attrs, _et):
    _arity(opcode, shapes, 1)
    operand = shapes[0]
    _expect_array(operand, "operand of topk")
    k = attr_int(attrs, "k")
    if k is None:
        _fail("topk needs the attribute k")
    if operand.rank < 1:
        _fail("The input of TopK must have rank >= 1")
    if k < 0 or k > operand.dims[-1]:
        _fail(f"k={k} is out of range for the last dimension of {_shape_text(operand)}")
    dims = operand.dims[:-1] + (k,)
    dyn = None if operand.dynamic is None else tuple(operand.dynamic)
    return Shape.tuple([_make(operand.dtype, dims, dyn), _make("s32", dims, dyn)])


def _gather(opcode, shapes, attrs, _et):
    _arity(opcode, shapes, 2)
    operand, indices = shapes
    _expect_array(operand, "input tensor operand of gather op")
    _expect_array(indices, "gather indices operand of gather op")
    if not _is_integral(indices.dtype):
        _fail(f"Gather indices parameter must be an integral tensor; got {_shape_text(indices)}.")
    offset_dims = attr_ints(attrs, "offset_dims")
    collapsed = attr_ints(attrs, "collapsed_slice_dims")
    start_index_map = attr_ints(attrs, "start_index_map")
    ivd = attr_int(attrs, "index_vector_dim")
    slice_sizes = attr_ints(attrs, "slice_sizes")
    operand_batching = attr_ints(attrs, "operand_batching_dims") or ()
    indices_batching = attr_ints(attrs, "start_indices_batching_dims") or ()
    for key, value in (("offset_dims", offset_dims), ("collapsed_slice_dims", collapsed),
                       ("start_index_map", start_index_map), ("index_vector_dim", ivd),
                       ("slice_sizes", slice_sizes)):
        if value is None:
            _fail(f"gather needs the attribute {key}")
    if ivd < 0 or ivd > indices.rank:
        _fail(f"Gather index leaf dimension must be within [0, rank(start_indices) + 1). rank(start_indices) is "
              f"{indices.rank} and gather index leaf dimension is {ivd}.")
    expanded = list(indices.dims)
    expanded_dyn = [_dyn(indices, i) for i in range(indices.rank)]
    if len(expanded) == ivd:
        expanded.append(1)
        expanded_dyn.append(False)
    if list(offset_dims) != sorted(offset_dims):
        _fail(f"Output window dimensions in gather op must be ascending; got: {', '.join(map(str, offset_dims))}.")
    if len(set(offset_dims)) != len(offset_dims):
        _fail(f"Output window dimensions in gather op must not repeat; got: {', '.join(map(str, offset_dims))}.")
    out_rank = len(offset_dims) + len(expanded) - 1
    for i, d in enumerate(offset_dims):
        if not 0 <= d < out_rank:
            _fail(f"Offset dimension {i} in gather op is out of bounds; got {d}, but should have been in "
                  f"[0,{out_rank}).")
    if len(start_index_map) != expanded[ivd]:
        _fail(f"Gather op has {len(start_index_map)} elements in start_index_map and the bound of dimension "
              f"index_vector_dim={ivd} of start_indices is {expanded[ivd]}. These two numbers must be equal.")
    for i, d in enumerate(start_index_map):
        if not 0 <= d < operand.rank:
            _fail(f"Invalid start_index_map; domain is [0, {operand.rank}), got: {i}->{d}.")
    if len(set(start_index_map)) != len(start_index_map):
        _fail(f"Repeated dimensions are not allowed in start_index_map; got: {', '.join(map(str, start_index_map))}.")
    for name, dims in (("collapsed_slice_dims", collapsed), ("operand_batching_dims", operand_batching)):
        for d in dims:
            if not 0 <= d < operand.rank:
                _fail(f"Invalid {name} set in gather op; valid range is [0, {operand.rank}), got: {d}.")
        if list(dims) != sorted(dims):
            _fail(f"{name} in gather op must be sorted; got: {', '.join(map(str, dims))}")
        if len(set(dims)) != len(dims):
            _fail(f"Repeated dimensions not allowed in {name} in gather op; got: {', '.join(map(str, dims))}.")
    if set(collapsed) & set(operand_batching):
        _fail("collapsed_slice_dims and operand_batching_dims in gather op must be disjoint")
    if len(operand_batching) != len(indices_batching):
        _fail("operand_batching_dims and start_indices_batching_dims in gather op must be of the same size")
    for d in indices_batching:
        if not 0 <= d < indices.rank or d == ivd:
            _fail(f"Invalid start_indices_batching_dims set in gather op; got: {d}.")
    if len(slice_sizes) != operand.rank:
        _fail(f"Gather op must have one slice size for every input dimension; got: len(slice_sizes)="
              f"{len(slice_sizes)}, input_shape.rank={operand.rank}.")
    if len(slice_sizes) != len(offset_dims) + len(collapsed) + len(operand_batching):
        _fail(f"All components of the offset index in a gather op must either be a offset dimension or explicitly "
              f"collapsed/batching; got len(slice_sizes)={len(slice_sizes)}, output_slice_sizes="
              f"{','.join(map(str, offset_dims))}, collapsed_slice_dims={','.join(map(str, collapsed))}.")
    for i, size in enumerate(slice_sizes):
        if size < 0 or size > operand.dims[i]:
            _fail(f"Slice size at index {i} in gather op is out of range, must be within [0, {operand.dims[i] + 1}), "
                  f"got {size}.")
    for i, d in enumerate(collapsed):
        if slice_sizes[d] > 1:
            _fail(f"Gather op can only collapse slice dims with bound 1 or 0, but bound is {slice_sizes[d]} for "
                  f"index {d} at position {i}.")
    for i, d in enumerate(operand_batching):
        if slice_sizes[d] > 1:
            _fail(f"Gather op can only have operand batching dims with bound 0/1, but bound is {slice_sizes[d]} "
                  f"for index {d} at position {i}.")
    window_dims = [i for i in range(operand.rank) if i not in collapsed and i not in operand_batching]
    dims, dyn = [], []
    offset_seen = gather_seen = 0
    for i in range(out_rank):
        if i in offset_dims:
            d = window_dims[offset_seen]
            offset_seen += 1
            dims.append(slice_sizes[d])
            dyn.append(slice_sizes[d] == operand.dims[d] and _dyn(operand, d))
        else:
            if gather_seen == ivd:
                gather_seen += 1
            dims.append(expanded[gather_seen])
            dyn.append(expanded_dyn[gather_seen])
            gather_seen += 1
    return _make(operand.dtype, dims, dyn if any(dyn) else None)


def _scatter(opcode, shapes, attrs, _et):
    n = len(shapes) // 2
    if n * 2 + 1 != len(shapes):
        _fail(f"Invalid argument count of scatter op: Expected {n * 2 + 1}, saw {len(shapes)}")
    operands, indices, updates = shapes[:n], shapes[n], shapes[n + 1:]
    _expect_array(indices, "scatter indices of scatter op")
    if not _is_integral(indices.dtype):
        _fail(f"Scatter indices parameter must be an integral tensor; got {_shape_text(indices)}.")
    uwd = attr_ints(attrs, "update_window_dims")
    iwd = attr_ints(attrs, "inserted_window_dims")
    sdod = attr_ints(attrs, "scatter_dims_to_operand_dims")
    ivd = attr_int(attrs, "index_vector_dim")
    input_batching = attr_ints(attrs, "input_batching_dims") or ()
    indices_batching = attr_ints(attrs, "scatter_indices_batching_dims") or ()
    for key, value in (("update_window_dims", uwd), ("inserted_window_dims", iwd),
                       ("scatter_dims_to_operand_dims", sdod), ("index_vector_dim", ivd)):
        if value is None:
            _fail(f"scatter needs the attribute {key}")
    if ivd < 0 or ivd > indices.rank:
        _fail(f"Scatter index leaf dimension must be within [0, rank(scatter_indices) + 1). rank(scatter_indices) "
              f"is {indices.rank} and scatter index leaf dimension is {ivd}.")
    expanded = list(indices.dims)
    if len(expanded) == ivd:
        expanded.append(1)
    for i in range(n):
        operand, update = operands[i], updates[i]
        _expect_array(operand, f"operand {i} of scatter op")
        _expect_array(update, f"updates {i} of scatter op")
        if operand.dims != operands[0].dims:
            _fail("The shapes of the operands of a scatter must match")
        if update.dims != updates[0].dims:
            _fail("The shapes of the updates of a scatter must match")
        expected_rank = len(expanded) - 1 + len(uwd)
        if update.rank != expected_rank:
            _fail(f"Updates tensor must be of rank {expected_rank}; got {update.rank}.")
        if list(uwd) != sorted(uwd) or len(set(uwd)) != len(uwd):
            _fail(f"update_window_dims in scatter op must be sorted and not repeat; got: {', '.join(map(str, uwd))}.")
        for d in uwd:
            if not 0 <= d < update.rank:
                _fail(f"Invalid update_window_dims set in scatter op; valid range is [0, {update.rank}). got: {d}.")
        for name, dims in (("inserted_window_dims", iwd), ("input_batching_dims", input_batching)):
            if list(dims) != sorted(dims) or len(set(dims)) != len(dims):
                _fail(f"{name} in scatter op must be sorted and not repeat; got: {', '.join(map(str, dims))}.")
            for d in dims:
                if not 0 <= d < operand.rank:
                    _fail(f"Invalid {name} set in scatter op; valid range is [0, {operand.rank}), got: {d}.")
        if set(iwd) & set(input_batching):
            _fail("inserted_window_dims and input_batching_dims in scatter op must be disjoint")
        if len(uwd) + len(iwd) + len(input_batching) != operand.rank:
            _fail(f"Scatter op has window of size {len(uwd) + len(iwd) + len(input_batching)}; doesn't match "
                  f"operand of rank {operand.rank}.")
        if len(sdod) != expanded[ivd]:
            _fail(f"Scatter op has {len(sdod)} elements in scatter_dims_to_operand_dims and the bound of dimension "
                  f"index_vector_dim={ivd} of scatter_indices is {expanded[ivd]}. These two numbers must be equal.")
        for j, d in enumerate(sdod):
            if not 0 <= d < operand.rank:
                _fail(f"Invalid scatter_dims_to_operand_dims mapping; domain is [0, {operand.rank}), got: {j}->{d}.")
        if len(set(sdod)) != len(sdod):
            _fail(f"Repeated dimensions not allowed in scatter_dims_to_operand_dims; got: {', '.join(map(str, sdod))}.")
        if len(input_batching) != len(indices_batching):
            _fail("input_batching_dims and scatter_indices_batching_dims in scatter op must be of the same size")
        window_bounds = [operand.dims[d] for d in range(operand.rank) if d not in iwd and d not in input_batching]
        for j, d in enumerate(uwd):
            if update.dims[d] > window_bounds[j]:
                _fail(f"Bounds of the window dimensions of updates must not exceed the bounds of the corresponding "
                      f"dimensions of operand. For dimension {d}, updates bound is {update.dims[d]}, operand bound "
                      f"is {window_bounds[j]}.")
        seen = 0
        for d in range(update.rank):
            if d in uwd:
                continue
            if seen == ivd:
                seen += 1
            if update.dims[d] != expanded[seen]:
                _fail(f"Bounds of the scatter dimensions of updates must be same as the bounds of the corresponding "
                      f"dimensions of scatter indices. For scatter dimension {d}, updates bound is {update.dims[d]}, "
                      f"scatter_indices bound is {expanded[seen]}.")
            seen += 1
    comp = _computation(attrs, "to_apply", opcode)
    verify_reducer(comp, [Shape(s.dtype) for s in operands], [s.dtype for s in updates], n)
    return operands[0] if n == 1 else Shape.tuple(operands)


# -- control flow and calls --------------------------------------------------------------------------
def _while(opcode, shapes, attrs, _et):
    _arity(opcode, shapes, 1)
    init = shapes[0]
    cond_params, cond_result = program_shape(_computation(attrs, "condition", opcode))
    body_params, body_result = program_shape(_computation(attrs, "body", opcode))
    if len(cond_params) != 1:
        _fail(f"Condition must take 1 arguments; got {len(cond_params)}.")
    if len(body_params) != 1:
        _fail(f"Body must take 1 arguments; got {len(body_params)}.")
    if not compatible(cond_result, Shape("pred")):
        _fail(f"Condition must return a boolean; got {_shape_text(cond_result)}.")
    if not (compatible(body_result, cond_params[0]) and compatible(body_result, body_params[0])
            and compatible(body_result, init)):
        _fail(f"The parameter of condition and body, the result of the body, and init must all have the same "
              f"shape; got condition: ({_shape_text(cond_params[0])}) -> {_shape_text(cond_result)}; body: "
              f"({_shape_text(body_params[0])}) -> {_shape_text(body_result)}; init: {_shape_text(init)}.")
    return init


def _branches(attrs: dict, pred: bool):
    if pred:
        t, f = attrs.get("true_computation"), attrs.get("false_computation")
        if t is None or f is None:
            _fail("a conditional on a pred needs true_computation and false_computation")
        return [t, f]
    branches = attrs.get("branch_computations")
    if branches is None:
        _fail("a conditional on an s32 needs branch_computations")
    return list(branches) if isinstance(branches, tuple) else [branches]


def _conditional(opcode, shapes, attrs, _et):
    if not shapes:
        _fail("conditional needs a branch index operand")
    index = shapes[0]
    if not (compatible(index, Shape("pred")) or compatible(index, Shape("s32"))):
        _fail(f"branch_index must be bool or int32_t; got {_shape_text(index)}.")
    branches = _branches(attrs, index.dtype == "pred")
    if not branches or len(branches) != len(shapes) - 1:
        _fail(f"conditional has {len(branches)} branches but {len(shapes) - 1} branch operands")
    programs = [program_shape(b) for b in branches]
    result = programs[0][1]
    for j, (params, root) in enumerate(programs):
        if len(params) != 1:
            _fail(f"branch computation {j} must take 1 argument; got {len(params)}.")
        if not compatible(params[0], shapes[j + 1]):
            _fail(f"branch operand {j} must match the shape of the only parameter of branch computation {j}: got "
                  f"operand: {_shape_text(shapes[j + 1])}; computation: {_shape_text(params[0])}.")
        if not compatible(result, root):
            _fail(f"the result of branch 0 computation and branch {j} computation must have the same shape: got "
                  f"branch 0 computation result: {_shape_text(result)}; branch {j} computation result: "
                  f"{_shape_text(root)}.")
    return _merge_dynamic(result, [root for _, root in programs])


def _merge_dynamic(result: Shape, others) -> Shape:
    if result.is_tuple:
        return Shape.tuple(_merge_dynamic(s, [o.tuple_shapes[i] for o in others])
                           for i, s in enumerate(result.tuple_shapes))
    if not result.is_array or not any(o.dynamic for o in others):
        return result
    dyn = [any(_dyn(o, i) for o in others) for i in range(result.rank)]
    return _with_dynamic(result, dyn)


def _call(opcode, shapes, attrs, _et):
    params, result = program_shape(_computation(attrs, "to_apply", opcode))
    if len(params) != len(shapes):
        _fail(f"Call applied function arity must match number of arguments; got: arity: {len(params)}, "
              f"arguments: {len(shapes)}.")
    for i, (p, a) in enumerate(zip(params, shapes)):
        if not compatible(p, a):
            _fail(f"Call parameter must match argument; got parameter {i} shape: {_shape_text(p)}, argument shape: "
                  f"{_shape_text(a)}.")
    return result


def _fusion(opcode, shapes, attrs, _et):
    params, result = program_shape(_computation(attrs, "calls", opcode))
    if len(params) > len(shapes):
        _fail(f"Fused parameter count ({len(params)}) is greater than the number of operands ({len(shapes)})")
    for i, p in enumerate(params):
        if not compatible(p, shapes[i]):
            _fail(f"Shape mismatch between parameter number {i} and its operand: {_shape_text(p)} vs "
                  f"{_shape_text(shapes[i])}")
    return result


def _async_update(opcode, shapes, attrs, _et):
    _arity(opcode, shapes, 1)
    s = shapes[0]
    if not (s.is_tuple and len(s.tuple_shapes) >= 2 and s.tuple_shapes[0].is_tuple):
        _fail("AsyncUpdate and AsyncDone expect a single operand in the form of ((async-operands), async-outputs, "
              "state).")
    return s


def _async_done(opcode, shapes, attrs, _et):
    return _async_update(opcode, shapes, attrs, _et).tuple_shapes[1]


# -- collectives -------------------------------------------------------------------------------------------
def _same_or_tuple(shapes, what: str) -> Shape:
    if not shapes:
        _fail(f"{what} expects at least one operand")
    for s in shapes:
        _expect_array(s, f"operand of {what}")
    return shapes[0] if len(shapes) == 1 else Shape.tuple(shapes)


def _group_size(attrs: dict, opcode: str) -> int:
    groups = attrs.get("replica_groups")
    size = None
    if groups is not None and not isinstance(groups, Raw):
        if groups.iota is not None:
            size = groups.iota.dims[1]
        elif groups.explicit:
            size = len(groups.explicit[0])
    if not size:
        _fail(f"the shape of {opcode} must be given: without explicit replica_groups the group size depends on "
              f"the module's replica and partition counts")
    return size


def _all_reduce(opcode, shapes, attrs, _et):
    return _same_or_tuple(shapes, opcode)


def _all_gather_shapes(opcode, shapes, attrs):
    dims = attr_ints(attrs, "dimensions")
    if not dims:
        _fail(f"{opcode} needs the attribute dimensions")
    dim, count = dims[0], _group_size(attrs, opcode)
    outs = []
    for s in shapes:
        _expect_array(s, f"operand of {opcode}")
        if not 0 <= dim < s.rank:
            _fail(f"all-gather dimension {dim} is out of bounds for {_shape_text(s)}")
        new = list(s.dims)
        new[dim] *= count
        outs.append(Shape(s.dtype, new, s.dynamic, s.layout))
    if not outs:
        _fail(f"{opcode} expects at least one operand")
    return outs


def _all_gather(opcode, shapes, attrs, _et):
    outs = _all_gather_shapes(opcode, shapes, attrs)
    return outs[0] if len(outs) == 1 else Shape.tuple(outs)


def _all_gather_start(opcode, shapes, attrs, _et):
    outs = _all_gather_shapes(opcode, shapes, attrs)
    if len(outs) == 1:
        return Shape.tuple([shapes[0], outs[0]])
    return Shape.tuple([Shape.tuple(shapes), Shape.tuple(outs)])


def _reduce_scatter(opcode, shapes, attrs, _et):
    dims = attr_ints(attrs, "dimensions")
    if not dims:
        _fail("reduce-scatter needs the attribute dimensions")
    dim, count = dims[0], _group_size(attrs, opcode)
    outs = []
    for s in shapes:
        _expect_array(s, "operand of reduce-scatter")
        if not 0 <= dim < s.rank:
            _fail(f"reduce-scatter dimension {dim} is out of bounds for {_shape_text(s)}")
        if s.dims[dim] % count:
            _fail(f"ReduceScatter operand scatter dimension size {s.dims[dim]} must be dividable by shard_count "
                  f"{count}.")
        new = list(s.dims)
        new[dim] //= count
        outs.append(Shape(s.dtype, new, s.dynamic, s.layout))
    if not outs:
        _fail("reduce-scatter expects at least one operand")
    return outs[0] if len(outs) == 1 else Shape.tuple(outs)


def _all_to_all(opcode, shapes, attrs, _et):
    dims = attr_ints(attrs, "dimensions")
    if dims:
        _arity(opcode, shapes, 1)
        s = shapes[0]
        if not 0 <= dims[0] < s.rank:
            _fail(f"AllToAll split_dimension {dims[0]} is out-of-bounds in shape {_shape_text(s)}.")
        groups = attrs.get("replica_groups")
        if groups is not None and not isinstance(groups, Raw) and (groups.explicit or groups.iota):
            count = _group_size(attrs, opcode)
            if s.dims[dims[0]] % count:
                _fail(f"AllToAll split dimension size {s.dims[dims[0]]} must be dividable by split_count {count}.")
        return _make(s.dtype, s.dims, s.dynamic)
    if not shapes:
        _fail("all-to-all expects at least one operand")
    for i, s in enumerate(shapes):
        if not compatible(s, shapes[0]):
            _fail(f"HLO all-to-all has operands with different shapes: the 0th operand shape "
                  f"{_shape_text(shapes[0])}, but the {i}th operand has shape {_shape_text(s)}.")
    return Shape.tuple(shapes)


def _collective_permute(opcode, shapes, attrs, _et):
    if "slice_sizes" in attrs or len(shapes) == 4 and not all(s.is_array for s in shapes[2:]):
        _arity(opcode, shapes, 4)
        output = shapes[1]
    else:
        output = _same_or_tuple(shapes, opcode)
    if opcode == "collective-permute":
        return output
    if len(shapes) == 1 or "slice_sizes" in attrs:
        u32 = Shape("u32")  # the context XLA gives a single or in-place permute
        return Shape.tuple([shapes[0], output, u32, u32])
    return Shape.tuple([Shape.tuple(shapes), output])


def _tuple_element(index: int):
    def rule(opcode, shapes, attrs, _et):
        _arity(opcode, shapes, 1)
        s = shapes[0]
        if not s.is_tuple or len(s.tuple_shapes) <= index:
            _fail(f"{opcode} expects a tuple operand with at least {index + 1} elements, got {_shape_text(s)}")
        return s.tuple_shapes[index]
    return rule


def _fixed(shape: Shape, arity: int | None = None):
    def rule(opcode, shapes, attrs, _et):
        if arity is not None:
            _arity(opcode, shapes, arity)
        return shape
    return rule


def _first_operand(opcode, shapes, attrs, _et):
    if not shapes:
        _fail(f"{opcode} expects an operand")
    return shapes[0]


def _add_dependency(opcode, shapes, attrs, _et):
    _arity(opcode, shapes, 2)
    if not shapes[1].is_token:
        _fail(f"Expected operand 1 of add-dependency to be token-shaped, actual shape is {_shape_text(shapes[1])}")
    return shapes[0]


def _send(opcode, shapes, attrs, _et):
    _arity(opcode, shapes, 2)
    return Shape.tuple([shapes[0], Shape("u32"), Shape.token()])


def _recv_done(opcode, shapes, attrs, _et):
    _arity(opcode, shapes, 1)
    s = shapes[0]
    if not s.is_tuple or not s.tuple_shapes:
        _fail(f"recv-done expects the tuple of a recv, got {_shape_text(s)}")
    return Shape.tuple([s.tuple_shapes[0], Shape.token()])


def _copy_start(opcode, shapes, attrs, _et):
    _arity(opcode, shapes, 1)
    return Shape.tuple([shapes[0], shapes[0], Shape("u32")])


def _get_dimension_size(opcode, shapes, attrs, _et):
    _arity(opcode, shapes, 1)
    dims = attr_ints(attrs, "dimensions")
    if not dims:
        _fail("get-dimension-size needs the attribute dimensions")
    if not 0 <= dims[0] < shapes[0].rank:
        _fail(f"GetDimensionSize dimension out of bounds: {dims[0]}.")
    if shapes[0].dims[dims[0]] > 2**31 - 1:
        _fail(f"GetDimensionSize's input shape is {_shape_text(shapes[0])}, the {dims[0]}th dimension exceeds the "
              f"INT_MAX limit.")
    return Shape("s32")


def _set_dimension_size(opcode, shapes, attrs, _et):
    _arity(opcode, shapes, 2)
    operand, value = shapes
    dims = attr_ints(attrs, "dimensions")
    if not dims:
        _fail("set-dimension-size needs the attribute dimensions")
    d = dims[0]
    if not 0 <= d < operand.rank:
        _fail(f"SetDimensionSize dimension out of bounds: {d}.")
    if value.rank != 0 or value.dtype != "s32":
        _fail(f"SetDimensionSize's value has to be S32 scalar, got {_shape_text(value)}")
    if operand.dims[d] > 2**31 - 1:
        _fail(f"SetDimensionSize's input shape is {_shape_text(operand)}, the {d}th dimension exceeds the INT_MAX "
              f"limit.")
    dyn = [_dyn(operand, i) or i == d for i in range(operand.rank)]
    return _with_dynamic(operand, dyn)


# -- linear algebra, fft, batch norm ------------------------------------------------------------------------
def _fft(opcode, shapes, attrs, _et):
    _arity(opcode, shapes, 1)
    s = shapes[0]
    kind = attrs.get("fft_type")
    length = attr_ints(attrs, "fft_length")
    if kind is None or length is None:
        _fail("fft needs the attributes fft_type and fft_length")
    kind = str(kind)
    n = len(length)
    if not 1 <= n <= 3:
        _fail(f"FFT only supports ranks 1-3; got {n}.")
    if s.rank < n:
        _fail(f"FFT of rank {n} requires input of at least same rank; got input of rank {s.rank}")
    if kind in ("FFT", "IFFT"):
        if not _is_complex(s.dtype):
            _fail(f"{kind} requires complex input type, found {s.dtype}.")
        return s
    if kind == "RFFT":
        if s.dtype not in ("f32", "f64"):
            _fail(f"RFFT requires F32 or F64 input type, found {s.dtype}.")
        for i in range(n):
            if s.dims[s.rank - n + i] != length[i]:
                _fail(f"RFFT requires innermost dimensions match fft_length but dimension {s.rank - n + i} is "
                      f"{s.dims[s.rank - n + i]} and should be {length[i]}.")
        dims = list(s.dims)
        if length[-1] != 0:
            dims[-1] = length[-1] // 2 + 1
        return Shape("c64" if s.dtype == "f32" else "c128", dims, s.dynamic, s.layout)
    if kind == "IRFFT":
        if not _is_complex(s.dtype):
            _fail(f"IRFFT requires complex input type, found {s.dtype}.")
        for i in range(n - 1):
            if s.dims[s.rank - n + i] != length[i]:
                _fail(f"IRFFT requires all but one innermost dimensions match fft_length, but dimension "
                      f"{s.rank - n + i} is {s.dims[s.rank - n + i]} and should be {length[i]}.")
        if (s.dims[-1] != 0 or length[-1] != 0) and s.dims[-1] != length[-1] // 2 + 1:
            _fail(f"IRFFT requires innermost dimension matches fft_length/2+1, but dimension {s.rank - 1} is "
                  f"{s.dims[-1]} and should be {length[-1] // 2 + 1}.")
        dims = list(s.dims)
        dims[-1] = length[-1]
        return Shape(_component_type(s.dtype), dims, s.dynamic, s.layout)
    _fail(f"unknown fft_type {kind}")


def _triangular_solve(opcode, shapes, attrs, _et):
    _arity(opcode, shapes, 2)
    a, b = shapes
    if not (_is_float(a.dtype) or _is_complex(a.dtype)) or a.dtype != b.dtype:
        _fail(f"Expected element types in shape to be floating or complex and identical for TriangularSolve; got "
              f"{a.dtype} and {b.dtype}.")
    if a.rank < 2:
        _fail(f"The 'a' argument to TriangularSolve must have rank >= 2, got shape {_shape_text(a)}")
    if b.rank != a.rank:
        _fail(f"Arguments to triangular solve must have equal rank; got {_shape_text(b)} and {_shape_text(a)}.")
    if a.dims[-2] != a.dims[-1]:
        _fail(f"The two minor dimensions of 'a' must have equal size, got {_shape_text(a)}.")
    left = attr_bool(attrs, "left_side")
    if a.dims[-1] != b.dims[-2 if left else -1]:
        _fail(f"The shared dimension of 'a' and 'b' does not match, got shapes {_shape_text(a)} and {_shape_text(b)}")
    if a.dims[:-2] != b.dims[:-2]:
        _fail(f"The leading batch dimensions of the arguments to triangular solve must be equal; got "
              f"{_shape_text(b)} and {_shape_text(a)}.")
    transpose = attrs.get("transpose_a")
    if transpose is None or str(transpose) not in ("NO_TRANSPOSE", "TRANSPOSE", "ADJOINT"):
        _fail(f"Invalid transpose option value for triangular solve ({transpose}).")
    return b


def _cholesky(opcode, shapes, attrs, _et):
    _arity(opcode, shapes, 1)
    a = shapes[0]
    if not (_is_float(a.dtype) or _is_complex(a.dtype)):
        _fail(f"Expected element type in shape to be floating or complex for Cholesky; got {a.dtype}.")
    if a.rank < 2:
        _fail(f"The 'a' argument to Cholesky must have rank >= 2, got shape {_shape_text(a)}")
    if a.dims[-2] != a.dims[-1]:
        _fail(f"The two minor dimensions of 'a' must have equal size, got {_shape_text(a)}.")
    return a


def _batch_norm(opcode, shapes, attrs, _et):
    arity = 3 if opcode == "batch-norm-training" else 5
    _arity(opcode, shapes, arity)
    operand = shapes[0]
    for s in shapes:
        _expect_array(s, f"operand of {opcode}")
    index = attr_int(attrs, "feature_index")
    if index is None:
        _fail(f"{opcode} needs the attribute feature_index")
    if index >= operand.rank:
        _fail(f"Expected feature_index of {opcode} to be smaller than the rank of operand_shape; got feature_index "
              f"{index}, and rank {operand.rank}.")
    if index < 0:
        _fail(f"Expected feature_index of {opcode} to be a non-negative number, got {index}.")
    if operand.rank < 1:
        _fail(f"Expected the rank of operand to {opcode} to be at least 1; got {operand.rank}.")
    if not _is_float(operand.dtype):
        _fail(f"The operand to {opcode} must have a floating point element type, but the shape is {operand.dtype}.")
    features = operand.dims[index]
    vectors = shapes[1:] if opcode != "batch-norm-grad" else shapes[1:4]
    if opcode == "batch-norm-grad":
        grad = shapes[4]
        if grad.rank != operand.rank or grad.dims != operand.dims:
            _fail("The bounds of operand shape should be the same as output_grad's")
        if not _same_type_ignoring_fp(grad, operand):
            _fail(f"The inputs should have the same element type for {opcode}")
    for v in vectors:
        if v.rank != 1:
            _fail(f"The vector inputs of {opcode} must have rank 1, but one has rank {v.rank}.")
        if not _same_type_ignoring_fp(v, operand):
            _fail(f"The inputs should have the same element type for {opcode}")
        if v.dims[0] != features:
            _fail(f"The size of the vector inputs of {opcode} should be the same as feature count, but is "
                  f"{v.dims[0]} and the feature count is {features}.")
    if opcode == "batch-norm-inference":
        return operand
    feature = _make(operand.dtype, (features,))
    return Shape.tuple([operand, feature, feature])


_RULES = {}
for _op in UNARY_OPS:
    _RULES[_op] = _unary
for _op in BINARY_OPS:
    _RULES[_op] = _binary
_RULES.update({
    "select": _select, "clamp": _clamp, "fma": _fma, "convert": _convert, "bitcast-convert": _convert,
    "stochastic-convert": _convert, "reduce-precision": _reduce_precision,
    "tuple": _tuple, "get-tuple-element": _get_tuple_element, "broadcast": _broadcast, "transpose": _transpose,
    "reverse": _reverse, "concatenate": _concatenate, "slice": _slice, "dynamic-slice": _dynamic_slice,
    "dynamic-update-slice": _dynamic_update_slice, "pad": _pad, "dot": _dot, "ragged-dot": _ragged_dot,
    "convolution": _convolution, "reduce": _reduce, "reduce-window": _reduce_window,
    "select-and-scatter": _select_and_scatter, "map": _map, "sort": _sort, "topk": _topk, "gather": _gather,
    "scatter": _scatter, "while": _while, "conditional": _conditional, "call": _call, "fusion": _fusion,
    "async-update": _async_update, "async-done": _async_done,
    "all-reduce": _all_reduce, "all-reduce-start": _all_reduce, "all-reduce-done": _first_operand,
    "all-gather": _all_gather, "all-gather-start": _all_gather_start, "all-gather-done": _tuple_element(1),
    "reduce-scatter": _reduce_scatter, "all-to-all": _all_to_all,
    "collective-permute": _collective_permute, "collective-permute-start": _collective_permute,
    "collective-permute-done": _tuple_element(1),
    "collective-broadcast": _all_reduce,
    "ragged-all-to-all": lambda op, s, a, e: (_arity(op, s, 6), s[1])[1],
    "replica-id": _fixed(Shape("u32"), 0), "partition-id": _fixed(Shape("u32"), 0),
    "after-all": _fixed(Shape.token()), "add-dependency": _add_dependency,
    "outfeed": _fixed(Shape.token(), 2), "send": _send, "send-done": _fixed(Shape.token(), 1),
    "recv-done": _recv_done, "copy-start": _copy_start, "copy-done": _tuple_element(0),
    "rng-get-and-update-state": _fixed(Shape("u64", (2,)), 0),
    "get-dimension-size": _get_dimension_size, "set-dimension-size": _set_dimension_size,
    "fft": _fft, "triangular-solve": _triangular_solve, "cholesky": _cholesky,
    "batch-norm-training": _batch_norm, "batch-norm-inference": _batch_norm, "batch-norm-grad": _batch_norm,
})
