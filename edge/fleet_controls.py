"""The edge daemon as the fleet plane sees it: `DaemonControls` implements edge/fleet_agent.py's
`EdgeControls` over the node (verifier, cloud, cost model) and the API's request defaults (mode,
policy, k, pipeline).

A config is the group's whole desired state (common/fleet_plane/messages.py:FleetConfig): it is
applied over the daemon's own settings from its command line, never over the previous config, so a
field the group cleared goes back to this daemon's own and every edge of a group, early or late,
runs the same document. It is checked whole before anything changes; the steps that can still fail
after the checks (reaching a new cloud, loading the daemon's own verifier again) run first; then
the new defaults, cloud and verifier are put in force together, with no await between them, so a
request starts wholly under the old config or wholly under the new one. Requests in flight keep
what they started with.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

from common.spec.modes import POLICY_MODES, DecodeSettings, needs_cloud, settings_mode
from common.fleet_plane.messages import CloudLoad, EdgeState, EdgeTelemetry, FleetConfig
from edge.api.completions import ApiSettings, Completions
from edge.fleet_agent import EdgeIdentity
from edge.node import EdgeNode, VerifierSetup


class DaemonControls:
    def __init__(self, node: EdgeNode, service: Completions, identity: EdgeIdentity) -> None:
        self.node = node
        self.service = service
        self.identity = identity
        self._last_report = (time.monotonic(), replace(service.metrics.totals))
        # The daemon's own settings, which a config's fields override and a cleared field returns to.
        self.own_api = service.api
        self.own_verifier = node.verifier_identity
        self.clouds_from_config = False

    def state(self, status: str, config_version: int) -> EdgeState:
        api = self.service.api
        return EdgeState(status, self.identity.edge_id, self.identity.group, self.node.settings.draft,
                         self.node.target_id, self.node.verifier_identity or {}, api.default_mode, api.default_policy,
                         self.identity.version, self.identity.api, config_version, time.time())

    def telemetry(self, edge_id: str, interval_s: float, dropped: int) -> EdgeTelemetry:
        """Rates over the time since the last report, from the requests that finished in it."""
        now, totals = time.monotonic(), replace(self.service.metrics.totals)
        then, before = self._last_report
        self._last_report = (now, totals)
        delta = totals.since(before)
        return EdgeTelemetry(
            edge_id=edge_id, time=time.time(), interval_s=interval_s,
            tokens_per_s=delta.tokens / max(now - then, 1e-6),
            target_calls_per_token=delta.target_calls / delta.tokens if delta.tokens else 0.0,
            tokens_per_call=delta.tokens / delta.target_calls if delta.target_calls else None,
            active_requests=self.service.slots.in_flight, requests=delta.requests,
            degraded_requests=delta.degraded_requests, cost_model=self.node.decoder.cost_model.snapshot(),
            cloud=self.node.cloud_address, dropped_telemetry=dropped)

    def load_verifier(self, metadata_path: Path) -> VerifierSetup:
        try:
            return self.node.prepare_verifier(str(metadata_path))
        except ValueError:
            raise
        except Exception as err:  # ONNX Runtime's own errors, a metadata field missing: all mean "does not load"
            raise ValueError(f"the verifier does not load: {type(err).__name__}: {err}") from err

    async def apply(self, config: FleetConfig, verifier: VerifierSetup | None) -> None:
        api = self._checked_defaults(config)
        if verifier is None and self.node.verifier_identity != self.own_verifier:  # the group cleared its verifier
            verifier = await asyncio.to_thread(self.node.prepare_verifier, self.node.settings.verifier)
        if config.clouds:
            await self.node.use_clouds([str(address) for address in config.clouds])
        elif self.clouds_from_config and self.node.settings.cloud:  # the group cleared its clouds
            await self.node.use_clouds(self.node.settings.cloud.split(","))
        if needs_cloud(api.default_mode) and self.node.cloud is None:  # a drafting mode runs from its draft alone
            raise ValueError(f"mode {api.default_mode!r} needs a cloud, and this edge has none: name one in 'clouds'")
        # From here on nothing awaits: the next request sees all of it.
        self.clouds_from_config = bool(config.clouds) or (self.clouds_from_config and not self.node.settings.cloud)
        self.service.api = api
        if verifier is not None:
            self.node.use_verifier(verifier)

    def _checked_defaults(self, config: FleetConfig) -> ApiSettings:
        changes = {name: value for name, value in (("default_mode", config.mode), ("default_policy", config.policy),
                                                   ("default_k", config.k), ("default_pipeline", config.pipeline))
                   if value is not None}
        api = replace(self.own_api, **changes)
        mode = settings_mode(api.default_mode)
        policy = api.default_policy if mode in POLICY_MODES else None
        DecodeSettings(mode=mode, max_new_tokens=1, k=api.default_k, policy=policy)  # ValueError if not
        return api

    def message_rejected(self, reason: str) -> None:
        self.service.metrics.fleet_rejected.labels(reason).inc()

    def cloud_announced(self, load: CloudLoad) -> None:
        if self.node.cloud is not None:
            self.node.cloud.observe(load)
        if load.status == "online" and load.verify_ms_p50 is not None:
            self.node.decoder.cost_model.seed_verify_ms(load.verify_ms_p50)
