"""ZeRO-2/3 unit by unit: each unit's params enter the autograd graph when the unit runs.

One module per seam: :mod:`~funcshard.units.run` (the run, its units and their phases),
:mod:`~funcshard.units.phase` (the stored phases), :mod:`~funcshard.units.gather` (the gather
and its transpose, the gatherer), :mod:`~funcshard.units.reducer` (reduce-scatter into the
accumulator), :mod:`~funcshard.units.saved` (the saved-tensor codec) and
:mod:`~funcshard.units.placeholders` (params outside their unit).
"""

from funcshard.units.gather import Gatherer, GatherFn
from funcshard.units.phase import Phase, UnitState
from funcshard.units.placeholders import UnitParamsError
from funcshard.units.reducer import Reducer
from funcshard.units.run import Unit, UnitRun
from funcshard.units.saved import SavedParams

__all__ = [
    "UnitRun",
    "Unit",
    "Phase",
    "UnitState",
    "Gatherer",
    "GatherFn",
    "Reducer",
    "SavedParams",
    "UnitParamsError",
]
