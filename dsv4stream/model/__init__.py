"""DeepSeek-V4's and V4.1's forward math in numpy, one small module per block; pure (a test
forbids I/O).

V4: ops (norms, activations, deterministic top-k) · rope (two tables, interleaved partial
rotation) · mhc (hyper-connection streams) · compressor (KV compression, also for the
indexer) · indexer (ratio-4 row selection) · attention (window + compressed rows, sink,
grouped output) · moe (routing, SwiGLU experts) · layer (the named weights of a block and the
head) · block (one layer's two halves, the head) · scan (finding non-finite values).
V4.1: v41_attention (window + compressed rows shared between layers) · v41_kv (the shared
compressed KV of the source layers) · v41_indexer (two-level row selection) · v41_moe
(routing with a text and an image bias) · v41_block (one layer, the head) · engram (table rows
gated into the streams) · quant (the activation rounding V4.1's official numerics apply).
Values are float32; linears and the attention products go through `dsv4stream.kernels`.
Weights are filled by `dsv4stream.weights`; per-sequence state and the public API live in
`dsv4stream.engine`.
"""
