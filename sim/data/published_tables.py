#!/usr/bin/env python3
"""Writes the kernel-efficiency tables of GPUs Piper has not measured itself (A100-SXM4-40GB,
A100-SXM4-80GB, H100-SXM5-80GB) from published microbenchmarks, each number cited in the file.

Every entry carries either
  * "source": {"ref": <key of the table's "sources">, "quote": <the text the number is read from>}
    (a published figure at that shape, copied as printed), or
  * "derived": <key of the table's "rules"> (no published figure: the H200 measurement of
    kernels-h200-sxm.json at the same shape, scaled by the rule's stated factor).

The factors are fixed by the rules below from datasheets and the cited sources, before and
independently of any comparison with training-step times; nothing here is fitted to a step time.
Python 3 standard library only:

    python3 sim/data/published_tables.py          # rewrites sim/data/kernels-{a100-40gb,a100-80gb,h100}-sxm.json
    python3 sim/data/published_tables.py --check  # exit 1 naming each file that differs from what it writes
"""
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# ---- sources (read 2026-12-04; commits pin the text quoted) ----
MAMF = {
    "url": "https://github.com/stas00/ml-engineering/blob/744d01e18b79512572f64a6bbd8b5f4a725203a7/compute/accelerator/README.md#maximum-achievable-matmul-flops-comparison-table",
    "title": "Stas Bekman, Machine Learning Engineering Open Book: Maximum Achievable Matmul FLOPS comparison table",
    "location": "section 'Maximum Achievable Matmul FLOPS comparison table', BF16 and FP8 tables (columns: Accelerator | MAMF | Theory | Efficiency | Best Shape MxNxK | torch version | Notes)",
    "method": "mamf-finder.py: torch.mm of an [M x K] by a [K x N] random matrix, 'a mean of 100 iterations after 50 warmup iterations for each shape', best shape of a search",
    "licence": "CC BY-SA 4.0 (numbers and short quotes, attributed)",
}
RRZE_A100_40 = {
    "url": "https://github.com/RRZE-HPC/gpu-benches/blob/1038c5d0d0f48cfe9912930d34eb2d8a31b72b9b/gpu-stream/a100_40.txt",
    "title": "RRZE-HPC gpu-benches, gpu-stream results for the A100 40 GB",
    "location": "last row (full occupancy); columns: init read scale triad 3pt 5pt, in GB/s",
    "method": "gpu-stream/main.cu: fp64 streaming kernels, scale A[i] = B[i] * c (1 load, 1 store stream), triad A[i] = B[i] * D[i] + C[i] (3 load, 1 store streams); this file has the output format of main.cu before commit 2952d3f, whose arrays are 128 Mi + 2 doubles (1 GiB) each",
    "licence": "GPL-3.0 repository (numbers only, attributed)",
}
RRZE_A100_80 = dict(RRZE_A100_40)
RRZE_A100_80.update({
    "url": "https://github.com/RRZE-HPC/gpu-benches/blob/1038c5d0d0f48cfe9912930d34eb2d8a31b72b9b/gpu-stream/a100_80.txt",
    "title": "RRZE-HPC gpu-benches, gpu-stream results for the A100 80 GB",
    "method": "gpu-stream/main.cu at the same commit: fp64 streaming kernels over arrays of 256 Mi + 2 doubles (2 GiB) each; scale A[i] = B[i] * c (1 load, 1 store stream), triad A[i] = B[i] * D[i] + C[i] (3 load, 1 store streams). The file names the GPU 'a100_80' without its form factor; its write-only rate (init, 1894 GB/s) is 93 % of the SXM4's 2039 GB/s and 98 % of the PCIe card's 1935 GB/s",
})
ZZC_H100 = {
    "url": "https://github.com/zzc0721/torch-performance-test-data/issues/79",
    "title": "torch-performance-test-data issue #79, 'NVIDIA H100 80GB HBM3' (the device name of the H100 SXM5 80 GB; the PCIe card reports 'NVIDIA H100 PCIe')",
    "location": "issue description, section '详细性能数据' (detailed performance data), PyTorch 2.7.0+cu128",
    "method": "test.py of github.com/zzc0721/torch-performance-test-data (commit 9d82827): square torch.mm of randn matrices, 10 warm-ups, then 30 back-to-back calls between two CUDA events",
    "licence": "figures posted publicly in a GitHub issue; numbers only, attributed",
}

FA_PR1791 = {
    "url": "https://github.com/Dao-AILab/flash-attention/pull/1791",
    "title": "Dao-AILab/flash-attention pull request #1791 'ABI stable fa3' (2025-07-31), 'Results of python benchmark_attn.py', `main` block",
    "location": "PR description, the `main` results before 'this branch'",
    "method": "hopper/benchmark_attn.py of FlashAttention: FlashAttention-2 and FlashAttention-3 on one Hopper GPU (FA3 runs only on sm90), bf16",
    "licence": "figures posted publicly in a GitHub pull request; numbers only, attributed",
}
FA2_PAPER = {
    "url": "https://arxiv.org/abs/2307.08691",
    "title": "Tri Dao, 'FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning' (ICLR 2024), arXiv:2307.08691, Figure 4(c) 'Attention forward + backward speed (A100 80GB SXM4)', with causal mask, head dimension 64",
    "location": "Figure 4(c): the TFLOP/s printed above each bar, series 'FlashAttention' and 'FlashAttention-2', sequence length 512, 1k, 2k, 4k, 8k, 16k (the figure is an image in the paper; its bar labels are text in the e-print's figure file figs/flash2_causal_True_hdim_64_fwd_bwd_speed.pdf)",
    "method": "section 4.1: 'We vary the sequence length from 512, 1k, ..., 16k, and set batch size so that the total number of tokens is 16k. We set hidden dimension to 2048, and head dimension to be either 64 or 128 (i.e., 32 heads or 16 heads)'; causal FLOPs are half of 4 seqlen^2 head_dim heads, the backward 2.5 times the forward",
    "licence": "arXiv paper; numbers and short quotes, attributed",
}
# Figure 4(c) of FA2_PAPER, forward + backward TFLOP/s of the two kernels by sequence length (512 ... 16k).
FA2_PAPER_SEQ = [512, 1024, 2048, 4096, 8192, 16384]
FA2_PAPER_FA1 = [58, 70, 77, 87, 92, 97]
FA2_PAPER_FA2 = [88, 119, 140, 156, 165, 171]
FA1_QUOTE = ("Figure 4(c), bar labels (TFLOPs/s), sequence length 512 1k 2k 4k 8k 16k: FlashAttention "
             + " ".join(map(str, FA2_PAPER_FA1)) + "; FlashAttention-2 " + " ".join(map(str, FA2_PAPER_FA2)))
# FlashAttention 1.x over FlashAttention-2: the geometric mean of the figure's six ratios (0.66 at 512, 0.55-0.57
# from 2k on), one ratio at every shape, forward and backward (the figure times them together).
FA1_OVER_FA2 = math.exp(sum(math.log(a / b) for a, b in zip(FA2_PAPER_FA1, FA2_PAPER_FA2)) / len(FA2_PAPER_SEQ))
FA1_PAPER = {
    "url": "https://arxiv.org/abs/2205.14135v2",
    "title": "Dao, Fu, Ermon, Rudra, Re, 'FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness' (NeurIPS 2022), arXiv:2205.14135v2, Appendix E.6 'Full Benchmarking Results'",
    "location": "Table 15 (forward runtime in ms, with dropout), Table 16 (backward, with dropout), Table 18 (forward, without dropout or masking), Table 19 (backward, without); rows 'PyTorch Attention' and 'Megatron'; columns: sequence length 128, 256, 512, 1024, 2048, 4096, 8192, ... ('-': out of memory or not supported)",
    "method": "'We measure runtime and memory usage of the attention computation with 8 heads of dimension 64, and batch size 16 on a machine with one A100 GPU with 40 GB of GPU HBM. ... We compute attention on random vectors for Q, K, and V (we do not measure the projection from the hidden layer). For dropout, we use dropout 0.1 ... we take the average of 100 measurements of the attention call.' 'We use FP16 for all measurements'. No mask: the full (non-causal) s x s scores",
    "licence": "arXiv paper; numbers and short quotes, attributed",
}

# Standard attention (the s x s scores in HBM) on the A100-40GB: FA1_PAPER's rows, by sequence length, as
# printed (the first four rows: Tables 15, 16, 18, 19). Columns where both passes ran are used.
FA1_SEQ = [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
FA1_ROWS = {
    # (implementation, dropout): (forward row, backward row, their tables)
    ("pytorch", True): ("PyTorch Attention 0.26 0.24 0.57 1.80 6.56 25.34 - - - -",
                        "PyTorch Attention 0.44 0.35 0.90 2.94 10.77 41.67 - - - -", (15, 16)),
    ("megatron", True): ("Megatron 0.27 0.27 0.56 1.88 6.56 - - - - -",
                         "Megatron 0.28 0.33 0.92 2.94 10.80 - - - - -", (15, 16)),
    ("pytorch", False): ("PyTorch Attention 0.21 0.22 0.43 1.27 4.32 16.47 67.77 - - -",
                         "PyTorch Attention 0.26 0.29 0.78 2.44 8.82 33.87 - - - -", (18, 19)),
    ("megatron", False): ("Megatron 0.24 0.26 0.42 1.33 4.28 - - - - -",
                          "Megatron 0.29 0.30 0.80 2.59 8.86 - - - - -", (18, 19)),
}


def standard_attention_entries():
    out = []
    for (impl, dropout), (fwd_row, bwd_row, (tf, tb)) in FA1_ROWS.items():
        fwd, bwd = fwd_row.split()[-len(FA1_SEQ):], bwd_row.split()[-len(FA1_SEQ):]
        for col, (s, f, b) in enumerate(zip(FA1_SEQ, fwd, bwd)):
            if f == "-" or b == "-":
                continue
            out.append({"implementation": impl, "dropout": dropout, "b": 16, "heads": 8, "s": s, "head_dim": 64,
                        "dtype": "fp16", "fwd_ms": float(f), "bwd_ms": float(b),
                        "source": {"ref": "fa1-paper", "quote": f"Table {tf}: {fwd_row} / Table {tb}: {bwd_row}",
                                   "note": f"column {col + 1}: sequence length {s}; forward from Table {tf}, "
                                           f"backward from Table {tb}"}})
    return out


def fa1_kernel(fa2):
    """FlashAttention 1.x (flash-attn < 2.0, as MosaicML llm-foundry pinned it) at FA1_OVER_FA2 of FlashAttention-2's
    rates."""
    return {"fwd_scale": r(fa2["fwd_scale"] * FA1_OVER_FA2, 6), "bwd_scale": r(fa2["bwd_scale"] * FA1_OVER_FA2, 6),
            "source": {"ref": "fa2-paper", "quote": FA1_QUOTE,
                       "note": f"FlashAttention 1.x at {r(FA1_OVER_FA2, 6)} of the rates of FlashAttention-2 ('fa2' of "
                               f"this table), the geometric mean of the six ratios FlashAttention / FlashAttention-2 "
                               f"of the figure, forward and backward, at every shape"}}


# FlashAttention-2 against a Hopper-native kernel at one shape (causal, head_dim 128, seq 8192), the source's
# four figures; the table's own attention (cuDNN on the H200, 615 / 511 TFLOP/s at that shape with 32 heads)
# is within 3 % / 4 % of FlashAttention-3's 630.0 / 531.6, so FA2 is costed at these ratios of it.
FA2_FWD, FA2_BWD, FA3_FWD, FA3_BWD = 284.1, 287.1, 630.0, 531.6
FA2_QUOTE = ("### headdim = 128, causal = True, seqlen = 8192 ### Fav2 fwd: 1.935ms, 284.1 TFLOPS "
             "Fav2 bwd: 4.788ms, 287.1 TFLOPS Fav3 fwd: 0.873ms, 630.0 TFLOPS Fav3 bwd: 2.585ms, 531.6 TFLOPS")

# ---- datasheet figures the rules use ----
A100_BF16_MAMF, H100_BF16_MAMF = 271.2, 794.5   # MAMF table above; its H100 row notes "H200 is the same"
A100_FP32, H100_FP32 = 19.5, 67.0               # NVIDIA A100 / H100 SXM datasheets, FP32 (CUDA cores) TFLOPS
H200_COPY_LARGEST = None                        # filled from kernels-h200-sxm.json (copy, 32768 x 8192 bf16)


def load_h200():
    with open(os.path.join(HERE, "kernels-h200-sxm.json")) as f:
        return json.load(f)


def r(x, digits=12):
    return float(f"{x:.{digits}g}")


def gemm_entry(dtype, m, k, n, tflops, **prov):
    e = {"dtype": dtype, "m": m, "k": k, "n": n, "tflops": r(tflops)}
    e.update(prov)
    return e


def dispatch_latency_s(h200):
    """The CPU dispatch latency in the H200's single-launch GEMM timings, by the loader's "estimate" rule
    (sim/src/kernel_table.cpp, docs/cost-model.md): the median over (dtype, K, N) curves of the time at
    M = 0 on the line through the two smallest M."""
    curves = {}
    for g in h200["gemm"]:
        if "tflops" in g:
            curves.setdefault((g["dtype"], g["k"], g["n"]), {})[g["m"]] = 2.0 * g["m"] * g["k"] * g["n"] / (g["tflops"] * 1e12)
    at_zero = []
    for c in curves.values():
        if len(c) < 2:
            continue
        (m1, t1), (m2, t2) = sorted(c.items())[:2]
        at_zero.append(t1 - (t2 - t1) / (m2 - m1) * m1)
    at_zero.sort()
    n = len(at_zero)
    return max(0.0, at_zero[n // 2] if n % 2 else (at_zero[n // 2 - 1] + at_zero[n // 2]) / 2)


def derive(h200, latency, compute_rule, compute_factor, fp32_rule, fp32_factor, memory_rule, memory_factor,
           with_fp8):
    """The H200's entries scaled by the rules' factors, each marked with its rule. A GEMM entry is a
    single-launch timing: its GPU part (the time less `latency`, the CPU's dispatch latency) is scaled,
    the dispatch latency, a host cost, is kept as it is."""
    gemm = []
    for g in h200["gemm"]:
        if "error" in g:
            continue
        if g["dtype"] == "fp8" and not with_fp8:
            continue  # the A100 has no fp8 tensor cores: no rate to derive
        rule, f = (fp32_rule, fp32_factor) if g["dtype"] == "fp32" else (compute_rule, compute_factor)
        work = 2.0 * g["m"] * g["k"] * g["n"]
        t = work / (g["tflops"] * 1e12)
        gpu = max(t - latency, t / 4)  # the loader's floor: a corrected time keeps a quarter of the measured one
        gemm.append(gemm_entry(g["dtype"], g["m"], g["k"], g["n"], work / (gpu / f + (t - gpu)) / 1e12,
                               derived=rule))
    att = []
    for a in h200["attention"]:
        e = {k: a[k] for k in ("b", "s", "heads", "kv_heads", "head_dim")}
        e["fwd_tflops"] = r(a["fwd_tflops"] * compute_factor)
        e["bwd_tflops"] = r(a["bwd_tflops"] * compute_factor)
        e["derived"] = compute_rule
        att.append(e)
    mem = []
    for m in h200["memory_bound"]:
        bytes_moved = m["gbps"] * 1e9 * m["s"]
        mem.append({"kernel": m["kernel"], "gbps": r(m["gbps"] * memory_factor), "bytes": r(bytes_moved, 10),
                    "derived": memory_rule})
    adam = []
    for a in h200["adamw"]:
        adam.append({"params": a["params"], "param_dtype": a["param_dtype"], "s": r(a["s"] / memory_factor),
                     "derived": memory_rule})
    return gemm, att, mem, adam


def replace_cited(derived, cited):
    """Cited GEMM entries replace a derived entry of the same dtype and shape."""
    keys = {(c["dtype"], c["m"], c["k"], c["n"]) for c in cited}
    return [d for d in derived if (d["dtype"], d["m"], d["k"], d["n"]) not in keys] + cited


# The A100 tables' attention is the H200's cuDNN scaled by the matmul ratio; no FlashAttention-2 figure on
# the A100 is used, so "fa2" is the table's own rates (rule a100-attention-fa2).
FA2_A100 = {"fwd_scale": 1.0, "bwd_scale": 1.0, "derived": "a100-attention-fa2"}


def combined_tflops(fwd, bwd):
    """Forward + backward TFLOP/s of one attention call, the backward doing 2.5 times the forward's work
    (FA2_PAPER's count)."""
    return 3.5 / (1 / fwd + 2.5 / bwd)


def anchor_a100_hd64_attention(att):
    """Head dimension 64 on the A100: FA2_PAPER's Figure 4(c) times FlashAttention-2 at exactly the shapes of the
    H200's head-dim-64, 32-head entries (batch x 32 heads x s = 16k tokens, causal), forward and backward
    together. Those entries take the figure's rate, split into forward and backward as the H200's cuDNN
    split its time at that shape; the other head-dim-64 entries (16 heads) take the same factor over the
    a100-compute rate at their sequence length. Returns the rule's text."""
    factors = {}
    for s, fig in zip(FA2_PAPER_SEQ, FA2_PAPER_FA2):
        e = next(a for a in att if a["head_dim"] == 64 and a["heads"] == 32 and a["s"] == s)
        assert e["b"] * e["s"] == 16384, e
        factors[s] = fig / combined_tflops(e["fwd_tflops"], e["bwd_tflops"])
    for a in att:
        if a["head_dim"] != 64:
            continue
        c = factors[a["s"]]
        a["fwd_tflops"], a["bwd_tflops"] = r(a["fwd_tflops"] * c), r(a["bwd_tflops"] * c)
        a["derived"] = "a100-attention-hd64"
    return ("Causal attention at head dimension 64: the a100-compute rate x the factor that brings the 32-head entry "
            "of the same sequence length to FlashAttention-2's forward + backward rate in source 'fa2-paper' "
            "(Figure 4(c), measured on an A100 80GB at exactly those shapes), forward and backward alike: "
            + ", ".join(f"{s}: {r(c, 4)}" for s, c in factors.items())
            + ". The H200's cuDNN runs head dimension 64 far below its head-dimension-128 rates, so the matmul ratio "
              "alone left these 13-47 % below the figure.")


def a100_table(h200, latency, gb, stream_src, stream_row, scale_gbps, triad_gbps, array_bytes, device):
    copy_h200 = max((m for m in h200["memory_bound"] if m["kernel"] == "copy"), key=lambda m: m["gbps"] * m["s"])
    mem_factor = scale_gbps / copy_h200["gbps"]
    compute_factor = A100_BF16_MAMF / H100_BF16_MAMF
    rules = {
        "a100-compute": (
            f"H200 measured rate at the same shape (kernels-h200-sxm.json) x {r(compute_factor)} = {A100_BF16_MAMF} / "
            f"{H100_BF16_MAMF}: the ratio of the maximum achievable bf16 matmul TFLOP/s of the A100 SXM and the "
            f"H100 SXM ('H200 is the same') measured by one tool (source 'mamf'); for a GEMM, its GPU time (the "
            f"single-launch time less the H200's CPU dispatch latency, the loader's estimate) is scaled and the "
            f"latency kept. Used for bf16/fp16 and tf32 GEMMs "
            f"(tf32 is half the bf16 tensor-core peak on both datasheets) and for causal attention."),
        "a100-fp32": (
            f"H200 measured fp32 GEMM rate x {r(A100_FP32 / H100_FP32)} = {A100_FP32} / {H100_FP32} TFLOP/s, the FP32 "
            f"(CUDA-core) peaks of the A100 and H100 SXM datasheets (GPU time scaled, dispatch latency kept, as "
            f"a100-compute)."),
        "a100-memory": (
            f"H200 measured rate of the same kernel class and size x {r(mem_factor)} = {scale_gbps} GB/s (A100 "
            f"stream 'scale', source '{stream_src}') / {r(copy_h200['gbps'], 7)} GB/s (H200 'copy' of "
            f"{copy_h200['tokens']} x {copy_h200['hidden']} bf16, its largest). Also used for fused AdamW."),
        "a100-attention-fa2": (
            "The attention implementation 'fa2' (FlashAttention-2, PyTorch's flash SDPA backend) at the table's own "
            "attention rates: they are the H200's cuDNN rates x the A100/H100 matmul ratio (a100-compute), which "
            "stands for Ampere's best attention kernel; no separate FlashAttention-2 measurement on the A100 is used."),
    }
    gemm, att, mem, adam = derive(h200, latency, "a100-compute", compute_factor, "a100-fp32", A100_FP32 / H100_FP32,
                                  "a100-memory", mem_factor, with_fp8=False)
    rules["a100-attention-hd64"] = anchor_a100_hd64_attention(att)
    cited_gemm = [gemm_entry("bf16", 1024, 5120, 10240, A100_BF16_MAMF, source={
        "ref": "mamf",
        "quote": "| NVIDIA A100 SXM  |  271.2 |    312 |      86.9% |  1024x10240x5120 | 2.6.0+cu126",
        "note": "MxNxK = 1024 x 10240 x 5120; the row does not say 40 or 80 GB (the two share the SXM4 compute: 108 SMs, 1410 MHz boost, 312 TFLOP/s)"})]
    mem += [
        {"kernel": "copy", "gbps": scale_gbps, "bytes": 2 * array_bytes,
         "source": {"ref": stream_src, "quote": stream_row,
                    "note": "'scale' (one load and one store stream of fp64 arrays) as the copy class"}},
        {"kernel": "add", "gbps": triad_gbps, "bytes": 4 * array_bytes,
         "source": {"ref": stream_src, "quote": stream_row,
                    "note": "'triad' (three load streams and one store) as the add class (two loads and one store)"}},
    ]
    return {
        "name": f"a100-{gb}gb-sxm",
        "device": device,
        "cited": True,
        # The derived GEMMs keep the H200's single-launch dispatch latency (µs, the loader's estimate on the
        # H200's table), which the loader removes again.
        "gemm_dispatch_latency": r(latency * 1e6, 6),
        "comment": ("Published microbenchmarks where they exist ('source'), otherwise the H200 measurement scaled by a "
                    "stated rule ('derived'). Written by sim/data/published_tables.py; see sim/data/README.md."),
        "sources": dict({"mamf": MAMF, stream_src: RRZE_A100_40 if gb == 40 else RRZE_A100_80, "fa2-paper": FA2_PAPER},
                        **({"fa1-paper": FA1_PAPER} if gb == 40 else {})),
        "rules": rules,
        "gemm": replace_cited(gemm, cited_gemm),
        "attention": att,
        "attention_kernels": {"fa2": FA2_A100, "fa1": fa1_kernel(FA2_A100)},
        "memory_bound": mem,
        "adamw": adam,
        # Measured on the 40 GB card only; the loader derives every other table's (docs/cost-model.md).
        **({"attention_standard": standard_attention_entries()} if gb == 40 else {}),
    }


def h100_table(h200, latency):
    mem_factor = 3.35 / 4.8
    rules = {
        "h100-same-die": (
            "H200 measured rate at the same shape, unchanged: the H100 SXM5 is the H200's GH100 die at the same "
            "clocks and 700 W (989 TFLOP/s dense bf16 on both datasheets; source 'mamf' notes of its H100 SXM row "
            "'H200 is the same'). Used for GEMMs and causal attention without a published H100 figure."),
        "h100-hbm": (
            "H200 measured rate of the same kernel class and size x 3.35 / 4.8 = 0.697917, the HBM3 / HBM3e peak "
            "bandwidths of the H100 SXM and H200 datasheets (no published H100 SXM stream measurement was found). "
            "Also used for fused AdamW."),
    }
    gemm, att, mem, adam = derive(h200, latency, "h100-same-die", 1.0, "h100-same-die", 1.0, "h100-hbm", mem_factor,
                                  with_fp8=True)
    fa2 = {"fwd_scale": r(FA2_FWD / FA3_FWD, 6), "bwd_scale": r(FA2_BWD / FA3_BWD, 6),
           "source": {"ref": "fa-pr1791", "quote": FA2_QUOTE,
                      "note": "fwd_scale = 284.1 / 630.0, bwd_scale = 287.1 / 531.6: FlashAttention-2 over "
                              "FlashAttention-3, which the table's cuDNN rates match within 4 % at this shape"}}
    squares = {
        "bf16": [176.62, 676.59, 788.72, 797.51, 719.72],
        "tf32": [119.60, 334.99, 402.15, 372.05, 376.66],
        "fp32": [37.39, 49.58, 51.88, 51.81, 49.61],
    }
    label = {"bf16": "BF16", "tf32": "TF32", "fp32": "FP32"}
    cited = []
    for dt, vals in squares.items():
        for size, v in zip([1024, 2048, 4096, 8192, 10240], vals):
            cited.append(gemm_entry(dt, size, size, size, v, source={
                "ref": "zzc-h100", "quote": f"{size}x{size}: {v:.2f} TFLOPS",
                "note": f"in the '{label[dt]}:' block; M = K = N = {size}"}))
    cited.append(gemm_entry("bf16", 2048, 13312, 2048, H100_BF16_MAMF, source={
        "ref": "mamf",
        "quote": "| NVIDIA H100 SXM  |  794.5 |    989 |      80.3% |  2048x2048x13312 | 2.7.0+cu126                    | H200 is the same",
        "note": "MxNxK = 2048 x 2048 x 13312"}))
    cited.append(gemm_entry("fp8", 1024, 14336, 9216, 1402.6, source={
        "ref": "mamf",
        "quote": "| NVIDIA H100 SXM  | 1402.6 |   1979 |      70.9% |  1024x9216x14336 | 2.7.0+cu126",
        "note": "FP8 (float8_e4m3fn) table; MxNxK = 1024 x 9216 x 14336"}))
    return {
        "name": "h100-sxm",
        "device": "NVIDIA H100 SXM5 80GB",
        "cited": True,
        "gemm_dispatch_latency": "estimate",
        "comment": ("Published microbenchmarks where they exist ('source'), otherwise the H200 measurement under a "
                    "stated rule ('derived'). Written by sim/data/published_tables.py; see sim/data/README.md."),
        "sources": {"mamf": MAMF, "zzc-h100": ZZC_H100, "fa-pr1791": FA_PR1791, "fa2-paper": FA2_PAPER},
        "rules": rules,
        "gemm": replace_cited(gemm, cited),
        "attention": att,
        "attention_kernels": {"fa2": fa2, "fa1": fa1_kernel(fa2)},
        "memory_bound": mem,
        "adamw": adam,
    }


def main():
    h200 = load_h200()
    latency = dispatch_latency_s(h200)
    row40 = "2048      221184  100.0 %  |  GB/s:        1539       1500       1382       1358       1371       1368"
    row80 = "1024    221184       2  100.0%     |  GB/s:        1894       1776       1737       1794       1702       1686"
    tables = {
        "kernels-a100-40gb-sxm.json": a100_table(h200, latency, 40, "rrze-stream-a100-40", row40, 1382, 1358,
                                                 (128 * 1024 * 1024 + 2) * 8, "NVIDIA A100-SXM4-40GB"),
        "kernels-a100-80gb-sxm.json": a100_table(h200, latency, 80, "rrze-stream-a100-80", row80, 1737, 1794,
                                                 (256 * 1024 * 1024 + 2) * 8, "NVIDIA A100-SXM4-80GB"),
        "kernels-h100-sxm.json": h100_table(h200, latency),
    }
    check = sys.argv[1:] == ["--check"]
    if sys.argv[1:] and not check:
        sys.exit("usage: published_tables.py [--check]")
    stale = []
    for name, t in tables.items():
        text = json.dumps(t, indent=1, ensure_ascii=False) + "\n"
        path = os.path.join(HERE, name)
        if check:
            with open(path, encoding="utf-8") as f:
                if f.read() != text:
                    stale.append(name)
            continue
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        sections = ("gemm", "attention", "memory_bound", "adamw", "attention_standard")
        n_src = sum(1 for k in sections for e in t.get(k, []) if "source" in e)
        n_der = sum(1 for k in sections for e in t.get(k, []) if "derived" in e)
        print(f"{name}: {n_src} cited, {n_der} derived")
    if stale:
        sys.exit(f"published_tables: {', '.join(stale)} differ from what this script writes; run it to rewrite them")
    if check:
        print(f"published_tables: {len(tables)} tables current")


if __name__ == "__main__":
    main()
