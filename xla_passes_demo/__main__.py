"""`python -m xla_passes_demo`: the main job (`xla_passes_demo.demo`, which see)."""
import sys

try:
    from .demo import main
except ImportError as missing:  # flax/optax: the demo extra; as a command, one line and exit status 1
    if __name__ == "__main__":
        sys.exit(f"python -m xla_passes_demo: error: {missing}")
    raise

if __name__ == "__main__":
    sys.exit(main())
