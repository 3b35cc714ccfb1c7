"""`dflow-trt bench zlab-vocab`: how often a reduced-vocabulary drafter proposes the same tokens over
the target's full LM head.

z-lab's DFlash layout (what TensorRT-LLM, vLLM and SGLang load) has no reduced draft vocabulary,
so a drafter exported there drafts over the full head. This measures what that changes, on
held-out prompts (MT-Bench, HumanEval) and the target's own greedy continuations.
"""

from __future__ import annotations

from . import report


def run(target: str = "smollm2-135m", drafter: str | None = None, prompts: int = 8, tokens: int = 48,
        anchors: int = 16, json_out: str | None = None) -> int:
    import torch

    from ..decoding.loop import generate

    from ..decoding.options import DecodeOptions
    from ..drafter.defaults import load_target_and_drafter
    from ..export.fp8_check import heldout_prompts
    from ..training.objective import Batch, drafter_blocks, sample_anchors, target_states

    con = report.console()
    t, m = load_target_and_drafter(target, drafter, "dflash", warn=lambda s: con.print(f"[yellow]{s}"))
    out = {"target": target, "drafter": m.config.extra.get("name", drafter or "untrained"),
           "draft_vocab_size": m.config.draft_vocab_size}
    if m.config.draft_vocab_size is None:
        con.print("the drafter already drafts over the full vocabulary: nothing to compare")
        if json_out:
            con.print(f"wrote {report.write_json(json_out, out)}")
        return 0
    ps = heldout_prompts(t, prompts)
    options = DecodeOptions(mode="ar", max_new_tokens=tokens, stop_token_ids=())
    seqs = [p + r for p, r in zip(ps, generate(t, None, ps, options).token_ids)]
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
    batch = Batch(ids=ids, lens=torch.tensor([len(s) for s in seqs]), prompt_lens=torch.tensor([len(p) for p in ps]))
    with torch.no_grad():
        taps, _ = target_states(t, batch, keep_cache=False)
        where = sample_anchors(batch, anchors, m.config.block_size, torch.Generator().manual_seed(0))
        reduced = m.draft_vocab[drafter_blocks(m, taps, batch, where, None).argmax(-1)]
        m.draft_head = lambda: m.lm_head_weight  # what z-lab's layout computes: the full LM head [V, H]
        full = drafter_blocks(m, taps, batch, where, None).argmax(-1)  # target token ids
    same = (reduced == full).float()
    out.update(prompts=len(ps), tokens=tokens, anchors_per_seq=anchors, positions=same.numel(),
               same_proposal=same.mean().item(), same_first_position=same[..., 0].mean().item())
    con.print(f"same greedy proposal: {out['same_proposal']:.4f} of {out['positions']} block positions "
              f"(first position {out['same_first_position']:.4f})")
    if json_out:
        con.print(f"wrote {report.write_json(json_out, out)}")
    return 0
