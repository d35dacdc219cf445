"""The training runtime: rank launch, the run built from a config, the step, the schedule runner, optimizer, gradients, checkpoints, metrics."""
