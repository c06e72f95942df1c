"""PodGroup access for the platform agent: list, get, patch and watch, each bounded."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bridge.core.kube import BoundedApi, WatchStream, classify, kubernetes_module, open_watch, watch_arguments
from bridge.platform.annotations import GROUP, PLURAL, VERSION


class PodGroupApi(BoundedApi):
    """List, get, patch and watch PodGroups; every call bounded by a timeout."""

    def __init__(self, client: Any, request_timeout: float = 10.0, connect_timeout: float = 5.0) -> None:
        super().__init__(client, request_timeout, connect_timeout)
        self._api = kubernetes_module().client.CustomObjectsApi(client)

    def list(self, namespace: str | None, selector: str | None) -> tuple[list[dict[str, Any]], str]:
        """Every matching PodGroup and the list's resourceVersion (the watch's start)."""
        kwargs: dict[str, Any] = {"_request_timeout": self._timeouts()}
        if selector:
            kwargs["label_selector"] = selector
        try:
            if namespace:
                data = self._api.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, **kwargs)
            else:
                data = self._api.list_cluster_custom_object(GROUP, VERSION, PLURAL, **kwargs)
        except Exception as error:
            raise classify(error) from error
        items = [item for item in data.get("items") or [] if isinstance(item, dict)]
        return items, str((data.get("metadata") or {}).get("resourceVersion") or "")

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        try:
            obj = self._api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                                         _request_timeout=self._timeouts())
        except Exception as error:
            raise classify(error) from error
        return dict(obj)

    def patch(self, namespace: str, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """A JSON merge patch (``null`` deletes a key). Put ``metadata.resourceVersion`` in
        ``body`` to make it conditional: the server then answers 409 on any newer change."""
        try:
            obj = self._api.patch_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, dict(body),
                _content_type="application/merge-patch+json", _request_timeout=self._timeouts())
        except Exception as error:
            raise classify(error) from error
        return dict(obj)

    def watch(self, namespace: str | None, selector: str | None, resource_version: str,
              timeout_seconds: int) -> WatchStream:
        """Open a watch from ``resource_version``; the server ends it after ``timeout_seconds``,
        and a silent connection is abandoned a few seconds after that."""
        kwargs = watch_arguments(resource_version, timeout_seconds, self.connect_timeout, self.request_timeout)
        if selector:
            kwargs["label_selector"] = selector
        if namespace:
            return open_watch(self._api.list_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL, **kwargs)
        return open_watch(self._api.list_cluster_custom_object, GROUP, VERSION, PLURAL, **kwargs)
