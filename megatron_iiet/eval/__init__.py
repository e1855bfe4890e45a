"""Evaluation with lm-evaluation-harness: the native `iiet` backend over megatron checkpoints, local task data, result tables."""
