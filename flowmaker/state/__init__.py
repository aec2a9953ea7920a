"""Cluster state: key layout (`keys`), the StateStore protocol (`store`), etcd and in-memory stores, records."""

from flowmaker.state.store import (
    Compare,
    EventKind,
    KeyValue,
    LeaseKeeper,
    Listing,
    Put,
    StateStore,
    TxnResult,
    WatchEvent,
    commit,
)

__all__ = [
    "Compare", "EventKind", "KeyValue", "LeaseKeeper", "Listing", "Put", "StateStore", "TxnResult",
    "WatchEvent", "commit", "connect",
]


def connect(endpoints: str | list[str], *, namespace: str = "", timeout_s: float = 5.0) -> StateStore:
    """The store every service uses: etcd at `endpoints` (imported lazily so pure code never loads aetcd)."""
    from flowmaker.state.etcd import EtcdStore

    return EtcdStore(endpoints, namespace=namespace, timeout_s=timeout_s)
