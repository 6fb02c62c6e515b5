"""XLA's opcodes and the facts about them that the parser, verifier and passes share."""

UNARY_ELEMENTWISE = frozenset({
    "abs", "cbrt", "ceil", "count-leading-zeros", "copy", "cosine", "erf", "exponential", "exponential-minus-one",
    "floor", "imag", "is-finite", "log", "log-plus-one", "logistic", "negate", "not", "popcnt", "real",
    "round-nearest-afz", "round-nearest-even", "rsqrt", "sign", "sine", "sqrt", "tan", "tanh",
    "convert", "bitcast-convert", "reduce-precision",
})
BINARY_ELEMENTWISE = frozenset({
    "add", "atan2", "compare", "complex", "divide", "maximum", "minimum", "multiply", "power",
    "remainder", "shift-left", "shift-right-arithmetic", "shift-right-logical", "subtract",
    "and", "or", "xor", "stochastic-convert",
})
# fma(a, b, c) = a * b + c rounded once: XLA's algebraic simplifier makes it from a multiply and an add
# (jaxlib 0.12.1 on CPU, in the polynomials of erf and the like).
TERNARY_ELEMENTWISE = frozenset({"clamp", "fma", "select"})
ELEMENTWISE = UNARY_ELEMENTWISE | BINARY_ELEMENTWISE | TERNARY_ELEMENTWISE

COLLECTIVES = frozenset({
    "all-gather", "all-gather-start", "all-reduce", "all-reduce-start", "all-to-all", "ragged-all-to-all",
    "collective-broadcast", "collective-permute", "collective-permute-start", "reduce-scatter",
})
COLLECTIVE_DONES = frozenset({"all-gather-done", "all-reduce-done", "collective-permute-done"})

OPCODES = ELEMENTWISE | COLLECTIVES | COLLECTIVE_DONES | frozenset({
    "add-dependency", "after-all", "async-done", "async-start", "async-update", "batch-norm-grad",
    "batch-norm-inference", "batch-norm-training", "bitcast", "broadcast", "call", "cholesky",
    "concatenate", "conditional", "constant", "convolution", "copy-done", "copy-start", "custom-call",
    "domain", "dot", "dynamic-reshape", "dynamic-slice", "dynamic-update-slice", "fft", "fusion", "gather",
    "get-dimension-size", "get-tuple-element", "infeed", "iota", "map", "opt-barrier", "outfeed", "pad",
    "parameter", "partition-id", "recv", "recv-done", "reduce", "reduce-window", "replica-id", "reshape",
    "reverse", "rng", "rng-bit-generator", "rng-get-and-update-state", "scan", "scatter",
    "select-and-scatter", "send", "send-done", "set-dimension-size", "slice", "sort", "topk", "transpose",
    "triangular-solve", "tuple", "while", "ragged-dot",
})

# `<op>-start`, `<op>-update`, `<op>-done`: XLA's shorthand for an async op wrapping `<op>`.
ASYNC_SUFFIXES = ("-start", "-update", "-done")

# As XLA's HasSideEffectNoRecurse; synchronous collectives are removable when unused, since
# every device runs the same program and drops them together.
SIDE_EFFECTING = frozenset({
    "all-gather-start", "all-gather-done", "all-reduce-start", "all-reduce-done",
    "collective-permute-start", "collective-permute-done", "infeed", "outfeed", "recv", "recv-done",
    "rng", "rng-get-and-update-state", "send", "send-done", "async-start", "async-update", "async-done",
})


def is_opcode(name: str) -> bool:
    """A known opcode, or XLA's async shorthand around one."""
    if name in OPCODES:
        return True
    for suffix in ASYNC_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in OPCODES:
            return True
    return False


def async_wrapped_opcode(name: str) -> str | None:
    """`custom-call` for `custom-call-start`; None for built-in async pairs and other opcodes."""
    if name in OPCODES:
        return None
    for suffix in ASYNC_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in OPCODES:
            return name[: -len(suffix)]
    return None


def has_side_effect(instr) -> bool:
    """Whether dead-code elimination must keep `instr` even when its result is unused."""
    if instr.opcode == "custom-call":
        return bool(instr.attrs.get("custom_call_has_side_effect", False))
    return instr.opcode in SIDE_EFFECTING or async_wrapped_opcode(instr.opcode) is not None
