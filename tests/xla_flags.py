"""XLA flags of the test suite (no imports: tests/conftest.py reads them before jax loads).

The suite's time is mostly XLA:CPU compiling small programs that then run a few times, so
compilation is made cheap: LLVM's optimisation turned down, fusions emitted by XLA's older
(non-MLIR) CPU emitters, and each program's LLVM module compiled in one piece rather than split
for parallel codegen (the test workers already use every core). They change how fast the
generated code runs, not what it computes: measured on the tests' 3-step demo run, compilation
15.5 s -> 5.3 s (sync) and 12.2 s -> 4.1 s (oppo), the whole run 27.3 s -> 17.4 s and
21.5 s -> 12.0 s, with the same rewards. Tests that compare results compare two runs under the
same flags. Subprocesses that set their own device count get ``COMPILE_FLAGS`` alone (the CLI
appends the count it needs).

Only the emitter flag reaches XLA's HLO passes (the older emitters have scatters rewritten into
dynamic-update-slices and fuse differently), so a test that reads a compiled program's
structure or memory compiles it with ``compile_as_in_production``, which restores that one
option for its compilation: the program it gets is the one a run without these flags compiles,
text and memory alike (tests/test_model_kernels.py checks this against a fresh process).
"""

COMPILE_FLAGS = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    " --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
)
TEST_XLA_FLAGS = f"--xla_force_host_platform_device_count=8 {COMPILE_FLAGS}"

# The compile options that make a compilation's HLO passes a flag-free run's (see above).
PRODUCTION_HLO_PASSES = {"xla_cpu_use_fusion_emitters": True}


def compile_as_in_production(lowered):
    """``lowered.compile()`` with the HLO passes of a run without the suite's flags."""
    return lowered.compile(compiler_options=PRODUCTION_HLO_PASSES)
