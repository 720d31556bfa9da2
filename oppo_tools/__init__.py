"""oppo_tools: tools that model, size and check the oppo_jax engine, off the training path.

The simulator (``sim``), the memory report (``memory``), the bench bounds (``bench_bounds``)
and the abstract checks (``abstract_checks``) import ``oppo_jax`` (its shape rules, its
kernels); ``oppo_jax`` never imports them, except from its entry points (``oppo_jax.cli``'s
``sim`` and ``memory`` verbs and ``oppo_jax.bench``), lazily.
"""
