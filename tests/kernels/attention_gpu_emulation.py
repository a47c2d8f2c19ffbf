#!/usr/bin/env python3
# A CPU emulation of the tensor-core attention kernels (kernels/attention_kernels.cuh), runnable without a GPU:
#   python3 tests/kernels/attention_gpu_emulation.py
# It models the PTX semantics the kernels rely on (ldmatrix .x4 with and without .trans, mma.m16n8k16 row.col
# fragment layouts, the XOR swizzle of the shared tiles) and transcribes fwd_kernel, bwd_dkdv_kernel and
# bwd_dq_kernel statement by statement (per-lane masking, online softmax with quad shuffles, causal block
# skipping, GQA head loops, rows past seq_len), in float64, against a numpy reference. It checks the index
# and fragment logic only: not synchronization, not bf16 precision, not the hardware; the GPU tests do that.
# Keep it in step with the kernels when they change.
import math
import numpy as np

rng = np.random.default_rng(0)

def swizzle(kdim, row, chunk):
    return row * kdim + ((chunk ^ (row & 7)) * 8)

class Tile:
    def __init__(self, rows, kdim, values):  # values [rows][kdim]
        self.kdim = kdim
        self.mem = np.full(rows * kdim, np.nan)
        for r in range(rows):
            for ch in range(kdim // 8):
                a = swizzle(kdim, r, ch)
                self.mem[a:a+8] = values[r, ch*8:ch*8+8]

def ldmatrix_x4(tile, addrs, trans):
    # addrs[lane] = element offset of the 8-element row that lane provides
    regs = [[None]*4 for _ in range(32)]
    for i in range(4):
        m = np.array([tile.mem[addrs[8*i + r]: addrs[8*i + r] + 8] for r in range(8)])  # 8x8
        for t in range(32):
            if not trans:
                regs[t][i] = (m[t//4, 2*(t%4)], m[t//4, 2*(t%4)+1])
            else:
                regs[t][i] = (m[2*(t%4), t//4], m[2*(t%4)+1, t//4])
    return regs

def mma(c, a, b0, b1):
    # c[lane] = 4 floats; a[lane] = 4 pairs; b0[lane], b1[lane] pairs
    A = np.zeros((16,16)); B = np.zeros((16,8)); C = np.zeros((16,8))
    for t in range(32):
        g, cc = t//4, t%4
        A[g, 2*cc:2*cc+2] = a[t][0]; A[g+8, 2*cc:2*cc+2] = a[t][1]
        A[g, 2*cc+8:2*cc+10] = a[t][2]; A[g+8, 2*cc+8:2*cc+10] = a[t][3]
        B[2*cc:2*cc+2, g] = b0[t]; B[2*cc+8:2*cc+10, g] = b1[t]
        C[g, 2*cc:2*cc+2] = c[t][0:2]; C[g+8, 2*cc:2*cc+2] = c[t][2:4]
    D = C + A @ B
    for t in range(32):
        g, cc = t//4, t%4
        c[t][0:2] = D[g, 2*cc:2*cc+2]; c[t][2:4] = D[g+8, 2*cc:2*cc+2]

def load_a(tile, row0, kk):
    return ldmatrix_x4(tile, [swizzle(tile.kdim, row0 + l % 16, 2*kk + l // 16) for l in range(32)], False)
def load_b(tile, n0, kk):
    return ldmatrix_x4(tile, [swizzle(tile.kdim, n0 + l % 8 + 8*(l // 16), 2*kk + (l // 8) % 2) for l in range(32)], False)
def load_b_trans(tile, k0, n0):
    return ldmatrix_x4(tile, [swizzle(tile.kdim, k0 + l % 16, n0 // 8 + l // 16) for l in range(32)], True)

def gemm_rows_by_rows(kdim, ntiles, a_tile, a_row0, b_tile, b_row0):
    acc = [[np.zeros(4) for _ in range(ntiles)] for _ in range(32)]  # acc[lane][nt]
    for kk in range(kdim // 16):
        a = load_a(a_tile, a_row0, kk)
        for np_ in range(ntiles // 2):
            b = load_b(b_tile, b_row0 + np_*16, kk)
            c0 = [acc[t][2*np_] for t in range(32)]; mma(c0, a, [b[t][0] for t in range(32)], [b[t][1] for t in range(32)])
            c1 = [acc[t][2*np_+1] for t in range(32)]; mma(c1, a, [b[t][2] for t in range(32)], [b[t][3] for t in range(32)])
    return acc

def gemm_regs_by_tile(kdim, ptiles, acc, p, b_tile):
    for kk in range(ptiles // 2):
        a = [[(p[t][2*kk][0], p[t][2*kk][1]), (p[t][2*kk][2], p[t][2*kk][3]),
              (p[t][2*kk+1][0], p[t][2*kk+1][1]), (p[t][2*kk+1][2], p[t][2*kk+1][3])] for t in range(32)]
        for dp in range(kdim // 16):
            b = load_b_trans(b_tile, kk*16, dp*16)
            c0 = [acc[t][2*dp] for t in range(32)]; mma(c0, a, [b[t][0] for t in range(32)], [b[t][1] for t in range(32)])
            c1 = [acc[t][2*dp+1] for t in range(32)]; mma(c1, a, [b[t][2] for t in range(32)], [b[t][3] for t in range(32)])

def frag_to_matrix(acc, ntiles):
    M = np.zeros((16, 8*ntiles))
    for t in range(32):
        g, cc = t//4, t%4
        for nt in range(ntiles):
            M[g, nt*8+2*cc:nt*8+2*cc+2] = acc[t][nt][0:2]; M[g+8, nt*8+2*cc:nt*8+2*cc+2] = acc[t][nt][2:4]
    return M



def check_fragments():
    for kdim, rows_a, rows_b in [(64, 64, 64), (128, 64, 32), (128, 64, 64)]:
        A = rng.standard_normal((rows_a, kdim)); Bm = rng.standard_normal((rows_b, kdim))
        ta, tb = Tile(rows_a, kdim, A), Tile(rows_b, kdim, Bm)
        for warp in range(rows_a // 16):
            ntiles = rows_b // 8
            acc = gemm_rows_by_rows(kdim, ntiles, ta, warp*16, tb, 0)
            S = frag_to_matrix(acc, ntiles)
            ref = A[warp*16:warp*16+16] @ Bm.T
            assert np.allclose(S, ref), ("rows_by_rows", kdim, warp)
            # values product: S (16 x rows_b) @ V (rows_b x kdim)
            V = rng.standard_normal((rows_b, kdim)); tv = Tile(rows_b, kdim, V)
            o = [[np.zeros(4) for _ in range(kdim // 8)] for _ in range(32)]
            gemm_regs_by_tile(kdim, ntiles, o, acc, tv)
            O = frag_to_matrix(o, kdim // 8)
            assert np.allclose(O, S @ V), ("regs_by_tile", kdim, warp)
    print("fragment emulation: all products match")
    # bank conflicts: for each ldmatrix 8-row group, the 16-byte chunks must hit 8 distinct bank groups (addr/8 % 8)
    for kdim in (64, 128):
        for row0 in range(0, 64, 8):
            for ch in range(kdim // 8):
                groups = {(swizzle(kdim, row0 + r, ch) // 8) % 8 for r in range(8)}
                assert len(groups) == 8
    print("swizzle: conflict-free")

LOG2E = 1.4426950408889634

def load_tile(rows, kdim, X, row0, seq):  # X: [seq, kdim]; rows past seq are zeros
    vals = np.zeros((rows, kdim))
    for r in range(rows):
        if row0 + r < seq: vals[r] = X[row0 + r]
    return Tile(rows, kdim, vals)

def quad_reduce(vals, op):  # vals[lane] -> reduce over lanes with the same lane//4 (shfl xor 1, 2)
    out = list(vals)
    for off in (1, 2):
        out = [op(out[l], out[l ^ off]) for l in range(32)]
    return out

def store_rows(acc, kdim, row0, seq, scale_lo, scale_hi, dst):
    for lane in range(32):
        g, c = lane // 4, lane % 4
        for half in range(2):
            row = row0 + g + 8 * half
            if row >= seq: continue
            s = scale_lo[lane] if half == 0 else scale_hi[lane]
            for nt in range(kdim // 8):
                dst[row, nt*8 + 2*c] = acc[lane][nt][2*half] * s
                dst[row, nt*8 + 2*c + 1] = acc[lane][nt][2*half + 1] * s

def fwd(q, k, v, hd):  # one (b, h): q, k, v [seq, hd]
    seq = q.shape[0]; scale_log2 = LOG2E / math.sqrt(hd)
    out = np.full((seq, hd), np.nan); lse = np.full(seq, np.nan)
    for m_block in range((seq + 63) // 64):
        q0 = m_block * 64
        n_steps = (min(seq, q0 + 64) + 63) // 64
        sq = load_tile(64, hd, q, q0, seq)
        for warp in range(4):
            o = [[np.zeros(4) for _ in range(hd // 8)] for _ in range(32)]
            row_max = [[-np.inf, -np.inf] for _ in range(32)]; row_sum = [[0.0, 0.0] for _ in range(32)]
            for j in range(n_steps):
                key0 = j * 64
                sk = load_tile(64, hd, k, key0, seq); sv = load_tile(64, hd, v, key0, seq)
                s = gemm_rows_by_rows(hd, 8, sq, warp * 16, sk, 0)
                needs_mask = key0 + 64 > q0 + warp * 16 or key0 + 64 > seq
                for lane in range(32):
                    g, c = lane // 4, lane % 4
                    row_lo = q0 + warp * 16 + g
                    for nt in range(8):
                        for e in range(4):
                            key = key0 + nt * 8 + 2 * c + (e & 1); row = row_lo + 8 * (e >> 1)
                            s[lane][nt][e] = -np.inf if needs_mask and (key > row or key >= seq) else s[lane][nt][e] * scale_log2
                for half in range(2):
                    step_max = [max(max(s[l][nt][2*half], s[l][nt][2*half+1]) for nt in range(8)) for l in range(32)]
                    step_max = quad_reduce(step_max, max)
                    for l in range(32):
                        new_max = max(row_max[l][half], step_max[l])
                        corr = 2.0 ** (row_max[l][half] - new_max)
                        row_max[l][half] = new_max
                        ssum = 0.0
                        for nt in range(8):
                            for e in (2*half, 2*half+1):
                                s[l][nt][e] = 2.0 ** (s[l][nt][e] - new_max); ssum += s[l][nt][e]
                        row_sum[l][half] = row_sum[l][half] * corr + ssum
                        for nt in range(hd // 8):
                            o[l][nt][2*half] *= corr; o[l][nt][2*half+1] *= corr
                gemm_regs_by_tile(hd, 8, o, s, sv)
            inv = [[0, 0] for _ in range(32)]
            for half in range(2):
                tot = quad_reduce([row_sum[l][half] for l in range(32)], lambda a, b: a + b)
                for l in range(32):
                    inv[l][half] = 1.0 / tot[l]
                    row = q0 + warp * 16 + l // 4 + 8 * half
                    if l % 4 == 0 and row < seq: lse[row] = (row_max[l][half] + math.log2(tot[l])) * math.log(2)
            store_rows(o, hd, q0 + warp * 16, seq, [inv[l][0] for l in range(32)], [inv[l][1] for l in range(32)], out)
    return out, lse

def bwd(q_heads, k, v, dout_heads, out_heads, lse_heads, hd, kq):  # one (b, kv head); lists over the group's heads
    seq = k.shape[0]; scale = 1 / math.sqrt(hd); scale_log2 = scale * LOG2E
    group = len(q_heads)
    delta_heads = [np.sum(dout_heads[h] * out_heads[h], axis=1) for h in range(group)]
    dk = np.full((seq, hd), np.nan); dv = np.full((seq, hd), np.nan)
    for n_block in range((seq + 63) // 64):
        key0 = n_block * 64
        sk = load_tile(64, hd, k, key0, seq); sv = load_tile(64, hd, v, key0, seq)
        first = key0 // kq; qblocks = (seq + kq - 1) // kq - first
        for warp in range(4):
            dkacc = [[np.zeros(4) for _ in range(hd // 8)] for _ in range(32)]
            dvacc = [[np.zeros(4) for _ in range(hd // 8)] for _ in range(32)]
            for step in range(group * qblocks):
                h = step // qblocks; q0 = (first + step % qblocks) * kq
                sq = load_tile(kq, hd, q_heads[h], q0, seq); sdo = load_tile(kq, hd, dout_heads[h], q0, seq)
                lse2 = [lse_heads[h][q0 + i] * LOG2E if q0 + i < seq else np.inf for i in range(kq)]
                dl = [delta_heads[h][q0 + i] if q0 + i < seq else 0.0 for i in range(kq)]
                pt = gemm_rows_by_rows(hd, kq // 8, sk, warp * 16, sq, 0)
                for l in range(32):
                    c = l % 4; key_lo = key0 + warp * 16 + l // 4
                    for nt in range(kq // 8):
                        for e in range(4):
                            qi = nt * 8 + 2 * c + (e & 1); key = key_lo + 8 * (e >> 1)
                            pt[l][nt][e] = 0.0 if key > q0 + qi else 2.0 ** (pt[l][nt][e] * scale_log2 - lse2[qi])
                dst = gemm_rows_by_rows(hd, kq // 8, sv, warp * 16, sdo, 0)
                for l in range(32):
                    c = l % 4
                    for nt in range(kq // 8):
                        for e in range(4):
                            dst[l][nt][e] = pt[l][nt][e] * (dst[l][nt][e] - dl[nt * 8 + 2 * c + (e & 1)])
                gemm_regs_by_tile(hd, kq // 8, dvacc, pt, sdo)
                gemm_regs_by_tile(hd, kq // 8, dkacc, dst, sq)
            store_rows(dkacc, hd, key0 + warp * 16, seq, [scale]*32, [scale]*32, dk)
            store_rows(dvacc, hd, key0 + warp * 16, seq, [1.0]*32, [1.0]*32, dv)
    dqs = []
    for h in range(group):
        dq = np.full((seq, hd), np.nan)
        for m_block in range((seq + 63) // 64):
            q0 = m_block * 64
            sq = load_tile(64, hd, q_heads[h], q0, seq); sdo = load_tile(64, hd, dout_heads[h], q0, seq)
            n_steps = (min(seq, q0 + 64) + 63) // 64
            for warp in range(4):
                dqacc = [[np.zeros(4) for _ in range(hd // 8)] for _ in range(32)]
                for j in range(n_steps):
                    key0 = j * 64
                    sk2 = load_tile(64, hd, k, key0, seq); sv2 = load_tile(64, hd, v, key0, seq)
                    s = gemm_rows_by_rows(hd, 8, sq, warp * 16, sk2, 0)
                    for l in range(32):
                        g, c = l // 4, l % 4; row_lo = q0 + warp * 16 + g
                        for half in range(2):
                            row = row_lo + 8 * half
                            l2 = lse_heads[h][row] * LOG2E if row < seq else np.inf
                            for nt in range(8):
                                for e in (2*half, 2*half+1):
                                    key = key0 + nt * 8 + 2 * c + (e & 1)
                                    s[l][nt][e] = 0.0 if key > row or key >= seq else 2.0 ** (s[l][nt][e] * scale_log2 - l2)
                    dp = gemm_rows_by_rows(hd, 8, sdo, warp * 16, sv2, 0)
                    for l in range(32):
                        g = l // 4
                        for half in range(2):
                            row = q0 + warp * 16 + g + 8 * half
                            d = delta_heads[h][row] if row < seq else 0.0
                            for nt in range(8):
                                for e in (2*half, 2*half+1): dp[l][nt][e] = s[l][nt][e] * (dp[l][nt][e] - d)
                    gemm_regs_by_tile(hd, 8, dqacc, dp, sk2)
                store_rows(dqacc, hd, q0 + warp * 16, seq, [scale]*32, [scale]*32, dq)
        dqs.append(dq)
    return dqs, dk, dv

def reference(q_heads, k, v, dout_heads, hd):
    seq = k.shape[0]; scale = 1 / math.sqrt(hd)
    mask = np.tril(np.ones((seq, seq), bool))
    outs, lses, dqs = [], [], []; dk = np.zeros_like(k); dv = np.zeros_like(v)
    for q, g in zip(q_heads, dout_heads):
        s = np.where(mask, q @ k.T * scale, -np.inf)
        m = s.max(1, keepdims=True); p = np.exp(s - m); l = p.sum(1, keepdims=True); p /= l
        out = p @ v; outs.append(out); lses.append((m + np.log(l))[:, 0])
        dp = g @ v.T; D = np.sum(g * out, 1, keepdims=True); ds = p * (dp - D)
        dqs.append(ds @ k * scale); dk += ds.T @ q * scale; dv += p.T @ g
    return outs, lses, dqs, dk, dv

def check_kernels():
  rng = np.random.default_rng(1)
  for seq, hd, group, kq in [(70, 64, 2, 64), (100, 128, 1, 32), (33, 64, 1, 64), (130, 64, 2, 32)]:
      q_heads = [rng.standard_normal((seq, hd)) for _ in range(group)]
      k = rng.standard_normal((seq, hd)); v = rng.standard_normal((seq, hd))
      dout_heads = [rng.standard_normal((seq, hd)) for _ in range(group)]
      outs, lses, dqs, dk, dv = reference(q_heads, k, v, dout_heads, hd)
      for h in range(group):
          o, l = fwd(q_heads[h], k, v, hd)
          assert np.allclose(o, outs[h]) and np.allclose(l, lses[h]), ("fwd", seq, hd)
      edq, edk, edv = bwd(q_heads, k, v, dout_heads, outs, lses, hd, kq)
      for h in range(group): assert np.allclose(edq[h], dqs[h]), ("dq", seq, hd, h)
      assert np.allclose(edk, dk), ("dk", seq, hd); assert np.allclose(edv, dv), ("dv", seq, hd)
      print(f"seq {seq} hd {hd} group {group} kq {kq}: fwd, dq, dk, dv match")


if __name__ == "__main__":
    check_fragments()
    check_kernels()
