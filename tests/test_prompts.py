"""The training prompt pool at scale (issue 27): pool 4 after the frozen pools 1-3.

Building the whole pool takes seconds (pool 4 parses pinned packages' source once per process), so one
module fixture holds it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections import Counter

import pytest

from dflow_trt.errors import UserError
from dflow_trt.training import prompt_sources
from dflow_trt.training.prompts import _shingles, build_prompts, mtbench_all_turns

POOLS_1_TO_3 = 7662  # where pool 4 starts (data/smollm2-135m-p7658 begins 4 earlier, where p5376 ends)
NEW_KINDS = {"code-pkg", "code-spec", "summarize", "rewrite", "multi-turn", "explain", "math-steps", "math-rate",
             "math-percent", "math-geometry", "math-units", "math-stats"}


def _text(p: dict) -> str:
    """The whole conversation of a multi-turn prompt, else its text."""
    return "\n\n".join(m["content"] for m in p["messages"]) if "messages" in p else p["prompt"]


def _digest(prompts: list[dict]) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]


# make-data builds the pool in a plain process. Under pytest each test runs inside
# warnings.catch_warnings(record=True), which swaps warnings._showwarnmsg_impl for a bound method, so
# pool 3 (which reads stdlib functions) loses one: the positions the data sets use are checked in a
# subprocess.
_BUILD = """
import json, sys
from dflow_trt.training.prompts import build_prompts
full = build_prompts(10**6)
prefixes = {n: build_prompts(n) == full[:n] for n in (7658, 7663, 7728, 15001)}
json.dump({"full": full, "prefixes": prefixes}, sys.stdout)
"""


def _build(hash_seed: str) -> dict:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _BUILD], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def built():
    return _build("0")


@pytest.fixture(scope="module")
def full(built):
    return built["full"]


def test_pool_is_large_and_pool_4_starts_after_the_frozen_pools(full):
    assert len(full) >= 24_000 and len(full) - POOLS_1_TO_3 >= 16_000
    assert [p["id"] for p in full] == list(range(len(full)))
    first_new = {p["source"] for p in full[POOLS_1_TO_3:POOLS_1_TO_3 + 200]}
    assert not {p["source"] for p in full[:POOLS_1_TO_3]} & {"code-pkg", "code-spec", "multi-turn", "math-units"}
    assert len(first_new & NEW_KINDS) >= 8  # the campaign's first shards already mix the new kinds


def test_prefixes_are_stable_across_the_pool_boundary(built):
    assert built["prefixes"] == {"7658": True, "7663": True, "7728": True, "15001": True}
    assert built["full"][POOLS_1_TO_3]["source"] in NEW_KINDS  # pool 4 starts where the campaign starts
    assert built["full"][POOLS_1_TO_3 - 1]["source"] not in NEW_KINDS - {"explain"}


def test_pool_is_the_same_under_another_hash_seed(full):
    """Nothing may depend on set/dict order or str hashing: a process with another PYTHONHASHSEED agrees."""
    assert _digest(_build("4321")["full"]) == _digest(full)


def test_no_duplicates_exact_or_near(full):
    keys = [" ".join(re.findall(r"\w+", _text(p).lower())) for p in full]
    assert len(set(keys)) == len(keys)
    # near duplicates, checked exactly (every earlier prompt, not only each shingle's first owner) on a sample
    owners: dict[tuple, list[int]] = {}
    for p in full:
        for s in _shingles(_text(p)):
            owners.setdefault(s, []).append(p["id"])
    worst = []
    for p in full[POOLS_1_TO_3::25]:
        sh = _shingles(_text(p))
        counts = Counter(j for s in sh for j in owners[s] if j < p["id"])
        worst.append(max(counts.values(), default=0) / max(len(sh), 1))
    assert len(worst) > 600 and max(worst) < prompt_sources.NEAR_DUP
    assert sum(w > 0 for w in worst) > 20  # the check above can fail: templates do share shingles


def test_eval_sets_stay_held_out(full):
    from dflow_trt.evalsets import humaneval_prompts, mtbench_prompts

    held = set().union(*(_shingles(t) for t in humaneval_prompts() + mtbench_prompts()))
    assert not any(_shingles(_text(p)) & held for p in full)
    second_turns = set().union(*(_shingles(t) for t in mtbench_all_turns()))
    assert len(second_turns) > len(set().union(*(_shingles(t) for t in mtbench_prompts())))
    assert not any(_shingles(_text(p)) & second_turns for p in full[POOLS_1_TO_3:])


def test_every_new_kind_has_its_share(full):
    new = Counter(p["source"] for p in full[POOLS_1_TO_3:])
    assert set(new) == NEW_KINDS
    share = {k: n / sum(new.values()) for k, n in new.items()}
    assert all(share[k] >= 0.02 for k in NEW_KINDS), share
    assert share["code-pkg"] + share["code-spec"] >= 0.3 and sum(v for k, v in share.items() if k.startswith("math")) >= 0.3
    assert share["multi-turn"] >= 0.1 and share["summarize"] + share["rewrite"] >= 0.08
    # code from every pinned package, not from one or two
    pkgs = Counter(m.group(1) for p in full[POOLS_1_TO_3:] if p["source"] == "code-pkg"
                   for m in [re.search(r"from `(\w+)`", p["prompt"])] if m)
    assert len(pkgs) >= 10 and max(pkgs.values()) < 0.4 * sum(pkgs.values())
    # any 1,000 consecutive new prompts (a campaign's first shards) hold every kind
    assert {p["source"] for p in full[POOLS_1_TO_3 + 5000:POOLS_1_TO_3 + 6000]} == NEW_KINDS


def test_multi_turn_prompts_alternate_and_end_with_the_user(full):
    multi = [p for p in full if "messages" in p]
    assert len(multi) > 1500 and all(p["source"] == "multi-turn" for p in multi)
    for p in multi:
        roles = [m["role"] for m in p["messages"]]
        assert roles == ["user", "assistant", "user"] and p["prompt"] == _text(p)
        assert all(m["content"].strip() for m in p["messages"])


def test_math_answers_in_conversations_are_right():
    """The worked solutions shown as assistant turns are computed, not templated: spot-check them."""
    import random

    rng = random.Random(7)
    for _ in range(300):
        q, sol = prompt_sources._math_geometry(rng)
        if "ladder" in q:
            x, y = map(int, re.findall(r"(\d+) m", q)[:2])
            assert sol.endswith(f"= {round((x * x + y * y) ** 0.5)} m.") and round((x * x + y * y) ** 0.5) ** 2 == x * x + y * y
    for _ in range(300):
        q, sol = prompt_sources._math_steps(rng)
        if "pays with a $" in q:
            nums = list(map(int, re.findall(r"\d+", q)))
            change = nums[4] - (nums[0] * nums[1] + nums[2] * nums[3])
            assert change >= 0 and sol.endswith(f"${change}.")


def test_a_package_that_differs_from_the_pin_is_a_one_line_error(monkeypatch):
    prompt_sources.package_records.cache_clear()
    pinned = list(prompt_sources.PINNED)
    try:
        dist, version, folder, subs, _ = pinned[2]
        monkeypatch.setattr(prompt_sources, "PINNED", (*pinned[:2], (dist, version, folder, subs, "0" * 16)))
        with pytest.raises(UserError, match=r"requests 2\.\S+ .*differ.*pip install --force-reinstall") as e:
            build_prompts(10**6)  # any n that reaches pool 4
        assert "\n" not in str(e.value)
        assert len(build_prompts(5000)) == 5000  # pools 1-3 never read the packages
        prompt_sources.package_records.cache_clear()
        monkeypatch.setattr(prompt_sources, "PINNED", (("no-such-dist", "1.0", "no_such_pkg", (), "0" * 16),))
        with pytest.raises(UserError, match="not installed here.*pip install --no-deps no-such-dist==1.0"):
            build_prompts(10**6)  # any n that reaches pool 4
    finally:
        prompt_sources.package_records.cache_clear()


def test_make_data_lays_out_the_conversation(tiny_qwen3, tmp_path):
    """A multi-turn prompt's ids are its whole conversation, through the chat template, in the shard."""
    from dflow_trt.training.data import generate_dataset, read_shard, shard_path

    full = build_prompts(POOLS_1_TO_3 + 300)  # in this process (see _BUILD)
    i = next(p["id"] for p in full[POOLS_1_TO_3:] if "messages" in p)
    d = generate_dataset(tiny_qwen3, tmp_path / "d", num_prompts=2, max_new_tokens=4, batch_size=2, shard_size=2,
                         first_prompt=i)
    row = read_shard(shard_path(d, "shard-0000.jsonl"))[0]
    want = tiny_qwen3.tokenizer.apply_chat_template(full[i]["messages"], add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"]
    assert row["id"] == i and row["prompt_ids"] == want
    text = tiny_qwen3.tokenizer.decode(row["prompt_ids"])
    assert all(m["content"][:40] in text for m in full[i]["messages"])


@pytest.mark.slow
def test_the_committed_data_sets_still_match_the_pool(smollm2, full):
    """data/smollm2-135m-p5376 and -p7658 were made by make-data: their prompt ids are the pool's prompts
    through the chat template (pools 1-3 as make-data builds them, pool 4 with its conversations)."""
    from pathlib import Path

    from dflow_trt.training.data import _chat, read_shard, shard_path

    root = Path(__file__).resolve().parent.parent / "data"
    checked = 0
    for name in ("smollm2-135m-p5376", "smollm2-135m-p7658"):
        for shard in json.loads((root / name / "manifest.json").read_text())["shards"][:3]:
            for row in read_shard(shard_path(root / name, shard))[::7]:
                assert row["prompt_ids"] == _chat(smollm2.tokenizer, full[row["id"]]), (name, row["id"])
                checked += 1
    assert checked >= 20
