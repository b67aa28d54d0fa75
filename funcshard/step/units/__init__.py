"""ZeRO-2/3 unit by unit: each unit's params enter the autograd graph when the unit runs.

One module per seam: :mod:`~funcshard.step.units.run` (the run, its units and their phases),
:mod:`~funcshard.step.units.phase` (the stored phases), :mod:`~funcshard.step.units.gather`
(the gather and its transpose, the gatherer), :mod:`~funcshard.step.units.reducer`
(reduce-scatter into the accumulator), :mod:`~funcshard.step.units.saved` (the saved-tensor
codec) and
:mod:`~funcshard.step.units.placeholders` (params outside their unit).
"""

from funcshard.step.units.gather import Gatherer, GatherFn
from funcshard.step.units.phase import Phase, UnitState
from funcshard.step.units.placeholders import UnitParamsError
from funcshard.step.units.reducer import Reducer
from funcshard.step.units.run import Unit, UnitRun
from funcshard.step.units.saved import SavedParams

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
