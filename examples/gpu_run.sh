#!/usr/bin/env bash
# The GPU checks of DESIGN §8 in one prepared run on the lent H200: gpu-marked tests, then the GPU benchmarks.
# Outputs (logs, one per part) land in $OUT. Parts run in the order given; default: tests kernels llm sd15.
#
# Once, here (the device image lacks diffusers and the serving stack; see ../shared/gpu-wheels/README.md):
#   echo /.whl/ >> .git/info/exclude && mkdir -p .whl && cp ../shared/gpu-wheels/*.whl .whl/
# Then a device call with carry [".whl"] and the command:
#   bash examples/gpu_run.sh                      # tests, kernels, llm, sd15 (meant to fit one 10-minute call)
#   bash examples/gpu_run.sh flux                 # the FLUX.1-size benchmark alone (builds 12B weights: long)
set -u -o pipefail
OUT=${OUT:-/tmp/mmserve-gpu}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TRITON_INTERPRET=0
export MMSERVE_BENCH=${MMSERVE_BENCH:-/tmp/mmserve-bench}  # real-size random checkpoints are built here
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; python3 -c \
  "import torch, triton, transformers, diffusers; print('torch', torch.__version__, 'triton', triton.__version__,
   'transformers', transformers.__version__, 'diffusers', diffusers.__version__)"; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

run() {  # run NAME SECONDS CMD...: one part with its own time limit, its output kept in $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  echo "== $name: $*"
  local started=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - started)) s" | tee -a "$OUT/$name.log"
}

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests kernels llm sd15)
for part in "${parts[@]}"; do
  case $part in
    tests) run gpu_tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_graph_runner.py \
             tests/test_kernels.py tests/test_compile.py tests/test_llm_paged_attention.py ;;
    kernels) run bench_kernels 60 python3 examples/bench_kernels.py ;;
    llm) run bench_llm 240 python3 examples/bench_gpu_llm.py --out "$MMSERVE_BENCH" --batch 1,16 --prompt 128 \
           --output 64 ;;
    sd15) run bench_sd15 300 python3 examples/bench_gpu_diffusion.py --out "$MMSERVE_BENCH" --models sd15 \
            --variants eager,graphs,cache --concurrency 16 --sequential 4 --repeats 2 ;;
    sd15-compile) run bench_sd15_compile 400 python3 examples/bench_gpu_diffusion.py --out "$MMSERVE_BENCH" \
                    --models sd15 --variants compile,diffusers-compile --repeats 2 --sequential 1 ;;
    flux) run bench_flux 590 python3 examples/bench_gpu_diffusion.py --out "$MMSERVE_BENCH" --models flux \
            --variants eager,graphs,cache --concurrency 16 --sequential 2 --repeats 1 ;;
    *) echo "unknown part $part (tests kernels llm sd15 sd15-compile flux)"; exit 2 ;;
  esac
done
