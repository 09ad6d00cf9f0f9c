"""Turn one target's aggregate into its next committed version: the server optimizer moves the
global adapter towards the aggregate, a finite check guards what devices will receive, the
frequent n-grams are released privately into the global cache, and the registry commits the
new version (adapter, cache, optimizer state and privacy ledger) atomically."""

from __future__ import annotations

import numpy as np
import torch

from omnidraft.coordinator.fleet_config import FleetConfig
from omnidraft.coordinator.ngram_release import NgramRelease
from omnidraft.coordinator.registry import GlobalState, TargetRegistry
from omnidraft.coordinator.server_opt import ServerOptimizer


def commit_aggregate(
    registry: TargetRegistry,
    config: FleetConfig,
    rnd: int,
    target: str,
    state: GlobalState,
    global_adapter: dict[str, np.ndarray],
    aggregate: dict[str, np.ndarray],
    ngram_stats: list,
    devices: int,
    tokens: int,
    record: dict,
) -> str | None:
    """Commit round ``rnd``'s ``aggregate`` (the devices' aggregated adapter) for ``target``,
    whose current version is ``state`` (its adapter as ``global_adapter``); ``ngram_stats`` are
    the accepted devices' decoded n-gram statistics, ``devices`` and ``tokens`` (trained tokens)
    go into the manifest. Adds what was committed to ``record`` (version, sizes, n-gram release
    report, update noise); returns why nothing was committed, or None."""
    server = ServerOptimizer(config.server_opt, registry.server_state(target))
    adapter = server.step(global_adapter, aggregate)
    if not all(np.isfinite(v).all() for v in adapter.values()):  # never commit what no device can use
        return "the aggregate is not finite: round not committed"
    dp_noise = config.aggregation.dp_noise
    release = NgramRelease(config.release, registry.privacy_ledger(target), private_updates=dp_noise > 0)
    if dp_noise > 0:  # charged in the same ledger, committed with the version
        release.account_updates(dp_noise)
        from flwr.supercore.differential_privacy import compute_stdv

        record["update-noise-std"] = compute_stdv(dp_noise, config.aggregation.clip_norm, devices)
    released, report = release.release(ngram_stats)  # noise from OS entropy, never the seed
    cache = state.cache()
    candidates = registry.candidates(target)
    for target_id, count in released.items():
        if target_id in candidates:
            cache.add(candidates[target_id], target_id, max(1, int(round(count))))
    manifest = registry.commit(
        target,
        {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in adapter.items()},
        cache,
        round_=rnd,
        devices=devices,
        tokens=tokens,
        server_state=server.state(),
        privacy_ledger=release.ledger(),
    )
    record.update(
        {
            "version": int(manifest.version),
            "trained-tokens": tokens,
            "cache-entries": len(cache),
            "cache-bytes": int(manifest.cache_bytes),
            "adapter-bytes": int(manifest.adapter_bytes),
            "ngrams": report.to_dict(),
        }
    )
    return None
