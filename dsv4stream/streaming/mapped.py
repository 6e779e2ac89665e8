"""A trunk tensor mapped read-only from its file instead of read into the budget.

Owns `map_entry`. Used for the BF16 head while `fast` reads the pack's int8 copy and nothing else
in the run reads the BF16 head (`run.planner_head`): a normal step never touches the map, so
none of its pages is resident and the budget does not count it; what does read it (the NaN
diagnosis, `model.scan`) pages in what it reads, from the file, as clean page cache the kernel
may drop again. Its bytes are not checksummed here: they are only read on the error path.
"""

from __future__ import annotations

import numpy as np

from ..checkpoint.catalog import NP_DTYPE, TensorEntry


def map_entry(e: TensorEntry) -> np.ndarray:
    """Tensor `e` as a read-only array over its file's bytes (a plain ndarray, not a np.memmap,
    so the kernels see the type they see for any weight); the map lives as long as the array."""
    m = np.memmap(e.path, dtype=np.dtype(NP_DTYPE[e.dtype]), mode="r", offset=e.offset, shape=e.shape)
    return np.asarray(m)
