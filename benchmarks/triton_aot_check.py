"""Ahead-of-time compile check of memplan's Triton kernels for NVIDIA targets, without a GPU.

Compiles every autotune config (attention) / every launch tile (gated MLP) of the kernels in
src/memplan/kernels/triton_attention.py and src/memplan/kernels/triton_mlp.py with
triton.compile(ASTSource, target=GPUTarget) for sm_80 and sm_90, using Triton's bundled ptxas (the one
the JIT uses at run time), and reports per compile: ok / error, dynamic shared memory (metadata.shared,
what the launcher checks against the device's opt-in limit), registers and spill bytes from `ptxas -v`.

The signature and the divisibility / ==1 specialisation of each argument are derived exactly as
JITFunction.run does it (native_specialize_impl), from representative arguments: q/k/v (b, hq|hkv, s, d)
views of (b, s, h, d) storage (as transformers produces them), dk/dv/dq contiguous, int8 key padding
mask, SQ = SK = 4096.

Usage:  env -u TRITON_INTERPRET python -W ignore benchmarks/triton_aot_check.py [--jobs 2] [--json out.json] [--only attn|mlp]
        [--variants worst|plain|all] [--match 'M32 N32'] [--dtypes fp16,bf16] [--head-dims 256]
  --variants: worst = IS_CAUSAL and HAS_KPM (default), plain = neither, all = the 4 combinations.
Exit status 1 when a compile fails or a (kernel, arch, dtype, head dim, variant) has no config that fits
(the autotuner skips configs over the limit, but fails when none is left). fp32 at head dim 256 is the
slow part (ptxas spends tens of seconds to minutes on each heavily spilling tile).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time
import traceback

if os.environ.get("TRITON_INTERPRET"):
    sys.exit("unset TRITON_INTERPRET: this checks real NVIDIA compiles, not the interpreter")
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="memplan_aot_cache_"))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402

from memplan.kernels import triton_attention as ta  # noqa: E402
from memplan.kernels import triton_mlp as tm  # noqa: E402

assert not ta.INTERPRETED and not tm.INTERPRETED, "kernels were decorated for the interpreter"

triton.knobs.compilation.always_compile = True  # every compile runs ptxas, so its -v log is there
triton.knobs.nvidia.dump_ptxas_log = True  # make_cubin prints the ptxas -v log: captured below

# opt-in dynamic shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin)
SMEM_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
ARCHS = (80, 90)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _spec(arg):
    """(signature type, attr) the JIT would give this argument."""
    return native_specialize_impl(BaseBackend, arg, False, True, True)


def _source(fn, args: dict, constexprs: dict):
    """ASTSource for jit fn from name -> runtime value (non-constexpr) and name -> constexpr value."""
    signature, consts, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            consts[p.name] = constexprs[p.name]
            continue
        ty, attr = _spec(args[p.name])
        signature[p.name] = ty
        if ty == "constexpr":  # an int equal to 1 (e.g. a unit stride): specialised as the JIT does
            consts[p.name] = attr
        elif isinstance(attr, str):
            a = BaseBackend.parse_attr(attr)
            if a:
                attrs[(i,)] = a
    return triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)


def _ptxas_stats(log: str):
    regs = re.findall(r"Used (\d+) registers", log)
    st = re.findall(r"(\d+) bytes spill stores", log)
    ld = re.findall(r"(\d+) bytes spill loads", log)
    stack = re.findall(r"(\d+) bytes stack frame", log)
    return (int(regs[-1]) if regs else None, int(st[-1]) if st else None, int(ld[-1]) if ld else None,
            int(stack[-1]) if stack else None)


def compile_one(job: dict) -> dict:
    fn = {"fwd": ta._fwd_kernel, "dkdv": ta._bwd_dkdv_kernel, "dq": ta._bwd_dq_kernel, "pre": ta._bwd_preprocess_kernel,
          "mlp_fwd": tm._gated_fwd_kernel, "mlp_bwd": tm._gated_bwd_kernel}[job["kernel"]]
    src = _source(fn, job_args(job), job["constexprs"])
    out = dict(job)
    buf = io.StringIO()
    t0 = time.time()
    try:
        with contextlib.redirect_stdout(buf):
            k = triton.compile(src, target=GPUTarget("cuda", job["arch"], 32), options=job["options"])
        out["ok"] = True
        out["shared"] = k.metadata.shared
        out["regs"], out["spill_st"], out["spill_ld"], out["stack"] = _ptxas_stats(buf.getvalue())
        out["fits"] = k.metadata.shared <= SMEM_LIMIT[job["arch"]]
        out["secs"] = round(time.time() - t0, 1)
    except Exception as e:  # noqa: BLE001
        out["ok"] = False
        msg = str(e).strip().splitlines()
        out["error"] = f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]
        out["trace"] = traceback.format_exc()[-2000:]
    return out


# -- representative arguments ---------------------------------------------------------------------------

B, HQ, HKV, S = 2, 32, 8, 4096


def _t(dtype):
    return torch.empty(64, dtype=dtype)  # only dtype and 16-byte alignment matter to the signature


def _sdpa_strides(h, d):  # (b, h, s, d) view of (b, s, h, d) storage
    return (S * h * d, d, h * d, 1)


def _contig_strides(h, d):  # (b, h, s, d) contiguous
    return (h * S * d, S * d, d, 1)


def job_args(job):
    kind, d, dt = job["kernel"], job.get("head_dim"), DTYPES[job["dtype"]]
    if kind in ("fwd", "dkdv", "dq", "pre"):
        x, f32 = _t(dt), _t(torch.float32)
        kpm = _t(torch.int8) if job.get("kpm") else x  # as _common(): q stands in when there is no mask
        q_s, kv_s, o_s = _sdpa_strides(HQ, d), _sdpa_strides(HKV, d), _sdpa_strides(HQ, d)
        do_s = _contig_strides(HQ, d)
        tail = dict(scale=d ** -0.5, H=HQ, G=HQ // HKV, SQ=S, SK=S, OFF=0, HEAD_DIM=d, skpm=S)
        names = lambda pre, s: dict(zip((pre + c for c in "bhmd"), s))  # noqa: E731
        qkv = {**dict(zip(("sqb", "sqh", "sqm", "sqd"), q_s)), **dict(zip(("skb", "skh", "skn", "skd"), kv_s)),
               **dict(zip(("svb", "svh", "svn", "svd"), kv_s))}
        if kind == "fwd":
            return dict(Q=x, K=x, V=x, O=x, LSE=f32, KPM=kpm, **qkv, **names("so", o_s), **tail)
        if kind == "pre":
            return dict(O=x, DO=x, D=f32, **names("so", o_s), **names("sdo", do_s), H=HQ, SQ=S, HEAD_DIM=d)
        common = dict(Q=x, K=x, V=x, DO=x, LSE=f32, D=f32, KPM=kpm, **qkv, **names("sdo", do_s), **tail)
        if kind == "dkdv":
            kv_c = _contig_strides(HKV, d)
            return dict(common, DK=x, DV=x, **dict(zip(("sdkb", "sdkh", "sdkn", "sdkd"), kv_c)),
                        **dict(zip(("sdvb", "sdvh", "sdvn", "sdvd"), kv_c)))
        return dict(common, DQ=x, **names("sdq", _contig_strides(HQ, d)))
    # gated MLP: rows x cols halves of a fused gate_up projection (row stride 2 * cols)
    rows, cols = 8192, job["cols"]
    x = _t(dt)
    if kind == "mlp_fwd":
        return dict(g_ptr=x, u_ptr=x, o_ptr=x, rows=rows, cols=cols, g_stride=2 * cols, u_stride=2 * cols)
    return dict(g_ptr=x, u_ptr=x, do_ptr=x, dg_ptr=x, du_ptr=x, rows=rows, cols=cols, g_stride=2 * cols,
                u_stride=2 * cols, do_stride=cols)


def attention_jobs(variants):
    tuned = {"fwd": ta._fwd_tuned, "dkdv": ta._dkdv_tuned, "dq": ta._dq_tuned}
    jobs = []
    for arch in ARCHS:
        for dtype in ("fp16", "bf16", "fp32"):
            for d in (64, 80, 128, 256):
                block_d = max(16, triton.next_power_of_2(d))
                # as _common(): fp32 inputs get an ieee fp32 product, half inputs "tf32" (ignored for half)
                prec = "ieee" if dtype == "fp32" else "tf32"
                for causal, kpm in variants:
                    base = dict(IS_CAUSAL=causal, HAS_KPM=kpm, PRECISION=prec, INTERP=False, BLOCK_D=block_d)
                    for name, at in tuned.items():
                        for ci, cfg in enumerate(at.configs):
                            kw = cfg.all_kwargs()
                            opts = {k: kw.pop(k) for k in list(kw) if k in ("num_warps", "num_stages", "num_ctas",
                                                                           "maxnreg")}
                            jobs.append(dict(kernel=name, cfg=ci, cfg_str=f"M{kw['BLOCK_M']} N{kw['BLOCK_N']} "
                                             f"w{opts['num_warps']} s{opts['num_stages']}", arch=arch, dtype=dtype,
                                             head_dim=d, causal=causal, kpm=kpm, constexprs=dict(base, **kw),
                                             options=opts))
                # the untuned preprocess kernel: BLOCK_M = 64, default num_warps / num_stages
                if (causal, kpm) == variants[0]:
                    jobs.append(dict(kernel="pre", cfg=0, cfg_str="M64 w4 s3 (fixed)", arch=arch, dtype=dtype,
                                     head_dim=d, causal=None, kpm=None, constexprs=dict(BLOCK_D=block_d, BLOCK_M=64),
                                     options={}))
    return jobs


def mlp_jobs():
    jobs = []
    for arch in ARCHS:
        for dtype in ("fp32", "fp16", "bf16"):
            for act_name, act in tm.ACTS.items():
                for cols in (2 ** i for i in range(4, 11)):  # block_n 16 .. 1024 (>= 1024 cols: 1024)
                    _, bm, bn = tm._grid(8192, cols)
                    for kernel in ("mlp_fwd", "mlp_bwd"):
                        jobs.append(dict(kernel=kernel, cfg=bn, cfg_str=f"M{bm} N{bn} w4 s3 ({act_name})", arch=arch,
                                         dtype=dtype, cols=cols, act=act_name,
                                         constexprs=dict(ACT=act, BLOCK_M=bm, BLOCK_N=bn), options={}))
    return jobs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", choices=("attn", "mlp"), default=None)
    ap.add_argument("--variants", choices=("worst", "plain", "all"), default="worst")
    ap.add_argument("--match", default=None, help="only configs whose label contains this, e.g. 'M32 N32'")
    ap.add_argument("--dtypes", default=None, help="comma list, e.g. fp16,bf16")
    ap.add_argument("--head-dims", default=None, help="comma list, e.g. 256 (attention only)")
    a = ap.parse_args()
    variants = {"worst": [(True, True)], "plain": [(False, False)],
                "all": [(True, True), (False, False), (True, False), (False, True)]}[a.variants]
    jobs = ([] if a.only == "mlp" else attention_jobs(variants)) + ([] if a.only == "attn" else mlp_jobs())
    if a.match:
        jobs = [j for j in jobs if a.match in j["cfg_str"]]
    if a.dtypes:
        jobs = [j for j in jobs if j["dtype"] in a.dtypes.split(",")]
    if a.head_dims:
        jobs = [j for j in jobs if "head_dim" not in j or str(j["head_dim"]) in a.head_dims.split(",")]
    print(f"{len(jobs)} compiles, cache {os.environ['TRITON_CACHE_DIR']}", file=sys.stderr, flush=True)
    results = []
    with cf.ProcessPoolExecutor(a.jobs) as ex:
        for i, r in enumerate(ex.map(compile_one, jobs)):
            results.append(r)
            status = (f"smem {r['shared']:>6} regs {r['regs']} spill {r['spill_st']}/{r['spill_ld']}"
                      + ("" if r["fits"] else "  OVER LIMIT")) if r["ok"] else r["error"]
            print(f"[{i + 1}/{len(jobs)}] sm_{r['arch']} {r['kernel']:<7} {r['dtype']} "
                  f"d={r.get('head_dim', r.get('cols'))} {r['cfg_str']:<22} "
                  f"{'' if r.get('causal') is None else 'c%d k%d ' % (r['causal'], r['kpm'])}{status}",
                  flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    bad = [r for r in results if not r["ok"] or not r["fits"]]
    print(f"\n{len(results) - len(bad)}/{len(results)} compile and fit; {len(bad)} fail or exceed", flush=True)
    # a (kernel, arch, dtype, head dim, variant) with no usable autotune config fails at run time
    groups = {}
    for r in results:
        if r["kernel"] in ("fwd", "dkdv", "dq"):
            g = (r["kernel"], r["arch"], r["dtype"], r["head_dim"], r["causal"], r["kpm"])
            groups[g] = groups.get(g, False) or (r["ok"] and r["fits"])
    dead = [g for g, ok in groups.items() if not ok]
    print("cases with no usable config:", dead or "none", flush=True)
    return 1 if dead or any(not r["ok"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
