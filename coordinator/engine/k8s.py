"""Kubernetes: follow the stage StatefulSet and re-partition when its replica count changes.

A daemon thread watches the one StatefulSet (the sync `kubernetes` client; RBAC in the chart allows get,
list and watch on it). When `spec.replicas` is 0, or the StatefulSet reports at least that many ready
replicas, it asks the Repartitioner for that depth on the event loop. Stage i is reached at
`address_of(i)`, the headless-Service DNS name of pod <name>-i. After a pipeline failure (a stage pod
restarted and came back with its default layers), the next event with every replica ready re-applies the
partition.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from common.logs import get_logger

log = get_logger(__name__)


def desired_stages(sts) -> int | None:
    """The depth to serve with, or None while new stages are still starting."""
    want = (sts.spec.replicas if sts.spec is not None else 0) or 0
    ready = ((sts.status.ready_replicas if sts.status is not None else 0) or 0)
    return want if want == 0 or ready >= want else None


class StatefulSetWatcher:
    def __init__(self, apps_api, namespace: str, name: str, on_depth: Callable[[int], None],
                 read_timeout_s: float = 5.0) -> None:
        self.api, self.namespace, self.name = apps_api, namespace, name
        self.on_depth = on_depth
        self.read_timeout_s = read_timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="statefulset-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.read_timeout_s)

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        while not self._stop.is_set():
            w = watch.Watch()
            try:
                for event in w.stream(self.api.list_namespaced_stateful_set, self.namespace,
                                      field_selector=f"metadata.name={self.name}",
                                      _request_timeout=self.read_timeout_s):
                    if self._stop.is_set():
                        break
                    sts = event["object"]
                    if sts.metadata.name != self.name:           # servers that ignore the selector
                        continue
                    depth = desired_stages(sts)
                    if depth is not None:
                        self.on_depth(depth)
            except (ApiException, HTTPError, OSError) as e:
                if not self._stop.is_set() and "timed out" not in str(e).lower():
                    log.warning("statefulset watch interrupted; retrying", error=str(e))
                self._stop.wait(0.2)
            finally:
                w.stop()


def watch_statefulset(apps_api, namespace: str, name: str, repartitioner,
                      loop: asyncio.AbstractEventLoop) -> StatefulSetWatcher:
    """Start a watcher that drives `repartitioner.scale` on `loop`."""
    def on_depth(n: int) -> None:
        # also after a pipeline failure (say a stage pod restarted with its default layers): once all
        # stages are ready again, re-apply the partition
        broken = repartitioner.broken
        if n != repartitioner.current or broken:
            asyncio.run_coroutine_threadsafe(repartitioner.scale(n, force=broken), loop)
    watcher = StatefulSetWatcher(apps_api, namespace, name, on_depth)
    watcher.start()
    return watcher
