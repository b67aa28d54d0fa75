"""Model-parallel axes (tensor, experts): what the data-parallel layers ask of such an axis,
behind one protocol."""
