"""How long the estimator's replay of a step's allocations takes (estimator/timeline.py; serving:
estimator/serving_timeline.py), against the same estimate without it, for 1B to 70B models: the cost `memplan
estimate` and `verify` pay on every call.

    python benchmarks/replay_speed.py    # writes results/replay_speed.json

Median of 5 cold replays (the replay's cache cleared each time) and of 5 plain estimates, one process."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import memplan
from memplan.estimator import timeline

ROOT = Path(__file__).resolve().parent
CASES = [("llama-3.2-1b", dict(micro_batch=2, seq_len=2048, precision="bf16")),
         ("llama-3.1-8b", dict(micro_batch=2, seq_len=2048, precision="bf16", attn="eager")),
         ("llama-3.1-70b", dict(micro_batch=1, seq_len=4096, precision="bf16-pure", grad_ckpt="full")),
         (str(ROOT / "accuracy/configs/cohere2-small.json"), dict(micro_batch=2, seq_len=512, precision="bf16")),
         # layers that differ (activations.layer_kinds): each kind's lists built and replayed
         ("llama-4-scout-17b-16e", dict(micro_batch=1, seq_len=4096, precision="bf16-pure", grad_ckpt="full")),
         ("deepseek-v3", dict(micro_batch=1, seq_len=4096, precision="bf16-pure", grad_ckpt="full")),
         # serving (estimator/serving_timeline.py): generate's prefill and decode steps, the decode strided past
         # 1,024 block passes
         ("llama-3.2-1b", dict(task="infer", micro_batch=8, seq_len=1024, max_new_tokens=256, precision="bf16-pure")),
         ("llama-3.1-8b", dict(task="infer", micro_batch=4, seq_len=2048, max_new_tokens=512, precision="int4")),
         ("llama-3.1-70b", dict(task="infer", micro_batch=1, seq_len=4096, max_new_tokens=1024, precision="bf16-pure")),
         ("bert-large", dict(task="infer", micro_batch=32, seq_len=512, precision="fp16"))]


def median_s(call, repeats: int = 5, before=lambda: None) -> float:
    times = []
    for _ in range(repeats):
        before()
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    rows = []
    for model, kw in CASES:
        spec = memplan.resolve_model(model)
        memplan.estimate(spec, "h200", simulate=True, **kw)  # traces a traced model once, warms the caches
        plain = median_s(lambda: memplan.estimate(spec, "h200", simulate=False, **kw))
        replayed = median_s(lambda: memplan.estimate(spec, "h200", simulate=True, **kw),
                            before=timeline.replay.cache_clear)
        rows.append({"model": Path(model).stem if model.endswith(".json") else model, "workload": kw,
                     "estimate_s": round(plain, 4), "with_replay_s": round(replayed, 4)})
        print(f"{rows[-1]['model']:<20} estimate {plain:.4f} s, with the replay {replayed:.4f} s")
    out = ROOT / "results" / "replay_speed.json"
    out.write_text(json.dumps({"command": "python benchmarks/replay_speed.py", "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
