"""Zero-centred RMSNorm (optionally after the residual add), the GDN gated norm and the MLP activation: the torch
references, then the Triton kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from .triton_or_absent import tl, triton

from .config import DEFAULT, KernelConfig
from .launch import _pow2, pdl_options, rows_per_program, wait_for_previous_kernel


# Torch references


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * (1 + w), computed in fp32.
    weight None: (1 + w) is already folded into the projection that reads the norm (model/forward.py)."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        out = out * (1.0 + weight.float())
    return out.to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x (in the model dtype, as the reference does), then the zero-centred norm of the sum (weight
    None: folded into the next projection).

    Returns (normed, new residual). With residual None the input itself becomes the residual.
    """
    summed = x if residual is None else residual + x
    return rms_norm_reference(summed, weight, eps), summed


def gated_rms_norm_reference(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm with a plain weight: w * norm(o) * silu(z), normalised in fp32 over the last dim."""
    of = o.float()
    normed = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)).to(o.dtype)
    return ((weight * normed).float() * F.silu(z.float())).to(o.dtype)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """The MLP activation on a fused [gate | up] projection: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(gate_up.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# Triton kernels (same signatures, plus the launch configuration `cfg`)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_rows, n_cols, eps, HAS_RES: tl.constexpr,
                     HAS_W: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Zero-centred: out = norm(x) * (1 + w); without HAS_W, norm(x) (the weight folded into the next projection).
    ROWS rows a program."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    cmask = cols < n_cols
    mask = (rows < n_rows)[:, None] & cmask[None, :]
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :] + 1.0
    else:
        w = 1.0
    wait_for_previous_kernel(PDL)
    at = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(x_ptr + at, mask=mask, other=0.0)
    if HAS_RES:
        x = x + tl.load(res_ptr + at, mask=mask, other=0.0)  # in the model dtype, as HF does
        tl.store(res_out_ptr + at, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / n_cols + eps)
    tl.store(out_ptr + at, (xf * inv[:, None] * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rms_norm_launch(x2, res, weight, out, res_out, eps, has_res: bool, cfg: KernelConfig) -> None:
    n_rows, n_cols = x2.shape
    block = _pow2(n_cols)
    rows = rows_per_program(n_rows, block, x2.device)
    _rms_norm_kernel[(triton.cdiv(n_rows, rows),)](x2, res, x2 if weight is None else weight, out, res_out, n_rows,
                                                   n_cols, eps, HAS_RES=has_res, HAS_W=weight is not None,
                                                   ROWS=rows, BLOCK=block, **pdl_options(x2.device, cfg.pdl))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cfg: KernelConfig = DEFAULT) -> torch.Tensor:
    x2 = x.contiguous().view(-1, x.shape[-1])
    out = torch.empty_like(x2)
    _rms_norm_launch(x2, x2, weight, out, out, eps, False, cfg)
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
                 cfg: KernelConfig = DEFAULT):
    if residual is None:
        return rms_norm(x, weight, eps, cfg), x
    x2, r2 = x.contiguous().view(-1, x.shape[-1]), residual.contiguous().view(-1, x.shape[-1])
    out, summed = torch.empty_like(x2), torch.empty_like(x2)
    _rms_norm_launch(x2, r2, weight, out, summed, eps, True, cfg)
    return out.view(x.shape), summed.view(x.shape)


@triton.jit
def _gated_rms_norm_kernel(o_ptr, z_ptr, w_ptr, out_ptr, n_rows, n_cols, heads, z_row_stride, z_head_stride, eps,
                           ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # token * heads + head
    cols = tl.arange(0, BLOCK)
    cmask = cols < n_cols
    mask = (rows < n_rows)[:, None] & cmask[None, :]
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    wait_for_previous_kernel(PDL)
    o = tl.load(o_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    z_rows = z_ptr + (rows // heads) * z_row_stride + (rows % heads) * z_head_stride
    z = tl.load(z_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(o * o, axis=1) / n_cols + eps)
    normed = (o * inv[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded as the reference rounds
    y = (w * normed).to(out_ptr.dtype.element_ty).to(tl.float32) * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   cfg: KernelConfig = DEFAULT) -> torch.Tensor:
    """o [T, H, d] contiguous; z [T, H, d] may be a strided view (of the fused input projection)."""
    o2 = o.contiguous().view(-1, o.shape[-1])
    if z.stride(-1) != 1:
        z = z.contiguous()
    out = torch.empty_like(o2)
    n_rows, block = o2.shape[0], _pow2(o2.shape[1])
    rows = rows_per_program(n_rows, block, o.device)
    _gated_rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
        o2, z, weight, out, n_rows, o2.shape[1], o.shape[1], z.stride(0), z.stride(1), eps, ROWS=rows, BLOCK=block,
        **pdl_options(o.device, cfg.pdl))
    return out.view(o.shape)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inner, x_row_stride, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    g = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * x_row_stride + inner + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * inner + cols, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, cfg: KernelConfig = DEFAULT) -> torch.Tensor:
    T, two_i = gate_up.shape
    inner = two_i // 2
    out = torch.empty(T, inner, dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = 1024
    _silu_mul_kernel[(T, triton.cdiv(inner, BLOCK))](gate_up, out, inner, gate_up.stride(0), BLOCK=BLOCK,
                                                     **pdl_options(gate_up.device, cfg.pdl))
    return out
