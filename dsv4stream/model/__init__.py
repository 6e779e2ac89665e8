"""DeepSeek-V4's forward math in numpy, one small module per block.

ops (norms, activations, deterministic top-k) · rope (two tables, interleaved partial
rotation) · mhc (hyper-connection streams) · compressor (KV compression, also for the
indexer) · indexer (ratio-4 row selection) · attention (window + compressed rows, sink,
grouped output) · moe (routing, SwiGLU experts) · block (one layer, the head) · weights
(checkpoint names -> frozen dataclasses) · providers (where weights come from).
Everything is float32; linears go through `dsv4stream.kernels`. Per-sequence state and the
public API live in `dsv4stream.engine.session`.
"""
