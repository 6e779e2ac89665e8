"""DeepSeek-V4.1's own blocks: attention (window + compressed rows shared between layers) · kv
(the shared compressed KV of the source layers) · indexer (two-level row selection) · moe
(routing with a text and an image bias) · block (one layer, the head) · engram (table rows gated
into the streams) · quant (the activation rounding V4.1's official numerics apply). The expert
math, mHC, RoPE and the caches are shared (`model/`).
"""
