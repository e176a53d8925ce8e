#!/usr/bin/env bash
# What a lent GPU is asked to measure, in calls of the device tool (benchmarks/README.md):
#   run: bash benchmarks/gpu_lease.sh        carry: .whl        timeout_s: 600   (about 550 s)
#   run: bash benchmarks/gpu_lease.sh wide   carry: .whl        timeout_s: 385   (gpu_grid.py's wide grid only)
#   run: bash benchmarks/gpu_lease.sh profile  carry: .whl      timeout_s: 240   (gpu_profile.py on the steps the
#        first lease found under-predicted: T5, GPT-2, bert-large bf16, with Llama-3.2-1B as the GPU-bound baseline)
#   run: bash benchmarks/gpu_lease.sh serve  carry: .whl        timeout_s: 590   (the second lease's one call: the
#        serving grid, the profiles of T5, GPT-2 and bert-large, then the wide grid's last 3 cases; 8 files)
#   run: bash benchmarks/gpu_lease.sh recheck  carry: .whl      timeout_s: 560   (the serving grid alone, with
#        verify building the weights in their dtype on the GPU (docs/verify.md); the third lease ran it inside
#        `suite`: results/gpu_lease3/serve_grid.json, a median 1.4 % off the replay)
#   run: bash benchmarks/gpu_lease.sh suite  carry: .whl        timeout_s: 540   (the third lease's one call: the
#        accuracy suite's cases furthest from the allocator simulation on the real allocator, two shards side by
#        side, beside the serving grid's recheck, and the allocator's own record of the two worst; results/gpu_lease3/;
#        the third lease's call left 12 files of which 8 came back, and reran shard 1 for its own: now 7 files)
# The machine's image holds torch and most of memplan's needs but not pydantic, and an older transformers:
# .whl (ignored) travels with the tree: `pip download --no-deps --python-version 3.12 --only-binary=:all: --platform
# manylinux2014_x86_64 -d .whl pydantic pydantic_core annotated_types typing_inspection typing_extensions
# transformers peft`, each at this machine's version (peft for the LoRA cases; the third lease's .whl: 17 MiB).
# Each step has its own time limit and writes under $OUT as it goes, so a step that fails or runs long leaves the
# others' results.
set -u
OUT=${OUT:-benchmarks/results/gpu_lease}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:src
else
  export PYTHONPATH=src
fi
export PYTHONUNBUFFERED=1
if [ "${1:-}" = wide ]; then
  exec timeout 370 python3 benchmarks/gpu_grid.py --grid wide --max-seconds 330 --out "$OUT/gpu_grid_wide"
fi
env_record() {  # the machine and the versions a lease ran with
  { nvidia-smi; python3 -c "import torch, transformers, sys; print(sys.version, torch.__version__, torch.version.cuda,
transformers.__version__, torch.cuda.get_device_name())"; } >"$OUT/env.txt" 2>&1
}
profile() {  # model seq_len micro_batch precision
  timeout 50 python3 benchmarks/gpu_profile.py --model "$1" --seq-len "$2" --micro-batch "$3" --precision "$4" \
    --attn sdpa --out "$OUT/profile_$1.json"
}
if [ "${1:-}" = serve ]; then
  env_record
  echo "== serving grid"
  timeout 270 python3 benchmarks/gpu_grid.py --grid serve --max-seconds 230 --out "$OUT/serve_grid"
  echo "== profiles"
  profile t5-base 512 8 bf16; profile gpt2 1024 8 fp16; profile bert-large 512 8 bf16
  echo "== the wide grid's last 3"
  timeout 110 python3 benchmarks/gpu_grid.py --grid wide --first 9 --max-seconds 80 --out "$OUT/gpu_grid_wide_tail"
  exit 0
fi
if [ "${1:-}" = suite ]; then  # three processes share the GPU: step times and NVML's used are contended
  env_record
  for i in 0 1; do
    timeout 480 python3 benchmarks/gpu_grid.py --grid suite --shard $i/2 --max-seconds 420 \
      --out "$OUT/suite_grid_$i" >"$OUT/suite_grid_$i.log" 2>&1 &
  done
  timeout 480 python3 benchmarks/gpu_grid.py --grid serve --max-seconds 400 --out "$OUT/serve_grid" \
    >"$OUT/serve_grid.log" 2>&1 &
  wait
  for c in "llama4 bf16-pure sdpa false" "gemma3 bf16 eager true"; do
    set -- $c
    conf=""; [ "$4" = true ] && conf=expandable_segments:True
    PYTORCH_ALLOC_CONF=$conf PYTORCH_CUDA_ALLOC_CONF=$conf timeout 25 python3 benchmarks/gpu_memory_history.py \
      "$OUT/hist_$1.pkl.gz" model=benchmarks/accuracy/configs/$1-small.json micro_batch=2 seq_len=512 \
      optim=adamw_torch_fused precision=$2 attn=$3 grad_ckpt=none expandable_segments=$4 >/dev/null 2>&1
  done
  # the device tool returns 8 files a call: the logs in one, the tables left to gpu_grid.py --summary
  for f in "$OUT"/*_grid*.log; do echo "== $f"; cat "$f"; done >"$OUT/grids.log" && rm -f "$OUT"/*_grid*.log
  rm -f "$OUT"/*.md
  tail -n 3 "$OUT/grids.log"
  exit 0
fi
if [ "${1:-}" = recheck ]; then
  env_record
  exec timeout 540 python3 benchmarks/gpu_grid.py --grid serve --max-seconds 480 --out "$OUT/serve_grid"
fi
if [ "${1:-}" = profile ]; then
  for c in "t5-base 512 8 bf16" "gpt2 1024 8 fp16" "bert-large 512 8 bf16" "llama-3.2-1b 1024 4 bf16"; do
    set -- $c
    timeout 55 python3 benchmarks/gpu_profile.py --model "$1" --seq-len "$2" --micro-batch "$3" --precision "$4" \
      --attn sdpa --out "$OUT/profile_$1.json"
  done
  exit 0
fi
env_record
echo "== gpu_grid"
timeout 330 python3 benchmarks/gpu_grid.py --max-seconds 270 --out "$OUT/gpu_grid"
echo "== gpu_ops"
timeout 60 python3 benchmarks/gpu_ops.py --out "$OUT/gpu_ops.json"
echo "== kernel_speed"
timeout 75 python3 benchmarks/kernel_speed.py --out "$OUT/kernel_speed.json"
echo "== cuda tests"
timeout 80 python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_attention.py tests/test_verify.py \
  tests/test_triton_cross_entropy.py tests/test_mlp.py >"$OUT/cuda_tests.txt" 2>&1
tail -5 "$OUT/cuda_tests.txt"
