"""Training: trainable specs and the compiled, partitioned training step."""
