"""--suite ops: the fused ops of cuteflash.layer_norm and cuteflash.cross_entropy beside the PyTorch composition they
replace, on the same GPU in the same run (milliseconds per call, forward and forward + backward)."""

from __future__ import annotations

from functools import partial

# (tokens, hidden) for the norms; (tokens, vocabulary) for the cross-entropy
NORM_SHAPES = [(16384, 4096), (16384, 8192), (65536, 1024)]
XENT_SHAPES = [(8192, 32000), (8192, 128256)]


def _fused_norm(x, residual, weight, bias, rms):
    from .layer_norm import layer_norm_fn

    return layer_norm_fn(x, weight, bias, residual=residual, prenorm=True, is_rms_norm=rms)


def _composed_norm(x, residual, weight, bias, rms):
    import torch.nn.functional as F

    total = x + residual
    if rms:
        return F.rms_norm(total, total.shape[-1:], weight, 1e-6), total
    return F.layer_norm(total, total.shape[-1:], weight, bias, 1e-6), total


def _norm_rows(args, time_ms) -> list[list[str]]:
    import torch

    rows = []
    for rms in (True, False):
        for tokens, hidden in NORM_SHAPES:
            dev = dict(device="cuda", dtype=torch.bfloat16)
            x, residual, dy = (torch.randn(tokens, hidden, **dev) for _ in range(3))
            weight = torch.rand(hidden, **dev) + 0.5
            bias = None if rms else torch.randn(hidden, **dev)
            inputs = (x, residual, weight, bias, rms)
            params = [t for t in inputs[:4] if t is not None]
            ours, composed = partial(_fused_norm, *inputs), partial(_composed_norm, *inputs)
            name = f"{'RMSNorm' if rms else 'LayerNorm'} + residual, {tokens} x {hidden}"
            rows.append([name, *_fwd_bwd(ours, composed, params, dy, args, time_ms)])
    return rows


def _fused_xent(logits, labels, smoothing, z):
    from .cross_entropy import cross_entropy_loss

    return cross_entropy_loss(logits, labels, label_smoothing=smoothing, lse_square_scale=z)[0]


def _composed_xent(logits, labels, smoothing, z):
    import torch
    import torch.nn.functional as F

    loss = F.cross_entropy(logits, labels, reduction="none", label_smoothing=smoothing)
    return loss + z * torch.logsumexp(logits.float(), -1).square() if z else loss


def _xent_rows(args, time_ms) -> list[list[str]]:
    import torch

    rows = []
    for smoothing, z in ((0.0, 0.0), (0.1, 1e-4)):
        for tokens, vocab in XENT_SHAPES:
            logits = torch.randn(tokens, vocab, device="cuda", dtype=torch.bfloat16)
            labels = torch.randint(0, vocab, (tokens,), device="cuda")
            dy = torch.randn(tokens, device="cuda")
            inputs = (logits, labels, smoothing, z)
            ours, composed = partial(_fused_xent, *inputs), partial(_composed_xent, *inputs)
            name = f"cross-entropy, {tokens} x {vocab}" + (f", smoothing {smoothing}, z-loss {z}" if z else "")
            rows.append([name, *_fwd_bwd(ours, composed, [logits], dy, args, time_ms)])
    return rows


def _rotary_rows(args, time_ms) -> list[list[str]]:
    import torch

    from . import rotary

    rows = []
    for batch, seqlen, heads, d in ((8, 4096, 32, 128), (1, 32768, 8, 64)):
        x = torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16)
        angles = torch.rand(seqlen, d // 2, device="cuda") * 6
        cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
        ours = partial(rotary.apply_rotary_emb, x, cos, sin)
        composed = partial(rotary._composed, x, cos, sin, False, False, 0, None)
        rows.append(
            [
                f"rotary, {batch}x{seqlen}x{heads}x{d}",
                *_fwd_bwd(ours, composed, [x], torch.randn_like(x), args, time_ms),
            ]
        )
    return rows


def _fwd_bwd(ours, composed, params, dy, args, time_ms) -> list[str]:
    """The forward and forward + backward milliseconds of both, and the speedups."""
    import torch

    for p in params:
        p.requires_grad_(True)

    def step(fn):
        out = fn()
        torch.autograd.grad(out[0] if isinstance(out, tuple) else out, params, dy)

    def forward(fn):
        with torch.no_grad():
            fn()

    times = []
    for fn in (ours, composed):
        times.append(time_ms([partial(forward, fn)], args.repeats))
        times.append(time_ms([partial(step, fn)], args.repeats))
    fwd, step_ms, cfwd, cstep = times
    return [f"{fwd:.3f}", f"{cfwd:.3f}", f"{cfwd / fwd:.2f}x"] + [
        f"{step_ms:.3f}",
        f"{cstep:.3f}",
        f"{cstep / step_ms:.2f}x",
    ]


def tables(args, time_ms) -> list[tuple[str, list[list[str]]]]:
    head = ["op, shape (bf16)", "fwd ms", "torch fwd ms", "x torch", "fwd+bwd ms", "torch fwd+bwd ms", "x torch"]
    norms = "Fused norms (prenorm, residual) beside x + residual then F.rms_norm / F.layer_norm"
    xent = "Cross-entropy beside F.cross_entropy (+ the z-loss composed)"
    rope = "Rotary embedding (apply_rotary_emb, GPT-NeoX halves) beside the same rotation in torch operations"
    return [
        (norms, [head, *_norm_rows(args, time_ms)]),
        (xent, [head, *_xent_rows(args, time_ms)]),
        (rope, [head, *_rotary_rows(args, time_ms)]),
    ]
