"""Worker for tests/tools/test_translation_validation.py: a data-parallel step compiled under the
`XLA_PASSES*` variables, with a test-only pass that makes a wrong rewrite on purpose.

    python tests/workers/translation_validation_worker.py OUT.npz

`test-perturb-constant` multiplies the first floating-point scalar constant it finds by 1.5
(and adds 1): a rewrite XLA accepts and the verifier cannot see, which computes something
else. It is registered here, before JAX starts and the plugin reads XLA_PASSES.
"""
from __future__ import annotations

import sys

import numpy as np

from hlo_tools.ir.literal import Literal
from xla_passes.core import HloPass, register_pass


@register_pass
class PerturbConstant(HloPass):
    """Test only: change one floating-point scalar constant."""

    name = "test-perturb-constant"

    def run(self, module) -> bool:
        for comp in module.computations:
            for instr in comp.instructions:
                if instr.opcode == "constant" and instr.shape.rank == 0 and instr.shape.dtype.startswith("f"):
                    value = instr.literal.to_numpy() * 1.5 + 1
                    new = comp.add_instruction("constant", [], instr.shape, literal=Literal.from_numpy(value),
                                               before=instr)
                    instr.replace_all_uses_with(new)
                    comp.remove_instruction(instr)
                    return True
        return False


def main(out: str) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def step(w, x):  # a weight-wise loss: the gradient reaches the update as the all-reduce made it
        grad = jax.grad(lambda w: jnp.mean(jnp.tanh(x * w) ** 2))(w)
        return w - 0.1 * grad

    rng = np.random.default_rng(0)
    w = jax.device_put(rng.standard_normal((3, 3, 16, 16)).astype(np.float32), replicated)
    x = jax.device_put(rng.standard_normal((8, 3, 3, 16, 16)).astype(np.float32), batch)
    new_w = jax.jit(step, in_shardings=(replicated, batch), out_shardings=replicated)(w, x)
    np.savez(out, w=np.asarray(new_w))


if __name__ == "__main__":
    main(sys.argv[1])
