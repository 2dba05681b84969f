"""The stated cost model of one broadcast of `num_bytes` from one source to `num_receivers` ranks.

Two algorithms, as the libraries implement them (alpha = per-message latency, B = one rank's link bandwidth):

- **binomial** (gloo; what torch's ProcessGroupGloo broadcast runs: `AsyncBroadcastWork` calls `gloo::broadcast`,
  gloo/broadcast.cc): ranks are renumbered so the root is 0; in round i (of ceil(log2 p), p = receivers + 1) every
  rank that already holds the buffer sends the *whole* buffer to the rank whose number differs in bit i. A receiver
  waits for the whole buffer before it forwards it (store and forward, no pipelining inside a call), while a
  sender queues its sends without waiting for them, so the root's ceil(log2 p) whole-buffer sends run at once:

      t_binomial(S, p) = ceil(log2 p) * S / B + depth(p) * alpha     (network: the root's NIC carries one
                                                                       whole copy per round)
      t_binomial(S, p) = depth(p) * (S / B + alpha)                   (loopback, `shares_nic=False`: no NIC is
                                                                       shared, the longest chain of hops bounds it)

  where depth(p) = the most store-and-forward hops to any rank = the largest popcount of the ranks 1..p-1
  (0 -> 1 -> 3 -> 7 ...), never more than ceil(log2 p). A bucketed sync pays the call once per bucket.
- **ring** (NCCL; its broadcast is a pipelined chain along a ring): the buffer moves in chunks, each rank forwards
  chunk k while receiving chunk k+1, so every link carries S once and the pipeline fills in p - 2 chunk steps;
  nccl-tests' doc/PERFORMANCE.md gives broadcast's bus bandwidth = algorithm bandwidth (t = S / B, the root's link
  being the bottleneck):

      t_ring(S, p) = alpha * (p - 1) + (S + (p - 2) * chunk) / B      (chunk = 512 KiB: NCCL's 4 MiB buffer / 8 steps)

Assumptions: one source; every receiver gets every byte (an engine rank receives the whole bucket, as SGLang's
`update_weights_from_distributed` does, and keeps its shard); links are full duplex and uncontended, with the
same B for every rank (the slowest hop bounds a chain); no switch or NIC oversubscription; receivers are ready
when the call starts.
"""

from __future__ import annotations

import math
from enum import Enum

__all__: list[str] = []  # nothing here is imported from outside miles_sync.sizing

NCCL_CHUNK_BYTES = 512 * 1024


class BroadcastAlgorithm(str, Enum):
    BINOMIAL = "binomial"  # gloo
    RING = "ring"  # NCCL


def broadcast_seconds(
    num_bytes: float,
    *,
    num_receivers: int,
    link_gbps: float,
    algorithm: BroadcastAlgorithm,
    latency_s: float = 0.0,
    chunk_bytes: int = NCCL_CHUNK_BYTES,
    shares_nic: bool = True,
) -> float:
    """Wall seconds until every one of `num_receivers` ranks holds `num_bytes` sent by one source, over links of
    `link_gbps` GB/s (10^9 bytes/s) each. Zero receivers cost nothing. `shares_nic=False`: the source's concurrent
    sends do not share one link (loopback), which only the binomial algorithm has."""
    if num_receivers < 0 or link_gbps <= 0 or num_bytes < 0:
        raise ValueError(f"need num_receivers >= 0, link_gbps > 0, num_bytes >= 0; got {num_receivers}, {link_gbps}")
    if num_receivers == 0:
        return 0.0
    per_byte = 1.0 / (link_gbps * 1e9)
    p = num_receivers + 1
    if algorithm is BroadcastAlgorithm.BINOMIAL:
        depth = binomial_depth(p)
        rounds = math.ceil(math.log2(p)) if shares_nic else depth
        return rounds * num_bytes * per_byte + depth * latency_s
    return latency_s * (p - 1) + (num_bytes + (p - 2) * chunk_bytes) * per_byte


def binomial_depth(num_ranks: int) -> int:
    """Store-and-forward hops from the root to the farthest rank of gloo's binomial tree over `num_ranks` ranks."""
    return max((bin(r).count("1") for r in range(1, num_ranks)), default=0)
