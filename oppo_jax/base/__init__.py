"""The lowest layer: errors, the shape rules, host limits and help text. Imports nothing else of
oppo_jax but each other."""
