#!/usr/bin/env python3
"""Builds ../steptimes.json and ../models/*.json from clones of the source repositories.

  python3 experiments/fidelity/sources/build_steptimes.py MIRRORS            # rebuild
  python3 experiments/fidelity/sources/build_steptimes.py MIRRORS --verify   # every quote still verbatim

MIRRORS holds one bare or normal git clone per source, at MIRRORS/<owner>+<name>/repo:
mosaicml+llm-foundry, pytorch+torchtitan, bigscience-workshop+bigscience, cli99+llm-analysis,
deepspeedai+DeepSpeed (read for its pipeline engine's point-to-point semantics), NVIDIA+Megatron-LM,
sail-sg+zero-bubble-pipeline-parallelism (its paper.pdf is read with `pdftotext -layout`, from poppler-utils). The
script reads each source file at the clone's HEAD with `git show`, picks table rows by their key
columns, and copies each row's text verbatim into the case's quote; every number in a case is parsed
from that text (or asserted to appear in it), never typed in. The commit read is recorded per case.
Re-running it against newer clones may change the commits (and, if a table changed, fail an assert).
"""
import json, subprocess, sys, os

OUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
args = [a for a in sys.argv[1:] if a != "--verify"]
if len(args) != 1 or not os.path.isdir(args[0]):
    sys.exit("usage: build_steptimes.py MIRRORS [--verify] (MIRRORS: a folder of <owner>+<name>/repo git clones)")
MIR = args[0]


def verify():
    """Every case's (and stage time's) quote must occur verbatim in its file at its commit."""
    with open(f"{OUT}/steptimes.json") as f:
        cases = json.load(f)["cases"]
    with open(f"{OUT}/stagetimes.json") as f:
        cases += json.load(f)["stages"]
    bad = skipped = 0
    for c in cases:
        if "repo" not in c:  # a paper's text, transcribed (its url and quote_context say so): no clone to read
            skipped += 1
            continue
        repo = c["repo"].replace("/", "+")
        text = (pdf_text(repo, c["commit"], c["path"]) if c.get("text_of") == "pdftotext -layout" else
                subprocess.check_output(["git", "-C", f"{MIR}/{repo}/repo", "show", f"{c['commit']}:{c['path']}"], text=True))
        if c["quote"] not in text:
            print(f"build_steptimes: case '{c['id']}': quote not found in {c['repo']}@{c['commit'][:8]}:{c['path']}")
            bad += 1
    print(f"build_steptimes --verify: {len(cases) - skipped - bad} of {len(cases) - skipped} quotes found verbatim "
          f"({skipped} transcribed from papers, not in a repository)")
    sys.exit(1 if bad else 0)




def show(repo, commit, path):
    return subprocess.check_output(["git", "-C", f"{MIR}/{repo}/repo", "show", f"{commit}:{path}"], text=True)


def pdf_text(repo, commit, path):
    """A PDF in a source repository as `pdftotext -layout` prints it (poppler-utils)."""
    pdf = subprocess.check_output(["git", "-C", f"{MIR}/{repo}/repo", "show", f"{commit}:{path}"])
    return subprocess.run(["pdftotext", "-layout", "-", "-"], input=pdf, capture_output=True, check=True).stdout.decode()


def head(repo):
    return subprocess.check_output(["git", "-C", f"{MIR}/{repo}/repo", "rev-parse", "HEAD"], text=True).strip()


if "--verify" in sys.argv[1:]:
    verify()


cases = []
models_written = {}


def write_model(name, spec):
    path = f"{OUT}/models/{name}.json"
    if name not in models_written:
        with open(path, "w") as f:
            json.dump(spec, f, indent=2)
            f.write("\n")
        models_written[name] = spec
    return f"experiments/fidelity/models/{name}.json"


MPT_LOSS_NOTE = " Runtime: PyTorch eager with MPT's default loss, flash-attn's fused cross-entropy (llmfoundry/models/mpt/modeling_mpt.py: loss_fn_config = om_model_config.get('loss_fn', 'fused_crossentropy'), from the first benchmark table's commit c6cfb42 to 8c8dd48; the pretrain yamls set no loss_fn): posed as the eager-fused-loss runtime profile."

# ---------------------------------------------------------------- MosaicML llm-foundry
LF = "mosaicml+llm-foundry"
lf_commit = head(LF)
lf_path = "scripts/train/benchmarking/README.md"
lf = show(LF, lf_commit, lf_path).splitlines()
lf_url = f"https://github.com/mosaicml/llm-foundry/blob/{lf_commit}/{lf_path}"

MPT = {  # from scripts/train/yamls/pretrain/mpt-*.yaml at the same commit (d_model, n_heads, n_layers)
    "125m": (768, 12, 12), "350m": (1024, 16, 24), "760m": (1536, 12, 24), "1b": (2048, 16, 24),
    "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 56, 48), "70b": (8192, 64, 80)}
# Check the shapes against the yamls (verbatim values, not memory).
for size, (d, h, l) in MPT.items():
    y = show(LF, lf_commit, f"scripts/train/yamls/pretrain/mpt-{size}.yaml")
    assert f"d_model: {d}" in y and f"n_heads: {h}" in y and f"n_layers: {l}" in y, size
    assert "expansion_ratio: 4" in y and "vocab_size: 50368" in y and "attn_impl: flash" in y, size


def mpt_model(size, seq, fp32_reduce=False):
    d, h, l = MPT[size]
    name = (f"mpt-{size}" if seq == 2048 else f"mpt-{size}-s{seq}") + ("-fp32-reduce" if fp32_reduce else "")
    return write_model(name, {
        "name": name,
        "description": (f"MosaicML MPT-{size} as benchmarked in llm-foundry scripts/train/benchmarking (commit {lf_commit[:8]}): "
                        f"d_model {d}, n_heads {h}, n_layers {l}, expansion_ratio 4, vocab_size 50368, attn_impl flash "
                        f"(scripts/train/yamls/pretrain/mpt-{size}.yaml). The table's NumParams grows by d_model per extra "
                        f"token of SeqLen and exceeds 12*L*d^2 + V*d by 9d per layer, so: learned positions up to the "
                        f"sequence length ({seq}), biases on every linear, LayerNorm, GELU MLP, tied embeddings."
                        + (" Gradients reduced in fp32 (Composer's FSDP mixed precision DEFAULT: reduce_dtype "
                           "torch.float32): fp32_main_grads." if fp32_reduce else "")),
        "vocab": 50368, "hidden": d, "layers": l, "heads": h, "ffn": 4 * d,
        "activation": "gelu", "norm": "layernorm", "bias": True, "tie_embeddings": True,
        "max_positions": seq, "attention": "flash",
        "training": {"seq_len": seq, "micro_batch_size": 1, "precision": "bf16",
                     **({"fp32_main_grads": True} if fp32_reduce else {})}})


def lf_section(title):
    i = lf.index(title)
    return i


def lf_rows(section):
    """The (line, cells) of each data row of the table under `section`, to the next section."""
    for line in lf[lf_section(section) + 1:]:
        if line.startswith("## "):
            break
        if line.startswith("|  ") and "---" not in line and "Model" not in line:
            yield line, [x.strip() for x in line.strip().strip("|").split("|")]


def lf_row(section, size, seq, gpus, mbs=None):
    rows = [(line, c) for line, c in lf_rows(section)
            if c[0] == size and c[1] == str(seq) and c[2] == str(gpus) and (mbs is None or c[7] == str(mbs))]
    assert len(rows) == 1, (section, size, seq, gpus, rows)
    return rows[0]


LF_CLUSTERS = {
    "## H100 80GB BF16 (Large Scale, >= 128 GPUs)": ("H100-80GB", "dgx-h100",
        "The README names the GPU h100_80gb and gives no node or network figures for the H100 tables; posed on the dgx-h100 preset (8 GPUs/node, 8x400 Gb/s)."),
    "## H100 80GB BF16": ("H100-80GB", "dgx-h100",
        "The README names the GPU h100_80gb and gives no node or network figures for the H100 tables; posed on the dgx-h100 preset (8 GPUs/node, 8x400 Gb/s)."),
    "## A100 80GB with 1600 Gbps node-node interconnect (RoCE)": ("A100-80GB", "dgx-a100-80g",
        "1600 Gbps node-node interconnect = the dgx-a100-80g preset's 8 NICs x 200 Gb/s."),
    "## A100 40GB with 1600 Gbps node-node interconnect (RoCE)": ("A100-40GB", "experiments/fidelity/clusters/dgx-a100-40g.json",
        "A100-SXM4-40GB (1.555 TB/s HBM2) nodes with the dgx-a100-80g preset's 8 x 200 Gb/s = 1600 Gbps."),
}
LF_PICK = [
    # section, size, seq, gpus, mbs (to disambiguate)
    ("## A100 40GB with 1600 Gbps node-node interconnect (RoCE)", "125m", 2048, 8, None),
    ("## A100 40GB with 1600 Gbps node-node interconnect (RoCE)", "350m", 2048, 8, None),
    ("## A100 40GB with 1600 Gbps node-node interconnect (RoCE)", "760m", 2048, 8, None),
    ("## A100 40GB with 1600 Gbps node-node interconnect (RoCE)", "1b", 2048, 8, None),
    ("## A100 40GB with 1600 Gbps node-node interconnect (RoCE)", "3b", 2048, 8, None),
    ("## A100 40GB with 1600 Gbps node-node interconnect (RoCE)", "7b", 2048, 8, None),
    ("## A100 40GB with 1600 Gbps node-node interconnect (RoCE)", "13b", 2048, 8, None),
    ("## A100 40GB with 1600 Gbps node-node interconnect (RoCE)", "7b", 2048, 64, None),
    ("## A100 40GB with 1600 Gbps node-node interconnect (RoCE)", "30b", 2048, 32, None),
    ("## A100 40GB with 1600 Gbps node-node interconnect (RoCE)", "1b", 8192, 8, None),
    ("## A100 80GB with 1600 Gbps node-node interconnect (RoCE)", "125m", 2048, 8, 32),
    ("## A100 80GB with 1600 Gbps node-node interconnect (RoCE)", "1b", 2048, 8, None),
    ("## A100 80GB with 1600 Gbps node-node interconnect (RoCE)", "7b", 2048, 8, None),
    ("## A100 80GB with 1600 Gbps node-node interconnect (RoCE)", "30b", 2048, 8, None),
    ("## A100 80GB with 1600 Gbps node-node interconnect (RoCE)", "70b", 2048, 64, None),
    ("## A100 80GB with 1600 Gbps node-node interconnect (RoCE)", "7b", 32768, 8, None),
    ("## H100 80GB BF16", "760m", 2048, 8, None),
    ("## H100 80GB BF16", "1b", 2048, 8, None),
    ("## H100 80GB BF16", "7b", 2048, 8, None),
    ("## H100 80GB BF16", "13b", 2048, 8, None),
    ("## H100 80GB BF16", "30b", 2048, 8, None),
    ("## H100 80GB BF16", "7b", 8192, 8, None),
    ("## H100 80GB BF16 (Large Scale, >= 128 GPUs)", "13b", 2048, 128, None),
    ("## H100 80GB BF16 (Large Scale, >= 128 GPUs)", "1b", 2048, 128, None),
    ("## H100 80GB BF16 (Large Scale, >= 128 GPUs)", "3b", 2048, 128, None),
    ("## H100 80GB BF16 (Large Scale, >= 128 GPUs)", "3b", 2048, 512, None),
]


def lf_long_rows():
    """Every row of the bf16 tables with a sequence of 32K tokens or more (the held-out set's worst class at
    issue #23's filing, 'long sequences with flash attention (32k)'): picked by that rule, not one by one."""
    return [(section, c[0], int(c[1]), int(c[2]), None)
            for section in sorted(LF_CLUSTERS, key=lf_section) for _, c in lf_rows(section) if int(c[1]) >= 32768]


LF_PICK += [row for row in lf_long_rows() if row[:4] not in {p[:4] for p in LF_PICK}]


def lf_flash_attn(section):
    """The flash-attn version the benchmark harness installed when the section's table was added: the commit
    that introduced the section title, its submit_benchmarks.py's pip_install extra, and setup.py's pin of
    flash-attn in that extra (all read from the source at that commit)."""
    first = subprocess.check_output(["git", "-C", f"{MIR}/{LF}/repo", "log", "--reverse", "--format=%H", "-S", section,
                                     lf_commit, "--", lf_path], text=True).split()[0]
    harness = show(LF, first, "scripts/train/benchmarking/submit_benchmarks.py")
    extras = sorted({line.split("[")[1].split("]")[0] for line in harness.splitlines()
                     if "'pip_install'" in line and "[" in line})
    assert len(extras) == 1, (section, extras)
    setup = show(LF, first, "setup.py").splitlines()
    i = next(k for k, line in enumerate(setup) if line.startswith(f"extra_deps['{extras[0]}'] = ["))
    pin = next(line.strip().strip("',") for line in setup[i:] if "'flash-attn==" in line)
    return first, extras[0], pin


# Composer's FSDP mixed precision 'DEFAULT' (the tables' "MP mode"): from v0.16.4 on it sets reduce_dtype
# torch.float32, before that it leaves it unset (FSDP then reduces in param_dtype, bf16). Read at the lowest
# Composer the section's harness allowed (llm-foundry's setup.py at the commit that added the table).
CP = "mosaicml+composer"


def lf_default_reduces_in_fp32(first):
    setup = show(LF, first, "setup.py")
    lows = {l.split(">=")[1].split(",")[0] for l in setup.splitlines()
            if ("'mosaicml[" in l or "'composer[" in l) and ">=" in l}  # the install_requires and extras pins
    assert lows, first
    low = max(lows, key=lambda v: tuple(int(x) for x in v.split(".")))  # pip satisfies every pin
    src = subprocess.check_output(["git", "-C", f"{MIR}/{CP}/repo", "grep", "-h", "-A3",
                                   "elif mixed_precision == 'DEFAULT':", f"v{low}", "--", "composer"], text=True)
    return "reduce_dtype = torch.float32" in src, low


for section, size, seq, gpus, mbs in LF_PICK:
    line, c = lf_row(section, size, seq, gpus, mbs)
    (model, seqlen, ngpu, gpu, mfu, hfu, mtflop, mbsz, ga, gbs, sps, tps, tpsg, gbs_t, prec, mp, shard, ac, off, nparams) = c
    assert int(gbs) == int(mbsz) * int(ga) * int(ngpu)
    assert int(gbs_t) == int(gbs) * int(seqlen)
    step = int(gbs_t) / int(tps)
    gpu_label, cluster, cluster_note = LF_CLUSTERS[section]
    zero = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2}[shard]
    fam = {3: "fsdp/zero3", 2: "zero2"}[zero]
    sect_name = section[3:]
    gi = "a40" if "A100 40GB" in section else ("a80" if "A100 80GB" in section else ("h100l" if "Large" in section else "h100"))
    notes = [cluster_note,
             f"Composer FSDP {shard} ({'ZeRO-3' if zero == 3 else 'ZeRO-2'}); GradAccum {ga} posed as {ga} microbatches of {mbsz} sequences.",
             f"Precision {prec}, MP mode {mp}: " + ("pure bf16 parameters (Piper's bf16 costing with its default fp32 optimizer state)" if mp == "PURE" else "autocast bf16 over fp32 parameters, posed as bf16") + ".",
             "Activation checkpointing True posed as --recompute full." if ac == "True" else "No activation checkpointing.",
             "The step time divides GlobalBatchSize (T) by Throughput (T/s); the README rounds T/s to an integer, so the conversion is exact to < 0.01 %.",
             "Runtime: PyTorch eager under Composer (no torch.compile) with FlashAttention.",
             "Composer's FSDP is PyTorch's FSDP1: its FlatParameter all-gathers straight into the unsharded flat "
             "parameter whose views the layers read, and reduce-scatters the flat gradient (its cast to the "
             "reduction dtype runs on the post-backward stream), so it has no compute-stream copies around its "
             "collectives: --collective-copies stays at its default (docs/cost-model.md, 'Copies around the ZeRO-3 "
             "collectives')."]
    # Every MosaicML table: the flash-attn its harness installed.
    first, extra, pin = lf_flash_attn(section)
    fp32_reduce, composer_low = lf_default_reduces_in_fp32(first) if mp == "DEFAULT" else (False, None)
    if mp == "DEFAULT":
        notes[2] = (f"Precision {prec}, MP mode DEFAULT: autocast bf16 over fp32 parameters, posed as bf16; Composer "
                    f"{composer_low} (the lowest the harness allowed at {first[:9]}) "
                    + ("sets reduce_dtype torch.float32 for DEFAULT, so the gradients are reduce-scattered in fp32: "
                       "the model's fp32_main_grads (ZeRO-2/3 reducing every microbatch keeps no whole fp32 gradient; "
                       "docs/cost-model.md, 'Gradient accumulation')."
                       if fp32_reduce else "leaves reduce_dtype unset for DEFAULT, so FSDP reduces in param_dtype, bf16."))
    major = pin.split("==")[1].lstrip("v").split(".")[0]
    attention_kernel = "fa2" if major == "2" else "fa1"
    notes.append(f"Attention: the table was added at {first[:9]}, whose benchmark harness installs llm-foundry with "
                 f"'.[{extra}]' (scripts/train/benchmarking/submit_benchmarks.py), which setup.py pins to '{pin}': "
                 + ("FlashAttention-2, " + ("not a Hopper kernel: " if gpu_label.startswith("H100") else "")
                    + "attention_kernel \"fa2\" (docs/cost-model.md)." if major == "2" else
                    "FlashAttention 1: attention_kernel \"fa1\", 0.5788 of FlashAttention-2's rates (the FlashAttention-2 "
                    "paper's Figure 4(c); docs/cost-model.md)."))
    if seq != 2048:
        notes.append(f"Sequence length {seq}: the model file has learned positions up to {seq}, as NumParams shows.")
    cases.append({
        "id": f"mosaic-{gi}-mpt{size}-s{seq}-g{gpus}",
        "source": "MosaicML llm-foundry, MPT training benchmarks",
        "url": lf_url,
        "repo": "mosaicml/llm-foundry", "commit": lf_commit, "path": lf_path,
        "quote": line,
        "quote_context": f"{section} / " + next(l for l in lf[lf_section(section) + 1:] if l.startswith("|  Model")).strip(),
        "model": mpt_model(size, seq, fp32_reduce),
        "gpu": gpu_label,
        "cluster": cluster,
        "gpus": int(ngpu),
        "flags": ["--pp", "1", "--dp", ngpu, "--zero", str(zero), "--microbatches", ga, "--micro-batch-size", mbsz,
                  "--seq-len", seqlen, "--recompute", "full" if ac == "True" else "none"],
        "family": fam,
        "runtime": "eager-fused-loss",
        "measured": {"value": int(tps), "unit": "tokens/s (all GPUs)"},
        "measured_step_s": step,
        "conversion": f"GlobalBatchSize (T) {gbs_t} tokens / Throughput {tps} tokens/s = {step:.4f} s",
        "notes": " ".join(notes) + MPT_LOSS_NOTE,
        **({"attention_kernel": attention_kernel} if attention_kernel else {})})

# ---------------------------------------------------------------- TorchTitan
TT = "pytorch+torchtitan"
tt_commit = head(TT)
tt1_path = "benchmarks/llama3_h100_202412_torchtitan.md"
tt1 = show(TT, tt_commit, tt1_path).splitlines()
tt2_path = "benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
tt2 = show(TT, tt_commit, tt2_path).splitlines()
cfg_commit = "9dec370ad26b5f8e9a7333a0e36165018262644b"  # torchtitan commit the 2024-12 benchmark names
cfg8 = show(TT, cfg_commit, "train_configs/llama3_8b.toml")
cfg70 = show(TT, cfg_commit, "train_configs/llama3_70b.toml")
assert "seq_len = 8192" in cfg8 and "seq_len = 8192" in cfg70
# What both TorchTitan benchmarks ran, read from the code at the commits they name: FSDP2 reduces gradients
# in fp32 (the only choice), and attention is PyTorch's SDPA with the flash (FlashAttention-2) backend first
# on an H100 (cuDNN only on B200 at 820504e; at 9dec370 the default order, cuDNN being opt-in since
# pytorch/pytorch#138522).
tt2_commit = "820504e20d1149fbf0b98c567af24c4b0433b22d"  # torchtitan commit the 2025-06 benchmark names
cm1 = show(TT, cfg_commit, "torchtitan/config_manager.py")
assert '"--training.mixed_precision_reduce",' in cm1 and 'default="float32",\n            choices=["float32"],' in cm1
assert 'mixed_precision_reduce: Literal["float32"] = "float32"' in show(TT, tt2_commit, "torchtitan/config_manager.py")
# The memory TorchTitan logs ("memory: ...GiB") is the caching allocator's reserved peak.
assert 'f"{color.yellow}memory: {device_mem_stats.max_reserved_gib:5.2f}GiB"' in show(TT, cfg_commit, "train.py")
assert 'max_reserved = device_info["reserved_bytes.all.peak"]' in show(TT, cfg_commit, "torchtitan/metrics.py")
assert "F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)" in show(TT, cfg_commit, "torchtitan/models/llama/model.py")
att2 = show(TT, tt2_commit, "torchtitan/models/attention.py")
assert "SDPBackend.FLASH_ATTENTION,\n            SDPBackend.EFFICIENT_ATTENTION," in att2 and "if has_cuda_capability(10, 0):" in att2
# FSDP2 (fully_shard) at both commits, with bf16 parameters (mixed_precision_param's default): its copies
# around the all-gathers and reduce-scatters run on the compute stream (docs/cost-model.md "Copies around
# the ZeRO-3 collectives", read in PyTorch's _fsdp_collectives.py): --collective-copies fsdp2.
pl1 = show(TT, cfg_commit, "torchtitan/parallelisms/parallelize_llama.py")
assert "from torch.distributed._composable.fsdp import (" in pl1 and "    fully_shard,\n    MixedPrecisionPolicy,\n)" in pl1
assert "mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)" in pl1
assert ('"--training.mixed_precision_param",\n            type=str,\n            default="bfloat16",' in cm1)
pl2 = show(TT, tt2_commit, "torchtitan/models/llama3/parallelize_llama.py")
assert "from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard, MixedPrecisionPolicy" in pl2
assert 'mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"' in show(TT, tt2_commit, "torchtitan/config_manager.py")
TT_NOTE_RUNTIME = (" FSDP2 reduces gradients in fp32 (training.mixed_precision_reduce = \"float32\", its only choice, at "
                   f"{cfg_commit[:7]} and {tt2_commit[:7]}): the model file sets fp32_main_grads. Attention is SDPA's "
                   "flash backend (FlashAttention-2): the cluster's attention_kernel \"fa2\". FSDP2 is fully_shard "
                   "(torchtitan/parallelisms/parallelize_llama.py at "
                   f"{cfg_commit[:7]}, torchtitan/models/llama3/parallelize_llama.py at {tt2_commit[:7]}) with bf16 "
                   "parameters (training.mixed_precision_param's default): on the compute stream it copies each gathered "
                   "flat buffer out into the parameters (split_with_sizes_copy) and each block's bf16 gradients into the "
                   "fp32 reduce-scatter input (_chunk_cat), per PyTorch's _fsdp_collectives.py: --collective-copies fsdp2 "
                   "(docs/cost-model.md, 'Copies around the ZeRO-3 collectives'; TorchTitan keeps the last block gathered "
                   "from forward to backward, which Piper re-gathers like the others).")


def titan_model(size, hidden, layers, heads, ffn):
    """The zoo's llama3-<size> shape with fp32 gradient reduction (FSDP2 mixed_precision_reduce)."""
    return write_model(f"llama3.1-{size}-torchtitan", {
        "name": f"llama3.1-{size}-torchtitan",
        "description": (f"Llama 3.1 {size.upper()} as TorchTitan trains it (the zoo's llama3-{size} shape) with FSDP2's fp32 "
                        "gradient reduction (training.mixed_precision_reduce = \"float32\"), posed as fp32 gradient buffers "
                        "and reductions."),
        "vocab": 128256, "hidden": hidden, "layers": layers, "heads": heads, "kv_heads": 8, "head_dim": 128, "ffn": ffn,
        "activation": "swiglu", "norm": "rmsnorm", "tie_embeddings": False,
        "training": {"seq_len": 8192, "micro_batch_size": 1, "precision": "bf16", "fp32_main_grads": True}})


TITAN_MODEL = {"llama3-8b": titan_model("8b", 4096, 32, 32, 14336), "llama3-70b": titan_model("70b", 8192, 80, 64, 28672)}


def find(lines, prefix):
    hits = [l for l in lines if l.startswith(prefix)]
    assert len(hits) == 1, (prefix, hits)
    return hits[0]


def after(lines, caption, prefix):
    i = next(k for k, l in enumerate(lines) if l.startswith(caption))
    for l in lines[i:]:
        if l.startswith(prefix):
            return l
    raise KeyError(prefix)


tt_hw = "Each H100 GPU is equipped with 96GB HBM2e with 2.4 TB/sec peak memory bandwidth."
assert any(tt_hw in l for l in tt1)
TT_NOTE_HW = ("Grand Teton H100s with 96GB HBM2e at 2.4 TB/s and a 500 W power limit, 400 Gb/s per GPU "
              "(experiments/fidelity/clusters/grand-teton-h100.json); the source says their peak lies between the SXM and NVL "
              "figures and is not known: the cluster's kernel table (clusters/h100-96gb-500w-kernels.json) scales the H100 SXM "
              "table's GEMM and attention rates to the straight line between the two datasheets at 500 W (0.896) and its "
              "memory-bound rates to 2.4 TB/s (0.716).")
# TorchTitan's eager runs: the Llama RMSNorm in torch ops (norm_type "rmsnorm", not the Triton "fused_rmsnorm").
norms = show(TT, cfg_commit, "torchtitan/models/norms.py")
assert 'norm_type = "rmsnorm"' in cfg8
assert "return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)" in norms
assert "output = self._norm(x.float()).type_as(x)" in norms and "return output * self.weight" in norms
TT_NOTE_EAGER = (" Eager: train_configs/llama3_8b.toml sets norm_type = \"rmsnorm\", torchtitan/models/norms.py's RMSNorm "
                 "in torch ops (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) over x.float(), .type_as(x), "
                 "* self.weight), which eager runs op by op: the eager-unfused-norm runtime profile.")
for table, tech, gpus, lbs, runtime in [
        ("**Table 1**", "| FSDP |", 8, 2, "eager-unfused-norm"),
        ("**Table 1**", "| FSDP + torch.compile |", 8, 2, "torch.compile"),
        ("**Table 3**", "| FSDP |", 128, 2, "eager-unfused-norm"),
        ("**Table 3**", "| FSDP + torch.compile |", 128, 2, "torch.compile")]:
    caption = find(tt1, table)
    row = after(tt1, table, tech)
    tps = int(row.split("|")[2].strip().replace(",", ""))
    mem = float(row.split("|")[3].strip())
    step = lbs * 8192 / tps
    cases.append({
        "id": f"titan-llama3-8b-fsdp{gpus}-{'compile' if runtime == 'torch.compile' else 'eager'}",
        "source": "TorchTitan performance benchmarks (PyTorch team, 2024-12)",
        "url": f"https://github.com/pytorch/torchtitan/blob/{tt_commit}/{tt1_path}",
        "repo": "pytorch/torchtitan", "commit": tt_commit, "path": tt1_path,
        "quote": row, "quote_context": caption,
        "model": TITAN_MODEL["llama3-8b"], "gpu": "H100-96GB-500W", "cluster": "experiments/fidelity/clusters/grand-teton-h100.json",
        "gpus": gpus,
        "flags": ["--pp", "1", "--dp", str(gpus), "--zero", "3", "--microbatches", "1", "--micro-batch-size", str(lbs),
                  "--seq-len", "8192", "--recompute", "op", "--collective-copies", "fsdp2"],
        "family": "fsdp/zero3", "runtime": runtime,
        "measured": {"value": tps, "unit": "tokens/s per GPU"},
        "measured_step_s": step,
        "measured_peak_gib": mem,
        "measured_peak_kind": "reserved",
        "conversion": f"local batch {lbs} x seq 8192 = {lbs * 8192} tokens per GPU per step / {tps} TPS/GPU = {step:.4f} s",
        "notes": (TT_NOTE_HW + " Sequence length 8192 from train_configs/llama3_8b.toml at the benchmark's torchtitan commit "
                  f"{cfg_commit[:7]} (seq_len = 8192). FSDP2 = ZeRO-3, no gradient accumulation (one microbatch of the local "
                  "batch). TorchTitan's selective activation checkpointing (per-op policy) is posed as Piper's --recompute "
                  "op, that policy (every other matmul's output and attention's kept). bf16 (no Float8 row is used). Memory(GiB) is the source's peak, the maximum over GPUs, as TorchTitan logs it: the caching allocator's reserved peak (train.py prints max_reserved_gib; metrics.py reads reserved_bytes.all.peak), not the allocated peak Piper predicts." + TT_NOTE_RUNTIME
                  + (TT_NOTE_EAGER if runtime != "torch.compile" else ""))})

for caption_prefix, quant_row, name, gpus, tp, lbs, ac, model in [
        ("#### Llama3 70b on 256 H100s", "| None (bfloat16)", "llama3-70b-fsdp32-tp8", 256, 8, 16, "full", "llama3-70b"),
        ("#### Llama3 8b on 64 H100s", "| None (bfloat16)", "llama3-8b-fsdp8-tp8", 64, 8, 12, "op", "llama3-8b")]:
    caption = find(tt2, caption_prefix)
    row = after(tt2, caption_prefix, quant_row)
    tps = float(row.split("|")[2].strip())
    dp = gpus // tp
    tokens_per_gpu = lbs * dp * 8192 / gpus
    step = tokens_per_gpu / tps
    cases.append({
        "id": f"titan-{name}-vanillatp",
        "source": "TorchTitan async-TP benchmarks (PyTorch team, 2025-06)",
        "url": f"https://github.com/pytorch/torchtitan/blob/{tt_commit}/{tt2_path}",
        "repo": "pytorch/torchtitan", "commit": tt_commit, "path": tt2_path,
        "quote": row, "quote_context": caption,
        "model": TITAN_MODEL[model], "gpu": "H100-96GB-500W", "cluster": "experiments/fidelity/clusters/grand-teton-h100.json",
        "gpus": gpus,
        "flags": ["--pp", "1", "--tp", str(tp), "--sequence-parallel", "--dp", str(dp), "--zero", "3", "--microbatches", "1",
                  "--micro-batch-size", str(lbs), "--seq-len", "8192", "--recompute", ac, "--collective-copies", "fsdp2"],
        "family": "fsdp+tp", "runtime": "torch.compile",
        "measured": {"value": tps, "unit": "tokens/s per GPU (vanilla TP column)"},
        "measured_step_s": step,
        "conversion": (f"local batch {lbs} per FSDP rank x {dp} FSDP ranks x seq 8192 / {gpus} GPUs = {tokens_per_gpu:.0f} tokens per GPU "
                       f"per step / {tps} tokens/s = {step:.4f} s"),
        "notes": (TT_NOTE_HW + " The column reads 'tokens/sec'; TorchTitan logs tokens/s per GPU (its other tables say TPS/GPU, "
                  "and the float8 70B row here, 809.8, matches Table 4's 829 TPS/GPU of the 2024-12 file), so it is read per GPU. "
                  "Sequence length 8192 from the llama3 train configs. Vanilla TP (no async TP) bf16 column. TorchTitan's TP plan shards the norms over the "
                  "sequence (SequenceParallel() on attention_norm, ffn_norm and norm in torchtitan/models/llama3/parallelize_llama.py "
                  "at the benchmark's commit 820504e), i.e. Megatron-style sequence parallelism: posed with --sequence-parallel. " + ("Full AC = --recompute full." if ac == "full" else "Per-op SAC posed as --recompute op.") + TT_NOTE_RUNTIME)})

# ---------------------------------------------------------------- DeepSpeed's pipeline engine (BLOOM, MT-NLG)
# Its point-to-point transfers are synchronous: p2p.send refuses async_op and calls dist.send, which the
# compute stream waits on; posed with --p2p-blocking (the place directives' "blocking", docs/compiler.md).
DS = "deepspeedai+DeepSpeed"
ds_commit = head(DS)
ds_p2p = show(DS, ds_commit, "deepspeed/runtime/pipe/p2p.py")
assert 'def send(tensor, dest_stage, async_op=False):' in ds_p2p
assert 'assert async_op == False, "Doesn\'t support async_op true"' in ds_p2p and "return dist.send(tensor, dest_rank)" in ds_p2p
# DeepSpeed's BF16_Optimizer (fp32 gradient accumulation) reached the pipeline engine on 2022-04-19 ("bf16+pipeline
# parallelism"); the BLOOM topology rows below are from February 2022 and ran without it (asserted in the BLOOM section).
ds_bf16_commit = "56c522386878df2513ccb548de76b50191ae3af7"
ds_bf16 = show(DS, ds_bf16_commit, "deepspeed/runtime/bf16_optimizer.py")
ds_pipe = show(DS, ds_bf16_commit, "deepspeed/runtime/pipe/engine.py")
assert "self.optimizer.clear_lp_grads()" in ds_pipe and "self.optimizer.update_hp_grads(clear_lp_grads=False)" in ds_pipe
DS_P2P_NOTE = (" DeepSpeed's pipeline engine sends and receives synchronously (deepspeed/runtime/pipe/p2p.py at "
               f"{ds_commit[:7]}: send(tensor, dest_stage, async_op=False) asserts \"Doesn't support async_op true\" and "
               "calls dist.send): --p2p-blocking.")

# ---------------------------------------------------------------- BigScience BLOOM (tr11) 3D-topology benchmarks
BS = "bigscience-workshop+bigscience"
bs_commit = head(BS)
bs_path = "train/tr11-176B-ml/chronicles-prequel.md"
bs = show(BS, bs_commit, bs_path).splitlines()
bs_readme = show(BS, bs_commit, "train/tr11-176B-ml/README.md")
assert "- Vocabulary size is 250,680 tokens" in bs_readme and "`250880*14336`" in bs_readme
assert "- 8 GPUs per node Using NVLink 4 inter-gpu connects, 4 OmniPath links" in bs_readme
assert "all NHEADS=64 (above too)" in bs
# The training inherits Megatron's dropout defaults (the README says so; the slurm scripts set neither).
assert "The default Megatron-LM dropout settings are inherited:" in bs_readme
assert "--attention-dropout 0.1" in bs_readme and "--hidden-dropout default=0.1" in bs_readme
# The rows used here (02-21, 02-23) precede both the BF16 optimizer and the embedding-aware pipeline partition,
# which the "Rebalancing layers" section (02-28, after these tables) introduces: until then the runs were fp16,
# gradients accumulating in fp16 (PyTorch autograd's in-place add: the model's default accumulation), and the
# pipeline partitioned transformer layers only ('type:transformer', Megatron-DeepSpeed's GPTModelPipe default),
# so the first stage also holds the embedding and the last the tied head: posed with --pp-ranges.
BS_FP16 = ("- First, from now on the testing is happening with BF16 optimizer that was just written to accumulate "
           "gradients in fp32, so it is more memory heavy and is a bit slower - this is compared to fp16 which grad "
           "accumulates in fp16.")
BS_PARTITION = "- I implemented and enabled `--pp-partition-method 'type:transformer|embedding'` so we use 2 layers less"
BS_REBALANCING = bs.index("## Rebalancing layers")
assert [l.startswith(BS_FP16) for l in bs].index(True) > BS_REBALANCING
assert [l.startswith(BS_PARTITION) for l in bs].index(True) > BS_REBALANCING


def bs_model(hidden, layers):
    name = f"bloom-prequel-h{hidden}-l{layers}"
    return write_model(name, {
        "name": name,
        "description": (f"A BLOOM-176B topology-search variant from bigscience tr11 chronicles-prequel.md (commit {bs_commit[:8]}): "
                        f"NHIDDEN={hidden} / NLAYERS={layers}, NHEADS=64 ('all NHEADS=64 (above too)'), seq 2048, vocabulary "
                        "250880 (the padded size of the README's `250880*14336` embedding), tied embeddings, LayerNorm, GELU, "
                        "biases, Megatron fused-softmax attention (no flash), fp16 with gradients accumulated in fp16 by autograd "
                        "(the rows predate the BF16 optimizer: 'this is compared to fp16 which grad accumulates in fp16', "
                        "chronicles-prequel.md, Rebalancing layers); attention and hidden "
                        "dropout 0.1 (README: 'The default Megatron-LM dropout settings are inherited'). BLOOM uses ALiBi, which "
                        "Piper does not model: posed as "
                        "rotary positions (max_positions 0; no parameters either way). BLOOM's embedding LayerNorm is omitted."),
        "vocab": 250880, "hidden": hidden, "layers": layers, "heads": 64, "ffn": 4 * hidden,
        "activation": "gelu", "norm": "layernorm", "bias": True, "tie_embeddings": True, "max_positions": 0,
        "attention": "standard", "dropout": 0.1,
        "training": {"seq_len": 2048, "micro_batch_size": 1, "precision": "fp16"}})


def bs_rows(table_marker, occurrence=0):
    idx = [k for k, l in enumerate(bs) if l.strip() == table_marker]
    i = idx[occurrence]
    assert i < BS_REBALANCING  # fp16, transformer-only partition (above)
    out, header = [], None
    for l in bs[i + 1:]:
        if l.startswith("NHIDDEN=") or l.startswith("#"):
            break
        if l.startswith("| Nodes"):
            header = l
            continue
        if l.startswith("|") and not l.startswith("| ---") and not l.startswith("| ----"):
            c = [x.strip() for x in l.strip().strip("|").split("|")]
            if c[0] and not set(c[0]) <= set("-:"):
                out.append((l, c, header))
    return out


def pick_bs(marker, occurrence, hidden, layers, label, want):
    rows = bs_rows(marker, occurrence)
    for line, c, header in rows:
        nodes, size, dp, tp, pp, mbs, gbs, mem, secit, tflops, date = c
        key = (int(dp), int(pp), int(mbs))
        if key not in want:
            continue
        gpus = int(nodes) * 8
        assert gpus == int(dp) * int(tp) * int(pp)
        m = int(gbs) // (int(dp) * int(mbs))
        cases.append({
            "id": f"bloom-{label}-pp{pp}-dp{dp}-mbs{mbs}",
            "source": "BigScience BLOOM-176B (tr11) pre-training topology benchmarks, Megatron-DeepSpeed",
            "url": f"https://github.com/bigscience-workshop/bigscience/blob/{bs_commit}/{bs_path}",
            "repo": "bigscience-workshop/bigscience", "commit": bs_commit, "path": bs_path,
            "quote": line, "quote_context": f"{marker} / {header}",
            "model": bs_model(hidden, layers), "gpu": "A100-80GB", "cluster": "experiments/fidelity/clusters/jean-zay-a100.json",
            "gpus": gpus,
            "flags": ["--tp", tp, "--pp", pp, "--dp", dp, "--zero", "1", "--schedule", "1f1b", "--microbatches", str(m),
                      "--micro-batch-size", mbs, "--seq-len", "2048", "--recompute", "full", "--p2p-blocking",
                      "--pp-ranges", ",".join(str(layers // int(pp) * r) for r in range(int(pp)))],
            "family": "tp+pp+dp",
            "runtime": "megatron",
            "measured": {"value": float(secit), "unit": "s/iteration (iteration 2)"},
            "measured_step_s": float(secit),
            "conversion": f"Sec/it {secit} s is the step time; GBS {gbs} / (DP {dp} x MBS {mbs}) = {m} microbatches per pipeline",
            "notes": ("Jean Zay A100 80GB nodes, '8 GPUs per node Using NVLink 4 inter-gpu connects, 4 OmniPath links' (README): "
                      "posed as the dgx-a100-80g preset with 4 NICs of 100 Gb/s per node (experiments/bandwidth/README.md: OPA "
                      "'is supposed to be 400Gbps max'). Megatron-DeepSpeed in fp16 with DeepSpeed's ZeRO-1 = --zero 1; the row "
                      "predates the BF16 optimizer (fp32 gradient accumulation), which the source's 'Rebalancing layers' section "
                      "introduces after these tables ('this is compared to fp16 which grad accumulates in fp16'), so the "
                      "gradients accumulate in fp16 by autograd (the model's default accumulation); activation checkpointing "
                      "(README: 'Since we use activation check-pointing') = --recompute full; DeepSpeed's pipeline schedule posed "
                      "as 1F1B; the same section introduces the embedding-aware partition ('I implemented and enabled "
                      "`--pp-partition-method 'type:transformer|embedding'`'), so these rows partitioned transformer layers "
                      f"only, {layers // int(pp)} a stage with the embedding on the first and the tied head on the last: "
                      "--pp-ranges. Measured at iteration 2 (the source warns the snapshot 'can fluctuate a bit'). The table's "
                      "model size column is the source's." + DS_P2P_NOTE)})


pick_bs("NHIDDEN=14336 / NLAYERS=72", 0, 14336, 72, "h14336-l72", {(4, 12, 1), (4, 12, 2), (4, 12, 4), (4, 12, 8), (8, 6, 1), (8, 6, 2), (8, 6, 4)})
pick_bs("NHIDDEN=12288 / NLAYERS=96", 0, 12288, 96, "h12288-l96", {(8, 6, 2), (8, 6, 4)})
pick_bs("NHIDDEN=13312 / NLAYERS=84", 0, 13312, 84, "h13312-l84", {(4, 12, 4), (8, 6, 2), (8, 6, 4)})

# Left out: the one-node TP-8 rows under "NHIDDEN=14336 / NLAYERS=6 / GBS=512". Their GBS column says 2048
# while the heading says GBS=512, and the TFLOPs column (142.59 at 205.52 s for 10 layers) fits 512
# sequences, not 2048; the two 6-layer rows pose the same setting and differ by 9 %. Too ambiguous to pose.

# ---------------------------------------------------------------- MT-NLG 530B (paper section 2.4, quoted by llm-analysis)
LA = "cli99+llm-analysis"
la_commit = head(LA)
la_path = "examples/megatron-turing-nlg/README.md"
la = show(LA, la_commit, la_path)
quote = next(l for l in la.splitlines() if l.startswith("As reported in `Section 2.4`"))
cfg = next(l for l in la.split("```")[1:2])
assert '"num_layers": 105' in cfg and '"n_head": 128' in cfg and '"hidden_dim": 20480' in cfg and '"vocab_size": 50272' in cfg and '"ffn_embed_dim": 81920' in cfg
script = show(LA, la_commit, "examples/megatron-turing-nlg/run_train.sh")
assert "--tp_size 8 --pp_size 35" in script and "--activation_recomputation 2" in script
mt_model = write_model("mt-nlg-530b", {
    "name": "mt-nlg-530b",
    "description": ("Megatron-Turing NLG 530B (Smith et al. 2022, arXiv:2201.11990), configuration as in cli99/llm-analysis "
                    "examples/megatron-turing-nlg/README.md: 105 layers, 128 heads, hidden 20480, ffn 81920, vocab 50272, max_seq_len 2048. "
                    "GPT-3-style: learned positions, LayerNorm, GELU, biases, tied embeddings, Megatron fused-softmax attention "
                    "(no flash), bf16 with Megatron-LM's fp32 main grads; dropout not modelled."),
    "vocab": 50272, "hidden": 20480, "layers": 105, "heads": 128, "ffn": 81920,
    "activation": "gelu", "norm": "layernorm", "bias": True, "tie_embeddings": True, "max_positions": 2048,
    "attention": "standard",
    "training": {"seq_len": 2048, "micro_batch_size": 1, "precision": "bf16", "fp32_main_grads": True}})
for servers, secit, tfl in [("280", "60.1", "126"), ("350", "50.2", "121"), ("420", "44.4", "113")]:
    assert f"`{servers}`" in quote and f"`{secit}`" in quote and f"`{tfl}`" in quote
    gpus = int(servers) * 8
    dp = gpus // (8 * 35)
    m = 1920 // dp
    cases.append({
        "id": f"mtnlg-530b-{gpus}gpus",
        "source": "Smith et al. 2022, Megatron-Turing NLG 530B (arXiv:2201.11990) section 2.4, as quoted by cli99/llm-analysis",
        "url": f"https://github.com/cli99/llm-analysis/blob/{la_commit}/{la_path}",
        "repo": "cli99/llm-analysis", "commit": la_commit, "path": la_path,
        "quote": quote, "quote_context": "Example Analyses with Megatron-Turing NLG 530B",
        "model": mt_model, "gpu": "A100-80GB", "cluster": "dgx-a100-80g",
        "gpus": gpus,
        "flags": ["--tp", "8", "--pp", "35", "--dp", str(dp), "--zero", "1", "--schedule", "1f1b", "--microbatches", str(m),
                  "--micro-batch-size", "1", "--seq-len", "2048", "--recompute", "full", "--p2p-blocking"],
        "family": "tp+pp+dp", "runtime": "megatron",
        "measured": {"value": float(secit), "unit": "s/iteration"},
        "measured_step_s": float(secit),
        "conversion": f"latency per iteration {secit} s is the step time; {gpus} GPUs / (TP 8 x PP 35) = DP {dp}; 1920 / DP {dp} = {m} microbatches",
        "notes": ("TP 8, PP 35 and full recomputation from llm-analysis's run_train.sh for this example (--tp_size 8 --pp_size 35 "
                  "--activation_recomputation 2). The micro-batch size is not in the retrieved text: posed as 1. The quote says "
                  "'8 A100-SXM 40GB GPUs'; the Microsoft Research announcement, as quoted at "
                  "https://creativeg.gr/gpt3/mt-nlg-by-microsoft-and-nvidia-ai/, says 'Each DGX A100 includes eight A100s, each "
                  "with an 80GB Tensor Core GPU' and 'HDR InfiniBand with full-fat tree extension', so the dgx-a100-80g preset is used (the GPUs' FLOP/s and NVLink are the same). DeepSpeed ZeRO-1 "
                  "data parallelism and its 1F1B pipeline schedule; fp32 main grads as Megatron-LM's default." + DS_P2P_NOTE)})

# ---------------------------------------------------------------- Megatron-LM GPT-3 175B (README, January 2021)
MG = "NVIDIA+Megatron-LM"
mg_quote_start = "With full global batch size of 1536 on 1024 A100 GPUs, each iteration takes around 32 seconds"
# The commit that wrote the sentence; the README and the example script are read there.
mg_commit = subprocess.check_output(["git", "-C", f"{MIR}/{MG}/repo", "log", "--reverse", "--format=%H", "-S", mg_quote_start,
                                     "--", "README.md"], text=True).split()[0]
mg_readme = show(MG, mg_commit, "README.md")
quote = next(l for l in mg_readme.splitlines() if l.startswith(mg_quote_start))
mg_script = show(MG, mg_commit, "examples/pretrain_gpt3_175B.sh")
for flag in ("--tensor-model-parallel-size 8", "--pipeline-model-parallel-size 16", "--num-layers 96", "--hidden-size 12288",
             "--num-attention-heads 96", "--seq-length 2048", "--micro-batch-size 1", "--global-batch-size 1536", "--fp16",
             "--checkpoint-activations"):
    assert flag in mg_script, flag
assert "dropout" not in mg_script and "--num-layers-per-virtual-pipeline-stage" not in mg_script
mg_args = show(MG, mg_commit, "megatron/arguments.py")
assert "'--attention-dropout', type=float, default=0.1" in mg_args and "'--hidden-dropout', type=float, default=0.1" in mg_args
assert "'--make-vocab-size-divisible-by', type=int, default=128" in mg_args
mg_training = show(MG, mg_commit, "megatron/training.py")
assert "reqs = torch.distributed.batch_isend_irecv(ops)" in mg_training and "req.wait()" in mg_training
assert "tensor_shape = (args.seq_length, args.micro_batch_size, args.hidden_size)" in mg_training
gpt3_model = write_model("gpt3-175b-megatron", {
    "name": "gpt3-175b-megatron",
    "description": (f"GPT-3 175B as NVIDIA/Megatron-LM examples/pretrain_gpt3_175B.sh runs it (commit {mg_commit[:10]}): 96 layers, "
                    "hidden 12288, 96 heads, sequence 2048, fp16; GPT-2 BPE vocabulary 50257 padded to a multiple of 128 x TP 8 "
                    "(megatron/tokenizer/tokenizer.py) = 51200; learned positions, LayerNorm, GELU, biases, tied embeddings, "
                    "Megatron's fused-softmax attention (no flash); attention and hidden dropout 0.1 (megatron/arguments.py "
                    "defaults; the script sets neither)."),
    "vocab": 51200, "hidden": 12288, "layers": 96, "heads": 96, "ffn": 49152,
    "activation": "gelu", "norm": "layernorm", "bias": True, "tie_embeddings": True, "max_positions": 2048,
    "attention": "standard", "dropout": 0.1,
    "training": {"seq_len": 2048, "micro_batch_size": 1, "precision": "fp16"}})
assert "takes around 32 seconds" in quote and "1024 A100 GPUs" in quote
cases.append({
    "id": "megatron-gpt3-175b-1024gpus",
    "source": "NVIDIA Megatron-LM README, GPT-3 example (January 2021)",
    "url": f"https://github.com/NVIDIA/Megatron-LM/blob/{mg_commit}/README.md",
    "repo": "NVIDIA/Megatron-LM", "commit": mg_commit, "path": "README.md",
    "quote": quote, "quote_context": "## GPT-3 Example",
    "model": gpt3_model, "gpu": "A100-80GB", "cluster": "dgx-a100-80g",
    "gpus": 1024,
    "flags": ["--tp", "8", "--pp", "16", "--dp", "8", "--zero", "0", "--schedule", "1f1b", "--microbatches", "192",
              "--micro-batch-size", "1", "--seq-len", "2048", "--recompute", "full", "--p2p-blocking"],
    "family": "tp+pp+dp", "runtime": "megatron",
    "measured": {"value": 32, "unit": "s/iteration ('around')"},
    "measured_step_s": 32.0,
    "conversion": "'each iteration takes around 32 seconds' is the step time; 1024 GPUs / (TP 8 x PP 16) = DP 8; 1536 / (DP 8 x micro-batch 1) = 192 microbatches",
    "notes": ("Settings from examples/pretrain_gpt3_175B.sh at the same commit (--tensor-model-parallel-size 8 "
              "--pipeline-model-parallel-size 16 --micro-batch-size 1 --global-batch-size 1536 --fp16 --checkpoint-activations; "
              "no --num-layers-per-virtual-pipeline-stage, so the non-interleaved 1F1B schedule). The README gives no GPU memory "
              "size or network; posed on the dgx-a100-80g preset (8 x 200 Gb/s HDR per node). Megatron's local DDP all-reduces "
              "fp16 gradients after the backward (--zero 0). The pipeline's communicate() in megatron/training.py sends the "
              "whole (seq, micro-batch, hidden) tensor from every TP rank with batch_isend_irecv and waits for every request "
              "before the next compute: --p2p-blocking. The figure is approximate ('around 32 seconds'); the README's 138 "
              "teraFLOP/s per GPU is the same figure counted with recomputation.")})

# ---------------------------------------------------------------- Zero Bubble Pipeline Parallelism (Qi et al., ICLR 2024)
ZB = "sail-sg+zero-bubble-pipeline-parallelism"
ZB_PDF_COMMIT = "3a91d0c8c21755dd0f7b425e3ac5699ab00b4083"  # "Add paper because arxiv pending too long" (2024-01-17)
ZB_SCRIPT_COMMIT = "ed85b11c0b9e58a3bb6b9d15ee0de2aeff62e398"  # "Zero Bubble Pipeline Parallelism", the first commit (2023-11-03)
zb_lines = pdf_text(ZB, ZB_PDF_COMMIT, "paper.pdf").splitlines()
zb_script = show(ZB, ZB_SCRIPT_COMMIT, "examples/pretrain_llama_7b.sh")
for flag in ("--seq-length 1024", "--tokenizer-type GPTSentencePieceTokenizer", "--fp16", "--clip-grad"):
    assert flag in zb_script, flag
assert "flash" not in zb_script and "dropout" not in zb_script.split("ENABLE_EXACTLY_NUMERIC_MATCH")[0]
assert "--untie-embeddings-and-output-weights" not in zb_script


def zb_line(prefix, after=0):
    hits = [i for i, l in enumerate(zb_lines) if l.strip().startswith(prefix) and i > after]
    return hits[0]


t3 = zb_line("Table 3: Models and fixed settings used in experiments")
t4 = zb_line("Table 4: Experiment result details")
ZB_MODELS = {}
for size in ("1.5B", "6.2B", "14.6B", "28.3B"):
    row = zb_lines[zb_line(size, t3)].split()
    layers, heads, hidden, seq, gpus, mbs = (int(x) for x in row[1:7])
    ms = [int(x) for x in row[7:] if x != "/"]
    assert seq == 1024 and len(ms) == 3, row
    ZB_MODELS[size] = (layers, heads, hidden, gpus, mbs, ms, " ".join(zb_lines[zb_line(size, t3)].split()))
ZB_PERF, ZB_MEM = {}, {}
for sched in ("ZB-2p", "ZB-1p", "1F1B"):
    perf_i = next(i for i in range(t4, t4 + 12) if sched in zb_lines[i].split() and "." in zb_lines[i])
    mem_i = next(i for i in range(perf_i + 1, t4 + 16) if sched in zb_lines[i].split())
    for store, i in ((ZB_PERF, perf_i), (ZB_MEM, mem_i)):
        words = zb_lines[i].split()
        store[sched] = ([float(x) for x in words[words.index(sched) + 1:]], zb_lines[i].strip())
    assert len(ZB_PERF[sched][0]) == 12 and len(ZB_MEM[sched][0]) == 12, sched
ZB_PDF = {"url": f"https://github.com/sail-sg/zero-bubble-pipeline-parallelism/blob/{ZB_PDF_COMMIT}/paper.pdf",
          "repo": "sail-sg/zero-bubble-pipeline-parallelism", "commit": ZB_PDF_COMMIT, "path": "paper.pdf",
          "text_of": "pdftotext -layout"}


def zb_setting(layers, gpus, m, mbs):
    """A Table 3 model's pipeline as posed (one fewer layer on the first and last stages), before the schedule."""
    per_stage = (layers + 2) // gpus
    assert (per_stage - 1) * 2 + per_stage * (gpus - 2) == layers, (layers, gpus)
    return ["--pp", str(gpus), "--dp", "1", "--microbatches", str(m), "--micro-batch-size", str(mbs), "--seq-len", "1024",
            "--recompute", "none", "--first-stage-layers", str(per_stage - 1), "--last-stage-layers", str(per_stage - 1)]


ZB_FLAGS = {
    "1F1B": ["--schedule", "1f1b", "--clip-grad", "8", "--p2p-blocking"],
    "ZB-1p": ["--schedule", "zb-auto", "--zb-memory-limit", "1p"],
    "ZB-2p": ["--schedule", "zb-auto", "--zb-memory-limit", "2p"],
}
ZB_NOTE = ("Setup from the paper's section 5.1: Megatron-LM GPT models, 'up to 32 NVIDIA A100 SXM 80G GPUs distributed across 4 "
           "nodes interconnected by a RoCE RDMA network' (posed as the dgx-a100-80g preset; the RoCE bandwidth is not given), "
           "TP 1, DP 1, 'both the initial and final pipeline stages possess one fewer transformer layer' "
           "(--first-stage-layers and --last-stage-layers one below the other stages). The authors' training script at their first commit "
           f"({ZB_SCRIPT_COMMIT[:8]}, examples/pretrain_llama_7b.sh) sets --fp16 and --clip-grad and no --use-flash-attn, so "
           "Megatron's fused-softmax attention with its default dropout 0.1; fp16 main grads with the fused weight-gradient "
           "accumulation (Megatron's defaults for fp16). 1F1B is Megatron-LM's schedule: blocking batched send/receive "
           "(--p2p-blocking) and the gradient-norm all-reduce before the update (--clip-grad). ZB-1p and ZB-2p use the paper's "
           "optimizer post-validation ('we propose to replace the before-hand synchronizations with a post update "
           "validation', section 4): no all-reduce before the update; posed as Piper's zb-auto with activation limit 1p / 2p. The Memory (GB) row is "
           "Megatron-LM's report_memory, which prints both max allocated and max reserved in MiB; the paper does not say "
           "which: measured_peak_kind 'unstated', the GB read as GiB.")
for size, (layers, heads, hidden, gpus, mbs, ms, t3_row) in ZB_MODELS.items():
    name = f"zb-gpt-{size.lower()}"
    model = write_model(name, {
        "name": name,
        "description": (f"The {size} GPT of Qi et al., 'Zero Bubble Pipeline Parallelism' (ICLR 2024), Table 3: {layers} layers, "
                        f"{heads} heads, hidden {hidden}, sequence 1024, micro-batch {mbs}. Megatron-LM GPT as the authors' "
                        f"script runs it (sail-sg/zero-bubble-pipeline-parallelism {ZB_SCRIPT_COMMIT[:8]}, "
                        "examples/pretrain_llama_7b.sh): fp16, Megatron's fused-softmax attention (no --use-flash-attn), "
                        "attention and hidden dropout 0.1 (Megatron-LM's defaults), learned positions, LayerNorm, GELU, biases, "
                        "ffn 4h, tied embeddings (no --untie-embeddings-and-output-weights). Assumed: a vocabulary of 32,000 "
                        "(the script's GPTSentencePieceTokenizer model is not in the repository; the script's name suggests "
                        "Llama's SentencePiece vocabulary)."),
        "vocab": 32000, "hidden": hidden, "layers": layers, "heads": heads, "ffn": 4 * hidden,
        "activation": "gelu", "norm": "layernorm", "bias": True, "tie_embeddings": True, "max_positions": 2048,
        "attention": "standard", "dropout": 0.1,
        "training": {"seq_len": 1024, "micro_batch_size": mbs, "precision": "fp16", "main_grad_accumulation": "fused"}})
    col0 = list(ZB_MODELS).index(size) * 3
    for j, m in enumerate(ms):
        for sched, flags in ZB_FLAGS.items():
            rate = ZB_PERF[sched][0][col0 + j]
            step = m * mbs / gpus / rate
            cases.append({
                "id": f"zb-{size.lower()}-pp{gpus}-m{m}-{sched.lower()}",
                "source": "Qi et al. 2024, Zero Bubble Pipeline Parallelism (ICLR 2024) Table 4, the paper in the authors' repository",
                **ZB_PDF,
                "quote": ZB_PERF[sched][1],
                "quote_context": (f"Table 4: Experiment result details (samples per GPU per second; columns {size} #Microbatch "
                                  f"{ms[0]} {ms[1]} {ms[2]}). Table 3: {t3_row}. Memory (GB): {ZB_MEM[sched][1]}"),
                "model": model, "gpu": "A100-80GB", "cluster": "dgx-a100-80g", "gpus": gpus,
                "flags": zb_setting(layers, gpus, m, mbs) + flags,
                "family": "pp", "runtime": "megatron",
                "measured": {"value": rate, "unit": "samples per GPU per second"},
                "measured_step_s": step,
                "conversion": f"{m} microbatches x {mbs} sequences / {gpus} GPUs / {rate} samples per GPU per second = {step:.4g} s",
                "measured_peak_gib": ZB_MEM[sched][0][col0 + j], "measured_peak_kind": "unstated",
                "notes": ZB_NOTE})

# Table 9 (appendix D): the profiled F, B (input gradient) and W (weight gradient) times of one
# microbatch on one stage, the median over ranks (zb_schedules.py's update_schedule takes the middle
# of the sorted per-rank times), and the p2p time, in the ZB-2p runs: ../stagetimes.json.
t9 = zb_line("Table 9: Profiled time of")
t9_rows = [l for l in zb_lines[t9 + 2:t9 + 16] if l.strip()][:12]
stages = []
for i, line in enumerate(t9_rows):
    size = list(ZB_MODELS)[i // 3]
    layers, heads, hidden, gpus, mbs, ms, _ = ZB_MODELS[size]
    words = line.split()
    m, tf, tb, tw, tc = int(words[-5]), *(float(x) for x in words[-4:])
    assert m == ms[i % 3] and (i % 3 != 1 or (size in words and str(gpus) in words)), line
    stages.append({
        "id": f"zb-{size.lower()}-pp{gpus}-m{m}", "model": f"experiments/fidelity/models/zb-gpt-{size.lower()}.json",
        "gpu": "A100-80GB", "cluster": "dgx-a100-80g",
        "flags": zb_setting(layers, gpus, m, mbs) + ZB_FLAGS["ZB-2p"],
        "stage_layers": (layers + 2) // gpus,
        "measured_ms": {"F": tf, "BI": tb, "BW": tw, "p2p": tc},
        "quote": line.strip(), "quote_context": " ".join(zb_lines[t9].split()) + " " + " ".join(zb_lines[t9 + 1].split()),
        **ZB_PDF})
with open(f"{OUT}/stagetimes.json", "w") as f:
    json.dump({"format": "piper-fidelity-stagetimes", "version": 1,
               "comment": ("Published per-stage op times (Qi et al. 2024, Table 9): one microbatch's forward (F), input "
                           "gradient (B, Piper's BI) and weight gradient (W, Piper's BW) on a middle pipeline stage, and "
                           "the p2p time, in ms. See README.md, section 'Stage times'."),
               "stages": stages}, f, indent=2, ensure_ascii=False)
    f.write("\n")

# Cases of sources this script does not build (transcribed from papers, or added by hand from a source read
# with `fetch`): kept as they are, in their places after the built ones, so a rebuild never drops them.
with open(f"{OUT}/steptimes.json") as f:
    previous = json.load(f)["cases"]
built_sources = {c["source"] for c in cases}
kept = [c for c in previous if c["source"] not in built_sources]
cases += kept
print(f"build_steptimes: kept {len(kept)} cases of sources it does not build: "
      + ", ".join(sorted({c['source'].split(' (')[0].split(',')[0] for c in kept})))
ids = [c["id"] for c in cases]
assert len(ids) == len(set(ids)), "duplicate ids"
doc = {
    "format": "piper-fidelity-steptimes",
    "version": 1,
    "comment": ("Published measured training step times, each with its verbatim quote (copied from the file at the named "
                "commit), the setting posed to `piper simulate` and the conversion to seconds per step. "
                "See README.md, section 'Step times'."),
    "cases": cases}
with open(f"{OUT}/steptimes.json", "w") as f:
    json.dump(doc, f, indent=2, ensure_ascii=False)
    f.write("\n")
from collections import Counter
print(len(cases), Counter(c["source"].split(",")[0].split(" (")[0] for c in cases))
