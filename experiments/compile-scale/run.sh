#!/usr/bin/env bash
# Study 4: what compiling a global DAG for thousands of accelerators costs. `piper compile --stats`
# for three strategies at 1,024 -> 65,536 devices (data parallelism grows; the pipeline is fixed):
# compile time, the compiler's peak memory (and the process's peak RSS), total ops of the Program,
# and the growth law time ~ devices^k fitted by least squares on log-log.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
enter_study compile-scale
sizes=(1024 4096 16384 65536)
# name | pp | flags
strategies=(
  "qwen3-30b-a3b DualPipeV PP8 EP8 ZeRO-1 M64|8|--model qwen3-30b-a3b --ep 8 --zero 1 --schedule dualpipev --microbatches 64"
  "llama3-70b 1F1B PP8 ZeRO-1 M64|8|--model llama3-70b --zero 1 --schedule 1f1b --microbatches 64"
  "llama3-8b interleaved-1F1B PP4 v2 ZeRO-3 M32|4|--model llama3-8b --zero 3 --schedule interleaved-1f1b --virtual 2 --microbatches 32"
)
if [ "$QUICK" = 1 ]; then sizes=(1024 4096); strategies=("${strategies[1]}"); fi
echo "strategy,devices,compile_s,compiler_peak_mib,process_peak_rss_mib,dag_nodes,ops_total,distinct_plans" > results.csv
for st in "${strategies[@]}"; do
  IFS='|' read -r name pp flags <<< "$st"
  for n in "${sizes[@]}"; do
    # shellcheck disable=SC2086
    out=$( { /usr/bin/time -f "rss_kb %M" "$PIPER" compile $flags --pp "$pp" --dp $((n / pp)) --stats; } 2>&1 )
    awk -v name="$name" -v n="$n" '
      /^compile time/ { t=$3/1000 } /^compiler peak memory/ { m=$4 } /^rss_kb/ { r=$2/1024 }
      /^DAG nodes/ { d=$3 } /^ops total/ { o=$3 } /^distinct plans/ { p=$3 }
      END { printf "%s,%s,%.3f,%.1f,%.1f,%s,%s,%s\n", name, n, t, m, r, d, o, p }' <<< "$out" >> results.csv
  done
done
# Growth law per strategy: slope k of log(compile_s) and of log(ops_total) against log(devices).
echo "strategy,time_exponent_k,ops_exponent,time_at_smallest_s,time_at_largest_s" > growth.csv
awk -F, 'NR>1 { s=$1; x=log($2); n[s]++; sx[s]+=x; sxx[s]+=x*x; sy[s]+=log($3); sxy[s]+=x*log($3); so[s]+=log($7); sxo[s]+=x*log($7);
                if (!(s in first)) first[s]=$3; last[s]=$3 }
  END { for (s in n) { d=n[s]*sxx[s]-sx[s]^2; printf "%s,%.3f,%.3f,%s,%s\n", s, (n[s]*sxy[s]-sx[s]*sy[s])/d, (n[s]*sxo[s]-sx[s]*so[s])/d, first[s], last[s] } }' results.csv >> growth.csv
{ csv_to_md results.csv; echo; csv_to_md growth.csv; } > results.md
echo "compile-scale: $(tail -n +2 growth.csv | cut -d, -f1,2 | tr '\n' ';')"
if has_plot; then
  "$PIPER" plot results.csv --x devices --y compile_s --series strategy --line --log-x --log-y \
    --title "Compile time vs devices (pipeline fixed, data parallelism grows)" --x-label "devices" --y-label "compile time (s)" -o compile-time.png > /dev/null
  "$PIPER" plot results.csv --x devices --y process_peak_rss_mib --series strategy --line --log-x \
    --title "Compiler peak memory vs devices" --x-label "devices" --y-label "peak RSS of piper compile (MiB)" -o compile-memory.png > /dev/null
fi
