"""Kernels behind the custom ops of the `ai.tandem` domain, per backend."""
