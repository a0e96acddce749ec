"""Transfer statistics through vLLM's connector stats, so they reach the logs and /metrics:

    vllm:vllm_ext_transfers_total          pulls that completed
    vllm:vllm_ext_failed_transfers_total   receives that failed (pull, lease, or bad params)
    vllm:vllm_ext_expired_leases_total     producer leases that expired unused
    vllm:vllm_ext_digest_mismatches_total  pulls whose blocks differed from the producer's digests
    vllm:vllm_ext_refused_leases_total     loads refused before the pull: the lease holds other tokens
    vllm:vllm_ext_transfer_bytes_total     bytes pulled
    vllm:vllm_ext_pull_seconds             histogram of a load's time (its start to blocks written
                                           and checked; the release too where no digests vouch)
    vllm:vllm_ext_sync_loads_total         of the pulls completed, those loaded inside the step
                                           that scheduled their request (before its forward)
    vllm:vllm_ext_load_phase_seconds       histogram of each phase of a completed load (label
                                           `phase`): queued (waiting for a pull thread), connect
                                           (describe and connect a producer first seen; else
                                           ~0), acquire (the lease round trip, answered once the
                                           producer serves the blocks), pull (the transfer),
                                           verify (the digest check; absent with verify_kv off),
                                           release (absent where digests vouch: sent after the
                                           load is reported)
    vllm:vllm_ext_leased_blocks            (gauge) the producer's blocks that P/D leases hold now
    vllm:vllm_ext_evicted_leases_total     untaken producer leases ended early to make room for new ones
    vllm:vllm_ext_unleased_prefills_total  prefills answered without a lease (max_leased_fraction reached)
    vllm:vllm_ext_rank_transfers_total, vllm:vllm_ext_rank_failed_transfers_total,
    vllm:vllm_ext_rank_transfer_bytes_total
                                           the same per TP rank (label `tp_rank`): under tensor
                                           parallelism every rank pulls its own shard, and the
                                           totals above count each rank's pull
"""

import dataclasses
from typing import Any, Dict

from . import check_vllm_version

check_vllm_version()  # before importing what another release may lack: one clear message

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats  # noqa: E402

_COUNTS = ("transfers", "failed", "expired", "bytes", "mismatches", "refused", "evicted", "unleased", "sync")
LEASED = "leased_blocks"  # a gauge: the latest value wins when stats are merged
RANKS = "ranks"  # TP rank (a string: the stats cross processes) -> {"transfers", "failed", "bytes"}
_RANK_COUNTS = ("transfers", "failed", "bytes")
PHASES = "phases"  # phase name -> [seconds of each load] (receiver.PHASES)


def _empty() -> Dict[str, Any]:
    return {"transfers": 0, "failed": 0, "expired": 0, "bytes": 0, "mismatches": 0, "refused": 0, "evicted": 0,
            "unleased": 0, "sync": 0, "seconds": []}


@dataclasses.dataclass
class VllmExtStats(KVConnectorStats):
    def __post_init__(self):
        if not self.data:
            self.data = _empty()

    def _rank(self, rank: int) -> Dict[str, int]:
        return self.data.setdefault(RANKS, {}).setdefault(str(rank), dict.fromkeys(_RANK_COUNTS, 0))

    def record_transfer(self, nbytes: int, seconds: float, rank: int = 0, sync: bool = False) -> None:
        self.data["transfers"] += 1
        if sync:
            self.data["sync"] = self.data.get("sync", 0) + 1
        self.data["bytes"] += int(nbytes)
        self.data["seconds"].append(float(seconds))
        counts = self._rank(rank)
        counts["transfers"] += 1
        counts["bytes"] += int(nbytes)

    def record_phases(self, phases: Dict[str, float]) -> None:
        """One completed load's time per phase (receiver.PHASES)."""
        into = self.data.setdefault(PHASES, {})
        for name, seconds in phases.items():
            into.setdefault(name, []).append(float(seconds))

    def record_failure(self, rank: int = 0) -> None:
        self.data["failed"] += 1
        self._rank(rank)["failed"] += 1

    def record_expiry(self) -> None:
        self.data["expired"] += 1

    def record_mismatch(self) -> None:
        self.data["mismatches"] += 1

    def record_refusal(self) -> None:
        self.data["refused"] = self.data.get("refused", 0) + 1

    def record_eviction(self) -> None:
        self.data["evicted"] = self.data.get("evicted", 0) + 1

    def record_unleased(self) -> None:
        self.data["unleased"] = self.data.get("unleased", 0) + 1

    def record_leased_blocks(self, n: int) -> None:
        self.data[LEASED] = int(n)

    def reset(self):
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> "VllmExtStats":
        merged = _empty()
        for source in (self.data, other.data):
            for key in _COUNTS:
                merged[key] += int(source.get(key, 0))
            merged["seconds"].extend(source.get("seconds", []))
            for name, values in (source.get(PHASES) or {}).items():
                merged.setdefault(PHASES, {}).setdefault(name, []).extend(values)
            for rank, counts in (source.get(RANKS) or {}).items():
                into = merged.setdefault(RANKS, {}).setdefault(rank, dict.fromkeys(_RANK_COUNTS, 0))
                for key in _RANK_COUNTS:
                    into[key] += int(counts.get(key, 0))
            if LEASED in source:  # `other` is the newer
                merged[LEASED] = int(source[LEASED])
        return VllmExtStats(data=merged)

    def reduce(self) -> Dict[str, Any]:
        seconds = self.data["seconds"]
        return {"transfers": self.data["transfers"], "failed": self.data["failed"],
                "expired_leases": self.data["expired"], "bytes": self.data["bytes"],
                "digest_mismatches": self.data.get("mismatches", 0), "refused_leases": self.data.get("refused", 0),
                "evicted_leases": self.data.get("evicted", 0), "unleased_prefills": self.data.get("unleased", 0),
                **({LEASED: self.data[LEASED]} if LEASED in self.data else {}),
                **({RANKS: self.data[RANKS]} if self.data.get(RANKS) else {}),
                "sync_loads": self.data.get("sync", 0),
                **{f"avg_{name}_ms": round(1e3 * sum(v) / len(v), 3)
                   for name, v in (self.data.get(PHASES) or {}).items() if v},
                "avg_pull_ms": round(1e3 * sum(seconds) / len(seconds), 3) if seconds else 0.0}

    def is_empty(self) -> bool:
        return (not any(self.data.get(k, 0) for k in _COUNTS) and not self.data["seconds"] and LEASED not in self.data
                and not self.data.get(PHASES))


class VllmExtPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def create_metric_per_engine(metric, labelvalues):  # one child per engine index
            return {idx: metric.labels(*values) for idx, values in labelvalues.items()}

        def counter(name, doc):
            return create_metric_per_engine(self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                                            per_engine_labelvalues)

        self.transfers = counter("vllm:vllm_ext_transfers", "KV pulls completed by vllm-ext's connector")
        self.failed = counter("vllm:vllm_ext_failed_transfers", "KV receives that failed (pull, lease, params)")
        self.expired = counter("vllm:vllm_ext_expired_leases", "producer leases that expired unused")
        self.bytes = counter("vllm:vllm_ext_transfer_bytes", "KV bytes pulled by vllm-ext's connector")
        self.mismatches = counter("vllm:vllm_ext_digest_mismatches",
                                  "KV pulls whose blocks differed from the producer's digests")
        self.refused = counter("vllm:vllm_ext_refused_leases",
                               "KV loads refused before the pull: the producer's lease holds other tokens")
        self.evicted = counter("vllm:vllm_ext_evicted_leases",
                               "untaken producer leases ended early to make room for new ones (max_leased_fraction)")
        self.unleased = counter("vllm:vllm_ext_unleased_prefills",
                                "prefills answered without a lease: P/D leases held max_leased_fraction of the cache")
        self.sync = counter("vllm:vllm_ext_sync_loads",
                            "KV pulls completed inside the step that scheduled their request (before its forward)")
        self.leased = create_metric_per_engine(
            self._gauge_cls(name="vllm:vllm_ext_leased_blocks", multiprocess_mode="mostrecent", labelnames=labelnames,
                            documentation="KV blocks the producer's P/D leases hold"), per_engine_labelvalues)
        hist = self._histogram_cls(
            name="vllm:vllm_ext_pull_seconds", documentation="time of one KV pull (lease to blocks written)",
            buckets=[1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0], labelnames=labelnames)
        self.seconds = create_metric_per_engine(hist, per_engine_labelvalues)
        self._phases = self._histogram_cls(
            name="vllm:vllm_ext_load_phase_seconds", labelnames=[*labelnames, "phase"],
            documentation="time of each phase of a completed KV load (queued, connect, acquire, pull, verify, release)",
            buckets=[3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0])
        self._labelvalues = per_engine_labelvalues
        self._by_rank = {key: self._counter_cls(name=f"vllm:vllm_ext_rank_{name}", documentation=doc,
                                                labelnames=[*labelnames, "tp_rank"])
                         for key, name, doc in (("transfers", "transfers", "KV pulls completed, per TP rank"),
                                                ("failed", "failed_transfers", "KV receives that failed, per TP rank"),
                                                ("bytes", "transfer_bytes", "KV bytes pulled, per TP rank"))}

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0):
        for metric, key in ((self.transfers, "transfers"), (self.failed, "failed"),
                            (self.expired, "expired"), (self.bytes, "bytes"), (self.mismatches, "mismatches"),
                            (self.refused, "refused"), (self.evicted, "evicted"), (self.unleased, "unleased"),
                            (self.sync, "sync")):
            value = int(transfer_stats_data.get(key, 0))
            if value:
                metric[engine_idx].inc(value)
        if LEASED in transfer_stats_data:
            self.leased[engine_idx].set(int(transfer_stats_data[LEASED]))
        for s in transfer_stats_data.get("seconds", []):
            self.seconds[engine_idx].observe(s)
        for name, values in (transfer_stats_data.get(PHASES) or {}).items():
            child = self._phases.labels(*self._labelvalues[engine_idx], str(name))
            for s in values:
                child.observe(s)
        for rank, counts in (transfer_stats_data.get(RANKS) or {}).items():
            for key, metric in self._by_rank.items():
                value = int(counts.get(key, 0))
                if value:
                    metric.labels(*self._labelvalues[engine_idx], str(rank)).inc(value)
