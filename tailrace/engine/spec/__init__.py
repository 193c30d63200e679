"""Speculative decoding inside the engine, lossless by construction (see `accept`).

`accept` (verification), `ladder` (draft length by acceptance), `costs` (the toggle's cost model) and
`suffix` (the history index) are pure decision cores; `Speculator` holds an engine's policy and books;
drafters (`Drafter`) are small classes chosen by name from `DRAFTERS`.
"""

import functools

from tailrace.engine.spec.history import HistoryDrafter
from tailrace.engine.spec.selfdraft import QuantDrafter
from tailrace.engine.spec.speculator import SpecOptions, Speculator
from tailrace.engine.spec.stats import SpecStats
from tailrace.engine.spec.trained import TrainedDrafter

DRAFTERS = {  # name -> factory of a `Drafter` from the engine's `DraftEnv`
    "history": HistoryDrafter,
    "quant8": functools.partial(QuantDrafter, bits=8),
    "quant4": functools.partial(QuantDrafter, bits=4),
    "trained": TrainedDrafter,
    "trained2": functools.partial(TrainedDrafter, layers=2),
}

__all__ = ["DRAFTERS", "SpecOptions", "SpecStats", "Speculator"]
