"""The XLA side: jaxlib's bindings (one bridge module), compiling and running modules on devices, dumps."""
