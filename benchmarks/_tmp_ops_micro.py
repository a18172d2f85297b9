import time, numpy as np, sys
sys.path.insert(0, '.')
from tf_async.backend.cpu.ops import CpuOps
from tf_async.backend.cpu import kernels as K
from tf_async.models.weights import quantize_affine
ops = CpuOps(); rng = np.random.default_rng(0)
def t(name, f, n=2000):
    f(); s = time.perf_counter()
    for _ in range(n): f()
    print(f"{name:<28}{(time.perf_counter()-s)/n*1e6:8.1f} us")
x = rng.standard_normal((1, 576)).astype(np.float32); w = np.ones(576, np.float32)
kv = ops.alloc_kv(30, 4096, 3, 64, "f32"); k = rng.standard_normal((1, 3, 64)).astype(np.float32)
slots = np.array([100], np.int64); pos = slots.copy(); inv = np.ones(32, np.float32)
q = rng.standard_normal((1, 9, 64)).astype(np.float32)
bt = np.arange(256, dtype=np.int32)[None]; rs = np.zeros(1, np.int32)
g = rng.standard_normal((1, 1536)).astype(np.float32)
t("rms_norm", lambda: ops.rms_norm(x, w, 1e-5))
t("rms_norm kernel", lambda: K.rms_norm(x, w, 1e-5, x.copy()))
t("rope q", lambda: ops.rope(q, pos, inv, 1.0))
t("kv_write", lambda: ops.kv_write(kv, 3, k, k, slots, None))
t("kv_write kernel", lambda: K.kv_write(k, k, kv[3], slots, 1.0, 1.0))
t("silu_mul", lambda: ops.silu_mul(g, g))
t("attention ctx100", lambda: ops.attention(q, kv, 3, None, bt, rs, pos, 16, 0.125))
t("attention kernel", lambda: K.paged_attention(q, kv[3], 1.0, 1.0, bt, rs, pos, 16, 0.125, q.copy()))
t("bad_page_row", lambda: K.first_bad_page_row(bt, rs, pos, 16, 256))
for o, i in [(192, 576), (576, 576), (1536, 576), (576, 1536)]:
    wq = ops.upload_linear(quantize_affine(rng.standard_normal((o, i)).astype(np.float32), 4, 32))
    xi = rng.standard_normal((1, i)).astype(np.float32)
    t(f"linear {o}x{i}", lambda: ops.linear(xi, wq), 500)
t("h + h", lambda: x + x)
