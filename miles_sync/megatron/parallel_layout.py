"""The rules a trainer's parallel layout (tp x pp x dp, with ep x etp for the expert layers) must follow.

One pure function, shared by the trainer config and the export parity harness, so both refuse the same layouts
with the same words, before any process starts. The rules are megatron-core's (0.16,
`megatron/core/parallel_state.py` `initialize_model_parallel`; context parallelism is not used here, cp = 1):

- dense layers: `world_size % (tp * pp * cp) == 0`, and `data_parallel_size = world_size // (tp * pp * cp)`;
- expert layers: `world_size % (etp * ep * pp) == 0`, and `expert_data_parallel_size = world_size // (etp * ep * pp)`.
  With world_size = tp * pp * dp this is `(tp * dp) % (etp * ep) == 0`: the etp x ep expert grid is carved from
  the tp x dp ranks of one pipeline stage. `etp` defaults to `tp` there when not given.
- `num_moe_experts % ep == 0` (`transformer/moe/moe_layer.py`: every EP rank holds the same number of experts);
- `num_layers % pp == 0` (`transformer/transformer_block.py`, without uneven first/last stages).

Imports nothing beyond the standard library: the config layer imports it at start-up.
"""

from __future__ import annotations

import math

__all__ = ["parallel_layout_problems", "smallest_world_size"]


def parallel_layout_problems(
    *,
    tp: int,
    pp: int,
    ep: int = 1,
    etp: int | None = None,
    dp: int | None = None,
    world_size: int | None = None,
    num_layers: int | None = None,
    num_experts: int | None = None,
) -> list[str]:
    """Every way the layout breaks megatron-core's rules, each naming its factors and numbers; [] if valid.

    Give `dp`, `world_size` or both (both: world_size must equal tp*pp*dp; world_size alone: dp is derived as
    world_size // (tp*pp)). `etp` None means tp, megatron-core's default. `num_layers` and `num_experts` are model
    facts, checked when given (pass num_experts only for a model with experts). Factors below 1 are reported
    alone: the divisibility rules say nothing useful about them.
    """
    if dp is None and world_size is None:
        raise TypeError("parallel_layout_problems needs dp or world_size")
    sizes = {"tp": tp, "pp": pp, "ep": ep, "etp": etp, "dp": dp, "world_size": world_size}
    sizes |= {"num_layers": num_layers, "num_experts": num_experts}
    problems = [f"{name}={size} must be at least 1" for name, size in sizes.items() if size is not None and size < 1]
    if problems:
        return problems
    etp = tp if etp is None else etp
    model_parallel = tp * pp
    if dp is None:
        if world_size % model_parallel != 0:
            return [f"world_size={world_size} is not divisible by tp*pp={tp}*{pp}={model_parallel}"]
        dp = world_size // model_parallel
    elif world_size is not None and world_size != model_parallel * dp:
        problems.append(f"world_size={world_size} must equal tp*pp*dp={tp}*{pp}*{dp}={model_parallel * dp}")
    expert_grid = etp * ep
    if (tp * dp) % expert_grid != 0:
        problems.append(
            f"etp*ep={etp}*{ep}={expert_grid} does not divide tp*dp={tp}*{dp}={tp * dp} (the expert layers need "
            f"world_size={tp * pp * dp} divisible by etp*ep*pp={expert_grid * pp})"
        )
    if num_experts is not None and num_experts % ep != 0:
        problems.append(f"num_experts={num_experts} is not divisible by ep={ep}")
    if num_layers is not None and num_layers % pp != 0:
        problems.append(f"num_layers={num_layers} is not divisible by pp={pp}")
    return problems


def smallest_world_size(*, tp: int, pp: int, ep: int = 1, etp: int | None = None) -> int:
    """The fewest ranks that hold the layout: pp * lcm(tp, etp*ep), so dp = lcm(tp, etp*ep) / tp.

    With etp = tp (the default) that is tp*pp*ep. Factors below 1 count as 1 here; parallel_layout_problems
    names them.
    """
    tp, pp, ep = max(tp, 1), max(pp, 1), max(ep, 1)
    etp = tp if etp is None else max(etp, 1)
    return pp * math.lcm(tp, etp * ep)
