"""The Triton kernels of cuteflash.layer_norm: a row's dropout, residual add and LayerNorm or RMSNorm in one pass
forward, and the matching backward pass. Imported on first use, so that cuteflash imports without Triton."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _keep(bits, threshold):
    """Philox bits to a keep decision: the top 24 bits against threshold = round(p * 2^24)."""
    return (bits.to(tl.uint32, bitcast=True) >> 8).to(tl.int32) >= threshold


@triton.jit
def norm_fwd(
    X, X1, RES, ROWSCALE, W, B, W1, B1,  # inputs (X1, RES, ROWSCALE, B, W1, B1 may be unused)
    Y, Y1, RES_OUT, MASK, MASK1, MEAN, RSTD,  # outputs
    stride_x, stride_x1, stride_res, stride_y, stride_y1, stride_res_out,
    N, eps, threshold, SEED, keep_scale,
    RMS: tl.constexpr, HAS_X1: tl.constexpr, HAS_RES: tl.constexpr, HAS_ROWSCALE: tl.constexpr,
    HAS_B: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr, STORE_RES: tl.constexpr,
    DROPOUT: tl.constexpr, STORE_MASK: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < N
    x = tl.load(X + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_ROWSCALE:
        x *= tl.load(ROWSCALE + row).to(tl.float32)
    if DROPOUT:
        bits, bits1, _, _ = tl.randint4x(tl.load(SEED), row * N + cols)
        keep = _keep(bits, threshold)
        x = tl.where(keep, x * keep_scale, 0.0)
        if STORE_MASK:
            tl.store(MASK + row * N + cols, keep, mask=inside)
    if HAS_X1:
        x1 = tl.load(X1 + row * stride_x1 + cols, mask=inside, other=0.0).to(tl.float32)
        if DROPOUT:
            keep1 = _keep(bits1, threshold)
            x1 = tl.where(keep1, x1 * keep_scale, 0.0)
            if STORE_MASK:
                tl.store(MASK1 + row * N + cols, keep1, mask=inside)
        x += x1
    if HAS_RES:
        x += tl.load(RES + row * stride_res + cols, mask=inside, other=0.0).to(tl.float32)
    if STORE_RES:  # x' rounded as stored, so that the norm reads what the backward pass will
        x = x.to(RES_OUT.dtype.element_ty).to(tl.float32)
        tl.store(RES_OUT + row * stride_res_out + cols, x, mask=inside)
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=0) / N
        tl.store(MEAN + row, mean)
        xc = tl.where(inside, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
    tl.store(RSTD + row, rstd)
    xhat = xc * rstd
    w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w += 1.0
    y = xhat * w
    if HAS_B:
        y += tl.load(B + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y, mask=inside)
    if HAS_W1:
        w1 = tl.load(W1 + cols, mask=inside, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            w1 += 1.0
        y1 = xhat * w1
        if HAS_B1:
            y1 += tl.load(B1 + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(Y1 + row * stride_y1 + cols, y1, mask=inside)


@triton.jit
def norm_bwd(
    X, W, W1, DY, DY1, DRES_OUT, MEAN, RSTD, ROWSCALE,  # inputs (X: the normalised rows, as saved)
    DX, DX1, DRES, DW, DB, DW1, DB1,  # outputs: DW..DB1 one row of partial sums per program
    stride_x, stride_dy, stride_dy1, stride_dres_out, stride_dx, stride_dx1, stride_dres,
    rows, rows_per_program, N, threshold, SEED, keep_scale,
    RMS: tl.constexpr, HAS_W1: tl.constexpr, HAS_DRES_OUT: tl.constexpr, HAS_RES: tl.constexpr,
    HAS_X1: tl.constexpr, HAS_ROWSCALE: tl.constexpr, DROPOUT: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < N
    w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w += 1.0
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    if HAS_W1:
        w1 = tl.load(W1 + cols, mask=inside, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            w1 += 1.0
        dw1 = tl.zeros((BLOCK,), dtype=tl.float32)
        db1 = tl.zeros((BLOCK,), dtype=tl.float32)
    first = program * rows_per_program
    last = tl.minimum(first + rows_per_program, rows)
    for r in range(first, last):
        row = tl.cast(r, tl.int64)
        x = tl.load(X + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        if RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(inside, (x - tl.load(MEAN + row)) * rstd, 0.0)
        dy = tl.load(DY + row * stride_dy + cols, mask=inside, other=0.0).to(tl.float32)
        dw += dy * xhat
        db += dy
        g = dy * w
        if HAS_W1:
            dy1 = tl.load(DY1 + row * stride_dy1 + cols, mask=inside, other=0.0).to(tl.float32)
            dw1 += dy1 * xhat
            db1 += dy1
            g += dy1 * w1
        if RMS:
            dx = (g - xhat * (tl.sum(xhat * g, axis=0) / N)) * rstd
        else:
            dx = (g - xhat * (tl.sum(xhat * g, axis=0) / N) - tl.sum(g, axis=0) / N) * rstd
        if HAS_DRES_OUT:
            dx += tl.load(DRES_OUT + row * stride_dres_out + cols, mask=inside, other=0.0).to(tl.float32)
        if HAS_RES:
            tl.store(DRES + row * stride_dres + cols, dx, mask=inside)
        if DROPOUT:
            bits, bits1, _, _ = tl.randint4x(tl.load(SEED), row * N + cols)
        if HAS_X1:
            dx1 = dx
            if DROPOUT:
                dx1 = tl.where(_keep(bits1, threshold), dx1 * keep_scale, 0.0)
            tl.store(DX1 + row * stride_dx1 + cols, dx1, mask=inside)
        if DROPOUT:
            dx = tl.where(_keep(bits, threshold), dx * keep_scale, 0.0)
        if HAS_ROWSCALE:
            dx *= tl.load(ROWSCALE + row).to(tl.float32)
        tl.store(DX + row * stride_dx + cols, dx, mask=inside)
    tl.store(DW + program * N + cols, dw, mask=inside)
    tl.store(DB + program * N + cols, db, mask=inside)
    if HAS_W1:
        tl.store(DW1 + program * N + cols, dw1, mask=inside)
        tl.store(DB1 + program * N + cols, db1, mask=inside)


@triton.jit
def xent_fwd(
    LOGITS, LABELS, LSE, SUM, PICKED,  # per row: the log-sum-exp, the sum and the label's entry of scale * logits
    stride, n, first_class, scale, ignore_index,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    total = tl.zeros((), tl.float32)
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(base + cols, mask=cols < n, other=float("-inf")).to(tl.float32) * scale
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
        total += tl.sum(tl.where(cols < n, z, 0.0), axis=0)
    tl.store(LSE + row, m + tl.log(s))
    tl.store(SUM + row, total)
    label = tl.load(LABELS + row).to(tl.int64) - first_class
    inside = (label >= 0) & (label < n) & (label + first_class != ignore_index)
    picked = tl.load(base + tl.where(inside, label, 0)).to(tl.float32) * scale
    tl.store(PICKED + row, tl.where(inside, picked, 0.0))


@triton.jit
def xent_bwd(
    LOGITS, LABELS, LSE, DLOSS, DLOGITS,
    stride, stride_d, n, first_class, total_classes, scale, smoothing, lse_square_scale, ignore_index,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n
    label = tl.load(LABELS + row).to(tl.int64)
    dloss = tl.where(label == ignore_index, 0.0, tl.load(DLOSS + row).to(tl.float32))
    lse = tl.load(LSE + row)
    z = tl.load(LOGITS + row * stride + cols, mask=inside, other=0.0).to(tl.float32) * scale
    p = tl.exp(z - lse) * (1.0 + 2.0 * lse_square_scale * lse)
    p -= smoothing / total_classes
    p = tl.where(cols == label - first_class, p - (1.0 - smoothing), p)
    tl.store(DLOGITS + row * stride_d + cols, p * (dloss * scale), mask=inside)


@triton.jit
def rotary(
    X, OUT, COS, SIN, POS, OFFSETS,  # X, OUT: (tokens, heads, headdim) with strides; COS, SIN: (rows, half)
    stride_xt, stride_xh, stride_ot, stride_oh, stride_cs, heads, headdim, half, table_rows, seqlen, offset,
    GIVEN_POS: tl.constexpr, HAS_OFFSETS: tl.constexpr, INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr,
    COPY_TAIL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_TAIL: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    k = tl.arange(0, BLOCK_K)
    if GIVEN_POS:  # each token's position, computed by the caller (variable-length batches)
        pos = tl.load(POS + token)
    else:  # token = sequence * seqlen + index, at index + the sequence's offset
        sequence = token // seqlen
        pos = token - sequence * seqlen + offset
        if HAS_OFFSETS:
            pos += tl.load(OFFSETS + sequence)
    inside = pos < table_rows
    row = tl.where(inside, pos, 0)
    c = tl.load(COS + row * stride_cs + k, mask=k < half, other=1.0).to(tl.float32)
    s = tl.load(SIN + row * stride_cs + k, mask=k < half, other=0.0).to(tl.float32)
    c = tl.where(inside, c, 1.0)
    s = tl.where(inside, s, 0.0)
    if CONJUGATE:
        s = -s
    heads_in = (h < heads)[:, None]
    both = heads_in & (k < half)[None, :]
    x_row = X + token * stride_xt + h[:, None] * stride_xh
    o_row = OUT + token * stride_ot + h[:, None] * stride_oh
    if INTERLEAVED:
        first, second = 2 * k[None, :], 2 * k[None, :] + 1
    else:
        first, second = k[None, :], k[None, :] + half
    x1 = tl.load(x_row + first, mask=both, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + second, mask=both, other=0.0).to(tl.float32)
    tl.store(o_row + first, x1 * c[None, :] - x2 * s[None, :], mask=both)
    tl.store(o_row + second, x2 * c[None, :] + x1 * s[None, :], mask=both)
    if COPY_TAIL:  # the features past rotary_dim, unchanged
        t = 2 * half + tl.arange(0, BLOCK_TAIL)[None, :]
        tail = heads_in & (t < headdim)
        tl.store(o_row + t, tl.load(x_row + t, mask=tail, other=0.0), mask=tail)
