"""Paired per prompt: a new bench JSON against the shipped drafters' (same prompts), and DFlow/DFlash."""
import json
import statistics as st
import sys
from pathlib import Path

new, old = (json.loads(Path(p).read_text()) for p in sys.argv[1:3])
se = lambda xs: st.stdev(xs) / len(xs) ** .5
for ds in ("humaneval", "mtbench"):
    n, o = new["datasets"][ds]["modes"], old["datasets"][ds]["modes"]
    for m in ("dflash", "dflow"):
        d = [x - y for x, y in zip(n[m]["prompt_taus"], o[m]["prompt_taus"])]
        print(f"{ds:9s} {m:6s} new {n[m]['tau']:.3f}±{n[m]['tau_se']:.3f} {n[m]['speedup_vs_ar']:.2f}x match={n[m]['matches_ar']}"
              f" | old {o[m]['tau']:.3f} {o[m]['speedup_vs_ar']:.2f}x | new-old {st.mean(d):+.3f}±{se(d):.3f}")
    f = new["datasets"][ds]["dflow_vs_dflash"]
    r = [a / b for a, b in zip(n["dflow"]["prompt_taus"], n["dflash"]["prompt_taus"])]
    print(f"{ds:9s} dflow-dflash {f['tau_diff_mean']:+.3f}±{f['tau_diff_se']:.3f} ratio/prompt {st.mean(r):.3f}±{se(r):.3f}"
          f"  ar {n['ar']['tokens_per_s']:.1f} tok/s")
