"""Encode+decode throughput of hidden-state frames: `tophat bench wire`.

Prints GB/s of tensor payload per full encode -> decode cycle (target >= 1 GB/s
so serialization never rivals the network). Prints only; timings are not asserted.
"""

from __future__ import annotations

import time

import torch

from shared.wire.schema import VerifyRequest, VerifyResult, WireDtype, decode, encode

TARGET_GBPS = 1.0
SID = 2**63  # worst-case (9-byte) session id


def bench(msg: VerifyRequest | VerifyResult, wire_dtype: WireDtype, seconds: float = 1.0) -> tuple[float, float, float]:
    """Return (payload GB/s for encode+decode, mean encode us, mean decode us)."""
    frame = encode(msg, wire_dtype=wire_dtype)
    decoded = decode(frame)
    assert isinstance(decoded, VerifyRequest | VerifyResult), "a frame decodes to the message it was"
    payload = decoded.hidden.nbytes  # bytes of tensor data on the wire
    n, t_enc, t_dec = 0, 0.0, 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or n < 5:
        t0 = time.perf_counter()
        frame = encode(msg, wire_dtype=wire_dtype)
        t1 = time.perf_counter()
        decode(frame)
        t2 = time.perf_counter()
        t_enc, t_dec, n = t_enc + (t1 - t0), t_dec + (t2 - t1), n + 1
    return payload * n / (t_enc + t_dec) / 1e9, t_enc / n * 1e6, t_dec / n * 1e6


def main() -> None:
    torch.manual_seed(0)
    cases: list[
        tuple[str, VerifyRequest | VerifyResult, WireDtype]
    ] = [  # (label, message, wire dtype); hidden: [rows, H]
        ("fp16 [2048,256] 1 MiB", VerifyRequest(SID, 1, 0, torch.randn(2048, 256).half()), WireDtype.F16),
        ("fp32 [1024,256] 1 MiB", VerifyRequest(SID, 1, 0, torch.randn(1024, 256)), WireDtype.F32),
        ("bf16 [2048,256] 1 MiB", VerifyRequest(SID, 1, 0, torch.randn(2048, 256).bfloat16()), WireDtype.BF16),
        ("fp32 input, cast to fp16 wire (cast incl.)", VerifyRequest(SID, 1, 0, torch.randn(2048, 256)), WireDtype.F16),
        ("verify-size fp16 [5,256] 2.5 KiB", VerifyResult(SID, 1, torch.randn(5, 256).half()), WireDtype.F16),
    ]
    print(f"torch threads: {torch.get_num_threads()}  target: >= {TARGET_GBPS} GB/s for 1 MiB")
    print(f"{'case':44} {'GB/s':>6} {'enc us':>8} {'dec us':>8} {'frame B':>8}")
    for label, msg, wd in cases:
        gbps, enc_us, dec_us = bench(msg, wd)
        size = len(encode(msg, wire_dtype=wd))
        print(f"{label:44} {gbps:6.2f} {enc_us:8.1f} {dec_us:8.1f} {size:8d}")
