"""Naive per-token recurrences: the test oracles of the chunked Mamba-2 and Gated DeltaNet paths.

Written from the defining recurrences, one sample (``cu_seqlens`` segment) at a time with a
fresh zero state, one token at a time, sharing no code with the chunked forms. Slow: tests and
small checks only.
"""

from __future__ import annotations

import torch

__all__ = ["conv1d_naive", "ssd_naive", "gated_delta_naive"]


def _spans(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    cu = cu_seqlens.tolist()
    return list(zip(cu[:-1], cu[1:]))


def conv1d_naive(x_TC: torch.Tensor, w_CK: torch.Tensor, bias_C: torch.Tensor | None, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv, tap by tap: y_t = sum_k w[:, k] x_{t-K+1+k}, zero before the sample."""
    k = w_CK.shape[1]
    rows = []
    for start, end in _spans(cu_seqlens):
        for t in range(start, end):
            acc = torch.zeros_like(x_TC[0]) if bias_C is None else bias_C.to(x_TC.dtype).clone()
            for j in range(k):
                src = t - (k - 1) + j
                if src >= start:
                    acc = acc + w_CK[:, j] * x_TC[src]
            rows.append(acc)
    return torch.stack(rows) if rows else x_TC.new_zeros(x_TC.shape)


def ssd_naive(
    x_THP: torch.Tensor, dt_TH: torch.Tensor, A_H: torch.Tensor, B_TGN: torch.Tensor, C_TGN: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> torch.Tensor:
    """Mamba-2's SSM, token by token (without the D skip).

        h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T        (per head: h is [P, N])
        y_t = h_t C_t

    Head h reads B and C of group ``h // (H / G)``.
    """
    _, n_heads, p = x_THP.shape
    n_groups, n = B_TGN.shape[1:]
    group_of_head = torch.arange(n_heads, device=x_THP.device) // (n_heads // n_groups)
    y = []
    for start, end in _spans(cu_seqlens):
        h_HPN = x_THP.new_zeros(n_heads, p, n)
        for t in range(start, end):
            b_HN, c_HN = B_TGN[t, group_of_head], C_TGN[t, group_of_head]
            decay_H = torch.exp(dt_TH[t] * A_H)
            h_HPN = decay_H[:, None, None] * h_HPN + (dt_TH[t][:, None] * x_THP[t])[:, :, None] * b_HN[:, None, :]
            y.append(torch.einsum("hpn,hn->hp", h_HPN, c_HN))
    return torch.stack(y) if y else x_THP.new_zeros(x_THP.shape)


def gated_delta_naive(
    q_THK: torch.Tensor, k_THK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor, beta_TH: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> torch.Tensor:
    """The gated delta rule, token by token (q, k already normalised and scaled; heads matched).

        S <- exp(g_t) S                                  (per head: S is [K, V])
        S <- S + beta_t k_t (v_t - S^T k_t)^T
        o_t = S^T q_t
    """
    _, n_heads, dk = q_THK.shape
    dv = v_THV.shape[-1]
    out = []
    for start, end in _spans(cu_seqlens):
        s_HKV = q_THK.new_zeros(n_heads, dk, dv)
        for t in range(start, end):
            s_HKV = s_HKV * torch.exp(g_TH[t])[:, None, None]
            pred_HV = torch.einsum("hkv,hk->hv", s_HKV, k_THK[t])
            delta_HV = beta_TH[t][:, None] * (v_THV[t] - pred_HV)
            s_HKV = s_HKV + k_THK[t][:, :, None] * delta_HV[:, None, :]
            out.append(torch.einsum("hkv,hk->hv", s_HKV, q_THK[t]))
    return torch.stack(out) if out else v_THV.new_zeros(v_THV.shape)
