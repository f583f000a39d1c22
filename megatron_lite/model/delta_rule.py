"""The gated delta rule, the recurrence of a gated DeltaNet layer (docs/reference.md, "Gated DeltaNet"), in
float32: chunk by chunk for a sequence, token by token for a generation step.

Each value head keeps a state S (key width x value width). At each token, with decay g <= 0 (a log factor),
write strength beta in (0, 1), key k and value v:

    S <- exp(g) S                        forget
    S <- S + k (beta (v - S^T k))^T      the delta rule: write the part of v the state does not predict from k
    o  = S^T q

The chunked form processes C tokens at once. Within a chunk, with Gamma_i the decay summed from the chunk's
start to token i and S_0 the state before it, the written values u_i satisfy a unit lower-triangular system

    u_i + sum_{j<i} beta_i exp(Gamma_i - Gamma_j) (k_i . k_j) u_j = beta_i v_i - beta_i exp(Gamma_i) S_0^T k_i

so U = T^-1 (beta V) - T^-1 (beta exp(Gamma) K) S_0 (the "WY" form of the DeltaNet paper), solved once for all
chunks; then o_i = exp(Gamma_i) S_0^T q_i + sum_{j<=i} exp(Gamma_i - Gamma_j) (q_i . k_j) u_j, and the state
after the chunk is exp(Gamma_C) S_0 + sum_j exp(Gamma_C - Gamma_j) k_j u_j^T. Only the last step runs chunk
after chunk.

A position with beta 0 and decay 0 (and key 0) leaves the state as it is: the padding of the last chunk, and
the padding after a short document in ``document_rows``' rows, change nothing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dimension (the query and key heads of the gated DeltaNet)."""
    return x * torch.rsqrt(x.square().sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(query, key, value, decay, beta, initial_state=None, chunk_size: int = CHUNK_SIZE):
    """query, key [n, L, heads, dk] and value [n, L, heads, dv] (one head of each per value head), decay and
    beta [n, L, heads], float32; initial_state [n, heads, dk, dv] or None (zero). Returns the outputs [n, L,
    heads, dv] and the state after the last position."""
    n, length, heads, dk = key.shape
    pad = (-length) % chunk_size
    # [n, heads, chunks, C, d]: positions padded to whole chunks with zeros (which leave the state alone).
    query, key, value = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(1, 2).reshape(n, heads, -1, chunk_size, x.shape[-1])
                         for x in (query, key, value))
    decay, beta = (F.pad(x, (0, 0, 0, pad)).transpose(1, 2).reshape(n, heads, -1, chunk_size) for x in (decay, beta))
    gamma = decay.cumsum(dim=-1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=key.device).tril()
    # exp(Gamma_i - Gamma_j) for j <= i; the exponent is masked before exp (above the diagonal it is positive).
    pair_decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    key_beta = key * beta[..., None]
    system = (key_beta @ key.transpose(-1, -2)) * pair_decay  # T's strict lower part (the diagonal reads as 1)
    written = torch.linalg.solve_triangular(system, value * beta[..., None], upper=False, unitriangular=True)
    from_state = torch.linalg.solve_triangular(system, key_beta * gamma.exp()[..., None], upper=False,
                                               unitriangular=True)
    within = (query @ key.transpose(-1, -2)) * pair_decay
    query_decayed = query * gamma.exp()[..., None]
    key_to_end = key * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]
    state = (torch.zeros(n, heads, dk, value.shape[-1], dtype=value.dtype, device=value.device)
             if initial_state is None else initial_state.to(value.dtype))
    outputs = []
    for c in range(query.shape[2]):
        u = written[:, :, c] - from_state[:, :, c] @ state
        outputs.append(query_decayed[:, :, c] @ state + within[:, :, c] @ u)
        state = state * chunk_decay[:, :, c] + key_to_end[:, :, c].transpose(-1, -2) @ u
    output = torch.stack(outputs, dim=2).reshape(n, heads, -1, value.shape[-1])[:, :, :length]
    return output.transpose(1, 2), state


def recurrent_gated_delta_rule(query, key, value, decay, beta, initial_state=None):
    """The same recurrence token by token (a generation step's few tokens); arguments and results as
    ``chunk_gated_delta_rule``'s."""
    n, length, heads, dk = key.shape
    state = (torch.zeros(n, heads, dk, value.shape[-1], dtype=value.dtype, device=value.device)
             if initial_state is None else initial_state.to(value.dtype))
    outputs = []
    for t in range(length):
        state = state * decay[:, t].exp()[..., None, None]
        predicted = torch.einsum("nhkv,nhk->nhv", state, key[:, t])
        delta = (value[:, t] - predicted) * beta[:, t, :, None]
        state = state + key[:, t, :, :, None] * delta[:, :, None, :]
        outputs.append(torch.einsum("nhkv,nhk->nhv", state, query[:, t]))
    return torch.stack(outputs, dim=1), state
