#!/usr/bin/env python3
"""Make tests/fixtures/base_quant/nf4.safetensors: bitsandbytes' NF4 quantization of a few tensors, which
tests/kernels/test_nf4.cpp compares with tuna's (kernels/cpu/nf4.h) bit for bit.

For each case CASE (a 2-D weight; odd sizes, a zero block, equal blocks, values exactly on NF4 midpoints, a
wide range of block scales, a bf16 tensor of 521 blocks so that the absmax fill three 256-blocks):
  CASE.input      F32 or BF16, the weight
  CASE.packed     U8 [ceil(n/2)]  quantize_4bit(blocksize=64, quant_type="nf4", compress_statistics=True)
  CASE.qabsmax    U8 [blocks]     its state.absmax (the 8-bit codes of the absmax)
  CASE.absmax2    F32 [ceil(blocks/256)]  state.state2.absmax
  CASE.offset     F32 [1]         state.offset
  CASE.absmax     F32 [blocks]    the first-level absmax (the same call with compress_statistics=False)
  CASE.dequant_f32, CASE.dequant_bf16   dequantize_4bit of the compressed state to float32 / bfloat16
                                  (not for the bf16 case, to keep the file small)
and dynamic_map F32 [256] (state.state2.code), nf4_code F32 [16] (state.code).

And tests/fixtures/base_quant/int8.safetensors, LLM.int8()'s row-wise weight format, which
tests/kernels/test_int8_rowwise.cpp compares with kernels/cpu/int8_rowwise.h: for each case CASE.input F32,
CASE.q I8 and CASE.scale F32 (int8_vectorwise_quant: CB, SCB), CASE.dequant F32 (int8_vectorwise_dequant).
Everything runs on the CPU (bitsandbytes' CPU path). Usage: python3 tools/reference/make_quant_fixtures.py
"""

import argparse
import os

import bitsandbytes
import bitsandbytes.functional as F
import numpy as np
import safetensors.torch
import torch


def cases():
    g = torch.Generator().manual_seed(20)
    out = {}
    out["odd_7x13"] = torch.randn(7, 13, generator=g)  # 91 elements: an odd count, a 27-element tail block
    out["tail_3x100"] = 0.02 * torch.randn(3, 100, generator=g)  # 4 blocks and a 44-element tail, weight scale
    z = torch.randn(5, 77, generator=g)  # 385: six blocks and a one-element tail
    flat = z.view(-1)
    flat[64:128] = 0.0  # a block of zeros (absmax 0)
    flat[128:192] = 0.37  # a block of one value
    flat[192:256] = -1.5
    flat[384] = 0.0  # the tail block is one zero: its absmax is clamped to 1e-38
    out["zeros_5x77"] = z
    # Values exactly on the NF4 midpoints (ties take the lower code) and on the codes, in blocks of absmax 1.
    code = F.get_4bit_type("nf4", device="cpu")
    mids = (code[:-1] + code[1:]) / 2
    m = torch.cat([torch.tensor([1.0]), mids, code, -mids, torch.tensor([0.5, -0.25])])
    out["midpoints_1x64"] = torch.cat([m, torch.zeros(64 - m.numel())]).view(1, 64)
    # Block scales from 1e-6 to 1e3: the double quantization's whole dynamic range, near-zero codes included.
    scales = torch.logspace(-6, 3, 64)[torch.randperm(64, generator=g)]
    out["scales_8x512"] = (torch.randn(64, 64, generator=g) * scales[:, None]).view(8, 512)
    out["one_1x1"] = torch.tensor([[-0.75]])
    out["big_100x333_bf16"] = (0.02 * torch.randn(100, 333, generator=g)).to(torch.bfloat16)
    return out


def int8_cases():
    g = torch.Generator().manual_seed(8)
    out = {}
    w = 0.02 * torch.randn(6, 50, generator=g)
    w[2] = 0.0  # a row of zeros
    w[4, 7] = 1.0  # an outlier: the rest of its row quantizes coarsely
    out["rows_6x50"] = w
    # Ties: a row whose absmax is 127 scales by (1/127)*127 == 1 in fp32, so x.5 values round half to even.
    out["ties_1x10"] = torch.tensor([[127.0, 2.5, 3.5, -0.5, 1.5, -2.5, 0.5, 126.5, -126.5, 0.0]])
    out["wide_33x97"] = torch.randn(33, 97, generator=g) * torch.logspace(-4, 1, 33)[:, None]
    return out


def write_int8(out_dir):
    tensors = {}
    for name, x in int8_cases().items():
        q, scale, _ = F.int8_vectorwise_quant(x.clone())
        tensors[f"{name}.input"] = x.contiguous()
        tensors[f"{name}.q"] = q.contiguous()
        tensors[f"{name}.scale"] = scale.contiguous()
        tensors[f"{name}.dequant"] = F.int8_vectorwise_dequant(q, scale).contiguous()
    path = os.path.join(out_dir, "int8.safetensors")
    safetensors.torch.save_file(tensors, path, metadata={"bitsandbytes": bitsandbytes.__version__,
                                                         "torch": torch.__version__})
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "../../tests/fixtures/base_quant"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    tensors = {}
    state2_code = None
    # Every quantization before any dequantization: bitsandbytes' CPU dequantize is torch.compile'd, and the
    # compiled code leaves the process flushing subnormals to zero, which turns the 1e-38 floor of an all-zero
    # last block's absmax into 0.
    quantized = {name: (x, F.quantize_4bit(x, blocksize=64, quant_type="nf4", compress_statistics=True),
                        F.quantize_4bit(x, blocksize=64, quant_type="nf4", compress_statistics=False)[1])
                 for name, x in cases().items()}
    assert torch.tensor([1e-38]).item() != 0.0, "subnormals flushed before quantizing"
    for name, (x, (packed, state), plain) in quantized.items():
        n = x.numel()
        blocks = -(-n // 64)
        assert packed.numel() == (n + 1) // 2 and state.absmax.numel() == blocks
        tensors[f"{name}.input"] = x.contiguous()
        tensors[f"{name}.packed"] = packed.reshape(-1).contiguous()
        tensors[f"{name}.qabsmax"] = state.absmax.contiguous()
        tensors[f"{name}.absmax2"] = state.state2.absmax.contiguous()
        tensors[f"{name}.offset"] = state.offset.reshape(1).float()
        tensors[f"{name}.absmax"] = plain.absmax.contiguous()
        # The correctly rounded mean (what tuna computes) against torch's fp32 mean, for the record.
        exact = np.float32(plain.absmax.double().mean().item())
        print(f"{name}: n {n}, blocks {blocks}, offset {state.offset.item():.9g} "
              f"({'equal to' if exact == np.float32(state.offset.item()) else 'DIFFERS from'} the exact mean)")
        if x.dtype == torch.float32:
            for dtype, tag in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
                state.dtype = dtype
                tensors[f"{name}.dequant_{tag}"] = F.dequantize_4bit(packed, state).reshape(-1).contiguous()
        if state2_code is None:
            state2_code = state.state2.code.contiguous()
            tensors["dynamic_map"] = state2_code
            tensors["nf4_code"] = state.code.contiguous()
        assert torch.equal(state.state2.code, state2_code)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "nf4.safetensors")
    safetensors.torch.save_file(tensors, path, metadata={
        "bitsandbytes": bitsandbytes.__version__, "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability()})
    print(f"wrote {path} ({os.path.getsize(path)} bytes), bitsandbytes {bitsandbytes.__version__}, "
          f"torch {torch.__version__}")
    write_int8(args.out)


if __name__ == "__main__":
    main()
