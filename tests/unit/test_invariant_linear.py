"""Tiled matrix multiplies give each row the same bits whatever the batch around it."""
from __future__ import annotations

import pytest
import torch

from shoal.model.invariant_linear import default_tile_rows, invariant_linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features,out_features", [(576, 1536), (1536, 576), (64, 128), (576, 4096)])
def test_row_results_do_not_depend_on_batch(dtype, in_features, out_features):
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features).to(dtype)
    bias = torch.randn(out_features).to(dtype)
    x = torch.randn(1, in_features).to(dtype)
    tile = default_tile_rows(dtype)
    alone = invariant_linear(x, weight, bias, tile)[0]
    for rows in (2, 3, tile - 1, tile, tile + 1, 3 * tile + 5, 200):
        batch = torch.randn(rows, in_features).to(dtype)
        where = rows // 2
        batch[where] = x[0]
        assert torch.equal(invariant_linear(batch, weight, bias, tile)[where], alone), rows


def test_matches_plain_linear_numerically():
    torch.manual_seed(0)
    weight, x = torch.randn(300, 64), torch.randn(37, 64)
    torch.testing.assert_close(invariant_linear(x, weight, None, 16), x @ weight.T)
