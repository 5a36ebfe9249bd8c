#!/usr/bin/env bash
# The measurements open issues wait for, in one device call: each stage under its own time limit, its output kept
# in OUT (default $OUT, else ./gpu-session), a summary line per stage printed. Device time is scarce: put the
# stages in the order they matter and give the call the whole 600 s.
#
#   bash tools/lab/gpu_session.sh [STAGES]     (default: tests,spec,prefix)
#
# after `. tools/lab/device_setup.sh` (the carried wheels, then the project installed).
#
# tests   the GPU tests of what changed last (MoE kernels, graphs and HF parity; prompt log-probs beside prefill
#         graphs; the server's capture-sweep log; a prompt resumed whole from the prefix cache; capture_check;
#         TESTS=EXPR picks others); the FP8 ones are fp8's
# spec    #32: the speculative step against a plain one, with the 27B head's published acceptance emulated, the
#         drafts reading an FP8 copy of lm_head (the default) and the bf16 one
# prefix  #31 and #30: the serving rows (each its own prompts), cache on and off (tools/lab/prefix_cache_rows.sh)
# mixed   #30: what a prompt chunk adds to a step of 60 decode rows (tools/lab/profile_mixed_step.py)
# turn    #31: a chat turn's prefill (1024 tokens) after cached prefixes of 0 and 7.6k tokens, with the kernels
#         that take the GPU time (what grows with the prefix), its attention's keys shared out up to 1 and 4 ways
#         (graphs and all); then the kernel alone with up to 1, 2, 4
# fp8     #33: the FP8 kernels' tests and the accuracy gate at the 9B and 27B widths, the FP8 projections per
#         shape, then the 27B decode step with FP8 projections (batch 1 and 64) against bf16 (batch 1; the FP8
#         floor counts the FP8 bytes), the 9B's at batch 1, and an 8k-token 27B prefill with FP8 and bf16 weights
# serve4  #30: the 4B start-up (cold and warm compile cache: ready time, first request against steady TTFT), an
#         8k-token prompt's prefill rate and eight of them arriving together
# serve27 #30, #33: the 27B serving rows of the issues (8192 in, 1024 out; c1 and c16), FP8 then bf16 checkpoints
#         (FORMATS=fp8 for one)
# specrows #32: the c16 and c64 serving rows with speculation (the 27B head's acceptance emulated) and without,
#         each server's graph captures listed (a bucket that ran out of memory runs eagerly)
# prefill #30: the 4B's 8k-token prefill by kernel, with one request's host timeline
# budget  #30: the 4B's 8k-token prompts one at a time and eight together, and the c64 row, at the server's chunk
#         budget (--max-num-batched-tokens) of 2048 tokens (the default) and 8192 (one 8k prompt a step: 120
#         against 126 ms in the engine on an H100, gpu-2026-12-07-fcb3039)
# table   the decode and 4B serving rows of docs/performance.md's H200 table: bench_decode (4B at 1, 8, 64 rows;
#         27B bf16 at 1; 27B FP8 at 1, 64; 9B FP8 at 1), then the c1 and c64 rows (`serve27` has the 27B ones)
# defects the checks from outside the team: the GPU tests of what they found (the FP8 accuracy gate at the 4B, 9B
#         and 27B widths with trained-like weights, W8A8 logged beside the W8A16 default; narrow GDN heads; a
#         closed engine's memory), then what the accurate default (W8A16 decode, dequantised prefill) costs against
#         the opt-in cuBLAS W8A8: the 27B FP8 decode step at batch 64 and a 16-layer 27B 8k prefill, each both ways
# fused   #30: the decode graph then the prefill (--no-fused-mixed-steps) against a step's decode rows and prompt
#         chunk as one graphed forward (the default): what a 256-token chunk adds beside 60 rows, then the c64 row
#         and its step log, each way
# moe     #65: the MoE tests (the grouped expert kernels at the 35B-A3B shapes, graphs against eager, a 4-layer
#         35B-A3B-width checkpoint saved by transformers against it), then the
#         35B-A3B decode step (20 of its 40 layers, random routing) at 1, 8 and 64 rows, bf16 and FP8
# eager   an eager decode step's launch time, GPU time and kernels (tools/lab/eager_host.py), on the BASELINE tree
#         and this one (EAGER="ARGS" for others)
# grammar the 4B's c1 TPOT and c64 output tok/s with every request's output under a JSON schema (and not)
# compare bench_decode on the tree in BASELINE (a `git archive` tarball; default .baseline/base.tar, carried) and
#         on this one, in the one call, base then new: the 4B at 1, 8 and 64 rows, plain and with 4 drafts
#         (COMPARE="ARGS;ARGS" for others, e.g. "--size 27b --batches 1,64 --fp8")
set -uo pipefail
STAGES=${1:-tests,spec,prefix}
DIR=${OUT:-gpu-session}
mkdir -p "$DIR"
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }

for stage in ${STAGES//,/ }; do
  case $stage in
    tests)
      timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -o log_cli=true --log-cli-level=INFO \
          -k "${TESTS:-moe or prompt_logprobs or capture_sweep or prefix_cache or capture_check}" \
          > "$DIR/tests.log" 2>&1
      grep -E "passed|failed|speculation k=|on/off|launches waited|reserved after" "$DIR/tests.log" | tail -12 ;;
    compare)
      rm -rf /tmp/base /tmp/basepkg && mkdir -p /tmp/base && tar -xf "${BASELINE:-.baseline/base.tar}" -C /tmp/base
      python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/basepkg /tmp/base \
          > "$DIR/base-install.log" 2>&1
      IFS=';' read -ra RUNS <<< "${COMPARE:---size 4b --batches 1,8,64 --speculative-tokens 4}"
      for args in "${RUNS[@]}"; do
        for tree in base new; do
          name=compare-$tree$(echo " $args" | sed 's/ --size /-/; s/ --batches /-b/; s/ --speculative-tokens /-k/;
              s/ --/-/g; s/,/-/g')
          path=$([ $tree = base ] && echo /tmp/basepkg:)${PYTHONPATH:-}
          PYTHONPATH=$path timeout 200 python3 -m deltaserve.tools.bench_decode $args > "$DIR/$name.md" 2>&1
          grep "^| [0-9]" "$DIR/$name.md" | sed "s/^/$tree $args: /"
        done
      done ;;
    spec)
      for head in --fp8-draft-head --no-fp8-draft-head; do
        timeout 150 python3 -m deltaserve.tools.bench_decode --size 4b --batches 1,8 --speculative-tokens 4 \
            --acceptance 0.92,0.84,0.65,0.54 $head > "$DIR/spec$head.md" 2>&1
        grep "^| [0-9]" "$DIR/spec$head.md" | sed "s/^/$head /"
      done ;;
    prefix)
      timeout 300 bash tools/lab/prefix_cache_rows.sh /tmp/prefix-rows
      rm -rf /tmp/prefix-rows/ck4b && tar czf "$DIR/prefix-rows.tgz" -C /tmp prefix-rows ;;
    mixed)
      timeout 200 python3 -m deltaserve.tools.lab.profile_mixed_step --size 4b --rows 60 --prompt 256 \
          > "$DIR/mixed-step.txt" 2>&1
      grep -A12 "^decode only" "$DIR/mixed-step.txt" ;;
    moe)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_moe.py -k "moe" \
          > "$DIR/moe-tests.log" 2>&1
      grep -E "passed|failed|Error" "$DIR/moe-tests.log" | tail -5
      for fp8 in "" --fp8; do  # the 35B-A3B's decode step against the bytes it reads (half its layers: one GPU)
        timeout 200 python3 -m deltaserve.tools.bench_decode --size 35b-a3b --layers 20 --batches 1,8,64 $fp8 \
            > "$DIR/moe-decode$fp8.md" 2>&1
        grep "^| [0-9]" "$DIR/moe-decode$fp8.md" | sed "s/^/35b-a3b ${fp8:-bf16} /"
      done ;;
    eager)
      rm -rf /tmp/base /tmp/basepkg && mkdir -p /tmp/base && tar -xf "${BASELINE:-.baseline/base.tar}" -C /tmp/base
      python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/basepkg /tmp/base \
          > "$DIR/base-install.log" 2>&1
      for tree in new base; do  # an eager step's launch time, GPU time and launch count, on each tree
        path=$([ $tree = base ] && echo /tmp/basepkg:)${PYTHONPATH:-}
        PYTHONPATH=$path timeout 150 python3 tools/lab/eager_host.py ${EAGER:---size 27b --layers 16 --fp8} \
            > "$DIR/eager-$tree.txt" 2>&1
        grep "^batch" "$DIR/eager-$tree.txt" | sed "s/^/$tree /"
      done ;;
    turn)
      for prefix in 0 7680; do
        for splits in 1 4; do  # the engine's prefill with the keys after a cached prefix shared out, and without
          timeout 100 python3 -m deltaserve.tools.lab.profile_prefill --size 4b --tokens 1024 --prefix $prefix \
              --repeats 3 --prefill-attention-splits $splits > "$DIR/turn-prefix-$prefix-splits-$splits.txt" 2>&1
          grep -E "^\| [0-9]|most GPU time" "$DIR/turn-prefix-$prefix-splits-$splits.txt" \
              | sed "s/^/prefix $prefix, splits $splits: /"
        done
      done
      timeout 150 python3 -m deltaserve.tools.bench_kernels --size 4b --only prefill > "$DIR/prefill-kernels.md" 2>&1
      grep "keys over" "$DIR/prefill-kernels.md" ;;  # the split-context attention against one program a block
    fp8)
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_gpu.py -o log_cli=true \
          --log-cli-level=INFO -k "w8a16 or w8a8 or fp8" > "$DIR/fp8-tests.log" 2>&1
      grep -E "passed|failed|FP8 .*: top-8" "$DIR/fp8-tests.log" | tail -4
      timeout 150 python3 -m deltaserve.tools.bench_kernels --size 27b --only fp8 > "$DIR/fp8-kernels.md" 2>&1
      grep "fp8 projection" "$DIR/fp8-kernels.md"
      for flag in --fp8 ""; do  # batch 64 too with FP8 weights (bf16 ones leave an H100 no room for 64 rows)
        timeout 150 python3 -m deltaserve.tools.bench_decode --size 27b --batches $([ -n "$flag" ] && echo 1,64 || echo 1) \
            $flag > "$DIR/decode-27b$flag.md" 2>&1
        grep "^| [0-9]" "$DIR/decode-27b$flag.md" | sed "s/^/27b ${flag:-bf16} /"
      done
      timeout 60 python3 -m deltaserve.tools.bench_decode --size 9b --batches 1 --fp8 > "$DIR/decode-9b-fp8.md" 2>&1
      grep "^| [0-9]" "$DIR/decode-9b-fp8.md" | sed "s/^/9b fp8 /"
      for flag in --fp8 ""; do  # #33's prefill rate: FP8 against bf16 weights, 8k tokens
        timeout 90 python3 -m deltaserve.tools.lab.profile_prefill --size 27b --layers 16 --tokens 8192 --repeats 3 \
            $flag > "$DIR/prefill-27b$flag.txt" 2>&1
        grep "^| [0-9]" "$DIR/prefill-27b$flag.txt" | sed "s/^/27b (16 layers) prefill ${flag:-bf16} /"
      done ;;
    fp8prefill)  # the FP8 accuracy gate at three widths, then the default prefill's rate (27B, 16 layers, 8k)
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -o log_cli=true --log-cli-level=INFO \
          -k accuracy_gate > "$DIR/fp8-gate.log" 2>&1
      grep -E "passed|failed|FP8 .*: top-8" "$DIR/fp8-gate.log" | tail -5
      timeout 80 python3 -m deltaserve.tools.lab.profile_prefill --size 27b --layers 16 --tokens 8192 --repeats 3 \
          --fp8 > "$DIR/prefill-27b-fp8-dequant.txt" 2>&1
      grep "^| [0-9]" "$DIR/prefill-27b-fp8-dequant.txt" | sed "s/^/27b (16 layers) prefill fp8 dequant /" ;;
    defects)
      timeout 330 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -o log_cli=true --log-cli-level=INFO \
          -k "${TESTS:-accuracy_gate or narrower or closed_in_process}" > "$DIR/defects-tests.log" 2>&1
      grep -E "passed|failed|FP8 .*: top-8|reserved after|Error" "$DIR/defects-tests.log" | tail -12
      for prefill in dequant cublas; do
        timeout 100 python3 -m deltaserve.tools.bench_decode --size 27b --batches 1,64 --fp8 \
            --kernel "fp8_prefill='$prefill'" > "$DIR/decode-27b-fp8-$prefill.md" 2>&1
        grep "^| [0-9]" "$DIR/decode-27b-fp8-$prefill.md" | sed "s/^/27b fp8 $prefill /"
        timeout 80 python3 -m deltaserve.tools.lab.profile_prefill --size 27b --layers 16 --tokens 8192 --repeats 3 \
            --fp8 --kernel "fp8_prefill='$prefill'" > "$DIR/prefill-27b-fp8-$prefill.txt" 2>&1
        grep "^| [0-9]" "$DIR/prefill-27b-fp8-$prefill.txt" | sed "s/^/27b (16 layers) prefill fp8 $prefill /"
      done ;;
    prefill)
      timeout 150 python3 -m deltaserve.tools.lab.profile_prefill --size 4b --tokens 8192 --repeats 3 --top 12 \
          --timeline > "$DIR/prefill-4b.txt" 2>&1
      grep -E "^\| 8192|most GPU time|the loop plans|prefill forward|first token" "$DIR/prefill-4b.txt" ;;
    budget)
      for tokens in 2048 8192; do  # the server's chunk budget: today's default, then vLLM's and SGLang's
        ROWS="long burst c64" MODES=on timeout 200 bash tools/lab/prefix_cache_rows.sh /tmp/budget-$tokens \
            --max-num-batched-tokens $tokens | sed "s/^/budget $tokens: /"
        mkdir -p "$DIR/budget-$tokens"
        cp /tmp/budget-$tokens/*.json /tmp/budget-$tokens/server-on.log "$DIR/budget-$tokens/" 2>/dev/null
      done ;;
    table)
      for args in "--size 4b --batches 1,8,64" "--size 27b --batches 1" "--size 27b --batches 1,64 --fp8" \
          "--size 9b --batches 1 --fp8"; do
        name=decode-$(echo $args | sed 's/--size //; s/ --batches /-b/; s/ --/-/; s/,/-/g')
        timeout 150 python3 -m deltaserve.tools.bench_decode $args > "$DIR/$name.md" 2>&1
        grep "^| [0-9]" "$DIR/$name.md" | sed "s/^/$args: /"
      done
      ROWS="c1 c64" MODES=on timeout 200 bash tools/lab/prefix_cache_rows.sh /tmp/table
      cp /tmp/table/*.json /tmp/table/server-on.log "$DIR/" 2>/dev/null ;;
    grammar)  # TPOT at c1 and output tok/s at c64, every request's output under a JSON schema, and not
      python3 -m deltaserve.tools.make_checkpoint /tmp/ck4b --size 4b --config-only > /dev/null
      deltaserve serve /tmp/ck4b --load-format random --device cuda --port 8000 --disable-access-log \
          --stats-interval 0 --max-num-seqs 64 > "$DIR/server-grammar.log" 2>&1 &
      server=$!
      for _ in $(seq 1 300); do curl -sf http://127.0.0.1:8000/health > /dev/null && break; sleep 1; done
      for c in 1 64; do
        for schema in "" tests/data/json_schema_bench.json; do
          name=grammar-c$c$([ -n "$schema" ] && echo -json)
          timeout 120 deltaserve bench serve --disable-tqdm --ignore-eos --num-prompts $((c == 1 ? 8 : 256)) \
              --max-concurrency $c --random-input-len 1024 --random-output-len 256 --seed 5 \
              ${schema:+--json-schema $schema} --result-file "$DIR/$name.json" > "$DIR/$name.txt" 2>&1
          grep -E "Median (TTFT|TPOT)|Output token throughput" "$DIR/$name.txt" | sed "s/^/$name /"
        done
      done
      grep -E "loop stalled|grammar|Traceback" "$DIR/server-grammar.log" | head -5
      kill -INT $server; wait $server ;;
    serve27)
      for fmt in ${FORMATS:-fp8 bf16}; do
        ck=/tmp/ck27-$fmt
        python3 -m deltaserve.tools.make_checkpoint $ck --size 27b --config-only $([ $fmt = fp8 ] && echo --fp8) \
            > /dev/null
        deltaserve serve $ck --load-format random --device cuda --port 8000 --disable-access-log --stats-interval 0 \
            --max-num-seqs 16 > "$DIR/server-27b-$fmt.log" 2>&1 &
        server=$!
        for _ in $(seq 1 300); do curl -sf http://127.0.0.1:8000/health > /dev/null && break; sleep 1; done
        for c in 1 16; do
          timeout 150 deltaserve bench serve --disable-tqdm --ignore-eos --num-prompts $((c == 1 ? 2 : 16)) \
              --max-concurrency $c --random-input-len 8192 --random-output-len 1024 --seed 5 \
              --result-file "$DIR/27b-$fmt-c$c.json" > "$DIR/27b-$fmt-c$c.txt" 2>&1
          grep -E "Median (TTFT|TPOT)|Output token throughput" "$DIR/27b-$fmt-c$c.txt" | sed "s/^/27b $fmt c$c /"
        done
        kill -INT $server; wait $server
      done ;;
    serve4)
      python3 -m deltaserve.tools.make_checkpoint /tmp/ck4b --size 4b --config-only > /dev/null
      for start in cold warm; do  # the same fresh compile cache twice: Triton compiles, then loads
        TRITON_CACHE_DIR=/tmp/triton-startup timeout 150 python3 -m deltaserve.tools.lab.startup -- /tmp/ck4b \
            --load-format random --device cuda --stats-interval 0 --disable-access-log --max-num-seqs 64 \
            > "$DIR/startup-$start.txt" 2>&1
        tail -1 "$DIR/startup-$start.txt" | sed "s/^/$start start: /"
      done
      ROWS="long burst" MODES=on timeout 200 bash tools/lab/prefix_cache_rows.sh /tmp/serve4
      cp /tmp/serve4/*.json /tmp/serve4/server-on.log "$DIR/" ;;
    fused)
      for flag in --no-fused-mixed-steps --fused-mixed-steps; do  # apart, then fused (graphed: the default)
        timeout 150 python3 -m deltaserve.tools.lab.profile_mixed_step --size 4b --rows 60 --prompt 256 --chunks 1 \
            $flag > "$DIR/mixed-step$flag.txt" 2>&1
        grep -A3 "^with prompts" "$DIR/mixed-step$flag.txt" | sed "s/^/$flag /"
        ROWS=c64 MODES=on timeout 150 bash tools/lab/prefix_cache_rows.sh /tmp/fused$flag --log-steps $flag
        mkdir -p "$DIR/c64$flag"
        cp /tmp/fused$flag/*.json /tmp/fused$flag/server-on.log "$DIR/c64$flag/" 2>/dev/null
      done ;;
    specrows)
      for mode in spec plain; do
        flags=$([ $mode = spec ] && echo "--speculative-tokens 4")
        serve=$([ $mode = spec ] && echo "python3 -m deltaserve.tools.lab.serve_emulated --acceptance 0.92,0.84,0.65,0.54")
        SERVE=$serve ROWS="c16 c64" MODES=on timeout 250 bash tools/lab/prefix_cache_rows.sh /tmp/specrows-$mode $flags \
            | sed "s/^/$mode /"
        grep -E "graphs per rank|capture of .* failed|runtime.speculation" /tmp/specrows-$mode/server-on.log \
            | cut -c1-200 | tail -8
        mkdir -p "$DIR/specrows-$mode"
        cp /tmp/specrows-$mode/*.json /tmp/specrows-$mode/server-on.log "$DIR/specrows-$mode/" 2>/dev/null
      done ;;
    *) echo "unknown stage $stage (tests, spec, prefix, fewrows, mixed, turn, fp8, prefill, budget, serve27, serve4,"\
            "table, fused, specrows)"
       exit 2 ;;
  esac
  stamp "$stage done"
done
