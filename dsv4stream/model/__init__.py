"""DeepSeek-V4's forward math in numpy, one small module per block; pure (a test forbids I/O).

ops (norms, activations, deterministic top-k) · rope (two tables, interleaved partial
rotation) · mhc (hyper-connection streams) · compressor (KV compression, also for the
indexer) · indexer (ratio-4 row selection) · attention (window + compressed rows, sink,
grouped output) · moe (routing, SwiGLU experts) · layer (the named weights of a block and the
head) · block (one layer's two halves, the head) · scan (finding non-finite values).
Everything is float32; linears go through `dsv4stream.kernels`. Weights are filled by
`dsv4stream.weights`; per-sequence state and the public API live in `dsv4stream.engine`.
"""
