"""Client of gbox-mini-agent, the agent service (docs/design.md, the agent): one async method per
endpoint.

Transport failures and bad answers raise :class:`AgentError` (:class:`AgentUnreachable` when no
connection could be opened, so the request was never sent); the "404 = none yet" endpoints
return empty results instead. Following a run to its end is the driver's job
(``cua_rl.agent.service_driver``).
"""

from __future__ import annotations

from typing import Any

import httpx

from cua_rl.errors import AgentError, ConfigError


class AgentUnreachable(AgentError):
    """No connection to the agent could be opened, so the request was never sent (an agent
    restarting or not up yet); unlike a lost answer, a retry cannot start anything twice."""


class MiniAgentClient:
    """One async method per gbox-mini-agent endpoint; inject ``client`` to share or fake transport."""

    def __init__(
        self,
        base_url: str,
        *,
        client: httpx.AsyncClient | None = None,
        timeout_s: float = 30.0,
    ):
        if not base_url or not base_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"agent base_url must be an http(s) URL such as http://127.0.0.1:8080, got {base_url!r}"
            )
        root, sep, _ = base_url.partition("/runs")
        if sep:  # a run's URL pasted instead of the service's
            raise ConfigError(f"agent base_url={base_url!r} has /runs in it: give {root}")
        self.base_url = base_url.rstrip("/")
        self._own_client = client is None
        self._client = client or httpx.AsyncClient(timeout=timeout_s)

    async def aclose(self) -> None:
        if self._own_client:
            await self._client.aclose()

    async def __aenter__(self) -> MiniAgentClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _request(self, method: str, path: str, *, none_on_404: bool = False, **kwargs) -> Any:
        url = f"{self.base_url}{path}"
        try:
            resp = await self._client.request(method, url, **kwargs)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise AgentUnreachable(
                f"{method} {path}: nothing answers at {self.base_url} ({type(exc).__name__}: "
                f"{exc}): start the agent service, or fix the host and port of agent.base_url"
            ) from exc
        except httpx.HTTPError as exc:
            raise AgentError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code == 404 and none_on_404:
            return None
        if resp.status_code >= 400:
            hint = f" (is {self.base_url} the agent service's root? check agent.base_url)"
            raise AgentError(
                f"{method} {path} answered {resp.status_code}: {resp.text[:500]}"
                + (hint if resp.status_code == 404 else ""),
                status=resp.status_code,
                body=resp.text,
            )
        try:
            return resp.json()
        except ValueError as exc:
            raise AgentError(
                f"{method} {path} answered non-JSON: {resp.text[:200]!r}",
                status=resp.status_code,
                body=resp.text,
            ) from exc

    async def create_run(self, body: dict) -> str:
        """``POST /runs``; returns the run id."""
        data = await self._request("POST", "/runs", json=body)
        run_id = data.get("runId") if isinstance(data, dict) else None
        if not run_id:
            raise AgentError(f"POST /runs answered without runId: {data!r}", status=200, body=data)
        return str(run_id)

    async def probe(self) -> None:
        """Raises ``AgentError`` unless the service answers: no health endpoint is known, so a
        lookup of a run that does not exist (a 404 is an answer) stands in for one."""
        await self._request("GET", "/runs/cua-rl-probe", none_on_404=True)

    async def get_run(self, run_id: str) -> dict:
        """``GET /runs/{id}`` -> ``{status, reason, ...}``."""
        data = await self._request("GET", f"/runs/{run_id}")
        if not isinstance(data, dict) or "status" not in data:
            raise AgentError(f"GET /runs/{run_id} answered without status: {data!r}", body=data)
        return data

    async def get_events(self, run_id: str, from_: Any = None, to: Any = None) -> list[dict]:
        """``GET /runs/{id}/events``; ``from_`` inclusive, ``to`` exclusive; [] when none yet."""
        bounds = (("from", from_), ("to", to))
        params = {name: str(value) for name, value in bounds if value is not None}
        data = await self._request("GET", f"/runs/{run_id}/events", params=params, none_on_404=True)
        if data is None:
            return []
        if isinstance(data, dict):
            data = data.get("events")
        if not isinstance(data, list):
            raise AgentError(f"events of run {run_id} are not a list: {str(data)[:200]}", body=data)
        return data

    async def get_steps(self, run_id: str) -> list[dict]:
        data = await self._request("GET", f"/runs/{run_id}/steps", none_on_404=True)
        if data is None:
            return []
        if isinstance(data, dict):
            data = data.get("steps", [])
        return list(data)

    async def get_step(self, run_id: str, index: int) -> dict | None:
        """Step ``index`` (0-based), ``None`` when it does not exist (yet)."""
        return await self._request("GET", f"/runs/{run_id}/steps/{index}", none_on_404=True)

    async def get_trajectory(self, run_id: str) -> Any:
        return await self._request("GET", f"/runs/{run_id}/trajectory", none_on_404=True)

    async def get_tokens(self, run_id: str) -> Any:
        return await self._request("GET", f"/runs/{run_id}/tokens", none_on_404=True)
