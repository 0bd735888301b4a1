#!/usr/bin/env bash
# Study 3: PP x ZeRO composition. For llama3-8b on 8 GPUs (one node), the largest micro-batch (in
# sequences of 2,048 tokens, 8 microbatches per step) that fits in HBM for each strategy: data
# parallelism alone (DP 8) with ZeRO-0..3, and PP 2 / PP 4 x DP with GPipe, 1F1B or ZB-H1 and
# ZeRO-0..3, under the 80 GB (DGX H100) and 141 GB (DGX H200) caps; and the throughput at that size.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
enter_study pp-zero
mkdir -p out
model=llama3-8b; seq=2048; m=8; limit=128
clusters=(dgx-h100 dgx-h200); zeros=(0 1 2 3); pps=(1 2 4); scheds=(gpipe 1f1b zb-h1)
if [ "$QUICK" = 1 ]; then clusters=(dgx-h100); zeros=(1 3); pps=(1 2); scheds=(1f1b); fi

# fits CLUSTER PP SCHEDULE ZERO B: prints "tokens_per_s peak_gib" and succeeds when B fits.
fits() {
  local r="out/$1-pp$2-$3-z$4-b$5.json"
  "$PIPER" simulate --model $model --pp "$2" --dp $((8 / $2)) --zero "$4" --schedule "$3" --microbatches $m \
    --micro-batch-size "$5" --seq-len $seq --cluster "$1" --engine analytic --report "$r" > /dev/null
  [ "$(jq -r .oom "$r")" = false ] && jq -r '"\(.tokens_per_s) \(.peak_memory_bytes / 1073741824)"' "$r"
}

echo "cluster,pp,dp,schedule,zero,max_micro_batch,tokens_per_step,tokens_per_s,peak_gib" > results.csv.tmp
for cl in "${clusters[@]}"; do
  for pp in "${pps[@]}"; do
    for s in "${scheds[@]}"; do
      [ "$pp" = 1 ] && [ "$s" != 1f1b ] && continue   # one stage: the schedules coincide
      for z in "${zeros[@]}"; do
        # Largest fitting size: double until it does not fit, then bisect (fitting is monotone in B).
        lo=0; hi=1
        while [ $hi -le $limit ] && fits "$cl" "$pp" "$s" "$z" $hi > /dev/null; do lo=$hi; hi=$((hi * 2)); done
        [ $hi -gt $limit ] && hi=$((limit + 1))
        while [ $((hi - lo)) -gt 1 ]; do mid=$(((lo + hi) / 2)); if fits "$cl" "$pp" "$s" "$z" $mid > /dev/null; then lo=$mid; else hi=$mid; fi; done
        if [ $lo -gt 0 ]; then read -r tps gib <<< "$(fits "$cl" "$pp" "$s" "$z" $lo)"; else tps=0; gib=; fi
        printf "%s,%s,%s,%s,%s,%s,%s,%.0f,%s\n" "$cl" "$pp" $((8 / pp)) "$s" "$z" "$lo" $((lo * seq * m * 8 / pp)) "$tps" "${gib:0:6}" >> results.csv.tmp
      done
    done
  done
done
mv results.csv.tmp results.csv
# The gain from composing: best PP x ZeRO micro-batch over the best DP-alone (ZeRO-k) one, per cluster.
echo "cluster,best_dp_only_micro_batch,best_pp_zero_micro_batch,best_pp_zero_strategy,ratio" > gain.csv
awk -F, 'NR>1 { if ($2==1) { if ($6>d[$1]) d[$1]=$6 } else if ($6>p[$1]) { p[$1]=$6; w[$1]="PP"$2" "$4" ZeRO-"$5 } }
  END { for (c in d) printf "%s,%s,%s,%s,%s\n", c, d[c], p[c], w[c], (d[c] ? sprintf("%.1f", p[c]/d[c]) : "inf") }' results.csv >> gain.csv
{ csv_to_md results.csv; echo; csv_to_md gain.csv; } > results.md
echo "pp-zero: $(tail -n +2 gain.csv | tr '\n' ';')"
if has_plot; then
  awk -F, 'NR==1 { print "cluster,strategy,zero,max_micro_batch" } NR>1 { printf "%s,%s,%s,%s\n", $1, ($2==1 ? "DP8 alone" : "PP"$2" x DP"$3" "$4), $5, $6 }' results.csv > plot.csv
  for cl in "${clusters[@]}"; do
    "$PIPER" plot plot.csv --where "cluster=$cl" --x zero --y max_micro_batch --series strategy --line \
      --title "llama3-8b on 8 GPUs ($cl): largest micro-batch that fits, 8 microbatches of 2k-token sequences" \
      --x-label "ZeRO level" --y-label "largest micro-batch (sequences)" -o "max-batch-$cl.png" > /dev/null
  done
fi
