#!/usr/bin/env bash
# Study 6: the 22B GPT of Korthikanti et al. (arXiv:2205.05198) on 8 A100-80GB GPUs with tensor
# parallelism 8 (PP 1, DP 1), global batch 4 sequences of 2,048 tokens: iteration time with full
# activation recomputation (TP alone) and with sequence parallelism + selective recomputation
# ("present work"), against the paper's table 5. Both engines; the analytic one is the fast check.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
enter_study megatron-22b
mkdir -p out
model="$REPO_DIR/examples/models/gpt-22b-korthikanti.json"
engines=(simgrid analytic); [ "$QUICK" = 1 ] && engines=(analytic)
# Table 5 of the paper (22B row), seconds per iteration; see README.md about these figures.
published_full=1.42; published_present=1.10
echo "configuration,engine,published_s,predicted_s,error_pct,mfu_pct,peak_gib,oom" > results.csv
for engine in "${engines[@]}"; do
  for cfg in "full recompute|--recompute full|$published_full" "sequence parallel + selective recompute|--sequence-parallel --recompute selective|$published_present"; do
    IFS='|' read -r name flags pub <<< "$cfg"
    r="out/$(echo "$name" | tr ' +' '__')-$engine.json"
    # shellcheck disable=SC2086
    "$PIPER" simulate --model "$model" --tp 8 $flags --pp 1 --dp 1 --schedule 1f1b --microbatches 1 --micro-batch-size 4 \
      --cluster dgx-a100-80g --engine "$engine" --report "$r" > /dev/null
    jq -r --arg n "$name" --arg e "$engine" --argjson p "$pub" \
      '[$n, $e, $p, (.step_time_s * 1000 | round / 1000), ((.step_time_s - $p) / $p * 100 * 100 | round / 100), (.mfu * 1000 | round / 10), (.peak_memory_bytes / 1073741824 * 100 | round / 100), .oom] | @csv' "$r" | tr -d '"' >> results.csv
  done
done
csv_to_md results.csv > results.md
echo "megatron-22b: $(awk -F, 'NR>1 { printf "%s/%s %s s vs %s s (%+.1f%%); ", $1, $2, $4, $3, $5 }' results.csv)"
