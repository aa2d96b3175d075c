"""The strategies by ``--strategy`` name, and the one a rank runs."""

from __future__ import annotations

from hyla.train.strategies.base import Strategy


def strategy_class(name: str) -> type[Strategy]:
    """The class of ``--strategy name`` (imported when asked for: FSDP2 and the process-group
    modules cost seconds to import).

    Example:
        >>> strategy_class("fomoe").__name__, strategy_class("fsdp").name
        ('Fomoe', 'fsdp')
    """
    if name == "fsdp":
        from hyla.train.strategies.fsdp import Fsdp

        return Fsdp
    from hyla.train.strategies.diloco import Diloco, Fomoe

    classes = {"diloco": Diloco, "fomoe": Fomoe}
    if name not in classes:
        raise ValueError(f"strategy must be one of ('fsdp', 'diloco', 'fomoe'), got {name!r}")
    return classes[name]


def build_strategy(model, cfg, *, rank: int, world: int) -> Strategy:
    """The strategy this rank runs: ``cfg.strategy`` at W > 1, one process's at W = 1, after
    the strategy's own checks (which refuse bad input at any world size).

    Example:
        >>> from hyla.model import HylaLM, preset
        >>> from hyla.train.config import TrainConfig
        >>> build_strategy(HylaLM(preset("debug")), TrainConfig(), rank=0, world=1).name
        'single'
    """
    cls = strategy_class(cfg.strategy)
    cls.check(model, cfg, world)
    return cls(cfg, rank=rank, world=world) if world > 1 else Strategy(cfg, rank=rank, world=1)
