"""The process world, the bottom floor: launch, the mesh and its dimensions, and the
collectives that count their bytes."""
