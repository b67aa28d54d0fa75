"""The step: init, train_step and its pure parts (gradient producers, the reduction, the
update, gather units)."""
