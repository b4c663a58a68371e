"""Attention over a packed tree (``tree_packing``): a token sees its ancestors' tokens and the
earlier tokens of its own node, nothing else.

Three ways to run it, chosen by the policy's ``attn_implementation`` (``--model.attention``):

- ``tree_sdpa`` (registered here with transformers' ``AttentionInterface``; the default off
  CUDA): each node's queries attend the keys of its own root path, gathered; nodes of
  similar path lengths share one batched SDPA call. The work is what the tree needs: a dense mask over a packed row would pay
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

def node_plan(rows: Sequence[Sequence[tuple[int, int, list[int]]]], width: int,
              waste: float = 1.25) -> dict:
    """The ``tree_sdpa`` plan of packed rows of ``width`` tokens.

    Args:
        rows: per row, its nodes in layout order, each ``(start, stop, path)``: the node's
            own tokens ``[start, stop)`` and the indices of its root path's tokens (its
            ancestors' and its own, in order, own ones last).
        width: the rows' length (padding after the last node).
        waste: most padded (query, key) pairs of a bucket over its real ones.

    Nodes are sorted by path length and bucketed, each bucket one batched SDPA call with its
    nodes padded to its longest query and path. Indices are into the rows flattened to
    ``R * width``. Returns a dict of per-bucket lists ``q_index`` ``(n, Q)``, ``k_index``
    ``(n, P)``, ``masks`` ``(n, 1, Q, P)`` (node query ``k`` sees its path's first
    ``P_node - Q_node + k + 1`` keys; a padding query sees key 0 alone, and is dropped),
    ``valid`` (the real queries' positions in ``n * Q``), and ``inverse`` ``(R * width,)``:
    where each token's output is among the buckets' real outputs concatenated (padding
    tokens: one zero row appended after them).
    """
    nodes = []  # (path_len, queries, flat query indices, flat key indices)
    for b, row in enumerate(rows):
        base = b * width
        for start, stop, path in row:
            if stop > start:
                nodes.append((len(path), stop - start, list(range(base + start, base + stop)),
                              [base + j for j in path]))
    nodes.sort(key=lambda n: (n[0], n[1]))
    buckets: list[list[tuple]] = []
    real = 0
    for n in nodes:
        if buckets:
            b = buckets[-1]
            qm, pm = max(n[1], max(x[1] for x in b)), n[0]  # sorted: n has the longest path
            if (len(b) + 1) * qm * pm <= waste * (real + n[0] * n[1]):
                b.append(n)
                real += n[0] * n[1]
                continue
        buckets.append([n])
        real = n[0] * n[1]
    plan = {"q_index": [], "k_index": [], "masks": [], "valid": []}
    order: list[int] = []  # flat token index of each real output, in bucket order
    for b in buckets:
        qm, pm = max(n[1] for n in b), max(n[0] for n in b)
        qi = torch.zeros(len(b), qm, dtype=torch.long)  # (n, Q)
        ki = torch.zeros(len(b), pm, dtype=torch.long)  # (n, P)
        mask = torch.zeros(len(b), 1, qm, pm, dtype=torch.bool)  # (n, 1, Q, P)
        mask[:, 0, :, 0] = True  # padding queries see key 0 (dropped)
        valid = []
        for i, (p, q, qs, ks) in enumerate(b):
            qi[i, :q] = torch.tensor(qs)
            ki[i, :p] = torch.tensor(ks)
            mask[i, 0, :q, :p] = torch.arange(p)[None, :] <= torch.arange(p - q, p)[:, None]
            valid += range(i * qm, i * qm + q)
            order += qs
        plan["q_index"].append(qi)
        plan["k_index"].append(ki)
        plan["masks"].append(mask)
        plan["valid"].append(torch.tensor(valid, dtype=torch.long))
    plan["q_flat"] = torch.cat([q.reshape(-1) for q in plan["q_index"]])  # (sum n Q,)
    plan["k_flat"] = torch.cat([k.reshape(-1) for k in plan["k_index"]])  # (sum n P,)
    plan["q_sizes"] = [q.numel() for q in plan["q_index"]]
    plan["k_sizes"] = [k.numel() for k in plan["k_index"]]
    inverse = torch.full((len(rows) * width,), len(order), dtype=torch.long)  # the zero row
    inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    plan["inverse"] = inverse  # (R * width,)
    return plan


def tree_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, attention_mask: torch.Tensor | None,
                        dropout: float = 0.0, scaling: float | None = None,
                        tree_nodes: dict | None = None, **kwargs):
    """transformers' attention interface: ``query (B, H, T, D)``, ``key`` / ``value``
    ``(B, Hkv, T, D)`` -> ``(B, T, H, D)``. With ``tree_nodes`` (a packed micro-batch,
    ``node_plan``) each node attends its own path, nodes batched by path length; otherwise
    plain SDPA with ``attention_mask``.

    The queries, keys and values of all buckets are each one ``index_select`` of the
    flattened tokens (its backward one ``index_add``), and each bucket is one SDPA call."""
    if tree_nodes is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    plan = tree_nodes
    b, h, t, d = query.shape
    qf = query.transpose(1, 2).reshape(b * t, h, d)  # (BT, H, D)
    kf = repeat_kv(key, h // key.shape[1]).transpose(1, 2).reshape(b * t, h, d)  # (BT, H, D)
    vf = repeat_kv(value, h // value.shape[1]).transpose(1, 2).reshape(b * t, h, d)
    p = dropout if module.training else 0.0
    # one gather each for every bucket's queries, keys and values (one scatter each back)
    q_all = qf.index_select(0, plan["q_flat"]).split(plan["q_sizes"])  # per bucket (nQ,H,D)
    k_all = kf.index_select(0, plan["k_flat"]).split(plan["k_sizes"])  # per bucket (nP,H,D)
    v_all = vf.index_select(0, plan["k_flat"]).split(plan["k_sizes"])
    outs = []
    for q, k, v, qi, ki, mask, valid in zip(q_all, k_all, v_all, plan["q_index"],
                                            plan["k_index"], plan["masks"], plan["valid"]):
        n, qm = qi.shape
        pm = ki.shape[1]
        o = F.scaled_dot_product_attention(
            q.view(n, qm, h, d).transpose(1, 2), k.view(n, pm, h, d).transpose(1, 2),
            v.view(n, pm, h, d).transpose(1, 2), attn_mask=mask, dropout_p=p,
            scale=scaling)  # (n, H, Q, D)
        outs.append(o.transpose(1, 2).reshape(n * qm, h, d).index_select(0, valid))
    outs.append(query.new_zeros(1, h, d))  # what padding tokens get (never read)
    out = torch.cat(outs).index_select(0, plan["inverse"])  # (BT, H, D)
    return out.view(b, t, h, d), None  # (B, T, H, D)


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
