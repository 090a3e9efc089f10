"""Token exchange between the ranks of an expert-parallel group (ep_size = p > 1).

Rank ``r`` of the group holds experts ``[r * E_local, (r + 1) * E_local)``. Every rank routes its
own tokens into a buffer ordered by global expert; the rows of the experts held by rank ``r`` are
sent to ``r`` with one all_to_all, the experts run on what arrived, and a second all_to_all sends
the results back into the sender's layout. Both go through :func:`dslab.comm.all_to_all_single`
(the comms logger sees them) inside :class:`AllToAll`, whose backward runs the inverse exchange,
so gradients of the tokens travel back to the rank that sent them and each expert's weight
gradient sums over every token of the group routed to it.

Two layouts:

- capacity (DeepSpeed's): a fixed ``[E, C, H]`` buffer exchanged with equal splits. Rank r
  receives ``[p, E_local, C, H]`` (source rank, local expert, slot) and reorders it to
  ``[E_local, p, C, H]`` so that each local expert's rows are contiguous for the grouped GEMM.
  Every rank of the group must feed the same number of tokens (so that C agrees), as in DeepSpeed.
- dropless: the per-expert counts are exchanged first (an int64 all_to_all of ``[p, E_local]``),
  then the variable rows with split sizes. The split sizes are host lists, so this path has one
  host sync per call (the only one of the layer); DeepSpeed instead pads every expert to the
  largest count of the group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dslab import comm


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 whose backward exchanges the gradient back.

    x [N, ...] -> [sum(output_splits) or N, ...]; the splits are host lists or None (equal).
    """

    @staticmethod
    def forward(ctx, group, x, output_splits, input_splits):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return _exchange(group, x, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        return None, AllToAll.apply(ctx.group, grad, ctx.input_splits, ctx.output_splits), None, None


def _exchange(group, x, output_splits, input_splits):
    x = x.contiguous()
    rows = x.shape[0] if output_splits is None else sum(output_splits)
    out = x.new_empty((rows, *x.shape[1:]))
    comm.all_to_all_single(out, x, output_split_sizes=output_splits, input_split_sizes=input_splits, group=group)
    return out


def dispatch_capacity(dispatched: torch.Tensor, group, ep_size: int, num_local_experts: int) -> torch.Tensor:
    """[E * C, H] (this rank's tokens, by global expert) -> [E_local * p * C, H] (this rank's
    experts' tokens from every rank of the group, by local expert, then source rank)."""
    hidden = dispatched.shape[-1]
    received = AllToAll.apply(group, dispatched, None, None)
    received = received.view(ep_size, num_local_experts, -1, hidden).transpose(0, 1)
    return received.reshape(-1, hidden)


def combine_capacity(expert_output: torch.Tensor, group, ep_size: int, num_local_experts: int) -> torch.Tensor:
    """The inverse of :func:`dispatch_capacity`: [E_local * p * C, H] -> [E * C, H]."""
    hidden = expert_output.shape[-1]
    by_source = expert_output.view(num_local_experts, ep_size, -1, hidden).transpose(0, 1).reshape(-1, hidden)
    return AllToAll.apply(group, by_source, None, None)


@dataclass
class DroplessPlan:
    """The sizes of one dropless exchange.

    send_splits / recv_splits: rows to / from each rank of the group (host ints);
    local_sizes: rows per local expert after the exchange (host ints); group_offsets
    [E_local + 1] int64 on the device; to_expert_major [R] int64: for each row of the
    expert-major buffer, its row in the received (source-major) buffer; to_source_major [R]
    int64, the inverse permutation.
    """

    send_splits: list[int]
    recv_splits: list[int]
    local_sizes: list[int]
    group_offsets: torch.Tensor
    to_expert_major: torch.Tensor
    to_source_major: torch.Tensor


def plan_dropless(counts: torch.Tensor, group, ep_size: int, num_local_experts: int) -> DroplessPlan:
    """Exchange this rank's per-expert row counts ``counts`` [E] int64 and plan the row exchange.

    One small all_to_all and one host sync (the split sizes must be host ints).
    """
    send_counts = counts.view(ep_size, num_local_experts).contiguous()
    recv_counts = _exchange(group, send_counts, None, None)  # [p source ranks, E_local]
    sizes = torch.cat([send_counts.sum(1), recv_counts.sum(1), recv_counts.sum(0)]).tolist()
    send_splits, recv_splits = sizes[:ep_size], sizes[ep_size:2 * ep_size]
    local_sizes = sizes[2 * ep_size:]
    total = sum(recv_splits)
    device = counts.device
    # received rows come source-major (segment s * E_local + j); the experts want expert-major
    source_major = recv_counts.reshape(-1)
    source_starts = torch.cumsum(source_major, 0) - source_major
    expert_major = recv_counts.t().reshape(-1)  # segment j * p + s
    expert_starts = (torch.cumsum(expert_major, 0) - expert_major).view(num_local_experts, ep_size)
    segment = torch.repeat_interleave(torch.arange(source_major.numel(), device=device), source_major,
                                      output_size=total)
    within = torch.arange(total, device=device) - source_starts[segment]
    destination = expert_starts[segment % num_local_experts, segment // num_local_experts] + within
    to_expert_major = torch.empty_like(destination)
    to_expert_major[destination] = torch.arange(total, device=device)
    per_expert = recv_counts.sum(0)
    group_offsets = torch.cat([per_expert.new_zeros(1), torch.cumsum(per_expert, 0)])
    return DroplessPlan(send_splits, recv_splits, local_sizes, group_offsets, to_expert_major, destination)


def dispatch_dropless(dispatched: torch.Tensor, plan: DroplessPlan, group) -> torch.Tensor:
    """This rank's rows by global expert [>= sum(send_splits), H] -> this rank's experts' rows,
    expert-major [sum(recv_splits), H]."""
    rows = sum(plan.send_splits)
    received = AllToAll.apply(group, dispatched[:rows], plan.recv_splits, plan.send_splits)
    return received.index_select(0, plan.to_expert_major)


def combine_dropless(expert_output: torch.Tensor, plan: DroplessPlan, group, num_rows: int) -> torch.Tensor:
    """The inverse of :func:`dispatch_dropless`, zero-padded to ``num_rows`` rows."""
    source_major = expert_output.index_select(0, plan.to_source_major)
    returned = AllToAll.apply(group, source_major, plan.send_splits, plan.recv_splits)
    if returned.shape[0] < num_rows:
        returned = torch.cat([returned, returned.new_zeros(num_rows - returned.shape[0], returned.shape[1])])
    return returned
