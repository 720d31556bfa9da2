"""oppo_tools: tools that measure, model, size and check the oppo_jax engine, off the
training path.

The benchmark of the four schedules side by side (``bench``, with its bounds in
``bench_bounds``), the simulator (``sim``), the memory report (``memory``), the compile-plan
projection (``compile_report``) and the abstract checks (``abstract_checks``) import
``oppo_jax`` (its shape rules, its kernels, its step); ``oppo_jax`` never imports them, except
its command line (``oppo_jax.cli``), lazily, for the verbs that run them.
"""
