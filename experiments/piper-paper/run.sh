#!/usr/bin/env bash
# Study: the Piper paper's own evaluation, posed (issue #26). Qwen3-MoE 1B-A0.7B (zoo qwen3-1b) at
# PP 8 x DP/EP 4 and 9B-A3B (qwen3-9b) at PP 4 x DP/EP 4 on 4 nodes x 8 A100-80GB (NVLink inside,
# EFA 400 Gb/s per node), sequence 512, bf16, no recomputation, microbatches = 2 x PP, ZeRO-1; one
# data-parallel replica per node, PP inside the node, EP across nodes. Schedules 1F1B, interleaved
# 1F1B (2 chunks per rank) and DualPipeV, on the analytic and SimGrid engines, at micro-batch sizes
# 1, 2 and 4 (the paper does not state it). Then the paper's other figure: an expert all-to-all
# running beside a data-parallel all-reduce on the same GPUs, on both engines.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
enter_study piper-paper
mkdir -p out
# config name | model | pp | cluster | placement note
configs=(
  "1b-pp8xdp4|qwen3-1b|8|inputs/p4d-4x8-a100-efa400.json|one replica per node (8 GPUs)"
  "9b-pp4xdp4|qwen3-9b|4|inputs/p4d-4x4-a100-efa400.json|one replica per node (4 of 8 GPUs)"
  "9b-pp4xdp4-packed|qwen3-9b|4|inputs/p4d-4x8-a100-efa400.json|two replicas per node (nodes 0-1)"
)
# dualpipev+head-auto: DualPipeV with the LM head as a region of its own, placed by cost (--v-head auto).
scheds=("1f1b|1" "interleaved-1f1b|2" "dualpipev|1" "dualpipev+head-auto|1")
mbss=(1 2 4)
engines=(analytic simgrid)
if [ "$QUICK" = 1 ]; then configs=("${configs[@]:0:2}"); mbss=(1); engines=(analytic); fi

echo "config,model,pp,dp,ep,micro_batch,engine,schedule,step_ms,tokens_per_s,bubble_pct,peak_gib,cp_compute_ms,cp_comm_ms,cp_dp_sync_ms,cp_all_to_all_and_p2p_ms,busiest_device,busiest_busy_ms,busiest_bound_tokens_per_s" > results.csv
for cfg in "${configs[@]}"; do
  IFS='|' read -r name model pp cluster _ <<< "$cfg"
  for mbs in "${mbss[@]}"; do
    for engine in "${engines[@]}"; do
      for sv in "${scheds[@]}"; do
        IFS='|' read -r sched virtual <<< "$sv"
        r="out/$name-mbs$mbs-$engine-$sched.json"
        family=${sched%%+*}; head=""; [ "$sched" != "$family" ] && head="--v-head auto"
        # shellcheck disable=SC2086
        "$PIPER" simulate --model "$model" --seq-len 512 --micro-batch-size "$mbs" --pp "$pp" --dp 4 --ep 4 --zero 1 \
          --recompute none --microbatches $((2 * pp)) --schedule "$family" $head --virtual "$virtual" --cluster "$cluster" \
          --engine "$engine" --report "$r" > /dev/null
        # The critical path's time in compute and in communication, the data-parallel collectives
        # (reduce-scatter/all-gather/all-reduce) among the latter, and the rest (expert all-to-all
        # and pipeline send/recv); the busiest device; and the throughput if the step took only
        # that device's busy time (no bubble, nothing exposed). The report lists the path's last
        # 256 steps; the DP collectives run after each region's last backward, at the step's tail,
        # and the script stops if the listed steps begin inside that tail (with a DP collective or
        # an update), where some of them could be cut off.
        jq -r --arg c "$name" --arg m "$model" --arg pp "$pp" --arg b "$mbs" --arg e "$engine" --arg s "$sched" '
          def ms(f): ([.critical_path.steps[] | select(f) | .end_s - .start_s] | add // 0) * 1000;
          (.per_device | max_by(.busy_s)) as $busy
          | ms(.label | test("^(REDUCE_SCATTER|ALL_GATHER|ALL_REDUCE)")) as $dp
          | if (.critical_path.steps | length) == (.critical_path.ops) or (.critical_path.steps[0].label
              | test("^(REDUCE_SCATTER|ALL_GATHER|ALL_REDUCE|UPD)") | not) then . else error("\($c) \($s): the listed critical-path steps may miss DP collectives") end
          | [$c, $m, $pp, 4, 4, $b, $e, $s, .step_time_s * 1000, .tokens_per_s, .bubble_fraction * 100,
             .peak_memory_bytes / 1073741824, .critical_path.compute_s * 1000, .critical_path.comm_s * 1000,
             $dp, .critical_path.comm_s * 1000 - $dp, $busy.device, $busy.busy_s * 1000, .tokens_per_step / $busy.busy_s]
          | map(if type == "number" then (. * 100 | round / 100) else . end) | @csv' "$r" | tr -d '"' >> results.csv
      done
    done
  done
done

# Throughput ratios at the same configuration, micro-batch size and engine, next to the paper's.
# Reported: interleaved / 1F1B 1.05 (both models); DualPipeV / 1F1B 1.13 (1B); DualPipeV /
# interleaved 1.10 (9B). The others are implied by them (1.13 / 1.05; 1.05 x 1.10).
# The last three columns: DualPipeV with the head placed by cost (--v-head auto) against the same two.
echo "config,micro_batch,engine,tps_1f1b,tps_interleaved,tps_dualpipev,interleaved_over_1f1b,reported_i,dualpipev_over_1f1b,reported_d1,dualpipev_over_interleaved,reported_di,tps_dualpipev_head,dualpipev_head_over_1f1b,dualpipev_head_over_interleaved" > ratios.csv
awk -F, 'NR > 1 { t[$1","$6","$7","$8] = $10; k[$1","$6","$7] = 1 }
  END { for (x in k) { a = t[x",1f1b"]; i = t[x",interleaved-1f1b"]; d = t[x",dualpipev"]; h = t[x",dualpipev+head-auto"];
          nine = (x ~ /^9b/);
          printf "%s,%.0f,%.0f,%.0f,%.3f,%s,%.3f,%s,%.3f,%s,%.0f,%.3f,%.3f\n", x, a, i, d, i / a, "1.05", d / a, (nine ? "(1.155)" : "1.13"),
            d / i, (nine ? "1.10" : "(1.076)"), h, h / a, h / i } }' results.csv | sort -t, -k1,1 -k3,3 -k2,2n >> ratios.csv

# The all-to-all beside an all-reduce: a hand-written plan of 4 devices, one per node (4 nodes x 1
# GPU with the per-GPU share of a p4d node's EFA, 400/8 = 50 Gb/s). Every device runs one expert
# dispatch all-to-all of qwen3-1b at micro-batch 1 (2 MiB: 512 tokens x top-2 x hidden 1,024 x 2
# bytes, as the compiled plan has it) on its "ep" stream, and, from the same instant, a ring
# all-reduce of R bytes on its "dp" stream (R = 0: alone). 12.6 MB is one PP-8 stage's
# data-parallel gradients (2 x 6,304,000 bytes; the experts, one per device with EP = DP = 4, have
# no data-parallel replica).
cluster1="out/4x1-gpu-50g.json"
echo '{"name": "4 nodes x 1 A100, the per-GPU share of 400 Gb/s EFA over 8 GPUs", "preset": "dgx-a100-80g", "nodes": 4,
  "node": {"gpus_per_node": 1, "nics": 1, "nic_bandwidth_gbit_per_s": 50}}' > "$cluster1"
pair_plan() {  # pair_plan ALL_TO_ALL_BYTES ALL_REDUCE_BYTES > plan.json
  jq -n --argjson a "$1" --argjson r "$2" '{format: "piper-program", version: 3, model: "collectives", num_devices: 4,
    microbatches: 1, training: {micro_batch_size: 1, precision: "bf16", seq_len: 512}, device_sets: [[0, 1, 2, 3]],
    families: [{devices: 0, group_size: 4, purpose: "ep", stride: 1}, {devices: 0, group_size: 4, purpose: "dp", stride: 1}],
    plan_of_device: [0, 0, 0, 0],
    plans: [{buffers: [], streams: ([{name: "ep", ops: [{bytes: $a, device_set: 0, family: 0, kind: "ALL_TO_ALL",
      label: "ALL_TO_ALL dispatch", node: 0, pair: 0}]}] + (if $r > 0 then [{name: "dp", ops: [{bytes: $r, device_set: 0,
      family: 1, kind: "ALL_REDUCE", label: "ALL_REDUCE grads", node: 1, pair: 1}]}] else [] end))}]}'
}
a2a=2097152
allreduces=(0 262144 524288 1048576 2097152 12608000)
[ "$QUICK" = 1 ] && allreduces=(0 12608000)
echo "all_to_all_bytes,all_reduce_bytes,engine,all_to_all_us,all_reduce_us,all_to_all_slowdown" > contention.csv
for engine in analytic simgrid; do
  alone=""
  for ar in "${allreduces[@]}"; do
    p="out/pair-$ar.json"; pair_plan $a2a "$ar" > "$p"
    "$PIPER" simulate --plan "$p" --cluster "$cluster1" --engine "$engine" --trace "out/pair-$ar-$engine-trace.json" > /dev/null
    read -r ta tr < <(jq -r '[.traceEvents[] | select(.ph == "X" and .pid == 0)] as $e
      | "\([$e[] | select(.name | startswith("ALL_TO_ALL")) | .dur] | max) \([$e[] | select(.name | startswith("ALL_REDUCE")) | .dur] | max // 0)"' \
      "out/pair-$ar-$engine-trace.json")
    [ "$ar" = 0 ] && alone=$ta
    printf "%s,%s,%s,%.1f,%.1f,%.3f\n" $a2a "$ar" "$engine" "$ta" "$tr" "$(echo "$ta / $alone" | bc -l)" >> contention.csv
  done
done

# The same effect inside a training step: qwen3-1b PP 8 x DP/EP 4, 1F1B, micro-batch 1, SimGrid. On
# each stage the last microbatch's backward all-to-alls of its first block run beside the
# reduce-scatter of its second block's gradients (same GPU, same EFA links). Every all-to-all of
# this step moves 2 MiB among 4 GPUs on 4 nodes, so the shortest one is the uncontended time.
r="out/1b-1f1b-mbs1-simgrid-trace.json"
"$PIPER" simulate --model qwen3-1b --seq-len 512 --pp 8 --dp 4 --ep 4 --zero 1 --recompute none --microbatches 16 \
  --schedule 1f1b --cluster inputs/p4d-4x8-a100-efa400.json --engine simgrid --trace "$r" > /dev/null
echo "all_to_alls,alone_us,slowed_down,mean_slowdown_of_slowed,max_slowdown,slowed_beside_dp_collective" > contention-in-step.csv
jq -r '[.traceEvents[] | select(.ph == "X")] as $ev
  | [$ev[] | select(.name | startswith("ALL_TO_ALL"))] as $a | ([$a[].dur] | min) as $m
  | [$a[] | select(.dur > $m * 1.001)] as $s
  | [$s[] | . as $x | select(any($ev[]; .pid == $x.pid and (.name | test("^(REDUCE_SCATTER|ALL_GATHER|ALL_REDUCE)"))
      and .ts < $x.ts + $x.dur and .ts + .dur > $x.ts))] as $b
  | [($a | length), ($m * 10 | round / 10), ($s | length), (([$s[].dur] | add) / ($s | length) / $m * 1000 | round / 1000),
     (([$s[].dur] | max) / $m * 1000 | round / 1000), ($b | length)] | @csv' "$r" >> contention-in-step.csv

{ echo "### Throughput ratios (predicted; the paper's in the reported_* columns, implied ones in parentheses)"; echo
  csv_to_md ratios.csv; echo
  echo "### Every run (critical-path time by kind of op; busiest device and its busy time)"; echo; csv_to_md results.csv; echo
  echo "### Expert all-to-all (2 MiB) beside a data-parallel all-reduce on the same 4 GPUs (reported: 1.46x)"; echo
  csv_to_md contention.csv; echo
  echo "### The same inside the step (1b, 1F1B, micro-batch 1, SimGrid): all-to-alls slower than alone"; echo
  csv_to_md contention-in-step.csv; } > results.md
echo "piper-paper: $(($(wc -l < results.csv) - 1)) runs; 1b mbs 1 analytic: $(awk -F, '$1=="1b-pp8xdp4" && $2==1 && $3=="analytic" { printf "interleaved/1F1B %s, DualPipeV/1F1B %s", $7, $9 }' ratios.csv)"
if has_plot; then
  awk -F, 'NR == 1 || $7 == "analytic"' results.csv > out/analytic.csv
  for cfg in "${configs[@]}"; do
    IFS='|' read -r name _ _ _ place <<< "$cfg"
    "$PIPER" plot out/analytic.csv --where "config=$name" --x micro_batch --y tokens_per_s \
      --series schedule --line --title "$name, $place: predicted throughput (analytic engine)" \
      --x-label "micro-batch size (sequences of 512 tokens)" --y-label "tokens/s" -o "throughput-$name.png" > /dev/null
  done
  "$PIPER" plot contention.csv --where "engine=simgrid" --x all_reduce_bytes --y all_to_all_slowdown --line \
    --title "2 MiB expert all-to-all beside a ring all-reduce, 4 GPUs on 4 nodes (SimGrid)" \
    --x-label "all-reduce bytes" --y-label "all-to-all time / time alone" -o contention.png > /dev/null
fi
