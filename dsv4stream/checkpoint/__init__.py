"""The official checkpoint: what it must hold, where its bytes are, and how they decode.

In data-flow order: `config` (config.json -> a frozen `ModelConfig`, checked early), `formats`
(FP8 E4M3, FP4 E2M1, E8M0, BF16 codecs and block dequantisation), `tensors` (what an
expected tensor is; the table of checkpoint tensor names), `spec_v4` / `spec_v41` (each
family's tensors with the dtype and shape the config implies), `spec` (the family switch and
byte totals), `catalog` (shard headers -> where every tensor lives, validated against `spec`,
read by name). `dsv4stream.synth` writes generated checkpoints in exactly this format for
tests and benches.

Not here: packing (`trunkpack`), turning tensors into the model's named weights (`weights`).
"""
