"""Tiled matrix multiplies give each row the same bits whatever the batch around it."""
from __future__ import annotations

import pytest
import torch

from shoal.model.invariant_linear import InvariantLinear, default_tile_rows


@pytest.mark.parametrize("prepack", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features,out_features", [(576, 1536), (1536, 576), (64, 128), (576, 4096)])
def test_row_results_do_not_depend_on_batch(dtype, in_features, out_features, prepack):
    torch.manual_seed(0)
    weights = [torch.randn(out_features, in_features).to(dtype), torch.randn(64, in_features).to(dtype)]
    biases = [torch.randn(out_features).to(dtype), None]
    tile = default_tile_rows(dtype)
    linear = InvariantLinear(weights, biases, tile, prepack)
    x = torch.randn(1, in_features).to(dtype)
    alone = linear(x)[0]
    for rows in (2, 3, tile - 1, tile, tile + 1, 3 * tile + 5, 200):
        batch = torch.randn(rows, in_features).to(dtype)
        where = rows // 2
        batch[where] = x[0]
        assert torch.equal(linear(batch)[where], alone), rows


@pytest.mark.parametrize("prepack", [False, True])
@pytest.mark.parametrize("tile", [0, 16])
def test_fused_parts_match_plain_linear(prepack, tile):
    torch.manual_seed(0)
    a, b, bias = torch.randn(300, 64), torch.randn(40, 64), torch.randn(40)
    x = torch.randn(37, 64)
    out = InvariantLinear([a, b], [None, bias], tile, prepack)(x)
    torch.testing.assert_close(out, torch.cat([x @ a.T, x @ b.T + bias], dim=1))
