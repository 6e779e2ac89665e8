"""The packed trunk: every tensor that is not a routed expert, written once in per-layer runs.

`format` (the bytes: marker, alignments, run placement, manifest, checksums) is shared by the
writer and the readers; `packdir` (where a pack may go, staging, the lock); `writer` (the
packer: atomic, resumable); `reader` (`TrunkFile`: manifest checks and raw tensors for a run).
"""
