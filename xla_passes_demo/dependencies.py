"""flax and optax, which the model zoo and the demo need and the `demo` extra installs: their one
import guard, so that a missing extra fails in one line that names it."""
try:
    import flax.linen as nn
    import optax
except ImportError as missing:
    if (missing.name or "").partition(".")[0] not in ("flax", "optax"):
        raise
    raise ImportError("xla_passes_demo (its models, training and demo) needs flax and optax, which the "
                      "demo extra installs: pip install 'xla-passes[demo]' (from a checkout: "
                      "pip install -e '.[demo]')") from None

__all__ = ["nn", "optax"]
