"""DeepSeek's V4.1 DSpark drafter (`Transformer.forward_spec`), run on CPU from a local copy.

What `dsv4 logits --draft-out` is checked against (docs/v41.md, DSpark). For each asked
position p, on a model loaded with its drafter (`v41_reference.build_model(drafter=True)`):

  1. one prefill of all T tokens gives the main model's taps (`main_hidden`, the mean over the
     hc copies of the target layers' inputs) at every position; the main model is causal, so
     the taps of positions <= p are those of a run that stopped at p;
  2. `forward_spec(.., main_hidden[:p], start_pos=0)` seeds every stage's window with positions
     0..p-1 (what the reference's prefill of tokens[0..p-1] leaves);
  3. `forward_spec(tokens[p+1], main_hidden[p], start_pos=p)`: the drafting step right after
     the main model consumed position p. The reference samples each slot's token for the next
     slot's Markov bias; here its module-level `sample` is replaced by the teacher tokens
     tokens[p+2..p+B] (the last slot's pick
     feeds no bias), so slot j's bias comes from tokens[p+1+j].

Returns the draft logits [P, B, vocab] (head + Markov bias) and the raw confidence [P, B].
Nothing of the reference is changed beyond `sample` during step 3 and what `build_model` does
for the numerics (fp32: every weight dequantised, the grids made identities).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
from v41_reference import Boundaries, ReferenceError, _seq_room, build_model


@contextlib.contextmanager
def teacher_tokens(ref, tokens):
    """The reference's `sample` returns `tokens` one by one (shape [1]) while inside."""
    import torch

    it = iter(tokens)
    orig = ref.sample

    def sample(logits, temperature=1.0):
        return torch.tensor([int(next(it))], dtype=torch.int64)

    ref.sample = sample
    try:
        yield
    finally:
        ref.sample = orig


def reference_drafts(
    reference: Path, ckpt: Path, ids: np.ndarray, positions, numerics: str, index_keys: str = "owner"
) -> tuple[np.ndarray, np.ndarray, dict]:
    """(draft logits [P, B, vocab] float32, confidence [P, B] float32, top-k boundary gaps)."""
    import torch

    model, ref = build_model(reference, ckpt, numerics, index_keys, max_seq_len=_seq_room(len(ids) + 8), drafter=True)
    if not len(model.mtp):
        raise ReferenceError(f"{ckpt}: no DSpark drafter (dspark_block_size is 0)")
    b = model.mtp[-1].block_size
    x = torch.from_numpy(ids.astype(np.int64))[None]
    logits, conf = [], []
    with Boundaries(ref).watching() as gaps, torch.inference_mode():
        _, _, main_hidden = model(x, 0)
        for p in positions:
            p = int(p)
            if not 1 <= p <= len(ids) - 1 - b:
                raise ReferenceError(f"position {p} is outside 1..{len(ids) - 1 - b}")
            model.forward_spec(x[:, 0], main_hidden[:, :p], 0)
            forced = ids[p + 2 : p + 1 + b]  # slots 1..B-1's bias tokens; the last slot's pick feeds nothing
            with teacher_tokens(ref, [*forced, 0]):
                out_ids, lg, c = model.forward_spec(x[:, p + 1], main_hidden[:, p : p + 1], p)
            if out_ids[0, 1:b].tolist() != forced.tolist():
                raise ReferenceError(f"position {p}: the drafter's chain is not the teacher tokens")
            logits.append(lg[0].float().numpy().copy())
            conf.append(c[0].float().numpy().copy())
    return np.stack(logits), np.stack(conf), dict(gaps.gaps)
