"""Compiled CPU kernels and the loader that builds them (C++ compiled on first use, cached)."""
