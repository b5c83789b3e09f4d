"""Which replica serves a request: the least busy of a model's ready replicas.

The controller publishes the ready replicas after every change; requests in flight are
counted here, per replica, so a slow replica gets fewer new requests.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Endpoint:
    replica: str
    base_url: str
    in_flight: int = 0


class Router:
    def __init__(self) -> None:
        self._routes: dict[str, list[Endpoint]] = {}

    def update(self, ready: dict[str, list[tuple[str, str, int]]]) -> None:
        """Replace the table, keeping the in-flight counts of replicas that stay."""
        known = {e.replica: e for eps in self._routes.values() for e in eps}
        table: dict[str, list[Endpoint]] = {}
        for model, replicas in ready.items():
            endpoints = []
            for replica, address, port in sorted(replicas):
                host = f"[{address}]" if ":" in address else address
                endpoint = known.get(replica) or Endpoint(replica, f"http://{host}:{port}")
                endpoints.append(endpoint)
            table[model] = endpoints
        self._routes = table

    def candidates(self, model: str) -> list[Endpoint]:
        """Ready replicas of ``model``, least busy first."""
        return sorted(self._routes.get(model, ()), key=lambda e: e.in_flight)

    def in_flight(self) -> dict[str, int]:
        return {e.replica: e.in_flight for eps in self._routes.values() for e in eps}
