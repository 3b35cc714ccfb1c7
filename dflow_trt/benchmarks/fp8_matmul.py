"""FP8 matmuls on a GPU at Qwen3-8B's linear shapes: accuracy against float64, speed against bf16.

    python scripts/bench_fp8_matmul.py [--ms 16,256,4096] [--repeats 50] [--json OUT]

The quantization is ModelOpt's FP8 recipe: e4m3 weights and activations, one scale per tensor
(amax / 448). For each shape it reports ‖out − ref‖/‖ref‖ against a float64 reference for the
bf16 matmul, the real FP8 kernel (`torch._scaled_mm`) and the fake-quant our CPU checks use
(quantize → dequantize → float matmul), plus how far the real kernel is from the fake-quant: small
means the CPU FP8 checks predict the GPU's numerics. Needs a CUDA GPU with FP8 (compute
capability 8.9 or newer). Prints a table and writes JSON. Not a test.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

E4M3_MAX = 448.0
# (name, in_features K, out_features N) of one Qwen3-8B decoder layer
SHAPES = [("q_proj/o_proj", 4096, 4096), ("k_proj/v_proj", 4096, 1024), ("gate/up_proj", 4096, 12288),
          ("down_proj", 12288, 4096)]


def _rel(x, ref) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="16,256,4096", help="rows (tokens) per matmul: a verify block up to a prefill")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--json", default="build/reports/bench_fp8_matmul.json")
    a = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("error: FP8 matmuls need a CUDA GPU of compute capability 8.9+ (Ada, Hopper, Blackwell); "
              "on a CPU use `dflow-trt fp8-check`, which measures FP8 accuracy with ModelOpt's fake quantization",
              file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    f8 = torch.float8_e4m3fn

    def quant(x):  # per-tensor scale, as ModelOpt's FP8 default
        s = (x.abs().amax().float() / E4M3_MAX).clamp(min=1e-12)
        return (x.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(f8), s

    def time_ms(fn):
        for _ in range(5):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(a.repeats):
            start.record()
            fn()
            end.record()
            end.synchronize()
            ts.append(start.elapsed_time(end))
        return statistics.median(ts)

    torch.manual_seed(0)
    rows = []
    for name, K, N in SHAPES:
        w = (torch.randn(N, K, device=dev) * 0.02).to(torch.bfloat16)  # [N, K], as nn.Linear stores it
        wq, sw = quant(w)
        for M in (int(m) for m in a.ms.split(",")):
            x = torch.randn(M, K, device=dev).to(torch.bfloat16)  # [M, K]
            xq, sx = quant(x)
            ref = x.double() @ w.double().T  # [M, N]
            out_bf16 = x @ w.T
            out_fp8 = torch._scaled_mm(xq, wq.T, scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)
            fake = (xq.float() * sx) @ (wq.float() * sw).T  # what fake quantization computes
            t_bf16 = time_ms(lambda: x @ w.T)
            t_fp8 = time_ms(lambda: torch._scaled_mm(xq, wq.T, scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16))
            flop = 2 * M * K * N
            rows.append({"layer": name, "M": M, "K": K, "N": N, "rel_err_bf16": _rel(out_bf16, ref),
                         "rel_err_fp8": _rel(out_fp8, ref), "rel_err_fake_quant": _rel(fake, ref),
                         "fp8_vs_fake_quant": _rel(out_fp8, fake.double()),
                         "bf16_ms": t_bf16, "fp8_ms": t_fp8, "bf16_tflops": flop / t_bf16 / 1e9,
                         "fp8_tflops": flop / t_fp8 / 1e9, "fp8_speedup": t_bf16 / t_fp8})
    card = torch.cuda.get_device_name(dev)
    print(f"FP8 e4m3 per-tensor vs bf16, {card}, torch {torch.__version__}")
    print(f"{'layer':>14} {'M':>5} {'err bf16':>9} {'err fp8':>9} {'err fake':>9} {'fp8~fake':>9} "
          f"{'bf16 TF/s':>9} {'fp8 TF/s':>9} {'speedup':>7}")
    for r in rows:
        print(f"{r['layer']:>14} {r['M']:>5} {r['rel_err_bf16']:>9.2e} {r['rel_err_fp8']:>9.2e} "
              f"{r['rel_err_fake_quant']:>9.2e} {r['fp8_vs_fake_quant']:>9.2e} {r['bf16_tflops']:>9.1f} "
              f"{r['fp8_tflops']:>9.1f} {r['fp8_speedup']:>6.2f}×")
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps({"device": card, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                               "rows": rows}, indent=2) + "\n")
    os.replace(tmp, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
