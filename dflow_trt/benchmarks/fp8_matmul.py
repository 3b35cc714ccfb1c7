"""`dflow-trt bench fp8-matmul`: FP8 matmuls on a GPU at Qwen3-8B's linear shapes, accuracy against
float64 and speed against bf16.

The quantization is ModelOpt's FP8 recipe: e4m3 weights and activations, one scale per tensor
(amax / 448). For each shape it reports ‖out − ref‖/‖ref‖ against a float64 reference for the
bf16 matmul, the real FP8 kernel (`torch._scaled_mm`) and the fake-quant our CPU checks use
(quantize → dequantize → float matmul), plus how far the real kernel is from the fake-quant: small
means the CPU FP8 checks predict the GPU's numerics. Needs a CUDA GPU with FP8 (compute
capability 8.9 or newer).
"""

from __future__ import annotations

import time

from ..errors import UserError
from . import report

E4M3_MAX = 448.0
# (name, in_features K, out_features N) of one Qwen3-8B decoder layer
SHAPES = [("q_proj/o_proj", 4096, 4096), ("k_proj/v_proj", 4096, 1024), ("gate/up_proj", 4096, 12288),
          ("down_proj", 12288, 4096)]


def _rel(x, ref) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def _cuda_ms(fn, repeats: int) -> float:
    """Median of `repeats` CUDA-event timings after 5 warm-up calls: the kernel's own time, no host gap."""
    import torch

    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end))
    return report.median(ts)


def run(ms=(16, 256, 4096), repeats: int = 50, json_out: str | None = "build/reports/bench_fp8_matmul.json") -> int:
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise UserError("FP8 matmuls need a CUDA GPU of compute capability 8.9+ (Ada, Hopper, Blackwell); on a CPU "
                        "use `dflow-trt fp8-check`, which measures FP8 accuracy with ModelOpt's fake quantization")
    dev = torch.device("cuda")
    f8 = torch.float8_e4m3fn

    def quant(x):  # per-tensor scale, as ModelOpt's FP8 default
        s = (x.abs().amax().float() / E4M3_MAX).clamp(min=1e-12)
        return (x.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(f8), s

    torch.manual_seed(0)
    rows = []
    for name, K, N in SHAPES:
        w = (torch.randn(N, K, device=dev) * 0.02).to(torch.bfloat16)  # [N, K], as nn.Linear stores it
        wq, sw = quant(w)
        for M in ms:
            x = torch.randn(M, K, device=dev).to(torch.bfloat16)  # [M, K]
            xq, sx = quant(x)
            ref = x.double() @ w.double().T  # [M, N]
            out_bf16 = x @ w.T
            out_fp8 = torch._scaled_mm(xq, wq.T, scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)
            fake = (xq.float() * sx) @ (wq.float() * sw).T  # what fake quantization computes
            t_bf16 = _cuda_ms(lambda: x @ w.T, repeats)
            t_fp8 = _cuda_ms(lambda: torch._scaled_mm(xq, wq.T, scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16),
                             repeats)
            flop = 2 * M * K * N
            rows.append({"layer": name, "M": M, "K": K, "N": N, "rel_err_bf16": _rel(out_bf16, ref),
                         "rel_err_fp8": _rel(out_fp8, ref), "rel_err_fake_quant": _rel(fake, ref),
                         "fp8_vs_fake_quant": _rel(out_fp8, fake.double()),
                         "bf16_ms": t_bf16, "fp8_ms": t_fp8, "bf16_tflops": flop / t_bf16 / 1e9,
                         "fp8_tflops": flop / t_fp8 / 1e9, "fp8_speedup": t_bf16 / t_fp8})
    card = torch.cuda.get_device_name(dev)
    con = report.console()
    report.table(f"FP8 e4m3 per-tensor vs bf16, {card}, torch {torch.__version__}",
                 ["layer", "M", "err bf16", "err fp8", "err fake", "fp8~fake", "bf16 TF/s", "fp8 TF/s", "speedup"],
                 [[r["layer"], r["M"], f"{r['rel_err_bf16']:.2e}", f"{r['rel_err_fp8']:.2e}",
                   f"{r['rel_err_fake_quant']:.2e}", f"{r['fp8_vs_fake_quant']:.2e}", f"{r['bf16_tflops']:.1f}",
                   f"{r['fp8_tflops']:.1f}", f"{r['fp8_speedup']:.2f}×"] for r in rows], con)
    if json_out:
        out = report.write_json(json_out, {"device": card, "torch": torch.__version__,
                                           "date": time.strftime("%Y-%m-%d"), "rows": rows})
        con.print(f"wrote {out}")
    return 0
