#!/usr/bin/env bash
# Study 1: pipeline bubbles and activation memory of 1F1B, ZB1P (zb-h1), DualPipe and DualPipeV in
# unit time (`piper schedule show`, computed from each compiled program), against the closed forms
# of the DualPipe README / DeepSeek-V3 report (table 2).
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
enter_study bubbles
ranks=(4 8); costs=("1,2,1" "2,3,1"); [ "$QUICK" = 1 ] && ranks=(4) && costs=("1,2,1")
out=results.csv.tmp
echo "family,ranks,stages,microbatches,F,B,W,step_units,busy_units,bubble_sim,bubble_formula,bubble_match,peak_act_sim,peak_act_formula,act_match" > "$out"
for p in "${ranks[@]}"; do
  for c in "${costs[@]}"; do
    IFS=, read -r F B W <<< "$c"
    for m in $((2 * p)) $((4 * p)); do
      for fam in 1f1b zb-h1 dualpipe dualpipev; do
        show=$("$PIPER" schedule show "$fam" --ranks "$p" --microbatches "$m" --costs "$c")
        step=$(sed -n 's/^step time \([0-9.]*\) units.*/\1/p' <<< "$show")
        # Bubble and busy of the worst rank; peak activations = the largest over ranks.
        read -r busy bubble act <<< "$(awk '/^rank [0-9]+ +busy/ { if ($6 > b) { b = $6; u = $4 } if ($9 > a) a = $9 } END { print u, b, a }' <<< "$show")"
        case "$fam" in
          1f1b)      stages=$p;       fb=$(( (p - 1) * (F + B) ));                    fa=$p ;;
          zb-h1)     stages=$p;       fb=$(( (p - 1) * (F + B - 2 * W) ));            fa=$p ;;
          dualpipe)  stages=$p;       fb=$(( (p / 2 - 1) * ((F + B) + B - 3 * W) ));  fa=$((p + 1)) ;;
          dualpipev) stages=$((2*p)); fb=$(( (2 * p / 2 - 1) * ((F + B) + B - 3 * W) )); fa=$((2 * p + 1)) ;;
        esac
        bm=$([ "$bubble" = "$fb" ] && echo yes || echo no)
        am=$([ "$act" = "$fa" ] && echo yes || echo no)
        echo "$fam,$p,$stages,$m,$F,$B,$W,$step,$busy,$bubble,$fb,$bm,$act,$fa,$am" >> "$out"
      done
    done
  done
done
mv "$out" results.csv
csv_to_md results.csv > results.md
echo "bubbles: $(grep -c ',yes,' results.csv) of $(($(wc -l < results.csv) - 1)) rows match the bubble formula; $(awk -F, 'NR>1 && $15=="yes"' results.csv | wc -l) match the activation formula"
if has_plot; then
  # Bubble fraction (bubble / step) against microbatches, P = the largest rank count, F=1 B=2 W=1; and simulated
  # against closed-form bubbles for every row (all points on the diagonal when they agree).
  awk -F, -v p="${ranks[-1]}" 'NR==1 { print "family,microbatches,bubble_fraction_pct" } NR>1 && $2==p && $5==1 { printf "%s,%s,%.2f\n", $1, $4, 100*$10/$8 }' results.csv > plot-fraction.csv
  "$PIPER" plot plot-fraction.csv --x microbatches --y bubble_fraction_pct --series family --line \
    --title "Unit-time bubble, ${ranks[-1]} pipeline ranks, F=1 B=2 W=1" --x-label "microbatches per step" --y-label "bubble / step time (%)" -o bubble-fraction.png > /dev/null
  "$PIPER" plot results.csv --x bubble_formula --y bubble_sim --series family \
    --title "Simulated bubble vs closed form (DualPipe README), all P, M, costs" --x-label "closed-form bubble (time units)" --y-label "simulated bubble (time units)" -o bubble-vs-formula.png > /dev/null
fi
