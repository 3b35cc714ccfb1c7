"""Mutation smoke check (a developer script, not part of the test run): plants one plausible bug at a
time into a temporary copy of the package and runs the fast test files that should catch it.

    python tests/mutations.py              # every mutant; a table of caught / SURVIVED at the end
    python tests/mutations.py --list       # the mutants and the tests each runs
    python tests/mutations.py -k flow      # mutants whose id contains "flow"
    python tests/mutations.py --json out.json

Each mutant is a one-line text substitution in one file of `dflow_trt/`; the script refuses one whose
`old` text is not found exactly once (re-point it after a rewrite rather than let it go stale). The
real files are never touched: the repository is mirrored into a temporary folder (`dflow_trt/` and
`tests/` copied, everything else linked), the substitution applied there, and `python -m pytest -x`
run from that folder (its `dflow_trt` comes first on sys.path; the script checks that it does).
A mutant is *caught* when pytest reports a failure, *SURVIVED* when every selected test passes.
Before the mutants, the unmutated copy runs the same selection once: it must pass (else every
mutant would look caught). Set OMP_NUM_THREADS yourself; runs are sequential.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The fast test files, cheapest first within each group (pytest -x stops at the first failure).
ACC = ["tests/test_acceptance.py"]
# Files whose slow decodes come first: their pure unit tests run as a group of their own before them.
# The exact-distribution tests decode thousands of rows (minutes each on a busy 2-core machine): only with --slow.
SAMPLING_EXACT = ["tests/test_sampling_exact.py", "-k", "not onnxruntime and not power"]
PROPS = ["tests/test_sampling_properties.py"]
FLOW = ["tests/test_flow.py"]
LOSSLESS = ["tests/test_lossless.py", "-k", "not verify_length_rule"]
LOSSLESS_UNIT = ["tests/test_lossless.py::test_verify_length_rule"]
LOSSLESS_HINTS = ["tests/test_lossless.py", "-k", "hints"]
EXACT = ["tests/test_exactness.py"]
ALTS_UNIT = ["tests/test_alternatives.py::test_accept_alternative_and_counts",
             "tests/test_alternatives.py::test_greedy_proposal_alternatives_are_the_runner_ups"]
ALTS = ["tests/test_alternatives.py", "-k", "not accept_alternative_and_counts and not runner_ups"]
TRAIN_UNIT = ["tests/test_training_matches_inference.py::"
              "test_block_loss_counts_only_the_accepted_prefix_and_skips_ignored_labels"]
TRAIN = ["tests/test_training_matches_inference.py", "-k", "not ddp and not block_loss"]


@dataclass
class Mutant:
    id: str
    file: str  # under dflow_trt/
    old: str
    new: str
    tests: list  # groups of pytest arguments, run in order until one fails
    what: str


M = Mutant
MUTANTS = [
    # ---------------------------------------------------------------- decoding/acceptance.py
    M("acc-resample-from-target", "decoding/acceptance.py",
      "residual = (target_at - padded_draft.gather(1, at)[:, 0]).clamp(min=0)",
      "residual = target_at.clone()",
      [ACC, SAMPLING_EXACT], "recovered token drawn from the target instead of norm(max(p - q, 0))"),
    M("acc-residual-sign", "decoding/acceptance.py",
      "residual = (target_at - padded_draft.gather(1, at)[:, 0]).clamp(min=0)",
      "residual = (padded_draft.gather(1, at)[:, 0] - target_at).clamp(min=0)",
      [ACC, SAMPLING_EXACT], "residual max(q - p, 0) instead of max(p - q, 0)"),
    M("acc-accept-prob-p", "decoding/acceptance.py",
      "accepted = ((u * p_draft < p_target) & proposed).long()",
      "accepted = ((u < p_target) & proposed).long()",
      [ACC, SAMPLING_EXACT], "accept with probability p instead of min(1, p/q)"),
    M("acc-sampled-count-no-cumprod", "decoding/acceptance.py",
      "num_accepted = accepted.cumprod(-1).sum(-1)  # [B]",
      "num_accepted = accepted.sum(-1)  # [B]",
      [ACC, SAMPLING_EXACT], "sampled: drafts accepted after a rejection still counted"),
    M("acc-bonus-wrong-slot", "decoding/acceptance.py",
      "target_at = target_probs.gather(1, at)[:, 0]  # [B, V]",
      "target_at = target_probs.gather(1, at.clamp(max=S - 2))[:, 0]  # [B, V]",
      [ACC, SAMPLING_EXACT], "bonus token drawn from the last draft's slot, not the slot after it"),
    M("acc-unproposed-keeps-draft", "decoding/acceptance.py",
      "padded_draft = torch.cat([draft_probs * proposed[..., None], draft_probs.new_zeros(B, 1, V)], 1)",
      "padded_draft = torch.cat([draft_probs, draft_probs.new_zeros(B, 1, V)], 1)",
      [ACC, SAMPLING_EXACT], "shortened block: the token after the last proposed draft from a residual"),
    M("acc-greedy-no-cumprod", "decoding/acceptance.py",
      "num_accepted = match.cumprod(-1).sum(-1)  # [B]",
      "num_accepted = match.sum(-1)  # [B]",
      [ACC, LOSSLESS_UNIT, LOSSLESS], "greedy: matches after the first mismatch counted"),
    M("acc-greedy-next-off-by-one", "decoding/acceptance.py",
      "next_token = target_ids.gather(1, num_accepted[:, None])[:, 0]  # [B]",
      "next_token = target_ids.gather(1, (num_accepted - 1).clamp(min=0)[:, None])[:, 0]  # [B]",
      [ACC, LOSSLESS_UNIT, LOSSLESS], "greedy: next token read one slot too early"),
    M("acc-proposed-off-by-one", "decoding/acceptance.py",
      "return torch.arange(draft_ids.shape[1], device=draft_ids.device)[None, :] < num_drafts[:, None]",
      "return torch.arange(draft_ids.shape[1], device=draft_ids.device)[None, :] <= num_drafts[:, None]",
      [ACC, LOSSLESS_UNIT, LOSSLESS], "a shortened row also accepts the first draft it did not propose"),
    M("acc-alternative-after-accept", "decoding/acceptance.py",
      "& _proposed(alt_ids, num_alts) & (num_accepted == 0)[:, None]",
      "& _proposed(alt_ids, num_alts)",
      [ALTS_UNIT, ALTS], "an alternative taken although the chain accepted draft 1"),
    # ---------------------------------------------------------------- decoding/sampling.py
    M("samp-temperature-twice", "decoding/sampling.py",
      "x = logits.float() / params.temperature",
      "x = logits.float() / params.temperature / params.temperature",
      [PROPS, SAMPLING_EXACT], "temperature applied twice"),
    M("samp-top-p-one-too-few", "decoding/sampling.py",
      "drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p",
      "drop_sorted = sorted_p.cumsum(-1) >= params.top_p",
      [PROPS, SAMPLING_EXACT], "top-p drops the token that reaches top_p (keeps one too few)"),
    M("samp-top-k-one-too-few", "decoding/sampling.py",
      "x = x.masked_fill(x < kth, float(\"-inf\"))",
      "x = x.masked_fill(x <= kth, float(\"-inf\"))",
      [PROPS, SAMPLING_EXACT], "top-k keeps k-1 tokens"),
    M("samp-draft-probs-not-zeroed", "decoding/sampling.py",
      "probs = probs_d.new_zeros(*probs_d.shape[:-1], vocab_size)",
      "probs = probs_d.new_full((*probs_d.shape[:-1], vocab_size), 1e-3)",
      [PROPS, SAMPLING_EXACT], "draft_probs not zero outside the draft vocabulary"),
    M("samp-confidence-of-sampled", "decoding/sampling.py",
      "return Proposal(draft_ids=draft_vocab[ids_d], draft_probs=probs, confidence=probs_d.amax(-1))",
      "return Proposal(draft_ids=draft_vocab[ids_d], draft_probs=probs, "
      "confidence=probs_d.gather(-1, ids_d[..., None])[..., 0])",
      [PROPS, SAMPLING_EXACT], "confidence = the sampled draft's own probability"),
    M("samp-alternatives-include-draft", "decoding/sampling.py",
      "alt_ids, alt_conf = draft_vocab[top.indices[:, 1:]], top.values[:, 1:]",
      "alt_ids, alt_conf = draft_vocab[top.indices[:, :-1]], top.values[:, :-1]",
      [PROPS, ALTS_UNIT, ALTS], "greedy runner-ups start with draft 1 itself"),
    # ---------------------------------------------------------------- decoding/flow.py
    M("flow-hint-when-sure", "decoding/flow.py",
      "take &= conf[:, k - 1] < trust",
      "take &= conf[:, k - 1] >= trust",
      [FLOW, PROPS], "hint taken where the drafter is at least `trust` sure"),
    M("flow-hint-reads-own-draft", "decoding/flow.py",
      "take = valid[:, j] & (seen[:, j] == ids[:, j - 1])  # [B]",
      "take = valid[:, j] & (seen[:, j] == ids[:, j])  # [B]",
      [FLOW, PROPS], "hint qualifies on the draft it replaces, not the one before it"),
    M("flow-hint-keeps-q", "decoding/flow.py",
      "probs[:, k - 1] = torch.where(take[:, None], onehot, probs[:, k - 1])",
      "probs[:, k - 1] = probs[:, k - 1]",
      [FLOW, PROPS, SAMPLING_EXACT], "a taken hint keeps the drafter's distribution (not a point mass)"),
    M("flow-hint-includes-draft-1", "decoding/flow.py",
      "for k in range(2, min(K, flow.prefix()) + 1):",
      "for k in range(1, min(K, flow.prefix()) + 1):",
      [FLOW, PROPS, LOSSLESS_UNIT, LOSSLESS], "draft 1 takes a hint (slot 0 held the rejected draft, j-1 wraps to -1)"),
    M("flow-carry-off-by-one", "decoding/flow.py",
      "src = num_accepted[:, None] + 1 + torch.arange(n, device=block_ids.device)  # [B, n] source slot",
      "src = num_accepted[:, None] + torch.arange(n, device=block_ids.device)  # [B, n] source slot",
      [FLOW, TRAIN_UNIT, TRAIN], "flow carries the last committed slot too (misaligned by one)"),
    M("flow-carry-hint-is-token", "decoding/flow.py",
      "hint_ids = block_target_ids.gather(1, src) * valid",
      "hint_ids = block_ids.gather(1, src) * valid",
      [FLOW, TRAIN_UNIT, TRAIN], "the hint is the token read, not the target's guess"),
    # ---------------------------------------------------------------- the loop's policy, verdict and transcript
    M("loop-hints-count-unsent", "decoding/policy.py",
      "return (self.hinted & sent).sum(1)",
      "return self.hinted.sum(1)",
      [LOSSLESS_HINTS, LOSSLESS], "hints_taken counts replaced drafts the shortened verify never sent"),
    M("loop-verified-ignores-alts", "decoding/loop.py",
      "self.verified += sent + sent_alts",
      "self.verified += sent",
      [ALTS_UNIT, ALTS, LOSSLESS], "verified_drafts leaves out the alternatives"),
    M("loop-alt-row-carries-flow", "decoding/acceptance.py",
      "return torch.where(self.took_alt, self.kept.shape[1] - 1, self.num_accepted)",
      "return self.num_accepted",
      [ALTS_UNIT, ALTS], "a row that took an alternative carries the chain's states as flow"),
    # ---------------------------------------------------------------- training/objective.py
    M("obj-labels-shifted", "training/objective.py",
      "pos = anchors[..., None] + torch.arange(1, S)  # [N, nb, S-1]",
      "pos = anchors[..., None] + torch.arange(2, S + 1)  # [N, nb, S-1]",
      [TRAIN_UNIT, TRAIN], "labels one token late"),
    M("obj-weights-gamma-times", "training/objective.py",
      "w = torch.exp(-torch.arange(S1, dtype=torch.float32) / gamma)  # position k=1..",
      "w = torch.exp(-torch.arange(S1, dtype=torch.float32) * gamma)  # position k=1..",
      [TRAIN_UNIT, TRAIN], "position weights exp(-(k-1)*gamma)"),
    M("obj-ignore-not-masked", "training/objective.py",
      "lab_d = to_draft[labels.clamp(min=0)].masked_fill(labels == IGNORE, IGNORE)  # [N, nb, S-1] draft ids",
      "lab_d = to_draft[labels.clamp(min=0)]  # [N, nb, S-1] draft ids",
      [TRAIN_UNIT, TRAIN], "positions past the sequence end trained on token 0"),
    M("obj-context-sees-anchor-slot", "training/objective.py",
      "mask = torch.arange(T)[None, None, :] < L[..., None]  # [N*G, R, T]: strictly before the anchor",
      "mask = torch.arange(T)[None, None, :] <= L[..., None]  # [N*G, R, T]: strictly before the anchor",
      [TRAIN_UNIT, TRAIN], "drafter context includes the anchor position's state"),
    M("obj-verifier-accept-no-cumprod", "training/objective.py",
      "accepted = (drafts == labels).long().cumprod(-1).sum(-1)  # [N, nb]",
      "accepted = (drafts == labels).long().sum(-1)  # [N, nb]",
      [TRAIN_UNIT, TRAIN], "self-conditioning: drafts after the first miss counted as accepted"),
    M("obj-stats-no-cumprod", "training/objective.py",
      "accepted = hit.cumprod(-1).sum(-1)[valid]",
      "accepted = hit.sum(-1)[valid]",
      [TRAIN_UNIT, TRAIN], "reported training tau counts hits after a miss"),
]


def mirror(dst: Path) -> None:
    """dst/ = the repository: dflow_trt/ and tests/ copied (the drafters' weights linked), the rest linked."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for entry in ROOT.iterdir():
        if entry.name in (".git", ".venv", "runs"):
            continue
        if entry.name == "dflow_trt":
            shutil.copytree(entry, dst / entry.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "drafters"))
            (dst / "dflow_trt" / "drafters").symlink_to(entry / "drafters")
        elif entry.name == "tests":
            shutil.copytree(entry, dst / entry.name, ignore=skip)
        else:
            (dst / entry.name).symlink_to(entry)


def check_mutant(m: Mutant) -> None:
    text = (ROOT / "dflow_trt" / m.file).read_text()
    n = text.count(m.old)
    if n != 1:
        raise SystemExit(f"mutant {m.id}: its text occurs {n} times in dflow_trt/{m.file} (want 1); re-point it")


def run_tests(cwd: Path, groups, timeout: float) -> tuple[str, float, str]:
    """-> ("pass" | "fail" | "error" | "timeout", seconds, last lines of output)."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=str(cwd))
    env.setdefault("OMP_NUM_THREADS", "1")
    t0, tail = time.time(), ""
    for args in groups:
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "not slow", *args]
        try:
            r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                               timeout=max(1.0, timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            return "timeout", time.time() - t0, f"{args[0]} timed out"
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-3:])
        if r.returncode == 1:
            return "fail", time.time() - t0, f"{args[0]}: {tail}"
        if r.returncode not in (0, 5):  # 5: nothing selected
            return "error", time.time() - t0, f"{args[0]} rc {r.returncode}: {tail}"
    return "pass", time.time() - t0, tail


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", default="", help="only mutants whose id contains this (comma-separated: any of them)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per mutant (all its test groups)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    ap.add_argument("--json", default="", help="write the results here")
    ap.add_argument("--slow", action="store_true", help="also run test_sampling_exact.py's decodes (where listed)")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run kills its pytest and removes its copy
    chosen = [m for m in MUTANTS if any(k in m.id for k in a.k.split(","))]
    if not a.slow:
        for m in chosen:
            m.tests = [g for g in m.tests if g is not SAMPLING_EXACT]
    for m in chosen:
        check_mutant(m)
    if a.list:
        for m in chosen:
            print(f"{m.id:34} {m.file:26} {m.what}\n{'':34} tests: {' | '.join(' '.join(g) for g in m.tests)}")
        return
    results = []
    with tempfile.TemporaryDirectory(prefix="dflow-mutants-") as tmp:
        work = Path(tmp) / "repo"
        work.mkdir()
        mirror(work)
        probe = subprocess.run([sys.executable, "-c", "import dflow_trt; print(dflow_trt.__file__)"], cwd=work,
                               capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(work)))
        if not probe.stdout.strip().startswith(str(work)):
            raise SystemExit(f"the copy's package is not the one imported: {probe.stdout or probe.stderr}")
        if not a.no_baseline:
            groups = []
            for m in chosen:
                groups += [g for g in m.tests if g not in groups]
            status, secs, tail = run_tests(work, groups, a.timeout * 2)
            print(f"baseline (unmutated): {status} in {secs:.0f} s", flush=True)
            if status != "pass":
                raise SystemExit(f"the unmutated package fails its tests; fix that first:\n{tail}")
        for m in chosen:
            path = work / "dflow_trt" / m.file
            original = path.read_text()
            path.write_text(original.replace(m.old, m.new, 1))
            try:
                status, secs, tail = run_tests(work, m.tests, a.timeout)
            finally:
                path.write_text(original)
            verdict = {"fail": "caught", "pass": "SURVIVED"}.get(status, status)
            results.append({"id": m.id, "file": m.file, "what": m.what, "verdict": verdict, "seconds": round(secs),
                            "detail": tail})
            print(f"{verdict:9} {secs:6.0f} s  {m.id:34} {m.what}", flush=True)
            if verdict != "caught":
                print("          " + tail.replace("\n", "\n          "), flush=True)
    caught = sum(r["verdict"] == "caught" for r in results)
    print(f"\n{caught}/{len(results)} mutants caught; survivors: "
          f"{', '.join(r['id'] for r in results if r['verdict'] != 'caught') or 'none'}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
