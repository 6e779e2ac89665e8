"""The official checkpoint: what it must hold, where its bytes are, and how they decode.

In data-flow order: `config` (config.json -> a frozen `ModelConfig`, checked early), `formats`
(FP8 E4M3, FP4 E2M1, E8M0, BF16 codecs and block dequantisation), `spec` (THE table of
checkpoint tensor names with the dtype and shape the config implies), `catalog` (shard headers
-> where every tensor lives, validated against `spec`, read by name). `synth` writes generated
checkpoints in exactly this format for tests and benches; nothing on a run's path imports it.

Not here: packing (`trunkpack`), turning tensors into the model's named weights (`weights`).
"""
