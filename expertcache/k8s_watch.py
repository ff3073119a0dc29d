"""Watching the service's ConfigMap through the Kubernetes API (``config_map_name``).

The kubelet refreshes a mounted ConfigMap only on its sync period (a minute or more); a watch
on the API sees the change at once. The watcher lists the one ConfigMap (by field selector),
hands the service's key (``daemon.yaml`` / ``predictor.yaml``) to ``on_data``, then follows a
watch from the list's resourceVersion, relisting when the watch ends or expires (410 Gone).

Credentials: in a pod, the service account (``load_incluster_config``); elsewhere the
standard kubeconfig (``$KUBECONFIG`` or ``~/.kube/config``). The namespace is ``POD_NAMESPACE``
(the downward API), else the service account's namespace file, else ``default``. The service
account needs get/list/watch on configmaps and create on events; without them the watcher logs
an ERROR and retries, and the mounted file still works.

A refused change posts a Warning Event on the ConfigMap (``post_warning``), so that
``kubectl describe configmap`` shows why an edit had no effect.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
WATCH_TIMEOUT_S = 300  # the server ends a watch after this; the watcher relists and watches again
RETRY_S = (1.0, 2.0, 5.0, 10.0, 30.0)
EVENT_REASON = "ConfigRejected"


def pod_namespace() -> str:
    namespace = os.environ.get("POD_NAMESPACE", "")
    if namespace:
        return namespace
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


def api_client() -> client.ApiClient:
    """In-cluster credentials in a pod, the kubeconfig elsewhere."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        # Read $KUBECONFIG now: the client reads it once, when it is first imported.
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
    return client.ApiClient()


class ConfigMapWatcher:
    """Follows ConfigMap ``name`` in ``namespace`` and calls ``on_data(origin, text)`` with the
    text of its ``key`` each time that text changes."""

    def __init__(
        self,
        name: str,
        key: str,
        on_data: Callable[[str, str], None],
        *,
        namespace: str | None = None,
        component: str = "expertcache",
    ) -> None:
        self.name = name
        self.key = key
        self.namespace = namespace or pod_namespace()
        self.origin = f"ConfigMap {self.namespace}/{name} key {key}"
        self._on_data = on_data
        self._component = component
        self._host = socket.gethostname()
        self._stop = threading.Event()
        self._watch: watch.Watch | None = None
        self._last_text: str | None = None
        self._uid = ""
        self._resource_version = ""
        self._api: client.CoreV1Api | None = None
        self.events_posted = 0
        self._thread = threading.Thread(target=self._run, name="configmap-watch", daemon=True)
        self._thread.start()

    # -- the watch -------------------------------------------------------------------------------
    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                if self._api is None:
                    self._api = client.CoreV1Api(api_client())
                    logger.info("watching %s through the Kubernetes API", self.origin)
                self._list_and_watch(self._api)
                failures = 0
            except ApiException as exc:
                if self._stop.is_set():
                    return
                failures += 1
                if exc.status in (401, 403):
                    logger.error(
                        "cannot watch %s: %s %s (the service account needs get/list/watch on configmaps); "
                        "the mounted config file is still watched",
                        self.origin,
                        exc.status,
                        exc.reason,
                    )
                else:
                    logger.warning("watch of %s failed: %s %s", self.origin, exc.status, exc.reason)
            except Exception as exc:  # noqa: BLE001 - connection errors, bad kubeconfig: retry
                if self._stop.is_set():
                    return  # close() cut the watch
                failures += 1
                logger.warning("watch of %s failed: %s", self.origin, exc)
            if failures:
                self._stop.wait(RETRY_S[min(failures, len(RETRY_S)) - 1])

    def _field_selector(self) -> str:
        return f"metadata.name={self.name}"

    def _list_and_watch(self, api: client.CoreV1Api) -> None:
        listed = api.list_namespaced_config_map(self.namespace, field_selector=self._field_selector())
        if not listed.items:
            logger.warning("%s does not exist (yet); waiting for it", self.origin)
        for item in listed.items:
            self._seen(item)
        version = listed.metadata.resource_version
        self._watch = watch.Watch()
        try:
            for event in self._watch.stream(
                api.list_namespaced_config_map,
                self.namespace,
                field_selector=self._field_selector(),
                resource_version=version,
                timeout_seconds=WATCH_TIMEOUT_S,
            ):
                if self._stop.is_set():
                    return
                kind = event.get("type")
                if kind in ("ADDED", "MODIFIED"):
                    self._seen(event["object"])
                elif kind == "DELETED":
                    logger.warning("%s was deleted; the running config stays", self.origin)
        finally:
            self._watch.stop()

    def _seen(self, item: client.V1ConfigMap) -> None:
        self._uid = item.metadata.uid or ""
        self._resource_version = item.metadata.resource_version or ""
        text = (item.data or {}).get(self.key)
        if text is None:
            logger.warning("%s: the ConfigMap has no key %r; nothing applied", self.origin, self.key)
            return
        if text == self._last_text:
            return
        self._last_text = text
        self._on_data(self.origin, text)

    # -- events ----------------------------------------------------------------------------------
    def post_warning(self, message: str) -> None:
        """A Warning Event on the ConfigMap (``kubectl describe configmap`` shows it); a failure
        to post is logged, never raised."""
        api = self._api
        if api is None:
            return
        now = datetime.datetime.now(datetime.UTC)
        body = client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name=f"{self.name}."),
            involved_object=client.V1ObjectReference(
                api_version="v1",
                kind="ConfigMap",
                name=self.name,
                namespace=self.namespace,
                uid=self._uid or None,
                resource_version=self._resource_version or None,
            ),
            reason=EVENT_REASON,
            message=message[:1024],
            type="Warning",
            source=client.V1EventSource(component=self._component, host=self._host),
            reporting_component=self._component,
            reporting_instance=self._host,
            first_timestamp=now,
            last_timestamp=now,
            count=1,
        )
        try:
            api.create_namespaced_event(self.namespace, body)
            self.events_posted += 1
        except Exception as exc:  # noqa: BLE001 - an event is best effort
            logger.warning("cannot post a Warning Event on %s: %s", self.origin, exc)

    def close(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        # The thread may sit in a read until the next event or the watch timeout: it is a daemon
        # thread and calls nothing once stopped.
        self._thread.join(0.5)
