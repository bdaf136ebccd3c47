"""All-to-all (seed 000: "GPU i sends its j-th chunk to GPU j ... a matrix transpose across
the network"; Thakur, Rabenseifner and Gropp 2005, sec. 4.5).

- pairwise exchange (served as `ring`, the cost model's name for it): p-1 rounds; in round
  s member i sends its block for i+s and receives the block from i-s, so every member sends
  and receives exactly one block per round. Blocks may be uneven (`out_bounds` and
  `in_bounds` are per-peer element offsets).
- Bruck's algorithm (served as `recursive_doubling`): ceil(lg p) rounds; in round k a
  member forwards every block whose (rotated) index has bit k set to member i + 2^k, so
  blocks hop towards their destination in binary. About n/2 bytes per round: fewer rounds,
  more bytes -- the short-message choice. Needs equal blocks (intermediate members must know
  the sizes of blocks passing through).
"""

from __future__ import annotations

import torch

from shardtrain.comm.p2p import Team, part


def pairwise(team: Team, out: torch.Tensor, inp: torch.Tensor, out_bounds: list[int],
             in_bounds: list[int]) -> None:
    p, i = team.size, team.index
    part(out, out_bounds, i).copy_(part(inp, in_bounds, i))
    for s in range(1, p):
        to, frm = (i + s) % p, (i - s) % p
        team.exchange(sends=[(to, part(inp, in_bounds, to))],
                      recvs=[(frm, part(out, out_bounds, frm))])


def bruck(team: Team, out: torch.Tensor, inp: torch.Tensor, out_bounds: list[int],
          in_bounds: list[int]) -> None:
    p, i = team.size, team.index
    m = inp.numel() // p
    if in_bounds != [j * m for j in range(p + 1)] or out_bounds != in_bounds:
        raise ValueError("Bruck's all_to_all (recursive_doubling) needs equal splits; use "
                         "ring (pairwise) or native for uneven ones")
    # Round k: distance d = 2^k, the rows whose index has bit k set.
    rounds = [(d, [j for j in range(p) if j & d]) for d in (1 << k for k in range(p.bit_length()))
              if d < p]
    work = team.scratch("bruck.work", p * m, inp.dtype).view(p, m)
    work[:p - i] = inp.view(p, m)[i:]  # [p, m]: row j is the block for member i + j
    work[p - i:] = inp.view(p, m)[:i]
    widest = max(len(picked) for _, picked in rounds)
    outgoing = team.scratch("bruck.out", widest * m, inp.dtype)
    incoming = team.scratch("bruck.in", widest * m, inp.dtype)
    for d, picked in rounds:
        index, rows = torch.tensor(picked, device=inp.device), len(picked)
        sent = torch.index_select(work, 0, index, out=outgoing[:rows * m].view(rows, m))
        got = incoming[:rows * m].view(rows, m)
        team.exchange(sends=[((i + d) % p, sent)], recvs=[((i - d) % p, got)])
        work.index_copy_(0, index, got)
    # Row j now holds the block member i - j sent to this member.
    order = torch.tensor([(i - j) % p for j in range(p)], device=inp.device)
    out.view(p, m).index_copy_(0, order, work)
