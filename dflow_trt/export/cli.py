"""`dflow-trt build` and `dflow-trt fp8-check`: register(subparsers) adds them to the main CLI."""

from __future__ import annotations

import argparse
import sys

from ..flags import COUNT, check_output


def add_build_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2-135m", help="smollm2-135m | tiny-qwen3 | tiny-llama | checkpoint dir")
    p.add_argument("--drafter", action="append", default=[], help="drafter folder (repeatable; default: the "
                   "target's shipped dflash and dflow drafters, else seeded untrained ones)")
    p.add_argument("--name", default=None, help="build name (default: the target's)")
    p.add_argument("--tp-size", type=COUNT, default=1, help="tensor-parallel ranks of the TensorRT-LLM checkpoints")
    p.add_argument("--out", default=None, help="build folder (default build/<name>)")
    p.add_argument("--calib-prompts", type=COUNT, default=32, help="training-distribution prompts for FP8 calibration")
    p.add_argument("--check-prompts", type=COUNT, default=16, help="held-out prompts for the FP8 check")
    p.add_argument("--check-max-new-tokens", type=COUNT, default=32)
    p.add_argument("--no-fp8-check", action="store_true")


def spec_from_args(a: argparse.Namespace):
    """The build's spec, its outputs checked writable before any work."""
    from .build import BuildSpec

    spec = BuildSpec(target=a.target, drafters=tuple(a.drafter), name=a.name, tp_size=a.tp_size, out=a.out,
                     calib_prompts=a.calib_prompts, check_prompts=a.check_prompts,
                     check_max_new_tokens=a.check_max_new_tokens, fp8_check=not a.no_fp8_check)
    check_output(str(spec.build_dir), "build folder (--out)", folder=True)
    check_output(getattr(a, "json_out", None), "FP8 report (--json-out)")
    return spec


def cmd_build(a: argparse.Namespace) -> int:
    from .build import Build

    b = Build(spec_from_args(a))
    b.run()
    print(b.dir)
    return 0


def cmd_fp8_check(a: argparse.Namespace) -> int:
    """Run (or reuse) the build's FP8 stages and check; print the table; exit 1 if a threshold fails."""
    import json

    from .build import Build
    from .fp8_check import Fp8Report

    b = Build(spec_from_args(a))
    b.run()
    rep = json.loads((b.dir / "reports" / "fp8_check.json").read_text())
    passed = rep.pop("passed")
    report = Fp8Report(**rep)
    print(report.table())
    if a.json_out:
        from .fp8_check import write_report

        write_report(report, a.json_out)
    print(f"fp8-check: {'PASS' if passed else 'FAIL'}", file=sys.stderr)
    return 0 if passed else 1


def register(subparsers) -> None:
    b = subparsers.add_parser("build", help="ONNX, FP8 and TensorRT-LLM artefacts in build/<name>/ (staged, cached)")
    add_build_args(b)
    b.set_defaults(func=cmd_build)
    c = subparsers.add_parser("fp8-check", help="FP8 vs full precision: top-1, KL, greedy match, tau; exit 1 on fail")
    add_build_args(c)
    c.add_argument("--json-out", default=None, help="also write the report here")
    c.set_defaults(func=cmd_fp8_check)
