"""Starting or joining the Ray cluster the workers run on (the control plane)."""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)

NAMESPACE = "duospec"


class ClusterUnavailable(ConnectionError):
    """No Ray cluster at the given address; the message says what to check."""


def _check_reachable(address: str, timeout_s: float) -> None:
    """Fails in seconds, instead of Ray's long connect retries, when nothing listens at `address`."""
    host, _, port = address.rpartition(":")
    if address.startswith("ray://") or not port.isdigit():
        return
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ClusterUnavailable(
            f"no Ray cluster reachable at {address} ({exc.strerror or exc}); start one with "
            f"`ray start --head` (or `ray up deploy/cluster.yaml`) or pass the head's address as HOST:6379"
        ) from None


def connect(address: str | None = None, *, namespace: str = NAMESPACE, timeout_s: float = 5.0,
            num_cpus: int | None = None) -> None:
    """Joins the cluster at `address` ("auto" = the one started on this machine with `ray start`), or
    starts a local single-node instance when `address` is None (declaring `num_cpus` logical CPUs,
    default: the machine's cores)."""
    import ray

    if ray.is_initialized():
        return
    kwargs = dict(namespace=namespace, log_to_driver=False, configure_logging=False)
    if address is None:  # a private instance, even if `ray start` runs on this machine
        ray.init(address="local", include_dashboard=False, num_cpus=num_cpus, **kwargs)
        return
    if address != "auto":
        _check_reachable(address, timeout_s)
    try:
        ray.init(address=address, **kwargs)
    except ConnectionError as exc:
        raise ClusterUnavailable(
            f"could not join the Ray cluster at {address!r}: {exc}. Is `ray start --head` running there?"
        ) from None


def torch_threads_for_actor() -> int:
    """One torch thread per model actor unless overridden: actors share the node's cores."""
    return int(os.environ.get("DUOSPEC_TORCH_THREADS", "1"))


def node_ip() -> str:
    import ray

    try:
        return ray.util.get_node_ip_address()
    except Exception:
        return socket.gethostbyname(socket.gethostname())
