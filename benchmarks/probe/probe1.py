"""One-off GPU probe (session 5): API availability and speeds that decide the training-speed design."""
import time, torch, json, sys
import torch.nn.functional as F
import triton, triton.language as tl
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
dev = "cuda"
res = {}

def bench(fn, n=20, w=3):
    for _ in range(w): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    ts.sort(); return ts[len(ts)//2]

# 1. torch.mm out_dtype
try:
    a = torch.randn(64, 64, device=dev, dtype=torch.bfloat16)
    print("mm out_dtype:", torch.mm(a, a, out_dtype=torch.float32).dtype)
except Exception as e:
    print("mm out_dtype ERR", str(e)[:200])

# 2. Triton pointer table
@triton.jit
def _ptr_kernel(tab, out, N: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(N):
        p = tl.load(tab + i).to(tl.pointer_type(tl.bfloat16))
        acc += tl.load(p + offs).to(tl.float32)
    tl.store(out + offs, acc)
try:
    xs = [torch.randn(128, device=dev, dtype=torch.bfloat16) for _ in range(3)]
    tab = torch.tensor([x.data_ptr() for x in xs], device=dev, dtype=torch.int64)
    out = torch.empty(128, device=dev)
    _ptr_kernel[(1,)](tab, out, N=3, BLOCK=128)
    print("pointer table ok:", torch.allclose(out, sum(x.float() for x in xs)))
except Exception as e:
    print("pointer table ERR", str(e)[:300])

# 3. LM-head GEMM shapes
D, V = 1536, 163840
W = torch.randn(V, D, device=dev, dtype=torch.bfloat16)
for n in (2048, 4096, 8192):
    h = torch.randn(n, D, device=dev, dtype=torch.bfloat16)
    g = torch.randn(n, V, device=dev, dtype=torch.bfloat16)
    f = 2 * n * D * V
    t1 = bench(lambda: h @ W.t()); t2 = bench(lambda: g @ W); t3 = bench(lambda: g.t() @ h)
    print(f"LM head n={n}: fwd {t1:.2f} ms {f/t1/1e9:.0f} TF/s | dh {t2:.2f} {f/t2/1e9:.0f} | dW {t3:.2f} {f/t3/1e9:.0f}")
    del g

# 4. flex attention, MLA shapes, doc mask
from torch.nn.attention.flex_attention import flex_attention, BlockMask, create_block_mask
try:
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:
    AuxRequest = None
print("AuxRequest:", AuxRequest is not None)
B, T, H = 8, 4096, 12
gen = torch.Generator().manual_seed(0)
cuts = []
for r in range(B):
    pos = 0
    while pos < T:
        L = min(T - pos, max(16, int(torch.empty(1).exponential_(1 / 2048, generator=gen).item())))
        pos += L; cuts.append(r * T + pos)
cu = torch.tensor([0] + cuts, device=dev)
docs = torch.searchsorted(cu[1:], torch.arange(B * T, device=dev), right=True).view(B, T)
def mask_mod(b, h, qi, ki):
    return (docs[b, qi] == docs[b, ki]) & (qi >= ki)
t0 = time.time()
bm = create_block_mask(mask_mod, B, None, T, T, device=dev)
print("create_block_mask", time.time() - t0, "s", bm.sparsity() if hasattr(bm, "sparsity") else "")
q = torch.randn(B, H, T, 192, device=dev, dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(B, H, T, 192, device=dev, dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(B, H, T, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
fa = torch.compile(flex_attention, dynamic=False)
t0 = time.time()
try:
    if AuxRequest is not None:
        o, aux = fa(q, k, v, block_mask=bm, scale=192 ** -0.5, return_aux=AuxRequest(max_scores=True))
        print("max_scores shape", aux.max_scores.shape)
    else:
        o = fa(q, k, v, block_mask=bm, scale=192 ** -0.5)
    o.sum().backward()
    torch.cuda.synchronize()
    print("flex compile+first", time.time() - t0, "s")
    def fb():
        o = fa(q, k, v, block_mask=bm, scale=192 ** -0.5)
        o.backward(torch.ones_like(o))
    tf = bench(lambda: fa(q, k, v, block_mask=bm, scale=192 ** -0.5), n=10)
    tfb = bench(fb, n=10)
    # useful FLOPs: per doc causal L(L+1)/2 pairs, fwd 2*(192+128) per pair per head
    lens = (cu[1:] - cu[:-1]).double()
    pairs = float((lens * (lens + 1) / 2).sum())
    fl = 2 * H * (192 + 128) * pairs
    print(f"flex fwd {tf:.2f} ms ({fl/tf/1e9:.0f} TF/s)  fwd+bwd {tfb:.2f} ms ({3.5*fl/tfb/1e9:.0f} TF/s)")
    # correctness vs dense sdpa on row 0
    with torch.no_grad():
        d0 = docs[0]
        allowed = (d0[:, None] == d0[None, :]) & torch.ones(T, T, device=dev, dtype=torch.bool).tril()
        ref = F.scaled_dot_product_attention(q[:1].float(), k[:1].float(), v[:1].float(), attn_mask=allowed, scale=192 ** -0.5)
        o = fa(q, k, v, block_mask=bm, scale=192 ** -0.5)
        print("flex vs dense rel err", ((o[:1].float() - ref).norm() / ref.norm()).item())
except Exception as e:
    import traceback; traceback.print_exc()
