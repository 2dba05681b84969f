"""Published weight-update times of comparable systems, printed next to a projection so a user sees where
miles_sync's design sits. Only figures read in a public source; each says where.

Sources:
- MILES_P2P_DOC: Miles documentation, "P2P Weight Transfer", profiling tables (radixark/miles,
  docs/advanced/p2p-weight-transfer.md): H100-80GB clusters, `update_weights_implementation` steady-state average
  of steps 3-14, `--check-weight-update-equal` on; NCCL = the default broadcast mode, RDMA = `p2p` mode.
- MILES_755: Miles RFC "Introduce Update Weight from RDMA P2P transfer" (github.com/radixark/miles/issues/755):
  "a reduction from 43s to 7s for the 1T parameter Kimi K2 model ... on H100 clusters with IB".
- CKPT_ENGINE: MoonshotAI checkpoint-engine README, Benchmark table (as shipped in checkpoint-engine 0.1.3):
  vLLM v0.10.2rc1 engines, `examples/update.py`; "updating our Kimi-K2 model (1 Trillion parameters) across
  thousands of GPUs takes about 20s".
"""

from __future__ import annotations

from dataclasses import dataclass

__all__: list[str] = []  # nothing here is imported from outside miles_sync.sizing

MILES_P2P_DOC = "radixark/miles docs/advanced/p2p-weight-transfer.md"
MILES_755 = "github.com/radixark/miles/issues/755"
CKPT_ENGINE = "MoonshotAI/checkpoint-engine README (0.1.3)"


@dataclass(frozen=True, kw_only=True)
class PublishedFigure:
    system: str
    model: str
    setup: str
    seconds: float
    source: str
    configs: tuple[str, ...]  # the shipped configs it is comparable with (same architecture family)


PUBLISHED = (
    PublishedFigure(
        system="Miles NCCL broadcast",
        model="Kimi K2 1T (DeepSeek-V3 arch)",
        setup="train TP8 PP8 CP4 EP32 -> 256 GPUs EP256, 32+32 H100 nodes",
        seconds=52.98,
        source=MILES_P2P_DOC,
        configs=("deepseek-v3",),
    ),
    PublishedFigure(
        system="Miles RDMA P2P",
        model="Kimi K2 1T (DeepSeek-V3 arch)",
        setup="same; + 0.88 s finalize (FP8 requantization)",
        seconds=6.29,
        source=MILES_P2P_DOC,
        configs=("deepseek-v3",),
    ),
    PublishedFigure(
        system="Miles NCCL broadcast",
        model="GLM-5 744B (DeepSeek-V3 arch)",
        setup="train TP4 PP4 CP2 EP16 -> 64 GPUs EP64, 16+16 H100 nodes",
        seconds=55.44,
        source=MILES_P2P_DOC,
        configs=("deepseek-v3",),
    ),
    PublishedFigure(
        system="Miles RDMA P2P",
        model="GLM-5 744B (DeepSeek-V3 arch)",
        setup="same",
        seconds=8.32,
        source=MILES_P2P_DOC,
        configs=("deepseek-v3",),
    ),
    PublishedFigure(
        system="Miles broadcast -> P2P (RFC)",
        model="Kimi K2 1T",
        setup="H100 clusters with IB; 43 s -> 7 s",
        seconds=43.0,
        source=MILES_755,
        configs=("deepseek-v3",),
    ),
    PublishedFigure(
        system="checkpoint-engine broadcast",
        model="DeepSeek-V3.1 FP8",
        setup="16 x H20, TP16 engines",
        seconds=12.22,
        source=CKPT_ENGINE,
        configs=("deepseek-v3",),
    ),
    PublishedFigure(
        system="checkpoint-engine broadcast",
        model="DeepSeek-V3.1 FP8",
        setup="256 x H20, 16 engines of TP16",
        seconds=13.88,
        source=CKPT_ENGINE,
        configs=("deepseek-v3",),
    ),
    PublishedFigure(
        system="checkpoint-engine broadcast",
        model="Kimi-K2-Instruct FP8 1T",
        setup="256 x H20, 16 engines of TP16 ('about 20 s' across thousands of GPUs)",
        seconds=21.50,
        source=CKPT_ENGINE,
        configs=("deepseek-v3",),
    ),
    PublishedFigure(
        system="Miles NCCL broadcast",
        model="Qwen3-235B-A22B",
        setup="train TP4 PP4 CP2 EP16 -> 32 GPUs EP32, 8 H100 nodes",
        seconds=10.759,
        source=MILES_P2P_DOC,
        configs=("qwen3-235b-a22b",),
    ),
    PublishedFigure(
        system="Miles RDMA P2P",
        model="Qwen3-235B-A22B",
        setup="same",
        seconds=3.196,
        source=MILES_P2P_DOC,
        configs=("qwen3-235b-a22b",),
    ),
    PublishedFigure(
        system="checkpoint-engine broadcast",
        model="Qwen3-235B-A22B-Instruct-2507 BF16",
        setup="8 x H800, one TP8 engine (P2P: 16.47 s)",
        seconds=6.75,
        source=CKPT_ENGINE,
        configs=("qwen3-235b-a22b",),
    ),
)


def figures_for(config_name: str | None) -> tuple[PublishedFigure, ...]:
    """The figures comparable with a shipped config (none for a config file of the user's own)."""
    return tuple(f for f in PUBLISHED if config_name in f.configs)
