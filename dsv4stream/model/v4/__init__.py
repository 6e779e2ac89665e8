"""DeepSeek-V4's own blocks (V4-Flash, V4-Pro): compressor (KV compression, also for the
indexer) · indexer (ratio-4 row selection) · attention (window + compressed rows, sink, grouped
output) · layer (the named weights of a block and the head) · block (one layer's two halves,
the hc_head collapse and the head). The MoE, mHC, RoPE and the caches are shared (`model/`).
"""
