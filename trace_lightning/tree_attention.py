"""Attention over a packed tree (``tree_packing``): a token sees its ancestors' tokens and the
earlier tokens of its own node, nothing else.

Three ways to run it, chosen by the policy's ``attn_implementation`` (``--model.attention``):

- ``tree_sdpa`` (registered here with transformers' ``AttentionInterface``; the default off
  CUDA): each node's queries attend the keys of its own root path, gathered, in one SDPA
  call per node. The work is what the tree needs: a dense mask over a packed row would pay
  for every (query, key) pair of the row, ``T^2``, where the per-leaf update pays ``L^2 / 2``
  per leaf with causal kernels (a tree of 1,600 tokens over leaves of 400: 4x the attention
  of its leaves, not less). A micro-batch without a tree plan (per-leaf rows) runs plain SDPA,
  unchanged.
- ``flex_attention`` (the default on CUDA with tree packing): FlexAttention with a block mask
  built from ``subtree_end``; its block sparsity skips the keys outside a query block's
  ancestors.
- ``sdpa`` / ``eager``: the dense ``(B, 1, T, T)`` mask (the reference the tests compare with).

In the layout's terms, query ``i`` sees key ``j`` iff ``j <= i < subtree_end[j]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

TREE_SDPA = "tree_sdpa"

# (row, first query, end of queries, key indices (P,), mask (Q, P)): one node of a packed row
NodePlan = tuple[int, int, int, torch.Tensor, torch.Tensor]


def node_plan(rows: Sequence[Sequence[tuple[int, int, list[int]]]]) -> list[NodePlan]:
    """The ``tree_sdpa`` plan of packed rows.

    Args:
        rows: per row, its nodes in layout order, each ``(start, stop, path)``: the node's
            own tokens ``[start, stop)`` and the indices of its root path's tokens (its
            ancestors' and its own, in order; the own ones last).

    A node's query ``k`` (its ``k``-th token) sees the path's first ``P - Q + k + 1`` keys.
    """
    plan = []
    for b, nodes in enumerate(rows):
        for start, stop, path in nodes:
            q, p = stop - start, len(path)
            if not q:
                continue
            mask = (torch.arange(p)[None, :]
                    <= torch.arange(p - q, p)[:, None])  # (Q, P): causal, offset by ancestors
            plan.append((b, start, stop, torch.tensor(path, dtype=torch.long), mask))
    return plan


def tree_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, attention_mask: torch.Tensor | None,
                        dropout: float = 0.0, scaling: float | None = None,
                        tree_nodes: list[NodePlan] | None = None, **kwargs):
    """transformers' attention interface: ``query (B, H, T, D)``, ``key`` / ``value``
    ``(B, Hkv, T, D)`` -> ``(B, T, H, D)``. With ``tree_nodes`` (a packed micro-batch) each
    node attends its own path; otherwise plain SDPA with ``attention_mask``."""
    if tree_nodes is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    b, h, t, d = query.shape
    key = repeat_kv(key, h // key.shape[1])  # (B, H, T, D)
    value = repeat_kv(value, h // value.shape[1])  # (B, H, T, D)
    rows: list[list[torch.Tensor]] = [[] for _ in range(b)]
    filled = [0] * b
    for row, start, stop, path, mask in tree_nodes:
        assert start == filled[row], "nodes must cover each row in layout order"
        rows[row].append(F.scaled_dot_product_attention(
            query[row:row + 1, :, start:stop],  # (1, H, Q, D)
            key[row:row + 1, :, path], value[row:row + 1, :, path],  # (1, H, P, D)
            attn_mask=mask, dropout_p=dropout if module.training else 0.0,
            scale=scaling))  # (1, H, Q, D)
        filled[row] = stop
    for row in range(b):  # padding after the row's last node: never read
        if filled[row] < t:
            rows[row].append(query.new_zeros(1, h, t - filled[row], d))
    out = torch.cat([torch.cat(r, dim=2) for r in rows])  # (B, H, T, D)
    return out.transpose(1, 2).contiguous(), None  # (B, T, H, D)


AttentionInterface.register(TREE_SDPA, tree_sdpa_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(TREE_SDPA, sdpa_mask)  # other callers' 2D masks


def tree_attention_mask(subtree_end: torch.Tensor) -> torch.Tensor:
    """``(B, 1, T, T)`` bool, True where query ``i`` may attend key ``j``:
    ``j <= i < subtree_end[j]``."""
    t = subtree_end.shape[-1]
    ar = torch.arange(t, device=subtree_end.device)
    causal = ar[None, :, None] >= ar[None, None, :]  # (1, T, T): q >= kv
    inside = ar[None, :, None] < subtree_end[:, None, :]  # (B, T, T): q < end[kv]
    return (causal & inside)[:, None]  # (B, 1, T, T)


def tree_block_mask(subtree_end: torch.Tensor):
    """The same mask as a FlexAttention ``BlockMask`` (its sparsity skips whole blocks of
    keys outside a query block's ancestors)."""
    from torch.nn.attention.flex_attention import create_block_mask

    end = subtree_end

    def mask_mod(b, h, q, kv):
        return (kv <= q) & (q < end[b, kv])

    b, t = end.shape
    return create_block_mask(mask_mod, B=b, H=None, Q_LEN=t, KV_LEN=t, device=end.device)


def attention_inputs(model, mb: dict) -> dict:
    """The forward's extra arguments for a micro-batch: a packed one's ``position_ids`` and
    its tree in the form the model's attention takes (``tree_sdpa``: the node plan;
    ``flex_attention``: a ``BlockMask``; ``sdpa``: a boolean 4D mask; ``eager``: an additive
    float mask); none for a per-leaf one (causal attention, right padding never seen)."""
    if "subtree_end" not in mb:
        return {}
    impl = model.config._attn_implementation
    end = mb["subtree_end"]
    if impl == TREE_SDPA:
        return {"position_ids": mb["position_ids"], "tree_nodes": mb["tree_nodes"]}
    if impl == "flex_attention":
        mask = tree_block_mask(end)
    elif impl == "eager":
        allowed = tree_attention_mask(end)
        dtype = next(model.parameters()).dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=end.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)
    else:
        mask = tree_attention_mask(end)
    return {"position_ids": mb["position_ids"], "attention_mask": mask}
