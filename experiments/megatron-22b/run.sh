#!/usr/bin/env bash
# Study 6: the 22B GPT of Korthikanti et al. (arXiv:2205.05198) on 8 A100-80GB GPUs with tensor
# parallelism 8 (PP 1, DP 1), global batch 4 sequences of 2,048 tokens: iteration time with full
# activation recomputation (TP alone) and with sequence parallelism + selective recomputation
# ("present work"), against the paper's table 5. Both engines; the analytic one is the fast check. And
# the time of one layer's forward and backward in five settings, against its table 4.
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

# Table 4 of the paper: the forward and backward time of one transformer layer of the same 22B (TP 8,
# micro-batch 4 as in its table 3), five settings, in ms. One layer alone: 48 pipeline stages of one
# block each, blocking transfers so that no transfer runs beside a layer's compute; the mean F and B
# op of the middle stage (device 24) in the analytic engine's trace. Only the ops are compared.
echo "configuration,pass,published_ms,predicted_ms,error_pct" > layers.csv
for cfg in "no recompute|--recompute none|7.7|11.9" "sequence parallel|--sequence-parallel --recompute none|7.2|11.8" \
  "full recompute|--recompute full|7.7|19.5" "selective recompute|--recompute selective|7.7|13.2" \
  "selective + sequence parallel|--sequence-parallel --recompute selective|7.2|13.1"; do
  IFS='|' read -r name flags pub_f pub_b <<< "$cfg"
  t="out/layer-$(echo "$name" | tr ' +' '__').trace.json"
  # shellcheck disable=SC2086
  "$PIPER" simulate --model "$model" --tp 8 $flags --pp 48 --dp 1 --schedule 1f1b --microbatches 48 --micro-batch-size 4 \
    --p2p-blocking --cluster dgx-a100-80g --engine analytic --trace "$t" > /dev/null
  for pass in F B; do
    pub=$pub_f; [ "$pass" = B ] && pub=$pub_b
    jq -r --arg n "$name" --arg p "$pass" --argjson pub "$pub" \
      '[.traceEvents[] | select(.ph == "X" and .pid == 24 and .cat == "COMPUTE" and (.name | startswith($p + " "))) | .dur]
       | (add / length / 1000) as $ms | [$n, $p, $pub, ($ms * 1000 | round / 1000), (($ms - $pub) / $pub * 100 * 100 | round / 100)] | @csv' \
      "$t" | tr -d '"' >> layers.csv
  done
done
csv_to_md layers.csv > layers.md
echo "megatron-22b layers: $(awk -F, 'NR>1 { printf "%s %s %s ms vs %s (%+.1f%%); ", $1, $2, $4, $3, $5 }' layers.csv)"

# The paper's other table 5 rows: the 175B, 530B and 1T of its table 3 (TP 8; PP 8, 35 and 64 with 64,
# 280 and 512 GPUs; global batch = GPUs, micro-batch 1; "the interleaving schedule with three
# interleaving stages (m = 3) for the 175B and 530B models"), full recomputation and SP + selective;
# and section 6.3's 530B at 8-way data parallelism (2,240 GPUs, the batch x 8). Analytic engine; quick
# mode runs the 175B only.
echo "model,configuration,gpus,published_s,predicted_s,error_pct,mfu_pct,peak_gib,oom" > table5.csv
cases=("175B|gpt-175b|--pp 8 --schedule interleaved-1f1b --virtual 3|64|18.13|13.75")
[ "$QUICK" = 0 ] && cases+=("530B|gpt-530b|--pp 35 --schedule interleaved-1f1b --virtual 3|280|49.05|37.83"
  "1T|gpt-1t|--pp 64 --schedule 1f1b|512|94.42|71.49"
  "530B DP 8|gpt-530b|--pp 35 --dp 8 --schedule interleaved-1f1b --virtual 3|2240|-|39.15")
for c in "${cases[@]}"; do
  IFS='|' read -r label spec layout gpus pub_full pub_present <<< "$c"
  for cfg in "full recompute|--recompute full|$pub_full" "sequence parallel + selective recompute|--sequence-parallel --recompute selective|$pub_present"; do
    IFS='|' read -r name flags pub <<< "$cfg"
    [ "$pub" = - ] && continue
    r="out/$(echo "$label $name" | tr ' +' '__').json"
    # shellcheck disable=SC2086
    "$PIPER" simulate --model "$REPO_DIR/examples/models/$spec-korthikanti.json" --tp 8 $layout $flags \
      --global-batch "$gpus" --micro-batch-size 1 --cluster dgx-a100-80g --engine analytic --report "$r" > /dev/null
    jq -r --arg m "$label" --arg n "$name" --arg g "$gpus" --argjson p "$pub" \
      '[$m, $n, $g, $p, (.step_time_s * 1000 | round / 1000), ((.step_time_s - $p) / $p * 100 * 100 | round / 100), (.mfu * 1000 | round / 10), (.peak_memory_bytes / 1073741824 * 100 | round / 100), .oom] | @csv' "$r" | tr -d '"' >> table5.csv
  done
done
csv_to_md table5.csv > table5.md
echo "megatron-22b table 5: $(awk -F, 'NR>1 { printf "%s %s %s s vs %s s (%+.1f%%); ", $1, $2, $5, $4, $6 }' table5.csv)"
