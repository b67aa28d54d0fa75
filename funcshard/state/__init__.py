"""The training state as data: TrainState, its donation, the compute copies derived from the
masters, and the check that replicas agree."""
