#!/usr/bin/env bash
# Every published figure the project compares against, with source, configuration, published value,
# Piper's prediction and the relative error; mean and max error printed last. Nothing is fitted:
# the cost model's constants are the presets' (sim/src/cluster.cpp), set before these comparisons.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
enter_study fidelity
mkdir -p out
echo "quantity,source,configuration,published,predicted,error_pct" > results.csv.tmp
row() { awk -v q="$1" -v s="$2" -v c="$3" -v p="$4" -v x="$5" 'BEGIN { printf "%s,%s,%s,%s,%s,%.2f\n", q, s, c, p, x, 100 * (x - p) / p }' >> results.csv.tmp; }

# 1. Parameter counts (model cards and papers), from `piper models`.
models=$("$PIPER" models)
params() { awk -v m="$1" '$1 == m { print $2 }' <<< "$models"; }
row "parameters (B)" "Meta Llama 3 model card" "llama3-8b" 8.03 "$(params llama3-8b)"
row "parameters (B)" "Meta Llama 3 model card" "llama3-70b" 70.6 "$(params llama3-70b)"
row "parameters (B)" "Brown et al. 2020 (GPT-3) table 2.1" "gpt3-175b" 175 "$(params gpt3-175b)"
row "parameters (B)" "DeepSeek-V3 technical report (671B total; MTP module not modelled)" "deepseek-v3" 671 "$(params deepseek-v3)"
row "parameters (B)" "Qwen3 technical report / model card" "qwen3-30b-a3b" 30.5 "$(params qwen3-30b-a3b)"

# 2. Pipeline bubbles: the DualPipe README table, through study 1 (unit time, exact integers).
if [ -f ../bubbles/results.csv ]; then
  n=$(($(wc -l < ../bubbles/results.csv) - 1))
  worst=$(awk -F, 'NR>1 { d=$10-$11; if (d<0) d=-d; if (d>w) w=d } END { print w+0 }' ../bubbles/results.csv)
  total=$(awk -F, 'NR>1 { s+=$11 } END { print s }' ../bubbles/results.csv)
  sim=$(awk -F, 'NR>1 { s+=$10 } END { print s }' ../bubbles/results.csv)
  row "bubble (sum over $n cases; units)" "DualPipe README / DeepSeek-V3 report table 2" "1F1B ZB1P DualPipe DualPipeV; P 4 and 8; several M and F/B/W" "$total" "$sim"
fi

# 3. Training throughput: DeepSeek-V3 report, table 1 and section 1: 180K H800 GPU hours per
# trillion tokens on 2,048 H800 GPUs (DualPipe PP16, EP64 over 8 nodes, ZeRO-1 DP; section 3.2).
# Piper: DualPipe PP16 x DP128, EP64, ZeRO-1 with the report's stated settings (DeepSeek_V3.pdf at
# deepseek-ai/DeepSeek-V3 4c2fdb8): FP8 training (section 3.3; models/deepseek-v3-fp8.json, 4K
# sequences), "only 20 SMs are sufficient to fully utilize the bandwidths of IB and NVLink" (3.2.2:
# --comm-sms 20), "we quantize the activation before MoE up-projections into FP8 and then apply
# dispatch components ... For both the forward and backward combine components, we retain them in
# BF16" (3.3.3: --fp8-dispatch), "the batch size ... keeps 15360" (4.2: 15,360 / DP 128 = 120
# microbatches of one sequence) and "the gradient clipping norm is set to 1.0" (--clip-grad 1).
# Devices in Megatron's order, pipeline rank outermost (--device-order tp-cp-dp-pp): a pipeline
# rank's 128 replicas are 16 consecutive nodes and each EP group of 64 fills 8 nodes, as in the report.
if [ "$QUICK" = 0 ]; then
  "$PIPER" simulate --model "$STUDY_SRC/models/deepseek-v3-fp8.json" --pp 16 --dp 128 --ep 64 --zero 1 --schedule dualpipe \
    --microbatches 120 --comm-sms 20 --fp8-dispatch --clip-grad 1 --device-order tp-cp-dp-pp --cluster hgx-h800 \
    --engine analytic --report out/deepseek-v3.json > /dev/null
  hours=$(jq -r '2048 * .step_time_s / .tokens_per_step * 1e12 / 3600 / 1000' out/deepseek-v3.json)
  row "H800 GPU hours per trillion tokens (thousands)" "DeepSeek-V3 technical report table 1" "deepseek-v3 on 2048 H800 (hgx-h800); DualPipe PP16 EP64 (8 nodes) ZeRO-1; fp8 with fp8 dispatch; 20 comm SMs; 120 microbatches" 180 "$(printf '%.1f' "$hours")"
fi
# 4. Megatron 22B, Korthikanti et al. table 5 (study 6), on the SimGrid engine when it ran.
if [ -f ../megatron-22b/results.csv ]; then
  engine=$(awk -F, 'NR>1 { print $2; exit }' ../megatron-22b/results.csv)
  awk -F, -v e="$engine" 'NR>1 && $2==e { printf "%s,%s,%s\n", $1, $3, $4 }' ../megatron-22b/results.csv |
    while IFS=, read -r name pub pred; do
      row "iteration time (s)" "Korthikanti et al. 2022 (arXiv:2205.05198) table 5" "gpt-22b on 8 A100-80GB; TP 8; $name; global batch 4 x 2048; $engine" "$pub" "$pred"
    done
fi
# 4b. The same 22B's per-layer forward and backward times, Korthikanti et al. table 4 (study 6).
if [ -f ../megatron-22b/layers.csv ]; then
  awk -F, 'NR>1 { printf "%s,%s,%s,%s\n", $1, $2, $3, $4 }' ../megatron-22b/layers.csv |
    while IFS=, read -r name pass pub pred; do
      row "layer $pass time (ms)" "Korthikanti et al. 2022 (arXiv:2205.05198) table 4" "gpt-22b one layer on 8 A100-80GB; TP 8; $name; micro-batch 4 x 2048; analytic" "$pub" "$pred"
    done
fi
# 4c. The same paper's 175B, 530B and 1T iteration times (its table 5 and section 6.3; study 6).
if [ -f ../megatron-22b/table5.csv ]; then
  awk -F, 'NR>1 { printf "%s,%s,%s,%s,%s\n", $1, $2, $3, $4, $5 }' ../megatron-22b/table5.csv |
    while IFS=, read -r label name gpus pub pred; do
      row "iteration time (s)" "Korthikanti et al. 2022 (arXiv:2205.05198) table 5 / section 6.3" "gpt-$label on $gpus A100-80GB; TP 8; $name; micro-batch 1; analytic" "$pub" "$pred"
    done
fi
# 5. One H200 (the project's own measurement, data/torch-dense1b.txt, copied from
# shared/measurements/h200/): dense-1b, 2 microbatches of 4 x 1024 tokens, bf16, fused AdamW, in
# PyTorch eager (123.3 ms) and torch.compile (103.0 ms). Predicted uncalibrated by the dgx-h200
# preset's kernel table under the matching runtime profile (cluster "runtime": eager / fused).
for profile in fused eager; do
  echo "{\"preset\": \"dgx-h200\", \"runtime\": \"$profile\"}" > out/h200-$profile.json
  "$PIPER" simulate --model "$REPO_DIR/examples/models/dense-1b.json" --microbatches 2 --cluster out/h200-$profile.json \
    --engine analytic --report out/dense1b-$profile.json > /dev/null
done
measured() { awk -v w="$1" '$1 == "torch" && $2 == w":" { for (i = 1; i <= NF; ++i) if ($i == "step") { print $(i + 1); exit } }' "$STUDY_SRC/data/torch-dense1b.txt"; }
row "step time (ms)" "Piper H200 measurement (data/torch-dense1b.txt): torch.compile" "dense-1b on 1 H200; 2 x 4 x 1024 tokens; bf16; runtime fused" "$(measured compile)" "$(jq -r '.step_time_s * 1000' out/dense1b-fused.json)"
row "step time (ms)" "Piper H200 measurement (data/torch-dense1b.txt): PyTorch eager" "dense-1b on 1 H200; 2 x 4 x 1024 tokens; bf16; runtime eager" "$(measured eager)" "$(jq -r '.step_time_s * 1000' out/dense1b-eager.json)"
# 6. Published measured step times (steptimes.json, 84 cases from 6 sources; README "Step times"): full
# mode writes steptimes.csv/.md/.svg here; quick mode checks the file and simulates 3 cases. Full mode
# also compares the published per-stage op times (stagetimes.json; README "Stage times").
if [ "$QUICK" = 1 ]; then
  PIPER="$PIPER" python3 "$STUDY_SRC/steptimes.py" --check > /dev/null
else
  PIPER="$PIPER" python3 "$STUDY_SRC/steptimes.py" --out "$PWD"
  PIPER="$PIPER" python3 "$STUDY_SRC/stagetimes.py" --out "$PWD"
fi
# 7. A kernel table calibrated on Piper's CUDA backend at PP 1 (one H200) predicting its PP 2 runs on
# virtual devices sharing the GPU (calibrated.sh writes calibrated.md).
bash "$STUDY_SRC/calibrated.sh" "$@"
while IFS=, read -r name m s; do
  [ "$name" = pp1 ] && continue  # the run it was fitted to
  row "step time (ms)" "Piper CUDA backend on one H200 (data/h200-piper-cuda; table calibrated at PP 1)" "dense-1b $name on 2 virtual devices sharing the GPU" \
    "$(awk -v x="$m" 'BEGIN { printf "%.1f", x * 1000 }')" "$(awk -v x="$s" 'BEGIN { printf "%.1f", x * 1000 }')"
done < out/calibrated.csv
mv results.csv.tmp results.csv
{ csv_to_md results.csv; echo;
  awk -F, 'NR>1 { e=$6; if (e<0) e=-e; s+=e; n++; if (e>m) { m=e; w=$3 } } END { printf "mean |error| %.2f %% over %d figures; max |error| %.2f %% (%s)\n", s/n, n, m, w }' results.csv; } > results.md
tail -1 results.md
