#!/usr/bin/env bash
# The GPU checks, as one run on a lent CUDA machine (~10 minutes): the CUDA offload tests (packed
# quantized weights included), the device tests, the offload benchmark, and CUDA decode speed with f16
# and with packed Q8_0 / Q4_0 weights (issue 16). Every step runs whatever the previous ones did; each
# step's output goes to its own file and its exit code to rc.txt, so one failure never hides the rest.
#
#     bash tools/gpu_check.sh          # outputs under $OUT if set, else ./gpu-check-out
set -u
cd "$(dirname "$0")/.."
out="${OUT:-./gpu-check-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # run from this checkout, installed or not
: > "$out/rc.txt"

step() {  # step NAME TIMEOUT_S COMMAND...: run it, keep its output and exit code, never stop here
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*" | tee -a "$out/summary.txt"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name $rc" >> "$out/rc.txt"
  tail -n 25 "$out/$name.log" | tee -a "$out/summary.txt"
  echo "== $name: rc $rc" | tee -a "$out/summary.txt"
}

# torch with CUDA is expected to be there already: install nothing heavy, say what is present.
step torch 60 python -c "import torch; print(torch.__version__, torch.cuda.is_available()); \
print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')"
step nvidia_smi 30 nvidia-smi
step tests 240 python -m pytest -q -rs tests/test_cuda_offload.py tests/test_devices.py
step bench_offload 120 python bench/offload.py --reps 2
# decode on the GPU: every layer offloaded; llama.cpp runs only if a CUDA build of llama-cpp-python is there
step decode_f16 90 python bench/decode.py --ngl -1 --dtype f16 --no-transformers --reps 2 --new 64
step decode_q8_0 90 python bench/decode.py --ngl -1 --weights Q8_0 --reps 2 --new 64
step decode_q4_0 90 python bench/decode.py --ngl -1 --weights Q4_0 --reps 2 --new 64

echo "exit codes (step rc):" | tee -a "$out/summary.txt"
tee -a "$out/summary.txt" < "$out/rc.txt"
! grep -qv ' 0$' "$out/rc.txt"
