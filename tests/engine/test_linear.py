"""The CPU matmul entry point: both of its paths compute x @ W.T + b, and MKL is kept on Intel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import engine.layers.linear as linear_module
from engine.layers.linear import linear, prefers_onednn


@pytest.mark.parametrize("use_onednn", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_linear_matches_torch_on_either_path(monkeypatch, use_onednn, rows):
    if use_onednn and not linear_module._onednn_available():
        pytest.skip("this torch build has no oneDNN linear")
    monkeypatch.setattr(linear_module, "_ONEDNN", use_onednn)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 48, generator=generator)
    weight = torch.randn(40, 48, generator=generator)
    bias = torch.randn(40, generator=generator)
    torch.testing.assert_close(linear(x, weight, bias), F.linear(x, weight, bias))
    torch.testing.assert_close(linear(x.view(1, rows, 48), weight), F.linear(x, weight)[None])


def test_intel_cpus_keep_mkl_and_others_use_onednn():
    assert not prefers_onednn("GenuineIntel")
    assert prefers_onednn("AuthenticAMD")
    assert prefers_onednn("")  # unknown vendors (not measured) keep the earlier default
