"""Evaluation: the 7 tasks, Azure trace loading/synthesis, and the baseline policies compared in `bench serving`."""
