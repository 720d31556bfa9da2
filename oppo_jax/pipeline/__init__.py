"""The step (``run_step``, DESIGN §3's seven steps) and the host-side parts a caller drives it
with, imported lazily (``oppo_jax.pipeline.compile_plan`` stays light)."""

import importlib

_NAMES = {
    **dict.fromkeys(
        ("run_step", "StepEngine", "StepPlan", "slot_admission", "admission_replay"), "step"
    ),
    **dict.fromkeys(("AdmitRule", "CarryBuffer", "admit", "select_batch"), "carry"),
    "SCHEDULES": "schedule",
    "Timeline": "timeline",
    "update_key": "host_state",
}
__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f"oppo_jax.pipeline.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'oppo_jax.pipeline' has no attribute {name!r}")
