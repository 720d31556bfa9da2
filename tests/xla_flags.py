"""XLA flags of the test suite (no imports: tests/conftest.py reads them before jax loads).

The suite's time is mostly XLA:CPU compiling small programs that then run a few times, so
LLVM's optimisation is turned down: it changes how fast the generated code runs, not what it
computes (it cut a compile-bound module's time by a quarter). Tests that compare results
compare two runs under the same flags. Subprocesses that set their own device count get
``COMPILE_FLAGS`` alone (the CLI appends the count it needs).
"""

COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
TEST_XLA_FLAGS = f"--xla_force_host_platform_device_count=8 {COMPILE_FLAGS}"
