"""How often a reduced-vocabulary drafter proposes the same tokens over the target's full LM head.

z-lab's DFlash layout (what TensorRT-LLM, vLLM and SGLang load) has no reduced draft vocabulary,
so a drafter exported there drafts over the full head. This measures what that changes, on
held-out prompts (MT-Bench, HumanEval) and the target's own greedy continuations.

    python scripts/zlab_vocab_agreement.py [--target smollm2-135m] [--drafter DIR] [--prompts 8] [--tokens 48]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> int:
    import torch

    from dflow_trt.decoding.loop import generate
    from dflow_trt.drafter.defaults import load_target_and_drafter
    from dflow_trt.export.fp8_check import heldout_prompts
    from dflow_trt.training.objective import Batch, drafter_blocks, sample_anchors, target_states

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", default=None, help="drafter folder (default: the target's shipped dflash one)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--anchors", type=int, default=16)
    a = ap.parse_args()
    target, m = load_target_and_drafter(a.target, a.drafter, "dflash")
    if m.config.draft_vocab_size is None:
        print("the drafter already drafts over the full vocabulary: nothing to compare")
        return 0
    prompts = heldout_prompts(target, a.prompts)
    seqs = [p + r for p, r in zip(prompts, generate(target, None, prompts, "ar", a.tokens, stop_token_ids=()).token_ids)]
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
    batch = Batch(ids=ids, lens=torch.tensor([len(s) for s in seqs]), prompt_lens=torch.tensor([len(p) for p in prompts]))
    with torch.no_grad():
        taps, _ = target_states(target, batch, keep_cache=False)
        anchors = sample_anchors(batch, a.anchors, m.config.block_size, torch.Generator().manual_seed(0))
        reduced = m.draft_vocab[drafter_blocks(m, taps, batch, anchors, None).argmax(-1)]
        m.draft_logits = lambda h: h @ m.lm_head_weight.T  # what z-lab's layout computes
        full = drafter_blocks(m, taps, batch, anchors, None).argmax(-1)
    same = (reduced == full).float()
    print(f"same greedy proposal: {same.mean().item():.4f} of {same.numel()} block positions "
          f"(first position {same[..., 0].mean().item():.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
