"""The composition of one run: the YAML config of every module, the model assembled on its grids, the data inputs of the run."""
