# Vendored from ../shared/measurements/h200/torch_dense1b.py (the measurement of issue 25: PyTorch eager
# 123.3 ms, torch.compile 103.0 ms on an H200, torch 2.11.0+cu130, ../shared/measurements/h200/torch-dense1b.txt)
# so that scripts/gpu-check.sh runs it from any copy of the repository; unchanged below this note.
# Anchor for the CUDA backend's one-GPU benchmark: the same dense 1.1B Llama-style model
# (examples/models/dense-1b.json: hidden 2048, 16 layers, 32 heads / 8 KV heads, head_dim 64,
# SwiGLU ffn 8192, vocab 32000, untied head, seq 1024) trained in PyTorch on one GPU, bf16 weights,
# fp32 AdamW states (torch.optim.AdamW fused), SDPA flash attention, micro-batch 4 x 2 microbatches
# per step (gradient accumulation), eager and torch.compile. Prints step time, tokens/s and MFU
# (PaLM's model FLOPs: 6 x non-embedding params x tokens + causal attention 6 x L x d x s per token, vs the 989.4 TFLOP/s dense bf16 peak).
import sys, time, torch, torch.nn as nn, torch.nn.functional as F
V, H, L, NH, KV, HD, FF, S, MB, NMB = 32000, 2048, 16, 32, 8, 64, 8192, 1024, 4, 2
dev = "cuda"

class Rope(nn.Module):
    def __init__(s):
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, HD, 2, device=dev).float() / HD))
        t = torch.arange(S, device=dev).float()
        f = torch.outer(t, inv)
        s.register_buffer("cos", f.cos().to(torch.bfloat16)[None, None], persistent=False)
        s.register_buffer("sin", f.sin().to(torch.bfloat16)[None, None], persistent=False)
    def forward(s, x):
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.cat([x1 * s.cos - x2 * s.sin, x1 * s.sin + x2 * s.cos], -1)

class Block(nn.Module):
    def __init__(s, rope):
        super().__init__()
        s.n1, s.n2 = nn.RMSNorm(H), nn.RMSNorm(H)
        s.qkv = nn.Linear(H, (NH + 2 * KV) * HD, bias=False)
        s.o = nn.Linear(NH * HD, H, bias=False)
        s.gu = nn.Linear(H, 2 * FF, bias=False)
        s.d = nn.Linear(FF, H, bias=False)
        s.rope = rope
    def forward(s, x):
        B = x.shape[0]
        q, k, v = s.qkv(s.n1(x)).split([NH * HD, KV * HD, KV * HD], -1)
        q = s.rope(q.view(B, S, NH, HD).transpose(1, 2))
        k = s.rope(k.view(B, S, KV, HD).transpose(1, 2))
        v = v.view(B, S, KV, HD).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + s.o(a.transpose(1, 2).reshape(B, S, NH * HD))
        g, u = s.gu(s.n2(x)).chunk(2, -1)
        return x + s.d(F.silu(g) * u)

class Model(nn.Module):
    def __init__(s):
        super().__init__()
        rope = Rope()
        s.emb = nn.Embedding(V, H)
        s.blocks = nn.ModuleList([Block(rope) for _ in range(L)])
        s.norm = nn.RMSNorm(H)
        s.head = nn.Linear(H, V, bias=False)
    def forward(s, idx, tgt):
        x = s.emb(idx)
        for b in s.blocks: x = b(x)
        return F.cross_entropy(s.head(s.norm(x)).float().view(-1, V), tgt.view(-1))

def run(compiled, steps=8):
    torch.manual_seed(0)
    m = Model().to(dev, torch.bfloat16)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
    f = torch.compile(m) if compiled else m
    idx = torch.randint(0, V, (NMB, MB, S), device=dev)
    times = []
    for i in range(steps):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for j in range(NMB):
            (f(idx[j], idx[j]) / NMB).backward()
        opt.step(); opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
    n = sum(p.numel() for p in m.parameters())
    st = sorted(times[2:])[len(times[2:]) // 2]
    tok = NMB * MB * S
    flops = 6 * (n - V * H) * tok + 6 * L * NH * HD * S * tok  # PaLM's count: non-embedding params, causal attention
    print(f"torch {'compile' if compiled else 'eager'}: params {n/1e9:.3f} B, step {st*1e3:.1f} ms (median of {len(times)-2}), "
          f"{tok/st:,.0f} tok/s, model TFLOP/s {flops/st/1e12:.0f}, MFU {flops/st/989.4e12*100:.1f} % of 989.4")
    del m, opt, f; torch.cuda.empty_cache()

if __name__ != "t": print(torch.__version__, torch.cuda.get_device_name(0))
if __name__ != "t": run(False)
if __name__ != "t" and (len(sys.argv) < 2 or sys.argv[1] != "eager"): run(True)
