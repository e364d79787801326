"""The native CPU kernels (csrc/cpu) and the one module that builds, loads and dispatches them."""
