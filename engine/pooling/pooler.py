"""Pool a packed batch's token states into one vector per sequence, vectorised per pooling
type: the first token (CLS), the mean of every token, or the last token; then Matryoshka
truncation and L2 normalization where the request asks for them."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from schemas.pooling import PoolingType


def pool(
    hidden: torch.Tensor,
    seq_lens: Sequence[int],
    types: Sequence[PoolingType],
) -> torch.Tensor:
    """hidden [T, H]: the batch's sequences one after another (seq_lens tokens each) ->
    float32 [B, H], each sequence pooled as its type says."""
    lens = torch.tensor(list(seq_lens), dtype=torch.int64, device=hidden.device)
    ends = torch.cumsum(lens, 0)
    starts = ends - lens
    pooled = torch.empty(
        (len(seq_lens), hidden.shape[1]), dtype=torch.float32, device=hidden.device
    )
    for kind in set(types):
        rows = torch.tensor(
            [i for i, t in enumerate(types) if t is kind], dtype=torch.int64, device=hidden.device
        )
        if kind is PoolingType.CLS:
            pooled[rows] = hidden.index_select(0, starts[rows]).float()
        elif kind is PoolingType.LAST:
            pooled[rows] = hidden.index_select(0, ends[rows] - 1).float()
        else:
            pooled[rows] = _means(hidden, lens, rows)
    return pooled


def _means(hidden: torch.Tensor, lens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The mean token state of the sequences `rows`, summed in float32."""
    seq_of_token = torch.repeat_interleave(torch.arange(len(lens), device=hidden.device), lens)
    sums = torch.zeros((len(lens), hidden.shape[1]), dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, seq_of_token, hidden.float())
    return sums[rows] / lens[rows].unsqueeze(1).float()


def finish(
    vectors: torch.Tensor, dimensions: Sequence[int | None], normalize: Sequence[bool]
) -> list[torch.Tensor]:
    """Truncate each pooled vector to its dimensions (Matryoshka: before normalizing, so a
    truncated vector is unit length too) and L2-normalize the ones that ask for it."""
    out = []
    for vector, dims, norm in zip(vectors, dimensions, normalize, strict=True):
        if dims is not None:
            vector = vector[:dims]
        if norm:
            vector = F.normalize(vector, p=2, dim=-1)
        out.append(vector)
    return out
