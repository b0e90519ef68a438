"""Taking rejected draft positions back out of a BatchKVCache, a different number per row.

Why this is not just ``trim``: the batch cache's rows are left-padded and share one length
(``_idx``), so trimming cuts every row alike. After a verification step each row keeps the
positions of its accepted drafts and drops the rest, so the rows' ends differ. The common part is
trimmed; a row that drops more is shifted right by the difference and counts that much more left
padding (exactly what ``BatchKVCache.finalize`` does after a right-padded prefill), so each row's
kept positions again end at the shared length and its rotary positions (``offset``) stay its own.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, dynamic_roll


def drop_positions(cache: list[BatchKVCache], rejected: list[int], in_place: bool) -> None:
    """Remove the last ``rejected[i]`` positions of row i from every layer's cache.

    in_place: the caches' buffers are evaluated float32 arrays that nothing else is computing
    from (the native pass just wrote them), so the shift is a numpy copy of the moved rows' live
    positions only; otherwise it is mlx's per-row roll of the whole buffer.
    """
    common = min(rejected)
    extra = [r - common for r in rejected]
    if any(extra):
        shift = mx.array(extra)
        if in_place:
            mx.synchronize()  # a row copy for the prefix cache may still be reading these buffers
        for c in cache:
            if in_place:
                _shift_in_place(c, extra)
            else:
                c.keys = dynamic_roll(c.keys, shift[:, None], axis=2)
                c.values = dynamic_roll(c.values, shift[:, None], axis=2)
            c.left_padding = c.left_padding + shift
            c.offset = c.offset - shift
    if common:
        for c in cache:
            c.trim(common)


def _shift_in_place(c: BatchKVCache, extra: list[int]) -> None:
    end = c._idx
    padding = np.asarray(c.left_padding).tolist()
    for buffer in (np.asarray(c.keys), np.asarray(c.values)):
        if not buffer.flags.writeable:
            raise ValueError("the cache buffer is not writable in place")
        for row, e in enumerate(extra):
            if e:
                start = padding[row]
                buffer[row, :, start + e : end] = buffer[row, :, start : end - e]
