"""Quantized matmul on the CPU (placeholder: dequantizes per call; the C++ kernels replace it)."""

import torch


def quant_matmul(x, data, scales, mins, bits, group_size, bias):
    out_f = data.shape[0]
    in_f = x.shape[-1]
    if bits == 4:
        b = data.reshape(out_f, -1, 1, 16)
        q = torch.cat([b & 0xF, b >> 4], 2).reshape(out_f, in_f).float()
    else:
        q = data.float()
    w = q.reshape(out_f, -1, group_size) * scales.float()[..., None]
    if mins is not None:
        w = w + mins.float()[..., None]
    return torch.nn.functional.linear(x, w.reshape(out_f, in_f).to(x.dtype), bias)
