#!/usr/bin/env bash
# The prefix-cache serving rows of docs/performance.md (issue #31), on a GPU: a 4B random-weight server with the
# cache on, then off, each running the same `deltaserve bench serve` rows. Results (JSON per row, server logs) go
# to OUT (default ./prefix-cache-rows); one summary line per row is printed.
#
#   [ROWS="c1 turns"] [MODES=on] [SERVE="python3 -m deltaserve.tools.lab.serve_emulated --acceptance P1,..."] \
#       bash tools/lab/prefix_cache_rows.sh [OUT] [extra serve flags, e.g. --log-steps]
#
# ROWS picks rows and their order (default: shared turns c64 c1; also c16, long, burst: #30's 8k-token prompts one at a
# time and eight together); MODES the servers (default: on off).
set -uo pipefail
OUT=${1:-prefix-cache-rows}; shift || true
mkdir -p "$OUT"
CK="$OUT/ck4b"
[ -f "$CK/config.json" ] || python3 -m deltaserve.tools.make_checkpoint "$CK" --size 4b --config-only > /dev/null

serve() {  # serve NAME FLAGS...: a server in the background, once /health answers
  local name=$1; shift
  ${SERVE:-deltaserve serve} "$CK" --load-format random --device cuda --port 8000 --disable-access-log --stats-interval 0 \
      --max-num-seqs 64 "$@" > "$OUT/server-$name.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 600); do
    curl -sf http://127.0.0.1:8000/health > /dev/null && return 0
    kill -0 $SERVER 2> /dev/null || { echo "server $name died:"; tail -5 "$OUT/server-$name.log"; exit 1; }
    sleep 1
  done
  echo "server $name did not start"; exit 1
}

bench() {  # bench NAME FLAGS...: one row, its JSON and a summary line
  local name=$1; shift
  deltaserve bench serve --disable-tqdm --ignore-eos --result-file "$OUT/$name.json" "$@" > "$OUT/$name.txt" 2>&1
  python3 - "$OUT/$name.json" "$name" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
turns = r.get("median_ttft_ms_by_turn")
print(f"{sys.argv[2]}: {r['completed']} ok, {r['output_throughput']:.0f} out tok/s, TTFT median {r['median_ttft_ms']:.1f} "
      f"p99 {r['p99_ttft_ms']:.1f} ms, TPOT median {r['median_tpot_ms']:.2f} ms, ITL p50 {r['median_itl_ms']:.2f} "
      f"p99 {r['p99_itl_ms']:.2f} ms, hit rate {r['prefix_cache_hit_rate']}"
      + (f", TTFT by turn {[round(t, 1) for t in turns]}" if turns else ""))
PY
}

rows() {  # the rows, each name suffixed
  local s=$1  # each row its own prompts (--seed): a row must not hit the prompts of the rows before it
  for row in ${ROWS:-shared turns c64 c1}; do
    case $row in
      shared) bench "shared$s" --dataset-name prefix_repetition --prefix-repetition-prefix-len 4096 \
          --prefix-repetition-suffix-len 100 --prefix-repetition-num-prefixes 1 --prefix-repetition-output-len 128 \
          --num-prompts 64 --max-concurrency 16 --seed 1 ;;
      turns) bench "turns$s" --multi-turn 8 --num-prompts 3 --max-concurrency 1 --random-input-len 1024 \
          --random-output-len 64 --seed 2 ;;
      c64) bench "c64$s" --num-prompts 256 --max-concurrency 64 --random-input-len 512 --random-output-len 256 \
          --seed 3 ;;
      c16) bench "c16$s" --num-prompts 128 --max-concurrency 16 --random-input-len 512 --random-output-len 256 \
          --seed 8 ;;  # #32: speculation at a middle batch
      c1) bench "c1$s" --num-prompts 16 --max-concurrency 1 --random-input-len 512 --random-output-len 256 --seed 4 ;;
      long) bench "long$s" --num-prompts 4 --max-concurrency 1 --random-input-len 8192 --random-output-len 2 \
          --seed 6 ;;  # #30's prefill rate: prompt tokens over TTFT
      burst) bench "burst$s" --num-prompts 8 --random-input-len 8192 --random-output-len 2 --seed 7 ;;  # together
      *) echo "unknown row $row (shared, turns, c64, c16, c1, long, burst)"; exit 2 ;;
    esac
  done
}

for mode in ${MODES:-on off}; do
  case $mode in
    on) serve on "$@"; rows "" ;;
    off) serve off --no-enable-prefix-caching "$@"; rows "-off" ;;
    *) echo "unknown mode $mode (on, off)"; exit 2 ;;
  esac
  curl -s http://127.0.0.1:8000/metrics > "$OUT/metrics-$mode.txt"  # TTFT's queue and prefill parts, step times
  kill -INT $SERVER; wait $SERVER
done
