"""Which devices evaluate together in a round (``Panel``), and the first-session panels: the
sampled devices that never trained for a target against those that did (``first_session_panels``)."""

from __future__ import annotations

from dataclasses import dataclass

from flwr.app import ConfigRecord

from omnidraft.coordinator.fleet_config import FleetConfig
from omnidraft.coordinator.registry import GlobalState
from omnidraft.shared.wire import StatusKey


@dataclass
class Panel:
    """Devices that evaluate together: ``nodes`` decode their held-out prompts with ``state``
    (None: their local state alone); ``held`` is their status (the parts they hold);
    ``prefix`` names the panel's metrics; ``adaptive=False`` decodes at the fixed draft length
    only (``FleetConfig.fixed_k``); ``timed=False``: the adaptive decode is not timed against
    the target alone (its speed is the modelled one); ``fresh`` (no ``state``): with nothing the
    devices hold, neither global nor local state (what they would do had they never learned)."""

    nodes: list[int]
    state: GlobalState | None
    held: dict[int, ConfigRecord] | None = None
    prefix: str = "eval-"
    adaptive: bool = True
    timed: bool = True
    fresh: bool = False


def first_session_panels(
    config: FleetConfig, states: dict[str, GlobalState], by_target: dict[str, dict[int, ConfigRecord]]
) -> tuple[dict, dict]:
    """``(cold, warm)`` panels, keyed ``(target, kind)``: per target, sampled devices that never
    trained for it and meet a trained global state (at most ``newcomer_evals`` of them) without
    it (``new-cold-``) and with it (``new-warm-``); alongside, as many sampled devices that did
    train before with the same state (``veteran-``) and with nothing they hold
    (``veteran-cold-``): the veterans' gain, the reference a newcomer's warm start is measured
    against. With a fixed draft length (``fixed_k``) the panels decode at that length only
    (the acceptance that compares states, at half the cost), adaptively too (untimed) where
    ``newcomer_speed`` asks for it."""
    n = config.newcomer_evals
    adaptive, timed = not config.fixed_k or config.newcomer_speed, not config.fixed_k
    cold, warm = {}, {}
    for target, group in by_target.items():
        order = sorted(group, key=lambda node: str(group[node].get(StatusKey.DEVICE, node)))
        new = [node for node in order if not group[node].get(StatusKey.TRAINED)][: n or None]
        if not new or states[target].manifest.version == 0:
            continue
        cold[target, "cold"] = Panel(new, None, None, "new-cold-", adaptive, timed)
        warm[target, "warm"] = Panel(new, states[target], group, "new-warm-", adaptive, timed)
        veterans = [node for node in order if group[node].get(StatusKey.TRAINED)][: n or None]
        if veterans:
            warm[target, "veteran"] = Panel(veterans, states[target], group, "veteran-", adaptive, timed)
            cold[target, "veteran"] = Panel(veterans, None, None, "veteran-cold-", adaptive, timed, fresh=True)
    return cold, warm
