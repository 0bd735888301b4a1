#!/usr/bin/env bash
# Study 2: pipeline schedules under PP x EP for MoE models (Qwen3-MoE shapes): 1F1B, interleaved
# 1F1B, ZB-V and DualPipeV, varying the microbatches and the cost of the expert all-to-all (NVLink
# inside a DGX node vs 400 Gb/s and 100 Gb/s between 2-GPU nodes), with `piper sweep` (analytic
# engine); then the default scenario's shapes on the SimGrid engine with per-device busy time.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
enter_study pp-ep-moe
mkdir -p out
# shape name | model | pp | dp | ep | microbatches (JSON list)
shapes=(
  "qwen3-1b-pp4|qwen3-1b|4|2|2|[8, 16, 32]"
  "qwen3-1b-pp2|qwen3-1b|2|4|2|[4, 8, 16]"
  "vocab8k-pp4|inputs/qwen3-1b-vocab8k.json|4|2|2|[8, 16, 32]"
  "qwen3-30b-a3b-pp4|qwen3-30b-a3b|4|2|2|[8, 16]"
)
clusters=("dgx-h200" "inputs/h200-2gpu-nodes-400g.json" "inputs/h200-2gpu-nodes-100g.json")
if [ "$QUICK" = 1 ]; then
  shapes=("qwen3-1b-pp4|qwen3-1b|4|2|2|[8]" "qwen3-1b-pp2|qwen3-1b|2|4|2|[4]")
  clusters=("dgx-h200" "inputs/h200-2gpu-nodes-400g.json")
fi
echo "shape,cluster,schedule,microbatches,step_ms,tokens_per_s,mfu_pct,bubble_pct,peak_gib,oom" > results.csv.tmp
for shape in "${shapes[@]}"; do
  IFS='|' read -r name model pp dp ep mbs <<< "$shape"
  for cluster in "${clusters[@]}"; do
    cname=$(basename "$cluster" .json)
    for variant in "1" "2" "h"; do
      # virtual 1: one region per rank (1f1b) or the V (zb-v, dualpipev); virtual 2: interleaved;
      # h: the V with the head (final norm + head + loss) as a region of its own, placed by cost
      # (--v-head auto: on a rank beside its V regions, or alone on the last rank).
      extra=""
      case "$variant" in
        1) scheds='["1f1b", "zb-v", "dualpipev"]'; virtual=1 ;;
        2) scheds='["interleaved-1f1b"]'; virtual=2 ;;
        h) scheds='["zb-v", "dualpipev"]'; virtual=1; extra=', "v_head": ["auto"]' ;;
      esac
      spec="out/$name-$cname-v$variant.json"
      model_path=$model; [ -f "$model" ] && model_path="$PWD/$model"
      cluster_path=$cluster; [ -f "$cluster" ] && cluster_path="$PWD/$cluster"
      cat > "$spec" <<JSON
{ "model": "$model_path", "cluster": "$cluster_path", "engine": "analytic",
  "pp": [$pp], "dp": [$dp], "ep": [$ep], "zero": [1], "virtual": [$virtual],
  "schedule": $scheds, "microbatches": $mbs$extra }
JSON
      rm -f "$spec.csv"
      "$PIPER" sweep "$spec" -j 2 -o "$spec.csv" >/dev/null
      # Columns by name, so a new sweep column does not shift them.
      awk -F, -v shape="$name" -v cl="$cname" '
        NR==1 { for (i=1;i<=NF;i++) c[$i]=i; next }
        { sched = $c["schedule"] ($c["v_head"] != "" ? "+head-" $c["v_head"] : "") }
        $c["status"]=="ok" { printf "%s,%s,%s,%s,%.3f,%.0f,%.1f,%.1f,%.2f,%s\n", shape, cl, sched, $c["microbatches"],
          $c["step_time_s"]*1000, $c["tokens_per_s"], $c["mfu"]*100, $c["bubble_fraction"]*100, $c["peak_memory_bytes"]/2^30, $c["oom"] }
        $c["status"]!="ok" { printf "%s,%s,%s,%s,,,,,,%s\n", shape, cl, sched, $c["microbatches"], $c["status"] }' "$spec.csv" >> results.csv.tmp
    done
  done
done
{ head -1 results.csv.tmp; tail -n +2 results.csv.tmp | sort -t, -k1,1 -k2,2 -k4,4n -k3,3; } > results.csv && rm results.csv.tmp

# DualPipeV against 1F1B and ZB-V at the same shape, cluster and microbatches.
# The head as a region of its own (--v-head auto): DualPipeV and ZB-V again, and DualPipeV's ratio to 1F1B.
echo "shape,cluster,microbatches,1f1b_ms,zb-v_ms,dualpipev_ms,dualpipev_over_1f1b,dualpipev_over_zbv,zb-v_head_ms,dualpipev_head_ms,dualpipev_head_over_1f1b" > ratios.csv
awk -F, 'NR>1 && $5!="" { t[$1","$2","$4","$3]=$5; k[$1","$2","$4]=1 }
  END { for (x in k) { a=t[x",1f1b"]; z=t[x",zb-v"]; d=t[x",dualpipev"]; zh=t[x",zb-v+head-auto"]; dh=t[x",dualpipev+head-auto"];
        if (a!="" && d!="") printf "%s,%s,%s,%s,%.3f,%.3f,%s,%s,%s\n", x, a, z, d, d/a, (z!="" ? d/z : 0), zh, dh,
          (dh!="" ? sprintf("%.3f", dh/a) : "") } }' results.csv |
  sort -t, -k1,1 -k2,2 -k3,3n >> ratios.csv

# The default scenario's shapes on the SimGrid engine: step time and per-device busy time.
echo "strategy,schedule,step_ms,busy_ms_dev0,busy_ms_dev1,busy_ms_dev2,busy_ms_dev3,max_busy_ms,step_over_max_busy" > simgrid.csv
for cfg in "pp4|--pp 4 --dp 2 --ep 2 --microbatches 8" "pp2|--pp 2 --dp 4 --ep 2 --microbatches 4"; do
  IFS='|' read -r tag flags <<< "$cfg"
  for s in 1f1b dualpipev dualpipev+head-auto; do
    [ "$QUICK" = 1 ] && [ "$tag" = pp4 ] && [ "$s" = 1f1b ] && continue
    sched=${s%%+*}; head=""; [ "$s" != "$sched" ] && head="--v-head auto"
    # shellcheck disable=SC2086
    "$PIPER" simulate --model qwen3-1b $flags --zero 1 --schedule "$sched" $head --cluster dgx-h200 \
      --report "out/$tag-$s.json" --trace "out/$tag-$s-trace.json" > /dev/null
    jq -r --arg t "$tag" --arg s "$s" '[$t, $s, (.step_time_s*1000)] + ([.per_device[0:4][] | .busy_s*1000] + [0,0,0,0])[0:4]
      + [([.per_device[].busy_s] | max * 1000)] + [(.step_time_s / ([.per_device[].busy_s] | max))]
      | map(if type == "number" then (. * 1000 | round / 1000) else . end) | @csv' "out/$tag-$s.json" | tr -d '"' >> simgrid.csv
  done
done
# The DualPipeV order against the DualPipe reference schedule (PyTorch CSV of deepseek-ai/DualPipe's
# DualPipeV, 4 ranks, 10 microbatches), when the shared fixtures are beside the checkout.
ref="$REPO_DIR/tests/fixtures/pytorch-schedules/dualpipev_4rank_10mb.csv"
if [ -f "$ref" ]; then
  if "$PIPER" schedule export-csv dualpipev --ranks 4 --microbatches 10 | cmp -s - "$ref"; then check="identical to"; else check="DIFFERS from"; fi
  echo "piper schedule export-csv dualpipev --ranks 4 --microbatches 10: $check dualpipev_4rank_10mb.csv" > reference-check.txt
fi
{ echo "### All runs (analytic engine)"; echo; csv_to_md results.csv; echo; echo "### DualPipeV / 1F1B and DualPipeV / ZB-V step-time ratios"; echo;
  csv_to_md ratios.csv; echo; echo "### SimGrid engine, qwen3-1b on one DGX H200 (8 GPUs), same 65,536 tokens per step"; echo; csv_to_md simgrid.csv; } > results.md
echo "pp-ep-moe: $(($(wc -l < results.csv) - 1)) runs; DualPipeV faster than 1F1B in $(awk -F, 'NR>1 && $7<1' ratios.csv | wc -l) of $(($(wc -l < ratios.csv) - 1)) settings, with --v-head auto in $(awk -F, 'NR>1 && $11!="" && $11<1' ratios.csv | wc -l)"
if has_plot; then
  for sh in $(tail -n +2 ratios.csv | cut -d, -f1 | sort -u); do
    "$PIPER" plot ratios.csv --where "shape=$sh" --x microbatches --y dualpipev_over_1f1b --series cluster --line \
      --title "DualPipeV / 1F1B step time, $sh (below 1: DualPipeV faster)" --x-label "microbatches per step" \
      --y-label "step-time ratio DualPipeV / 1F1B" -o "ratio-$sh.png" > /dev/null
    "$PIPER" plot ratios.csv --where "shape=$sh" --x microbatches --y dualpipev_head_over_1f1b --series cluster --line \
      --title "DualPipeV --v-head auto / 1F1B step time, $sh (below 1: DualPipeV faster)" --x-label "microbatches per step" \
      --y-label "step-time ratio DualPipeV (head placed) / 1F1B" -o "ratio-head-$sh.png" > /dev/null
  done
fi
