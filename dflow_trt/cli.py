"""`dflow-trt` command line: generate, demo, bench <what> and the pipeline stages."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from .errors import UserError

from .flags import BLOCK, COUNT, SEED, START, THREADS, Parser, check_output, number, number_list
from .export.cli import register as register_export

def _add_sampling(p: argparse.ArgumentParser) -> None:
    from .decoding.sampling import MAX_TEMPERATURE, MIN_TEMPERATURE

    p.add_argument("--temperature", type=number(float, 0, MAX_TEMPERATURE), default=0.0,
                   help=f"0 = greedy (default), else {MIN_TEMPERATURE}-{MAX_TEMPERATURE:g}")
    p.add_argument("--top-p", type=number(float, 0, 1, lo_open=True), default=1.0)
    p.add_argument("--top-k", type=START, default=0, help="0: no cut")
    p.add_argument("--seed", type=SEED, default=None)


def _add_verify_threshold(p: argparse.ArgumentParser, default: float | None = 0.0, extra: str = "") -> None:
    p.add_argument("--verify-threshold", type=number(float, 0, 1, hi_open=True), default=default,
                   help="verify only drafts whose estimated acceptance chance is >= this (0: the whole block)" + extra)


def _add_alternatives(p: argparse.ArgumentParser, default: int | None = 0, extra: str = "") -> None:
    from .decoding.interfaces import MAX_ALTERNATIVES

    p.add_argument("--alternatives", type=number(int, 0, MAX_ALTERNATIVES), default=default,
                   help=f"greedy: also verify up to this many of the drafter's runner-up tokens for the first "
                        f"draft, beside the chain (0-{MAX_ALTERNATIVES}; under --verify-threshold only those "
                        f"the drafter gives at least that probability)" + extra)


def _add_target_backend(p: argparse.ArgumentParser, default: str = "torch") -> None:
    p.add_argument("--backend", default=default, choices=["torch", "static"],
                   help=f"the target's forward: torch (Hugging Face) or static (preallocated KV pools, "
                        f"backends/static.py; Llama and Qwen3 targets); default {default}")


def _add_hint_trust(p: argparse.ArgumentParser, server: bool = False) -> None:
    """`server`: the client sends the value only when given, so older model repositories still serve it."""
    from .decoding.flow import HINT_TRUST

    default = f"the server's, {HINT_TRUST}" if server else f"{HINT_TRUST}"
    p.add_argument("--hint-trust", type=number(float, 0, 1), default=None if server else HINT_TRUST,
                   help=f"dflow: take the verifier's guess over a draft the drafter is less sure of than this, "
                        f"where the flow shows the verifier read the same token before it (0: off; default {default})")


def cmd_generate(a: argparse.Namespace) -> int:
    from .decoding.loop import generate
    from .decoding.options import DecodeOptions
    from .decoding.sampling import SamplingParams
    from .loading import load_backends
    from .prompting import check_prompt, encode_prompts

    check_prompt(a.prompt)  # sizes are checked by argparse, the context once the prompt is tokenized
    sampling = SamplingParams(a.temperature, a.top_p, a.top_k, a.seed)
    options = DecodeOptions(mode=a.mode, max_new_tokens=a.max_new_tokens, sampling=sampling, block_size=a.block_size,
                            verify_threshold=a.verify_threshold, hint_trust=a.hint_trust, alternatives=a.alternatives)
    target, drafter = load_backends(a.target, a.drafter, a.mode, a.backend, a.build_dir)
    prompt_ids = encode_prompts(target, [a.prompt], a.chat, a.max_new_tokens, ["--prompt"])[0]
    res = generate(target, drafter, [prompt_ids], options)
    ids = res.token_ids[0]
    text = target.tokenizer.decode(ids, skip_special_tokens=True)
    if a.json:
        print(json.dumps({
            "mode": a.mode, "target": a.target, "token_ids": ids, "text": text,
            "acceptance_lengths": res.acceptance_lengths[0], "tau": res.tau, "tokens_per_s": res.tokens_per_s,
            "rounds": res.rounds, "prefill_s": res.prefill_s, "draft_s": res.draft_s, "verify_s": res.verify_s,
            "total_s": res.total_s, "finish_reason": res.finish_reasons[0],
            "block_size": (a.block_size or drafter.block_size) if drafter else 1, "backend": a.backend}))
    else:
        print(text)
        print(f"[{a.mode}] tau={res.tau:.2f} tokens/s={res.tokens_per_s:.1f} rounds={res.rounds}", file=sys.stderr)
    return 0


def cmd_demo(a: argparse.Namespace) -> int:
    from .demo import DEMO_PROMPTS, run_demo

    if a.num_prompts > len(DEMO_PROMPTS):
        raise UserError(f"the demo has {len(DEMO_PROMPTS)} prompts; pass --num-prompts {len(DEMO_PROMPTS)} or fewer")
    return run_demo(a.target, a.max_new_tokens, a.num_prompts, a.verify_threshold, a.hint_trust, a.alternatives,
                    a.backend)


def cmd_bench_decode(a: argparse.Namespace) -> int:
    from .benchmarks.decode import run_bench
    from .decoding.options import DecodeOptions

    options = DecodeOptions(max_new_tokens=a.max_new_tokens, block_size=a.block_size,
                            verify_threshold=a.verify_threshold, hint_trust=a.hint_trust, alternatives=a.alternatives)
    check_output(a.json_out, "bench report (--json-out)")
    if a.json_out:
        check_output(a.plot_out or str(Path(a.json_out).with_suffix(".png")), "bench plot (--plot-out)")
    drafters = {"dflash": a.dflash_drafter, "dflow": a.dflow_drafter}
    if a.drafter:
        for m in a.modes.split(","):
            drafters[m] = a.drafter
    return run_bench(a.target, drafters, [m for m in a.modes.split(",") if m], a.dataset.split(","), a.num_prompts,
                     a.chat, options, a.json_out, a.plot_out, a.first_prompt, a.device, a.backend)


def cmd_bench_round(a: argparse.Namespace) -> int:
    from .benchmarks import round as bench

    check_output(a.json_out, "round report (--json-out)")
    return bench.run(a.target, a.mode, a.drafter, a.context, a.repeats, a.plain_linear, a.json_out, a.threads)


def cmd_bench_verify(a: argparse.Namespace) -> int:
    from .benchmarks import verify as bench

    check_output(a.json_out or str(bench.default_json(a.target, a.build)), "verify report (--json-out)")
    return bench.run(a.target, a.build, a.block, a.contexts, a.repeats, a.json_out, a.threads)


def cmd_bench_kv(a: argparse.Namespace) -> int:
    from .benchmarks import kv as bench

    check_output(a.json_out, "KV cache report (--json-out)")
    return bench.run(a.target, a.contexts, a.repeats, a.threads, a.json_out)


def cmd_bench_scale(a: argparse.Namespace) -> int:
    from .benchmarks import scale as bench

    check_output(a.json_out, "scale report (--json-out)")
    return bench.run(a.preset, a.device, a.dtype, a.contexts, a.batch, a.block, a.repeats, a.generate_tokens,
                     a.json_out, a.threads)


def cmd_bench_static(a: argparse.Namespace) -> int:
    from .benchmarks import static as bench

    check_output(a.json_out, "static back end report (--json-out)")
    dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    return bench.run(a.target, a.size, a.mode, a.device, dtype, a.context, a.block_size, a.repeats, a.new_tokens,
                     a.compile, a.cuda_graphs, a.threads, a.json_out, a.pad_block)


def cmd_bench_fp8_matmul(a: argparse.Namespace) -> int:
    from .benchmarks import fp8_matmul as bench

    check_output(a.json_out, "FP8 matmul report (--json-out)")
    return bench.run(a.ms, a.repeats, a.json_out)


def cmd_bench_serving(a: argparse.Namespace) -> int:
    from .benchmarks import serving as bench

    if Path(a.json_out).suffix != ".json":
        raise UserError(f"--json-out {a.json_out} must end in .json (the CSV, PNG and perf_analyzer input go "
                        f"beside it)")
    for suffix in (".json", ".csv", ".png"):
        check_output(str(Path(a.json_out).with_suffix(suffix)), f"load report {suffix} (--json-out)")
    check_output(str(bench.perf_analyzer_path(a.json_out)), "perf_analyzer input (--json-out)")
    if a.start and a.url:
        raise UserError("--start serves on its own address; pass --url or --start, not both")
    return bench.run(a.url or (None if a.start else "127.0.0.1:8001"), a.start, [m for m in a.models.split(",") if m],
                     [m for m in a.modes.split(",") if m], a.concurrency, a.requests, a.max_tokens, a.dataset,
                     a.json_out, a.unbatched_baseline)


def cmd_bench_hints(a: argparse.Namespace) -> int:
    from .benchmarks import hints as bench

    check_output(a.json_out, "hint report (--json-out)")
    return bench.run(a.target, a.drafter, a.dataset, a.num_prompts, a.max_new_tokens, a.json_out)


def cmd_bench_training(a: argparse.Namespace) -> int:
    from .benchmarks import training as bench

    check_output(a.json_out, "throughput report (--json-out)")
    return bench.run(list(dict.fromkeys(a.objective)), a.steps, a.warmup, a.threads, a.data_dir,
                     bench.parse_overrides(a.set), not a.no_peak, a.json_out, a.drafter)


def cmd_bench_training_tau(a: argparse.Namespace) -> int:
    from .benchmarks import training_tau as bench

    check_output(a.plot_out, "training plot (--plot-out)")
    if a.compute:
        check_output(a.compute_out, "compute plot (--compute-out)")
        check_output(str(Path(a.compute_out).with_suffix(".json")), "compute fit JSON (beside --compute-out)")
        return bench.compute_curve(a.drafters, a.throughput, a.compute_out, str(Path(a.compute_out).with_suffix(".json")))
    return bench.run(a.drafters, a.plot_out)


def cmd_bench_make_data(a: argparse.Namespace) -> int:
    from .benchmarks import make_data as bench

    check_output(a.json_out, "data-rate report (--json-out)")
    return bench.run(a.data_dir, a.target, a.shard, a.num_prompts, a.batch_size, a.repeats, a.threads, a.json_out)


def cmd_bench_zlab_vocab(a: argparse.Namespace) -> int:
    from .benchmarks import zlab_vocab as bench

    check_output(a.json_out, "vocabulary report (--json-out)")
    return bench.run(a.target, a.drafter, a.prompts, a.tokens, a.anchors, a.json_out)


def cmd_client(a: argparse.Namespace) -> int:
    from .serving.client import generate_grpc, generate_http, health

    url = a.url or ("127.0.0.1:8000" if a.protocol == "http" else "127.0.0.1:8001")
    if not health(url, a.protocol, a.model):
        raise UserError(f"no ready Triton server with the {a.model} model at {url} ({a.protocol}); "
                        f"start one with `python scripts/serve.py`")

    def show(ids, text):
        if a.stream and not a.json:
            print(text, end="", flush=True)

    send = generate_http if a.protocol == "http" else generate_grpc
    res = send(url, a.model, on_tokens=show, prompt=a.prompt, max_tokens=a.max_new_tokens, mode=a.mode,
               temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed,
               stop_words=a.stop or None, block_size=a.block_size, chat=a.chat, verify_threshold=a.verify_threshold,
               hint_trust=a.hint_trust, alternatives=a.alternatives)
    if a.json:
        print(json.dumps(res.as_dict()))
    else:
        if not a.stream:
            print(res.text, end="")
        s = res.stats
        print(f"\n[{s.get('mode')}] tau={s.get('tau', 0):.2f} rounds={s.get('rounds')} "
              f"tokens/s={s.get('tokens_per_s', 0):.1f}", file=sys.stderr)
    return 0


def cmd_make_data(a: argparse.Namespace) -> int:
    from .targets import check_device, load_target
    from .training.data import generate_dataset, read_prompts_file

    check_output(a.data_dir, "data folder (--data-dir)", folder=True)
    if a.prompts_file:
        read_prompts_file(a.prompts_file)  # a bad file is refused before the target loads
    target = load_target(a.target, num_taps=0, device=check_device(a.device))
    if target.tokenizer is None:
        raise UserError(f"{a.target} has no tokenizer to make text data with; use a checkpoint folder with one")
    print(generate_dataset(target, a.data_dir, a.num_prompts, a.max_new_tokens, a.batch_size, a.shard_size or 64,
                           seed=a.seed, first_prompt=a.first_prompt, prompts_file=a.prompts_file,
                           max_minutes=a.max_minutes, backend=a.backend))
    return 0


def cmd_cache_states(a: argparse.Namespace) -> int:
    from .drafter.defaults import DEFAULT_NUM_TAPS
    from .targets import load_target
    from .training.states import build_states

    check_output(a.data_dir, "data folder (--data-dir)", folder=True)
    target = load_target(a.target, num_taps=a.num_taps or DEFAULT_NUM_TAPS)
    print(build_states(target, a.data_dir, a.max_len, kv=not a.no_kv))
    return 0


def cmd_cache_flows(a: argparse.Namespace) -> int:
    from .drafter.defaults import DEFAULT_NUM_TAPS
    from .drafter.io import load_drafter
    from .targets import load_target
    from .training.data import load_dataset
    from .training.flows import build_flows
    from .training.trainer import _fits, check_precision, compute_dtype

    check_output(a.data_dir, "data folder (--data-dir)", folder=True)
    check_precision(a.precision)
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    target = load_target(a.target, num_taps=a.num_taps or DEFAULT_NUM_TAPS)
    drafter = load_drafter(a.drafter, target)
    train_seqs, heldout = (_fits(x, a.max_len) for x in load_dataset(Path(a.data_dir), target))
    print(build_flows(target, drafter, Path(a.data_dir), heldout[: a.eval_seqs] + train_seqs, a.anchors_per_seq,
                      a.max_len, seed=a.seed, compute_dtype=compute_dtype(a.precision), precision=a.precision,
                      max_seqs=a.max_seqs))
    return 0


def cmd_train(a: argparse.Namespace) -> int:
    from dataclasses import fields

    from .training.trainer import TrainConfig, train

    flags = {f.name: getattr(a, f.name) for f in fields(TrainConfig) if getattr(a, f.name, None) is not None}
    cfg = TrainConfig.from_file(a.config, **flags) if a.config else TrainConfig(**flags)  # checks every value
    check_output(cfg.out_dir, "training folder (--out-dir)", folder=True)
    print(train(cfg))
    return 0


def _add_train_flags(p: argparse.ArgumentParser) -> None:
    from dataclasses import MISSING, fields

    from .training.trainer import TrainConfig

    p.add_argument("--config", default=None, help="JSON file of TrainConfig fields (flags override it)")
    for f in fields(TrainConfig):  # ranges: TrainConfig checks them, for --config files too
        kind = {"int": number(int), "float": number(float)}.get(str(f.type).split(" ")[0])
        default = f.default if f.default is not MISSING else None
        p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=None,
                       help=f"(default {default})")


def _add_bench(sub) -> None:
    """`dflow-trt bench <what>`: every benchmark behind one command, each with its own flags."""
    bench = sub.add_parser("bench", help="measure: decode (tau, tokens/s per mode), round, verify, kv, scale, "
                                         "static, fp8-matmul, serving, hints, training, training-tau, make-data, zlab-vocab",
                           description="Every benchmark prints a table and writes a JSON report that records the "
                                       "machine it ran on (CPU, flags, threads, torch, date).")
    what = bench.add_subparsers(dest="what", metavar="WHAT", required=True)

    def add(name: str, func, help: str) -> argparse.ArgumentParser:
        p = what.add_parser(name, help=help, description=help)
        p.set_defaults(func=func)
        return p

    def json_out(p, default: str | None, what_: str = "the report") -> None:
        p.add_argument("--json-out", default=default,
                       help=f"write {what_} here" + (f" (default {default})" if default else ""))

    b = add("decode", cmd_bench_decode, "tau, acceptance by position, tokens/s and speedup per mode and dataset")
    b.add_argument("--target", default="smollm2-135m")
    b.add_argument("--drafter", default=None, help="one drafter for every drafting mode")
    b.add_argument("--dflash-drafter", default=None, help="drafter for --mode dflash (default: shipped)")
    b.add_argument("--dflow-drafter", default=None, help="drafter for --mode dflow (default: shipped)")
    b.add_argument("--modes", default="ar,dflash,dflow")
    b.add_argument("--dataset", default="humaneval,mtbench", help="humaneval | mtbench | FILE.jsonl, comma list")
    b.add_argument("--num-prompts", type=COUNT, default=10)
    b.add_argument("--first-prompt", type=START, default=0,
                   help="skip this many prompts of each set: --first-prompt 16 --num-prompts 16 benches prompts 17-32")
    b.add_argument("--max-new-tokens", type=COUNT, default=128)
    b.add_argument("--block-size", type=BLOCK, default=None)
    b.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the target and drafters run (fp32)")
    _add_target_backend(b)
    json_out(b, None, "the report (and a PNG plot beside it)")
    b.add_argument("--plot-out", default=None)
    _add_verify_threshold(b)
    _add_alternatives(b)
    _add_hint_trust(b)

    r = add("round", cmd_bench_round, "one round's cost against one ar step by drafts verified: break-even tau "
                                      "and the marginal draft cost (the natural --verify-threshold)")
    r.add_argument("--target", default="smollm2-135m")
    r.add_argument("--mode", default="dflash", choices=["dflash", "dflow"])
    r.add_argument("--drafter", default=None, help="drafter folder (default: the target's shipped one)")
    r.add_argument("--context", type=COUNT, default=256)
    r.add_argument("--repeats", type=COUNT, default=7)
    r.add_argument("--plain-linear", action="store_true",
                   help="PyTorch's default CPU linear layers and transformers' own attention instead of "
                        "dflow_trt.kernels (oneDNN-packed weights, grouped K/V), for comparison")
    r.add_argument("--threads", type=THREADS, default=None)
    json_out(r, "docs/bench_round.json")

    v = add("verify", cmd_bench_verify, "verify cost against context, torch and ONNX Runtime, with and without "
                                        "the KV cache (needs a build's ONNX target)")
    v.add_argument("--target", default="smollm2-135m")
    v.add_argument("--build", default=None, help="build folder with onnx/target (default build/<target>)")
    v.add_argument("--block", type=COUNT, default=16)
    v.add_argument("--contexts", type=number_list(COUNT), default=[64, 128, 256, 512, 1024])
    v.add_argument("--repeats", type=COUNT, default=5)
    v.add_argument("--threads", type=THREADS, default=None)
    json_out(v, None, "the report (default <build>/reports/bench_verify.json)")

    k = add("kv", cmd_bench_kv, "one target forward with transformers' DynamicCache against the in-place cache")
    k.add_argument("--target", default="smollm2-135m")
    k.add_argument("--contexts", type=number_list(COUNT), default=[256, 1024])
    k.add_argument("--repeats", type=COUNT, default=15)
    k.add_argument("--threads", type=THREADS, default=2)
    json_out(k, None)

    from .benchmarks.scale import DTYPES, PRESETS

    s = add("scale", cmd_bench_scale, "round cost at Qwen3-8B size on random weights (GPU; --device cpu "
                                      "--preset smoke to check it on a CPU)")
    s.add_argument("--preset", default="qwen3-8b", choices=sorted(PRESETS))
    s.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    s.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    s.add_argument("--contexts", type=number_list(COUNT), default=[512, 2048])
    s.add_argument("--batch", type=COUNT, default=1)
    s.add_argument("--block", type=BLOCK, default=16)
    s.add_argument("--repeats", type=COUNT, default=20)
    s.add_argument("--generate-tokens", type=START, default=64, help="0 skips the end-to-end generate() timing")
    s.add_argument("--threads", type=THREADS, default=None)
    json_out(s, "build/reports/bench_scale.json")

    st = add("static", cmd_bench_static, "the eager target against the static back end (preallocated KV pools): "
                                         "ar step, block verify, drafter pass, whole rounds and generate()")
    st.add_argument("--target", default="smollm2-135m")
    st.add_argument("--size", default=None, choices=sorted(PRESETS),
                    help="a random-init target and drafter of this size instead of --target (qwen3-8b: a GPU)")
    st.add_argument("--mode", default="dflow", choices=["dflash", "dflow"])
    st.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    st.add_argument("--dtype", default=None, choices=list(DTYPES), help="--size only (default bfloat16 on cuda, "
                                                                         "float32 on cpu)")
    st.add_argument("--context", type=COUNT, default=256)
    st.add_argument("--block-size", type=BLOCK, default=None, help="default: the drafter's")
    st.add_argument("--repeats", type=COUNT, default=10)
    st.add_argument("--new-tokens", type=START, default=48, help="generate() tokens per mode (0 skips it)")
    st.add_argument("--compile", action="store_true", help="also time the static target under torch.compile")
    st.add_argument("--cuda-graphs", action="store_true", help="also time it with CUDA-graph replay (--device cuda)")
    st.add_argument("--pad-block", action="store_true",
                    help="also a static target verifying every call as one block (ar bit for bit in bf16); pads "
                         "the graph variant too")
    st.add_argument("--threads", type=THREADS, default=None)
    json_out(st, "docs/bench_static.json")

    f = add("fp8-matmul", cmd_bench_fp8_matmul, "FP8 matmuls at Qwen3-8B's shapes: error against float64, "
                                                "speed against bf16 (CUDA, compute capability 8.9+)")
    f.add_argument("--ms", type=number_list(COUNT), default=[16, 256, 4096],
                   help="rows (tokens) per matmul: a verify block up to a prefill")
    f.add_argument("--repeats", type=COUNT, default=50)
    json_out(f, "build/reports/bench_fp8_matmul.json")

    sv = add("serving", cmd_bench_serving, "load against a Triton server: a concurrency sweep per mode "
                                           "(requests/s, tokens/s, TTFT, inter-token latency)")
    sv.add_argument("--url", default=None, help="HOST:PORT of the gRPC endpoint (default 127.0.0.1:8001)")
    sv.add_argument("--start", action="store_true", help="start scripts/serve.py's server for the run")
    sv.add_argument("--models", default="dflow", help="decoding models to compare, comma-separated (each point "
                                                      "runs on each in turn)")
    sv.add_argument("--unbatched-baseline", action="store_true",
                    help="with --start: serve `dflow`, `dflow_alone` (max_batch 1) and `dflow_whole_block` "
                         "(verify_budget 0) and compare them")
    sv.add_argument("--modes", default="ar,dflash,dflow")
    sv.add_argument("--concurrency", type=number_list(COUNT), default=[1, 2, 4, 8])
    sv.add_argument("--requests", type=COUNT, default=8, help="requests per point")
    sv.add_argument("--max-tokens", type=COUNT, default=32)
    sv.add_argument("--dataset", default="mtbench", help="humaneval | mtbench | FILE.jsonl (its first 16 prompts)")
    json_out(sv, "docs/serving_load.json", "the report (CSV, PNG and perf_analyzer's input beside it)")

    h = add("hints", cmd_bench_hints, "how often DFlow's verifier hints are right, and the tau each hint trust "
                                      "gives on replay (the measurement behind HINT_TRUST)")
    h.add_argument("--target", default="smollm2-135m")
    h.add_argument("--drafter", default=None, help="DFlow drafter folder (default: the target's shipped one)")
    h.add_argument("--dataset", default="heldout", help="heldout | humaneval | mtbench | FILE.jsonl")
    h.add_argument("--num-prompts", type=COUNT, default=64)
    h.add_argument("--max-new-tokens", type=COUNT, default=64)
    json_out(h, None)

    t = add("training", cmd_bench_training, "the trainer's throughput per objective: blocks/s, tokens/s and the "
                                            "fraction of this CPU's matmul FLOP/s a step reaches")
    t.add_argument("--objective", nargs="+", default=["dflash", "dflow"], choices=["dflash", "dflow", "relay"],
                   help="relay: DFlow's relay alone on --drafter's frozen body, first rounds cached (train --train-part relay)")
    t.add_argument("--steps", type=COUNT, default=8, help="timed trainer steps per objective")
    t.add_argument("--warmup", type=START, default=2, help="untimed steps first")
    t.add_argument("--threads", type=THREADS, default=None)
    t.add_argument("--data-dir", default=None, help="a data set with a state cache, or a new folder to keep the "
                                                    "synthetic one in (default: a temporary folder)")
    t.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="TrainConfig fields over the shipped drafters' settings, e.g. seqs_per_step=4 (JSON values)")
    t.add_argument("--drafter", default=None, help="start from this saved drafter (realistic acceptance for "
                                                   "DFlow's self-conditioning pass; default: an untrained one)")
    t.add_argument("--no-peak", action="store_true", help="skip the matmul microbenchmark")
    json_out(t, None)

    tt = add("training-tau", cmd_bench_training_tau, "held-out tau against training steps from drafters' "
                                                     "train_log.jsonl, as a PNG")
    tt.add_argument("drafters", nargs="*", help="drafter folders (default: the shipped smollm2-135m drafters)")
    tt.add_argument("--plot-out", default="docs/training_tau.png")
    tt.add_argument("--compute", action="store_true", help="instead: tau against cumulative training FLOPs, with "
                                                           "a log-linear fit and the compute it puts at tau 2 and 2.5")
    tt.add_argument("--compute-out", default="docs/training_tau_compute.png", help="its PNG (JSON beside it)")
    tt.add_argument("--throughput", default="docs/training_throughput.json",
                    help="the training benchmark's JSON (FLOPs per step, this CPU's FLOP/s)")

    md = add("make-data", cmd_bench_make_data, "make-data's rate: one data shard's prompts answered again the old "
                                               "way (eager, arrival order) and the new (continuous, static)")
    md.add_argument("--data-dir", default="data/smollm2-135m-p7658", help="a data set made by make-data")
    md.add_argument("--target", default=None, help="the data set's target (default: the name its manifest records)")
    md.add_argument("--shard", type=START, default=0, help="which complete shard's prompts")
    md.add_argument("--num-prompts", type=COUNT, default=None, help="only the shard's first this many")
    md.add_argument("--batch-size", type=COUNT, default=32, help="rows decoded together by the continuous ways")
    md.add_argument("--repeats", type=COUNT, default=1, help="rounds (each way once per round, interleaved)")
    md.add_argument("--threads", type=THREADS, default=None)
    json_out(md, None)

    z = add("zlab-vocab", cmd_bench_zlab_vocab, "how often a reduced-vocabulary drafter proposes the same tokens "
                                                "over the target's full LM head (z-lab's layout)")
    z.add_argument("--target", default="smollm2-135m")
    z.add_argument("--drafter", default=None, help="drafter folder (default: the target's shipped dflash one)")
    z.add_argument("--prompts", type=COUNT, default=8)
    z.add_argument("--tokens", type=COUNT, default=48)
    z.add_argument("--anchors", type=COUNT, default=16)
    json_out(z, None)


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="dflow-trt", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="decode one prompt with ar, dflash or dflow")
    g.add_argument("--target", default="smollm2-135m", help="smollm2-135m | tiny-qwen3 | tiny-llama | checkpoint dir")
    g.add_argument("--drafter", default=None, help="drafter folder (default: the target's shipped one)")
    g.add_argument("--mode", default="dflow", choices=["ar", "dflash", "dflow"])
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the target's chat template")
    g.add_argument("--max-new-tokens", type=COUNT, default=64)
    g.add_argument("--block-size", type=BLOCK, default=None, help="drafter block (default: as trained)")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--backend", default="torch", choices=["torch", "onnxruntime", "static"],
                   help="onnxruntime runs the exported graphs (exported into --build-dir first if missing); "
                        "static runs the target over preallocated KV pools (backends/static.py)")
    g.add_argument("--build-dir", default=None, help="build folder for --backend onnxruntime (default build/<target>)")
    _add_verify_threshold(g)
    _add_alternatives(g)
    _add_hint_trust(g)
    _add_sampling(g)
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="the main job: all three modes on the embedded target, tau and tokens/s")
    d.add_argument("--target", default="smollm2-135m")
    d.add_argument("--max-new-tokens", type=COUNT, default=48)
    d.add_argument("--num-prompts", type=COUNT, default=3)
    _add_verify_threshold(d, None, "; default: a table for 0, then one for the CPU's 0.05")
    _add_alternatives(d, None, "; default: 0 for the whole block, 7 with the CPU's threshold")
    _add_hint_trust(d)
    _add_target_backend(d)
    d.set_defaults(func=cmd_demo)

    _add_bench(sub)

    c = sub.add_parser("client", help="decode through a running Triton server (gRPC streaming)")
    c.add_argument("--url", default=None, help="HOST:PORT (default 127.0.0.1:8001 for grpc, :8000 for http)")
    c.add_argument("--protocol", default="grpc", choices=["grpc", "http"],
                   help="grpc: tritonclient streaming; http: Triton's generate_stream (server-sent events)")
    c.add_argument("--model", default="dflow", help="dflow (in-process) or dflow_bls (BLS orchestration)")
    c.add_argument("--prompt", required=True)
    c.add_argument("--mode", default="dflow", choices=["ar", "dflash", "dflow"])
    c.add_argument("--max-new-tokens", type=COUNT, default=64)
    c.add_argument("--block-size", type=BLOCK, default=None)
    c.add_argument("--chat", action="store_true")
    c.add_argument("--stop", action="append", default=[], help="stop word (repeatable)")
    c.add_argument("--stream", action="store_true", help="print text as rounds commit it")
    c.add_argument("--json", action="store_true", help="print one JSON object at the end")
    _add_verify_threshold(c)
    _add_alternatives(c)
    _add_hint_trust(c, server=True)
    _add_sampling(c)
    c.set_defaults(func=cmd_client)

    m = sub.add_parser("make-data", help="generate the target's own responses to the training prompts")
    m.add_argument("--target", default="smollm2-135m")
    m.add_argument("--data-dir", default="runs/data-smollm2")
    m.add_argument("--num-prompts", type=COUNT, default=1024)
    m.add_argument("--max-new-tokens", type=COUNT, default=128)
    m.add_argument("--batch-size", type=COUNT, default=32, help="prompts decoded together (at most --shard-size; "
                                                                "32 was fastest on a 2-core CPU)")
    m.add_argument("--shard-size", type=COUNT, default=None, help="sequences per data shard (default 64; a GPU "
                                                                 "wants it as large as --batch-size)")
    m.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    _add_target_backend(m, default="static")
    m.add_argument("--prompts-file", default=None, help="JSONL(.gz) of the prompts instead of building them here "
                                                        "(written by `python -m dflow_trt.training.recipe pack`)")
    m.add_argument("--max-minutes", type=number(float, 0), default=0.0,
                   help="stop after the shard that passes this (0: none); a rerun goes on")
    m.add_argument("--seed", type=SEED, default=0)
    m.add_argument("--first-prompt", type=START, default=0,
                   help="start this far down the prompt order (fresh prompts for a fine-tune)")
    m.set_defaults(func=cmd_make_data)

    s = sub.add_parser("cache-states", help="run the target once over the training data and store its states")
    s.add_argument("--target", default="smollm2-135m")
    s.add_argument("--data-dir", default="runs/data-smollm2")
    s.add_argument("--max-len", type=BLOCK, default=320, help="as the trainer's --max-len")
    s.add_argument("--num-taps", type=COUNT, default=None, help="as the trainer's --num-taps (default 3)")
    s.add_argument("--no-kv", action="store_true", help="taps only (enough for --objective dflash)")
    s.set_defaults(func=cmd_cache_states)

    f = sub.add_parser("cache-flows", help="run a frozen drafter's first rounds through the target once, for "
                                            "`train --train-part relay` (resumable)")
    f.add_argument("--target", default="smollm2-135m")
    f.add_argument("--drafter", required=True, help="the drafter whose body stays frozen (the run's --init-from)")
    f.add_argument("--data-dir", default="runs/data-smollm2")
    f.add_argument("--anchors-per-seq", type=COUNT, default=16, help="as the trainer's --anchors-per-seq")
    f.add_argument("--max-len", type=BLOCK, default=320, help="as the trainer's --max-len")
    f.add_argument("--seed", type=SEED, default=0, help="as the trainer's --seed (it places the anchors)")
    f.add_argument("--precision", default="auto", help="as the trainer's --precision")
    f.add_argument("--num-taps", type=COUNT, default=None, help="as the trainer's --num-taps (default 3)")
    f.add_argument("--eval-seqs", type=COUNT, default=24, help="held-out sequences first, as the trainer's --eval-seqs")
    f.add_argument("--max-seqs", type=COUNT, default=None, help="stop after this many sequences (default: all)")
    f.add_argument("--threads", type=THREADS, default=None)
    f.set_defaults(func=cmd_cache_flows)

    t = sub.add_parser("train", help="train a DFlash or DFlow drafter (resumable; torchrun for DDP)")
    _add_train_flags(t)
    t.set_defaults(func=cmd_train)

    register_export(sub)
    return ap


def _quiet_libraries() -> None:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub: everything is local
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _progress_bar_open() -> bool:
    """A progress bar the interrupt left on screen: the error then starts on a line of its own."""
    tqdm = sys.modules.get("tqdm")
    return bool(tqdm is not None and getattr(tqdm.tqdm, "_instances", None))


def main(argv: list[str] | None = None) -> int:
    """Run one command. A refusal ends in one `error: ...` line and exit 2 (argparse's too), Ctrl-C
    in `error: interrupted` and exit 130; outputs are written whole or not at all."""
    interrupts: list[int] = []

    def on_sigint(signum, frame):  # as Python's own, but remembered: a C extension interrupted while it
        interrupts.append(signum)  # imports raises another error (SystemError), still the user's Ctrl-C
        raise KeyboardInterrupt

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, on_sigint) if main_thread else None
    try:
        ap = build_parser()
        _quiet_libraries()
        args = sys.argv[1:] if argv is None else argv
        if args[:1] == ["bench"] and len(args) > 1 and args[1].startswith("-") and args[1] not in ("-h", "--help"):
            raise UserError(f"name what to bench before its flags: `dflow-trt bench decode {args[1]} ...` is what "
                            f"`dflow-trt bench {args[1]} ...` was; see `dflow-trt bench --help`")
        a = ap.parse_args(argv)
        if interrupts:  # a library swallowed it while importing (numpy's typing, under torch's import)
            raise KeyboardInterrupt
        return a.func(a)
    except UserError as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Exception) as e:
        if not (isinstance(e, KeyboardInterrupt) or interrupts):
            raise
        print(("\n" if _progress_bar_open() else "") + "error: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":
    sys.exit(main())
