"""KV writes (with conversion to the arena's dtype) and page zeroing. Pure data movement:
every element is written by exactly one thread. (The drafters' rings are written through
kv_write into ring views of the arena: no kernel of their own.)

Launch shapes (the launchers in tf_async/backend/cuda_ops.py use these):
- kv_write_*: grid (rows, 2), block KV_THREADS; kv_layer [2, num_slots, nkv, hd].
- zero_pages: grid (num_pages, num_layers * 2), block KV_THREADS; kv viewed as
  [num_layers * 2, num_slots, row_elems].
"""

from __future__ import annotations

import numpy as np

from cuda_kernels.convert import to_bf16_bits, to_e4m3
from cuda_kernels.env import cuda, kernel

KV_THREADS = 128


@kernel
def kv_write_f32(k, v, kv_layer, slots, k_scale, v_scale):
    # k, v: [rows, nkv, hd] f32; kv_layer: [2, num_slots, nkv, hd] f32; slots: [rows] i64
    row = cuda.blockIdx.x
    kind = cuda.blockIdx.y
    src = k if kind == 0 else v
    slot = slots[row]
    nkv = src.shape[1]
    hd = src.shape[2]
    for e in range(cuda.threadIdx.x, nkv * hd, cuda.blockDim.x):
        kv_layer[kind, slot, e // hd, e % hd] = src[row, e // hd, e % hd]


@kernel
def kv_write_bf16(k, v, kv_layer, slots, k_scale, v_scale):
    # kv_layer: [2, num_slots, nkv, hd] uint16 (bf16 bits)
    row = cuda.blockIdx.x
    kind = cuda.blockIdx.y
    src = k if kind == 0 else v
    slot = slots[row]
    nkv = src.shape[1]
    hd = src.shape[2]
    for e in range(cuda.threadIdx.x, nkv * hd, cuda.blockDim.x):
        kv_layer[kind, slot, e // hd, e % hd] = to_bf16_bits(src[row, e // hd, e % hd])


@kernel
def kv_write_fp8(k, v, kv_layer, slots, k_scale, v_scale):
    # kv_layer: [2, num_slots, nkv, hd] uint8 (E4M3FN); stored e4m3(x / scale)
    row = cuda.blockIdx.x
    kind = cuda.blockIdx.y
    src = k if kind == 0 else v
    scale = np.float32(k_scale) if kind == 0 else np.float32(v_scale)
    slot = slots[row]
    nkv = src.shape[1]
    hd = src.shape[2]
    for e in range(cuda.threadIdx.x, nkv * hd, cuda.blockDim.x):
        x = np.float32(src[row, e // hd, e % hd])
        kv_layer[kind, slot, e // hd, e % hd] = to_e4m3(x / scale)


@kernel
def zero_pages(kv_flat, page_ids, page_size):
    # kv_flat: [num_layers * 2, num_slots, row_elems] (any dtype); page_ids: [n] i32
    page_id = page_ids[cuda.blockIdx.x]
    plane = cuda.blockIdx.y
    row_elems = kv_flat.shape[2]
    first_slot = page_id * page_size
    for e in range(cuda.threadIdx.x, page_size * row_elems, cuda.blockDim.x):
        kv_flat[plane, first_slot + e // row_elems, e % row_elems] = 0
