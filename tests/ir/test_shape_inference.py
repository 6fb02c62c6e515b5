"""hlo_tools.ir.shape_inference against XLA's own shape inference.

For every opcode XLA's HLO parser can infer, the instruction is written without a shape, XLA's
parser infers it (hlo_tools.xla.xla_bridge), and infer_shape must produce the same shape, layout
included. Opcodes XLA's parser insists on seeing a shape for are checked against the shapes written
in XLA's own test modules (the corpus), which XLA accepts.
"""
import glob
import re

import pytest

import hlo_tools
from hlo_tools.xla import xla_bridge
from hlo_tools.ir.shape import Shape
from hlo_tools.ir.shape_inference import PARSER_INFERABLE, ShapeInferenceError, compatible, infer_shape
from support import CORPUS_DIR, needs_corpus, unless_xla_dropped_the_opcode

ADD = """
add {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(x, y)
}
"""
ADD_S32 = """
add_s32 {
  x = s32[] parameter(0)
  y = s32[] parameter(1)
  ROOT s = s32[] add(x, y)
}
"""
ARGMAX = """
argmax {
  v0 = f32[] parameter(0)
  i0 = s32[] parameter(1)
  v1 = f32[] parameter(2)
  i1 = s32[] parameter(3)
  gt = pred[] compare(v0, v1), direction=GT
  v = f32[] select(gt, v0, v1)
  i = s32[] select(gt, i0, i1)
  ROOT t = (f32[], s32[]) tuple(v, i)
}
"""
LESS = """
less {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  c = s32[] parameter(2)
  d = s32[] parameter(3)
  ROOT lt = pred[] compare(a, b), direction=LT
}
less1 {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT lt = pred[] compare(a, b), direction=LT
}
"""
GE = """
ge {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT cmp = pred[] compare(a, b), direction=GE
}
"""
LOOP = """
cond {
  p = (s32[], f32[4]{0}) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  n = s32[] constant(10)
  ROOT lt = pred[] compare(i, n), direction=LT
}
body {
  p = (s32[], f32[4]{0}) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  one = s32[] constant(1)
  j = s32[] add(i, one)
  v = f32[4]{0} get-tuple-element(p), index=1
  w = f32[4]{0} negate(v)
  ROOT t = (s32[], f32[4]{0}) tuple(j, w)
}
"""
BRANCHES = """
neg {
  p = f32[2,3]{0,1} parameter(0)
  ROOT n = f32[2,3]{0,1} negate(p)
}
ident {
  p = f32[2,3]{1,0} parameter(0)
  ROOT c = f32[2,3]{1,0} copy(p)
}
double {
  p = f32[2,3] parameter(0)
  ROOT a = f32[2,3] add(p, p)
}
"""

# (computations, entry body whose `ROOT r = ...` has no shape)
CASES = {
    "abs_layout": ("", "a = f32[2,10]{0,1} parameter(0)\n  ROOT r = abs(a)"),
    "abs_complex": ("", "a = c64[3,2]{0,1} parameter(0)\n  ROOT r = abs(a)"),
    "abs_int": ("", "a = s32[4] parameter(0)\n  ROOT r = abs(a)"),
    "negate_s4": ("", "a = s4[10] parameter(0)\n  ROOT r = negate(a)"),
    "sign": ("", "a = c128[5] parameter(0)\n  ROOT r = sign(a)"),
    "not_pred": ("", "a = pred[5] parameter(0)\n  ROOT r = not(a)"),
    "exp_tiled_layout": ("", "a = f32[2,3]{0,1:T(2,128)} parameter(0)\n  ROOT r = exponential(a)"),
    "log_plus_one": ("", "a = bf16[7] parameter(0)\n  ROOT r = log-plus-one(a)"),
    "expm1": ("", "a = f16[7] parameter(0)\n  ROOT r = exponential-minus-one(a)"),
    "sine": ("", "a = f64[2] parameter(0)\n  ROOT r = sine(a)"),
    "cosine": ("", "a = c64[2] parameter(0)\n  ROOT r = cosine(a)"),
    "tan": ("", "a = f32[2] parameter(0)\n  ROOT r = tan(a)"),
    "tanh": ("", "a = f32[2,2]{0,1} parameter(0)\n  ROOT r = tanh(a)"),
    "gte_scalar_memory_space": ("", "a = (f32[2]{0}, u32[]{:S(2)}) parameter(0)\n"
                                    "  ROOT r = get-tuple-element(a), index=1"),
    "add_scalar_memory_space": ("", "a = u32[]{:S(2)} parameter(0)\n  ROOT r = add(a, a)"),
    "transpose_tiled": ("", "a = f32[2,3]{0,1:T(2,128)} parameter(0)\n  ROOT r = transpose(a), dimensions={1,0}"),
    "compare_tiled": ("", "a = f32[2,3]{0,1:T(2,128)S(1)} parameter(0)\n  ROOT r = compare(a, a), direction=LT"),
    "concatenate_memory_space": ("", "a = f32[2,3]{0,1:S(1)} parameter(0)\n"
                                     "  ROOT r = concatenate(a, a), dimensions={0}"),
    "log": ("", "a = f32[2]{0} parameter(0)\n  ROOT r = log(a)"),
    "sqrt": ("", "a = f32[2] parameter(0)\n  ROOT r = sqrt(a)"),
    "rsqrt": ("", "a = f32[2] parameter(0)\n  ROOT r = rsqrt(a)"),
    "cbrt": ("", "a = f32[2] parameter(0)\n  ROOT r = cbrt(a)"),
    "logistic": ("", "a = f32[2] parameter(0)\n  ROOT r = logistic(a)"),
    "erf": ("", "a = f32[2] parameter(0)\n  ROOT r = erf(a)"),
    "floor": ("", "a = f32[2] parameter(0)\n  ROOT r = floor(a)"),
    "ceil": ("", "a = f32[2] parameter(0)\n  ROOT r = ceil(a)"),
    "round_afz": ("", "a = f32[2] parameter(0)\n  ROOT r = round-nearest-afz(a)"),
    "round_even": ("", "a = bf16[2] parameter(0)\n  ROOT r = round-nearest-even(a)"),
    "is_finite": ("", "a = f32[4,2]{0,1} parameter(0)\n  ROOT r = is-finite(a)"),
    "real": ("", "a = c128[4] parameter(0)\n  ROOT r = real(a)"),
    "imag_float": ("", "a = f32[4] parameter(0)\n  ROOT r = imag(a)"),
    "popcnt": ("", "a = u8[4] parameter(0)\n  ROOT r = popcnt(a)"),
    "copy_tuple": ("", "a = (f32[4], s32[]) parameter(0)\n  ROOT r = copy(a)"),
    "add_layout": ("", "a = f32[2,10]{0,1} parameter(0)\n  b = f32[2,10]{1,0} parameter(1)\n  ROOT r = add(a, b)"),
    "subtract": ("", "a = s32[3] parameter(0)\n  ROOT r = subtract(a, a)"),
    "multiply_mixed": ("", "a = bf16[3] parameter(0)\n  b = f32[3] parameter(1)\n  ROOT r = multiply(a, b)"),
    "divide": ("", "a = f32[3] parameter(0)\n  ROOT r = divide(a, a)"),
    "maximum": ("", "a = u32[3] parameter(0)\n  ROOT r = maximum(a, a)"),
    "minimum": ("", "a = f16[3] parameter(0)\n  ROOT r = minimum(a, a)"),
    "power": ("", "a = f32[3] parameter(0)\n  ROOT r = power(a, a)"),
    "remainder": ("", "a = s64[3] parameter(0)\n  ROOT r = remainder(a, a)"),
    "atan2": ("", "a = f32[3] parameter(0)\n  ROOT r = atan2(a, a)"),
    "and": ("", "a = pred[3] parameter(0)\n  ROOT r = and(a, a)"),
    "or": ("", "a = s8[3] parameter(0)\n  ROOT r = or(a, a)"),
    "xor": ("", "a = u16[3] parameter(0)\n  ROOT r = xor(a, a)"),
    "shift_left": ("", "a = s32[3] parameter(0)\n  ROOT r = shift-left(a, a)"),
    "shift_right_logical": ("", "a = u32[3] parameter(0)\n  ROOT r = shift-right-logical(a, a)"),
    "complex": ("", "a = f64[3]{0} parameter(0)\n  ROOT r = complex(a, a)"),
    "compare": ("", "a = f32[2,3]{0,1} parameter(0)\n  ROOT r = compare(a, a), direction=LT"),
    "select": ("", "p = pred[2,3]{0,1} parameter(0)\n  a = f32[2,3]{1,0} parameter(1)\n  ROOT r = select(p, a, a)"),
    "select_scalar_pred": ("", "p = pred[] parameter(0)\n  a = f32[4]{0} parameter(1)\n  ROOT r = select(p, a, a)"),
    "clamp": ("", "a = f32[2,3]{0,1} parameter(0)\n  ROOT r = clamp(a, a, a)"),
    "clamp_scalar_bounds": ("", "lo = f32[] parameter(0)\n  a = f32[2,3]{0,1} parameter(1)\n  ROOT r = clamp(lo, a, lo)"),
    "tuple": ("", "a = f32[3]{0} parameter(0)\n  b = s32[2,3] parameter(1)\n  ROOT r = tuple(a, b, a)"),
    "tuple_empty": ("", "a = f32[3]{0} parameter(0)\n  ROOT r = tuple()"),
    "get_tuple_element": ("", "a = (f32[2,4]{0,1}, (s32[], f32[3])) parameter(0)\n  ROOT r = get-tuple-element(a), index=1"),
    "broadcast_scalar": ("", "a = f32[] parameter(0)\n  ROOT r = broadcast(a)"),
    "broadcast_quirk": ("", "a = f32[3]{0} parameter(0)\n  ROOT r = broadcast(a), dimensions={1}"),
    "transpose_2d": ("", "a = f32[2,3]{0,1} parameter(0)\n  ROOT r = transpose(a), dimensions={1,0}"),
    "transpose_3d": ("", "a = f32[2,3,4]{1,2,0} parameter(0)\n  ROOT r = transpose(a), dimensions={2,0,1}"),
    "transpose_default": ("", "a = f32[2,3,4] parameter(0)\n  ROOT r = transpose(a), dimensions={1,2,0}"),
    "reverse": ("", "a = f32[2,4]{0,1} parameter(0)\n  ROOT r = reverse(a), dimensions={0,1}"),
    "concatenate": ("", "a = f32[2,3]{0,1} parameter(0)\n  b = f32[2,5]{0,1} parameter(1)\n"
                        "  ROOT r = concatenate(a, b, a), dimensions={1}"),
    "pad": ("", "a = f32[2,3]{0,1} parameter(0)\n  z = f32[] parameter(1)\n  ROOT r = pad(a, z), padding=0_1x-1_1_2"),
    "dot_matmul": ("", "a = f32[2,3]{0,1} parameter(0)\n  b = f32[3,4] parameter(1)\n"
                       "  ROOT r = dot(a, b), lhs_contracting_dims={1}, rhs_contracting_dims={0}"),
    "dot_batch": ("", "a = f32[2,10]{1,0} parameter(0)\n  b = f32[10,2]{1,0} parameter(1)\n"
                      "  ROOT r = dot(a, b), lhs_batch_dims={0}, lhs_contracting_dims={1}, rhs_batch_dims={1}, "
                      "rhs_contracting_dims={0}"),
    "dot_outer": ("", "a = f32[2,3] parameter(0)\n  ROOT r = dot(a, a)"),
    "dot_mixed": ("", "a = bf16[2,3] parameter(0)\n  b = f32[3] parameter(1)\n"
                      "  ROOT r = dot(a, b), lhs_contracting_dims={1}, rhs_contracting_dims={0}"),
    "convolution": ("", "a = f32[1,5,5,2]{0,1,2,3} parameter(0)\n  k = f32[3,3,2,4] parameter(1)\n"
                        "  ROOT r = convolution(a, k), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f"),
    "convolution_strided_grouped": ("", "a = f32[9,8,7,6] parameter(0)\n  k = f32[6,3,2,3] parameter(1)\n"
                                        "  ROOT r = convolution(a, k), window={size=3x2 stride=2x3 pad=0_1x2_0 "
                                        "lhs_dilate=1x2 rhs_dilate=2x1}, dim_labels=fb01_o01i->01bf, "
                                        "feature_group_count=3"),
    "convolution_batch_group": ("", "a = f32[4,3,10] parameter(0)\n  k = f32[4,3,3] parameter(1)\n"
                                    "  ROOT r = convolution(a, k), window={size=3}, dim_labels=bf0_oi0->bf0, "
                                    "batch_group_count=2"),
    "reduce": (ADD, "a = f32[5,7]{0,1} parameter(0)\n  z = f32[] constant(0)\n"
                    "  ROOT r = reduce(a, z), dimensions={0}, to_apply=add"),
    "reduce_variadic": (ARGMAX, "a = f32[5,7]{0,1} parameter(0)\n  i = s32[5,7] parameter(1)\n"
                                "  z = f32[] constant(0)\n  zi = s32[] constant(0)\n"
                                "  ROOT r = reduce(a, i, z, zi), dimensions={1}, to_apply=argmax"),
    "reduce_window": (ADD, "a = f32[4,6]{0,1} parameter(0)\n  z = f32[] constant(0)\n"
                           "  ROOT r = reduce-window(a, z), window={size=2x3 stride=2x1 pad=0_0x1_1}, to_apply=add"),
    "select_and_scatter": (GE + ADD, "a = f32[4,6]{0,1} parameter(0)\n  s = f32[2,2] parameter(1)\n"
                                     "  z = f32[] constant(0)\n  ROOT r = select-and-scatter(a, s, z), "
                                     "window={size=2x3 stride=2x3}, select=ge, scatter=add"),
    "map": (ADD, "a = f32[5,7]{0,1} parameter(0)\n  ROOT r = map(a, a), dimensions={0,1}, to_apply=add"),
    "sort_one": (LESS, "a = f32[4,3]{0,1} parameter(0)\n  ROOT r = sort(a), dimensions={1}, to_apply=less1"),
    "sort_pair": (LESS, "a = f32[4,3]{0,1} parameter(0)\n  i = s32[4,3] parameter(1)\n"
                        "  ROOT r = sort(a, i), dimensions={0}, to_apply=less"),
    "topk": ("", "a = f32[4,3]{0,1} parameter(0)\n  ROOT r = topk(a), k=2"),
    "gather": ("", "a = f32[5,7]{0,1} parameter(0)\n  i = s32[3,1] parameter(1)\n"
                   "  ROOT r = gather(a, i), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, "
                   "index_vector_dim=1, slice_sizes={1,7}"),
    "gather_batching": ("", "a = f32[3,5,7] parameter(0)\n  i = s32[3,4,1] parameter(1)\n"
                            "  ROOT r = gather(a, i), offset_dims={2}, collapsed_slice_dims={1}, start_index_map={1}, "
                            "operand_batching_dims={0}, start_indices_batching_dims={0}, index_vector_dim=2, "
                            "slice_sizes={1,1,7}"),
    "gather_implicit_index_dim": ("", "a = f32[5,7] parameter(0)\n  i = s32[2,3] parameter(1)\n"
                                      "  ROOT r = gather(a, i), offset_dims={2}, collapsed_slice_dims={0}, "
                                      "start_index_map={0}, index_vector_dim=2, slice_sizes={1,4}"),
    "scatter": (ADD, "a = f32[5,7]{0,1} parameter(0)\n  i = s32[3,1] parameter(1)\n  u = f32[3,7] parameter(2)\n"
                     "  ROOT r = scatter(a, i, u), update_window_dims={1}, inserted_window_dims={0}, "
                     "scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=add"),
    "while": (LOOP, "a = f32[4]{0} parameter(0)\n  i = s32[] constant(0)\n  t = (s32[], f32[4]{0}) tuple(i, a)\n"
                    "  ROOT r = while(t), condition=cond, body=body"),
    "conditional_pred": (BRANCHES, "p = pred[] parameter(0)\n  a = f32[2,3]{0,1} parameter(1)\n"
                                   "  b = f32[2,3]{1,0} parameter(2)\n"
                                   "  ROOT r = conditional(p, a, b), true_computation=neg, false_computation=ident"),
    "conditional_indexed": (BRANCHES, "i = s32[] parameter(0)\n  a = f32[2,3] parameter(1)\n"
                                      "  ROOT r = conditional(i, a, a, a), "
                                      "branch_computations={ident, neg, double}"),
    "call": (BRANCHES, "a = f32[2,3]{0,1} parameter(0)\n  ROOT r = call(a), to_apply=neg"),
    "fft": ("", "a = c64[5,8]{0,1} parameter(0)\n  ROOT r = fft(a), fft_type=FFT, fft_length={8}"),
    "ifft": ("", "a = c128[5,8] parameter(0)\n  ROOT r = fft(a), fft_type=IFFT, fft_length={5,8}"),
    "rfft": ("", "a = f32[5,8]{0,1} parameter(0)\n  ROOT r = fft(a), fft_type=RFFT, fft_length={8}"),
    "irfft": ("", "a = c64[5,8]{0,1} parameter(0)\n  ROOT r = fft(a), fft_type=IRFFT, fft_length={14}"),
    "triangular_solve": ("", "a = f32[4,4]{0,1} parameter(0)\n  b = f32[4,3]{0,1} parameter(1)\n"
                             "  ROOT r = triangular-solve(a, b), left_side=true, lower=true, transpose_a=NO_TRANSPOSE"),
    "cholesky": ("", "a = f32[2,4,4]{0,1,2} parameter(0)\n  ROOT r = cholesky(a), lower=true"),
    "batch_norm_training": ("", "a = f32[2,4]{0,1} parameter(0)\n  s = f32[4] parameter(1)\n"
                                "  ROOT r = batch-norm-training(a, s, s), epsilon=0.001, feature_index=1"),
    "batch_norm_inference": ("", "a = f32[2,4]{0,1} parameter(0)\n  s = f32[2] parameter(1)\n"
                                 "  ROOT r = batch-norm-inference(a, s, s, s, s), epsilon=0.001, feature_index=0"),
    "batch_norm_grad": ("", "a = f32[2,4]{0,1} parameter(0)\n  s = f32[4] parameter(1)\n"
                            "  ROOT r = batch-norm-grad(a, s, s, s, a), epsilon=0.001, feature_index=1"),
    "get_dimension_size": ("", "a = f32[<=4,3]{0,1} parameter(0)\n  ROOT r = get-dimension-size(a), dimensions={0}"),
    "set_dimension_size": ("", "a = f32[4,3]{0,1} parameter(0)\n  n = s32[] parameter(1)\n"
                               "  ROOT r = set-dimension-size(a, n), dimensions={0}"),
    "after_all": ("", "t = token[] after-all()\n  ROOT r = after-all(t, t)"),
    "add_dependency": ("", "a = f32[4,3]{0,1} parameter(0)\n  t = token[] after-all()\n"
                           "  ROOT r = add-dependency(a, t)"),
    "replica_id": ("", "ROOT r = replica-id()"),
    "partition_id": ("", "ROOT r = partition-id()"),
    "domain": ("", "a = f32[2,4]{0,1} parameter(0)\n  ROOT r = domain(a), "
                   "domain={kind=\"sharding\", entry={maximal device=0}, exit={maximal device=1}}"),
}


def _module(computations: str, body: str) -> str:
    return f"HloModule m\n{computations}\nENTRY e {{\n  {body}\n}}\n"


def _xla_root_shape(text: str, opcode: str) -> str:
    printed = xla_bridge.xla_print(xla_bridge.xla_parse(text))
    m = re.search(r"ROOT %r = (.*?) " + re.escape(opcode) + r"\(", printed)
    assert m, printed
    return m.group(1)


def _root_opcode(body: str) -> str:
    return re.search(r"ROOT r = ([a-z0-9\-]+)\(", body).group(1)


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_xla_inference(name):
    computations, body = CASES[name]
    opcode = _root_opcode(body)
    text = _module(computations, body)
    with unless_xla_dropped_the_opcode():
        expected = _xla_root_shape(text, opcode)
    # hlo_tools' parser infers the missing shape ...
    assert str(hlo_tools.parse_module(text).entry.root.shape) == expected
    # ... and so does infer_shape on the operands of the instruction written with XLA's shape.
    module = hlo_tools.parse_module(text.replace("ROOT r = ", f"ROOT r = {expected} ", 1))
    root = module.entry.root
    inferred = infer_shape(root.opcode, [o.shape for o in root.operands], root.attrs, literal=root.literal)
    assert str(inferred) == expected


def test_cases_cover_every_opcode_xla_infers():
    covered = {_root_opcode(body) for _, body in CASES.values()}
    # ragged-dot and opt-barrier: XLA's parser lists them but cannot infer them (it needs more operands
    # / fails); count-leading-zeros: hlo_tools' parser does not know the opcode yet (see below).
    missing = PARSER_INFERABLE - covered - {"ragged-dot", "shift-right-arithmetic", "opt-barrier",
                                            "count-leading-zeros"}
    assert not missing, missing


def test_count_leading_zeros():
    text = _module("", "a = s32[4]{0} parameter(0)\n  ROOT r = count-leading-zeros(a)")
    assert _xla_root_shape(text, "count-leading-zeros") == "s32[4]{0}"
    assert str(infer_shape("count-leading-zeros", [_s("s32[4]{0}")], {})) == "s32[4]{0}"
    with pytest.raises(ShapeInferenceError):
        infer_shape("count-leading-zeros", [_s("f32[4]")], {})


@needs_corpus
@pytest.mark.parametrize("name", ["InferBinaryShape", "InferDotShape", "InferTernaryShape", "InferTupleShape",
                                  "InferShapeMixedExplicitShape",
                                  "InferUnaryShape", "MixAnonAndNonAnonOperands_input", "SimpleNesting_input"])
def test_parser_inferred_shapes_match_xla(name):
    """Modules from XLA's parser tests that omit shapes: every inferred shape is XLA's."""
    text = open(CORPUS_DIR / "parser" / f"{name}.hlo").read()
    printed = xla_bridge.xla_print(xla_bridge.xla_parse(text))
    xla_shapes = dict(re.findall(r"^\s*(?:ROOT )?%(\S+) = (.*?) [a-z0-9\-]+\(", printed, re.M))
    module = hlo_tools.parse_module(text)
    written = set(re.findall(r"^\s*(?:ROOT )?%?([\w.\-]+) = [a-z0-9]+\[", text, re.M))
    checked = 0
    for instr in module.instructions():
        if instr.name in written or instr.opcode == "parameter" or instr.name not in xla_shapes:
            continue
        assert str(instr.shape) == xla_shapes[instr.name], instr.name
        checked += 1
    assert checked


# (computations, entry body) that XLA's parser refuses: the operands admit no shape.
XLA_REFUSES = {
    "dot_contracting_mismatch": ("", "a = f32[2,3] parameter(0)\n"
                                     "  ROOT r = dot(a, a), lhs_contracting_dims={1}, rhs_contracting_dims={1}, "
                                     "rhs_batch_dims={0}"),
    "dot_size_mismatch": ("", "a = f32[2,3] parameter(0)\n  b = f32[4,5] parameter(1)\n"
                              "  ROOT r = dot(a, b), lhs_contracting_dims={1}, rhs_contracting_dims={0}"),
    "transpose_not_permutation": ("", "a = f32[2,3] parameter(0)\n  ROOT r = transpose(a), dimensions={0,0}"),
    "concatenate_ranks": ("", "a = f32[2,3] parameter(0)\n  b = f32[6] parameter(1)\n"
                              "  ROOT r = concatenate(a, b), dimensions={0}"),
    "concatenate_types": ("", "a = f32[2,3] parameter(0)\n  b = s32[2,3] parameter(1)\n"
                              "  ROOT r = concatenate(a, b), dimensions={0}"),
    "binary_types": ("", "a = f32[2,3] parameter(0)\n  b = s32[2,3] parameter(1)\n  ROOT r = add(a, b)"),
    "subtract_pred": ("", "a = pred[3] parameter(0)\n  ROOT r = subtract(a, a)"),
    "floor_int": ("", "a = s32[3] parameter(0)\n  ROOT r = floor(a)"),
    "is_finite_int": ("", "a = s32[3] parameter(0)\n  ROOT r = is-finite(a)"),
    "select_not_pred": ("", "p = s32[3] parameter(0)\n  a = f32[3] parameter(1)\n  ROOT r = select(p, a, a)"),
    "clamp_matrix_bound_scalar_operand": ("", "a = f32[2,3] parameter(0)\n  s = f32[] parameter(1)\n"
                                              "  ROOT r = clamp(a, s, s)"),
    "reduce_bad_dimension": (ADD, "a = f32[5,7] parameter(0)\n  z = f32[] constant(0)\n"
                                  "  ROOT r = reduce(a, z), dimensions={2}, to_apply=add"),
    "reduce_bad_reducer": (ADD_S32, "a = f32[5,7] parameter(0)\n  z = f32[] constant(0)\n"
                                    "  ROOT r = reduce(a, z), dimensions={0}, to_apply=add_s32"),
    "pad_rank": ("", "a = f32[2,3] parameter(0)\n  z = f32[] parameter(1)\n  ROOT r = pad(a, z), padding=0_1"),
    "reverse_out_of_range": ("", "a = f32[2,3] parameter(0)\n  ROOT r = reverse(a), dimensions={2}"),
    "convolution_features": ("", "a = f32[1,5,5,2] parameter(0)\n  k = f32[3,3,3,4] parameter(1)\n"
                                 "  ROOT r = convolution(a, k), window={size=3x3}, dim_labels=b01f_01io->b01f"),
    "gather_index_map": ("", "a = f32[5,7] parameter(0)\n  i = s32[3,2] parameter(1)\n"
                             "  ROOT r = gather(a, i), offset_dims={1}, collapsed_slice_dims={0}, "
                             "start_index_map={0}, index_vector_dim=1, slice_sizes={1,7}"),
    "fft_real_input": ("", "a = f32[8] parameter(0)\n  ROOT r = fft(a), fft_type=FFT, fft_length={8}"),
    "cholesky_rank1": ("", "a = f32[4] parameter(0)\n  ROOT r = cholesky(a), lower=true"),
    "while_body_mismatch": (BRANCHES, "a = f32[2,3] parameter(0)\n"
                                      "  ROOT r = while(a), condition=neg, body=neg"),
    "call_arity": (BRANCHES, "a = f32[2,3] parameter(0)\n  ROOT r = call(a, a), to_apply=neg"),
    "conditional_operand_mismatch": (BRANCHES, "p = pred[] parameter(0)\n  a = f32[3,2] parameter(1)\n"
                                               "  ROOT r = conditional(p, a, a), true_computation=neg, "
                                               "false_computation=ident"),
}


@pytest.mark.parametrize("name", sorted(XLA_REFUSES))
def test_refuses_what_xla_refuses(name):
    computations, body = XLA_REFUSES[name]
    text = _module(computations, body)
    with pytest.raises(xla_bridge.XlaBridgeError, match="infer shape|expects|permutation|must|Expected|Invalid"):
        xla_bridge.xla_parse(text)
    module = hlo_tools.parse_module(text.replace("ROOT r = ", "ROOT r = f32[] ", 1))
    root = module.entry.root
    with pytest.raises(ShapeInferenceError):
        infer_shape(root.opcode, [o.shape for o in root.operands], root.attrs)


def _s(text):
    return hlo_tools.parse_shape(text)


def test_get_tuple_element_out_of_range():
    # (XLA's parser CHECK-fails on these, so they are not sent to it.)
    with pytest.raises(ShapeInferenceError, match="out of tuple bounds"):
        infer_shape("get-tuple-element", [_s("(f32[2], s32[])")], {"index": 2})
    with pytest.raises(ShapeInferenceError, match="non-tuple"):
        infer_shape("get-tuple-element", [_s("f32[2]")], {"index": 0})


def test_implicit_broadcast_is_refused():
    # XLA's ShapeInference would broadcast here, but HLO forbids implicit broadcasts (its verifier
    # refuses the instruction), so infer_shape refuses up front.
    with pytest.raises(ShapeInferenceError, match="implicit broadcast"):
        infer_shape("add", [_s("f32[3]"), _s("f32[]")], {})
    with pytest.raises(ShapeInferenceError, match="implicit broadcast"):
        infer_shape("multiply", [_s("f32[1,3]"), _s("f32[2,3]")], {})


@pytest.mark.parametrize("opcode", ["parameter", "constant", "iota", "reshape", "bitcast", "custom-call", "rng",
                                    "rng-bit-generator", "infeed", "recv", "dynamic-reshape", "convert",
                                    "bitcast-convert"])
def test_shape_must_be_given(opcode):
    with pytest.raises(ShapeInferenceError, match="must be given"):
        infer_shape(opcode, [_s("f32[4]")], {})


def test_element_type_completes_conversions():
    assert str(infer_shape("convert", [_s("f32[2,3]{0,1}")], {}, element_type="bf16")) == "bf16[2,3]{0,1}"
    assert str(infer_shape("bitcast-convert", [_s("f32[2,3]")], {}, element_type="u8")) == "u8[2,3,4]{2,1,0}"
    assert str(infer_shape("bitcast-convert", [_s("u8[2,4]")], {}, element_type="f32")) == "f32[2]{0}"
    with pytest.raises(ShapeInferenceError, match="ratio"):
        infer_shape("bitcast-convert", [_s("u8[2,3]")], {}, element_type="f32")
    # A dot's preferred element type may widen, but not narrow, integers.
    dims = {"lhs_contracting_dims": (1,), "rhs_contracting_dims": (0,)}
    assert str(infer_shape("dot", [_s("s8[2,3]"), _s("s8[3,4]")], dims, element_type="s32")) == "s32[2,4]{1,0}"
    with pytest.raises(ShapeInferenceError, match="narrower"):
        infer_shape("dot", [_s("s32[2,3]"), _s("s32[3,4]")], dims, element_type="s8")


def test_shapes_xla_parser_requires_but_passes_can_infer():
    A = hlo_tools.ir.attributes
    assert str(infer_shape("slice", [_s("f32[6,8]{0,1}")], {"slice": A.SliceSpec.parse("{[1:5:2], [0:8]}")})) \
        == "f32[2,8]{1,0}"
    assert str(infer_shape("dynamic-slice", [_s("f32[6,8]"), _s("s32[]"), _s("s32[]")],
                           {"dynamic_slice_sizes": (2, 3)})) == "f32[2,3]{1,0}"
    assert str(infer_shape("dynamic-update-slice", [_s("f32[6,8]{0,1}"), _s("f32[2,3]"), _s("s32[]"), _s("s32[]")],
                           {})) == "f32[6,8]{0,1}"
    groups = {"replica_groups": A.ReplicaGroups.parse("{{0,1,2,3}}"), "dimensions": (1,)}
    assert str(infer_shape("all-gather", [_s("f32[2,3]")], groups)) == "f32[2,12]{1,0}"
    assert str(infer_shape("reduce-scatter", [_s("f32[2,8]")], groups)) == "f32[2,2]{1,0}"
    assert str(infer_shape("all-reduce", [_s("f32[2]"), _s("s32[]")], {})) == "(f32[2]{0}, s32[])"
    assert str(infer_shape("collective-permute", [_s("f32[2]")], {})) == "f32[2]{0}"
    assert str(infer_shape("send", [_s("f32[2]"), _s("token[]")], {})) == "(f32[2]{0}, u32[], token[])"
    assert str(infer_shape("copy-start", [_s("f32[2]")], {})) == "(f32[2]{0}, f32[2]{0}, u32[])"
    with pytest.raises(ShapeInferenceError, match="replica"):
        infer_shape("all-gather", [_s("f32[2,3]")], {"dimensions": (1,)})


CORPUS_FILES = sorted(p for p in glob.glob(str(CORPUS_DIR / "*" / "*.hlo")) if "parser_invalid" not in p)


@needs_corpus
def test_inference_agrees_with_every_shape_in_xlas_tests():
    """Wherever infer_shape answers, its shape is the one XLA's own test modules write."""
    checked = 0
    for path in CORPUS_FILES:
        module = hlo_tools.parse_module(open(path, newline="").read())
        for instr in module.instructions():
            if instr.opcode == "broadcast":
                continue  # inferred as XLA's parser does (dimensions taken as sizes); see test_matches_xla
            try:
                element_type = instr.shape.dtype if instr.shape.is_array else None
                shape = infer_shape(instr.opcode, [o.shape for o in instr.operands], instr.attrs,
                                    literal=instr.literal, element_type=element_type)
            except ShapeInferenceError:
                continue
            assert compatible(shape, instr.shape), (path, instr.name, str(shape), str(instr.shape))
            checked += 1
    assert checked > 1000


def test_add_instruction_infers_shape():
    module = hlo_tools.parse_module("HloModule m\nENTRY e {\n  a = f32[2,3]{0,1} parameter(0)\n"
                                    "  ROOT n = f32[2,3]{0,1} negate(a)\n}\n")
    comp = module.entry
    a = comp.parameter(0)
    total = comp.add_instruction("add", [a, comp.root])
    assert str(total.shape) == "f32[2,3]{0,1}"
    t = comp.add_instruction("transpose", [total], attrs={"dimensions": (1, 0)})
    assert str(t.shape) == "f32[3,2]{1,0}"
    pair = comp.add_instruction("tuple", [t, a])
    assert pair.shape == Shape.tuple([t.shape, a.shape])
    with pytest.raises(ShapeInferenceError):
        comp.add_instruction("add", [t, a])


@pytest.mark.parametrize("operand, result, expected", [
    ("f32[1,64,32]{2,1,0}", "f32[64,32]{1,0}", True),
    ("f32[3,3,16,16]{3,2,1,0}", "f32[2304]{0}", True),
    ("f32[64,1,32]{2,0,1}", "f32[64,32]{1,0}", True),      # a size-1 dimension goes anywhere
    ("f32[64,32]{0,1}", "f32[2048]{0}", False),            # column-major: the flattening moves elements
    ("f32[64,32]{1,0}", "f32[32,64]{0,1}", False),
    ("f32[64,32]{1,0}", "s32[64,32]{1,0}", False),
    ("f32[64,32]{1,0:T(8,128)}", "f32[2048]{0}", False),    # tiled: not only an order
])
def test_reshape_is_bitcast_only_where_no_element_moves_in_memory(operand, result, expected):
    module = hlo_tools.parse_module(f"HloModule m\nENTRY e {{\n  p = {operand} parameter(0)\n"
                                    f"  ROOT r = {result} reshape(p)\n}}\n")
    assert module.entry.root.operands[0].shape.reshape_is_bitcast(module.entry.root.shape) is expected


def test_fma():
    """fma(a, b, c) = a * b + c, which XLA's simplifier makes on CPU from jaxlib 0.12.1 on (erf's polynomials in
    a truncated-normal initializer): parsed, verified, printed back as it came, its shape inferred."""
    text = ("HloModule m\n\nENTRY e {\n  a = f32[2,3]{1,0} parameter(0)\n  b = f32[2,3]{1,0} parameter(1)\n"
            "  ROOT r = f32[2,3]{1,0} fma(a, b, a)\n}\n")
    module = hlo_tools.parse_module(text)
    hlo_tools.verify(module)
    assert module.to_text() == text and module.entry.root.opcode == "fma"
    assert str(infer_shape("fma", [_s("f32[2,3]{1,0}")] * 3, {})) == "f32[2,3]{1,0}"
    for operands in ([_s("f32[2,3]"), _s("f32[3,2]"), _s("f32[2,3]")], [_s("s32[4]")] * 3, [_s("f32[4]")] * 2):
        with pytest.raises(ShapeInferenceError):
            infer_shape("fma", operands, {})
