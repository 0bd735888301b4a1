#!/usr/bin/env bash
# Study 5: heterogeneous interconnect and GPUs. llama3-8b, PP 4 x DP 8, 1F1B, ZeRO-1, 16 microbatches
# on 32 GPUs: a uniform 4-node H100 cluster, the same with a 4x slower inter-node fabric, and
# examples/clusters/mixed-h100-a100.json (node 3 is an A100 node). Placements: the generator's
# default (pipeline ranks adjacent: every node holds two data-parallel replicas of all four stages),
# one pipeline stage per node (data parallelism inside a node), and one stage per node with the
# A100 node's stage given fewer blocks (searched: the A100 stage holds c blocks, the others split the
# rest evenly; the A100 node holds the last stage (with the LM head) or, reversed, the first).
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
enter_study heterogeneous
mkdir -p out
base="--model llama3-8b --schedule 1f1b --microbatches 16 --engine analytic"
clusters=(uniform-4x-h100 slow-fabric-4x-h100 mixed-h100-a100); counts=(1 2 3 4 6 8)
[ "$QUICK" = 1 ] && clusters=(uniform-4x-h100 mixed-h100-a100) && counts=(1 8)
step_ms() { "$PIPER" simulate $base "$@" --report out/r.json > /dev/null && jq -r '.step_time_s * 1000' out/r.json; }
echo "cluster,placement,pp_ranges,step_ms" > results.csv
for c in "${clusters[@]}"; do
  cl="inputs/$c.json"
  # shellcheck disable=SC2086
  echo "$c,default (stage ranks adjacent),balanced,$(step_ms --pp 4 --dp 8 --zero 1 --cluster "$cl")" >> results.csv
  echo "$c,node per stage,balanced,$(step_ms --directives inputs/node-per-stage.json --cluster "$cl")" >> results.csv
  [ "$c" = mixed-h100-a100 ] || continue
  for n in "${counts[@]}"; do
    # Last stage (with the head) on the A100 node: 32 - n blocks over stages 0..2, n on stage 3.
    r=$(( (32 - n) / 3 )); ranges="0,$r,$((2 * r)),$((32 - n))"
    echo "$c,node per stage (A100 = last stage),${ranges//,/ },$(step_ms --directives inputs/node-per-stage.json --pp-ranges "$ranges" --cluster "$cl")" >> results.csv
    # First stage (with the embedding) on the A100 node: n blocks on stage 0.
    r=$(( (32 - n) / 3 )); ranges="0,$n,$((n + r)),$((n + 2 * r))"
    echo "$c,node per stage (A100 = first stage),${ranges//,/ },$(step_ms --directives inputs/node-per-stage-reversed.json --pp-ranges "$ranges" --cluster "$cl")" >> results.csv
  done
done
sed -i 's/,\([0-9]*\.[0-9]\{3\}\)[0-9]*$/,\1/' results.csv
{ csv_to_md results.csv; echo;
  awk -F, 'NR>1 && $1=="uniform-4x-h100" && $2 ~ /^default/ { u=$4 } NR>1 && $1=="mixed-h100-a100" { if ($2 ~ /^default/) d=$4; if (b=="" || $4+0<b+0) { b=$4; w=$2" "$3 } }
    END { printf "uniform default %s ms; mixed default %s ms (%.2fx); best mixed placement %s: %s ms (%.2fx of uniform)\n", u, d, d/u, w, b, b/u }' results.csv; } > results.md
echo "heterogeneous: $(tail -1 results.md)"
if has_plot; then
  # Step time against the blocks given to the A100 node's stage; the uniform cluster and the mixed
  # cluster's default placement as flat reference series.
  awk -F, 'NR==1 { print "placement,a100_blocks,step_ms" }
    NR>1 && $1=="uniform-4x-h100" && $2 ~ /^default/ { u=$4 } NR>1 && $1=="mixed-h100-a100" && $2 ~ /^default/ { d=$4 }
    NR>1 && $2 ~ /A100 = last/ { split($3, r, " "); printf "A100 node = last stage (with LM head),%d,%s\n", 32 - r[4], $4; xs[32 - r[4]] = 1 }
    NR>1 && $2 ~ /A100 = first/ { split($3, r, " "); printf "A100 node = first stage (with embedding),%d,%s\n", r[2], $4; xs[r[2]] = 1 }
    END { for (x in xs) { printf "uniform H100 cluster (default placement),%d,%s\n", x, u; printf "mixed cluster (default placement),%d,%s\n", x, d } }' results.csv > plot.csv
  "$PIPER" plot plot.csv --x a100_blocks --y step_ms --series placement --line \
    --title "llama3-8b PP4 x DP8 1F1B on 3 H100 nodes + 1 A100 node: one stage per node" \
    --x-label "transformer blocks on the A100 node's stage (of 32)" --y-label "step time (ms)" -o step-time.png > /dev/null
fi
