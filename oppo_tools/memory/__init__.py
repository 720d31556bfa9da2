"""Bytes per device of a run's state and of its compiled kernels (``oppo-jax memory``)."""
