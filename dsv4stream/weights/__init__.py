"""Named weights: checkpoint tensors turned into the frozen dataclasses the forward pass reads.

`loading` (tensors -> `model.layer.LayerWeights`, head, experts), `providers` (the `Trunk` and
`Experts` protocols and their in-memory defaults over a catalog), `lifetime` (loud ends for
weights whose bytes live in a slot that is refilled later). Streamed providers are in `streaming`.
"""
