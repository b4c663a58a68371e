"""Attention over a packed tree (``tree_packing``): a token sees its ancestors' tokens and the
earlier tokens of its own node, nothing else.

Three ways to run it, chosen by the policy's ``attn_implementation`` (``--model.attention``):

- ``tree_sdpa`` (registered here with transformers' ``AttentionInterface``; the default off
  CUDA): each node's queries attend the keys of its own root path, gathered; nodes of
  similar path lengths share one batched SDPA call. The work is what the tree needs: a dense
  mask over a packed row would pay for every (query, key) pair of the row, ``T^2``, where the
  per-leaf update pays ``L^2 / 2`` per leaf with causal kernels, so a wide tree would cost
  more attention than its leaves. A micro-batch without a tree plan (per-leaf rows) runs
  plain SDPA, unchanged.
- ``flex_attention`` (the default on CUDA with tree packing): FlexAttention with a block mask
  built from ``subtree_end`` block by block (``tree_block_mask``); its block sparsity skips
  the keys outside a query block's ancestors.
- ``sdpa`` / ``eager``: the dense ``(B, 1, T, T)`` mask (the reference the tests compare with).

In the layout's terms, query ``i`` sees key ``j`` iff ``j <= i < subtree_end[j]``.

No ``(T, T)`` tensor on the tree paths: transformers builds an attention mask on every
forward from the inputs (from packed ``position_ids`` a dense ``(B, 1, T, T)`` one) unless it is
handed a prepared 4D one; ``tree_sdpa`` hands it ``mask_placeholder`` (no elements; the node
plan is the mask), ``flex_attention`` its ``BlockMask``, whose block tables are
``(B, T / 128, T / 128)``.
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


def additive_masks(plan: dict, dtype: torch.dtype) -> list[torch.Tensor]:
    """The plan's boolean masks as SDPA's additive ones, ``(n, 1, Q, P)`` each (0 where seen,
    -inf elsewhere), built on a forward's first layer and kept in the plan for the others:
    SDPA would convert a boolean mask anew in every layer and keep each layer's copy for
    its backward (one copy per layer instead of one in all)."""
    key = f"additive_masks_{dtype}"
    if key not in plan:
        plan[key] = [torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(
            ~m, float("-inf")) for m in plan["masks"]]
    return plan[key]


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
        if attention_mask is not None and attention_mask.numel() == 0:
            raise ValueError("a tree_sdpa forward got the tree's mask placeholder without its "
                             "node plan; pass both (packing.attention.attention_inputs)")
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    plan = tree_nodes  # the mask: attention_mask is the placeholder (or None), never read
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
                                            plan["k_index"], additive_masks(plan, query.dtype),
                                            plan["valid"]):
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
# Forwards without a tree (generation, per-leaf rows with a padding mask) get SDPA's masks;
# a tree forward passes mask_placeholder, which transformers takes as prepared.
ALL_MASK_ATTENTION_FUNCTIONS.register(TREE_SDPA, sdpa_mask)


def mask_placeholder(rows: int, device: torch.device | str) -> torch.Tensor:
    """``(R, 1, 0, 0)`` bool: a tree_sdpa forward's ``attention_mask``. transformers returns a
    4D mask as it is (``masking_utils._preprocess_mask_arguments``) instead of building a
    ``(R, 1, T, T)`` one from the packed ``position_ids``; it holds no elements, so a kernel
    that read it as a mask would fail on its shape, never attend to everything."""
    return torch.empty(rows, 1, 0, 0, dtype=torch.bool, device=device)


def tree_attention_mask(subtree_end: torch.Tensor) -> torch.Tensor:
    """``(B, 1, T, T)`` bool, True where query ``i`` may attend key ``j``:
    ``j <= i < subtree_end[j]``."""
    t = subtree_end.shape[-1]
    ar = torch.arange(t, device=subtree_end.device)
    causal = ar[None, :, None] >= ar[None, None, :]  # (1, T, T): q >= kv
    inside = ar[None, :, None] < subtree_end[:, None, :]  # (B, T, T): q < end[kv]
    return (causal & inside)[:, None]  # (B, 1, T, T)


def tree_block_mask(subtree_end: torch.Tensor, block_size: int = 128):
    """The same mask as a FlexAttention ``BlockMask``, built from ``subtree_end`` a block at
    a time: ``(B, T / bs, T / bs)`` block tables, no ``(T, T)`` mask (``create_block_mask``
    evaluates the mask at every pair first).

    For key block ``[k0, k1)`` and query block ``[q0, q1)`` (index ``qb``, ``kb``):

    - some query sees some key iff ``qb >= kb`` and ``max(end[k0:k1]) > q0``: key ``j``'s
      subtree reaches into the query block (on the diagonal, ``end[j] > j`` always holds);
    - every query sees every key iff ``qb > kb`` and ``min(end[k0:k1]) >= q1``, both blocks
      inside ``[0, T)``: FlexAttention skips ``mask_mod`` on these full blocks.

    ``subtree_end`` is ``(B, T)``; the mask_mod reads it padded to whole blocks (a padding
    key sees itself alone), so no index of a block's padding falls outside it.
    """
    from torch.nn.attention.flex_attention import BlockMask

    b, t = subtree_end.shape
    nb = -(-t // block_size)
    pad = nb * block_size - t
    ar = torch.arange(nb * block_size, device=subtree_end.device)  # (T',)
    end = torch.cat([subtree_end, (ar[t:] + 1).expand(b, pad)], dim=1)  # (B, T')
    real = torch.cat([subtree_end, subtree_end.new_zeros(b, pad)], dim=1)  # (B, T')
    blocks = real.view(b, nb, block_size)  # (B, nb, bs)
    max_end = blocks.amax(-1)  # (B, nb) per key block
    min_end = blocks.amin(-1)  # (B, nb); 0 for a block with padding: never full
    starts = torch.arange(nb, device=end.device) * block_size  # (nb,) q0 per query block
    qb = torch.arange(nb, device=end.device)[:, None]  # (nb, 1)
    kb = torch.arange(nb, device=end.device)[None, :]  # (1, nb)
    seen = (qb >= kb) & (max_end[:, None, :] > starts[None, :, None])  # (B, nbq, nbk)
    full = (qb > kb) & (min_end[:, None, :] >= (starts + block_size)[None, :, None])
    partial = seen & ~full  # (B, nbq, nbk)

    def table(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, 1, nbq)`` counts and ``(B, 1, nbq, nbk)`` key-block indices, set ones first
        in ascending order."""
        counts = flags.sum(-1, dtype=torch.int32)  # (B, nbq)
        order = torch.argsort((~flags).to(torch.int8), dim=-1, stable=True)  # (B, nbq, nbk)
        return counts[:, None], order.to(torch.int32)[:, None]

    def mask_mod(bi, h, q, kv):
        return (kv <= q) & (q < end[bi, kv])

    kv_num, kv_idx = table(partial)
    full_num, full_idx = table(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size,
                                    mask_mod=mask_mod, seq_lengths=(t, t))


def attention_inputs(model, mb: dict) -> dict:
    """The forward's extra arguments for a micro-batch: a packed one's ``position_ids`` and
    its tree in the form the model's attention takes (``tree_sdpa``: the node plan, and
    ``mask_placeholder`` so that transformers builds no mask;
    ``flex_attention``: a ``BlockMask``; ``sdpa``: a boolean 4D mask; ``eager``: an additive
    float mask); none for a per-leaf one (causal attention, right padding never seen)."""
    if "subtree_end" not in mb:
        return {}
    impl = model.config._attn_implementation
    end = mb["subtree_end"]
    if impl == TREE_SDPA:
        return {"position_ids": mb["position_ids"], "tree_nodes": mb["tree_nodes"],
                "attention_mask": mask_placeholder(end.shape[0], end.device)}
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
