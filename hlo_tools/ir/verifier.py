"""Checks an HloModule the way XLA does: its HLO parser's semantic checks, then its HloVerifier.

    from hlo_tools.ir.verifier import verify_module, verify_edits
    verify_module(module)        # HloVerifyError(message, line=..., instruction=...) on the first problem
    verify_edits(module)         # the same checks, on what was edited since the module was parsed

What is checked, in XLA's order (a module that XLA's parser would refuse fails before anything the
verifier proper would say about it):

1. Structure: an entry computation; computations that define what they call before calling it; no
   duplicate instruction names within a computation; operands and control predecessors that belong
   to the same computation and come earlier in it (as HLO text must have them); parameters numbered
   0..n-1; a root.
2. What XLA's parser refuses: unexpected or missing attributes per opcode (e.g. `calls=` on a send,
   `branch_computations=` on a pred conditional, `result_accuracy=` on a non-transcendental op),
   operand counts, enumeration values (`direction=`, `api_version=`, ...), conditional branch
   indices, async op shapes and chains, infeed shapes, custom-call layout constraints.
3. What XLA's HloVerifier refuses (with its default options: layout-insensitive, no mixed
   precision): every instruction's shape against ShapeInference, called computations' signatures,
   implicit broadcasts, collectives' replica groups and source-target pairs, async/copy/send/recv
   pairing, fusion invariants, the entry computation layout, input/output aliasing and buffer donors.
"""
from __future__ import annotations

import functools
import re

from hlo_tools.ir import attributes as A
from hlo_tools.ir.errors import HloVerifyError
from hlo_tools.ir.opcodes import OPCODES, async_wrapped_opcode
from hlo_tools.ir.shape import FLOAT_DTYPES, INTEGRAL_DTYPES, UNBOUNDED, Shape
from hlo_tools.ir.attributes import attr_bool, attr_int, attr_ints
from hlo_tools.ir.shape_inference import ShapeInferenceError, compatible, default_layout, infer_shape, program_shape

# ----------------------------------------------------------------------------------------------------
# What XLA's parser accepts per opcode (CreateInstruction in xla/hlo/parser/hlo_parser.cc)
# ----------------------------------------------------------------------------------------------------
COMMON_ATTRS = frozenset({
    "sharding", "frontend_attributes", "statistics", "parameter_replication", "control-predecessors", "origin",
    "metadata", "backend_config",
})


def _spec(allowed: str = "", required: str = ""):
    req = frozenset(required.split())
    return frozenset(allowed.split()) | req, req


_RESULT_ACCURACY_OPS = frozenset({
    "exponential-minus-one", "log", "log-plus-one", "logistic", "sqrt", "cbrt", "rsqrt", "tanh", "erf", "sine",
    "cosine", "tan", "exponential",
})
_PLAIN_UNARY = frozenset({
    "abs", "all-gather-done", "all-reduce-done", "round-nearest-afz", "round-nearest-even", "bitcast", "ceil",
    "count-leading-zeros", "clz", "collective-permute-done", "copy", "copy-done", "opt-barrier", "imag",
    "is-finite", "floor", "not", "negate", "popcnt", "real", "sign",
})
_PLAIN_BINARY = frozenset({
    "add", "divide", "multiply", "subtract", "atan2", "complex", "maximum", "minimum", "power", "remainder",
    "and", "or", "xor", "shift-left", "shift-right-arithmetic", "shift-right-logical", "stochastic-convert",
})
_COLLECTIVE_REDUCE = "replica_groups channel_id constrain_layout use_global_device_ids"
_SEND_RECV = "channel_id is_host_transfer"

ATTRIBUTES = {op: _spec() for op in _PLAIN_UNARY | _PLAIN_BINARY}
ATTRIBUTES.update({op: _spec("result_accuracy") for op in _RESULT_ACCURACY_OPS})
ATTRIBUTES.update({
    "parameter": _spec(), "constant": _spec(), "iota": _spec(required="iota_dimension"),
    "topk": _spec("largest", "k"), "clamp": _spec(), "fma": _spec(), "select": _spec(), "convert": _spec(),
    "bitcast-convert": _spec(),
    "all-gather": _spec(_COLLECTIVE_REDUCE, "dimensions"), "all-gather-start": _spec(_COLLECTIVE_REDUCE, "dimensions"),
    "all-reduce": _spec(_COLLECTIVE_REDUCE, "to_apply"), "all-reduce-start": _spec(_COLLECTIVE_REDUCE, "to_apply"),
    "reduce-scatter": _spec(_COLLECTIVE_REDUCE, "to_apply dimensions"),
    "all-to-all": _spec("replica_groups channel_id dimensions constrain_layout"),
    "ragged-all-to-all": _spec("replica_groups channel_id dimensions"),
    "collective-broadcast": _spec("channel_id", "replica_groups"),
    "collective-permute": _spec("channel_id slice_sizes", "source_target_pairs"),
    "collective-permute-start": _spec("channel_id slice_sizes", "source_target_pairs"),
    "async-start": _spec("async_execution_thread output_to_operand_aliasing", "calls"),
    "async-update": _spec("async_execution_thread calls"), "async-done": _spec("async_execution_thread calls"),
    "copy-start": _spec("cross_program_prefetch_index"), "replica-id": _spec(), "partition-id": _spec(),
    "dynamic-reshape": _spec(), "reshape": _spec("inferred_dimension"), "after-all": _spec(),
    "add-dependency": _spec(), "sort": _spec("is_stable", "dimensions to_apply"), "tuple": _spec(),
    "while": _spec(required="condition body"), "recv": _spec(_SEND_RECV), "recv-done": _spec(_SEND_RECV),
    "send": _spec(_SEND_RECV), "send-done": _spec(_SEND_RECV), "get-tuple-element": _spec(required="index"),
    "call": _spec("is_composite", "to_apply"), "reduce-window": _spec("window", "to_apply"),
    "convolution": _spec("window feature_group_count batch_group_count operand_precision", "dim_labels"),
    "fft": _spec(required="fft_type fft_length"),
    "triangular-solve": _spec("left_side lower unit_diagonal transpose_a"), "compare": _spec("type", "direction"),
    "cholesky": _spec("lower"), "broadcast": _spec("dimensions"), "concatenate": _spec(required="dimensions"),
    "map": _spec("dimensions", "to_apply"), "reduce": _spec(required="to_apply dimensions"),
    "reverse": _spec(required="dimensions"), "select-and-scatter": _spec("window", "select scatter"),
    "slice": _spec(required="slice"), "dynamic-slice": _spec(required="dynamic_slice_sizes"),
    "dynamic-update-slice": _spec(), "transpose": _spec(required="dimensions"),
    "batch-norm-training": _spec(required="epsilon feature_index"),
    "batch-norm-inference": _spec(required="epsilon feature_index"),
    "batch-norm-grad": _spec(required="epsilon feature_index"), "pad": _spec(required="padding"),
    "fusion": _spec("output_to_operand_aliasing", "calls kind"), "infeed": _spec("infeed_config"),
    "outfeed": _spec("outfeed_config outfeed_shape"), "rng": _spec(required="distribution"),
    "rng-get-and-update-state": _spec(required="delta"), "rng-bit-generator": _spec(required="algorithm"),
    "reduce-precision": _spec(required="exponent_bits mantissa_bits"),
    "custom-call": _spec("window dim_labels feature_group_count batch_group_count operand_layout_constraints "
                         "custom_call_has_side_effect to_apply called_computations output_to_operand_aliasing "
                         "padding_type literal operand_precision schedule api_version", "custom_call_target"),
    "dot": _spec("lhs_contracting_dims rhs_contracting_dims lhs_batch_dims rhs_batch_dims operand_precision "
                 "sparsity algorithm"),
    "ragged-dot": _spec("lhs_contracting_dims rhs_contracting_dims lhs_batch_dims rhs_batch_dims lhs_ragged_dims "
                        "rhs_group_dims operand_precision"),
    "gather": _spec("indices_are_sorted operand_batching_dims start_indices_batching_dims",
                    "offset_dims collapsed_slice_dims start_index_map index_vector_dim slice_sizes"),
    "scatter": _spec("indices_are_sorted unique_indices input_batching_dims scatter_indices_batching_dims",
                     "update_window_dims inserted_window_dims scatter_dims_to_operand_dims index_vector_dim to_apply"),
    "domain": _spec(required="domain"), "get-dimension-size": _spec(required="dimensions"),
    "set-dimension-size": _spec(required="dimensions"),
    "scan": _spec("is_reverse is_associative num_carries", "dimensions to_apply"),
})

# Operand counts (HloOpcodeArity, plus the counts XLA's parser insists on).
ARITY = {op: 1 for op in _PLAIN_UNARY | _RESULT_ACCURACY_OPS}
ARITY.update({op: 2 for op in _PLAIN_BINARY})
ARITY.update({
    "add-dependency": 2, "batch-norm-grad": 5, "batch-norm-inference": 5, "batch-norm-training": 3,
    "bitcast-convert": 1, "broadcast": 1, "cholesky": 1, "clamp": 3, "compare": 2, "constant": 0, "convert": 1,
    "convolution": 2, "fma": 3, "copy-start": 1, "domain": 1, "fft": 1, "gather": 2, "get-dimension-size": 1,
    "set-dimension-size": 2, "get-tuple-element": 1, "infeed": 1, "iota": 0, "outfeed": 2, "pad": 2,
    "parameter": 0, "partition-id": 0, "recv": 1, "recv-done": 1, "reduce-precision": 1, "replica-id": 0,
    "reshape": 1, "reverse": 1, "rng-bit-generator": 1, "rng-get-and-update-state": 0, "select": 3,
    "select-and-scatter": 3, "send": 2, "send-done": 1, "slice": 1, "topk": 1, "transpose": 1,
    "triangular-solve": 2, "while": 1, "async-update": 1, "async-done": 1, "ragged-dot": 3, "rng": 2,
    "ragged-all-to-all": 6, "all-gather-done": 1, "all-reduce-done": 1, "collective-permute-done": 1,
    "copy-done": 1,
})

_ENUMS = {
    "direction": {"EQ", "NE", "GE", "GT", "LE", "LT"},
    "type": {"FLOAT", "TOTALORDER", "SIGNED", "UNSIGNED"},
    "kind": {"kLoop", "kInput", "kOutput", "kCustom"},
    "distribution": {"rng_uniform", "rng_normal"},
    "fft_type": {"FFT", "IFFT", "RFFT", "IRFFT"},
    "transpose_a": {"NO_TRANSPOSE", "TRANSPOSE", "ADJOINT"},
    "schedule": {"SCHEDULE_NONE", "SCHEDULE_LATEST", "SCHEDULE_EARLIEST"},
    "padding_type": {"PADDING_INVALID", "PADDING_VALID", "PADDING_SAME"},
    "api_version": {"API_VERSION_UNSPECIFIED", "API_VERSION_ORIGINAL", "API_VERSION_STATUS_RETURNING",
                    "API_VERSION_STATUS_RETURNING_UNIFIED", "API_VERSION_TYPED_FFI"},
}
_RNG_ALGORITHMS = {"rng_default", "rng_three_fry", "rng_philox"}
_PRECISIONS = {"default", "high", "highest", "packed_nibble"}
_ASYNC_GENERIC = frozenset({"async-start", "async-update", "async-done"})
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_KNOWN_OPCODES = OPCODES | {"count-leading-zeros"}  # XLA's name for what opcodes.py calls clz

# Opcodes whose operands may mix floating-point precisions (CheckMixedPrecisionOperands).
_MIXED_PRECISION_OK = frozenset({
    "call", "conditional", "constant", "convolution", "dot", "all-reduce", "all-reduce-start", "all-reduce-done",
    "all-gather", "all-gather-start", "all-gather-done", "async-done", "async-update", "async-start", "copy-done",
    "copy-start", "custom-call", "domain", "fusion", "get-tuple-element", "opt-barrier", "infeed", "outfeed",
    "parameter", "recv", "recv-done", "reduce-precision", "reduce-window", "send", "send-done", "sort", "tuple",
    "while", "broadcast", "reshape", "bitcast", "dynamic-reshape", "iota", "rng", "rng-bit-generator", "scan",
    "ragged-dot", "scatter", "reduce",
})


_INT64_MAX = 2**63 - 1


def verify_module(module) -> None:
    """Raise HloVerifyError on the first thing XLA's parser or HloVerifier would refuse in `module`."""
    _Verifier(module).run()


def verify_shape_sizes(module) -> None:
    """Only the size check of `verify_module` (dimensions and byte sizes that int64 holds): for
    readers that take unverified modules (`hlo-tools stats`, `cost`) and multiply sizes out."""
    verifier = _Verifier(module)
    for comp in module.computations:
        for instr in comp.instructions:
            verifier.check_shape_size(instr)


def verify_edits(module) -> None:
    """`verify_module` restricted to what was edited since `module` was parsed.

    A pipeline verifies after every pass; re-checking the untouched rest of a large module each
    time costs more than the pass. The IR marks every edit for its printer (an edited or new
    instruction loses its source span; its computation becomes dirty), and those marks bound what
    an edit can break. Checked here: the structure, send/recv/async pairing and every edited or
    new instruction of each dirty or new computation; the users of instructions whose shape was
    set (`set_shape`; an edit that keeps an instruction's shape cannot break its users) and whole
    chains of edited async ops; the roots and callers of dirty computations (their signatures and
    fusion bodies); every module-wide check (call graph, async sharing, layout-constrained
    all-reduces), and the entry layout and aliasing when the header or the entry's signature
    changed. A module built without parsing has no source spans, so all of it is checked.
    Computations not parsed yet (`parse_module(lazy_bodies=True)`) are text no pass touched: they
    are read only when their text names an edited computation or holds an op a module-wide check
    looks at (`async-start`, `all-reduce`); a fusion's operands are checked against the signature
    in its unread body's header.
    """
    _Verifier(module).run(edited_only=True)


class _Verifier:
    def __init__(self, module):
        self.module = module
        self.position = {}                  # instruction -> index in its computation
        self.comp_position = {}             # computation -> index in module.computations
        self.replica_count = _int_or(module.attrs.get("replica_count"), 1)
        self.num_partitions = _int_or(module.attrs.get("num_partitions"), 1)

    # -- errors --------------------------------------------------------------------------------------
    @staticmethod
    def fail(instr, message: str):
        raise HloVerifyError(message, line=instr.line, instruction=instr.name)

    @staticmethod
    def fail_comp(comp, message: str):
        raise HloVerifyError(message, line=comp.line)

    def check_shape(self, instr, expected: Shape, ignore_fp: bool = False):
        if not compatible(instr.shape, expected, ignore_fp_precision=ignore_fp):
            self.fail(instr, f"Expected instruction to have shape equal to {_txt(expected)}, actual shape is "
                             f"{_txt(instr.shape)}")

    def infer(self, instr, opcode=None, shapes=None, element_type=None) -> Shape:
        try:
            return infer_shape(opcode or instr.opcode, shapes if shapes is not None else
                               [o.shape for o in instr.operands], instr.attrs, instr.literal,
                               element_type=element_type)
        except ShapeInferenceError as e:
            self.fail(instr, f"{e}")
        except (A.AttrError, ValueError, IndexError, KeyError, TypeError) as e:
            self.fail(instr, f"malformed attributes: {e}")

    # -- driver ----------------------------------------------------------------------------------------
    def run(self, edited_only: bool = False):
        module = self.module
        if not module.computations:
            raise HloVerifyError("module has no computations")
        if module.entry is None or module.entry not in module.computations:
            raise HloVerifyError("module has no entry computation")
        names = set()
        for i, comp in enumerate(module.computations):
            if comp.name in names:
                self.fail_comp(comp, f"computation already exists: {comp.name}")
            names.add(comp.name)
            self.comp_position[comp] = i
        computations = _dirty_computations(module) if edited_only else module.computations
        self.walked = _computations_to_walk(module, computations) if edited_only else module.computations
        for comp in computations:
            self.check_structure(comp)
        self.check_call_graph()
        if not edited_only:
            self.check_callers_index()
        instructions = (self._edited_instructions(computations) if edited_only
                        else [instr for comp in computations for instr in comp.instructions])
        for instr in instructions:
            self.check_parsed_form(instr)
        self.check_async_sharing()
        # XLA's HloVerifier proper.
        if any(c.opcode == "fusion" for c in self.callers.get(module.entry, ())):
            raise HloVerifyError("Module entry computation cannot be a fusion computation")
        self.check_pairs(computations)
        for instr in instructions:
            self.check_instruction(instr)
        if not edited_only or _entry_interface_edited(module):
            self.check_entry_layout()
            self.check_aliasing()
        self.check_constrained_all_reduce()

    def _edited_instructions(self, dirty) -> list:
        """The instructions `verify_edits` checks one by one, in module order (see its docstring)."""
        selected = set()
        for comp in dirty:
            if comp._span is None:  # built or cloned, never parsed: all of it is new
                selected.update(comp.instructions)
            else:
                for instr in comp.instructions:
                    if instr._span is None:
                        selected.add(instr)
                        # An edit that keeps the shape (new operands, attributes) cannot break a user.
                        if instr._shape_set or _is_async_start_or_update(instr):
                            _add_users(instr, selected)
                selected.add(comp.root)
            selected.update(self.callers.get(comp, ()))
        return [instr for comp in self.walked for instr in comp.instructions if instr in selected]

    # -- 1. structure ---------------------------------------------------------------------------------
    def check_structure(self, comp):
        if not comp.instructions:
            self.fail_comp(comp, f"computation {comp.name} has no instructions")
        if comp.root is None or comp.root.parent is not comp or comp.root not in self._positions(comp):
            self.fail_comp(comp, f"computation {comp.name} has no root instruction")
        names = {}
        params = {}
        for instr in comp.instructions:
            if instr.parent is not comp:
                self.fail(instr, f"Instruction {instr.name} parent() does not point to parent computation "
                                 f"{comp.name}")
            if not isinstance(instr.name, str) or not _NAME.fullmatch(instr.name):
                self.fail(instr, f"illegal instruction name: {instr.name!r}")
            if instr.name in names:
                self.fail(instr, f"instruction '{instr.name}' already exists in computation {comp.name}")
            names[instr.name] = instr
            if instr.opcode not in _KNOWN_OPCODES and async_wrapped_opcode(instr.opcode) is None:
                self.fail(instr, f"unknown opcode: {instr.opcode}")
            if instr.opcode == "parameter":
                n = instr.parameter_number
                if not isinstance(n, int) or n < 0:
                    self.fail(instr, "parameter number must be >= 0")
                if n in params:
                    self.fail(instr, f"parameter number {n} already exists in computation {comp.name} "
                                     f"({params[n].name})")
                params[n] = instr
        for i in range(len(params)):
            if i not in params:
                self.fail_comp(comp, f"computation {comp.name} has parameters numbered up to {max(params)} but no "
                                     f"parameter {i}")
        pos = self._positions(comp)
        for instr in comp.instructions:
            here = pos[instr]
            for i, op in enumerate(instr.operands):
                if op.parent is not comp or op not in pos:
                    where = op.parent.name if op.parent is not None else "(none)"
                    self.fail(instr, f"Operand {i} ({op.name}) of instruction {instr.name} is in a different "
                                     f"computation: {where} vs {comp.name}")
                if pos[op] >= here:
                    self.fail(instr, f"operand {op.name} of {instr.name} is defined after it (HLO text must define "
                                     f"every instruction before its uses; see HloComputation.sort_topologically)")
            preds = instr.attrs.get("control-predecessors", ())
            for pred in preds if isinstance(preds, tuple) else ():
                if getattr(pred, "parent", None) is not comp or pred not in pos:
                    self.fail(instr, f"control predecessor {getattr(pred, 'name', pred)} of {instr.name} is not in "
                                     f"computation {comp.name}")
                if pos[pred] >= here:
                    self.fail(instr, f"instruction '{pred.name}' is not defined (control predecessors must be "
                                     f"defined before the instruction that names them)")
            if instr.opcode == "parameter" and instr.operands:
                self.fail(instr, f"expects 0 operands, but has {len(instr.operands)} operands")

    def _positions(self, comp):
        cached = self.position.get(comp)
        if cached is None:
            cached = {instr: i for i, instr in enumerate(comp.instructions)}
            self.position[comp] = cached
        return cached

    def check_call_graph(self):
        self.callers = {}
        for comp in self.walked:
            here = self.comp_position[comp]
            for instr in comp.instructions:
                for key, value in instr.attrs.items():
                    if key not in _COMPUTATION_KEYS:
                        continue
                    callees = value if isinstance(value, tuple) else (value,)
                    for callee in callees:
                        if callee is None or callee not in self.comp_position:
                            self.fail(instr, f"computation {getattr(callee, 'name', callee)} called by {instr.name} "
                                             f"is not in the module")
                        if callee is comp or self.comp_position[callee] > here:
                            self.fail(instr, f"computation does not exist: {callee.name} (a computation must be "
                                             f"defined before the computations that call it; reorder "
                                             f"module.computations, e.g. as module.computations_post_order())")
                        self.callers.setdefault(callee, []).append(instr)

    def check_callers_index(self):
        """The callers that the module keeps once asked (`HloModule.callers`) are those its instructions
        name (`check_call_graph` found them, walking every computation): every edit must have kept them
        current, or passes would act on stale call sites."""
        index = self.module._callers
        if index is None:
            return
        actual = {comp: set(calls) for comp, calls in self.callers.items()}
        kept = {comp: set(calls) for comp, calls in index.items() if calls}
        if kept != actual:
            wrong = next(c for c in {*kept, *actual} if kept.get(c) != actual.get(c))
            raise HloVerifyError(f"internal error: the module's callers of {wrong.name} are out of date "
                                 f"(kept {sorted(i.name for i in kept.get(wrong, ()))}, actual "
                                 f"{sorted(i.name for i in actual.get(wrong, ()))})")

    # -- 2. what XLA's parser refuses -----------------------------------------------------------------------
    def check_shape_size(self, instr):
        """XLA keeps dimensions and byte sizes in int64 (its parser and ShapeUtil::ValidateShape
        refuse larger ones): so do we, before anything multiplies them out."""
        for _, leaf in instr.shape.leaves():
            if not leaf.is_array:
                continue
            for number, size in enumerate(leaf.dims):
                if size > _INT64_MAX:
                    self.fail(instr, f"dimension {number} of shape {_txt(leaf)} is {size}, more than "
                                     f"int64 holds ({_INT64_MAX})")
            if leaf.byte_size > _INT64_MAX:
                self.fail(instr, f"shape {_txt(leaf)} takes {leaf.byte_size} bytes, more than int64 "
                                 f"holds ({_INT64_MAX})")

    def check_parsed_form(self, instr):
        opcode = instr.opcode
        attrs = instr.attrs
        wrapped = async_wrapped_opcode(opcode)
        if wrapped is not None:
            if opcode.endswith("-start"):
                base = ATTRIBUTES.get(wrapped, _spec())
                spec = (base[0] | {"async_execution_thread"}, base[1])
            else:
                spec = _spec("async_execution_thread")
        else:
            spec = ATTRIBUTES.get(opcode)
        if spec is not None:
            allowed, required = spec
            for key in attrs:
                if key not in allowed and key not in COMMON_ATTRS:
                    permitted = ", ".join(sorted(allowed | COMMON_ATTRS))
                    self.fail(instr, f'unexpected attribute "{key}". Allowed attributes: {permitted}')
            required = set(required)
            if opcode == "broadcast" and not (instr.operands and instr.operands[0].shape.rank == 0):
                required.add("dimensions")
            if opcode == "conditional":
                required = set()
            for key in sorted(required):
                if attrs.get(key) is None:
                    self.fail(instr, f"attribute {key} is expected but not seen")
        self.check_enums(instr)
        self.check_arity(instr)
        self.check_typed_values(instr)
        self.check_shape_size(instr)
        handler = _PARSE_CHECKS.get(opcode)
        if handler is not None:
            handler(self, instr)
        if wrapped is not None or opcode in _ASYNC_GENERIC:
            self.check_async_form(instr, wrapped)
        replication = attrs.get("parameter_replication")
        if replication is not None:
            text = str(replication).strip()
            count = len([p for p in text.strip("{}").split(",") if p.strip()])
            leaves = sum(1 for _ in instr.shape.leaves())
            if count != leaves:
                self.fail(instr, f"parameter has {leaves} leaf buffers, but parameter_replication has {count} "
                                 f"elements.")

    def check_enums(self, instr):
        attrs = instr.attrs
        for key, values in _ENUMS.items():
            value = attrs.get(key)
            if value is None:
                continue
            value = str(value)
            if value not in values:
                if key == "api_version":
                    self.fail(instr, f"expects custom-call API version but sees: {value}, error: Unknown API version")
                self.fail(instr, f"expects {key.replace('_', ' ')} but sees: {value}")
        if attrs.get("api_version") is not None and str(attrs["api_version"]) == "API_VERSION_UNSPECIFIED":
            self.fail(instr, "Invalid API version: API_VERSION_UNSPECIFIED")
        algorithm = attrs.get("algorithm")
        if algorithm is not None:
            value = str(algorithm)
            if instr.opcode == "rng-bit-generator" and value not in _RNG_ALGORITHMS:
                self.fail(instr, f"expects random algorithm but sees: {value}")
            if instr.opcode == "dot" and not re.fullmatch(r"[a-z0-9_]+", value):
                self.fail(instr, f"expects algorithm but sees: {value}")
        precision = attrs.get("operand_precision")
        if precision is not None:
            values = precision if isinstance(precision, tuple) else tuple(
                p.strip() for p in str(precision).strip("{}").split(",") if p.strip())
            for p in values:
                if str(p).lower() not in _PRECISIONS:
                    self.fail(instr, f"expects precision but sees: {p}")
        accuracy = attrs.get("result_accuracy")
        if accuracy is not None:
            self.check_result_accuracy(instr, str(accuracy))

    def check_result_accuracy(self, instr, text: str):
        m = re.fullmatch(r"\{\s*([A-Za-z_][\w]*)\s*=\s*(.*?)\s*\}", text, re.S)
        if not m:
            self.fail(instr, f"expects attribute name in result_accuracy, saw '{text}'")
        key, value = m.groups()
        if key == "mode":
            if value.lower() not in ("default", "highest"):
                self.fail(instr, f"expects ResultAccuracy type but sees: {value}, error: Unknown accuracy mode")
        elif key == "tolerance":
            inner = re.fullmatch(r"\{(.*)\}", value, re.S)
            if not inner:
                self.fail(instr, "expected '{' to start result accuracy list")
            for item in (p.strip() for p in inner.group(1).split(",") if p.strip()):
                name, eq, number = (s.strip() for s in item.partition("="))
                if name not in ("rtol", "atol", "ulps") or not eq:
                    self.fail(instr, f"invalid attribute name: {name}")
                try:
                    float(number)
                except ValueError:
                    self.fail(instr, f"expects a number for result_accuracy {name}, saw '{number}'")
        else:
            self.fail(instr, f"invalid attribute name: {key}")

    def check_arity(self, instr):
        opcode = instr.opcode
        n = len(instr.operands)
        expected = ARITY.get(opcode)
        if expected is not None and n != expected:
            self.fail(instr, f"expects {expected} operand{'s' if expected != 1 else ''}, but has {n} operands")
        attrs = instr.attrs
        if opcode == "dot":
            sparsity = attrs.get("sparsity")
            count = 0 if sparsity is None else len([s for s in str(sparsity).split("_") if s])
            if count > 2:
                self.fail(instr, f"too many sparse dot descriptors: {count}")
            if n != 2 + count:
                self.fail(instr, f"expects {2 + count} operands, but has {n} operands")
        elif opcode in ("reduce", "reduce-window"):
            if n == 0 or n % 2:
                self.fail(instr, f"expects an even number of operands, but has {n} operands")
        elif opcode == "scatter":
            if n % 2 == 0:
                self.fail(instr, f"expects an odd number of operands, but has {n} operands")
        elif opcode == "dynamic-slice":
            if n == 0:
                self.fail(instr, "Expected at least one operand.")
            rank = instr.operands[0].shape.rank
            if not (n == 2 and instr.operands[1].shape.rank == 1) and n != 1 + rank:
                self.fail(instr, "Wrong number of operands.")
        elif opcode == "dynamic-update-slice":
            if n < 2:
                self.fail(instr, "Expected at least two operands.")
            rank = instr.operands[0].shape.rank
            if not (n == 3 and instr.operands[2].shape.rank == 1) and n != 2 + rank:
                self.fail(instr, "Wrong number of operands.")
        elif opcode in ("sort", "concatenate", "map", "all-gather", "all-gather-start", "all-reduce",
                        "all-reduce-start", "reduce-scatter", "collective-permute", "collective-permute-start",
                        "collective-broadcast", "all-to-all"):
            if n == 0:
                self.fail(instr, f"Expected at least 1 operand for {opcode} instruction")
        elif opcode == "tuple":
            if instr.shape.is_tuple and len(instr.shape.tuple_shapes) != n:
                self.fail(instr, f"expects {len(instr.shape.tuple_shapes)} operands, but has {n} operands")
        if opcode in ("collective-permute", "collective-permute-start") and attrs.get("slice_sizes") is not None \
                and n != 4:
            self.fail(instr, "CollectivePermute and CollectivePermuteStart must have exactly four operands for "
                             "dynamic-slice and in-place update.")

    def check_typed_values(self, instr):
        attrs = instr.attrs
        for key in ("dimensions",):
            if key in attrs and instr.opcode in ("sort", "concatenate", "all-gather", "all-gather-start",
                                                 "reduce-scatter", "get-dimension-size", "set-dimension-size",
                                                 "all-to-all", "ragged-all-to-all"):
                dims = attr_ints(attrs, key)
                if dims is None or len(dims) != 1:
                    self.fail(instr, f"{instr.opcode} expects exactly one dimension in dimensions, got "
                                     f"{attrs[key]}")
        for key in ("to_apply", "calls", "condition", "body", "true_computation", "false_computation", "select",
                    "scatter"):
            value = attrs.get(key)
            if isinstance(value, tuple) and len(value) != 1:
                self.fail(instr, f"attribute {key} expects one computation")
        if instr.opcode == "custom-call" and attrs.get("to_apply") is not None and \
                attrs.get("called_computations") is not None:
            self.fail(instr, "A single instruction can't have both to_apply and calls field")
        pairs = attrs.get("source_target_pairs")
        if pairs is not None:
            for pair in pairs:
                if len(pair) != 2:
                    self.fail(instr, "expects 'source_target_pairs=' to be a list of pairs")
        domain = attrs.get("domain")
        if domain is not None and instr.opcode == "domain":
            m = re.search(r'kind\s*=\s*"([^"]*)"', str(domain))
            if not m or m.group(1) != "sharding":
                self.fail(instr, f"unsupported domain kind: {m.group(1) if m else ''}")
            if not re.search(r"\bentry\s*=", str(domain)) or not re.search(r"\bexit\s*=", str(domain)):
                self.fail(instr, "sub-attribute entry and exit are expected in domain")

    def _parse_conditional(self, instr):
        if not instr.operands:
            self.fail(instr, "conditional expects a branch index operand")
        index = instr.operands[0].shape
        if not index.is_array or index.rank != 0:
            self.fail(instr, "The first operand must be a scalar")
        attrs = instr.attrs
        if index.dtype == "pred":
            if "branch_computations" in attrs:
                self.fail(instr, 'unexpected attribute "branch_computations". Allowed attributes: '
                                 + ", ".join(sorted(COMMON_ATTRS | {"true_computation", "false_computation"})))
            for key in ("true_computation", "false_computation"):
                if attrs.get(key) is None:
                    self.fail(instr, f"attribute {key} is expected but not seen")
            branches = 2
        else:
            if index.dtype != "s32":
                self.fail(instr, "The first operand must be a scalar of PRED or S32")
            for key in ("true_computation", "false_computation"):
                if key in attrs:
                    self.fail(instr, f'unexpected attribute "{key}". Allowed attributes: '
                                     + ", ".join(sorted(COMMON_ATTRS | {"branch_computations"})))
            value = attrs.get("branch_computations")
            if value is None:
                self.fail(instr, "attribute branch_computations is expected but not seen")
            branches = len(value) if isinstance(value, tuple) else 1
        if branches == 0 or len(instr.operands) != branches + 1:
            self.fail(instr, f"conditional with {branches} branches expects {branches + 1} operands, but has "
                             f"{len(instr.operands)}")
        for key in attrs:
            if key not in COMMON_ATTRS and key not in ("true_computation", "false_computation",
                                                       "branch_computations"):
                self.fail(instr, f'unexpected attribute "{key}"')

    def _parse_infeed(self, instr):
        if not instr.shape.is_tuple or not instr.shape.tuple_shapes:
            self.fail(instr, "infeed must have a non-empty tuple shape")

    def _parse_custom_call(self, instr):
        constraints = instr.attrs.get("operand_layout_constraints")
        if constraints is None:
            return
        if isinstance(constraints, A.Raw):
            self.fail(instr, f"malformed operand_layout_constraints: {constraints}")
        if len(constraints) != len(instr.operands):
            self.fail(instr, f"Expected {len(instr.operands)} operand layout constraints, {len(constraints)} given")
        for i, (shape, operand) in enumerate(zip(constraints, instr.operands)):
            if not compatible(shape, operand.shape):
                self.fail(instr, f"Operand layout constraint shape {default_layout(shape)} for operand {i} is not "
                                 f"compatible with operand shape {default_layout(operand.shape)}")

    def _parse_send_recv_done(self, instr):
        op = instr.operands[0]
        if op.opcode in ("send", "recv", "send-done", "recv-done") or op.opcode in _CHANNEL_OPS:
            if instr.attrs.get("channel_id") != op.attrs.get("channel_id"):
                self.fail(instr, f"{instr.opcode} channel_id {instr.attrs.get('channel_id')} does not match the "
                                 f"channel_id {op.attrs.get('channel_id')} of its operand {op.name}")

    # -- async ops (parser rules) ---------------------------------------------------------------------------
    def async_chain(self, instr):
        """(start instruction, wrapped computation or None, wrapped opcode) of an async op's chain."""
        node = instr
        seen = 0
        while not _is_async_start(node):
            if not node.operands or not _is_async(node.operands[0]) or seen > 10000:
                return None, None, None
            node = node.operands[0]
            seen += 1
        wrapped = async_wrapped_opcode(node.opcode)
        comp = node.attrs.get("calls") if wrapped is None else None
        if isinstance(comp, tuple):
            comp = comp[0] if comp else None
        if wrapped is None and comp is not None and comp.root is not None:
            wrapped = comp.root.opcode
        return node, comp, wrapped

    def check_async_form(self, instr, wrapped):
        opcode = instr.opcode
        shape = instr.shape

        def async_shape(s):
            return s.is_tuple and len(s.tuple_shapes) >= 2 and s.tuple_shapes[0].is_tuple

        is_start = opcode == "async-start" or (wrapped is not None and opcode.endswith("-start"))
        is_update = opcode == "async-update" or (wrapped is not None and opcode.endswith("-update"))
        if not is_start:
            if len(instr.operands) != 1 or not async_shape(instr.operands[0].shape):
                self.fail(instr, "AsyncUpdate and AsyncDone expect a single operand in the form of "
                                 "((async-operands), async-outputs, state).")
            if not _is_async(instr.operands[0]) or _is_async_done(instr.operands[0]):
                self.fail(instr, "AsyncUpdate and AsyncDone expect a single async op as their operand.")
        if (is_start or is_update) and not async_shape(shape):
            self.fail(instr, "AsyncStart expects the op shape to be in the form of ((async-operands), "
                             "async-outputs, state)." if is_start else
                             "AsyncUpdate expects the op shape to be the same as the operand shape.")
        if is_update and not compatible(shape, instr.operands[0].shape):
            self.fail(instr, "AsyncUpdate expects the op shape to be the same as the operand shape.")
        if is_start:
            return
        start, comp, start_wrapped = self.async_chain(instr)
        if start is None:
            self.fail(instr, "AsyncUpdate and AsyncDone expect a single async op as their operand.")
        if wrapped is not None and start_wrapped != wrapped:
            self.fail(instr, f"Expect async wrapped opcode to be {start_wrapped}, but got {wrapped}")
        thread = instr.attrs.get("async_execution_thread")
        start_thread = start.attrs.get("async_execution_thread", "main")
        if thread is not None and str(thread) != str(start_thread):
            self.fail(instr, f"Expect async_execution_thread to be {start_thread}, but got {thread}")
        calls = instr.attrs.get("calls")
        if isinstance(calls, tuple):
            calls = calls[0] if calls else None
        if calls is not None and calls is not comp:
            expected = comp.name if comp is not None else "(none)"
            self.fail(instr, f"Expect async_wrapped_computation to be {expected}, but got {calls.name}")

    def check_async_sharing(self):
        owner = {}
        for comp in self.walked:
            for instr in comp.instructions:
                if instr.opcode != "async-start":
                    continue
                callee = instr.attrs.get("calls")
                if isinstance(callee, tuple):
                    callee = callee[0] if callee else None
                if callee is None:
                    continue
                if callee in owner:
                    self.fail(instr, f"Computation {callee.name} is called by more than one async op.")
                owner[callee] = instr
        self.async_owner = owner

    # -- 3. XLA's HloVerifier ------------------------------------------------------------------------------
    def check_instruction(self, instr):
        shape = instr.shape
        for leaf_index, leaf in shape.leaves():
            if leaf.is_array and leaf.dynamic is not None and UNBOUNDED in leaf.dims:
                self.fail(instr, f"Unbounded dynamism is disabled for instruction: {instr.name}")
            if leaf.is_array and leaf.layout is not None and leaf.layout.minor_to_major \
                    and len(leaf.layout.minor_to_major) != leaf.rank:
                self.fail(instr, "Instruction has mismatched minor-to-major size and dimension size")
        opcode = instr.opcode
        sharding = instr.attrs.get("sharding")
        if isinstance(sharding, A.Sharding):
            self.check_sharding(instr, sharding)
        if opcode not in _MIXED_PRECISION_OK and async_wrapped_opcode(opcode) is None:
            self.check_mixed_precision(instr)
        for callee in instr.called_computations:
            if opcode in _ASYNC_GENERIC:
                continue
            if _thread(callee) != _thread(instr.parent):
                self.fail(instr, f"callable instruction {instr.name} expects parent computation thread name same "
                                 f"as called computation's thread name ({_thread(instr.parent)} vs "
                                 f"{_thread(callee)}).")
        handler = _SHAPE_CHECKS.get(opcode)
        if handler is None:
            if async_wrapped_opcode(opcode) is not None:
                handler = _Verifier.verify_async
            else:
                handler = _Verifier.verify_inferred
        handler(self, instr)

    def check_sharding(self, instr, sharding):
        """HloSharding::Validate: tile ranks, tuple arity, device ids (a non-tuple sharding on a tuple shape
        applies to every leaf, as XLA's parser normalizes it)."""
        shape = instr.shape
        if sharding.kind == "tuple":
            if not shape.is_tuple:
                self.fail(instr, f"Invalid sharding for instruction: {instr.name}: Sharding is tuple-shaped but "
                                 f"validation shape is not.")
            leaves = [leaf for _, leaf in shape.leaves()]
            if sharding.elements and len(sharding.elements) != len(leaves):
                self.fail(instr, f"Invalid sharding for instruction: {instr.name}: the tuple sharding has "
                                 f"{len(sharding.elements)} elements, the shape has {len(leaves)} leaves")
            for element, leaf in zip(sharding.elements, leaves):
                self.check_single_sharding(instr, element, leaf)
            return
        for _, leaf in shape.leaves():
            self.check_single_sharding(instr, sharding, leaf)

    def check_single_sharding(self, instr, sharding, shape):
        limit = self.num_partitions if self.num_partitions > 1 else None
        if sharding.kind == "maximal":
            if limit is not None and not 0 <= (sharding.device or 0) < limit:
                self.fail(instr, f"Invalid sharding for instruction: {instr.name}: device {sharding.device} is out "
                                 f"of range [0, {limit})")
            return
        if sharding.kind != "tiled" or not shape.is_array:
            return
        subgroups = len(sharding.last_tile_dims) + (1 if sharding.last_tile_dim_replicate else 0)
        if len(sharding.tile_dims) - subgroups != shape.rank:
            self.fail(instr, f"Invalid sharding for instruction: {instr.name}: Number of tile assignment dimensions "
                             f"(excluding subgroups) is different than the input rank. sharding={sharding}, "
                             f"input_shape={_txt(shape)}")
        devices = sharding.device_list()
        if len(set(devices)) != len(devices):
            self.fail(instr, f"Invalid sharding for instruction: {instr.name}: a device appears more than once in "
                             f"{sharding}")
        if limit is not None and any(not 0 <= d < limit for d in devices):
            self.fail(instr, f"Invalid sharding for instruction: {instr.name}: device ids of {sharding} must be in "
                             f"[0, {limit})")

    def check_mixed_precision(self, instr):
        fp = None
        for op in instr.operands:
            for _, leaf in op.shape.leaves():
                if leaf.dtype in FLOAT_DTYPES:
                    if fp is None:
                        fp = leaf.dtype
                    elif fp != leaf.dtype:
                        self.fail(instr, f"Seen floating point types of different precisions in {instr.name}, but "
                                         f"mixed precision is disallowed.")

    def verify_inferred(self, instr):
        self.check_shape(instr, self.infer(instr))

    def verify_elementwise(self, instr):
        opcode = instr.opcode
        element_type = instr.shape.dtype if opcode in ("convert", "stochastic-convert") else None
        expected = self.infer(instr, element_type=element_type)
        self.check_shape(instr, expected)
        if opcode == "compare" and instr.attrs.get("type") is not None:
            dtype = instr.operands[1].shape.dtype
            kind = str(instr.attrs["type"])
            if dtype in FLOAT_DTYPES:
                if kind not in ("FLOAT", "TOTALORDER"):
                    self.fail(instr, f"Expected comparison type FLOAT or TOTALORDER.\nactual: {kind}\noperand: "
                                     f"{_txt(instr.operands[1].shape)}")
            else:
                default = ("SIGNED" if dtype[0] == "s" else "FLOAT" if dtype[0] == "c" else "UNSIGNED")
                if kind != default:
                    self.fail(instr, f"Expected comparison type {default}.\nactual: {kind}\noperand: "
                                     f"{_txt(instr.operands[1].shape)}")

    def verify_bitcast_convert(self, instr):
        self.check_shape(instr, self.infer(instr, element_type=instr.shape.dtype))

    def verify_dot_like(self, instr):
        expected = self.infer(instr, element_type=instr.shape.dtype if instr.shape.is_array else None)
        precision = instr.attrs.get("operand_precision")
        if precision is not None:
            nibbles = sum(1 for p in precision if str(p).lower() == "packed_nibble")
            if nibbles == 1:
                self.fail(instr, f"{instr.opcode.capitalize()} cannot have a single packed nibble argument")
            if nibbles == 2:
                for side, op in zip(("LHS", "RHS"), instr.operands[:2]):
                    if op.shape.dtype not in ("s8", "u8"):
                        self.fail(instr, f"Packed nibble precision can only apply to 8 bit integers. {side} is "
                                         f"{op.name}.")
        self.check_shape(instr, expected)

    def verify_broadcast(self, instr):
        operand = instr.operands[0].shape
        shape = instr.shape
        dims = attr_ints(instr.attrs, "dimensions")
        if dims is None:
            dims = ()
        if not shape.is_array or not operand.is_array or shape.dtype != operand.dtype:
            self.fail(instr, f"broadcast changes the element type: {_txt(operand)} to {_txt(shape)}")
        if len(dims) != operand.rank:
            self.fail(instr, f"Broadcast HLO ({instr.name}) has invalid number of dimensions: {len(dims)} != "
                             f"{operand.rank}")
        for i, d in enumerate(dims):
            if not (0 <= d < shape.rank and shape.dims[d] == operand.dims[i]):
                self.fail(instr, f"broadcast dimension {i} maps operand dimension of size {operand.dims[i]} to output "
                                 f"dimension {d} of {_txt(shape)}")

    def verify_reshape(self, instr):
        operand = instr.operands[0].shape
        shape = instr.shape
        if not shape.is_array or not operand.is_array or shape.dtype != operand.dtype:
            self.fail(instr, f"{instr.opcode} changes the element type: {_txt(operand)} to {_txt(shape)}")
        if shape.element_count != operand.element_count:
            self.fail(instr, f"{instr.opcode} has mismatched element counts: from={operand.element_count} "
                             f"({_txt(operand)}) to={shape.element_count} ({_txt(shape)})")
        if instr.opcode == "dynamic-reshape":
            if shape.rank + 1 != len(instr.operands):
                self.fail(instr, f"dynamic-reshape to rank {shape.rank} needs {shape.rank + 1} operands")
            for op in instr.operands[1:]:
                if op.shape.dtype != "s32":
                    self.fail(instr, f"dynamic-reshape sizes must be s32, got {_txt(op.shape)}")

    def verify_nothing(self, instr):
        pass

    def verify_iota(self, instr):
        shape = instr.shape
        if not shape.is_array:
            self.fail(instr, "Iota does not support non-array result.")
        if shape.rank == 0:
            self.fail(instr, "Iota does not support scalars.")
        dim = attr_int(instr.attrs, "iota_dimension")
        if dim is None or not 0 <= dim < shape.rank:
            self.fail(instr, "The iota dimension cannot go beyond the operation rank or be negative.")
        if shape.dtype == "pred":
            self.fail(instr, f"Only support iota of integral, floating point or complex primitive types, got "
                             f"{shape.dtype}")

    def verify_constant(self, instr):
        literal = instr.literal
        if literal is None:
            self.fail(instr, "Constant is required to have a valid literal")
        if getattr(literal, "shape", None) is not None and not compatible(literal.shape, instr.shape):
            self.fail(instr, f"constant literal of shape {_txt(literal.shape)} does not match {_txt(instr.shape)}")

    def verify_rng(self, instr):
        a, b = (op.shape for op in instr.operands)
        if not (a.is_array and a.rank == 0 and b.is_array and b.rank == 0):
            self.fail(instr, "Expected scalar types for the two operands of Rng instruction")
        if a.dtype != b.dtype or a.dtype != instr.shape.dtype:
            self.fail(instr, "Expected compatible element types for the result and the two operands of Rng "
                             "instruction")
        dist = str(instr.attrs.get("distribution"))
        if dist == "rng_uniform" and a.dtype not in FLOAT_DTYPES and a.dtype not in INTEGRAL_DTYPES \
                and a.dtype != "pred":
            self.fail(instr, "Element type not supported. Expected element to be of floating point type, integral "
                             "type or predicate type for RngUniform")
        if dist == "rng_normal" and a.dtype not in FLOAT_DTYPES:
            self.fail(instr, "Element type not supported. Expected element to be FloatingPointType for RngNormal")

    def verify_rng_bit_generator(self, instr):
        shape = instr.shape
        if not shape.is_tuple:
            return
        if len(shape.tuple_shapes) != 2:
            self.fail(instr, f"Expected tuple shape with 2 elements for RngBitGenerator. Got: {_txt(shape)}")
        if not compatible(instr.operands[0].shape, shape.tuple_shapes[0]):
            self.fail(instr, f"Expected state shape to match between input and output for RngBitGenerator. Got "
                             f"{_txt(instr.operands[0].shape)} vs. {_txt(shape.tuple_shapes[0])}")

    def verify_rng_state(self, instr):
        if not compatible(instr.shape, Shape("u64", (2,))):
            self.fail(instr, f"Invalid RngGetAndUpdateState, expect result to have shape u64[2], got "
                             f"{_txt(instr.shape)}")

    def check_token_operand(self, instr, i):
        if not instr.operands[i].shape.is_token:
            self.fail(instr, f"Expected operand {i} to be token-shaped, actual shape is "
                             f"{_txt(instr.operands[i].shape)}")

    def verify_infeed(self, instr):
        self.check_token_operand(instr, 0)
        shape = instr.shape
        if not (shape.is_tuple and len(shape.tuple_shapes) == 2 and shape.tuple_shapes[1].is_token):
            self.fail(instr, f"Expected instruction to have shape equal to (<data>, token[]), actual shape is "
                             f"{_txt(shape)}")

    def verify_outfeed(self, instr):
        self.check_token_operand(instr, 1)
        outfeed_shape = instr.attrs.get("outfeed_shape")
        if isinstance(outfeed_shape, Shape) and not compatible(outfeed_shape, instr.operands[0].shape):
            self.fail(instr, f"Expected outfeed shape to be equal to operand's shape {_txt(instr.operands[0].shape)}, "
                             f"actual shape is {_txt(outfeed_shape)}")
        self.check_shape(instr, Shape.token())

    def verify_recv(self, instr):
        shape = instr.shape
        if not shape.is_tuple or not shape.tuple_shapes:
            self.fail(instr, f"recv must have a tuple shape, got {_txt(shape)}")
        self.check_shape(instr, Shape.tuple([shape.tuple_shapes[0], Shape("u32"), Shape.token()]))

    def verify_custom_call(self, instr):
        constraints = instr.attrs.get("operand_layout_constraints")
        if isinstance(constraints, tuple):
            if len(constraints) != len(instr.operands):
                self.fail(instr, f"Expected {len(instr.operands)} operand layout constraints, {len(constraints)} "
                                 f"given")
            for op, c in zip(instr.operands, constraints):
                if not compatible(op.shape, c):
                    self.fail(instr, f"operand {op.name} does not match its layout constraint {_txt(c)}")
        self.check_output_operand_aliasing(instr)

    def check_output_operand_aliasing(self, instr):
        raw = instr.attrs.get("output_to_operand_aliasing")
        if raw is None:
            return
        try:
            entries = A.parse_output_to_operand_aliasing(str(raw))
        except ValueError as e:
            self.fail(instr, f"malformed output_to_operand_aliasing: {e}")
        operands = instr.operands
        for out_index, operand_no, operand_index in entries:
            if not 0 <= operand_no < len(operands):
                self.fail(instr, "Invalid aliasing operand index.")
            operand_sub = _subshape(operands[operand_no].shape, operand_index)
            if operand_sub is None:
                self.fail(instr, "Invalid aliasing operand shape index.")
            output_sub = _subshape(instr.shape, out_index)
            if output_sub is None:
                self.fail(instr, "Invalid aliasing output shape index.")
            if not compatible(output_sub, operand_sub):
                self.fail(instr, f"Different aliasing shapes: {_txt(operand_sub)} vs {_txt(output_sub)}")

    # -- collectives ---------------------------------------------------------------------------------------
    def group_mode(self, instr, with_global_ids: bool):
        has_channel = instr.attrs.get("channel_id") is not None
        if not with_global_ids:
            return "cross_partition" if has_channel else "cross_replica"
        use_global = attr_bool(instr.attrs, "use_global_device_ids")
        if not has_channel:
            if use_global:
                self.fail(instr, "Invalid combination of has_channel_id and use_global_device_ids")
            return "cross_replica"
        return "flattened_id" if use_global else "cross_replica_and_partition"

    def replica_groups(self, instr):
        groups = instr.attrs.get("replica_groups")
        if groups is None:
            return []
        if isinstance(groups, A.Raw):
            self.fail(instr, f"malformed replica_groups: {groups}")
        return groups.groups

    def check_replica_groups(self, instr, mode: str, uniform: bool = True):
        groups = self.replica_groups(instr)
        if not groups:
            if mode == "flattened_id":
                self.fail(instr, "Replica groups must be specified in flattened-id mode")
            return groups
        seen = set()
        for g in groups:
            if not g:
                self.fail(instr, "Instruction cannot have an empty replica group")
            for r in g:
                if r in seen:
                    self.fail(instr, f"Replica {r} is repeated in instruction's replica-groups")
                seen.add(r)
        n = len(seen)
        for r in range(n):
            if r not in seen:
                self.fail(instr, f"Replica {r} is not named in instruction's replica-groups")
        if mode in ("cross_replica", "cross_replica_and_partition"):
            if self.replica_count != 1 and n != self.replica_count:
                self.fail(instr, f"In {_MODE_NAMES[mode]} mode, replica groups should contain {self.replica_count} "
                                 f"replicas, but found {n}")
        elif mode == "cross_partition":
            if self.num_partitions != 1 and n != self.num_partitions:
                self.fail(instr, f"In {_MODE_NAMES[mode]} mode, replica groups should contain "
                                 f"{self.num_partitions} partitions, but found {n}")
        else:
            total = self.replica_count * self.num_partitions
            if total != 1 and n != total:
                self.fail(instr, f"In {_MODE_NAMES[mode]} mode, replica groups should contain {total} flattened "
                                 f"IDs, but found {n}")
        if uniform and any(len(g) != len(groups[0]) for g in groups):
            self.fail(instr, "Replica groups expected to be of uniform size")
        return groups

    def subgroup_size(self, groups, mode: str) -> int:
        if mode in ("cross_replica", "cross_replica_and_partition"):
            size = len(groups[0]) if groups else self.replica_count
            return size * self.num_partitions if mode == "cross_replica_and_partition" else size
        if mode == "flattened_id":
            return len(groups[0])
        return len(groups[0]) if groups else self.num_partitions

    def check_collective_dimension(self, instr, shapes_in, shapes_out, gather: bool) -> int:
        dims = attr_ints(instr.attrs, "dimensions") or ()
        if len(dims) != 1 or dims[0] < 0:
            self.fail(instr, f"{instr.opcode} needs one non-negative dimension")
        dim = dims[0]
        if len(shapes_out) != len(shapes_in):
            self.fail(instr, f"{instr.opcode} has {len(shapes_in)} operands but {len(shapes_out)} results")
        for s_in, s_out in zip(shapes_in, shapes_out):
            if not s_in.is_array or not s_out.is_array or dim >= s_in.rank or dim >= s_out.rank:
                self.fail(instr, f"{instr.opcode} dimension {dim} is out of bounds for {_txt(s_in)} -> {_txt(s_out)}")
        a, b = (shapes_out[0].dims[dim], shapes_in[0].dims[dim]) if gather else \
            (shapes_in[0].dims[dim], shapes_out[0].dims[dim])
        if b == 0:
            self.fail(instr, f"{instr.opcode} cannot compute a shard count from a zero-sized dimension")
        return -(-a // b)

    def verify_all_gather(self, instr):
        mode = self.group_mode(instr, True)
        groups = self.check_replica_groups(instr, mode)
        shapes_in = [op.shape for op in instr.operands]
        shape = instr.shape
        if instr.opcode == "all-gather-start":
            if not shape.is_tuple or len(shape.tuple_shapes) < 2:
                self.fail(instr, f"all-gather-start must have a (input, output) tuple shape, got {_txt(shape)}")
            out = shape.tuple_shapes[1]
        else:
            out = shape
        shapes_out = [out] if len(shapes_in) == 1 else list(out.tuple_shapes or ())
        shard_count = self.check_collective_dimension(instr, shapes_in, shapes_out, gather=True)
        size = self.subgroup_size(groups, mode)
        if size != 1 and shard_count != size:
            self.fail(instr, f"shard_count = {shard_count}, subgroup_size = {size}")
        gathered = []
        dim = attr_ints(instr.attrs, "dimensions")[0]
        for s in shapes_in:
            dims = list(s.dims)
            dims[dim] *= shard_count
            gathered.append(Shape(s.dtype, dims, s.dynamic))
        result = gathered[0] if len(gathered) == 1 else Shape.tuple(gathered)
        if instr.opcode == "all-gather-start":
            inputs = shapes_in[0] if len(shapes_in) == 1 else Shape.tuple(shapes_in)
            result = Shape.tuple([inputs, result])
        self.check_shape(instr, result)

    def verify_reduce_scatter(self, instr):
        mode = self.group_mode(instr, True)
        groups = self.check_replica_groups(instr, mode)
        shapes_in = [op.shape for op in instr.operands]
        shapes_out = [instr.shape] if len(shapes_in) == 1 else list(instr.shape.tuple_shapes or ())
        shard_count = self.check_collective_dimension(instr, shapes_in, shapes_out, gather=False)
        size = self.subgroup_size(groups, mode)
        if size != 1 and shard_count != size:
            self.fail(instr, f"shard_count = {shard_count}, subgroup_size = {size}")
        dim = attr_ints(instr.attrs, "dimensions")[0]
        outs = []
        for s in shapes_in:
            if s.dims[dim] % shard_count:
                self.fail(instr, f"ReduceScatter operand scatter dimension size {s.dims[dim]} must be dividable by "
                                 f"shard_count {shard_count}.")
            dims = list(s.dims)
            dims[dim] //= shard_count
            outs.append(Shape(s.dtype, dims, s.dynamic))
        self.check_reducer(instr)
        self.check_shape(instr, outs[0] if len(outs) == 1 else Shape.tuple(outs))

    def check_reducer(self, instr):
        comp = instr.attrs.get("to_apply")
        if comp is None or isinstance(comp, tuple):
            return
        params, result = program_shape(comp)
        if len(params) != 2 or not all(p.is_array and p.rank == 0 for p in params) or not result.is_array \
                or result.rank != 0:
            self.fail(instr, f"the reduction computation {comp.name} of {instr.opcode} must take two scalars and "
                             f"return a scalar, but is ({', '.join(_txt(p) for p in params)}) -> {_txt(result)}")

    def verify_all_reduce(self, instr):
        mode = self.group_mode(instr, True)
        self.check_replica_groups(instr, mode, uniform=False)
        channel = instr.attrs.get("channel_id")
        if channel is not None and attr_int(instr.attrs, "channel_id") <= 0:
            self.fail(instr, f"All reduce channel id must be greater than 0 for {instr.name}")
        self.check_reducer(instr)
        self.verify_inferred(instr)

    def verify_all_to_all(self, instr):
        mode = self.group_mode(instr, False)
        groups = self.check_replica_groups(instr, mode)
        count = self.subgroup_size(groups, mode)
        dims = attr_ints(instr.attrs, "dimensions")
        shapes = [op.shape for op in instr.operands]
        if dims:
            if len(shapes) != 1:
                self.fail(instr, "all-to-all with a split dimension expects exactly one operand")
            s = shapes[0]
            if not s.is_array or not 0 <= dims[0] < s.rank:
                self.fail(instr, f"AllToAll split_dimension {dims[0]} is out-of-bounds in shape {_txt(s)}.")
            if count and s.dims[dims[0]] % count:
                self.fail(instr, f"AllToAll split dimension size {s.dims[dims[0]]} must be dividable by split_count "
                                 f"{count}.")
            self.check_shape(instr, s)
        else:
            if len(shapes) != count:
                self.fail(instr, f"all-to-all without a split dimension expects {count} operands (its group size), "
                                 f"has {len(shapes)}")
            self.verify_inferred(instr)

    def verify_collective_permute(self, instr):
        mode = self.group_mode(instr, False)
        limit = self.replica_count if mode == "cross_replica" else self.num_partitions
        ops = instr.operands
        inplace = instr.attrs.get("slice_sizes") is not None
        allowed = 1
        if inplace:
            self.check_inplace_permute(instr)
            offsets = ops[2].shape
            allowed = len(offsets.tuple_shapes) if ops[0].shape.is_array else \
                len(offsets.tuple_shapes[0].tuple_shapes)
        sources, targets = {}, {}
        for source, target in instr.attrs.get("source_target_pairs") or ():
            for value, what in ((source, "Source"), (target, "Target")):
                if value < 0:
                    self.fail(instr, f"{what} {value} in the instruction's source-target pair must be >= 0")
                if limit != 1 and value >= limit:
                    self.fail(instr, f"{what} {value} in the instruction's source-target pair must be < {limit}")
            for value, seen, what in ((source, sources, "Source"), (target, targets, "Target")):
                seen[value] = seen.get(value, 0) + 1
                if seen[value] > allowed:
                    times = "once" if allowed == 1 else f"{allowed} times"
                    self.fail(instr, f"{what} {value} appears more than {times} in instruction's source-target pairs")
        shapes = [op.shape for op in ops]
        if instr.opcode == "collective-permute":
            if inplace:
                expected = shapes[1]
            else:
                for s in shapes:
                    if not s.is_array:
                        self.fail(instr, f"Expected array argument for operand of collective-permute, but got "
                                         f"{_txt(s)}.")
                expected = shapes[0] if len(shapes) == 1 else Shape.tuple(shapes)
        else:
            shape = instr.shape
            if not shape.is_tuple or len(shape.tuple_shapes) < 2:
                self.fail(instr, f"collective-permute-start must have a tuple shape, got {_txt(shape)}")
            context = list(shape.tuple_shapes[2:])
            if inplace:
                expected = Shape.tuple([shapes[0], shapes[1]] + context)
            elif len(shapes) == 1:
                expected = Shape.tuple([shapes[0], shapes[0]] + context)
            else:
                expected = Shape.tuple([Shape.tuple(shapes), Shape.tuple(shapes)] + context)
        self.check_shape(instr, expected)

    def check_inplace_permute(self, instr):
        if len(instr.operands) != 4:
            self.fail(instr, f"Unexpected number of operands: {len(instr.operands)}.")
        in_buf, out_buf, in_off, out_off = (op.shape for op in instr.operands)

        def check_offset(buf, off):
            if not off.is_tuple:
                self.fail(instr, "Buffer offset is not tuple.")
            elements = off.tuple_shapes
            all_array = all(s.is_array for s in elements)
            all_tuple = all(s.is_tuple for s in elements)
            if not all_array and not all_tuple:
                self.fail(instr, "Buffer offset should either be a tuple of arrays or  a tuple of tuples.")
            if all_tuple and elements:
                if any(len(s.tuple_shapes) != buf.rank for s in elements):
                    self.fail(instr, "Buffer offset index should have the same number of elements as the buffer's "
                                     "rank.")
            elif len(elements) != buf.rank:
                self.fail(instr, "Buffer offset index should have the same number of elements as the buffer's rank.")

        if in_buf.is_array and out_buf.is_array:
            check_offset(in_buf, in_off)
            check_offset(out_buf, out_off)
        elif in_buf.is_tuple and out_buf.is_tuple:
            if len(in_buf.tuple_shapes) != len(out_buf.tuple_shapes):
                self.fail(instr, "Unmatching input buffers and output buffers.")
            for buf, off, what in ((in_buf, in_off, "input"), (out_buf, out_off, "output")):
                if not off.is_tuple or len(off.tuple_shapes) != len(buf.tuple_shapes):
                    self.fail(instr, f"Unmatching {what} buffers and {what} offset.")
                for b, o in zip(buf.tuple_shapes, off.tuple_shapes):
                    check_offset(b, o)
        else:
            self.fail(instr, "Unmatching input buffers and output buffers.")

    def verify_collective_broadcast(self, instr):
        mode = self.group_mode(instr, False)
        self.check_replica_groups(instr, mode)
        self.verify_inferred(instr)

    def verify_ragged_all_to_all(self, instr):
        mode = self.group_mode(instr, False)
        self.check_replica_groups(instr, mode)
        self.check_shape(instr, instr.operands[1].shape)

    # -- calls and control flow ----------------------------------------------------------------------------
    def check_params(self, instr, comp, expected: int):
        if comp.num_parameters != expected:
            self.fail(instr, f"Expected computation {comp.name} called from {instr.name} to have {expected} "
                             f"parameters, has {comp.num_parameters}")

    def check_operand_param(self, instr, operand_no: int, comp, param_no: int):
        operand = instr.operands[operand_no]
        param = comp.parameter(param_no)
        if not compatible(operand.shape, param.shape):
            self.fail(instr, f"Operand {operand.name} shape {_txt(operand.shape)} does not match parameter's "
                             f"{param.name} {_txt(param.shape)} in {comp.name}")

    def verify_while(self, instr):
        body, cond = _single(instr.attrs.get("body")), _single(instr.attrs.get("condition"))
        self.check_params(instr, body, 1)
        self.check_params(instr, cond, 1)
        self.check_operand_param(instr, 0, body, 0)
        self.check_operand_param(instr, 0, cond, 0)
        if not compatible(cond.root.shape, Shape("pred")):
            self.fail(instr, f"Conditional computation shape does not lead to a scalar predicate shape: "
                             f"{_txt(cond.root.shape)}")
        self.check_shape(instr, body.root.shape)
        self.check_consistent_sharding(instr, [instr, body.root, body.parameter(0), cond.parameter(0)])

    def verify_conditional(self, instr):
        index = instr.operands[0].shape
        if not index.is_array or index.rank != 0:
            self.fail(instr, f"The first operand of conditional must be a scalar. Got {_txt(index)}")
        attrs = instr.attrs
        if index.dtype == "pred":
            branches = [_single(attrs.get("true_computation")), _single(attrs.get("false_computation"))]
        else:
            if index.dtype != "s32":
                self.fail(instr, f"The first operand of indexed conditional must be a scalar of S32. Got type "
                                 f"{index.dtype}.")
            value = attrs.get("branch_computations")
            branches = list(value) if isinstance(value, tuple) else [value]
            if not branches:
                self.fail(instr, "an indexed conditional needs at least one branch")
        if len(instr.operands) != len(branches) + 1:
            self.fail(instr, f"Expected {len(branches) + 1} operands for conditional instruction")
        for j, comp in enumerate(branches):
            self.check_params(instr, comp, 1)
            self.check_operand_param(instr, j + 1, comp, 0)
            self.check_shape(instr, comp.root.shape)
        self.check_consistent_sharding(instr, [instr] + [b.root for b in branches])

    def check_consistent_sharding(self, owner, instrs):
        common = None
        for instr in instrs:
            sharding = instr.attrs.get("sharding")
            if sharding is None:
                continue
            if common is None:
                common = (instr, sharding)
            elif _sharding_key(sharding) != _sharding_key(common[1]):
                self.fail(owner, f"Inconsistent {owner.opcode} sharding among instructions: {common[0].name} has "
                                 f"{common[1]}, {instr.name} has {sharding}")

    def verify_call(self, instr):
        comp = _single(instr.attrs.get("to_apply"))
        self.check_params(instr, comp, len(instr.operands))
        for i in range(comp.num_parameters):
            self.check_operand_param(instr, i, comp, i)
        if attr_bool(instr.attrs, "is_composite"):
            fa = instr.attrs.get("frontend_attributes")
            if fa is None:
                self.fail(instr, "A composite call op must have frontend attributes")
            items = dict(fa.items) if hasattr(fa, "items") else {}
            if not items.get("composite.name"):
                self.fail(instr, "A composite call op must have frontend attributes with key composite.name whose "
                                 "value is non-empty")
            if "composite.attributes" in items and not items["composite.attributes"]:
                self.fail(instr, "A composite call op must have frontend attributes with key composite.attributes "
                                 "whose value is default: {} or non-empty")
            version = items.get("composite.version")
            if version is not None and not re.fullmatch(r"\d+", str(version)):
                self.fail(instr, f"A composite call op must have frontend attributes with a composite.version whose "
                                 f"value is a non-negative integer but got: {version}")
        self.check_shape(instr, comp.root.shape)

    def verify_fusion(self, instr):
        comp = _single(instr.attrs.get("calls"))
        callers = self.callers.get(comp, [])
        if len(callers) != 1:
            self.fail(instr, f"fused computation {comp.name} is called by {len(callers)} instructions; a fusion "
                             f"computation belongs to exactly one fusion instruction")
        # A body not parsed yet is unedited text: its header's signature stands for it.
        declared = comp.unparsed_program_shape
        if declared is not None:
            param_shapes, result = declared
        else:
            param_shapes = {p.parameter_number: p.shape for p in comp.parameters}
            param_shapes = [param_shapes[n] for n in sorted(param_shapes)]
            result = comp.root.shape
        if not compatible(instr.shape, result):
            self.fail(instr, f"Fused computation shape ({_txt(result)}) is not equal to the fusion shape "
                             f"({_txt(instr.shape)})")
        if len(param_shapes) > len(instr.operands):
            self.fail(instr, f"Fused parameter count ({len(param_shapes)}) is greater than the number of operands "
                             f"({len(instr.operands)}) passed to the fusion instruction in: {instr.name}.")
        for number, shape in enumerate(param_shapes):
            if not compatible(shape, instr.operands[number].shape):
                self.fail(instr, f"Shape mismatch between parameter number {number} and its operand in "
                                 f"{instr.name}.")
        if declared is not None:
            self.check_output_operand_aliasing(instr)
            return
        root = comp.root
        if root.users:
            self.fail(instr, f"Root of {instr.name} may not have users.")
        for fused in comp.instructions:
            if fused is not root and not fused.users:
                self.fail(instr, f"Non-root instruction {fused.name} in {instr.name} must have users.")
        self.check_output_operand_aliasing(instr)

    def verify_map(self, instr):
        self.verify_inferred(instr)
        self.check_to_apply_element_types(instr)

    def check_to_apply_element_types(self, instr):
        comp = _single(instr.attrs.get("to_apply"))
        params, _ = program_shape(comp)
        for i in range(min(len(params), len(instr.operands))):
            if params[i].dtype != instr.operands[i].shape.dtype:
                self.fail(instr, f"Shape mismatch between to_apply computation parameter and operand {i} in "
                                 f"{instr.name}.")

    def verify_reduce(self, instr):
        self.verify_inferred(instr)
        self.check_to_apply_element_types(instr)

    def verify_sort(self, instr):
        comp = _single(instr.attrs.get("to_apply"))
        if not compatible(comp.root.shape, Shape("pred")):
            self.fail(instr, f"The Sort compare computation shape does not lead to a scalar predicate shape: "
                             f"{_txt(comp.root.shape)}")
        self.check_params(instr, comp, 2 * len(instr.operands))
        for j, p in enumerate(comp.parameters):
            expected = Shape(instr.operands[j // 2].shape.dtype)
            if not compatible(expected, p.shape, ignore_fp_precision=True):
                self.fail(instr, f"Expected the {j}-th parameter of the compare computation of sort to have shape "
                                 f"{_txt(expected)}, but got {_txt(p.shape)}")
        for i, op in enumerate(instr.operands[1:], 1):
            if op.shape.dims != instr.operands[0].shape.dims:
                self.fail(instr, f"Expected sort to have to have the same dimensions for all operands. First operand "
                                 f"shape is: {_txt(instr.operands[0].shape)}\n, shape (operand index {i}) is: "
                                 f"{_txt(op.shape)}")
        dims = attr_ints(instr.attrs, "dimensions") or (0,)
        if not 0 <= dims[0] < instr.operands[0].shape.rank:
            self.fail(instr, f"Expected the sort_dimension {dims[0]} of sort to be smaller than the rank "
                             f"{instr.operands[0].shape.rank} of the operand(s).")
        self.verify_inferred(instr)

    def verify_get_tuple_element(self, instr):
        operand = instr.operands[0].shape
        if not operand.is_tuple:
            self.fail(instr, f"get-tuple-element operand {instr.operands[0].name} is not a tuple: "
                             f"{_txt(operand)}")
        index = instr.attrs.get("index")
        if len(instr.operands) == 1 and type(index) is int and 0 <= index < len(operand.tuple_shapes):
            # What inference gives (the check ignores layouts) without laying out every element of a
            # wide tuple again for each of its users.
            self.check_shape(instr, operand.tuple_shapes[index])
        else:
            self.verify_inferred(instr)

    def verify_scan(self, instr):
        comp = _single(instr.attrs.get("to_apply"))
        if comp is None:
            self.fail(instr, "scan needs a to_apply computation")
        carries = attr_int(instr.attrs, "num_carries", 0) or 0
        inputs = instr.operands[:len(instr.operands) - carries]
        if carries < 0 or carries > len(instr.operands):
            self.fail(instr, f"scan has {len(instr.operands)} operands but num_carries={carries}")
        dims = attr_ints(instr.attrs, "dimensions") or ()
        if len(dims) != 1:
            self.fail(instr, "scan expects exactly one dimension in dimensions")
        for op in inputs:
            if not op.shape.is_array or not 0 <= dims[0] < op.shape.rank:
                self.fail(instr, f"scan dimension {dims[0]} of operand {op.name} is out of bounds for "
                                 f"{_txt(op.shape)}")

    # -- async ---------------------------------------------------------------------------------------------
    def verify_async(self, instr):
        opcode = instr.opcode
        wrapped = async_wrapped_opcode(opcode)
        start, comp, start_wrapped = self.async_chain(instr)
        if start is None:
            self.fail(instr, f"{opcode} expects operand to be async-update or async-start")
        thread = str(start.attrs.get("async_execution_thread", "main"))
        shape = instr.shape if _is_async_start(instr) or opcode.endswith("-update") or opcode == "async-update" \
            else instr.operands[0].shape
        if not shape.is_tuple or len(shape.tuple_shapes) < 2:
            self.fail(instr, f"The {opcode} expects the async shape to be a tuple of at least two elements, found "
                             f"{_txt(shape)}.")
        if comp is not None:
            if thread != _thread(comp):
                self.fail(instr, f"{opcode} expects same async thread name as wrapped computation's thread name "
                                 f"({thread} vs {_thread(comp)}).")
            self.check_nested_threads(instr, comp)
            params, root = program_shape(comp)
            if not compatible(shape.tuple_shapes[0], Shape.tuple(params)):
                self.fail(instr, f"The {opcode} expects the async shape at index {{0}} to match async computation "
                                 f"parameter shape ({_txt(shape.tuple_shapes[0])} vs {_txt(Shape.tuple(params))}).")
            if not compatible(shape.tuple_shapes[1], root):
                self.fail(instr, f"The {opcode} expects the async shape at index {{1}} to match the async computation "
                                 f"root shape ({_txt(shape.tuple_shapes[1])} vs {_txt(root)}).")
        if _is_async_start(instr):
            inputs = shape.tuple_shapes[0]
            if len(inputs.tuple_shapes) != len(instr.operands):
                self.fail(instr, f"The {opcode} has {len(instr.operands)} operands but its async shape at index {{0}} "
                                 f"has {len(inputs.tuple_shapes)} elements")
            for i, op in enumerate(instr.operands):
                if not compatible(inputs.tuple_shapes[i], op.shape):
                    self.fail(instr, f"The {opcode} expects the shape of operand {i} to match the async shape at index "
                                     f"{{0}} ({_txt(op.shape)} vs {_txt(inputs.tuple_shapes[i])}).")
            if wrapped is not None:
                self.check_wrapped_shape(instr, wrapped, shape.tuple_shapes[1])
        elif opcode.endswith("-update"):
            if not compatible(instr.operands[0].shape, instr.shape):
                self.fail(instr, f"The {opcode} expects the shape of operand and output to match "
                                 f"({_txt(instr.operands[0].shape)} vs {_txt(instr.shape)}).")
        else:
            if not compatible(shape.tuple_shapes[1], instr.shape):
                self.fail(instr, f"The {opcode} expects the shape of output to match the async shape at index {{1}} "
                                 f"({_txt(instr.shape)} vs {_txt(shape.tuple_shapes[1])}).")

    def check_wrapped_shape(self, instr, wrapped: str, result: Shape):
        """For the `<op>-start` shorthand: the wrapped instruction's own shape rules."""
        if wrapped in ("custom-call", "fusion", "call", "async-start") or wrapped in _NO_INFERENCE:
            return
        element_type = result.dtype if result.is_array else None
        try:
            expected = infer_shape(wrapped, [op.shape for op in instr.operands], instr.attrs, None,
                                   element_type=element_type)
        except ShapeInferenceError as e:
            self.fail(instr, f"the {wrapped} wrapped by {instr.name}: {e}")
        if not compatible(result, expected):
            self.fail(instr, f"the {wrapped} wrapped by {instr.name} should have shape {_txt(expected)}, but the async "
                             f"shape at index {{1}} is {_txt(result)}")

    def check_nested_threads(self, instr, comp, depth=0):
        if depth > 64:
            return
        for inner in comp.instructions:
            for callee in inner.called_computations:
                if _thread(callee) != _thread(comp):
                    self.fail(instr, f"Nested computations expects same computation's thread name: {_thread(callee)} "
                                     f"vs {_thread(comp)}, in called computation `{callee.name}` vs caller computation "
                                     f"`{comp.name}`")
                self.check_nested_threads(instr, callee, depth + 1)

    def check_pairs(self, computations):
        """VerifyAsynchronousInstructionPairs and VerifyChannels."""
        for comp in computations:
            async_comp = comp in self.async_owner
            for instr in comp.instructions:
                opcode = instr.opcode
                if _is_async_start(instr):
                    self.single_user(instr, _is_async_update_or_done, "async-update or async-done")
                elif _is_async(instr) and not _is_async_done(instr):
                    self.single_operand(instr, _is_async_start_or_update, "async-start or async-update")
                    self.single_user(instr, _is_async_update_or_done, "async-update or async-done")
                elif _is_async_done(instr):
                    self.single_operand(instr, _is_async_start_or_update, "async-start or async-update")
                elif opcode in _PAIRS:
                    done = _PAIRS[opcode]
                    self.single_user(instr, lambda u, d=done: u.opcode == d, done)
                elif opcode in _PAIRS_REVERSED:
                    start = _PAIRS_REVERSED[opcode]
                    self.single_operand(instr, lambda o, s=start: o.opcode == s, start)
                elif opcode in ("send", "recv"):
                    if instr.is_root and async_comp:
                        continue
                    done = opcode + "-done"
                    self.single_user(instr, lambda u, d=done: u.opcode in (d, "tuple"), f"{done} or tuple")
                    user = instr.users[0]
                    if user.opcode == done:
                        if user.attrs.get("channel_id") != instr.attrs.get("channel_id"):
                            self.fail(user, f"Expected to have the same channel id, actual channel ids are: "
                                            f"{instr.name} ({instr.attrs.get('channel_id')}), {user.name} "
                                            f"({user.attrs.get('channel_id')})")
                        if attr_bool(user.attrs, "is_host_transfer") != attr_bool(instr.attrs, "is_host_transfer"):
                            self.fail(user, f"Expected instructions to have the same is-host-transfer property: "
                                            f"{instr.name}, {user.name}")
                elif opcode in ("send-done", "recv-done"):
                    start = opcode[:-5]
                    self.single_operand(instr, lambda o, s=start: o.opcode in (s, "get-tuple-element"),
                                        f"{start} or get-tuple-element")

    def single_user(self, instr, ok, expected: str):
        users = instr.users
        if len(users) != 1:
            self.fail(instr, f"The {instr.opcode} instruction requires one consumer, found {len(users)}")
        if not ok(users[0]):
            self.fail(instr, f"The consumer of a {instr.opcode} instruction needs to be one of ({expected}), found "
                             f"{users[0].opcode}")

    def single_operand(self, instr, ok, expected: str):
        if len(instr.operands) != 1:
            self.fail(instr, f"The {instr.opcode} instruction requires one operand, found {len(instr.operands)}")
        if not ok(instr.operands[0]):
            self.fail(instr, f"The operand of a {instr.opcode} instruction needs to be {expected}, found "
                             f"{instr.operands[0].opcode}")

    # -- module-level ------------------------------------------------------------------------------------------
    def check_entry_layout(self):
        raw = self.module.attrs.get("entry_computation_layout")
        if raw is None:
            return
        entry = self.module.entry
        try:
            params, result = _parse_computation_layout(str(raw))
        except (ValueError, A.AttrError) as e:
            raise HloVerifyError(f"malformed entry_computation_layout: {e}", line=1)
        if not compatible(entry.root.shape, result):
            self.fail(entry.root, f"Shape of the root instruction of entry computation ({_txt(entry.root.shape)}) "
                                  f"should be compatible to one specified in module's entry computation layout "
                                  f"({_txt(result)})")
        num_parameters = entry.num_parameters
        if len(params) != num_parameters:
            raise HloVerifyError(f"Number of parameters in entry computation layout ({len(params)}) must be same as "
                                 f"number of parameters of entry computation ({num_parameters})", line=1)
        parameters = self.entry_parameters()
        for i, shape in enumerate(params):
            param = parameters[i]
            if not compatible(param.shape, shape):
                self.fail(param, f"Shape of the entry computation parameter {i} is {_txt(param.shape)} should be "
                                 f"compatible to the one specified in module's entry computation layout "
                                 f"{_txt(shape)}")

    def entry_parameters(self) -> dict:
        """parameter number -> parameter of the entry, numbered 0..n-1 (`parameter(i)` scans the entry each time)."""
        entry = self.module.entry
        params = {instr.parameter_number: instr for instr in entry.instructions if instr.opcode == "parameter"}
        for i in range(len(params)):
            if i not in params:
                self.fail_comp(entry, f"computation {entry.name} has parameters numbered up to {max(params)} but no "
                                      f"parameter {i}")
        return params

    def check_aliasing(self):
        entry = self.module.entry
        num_parameters = entry.num_parameters
        parameters = self.entry_parameters()
        raw = self.module.attrs.get("input_output_alias")
        aliased = set()
        if raw is not None:
            try:
                entries = A.parse_input_output_alias(str(raw))
            except ValueError as e:
                raise HloVerifyError(f"malformed input_output_alias: {e}", line=1)
            outputs = set()
            for out_index, param_no, param_index, _kind in entries:
                out_sub = _subshape(entry.root.shape, out_index)
                if out_sub is None:
                    raise HloVerifyError(f"Trying to set up alias at {_idx(out_index)} which is an invalid index for "
                                         f"shape {_txt(entry.root.shape)}", line=1)
                if out_index in outputs:
                    raise HloVerifyError(f"output {_idx(out_index)} is aliased more than once", line=1)
                outputs.add(out_index)
                if not 0 <= param_no < num_parameters:
                    raise HloVerifyError(f"input_output_alias names parameter {param_no}, but the entry computation "
                                         f"has {num_parameters} parameters", line=1)
                param_sub = _subshape(parameters[param_no].shape, param_index)
                if param_sub is None:
                    raise HloVerifyError(f"input_output_alias: {_idx(param_index)} is not a valid index of parameter "
                                         f"{param_no} ({_txt(parameters[param_no].shape)})", line=1)
                if not param_sub.is_array or not out_sub.is_array:
                    raise HloVerifyError(f"input_output_alias: only arrays can alias, not {_txt(param_sub)} and "
                                         f"{_txt(out_sub)}", line=1)
                if param_sub.byte_size != out_sub.byte_size:
                    raise HloVerifyError(f"input_output_alias: output {_idx(out_index)} ({_txt(out_sub)}) and parameter "
                                         f"{param_no} at {_idx(param_index)} ({_txt(param_sub)}) differ in size",
                                         line=1)
                if (param_no, param_index) in aliased:
                    raise HloVerifyError(f"parameter {param_no} at {_idx(param_index)} is aliased to more than one "
                                         f"output", line=1)
                aliased.add((param_no, param_index))
        raw = self.module.attrs.get("buffer_donor")
        if raw is not None:
            try:
                donors = A.parse_buffer_donor(str(raw))
            except ValueError as e:
                raise HloVerifyError(f"malformed buffer_donor: {e}", line=1)
            for param_no, param_index in donors:
                if not 0 <= param_no < num_parameters:
                    raise HloVerifyError(f"buffer_donor names parameter {param_no}, but the entry computation has "
                                         f"{num_parameters} parameters", line=1)
                sub = _subshape(parameters[param_no].shape, param_index)
                if sub is None or not sub.is_array:
                    raise HloVerifyError(f"buffer_donor: {_idx(param_index)} is not an array of parameter {param_no}",
                                         line=1)
                if (param_no, param_index) in aliased:
                    raise HloVerifyError(f"parameter {param_no} at {_idx(param_index)} is both a buffer donor and "
                                         f"aliased to an output", line=1)

    def check_constrained_all_reduce(self):
        reference = None
        for instr in (i for comp in self.walked for i in comp.instructions):
            if instr.opcode not in ("all-reduce", "all-reduce-start"):
                continue
            value = attr_bool(instr.attrs, "constrain_layout")
            if reference is None:
                reference = value
            elif value != reference:
                self.fail(instr, "HloModule has a mix of layout constrained and unconstrained AllReduce instructions.")


# ----------------------------------------------------------------------------------------------------
# tables of per-opcode checks
# ----------------------------------------------------------------------------------------------------
_COMPUTATION_KEYS = frozenset({
    "to_apply", "calls", "condition", "body", "branch_computations", "true_computation", "false_computation",
    "select", "scatter", "called_computations",
})
_CHANNEL_OPS = frozenset({"send", "recv"})
_PAIRS = {"all-reduce-start": "all-reduce-done", "copy-start": "copy-done",
          "collective-permute-start": "collective-permute-done"}
_PAIRS_REVERSED = {v: k for k, v in _PAIRS.items()}
_NO_INFERENCE = frozenset({"parameter", "constant", "iota", "reshape", "bitcast", "dynamic-reshape", "rng",
                           "rng-bit-generator", "infeed", "recv", "scan"})
_MODE_NAMES = {"cross_replica": "kCrossReplica", "cross_replica_and_partition": "kCrossReplicaAndPartition",
               "cross_partition": "kCrossPartition", "flattened_id": "kFlattenedID"}

_PARSE_CHECKS = {
    "conditional": _Verifier._parse_conditional,
    "infeed": _Verifier._parse_infeed,
    "custom-call": _Verifier._parse_custom_call,
    "send-done": _Verifier._parse_send_recv_done,
    "recv-done": _Verifier._parse_send_recv_done,
}

_SHAPE_CHECKS = {
    "parameter": _Verifier.verify_nothing, "bitcast": _Verifier.verify_nothing,
    "constant": _Verifier.verify_constant, "iota": _Verifier.verify_iota,
    "broadcast": _Verifier.verify_broadcast, "reshape": _Verifier.verify_reshape,
    "dynamic-reshape": _Verifier.verify_reshape, "custom-call": _Verifier.verify_custom_call,
    "rng": _Verifier.verify_rng, "rng-bit-generator": _Verifier.verify_rng_bit_generator,
    "rng-get-and-update-state": _Verifier.verify_rng_state, "infeed": _Verifier.verify_infeed,
    "outfeed": _Verifier.verify_outfeed, "recv": _Verifier.verify_recv,
    "bitcast-convert": _Verifier.verify_bitcast_convert, "dot": _Verifier.verify_dot_like,
    "convolution": _Verifier.verify_dot_like, "ragged-dot": _Verifier.verify_dot_like,
    "all-gather": _Verifier.verify_all_gather, "all-gather-start": _Verifier.verify_all_gather,
    "reduce-scatter": _Verifier.verify_reduce_scatter, "all-reduce": _Verifier.verify_all_reduce,
    "all-reduce-start": _Verifier.verify_all_reduce, "all-to-all": _Verifier.verify_all_to_all,
    "collective-permute": _Verifier.verify_collective_permute,
    "collective-permute-start": _Verifier.verify_collective_permute,
    "collective-broadcast": _Verifier.verify_collective_broadcast,
    "ragged-all-to-all": _Verifier.verify_ragged_all_to_all,
    "while": _Verifier.verify_while, "conditional": _Verifier.verify_conditional, "call": _Verifier.verify_call,
    "fusion": _Verifier.verify_fusion, "map": _Verifier.verify_map, "reduce": _Verifier.verify_reduce,
    "reduce-window": _Verifier.verify_reduce, "sort": _Verifier.verify_sort,
    "get-tuple-element": _Verifier.verify_get_tuple_element, "scan": _Verifier.verify_scan,
    "async-start": _Verifier.verify_async, "async-update": _Verifier.verify_async,
    "async-done": _Verifier.verify_async,
}
for _op in _PLAIN_UNARY | _PLAIN_BINARY | _RESULT_ACCURACY_OPS | {"convert", "stochastic-convert", "compare"}:
    if _op not in ("bitcast", "all-gather-done", "all-reduce-done", "collective-permute-done", "copy-done"):
        _SHAPE_CHECKS[_op] = _Verifier.verify_elementwise


# ----------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------
def _dirty_computations(module) -> list:
    """Computations edited since parsing, or never parsed (built or cloned by a pass)."""
    return [comp for comp in module.computations if comp._dirty or comp._span is None]


def _entry_interface_edited(module) -> bool:
    """Whether the header or the entry's parameters or result may differ from the parsed module's
    (what the entry-layout and aliasing checks compare): parameter edits and new roots of another
    shape clear the entry's head span, a root's own shape edit marks it, and replacing
    computations marks the module dirty."""
    entry = module.entry
    return (module._header_stale or module._dirty or entry._head_span is None or entry.root is None
            or entry.root._shape_set)


def _computations_to_walk(module, dirty: list) -> list:
    """The computations `verify_edits` reads: all but those still unparsed whose text names no
    dirty computation and holds no op of a module-wide check (see `verify_edits`)."""
    words = ("async-start", "all-reduce", *(comp.name for comp in dirty))
    return [comp for comp in module.computations if comp.may_contain_text(words)]


def _add_users(instr, selected: set) -> None:
    """Add the users of `instr` to `selected`; through async starts and updates, the whole chain."""
    for user in instr.users:
        if user not in selected:
            selected.add(user)
            if _is_async_start_or_update(user):
                _add_users(user, selected)


def _txt(shape) -> str:
    return shape.to_text(False) if isinstance(shape, Shape) else str(shape)


def _int_or(value, default: int) -> int:
    if value is None:
        return default
    try:
        return int(str(value))
    except ValueError:
        return default


def _thread(comp) -> str:
    return comp.execution_thread or "main"


def _single(value):
    if isinstance(value, tuple):
        return value[0] if len(value) == 1 else None
    return value


def _sharding_key(sharding):
    text = str(sharding)
    return re.sub(r"\s*metadata=\{.*\}", "", text)


def _is_async_start(instr) -> bool:
    return instr.opcode == "async-start" or (instr.opcode.endswith("-start")
                                             and async_wrapped_opcode(instr.opcode) is not None)


def _is_async_done(instr) -> bool:
    return instr.opcode == "async-done" or (instr.opcode.endswith("-done")
                                            and async_wrapped_opcode(instr.opcode) is not None)


def _is_async(instr) -> bool:
    return instr.opcode in _ASYNC_GENERIC or async_wrapped_opcode(instr.opcode) is not None


def _is_async_update_or_done(instr) -> bool:
    return _is_async(instr) and not _is_async_start(instr)


def _is_async_start_or_update(instr) -> bool:
    return _is_async(instr) and not _is_async_done(instr)


def _subshape(shape: Shape, index):
    for i in index:
        if not shape.is_tuple or not 0 <= i < len(shape.tuple_shapes):
            return None
        shape = shape.tuple_shapes[i]
    return shape


def _idx(index) -> str:
    return "{" + ",".join(map(str, index)) + "}"


@functools.lru_cache(maxsize=64)
def _parse_computation_layout(text: str):
    """`{(f32[2]{0}, s32[])->f32[2]{0}}` -> ((parameter shapes), result shape); cached, since a pipeline
    verifies the same module's layout after every pass."""
    from hlo_tools.ir.parser import parse_shape
    body = text.strip()
    if not (body.startswith("{") and body.endswith("}")):
        raise ValueError("expects '{' at the start of the computation layout")
    body = body[1:-1].strip()
    if not body.startswith("("):
        raise ValueError("expects ( before parameter shape list")
    depth, close = 0, -1
    for i, c in enumerate(body):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                close = i
                break
    if close < 0:
        raise ValueError("expects ) at end of parameter shape list")
    params_text, rest = body[1:close], body[close + 1:].strip()
    if not rest.startswith("->"):
        raise ValueError("expects -> before result shape")
    params = tuple(parse_shape(p.strip()) for p in A.split_top_level(params_text) if p.strip())
    return params, parse_shape(rest[2:].strip())
