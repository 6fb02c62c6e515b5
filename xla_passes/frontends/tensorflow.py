"""TensorFlow front end: run a TF step through an xla_passes pipeline on N devices.

TensorFlow has no Python hook for HLO passes, so `function(fn, passes=...)`
does what TF's own XLA launch does, with the pipeline in the middle:

1. trace `fn` as `tf.function(fn, jit_compile=True)` for the call's input
   signature and take TF's HLO of it (`experimental_get_compiler_ir`, stage "hlo");
2. run the pipeline: `passes`, else the one `XLA_PASSES` / `--xla_passes` ask
   for (`configured_pipeline`), else none (the HLO runs as TF made it);
3. compile the result once for that signature with XLA, through
   `hlo_tools.xla.runner`, in this process, on as many CPU devices as the rewritten
   module asks for (`num_partitions=`, `sharding=`);
4. on every call, run it on the arguments and the variables' current values,
   assign the updated values to the variables (as TF's launch does for the
   resource variables the step writes) and return `tf.Tensor`s in `fn`'s
   output structure.

Importing this module imports neither TensorFlow nor JAX; `function` does.
"""
from __future__ import annotations

import contextlib
import logging
import threading

import numpy as np

from .configuration import STRICT_VARIABLE, ConfigurationError, configured_settings
from ..pipeline import Pipeline, parse_pipeline

logger = logging.getLogger("xla_passes")

# HLO opcodes of TF's stateful random ops (tf.random.uniform and friends): XLA draws their
# numbers from a state inside the executable, so no other run can give TF's numbers.
_STATEFUL_RANDOM_OPCODES = ("rng", "rng-get-and-update-state")
_UNSUPPORTED_DTYPES = ("string", "variant")


class UnsupportedFunctionError(ValueError):
    """The step does something the front end cannot run as TF would (the message says what)."""


def configured_pipeline(module_number: int = 0) -> Pipeline | None:
    """A fresh `Pipeline` for one module, as the settings ask for; None when no passes are asked for.

    Fresh, because a `Pipeline` records what happened in its run; the dump
    directory comes from the settings and `module_number` names the dump files.

    Raises:
      ConfigurationError: a variable or flag has a bad value (the message names it).
    """
    settings = configured_settings()
    if settings is None:
        return None
    return settings.pipeline.clone(dump_to=settings.dump_to, module_number=module_number)


def function(fn=None, *, passes: str | None = None, dump_to: str | None = None):
    """`fn` as a TF step whose XLA module runs through `passes` and `hlo_tools.xla.runner`.

    Use it like `tf.function`: `step = function(train_step, passes="cse,dce")`
    or `@function(passes=...)`. Each new input signature (shapes, dtypes,
    Python values) is traced, rewritten and compiled once; later calls with
    it reuse the executable.

    Args:
      fn: the step: tensors and tf.Variables in, a nest of tensors out; it may
        read and assign tf.Variables that exist before the first call.
      passes: pipeline text (checked now). None: the `XLA_PASSES` setting at
        each signature's first call, else no passes.
      dump_to: directory for the module before and after each pass (as
        `XLA_PASSES_DUMP_TO` does for JAX) when `passes` is given.

    Raises:
      PassError: `passes` is not a valid pipeline.
    """
    if passes is not None:
        parse_pipeline(passes)
    if fn is None:
        return lambda f: Function(f, passes, dump_to)
    return Function(fn, passes, dump_to)


class Function:
    """A TF step run through a pipeline; built by `function`, called like `fn`."""

    def __init__(self, fn, passes: str | None, dump_to: str | None):
        import tensorflow as tf  # noqa: PLC0415 - only users of the front end pay for TF

        self._tf_function = tf.function(fn, jit_compile=True)
        self._passes = passes
        self._dump_to = dump_to
        self._steps: dict = {}  # ConcreteFunction -> _Step
        self._lock = threading.Lock()
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, *args, **kwargs):
        bound, step = self._step(args, kwargs)
        return step(bound)

    @property
    def compiled_signatures(self) -> int:
        """How many input signatures have been traced and compiled so far."""
        return len(self._steps)

    def module_text(self, *args, **kwargs) -> str:
        """The HLO module the call `self(*args, **kwargs)` runs: TF's, after the pipeline."""
        return self._step(args, kwargs)[1].text

    def _step(self, args, kwargs) -> tuple:
        """The call's bound arguments and its signature's `_Step`, built on the signature's first call."""
        bound, concrete = self._trace(args, kwargs)
        with self._lock:
            step = self._steps.get(concrete)
            if step is None:
                step = self._steps[concrete] = _Step(self.__name__, self._tf_function, concrete, bound,
                                                     *self._pipeline())
        return bound, step

    def _pipeline(self) -> tuple[Pipeline | None, bool]:
        """The pipeline for a new signature, and whether a failing pass must fail the call.

        Passes from the settings behave as in the JAX plugin: a bad setting or a
        failing pass logs one warning and TF's module runs unchanged, unless
        `XLA_PASSES_STRICT` is set. Passes given to `function` always fail loudly.
        """
        from .jax import next_module_number  # noqa: PLC0415 - one counter for every dump

        number = next_module_number()
        if self._passes is not None:
            return Pipeline(self._passes, dump_to=self._dump_to, module_number=number), True
        try:
            settings = configured_settings()
        except ConfigurationError as exc:
            if exc.strict:
                raise
            logger.warning("xla_passes: %s; no passes enabled", exc)
            return None, False
        if settings is None:
            return None, False
        return settings.pipeline.clone(dump_to=settings.dump_to, module_number=number), settings.strict

    def _trace(self, args, kwargs):
        """The call's arguments bound as TF binds them (defaults filled in), and its concrete function.

        Variables created while tracing are refused: TF would lift them out and
        initialize them itself, which no run outside TF can do.
        """
        import tensorflow as tf  # noqa: PLC0415
        from tensorflow.python.eager.polymorphic_function import function_type_utils  # noqa: PLC0415

        tf_function = self._tf_function
        bound = function_type_utils.canonicalize_function_inputs(
            args, kwargs, tf_function.function_type, tf_function.function_spec.default_values)
        created = []

        def refuse_variables(next_creator, **options):
            created.append(options.get("name"))
            raise UnsupportedFunctionError("variable created while tracing")

        try:
            with tf.variable_creator_scope(refuse_variables):
                concrete = tf_function.get_concrete_function(*bound.args, **bound.kwargs)
        except Exception:
            if created:
                named = f" ({created[0]})" if created[0] else ""
                raise UnsupportedFunctionError(
                    f"{self.__name__} creates a tf.Variable{named} while it is traced; create the "
                    f"variables before the first call (e.g. build Keras models first)") from None
            raise
        return bound, concrete


class _Step:
    """One traced signature: TF's module after the pipeline, compiled, and how to feed it.

    Inputs are the concrete function's flat arguments followed by its
    captured inputs, which is the order of TF's HLO parameters. Outputs are
    the function's flat outputs followed by the new values of the variables
    it assigns; `input_output_alias` pairs each of those with its variable's
    parameter.
    """

    def __init__(self, name: str, tf_function, concrete, bound, pipeline: Pipeline | None, strict: bool):
        import hlo_tools  # noqa: PLC0415
        from hlo_tools.xla import runner  # noqa: PLC0415

        self.concrete = concrete
        self.name = name  # the Python function's: what messages call the step
        flat = self._flat_inputs(bound)
        captured = list(concrete.captured_inputs)
        for k, tensor in enumerate(flat + captured):
            if tensor.dtype.name in _UNSUPPORTED_DTYPES:
                raise UnsupportedFunctionError(
                    f"{self.name}: input {k} is a {tensor.dtype.name} tensor; XLA runs numeric "
                    f"tensors only")
        self.is_variable = [t.dtype.name == "resource" for t in flat + captured]
        self.captured_variables = [self._variable_of(t, concrete.graph.variables, k + len(flat))
                                   for k, t in enumerate(captured)]
        self.captured_values = [None if v is not None else t for v, t in
                                zip(self.captured_variables, captured)]

        try:
            tf_text = tf_function.experimental_get_compiler_ir(*bound.args, **bound.kwargs)(stage="hlo")
        except Exception as exc:  # noqa: BLE001 - TF raises ValueError, InvalidArgumentError, ...
            raise UnsupportedFunctionError(
                f"{self.name}: TensorFlow could not compile it with XLA: "
                f"{runner.first_line(str(exc))}") from None
        module = hlo_tools.parse_module(tf_text)
        self._check_module(module, len(flat) + len(captured))
        self.num_outputs = len(concrete.outputs)
        self.updates = self._variable_updates(module)
        if pipeline is not None:
            try:
                pipeline.run(module)
            except Exception as exc:
                if strict:
                    raise
                logger.warning("xla_passes: %s: %s: %s; TF's module runs unchanged (%s=1 makes this an "
                               "error)", self.name, type(exc).__name__, exc, STRICT_VARIABLE)
                module = hlo_tools.parse_module(tf_text)
            for line in pipeline.refusals():   # a pass that refused the whole module says why
                logger.warning("xla_passes: %s: %s", self.name, line)
        self.text = module.to_text()
        self._compile(tf_text)

    def __call__(self, bound):
        import tensorflow as tf  # noqa: PLC0415

        flat = self._flat_inputs(bound)
        arg_variables = {id(v.handle): v for v in tf.nest.flatten((bound.args, bound.kwargs))
                         if isinstance(v, tf.Variable)}
        variables = [arg_variables.get(id(t)) if is_var else None
                     for t, is_var in zip(flat, self.is_variable)] + self.captured_variables
        for k, (variable, is_var) in enumerate(zip(variables, self.is_variable)):
            if is_var and variable is None:
                raise UnsupportedFunctionError(
                    f"{self.name}: input {k} is a resource that is not a tf.Variable of the call")
        values = list(flat) + self.captured_values
        inputs = [np.asarray(v.value() if v is not None else t) for v, t in zip(variables, values)]
        warnings: list[str] = []
        outputs = self.compiled.run(inputs, warnings)
        for warning in warnings:
            logger.warning("xla_passes: %s", warning)
        for output, parameter in self.updates:
            variables[parameter].assign(outputs[output])
        return self.concrete.function_type.pack_output(
            [tf.convert_to_tensor(a) for a in outputs[:self.num_outputs]])

    def _flat_inputs(self, bound) -> list:
        function_type = self.concrete.function_type
        return list(function_type.unpack_inputs(function_type.bind(*bound.args, **bound.kwargs)))

    def _variable_of(self, handle, variables, k: int):
        """The captured tf.Variable whose handle is `handle`; None for other captured tensors."""
        if handle.dtype.name != "resource":
            return None
        for variable in variables:
            if variable.handle is handle:
                return variable
        raise UnsupportedFunctionError(f"{self.name}: input {k} is a captured resource that is not "
                                       f"a tf.Variable")

    def _check_module(self, module, num_inputs: int) -> None:
        """Refuse what no run outside TF reproduces: values baked in at trace time, stateful random ops."""
        parameters = module.entry.num_parameters
        if parameters != num_inputs:
            raise UnsupportedFunctionError(
                f"{self.name}: XLA uses {num_inputs - parameters} of its {num_inputs} tensor inputs "
                f"as compile-time constants (a shape, an axis, a size...); pass such values as "
                f"Python numbers or lists")
        for instr in module.instructions():
            if instr.opcode in _STATEFUL_RANDOM_OPCODES:
                metadata = instr.attrs.get("metadata")
                op = (metadata.get("op_type") if metadata is not None else None) or instr.opcode
                raise UnsupportedFunctionError(
                    f"{self.name}: the stateful random op {op} draws numbers that only TF's own run "
                    f"can reproduce; use tf.random.stateless_* ops or a tf.random.Generator")

    def _variable_updates(self, module) -> list[tuple[int, int]]:
        """(output leaf, input) pairs: the variables the step assigns, from TF's input_output_alias."""
        from hlo_tools.ir.attributes import parse_input_output_alias  # noqa: PLC0415

        alias = module.attrs.get("input_output_alias")
        updates = [(index[0], parameter) for index, parameter, _, _ in
                   (parse_input_output_alias(str(alias)) if alias is not None else [])]
        root = module.entry.root.shape
        leaves = len(root.tuple_shapes) if root.is_tuple else 1
        if leaves != self.num_outputs + len(updates) or any(
                output < self.num_outputs or not self.is_variable[parameter]
                for output, parameter in updates):
            raise UnsupportedFunctionError(
                f"{self.name}: TF's module has {leaves} outputs for {self.num_outputs} results and "
                f"{len(updates)} variable updates; cannot tell which output updates which variable")
        return updates

    def _compile(self, tf_text: str) -> None:
        """Compile the rewritten module for its devices; its global interface must be TF's."""
        from hlo_tools.xla import runner, xla_bridge  # noqa: PLC0415

        original, loaded = runner.load_module(tf_text, self.name), runner.load_module(self.text, self.name)
        if loaded.mode == "replica":
            raise runner.RunError(f"{self.name}: the pipeline made a replica program (replica_count="
                                  f"{loaded.num_replicas}); the front end runs partitioned modules only")
        needed = loaded.num_devices
        # Later signatures may need more devices than this one, and jax fixes its count at start.
        runner.ensure_cpu_devices(max(needed, 8), max(needed, 8))
        devices, process_index = xla_bridge.platform_devices("cpu")
        if needed > len(devices):
            raise runner.RunError(
                f"{self.name}: the rewritten module needs {needed} devices, but jax started with "
                f"{len(devices)} CPU devices (set XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{needed} before anything starts jax)")
        with _jax_hook_off():
            self.compiled = loaded.compile(devices[:needed], process_index)
        for what, tfs, ours in (("input", original.global_signature(), loaded.global_signature()),
                                ("output", original.results, self.compiled.global_outputs())):
            for k, ((tf_shape, tf_dtype), (shape, dtype)) in enumerate(zip(tfs, ours)):
                if (tuple(tf_shape), tf_dtype) != (tuple(shape), dtype):
                    raise runner.RunError(
                        f"{self.name}: the pipeline changed global {what} {k} from "
                        f"{runner.shape_str(tf_shape, tf_dtype)} to {runner.shape_str(shape, dtype)}; "
                        f"a per-device module says with sharding= how it maps to TF's")
            if len(tfs) != len(ours):
                raise runner.RunError(f"{self.name}: the pipeline changed the number of {what}s from "
                                      f"{len(tfs)} to {len(ours)}")


@contextlib.contextmanager
def _jax_hook_off():
    """No JAX-plugin passes inside our compile: the pipeline already ran on this module."""
    from . import jax as jax_hook  # noqa: PLC0415

    settings = jax_hook.enabled()
    if settings is None:
        yield
        return
    jax_hook.apply(None)
    try:
        yield
    finally:
        jax_hook.apply(settings)
