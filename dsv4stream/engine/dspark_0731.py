"""V4-Flash-0731's DSpark drafter beside an engine: its weights and parameters, loaded once.

Owns: `model_0731(engine)`, what `engine.speculate_v41.drafter_for` keeps on the engine for a
0731 checkpoint (the math is `model.v4.dspark`, the names `weights.loading_dspark_0731`). The
drafter's routed experts come through the engine's expert provider as blocks n_layers + K, in
the main model's cache and budget, as V4.1's do; its taps are the V4 stack's "input" trace.
"""

from __future__ import annotations

from ..errors import InternalError
from ..model.v4.dspark import DSpark0731Params, DSpark0731Weights
from ..weights.loading_dspark_0731 import dspark_0731_params, load_dspark_0731


def model_0731(engine) -> tuple[DSpark0731Params, DSpark0731Weights]:
    if engine.catalog is None:
        raise InternalError("the drafter loads its weights from the engine's catalog")
    return dspark_0731_params(engine.cfg), load_dspark_0731(engine.catalog)
