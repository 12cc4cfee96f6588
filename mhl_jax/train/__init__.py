"""Training: optimizer, schedule, the jitted step, checkpoints and the loop."""
