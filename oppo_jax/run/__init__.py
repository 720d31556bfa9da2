"""A run around the step: its setup, checkpoints, evaluation, logs, plots and preemption."""
