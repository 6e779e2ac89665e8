"""Named weights: checkpoint tensors turned into the frozen dataclasses the forward pass reads.

`loading_v4` / `loading_v41` (tensors -> each family's layer and head dataclasses), `loading`
(what both build alike: experts, split linears), `family` (which family's builders a checkpoint
uses: the one switch), `providers` (the `Trunk` and `Experts` protocols and their in-memory
defaults over a catalog), `lifetime` (loud ends for weights whose bytes live in a slot that is
refilled later). Streamed providers are in `streaming`.
"""
