"""memplan's serving speed against the decode steps a lent GPU measured (benchmarks/results/gpu_lease2/: the
serving grid's generate calls, `verify --task infer --device cuda`, and gpu_decode.py's synchronised steps with
and without cuDNN attention): each decode step's median beside search/cost.py's decode_step_seconds (+ cuDNN's
graph builds), and each generate call beside the estimate's step_time_s.

    python benchmarks/serving_speed.py            # the table
    python benchmarks/serving_speed.py --fit      # SERVING_LAUNCH_S and CUDNN_GRAPH_S from these runs

The fit solves, per decode step without cuDNN graph builds, the host time per kernel that makes the model's step
equal the measured one, and takes the median; then, per step with builds, the measured step less the model's,
per build, and takes the median.
"""
import argparse
import json
import pathlib
import statistics
import sys

import memplan
from memplan.api import resolve_gpu, resolve_spec
from memplan.search import cost

HERE = pathlib.Path(__file__).parent / "results" / "gpu_lease2"
# gpu_decode.py's runs: the prompt's forward gives one token, then 32 timed decode steps and 3 profiled ones
DECODE_TOKENS = 1 + 32 + 3
DECODE_GPU = "h200"  # decode.json's device, "NVIDIA H200"


def grid_steps() -> list[dict]:
    """The serving grid's generate calls: the decode forwards' median, the whole call (prefill included)."""
    out = []
    for path in sorted(HERE.glob("serve_grid*.json")):
        name, doc = path.name, json.loads(path.read_text())
        for r in doc["results"]:
            if r["returncode"] != 0 or not r["case"].get("max_new_tokens"):
                continue
            times = r["verify"]["forward_times_s"]
            case = {k: v for k, v in r["case"].items() if k != "model"}
            out.append({"model": r["case"]["model"], "case": case, "gpu": r["verify"]["gpu"], "cudnn": True,
                        "step": statistics.median(times[1:]), "call": sum(times),
                        "label": f"{name} {' '.join(f'{k}={v}' for k, v in r['case'].items())} "
                                 f"{'expandable' if r['expandable_segments'] else 'default'}"})
    return out


def decode_steps() -> list[dict]:
    """gpu_decode.py's runs: 32 synchronised decode steps after a prompt, with cuDNN attention allowed or not."""
    doc = json.loads((HERE / "decode.json").read_text())
    return [{"model": r["model"], "gpu": DECODE_GPU, "cudnn": r["cudnn_sdp"], "step": r["step_median_s"],
             "call": None, "case": dict(task="infer", seq_len=r["prompt"], micro_batch=r["micro_batch"],
                                        max_new_tokens=DECODE_TOKENS, attn=r["attn"]),
             "label": f"decode.json {r['model']} b={r['micro_batch']} {r['attn']} cudnn={r['cudnn_sdp']}"}
            for r in doc["runs"]]


def with_setup(run: dict) -> dict:
    """The run with its (spec, gpu, workload, cuDNN graph builds per decode step), estimated once."""
    return run | {"setup": _setup(run)}


def _setup(run: dict):
    spec, gpu = resolve_spec(run["model"], None, False), resolve_gpu(run["gpu"])
    w = memplan.estimate(spec, gpu, simulate=False, **run["case"]).workload
    steps = max(w.max_new_tokens - 1, 1)
    builds = cost.cudnn_rebuilds(spec, gpu, w) / steps if run["cudnn"] else 0.0  # per decode step
    return spec, gpu, w, builds


def predicted_step(run: dict, launch_s: float | None = None, graph_s: float = cost.CUDNN_GRAPH_S) -> float:
    spec, gpu, w, builds = run["setup"]
    return cost.decode_step_seconds(spec, gpu, w, launch_s) + builds * graph_s


def solve_launch(run: dict) -> float:
    """The host time per kernel at which the model's decode step is the measured one (bisection)."""
    lo, hi = 1e-7, 1e-3
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if predicted_step(run, mid, 0.0) < run["step"] else (lo, mid)
    return (lo * hi) ** 0.5


def fit(runs: list[dict]) -> tuple[float, float]:
    plain = [r for r in runs if r["setup"][3] == 0]
    launch = statistics.median(solve_launch(r) for r in plain)
    built = [r for r in runs if r["setup"][3] > 0]
    graph = statistics.median((r["step"] - predicted_step(r, launch, 0.0)) / r["setup"][3] for r in built)
    return launch, graph


def table(runs: list[dict]) -> str:
    lines = ["| run | decode step ms, predicted / measured | generate call s, predicted / measured |",
             "|---|---:|---:|"]
    errs = []
    for r in runs:
        p = predicted_step(r)
        errs.append(p / r["step"] - 1)
        call = ""
        if r["call"]:
            e = memplan.estimate(r["model"], r["gpu"], simulate=False, **r["case"])
            call = f"{e.step_time_s:.2f} / {r['call']:.2f} ({100 * (e.step_time_s / r['call'] - 1):+.0f} %)"
        lines.append(f"| {r['label']} | {1e3 * p:.1f} / {1e3 * r['step']:.1f} ({100 * errs[-1]:+.0f} %) | {call} |")
    med = statistics.median(abs(e) for e in errs)
    lines += ["", f"{len(runs)} decode steps: median |error| {100 * med:.0f} %, from {100 * min(errs):+.0f} to "
                  f"{100 * max(errs):+.0f} %"]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fit", action="store_true", help="print SERVING_LAUNCH_S and CUDNN_GRAPH_S fitted on the runs")
    args = ap.parse_args()
    runs = [with_setup(r) for r in grid_steps() + decode_steps()]
    if args.fit:
        launch, graph = fit(runs)
        print(f"SERVING_LAUNCH_S = {launch:.2e}  (search/cost.py: {cost.SERVING_LAUNCH_S:.2e})")
        print(f"CUDNN_GRAPH_S = {graph:.2e}  (search/cost.py: {cost.CUDNN_GRAPH_S:.2e})")
        return 0
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
