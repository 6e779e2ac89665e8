"""DeepSeek-V4's and V4.1's forward math in numpy, one small module per block; pure (a test
forbids I/O).

Shared by both families: ops (norms, activations, deterministic top-k) · rope (two tables,
interleaved partial rotation) · mhc (hyper-connection streams) · moe (V4's routing and the SwiGLU
experts, which V4.1 reuses) · cache (the window ring and the compressed-row buffer) · trace (the
hook for intermediate arrays) · scan (finding non-finite values).
Each family's own blocks: `v4/` (compressor, indexer, attention, layer, block) and `v41/`
(attention, kv, indexer, moe, block, engram, quant).
Values are float32; linears and the attention products go through `dsv4stream.kernels`.
Weights are filled by `dsv4stream.weights`; per-sequence state and the public API live in
`dsv4stream.engine`.
"""
