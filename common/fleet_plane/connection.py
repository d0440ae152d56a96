"""One MQTT connection to the fleet's broker, kept up in the background for as long as its owner runs.

    async with FleetConnection(BrokerSettings.parse("mqtt://127.0.0.1:1883"), "edge-e1", will=...) as fleet:
        fleet.subscribe(topics.fleet_config("g1"), on_config)
        await fleet.publish(topics.edge_telemetry("e1"), payload)  # False: dropped, the broker is away

The owner never waits on the broker: `publish` returns at once when there is no connection (the
message is dropped and counted), and a connection that drops is re-made in the background with
exponential backoff and jitter; subscriptions are renewed on every (re)connect, then `on_connect`
runs (to republish retained state). Incoming messages go to the handler of the first matching
filter; a handler that raises is logged and counted, never fatal. Wrong credentials are reported
once, clearly, and retried at the slowest pace: the daemon keeps serving meanwhile.

No threads: aiomqtt runs paho's client on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable
from urllib.parse import urlsplit

import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

log = logging.getLogger(__name__)

Handler = Callable[[aiomqtt.Message], Awaitable[None]]


@dataclass(frozen=True)
class BrokerSettings:
    host: str
    port: int = 1883
    tls: bool = False
    ca_file: Path | None = None  # trust these roots (default: the system's) when tls
    cert_file: Path | None = None  # client certificate, with key_file
    key_file: Path | None = None
    username: str | None = None
    password: str | None = None
    keepalive_s: int = 10  # a dead client's Last Will fires within 1.5x this
    reconnect_min_s: float = 0.5
    reconnect_max_s: float = 15.0
    publish_timeout_s: float = 2.0

    @classmethod
    def parse(cls, url: str, **options: object) -> BrokerSettings:
        """`mqtt://[user:password@]host[:port]` or `mqtts://...` (TLS, port 8883 by default)."""
        parts = urlsplit(url)
        if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname:
            raise ValueError(f"broker URL {url!r}: expected mqtt://HOST[:PORT] or mqtts://HOST[:PORT]")
        try:
            port = parts.port
        except ValueError:  # urllib's own message does not name the URL
            port = 0
        if port == 0:
            raise ValueError(f"broker URL {url!r}: the port must be a number in 1-65535")
        tls = parts.scheme == "mqtts"
        credentials = {"username": parts.username, "password": parts.password} if parts.username else {}
        return cls(parts.hostname, port or (8883 if tls else 1883), tls, **credentials, **options)

    def tls_context(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        context = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
        if self.cert_file:
            context.load_cert_chain(str(self.cert_file), str(self.key_file) if self.key_file else None)
        return context

    def __str__(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"


def publish_properties(expiry_s: int | None = None, correlation: bytes | None = None,
                       response_topic: str | None = None) -> Properties | None:
    """MQTT v5 properties of a PUBLISH: message expiry, correlation data, response topic."""
    if expiry_s is None and correlation is None and response_topic is None:
        return None
    properties = Properties(PacketTypes.PUBLISH)
    if expiry_s is not None:
        properties.MessageExpiryInterval = expiry_s
    if correlation is not None:
        properties.CorrelationData = correlation
    if response_topic is not None:
        properties.ResponseTopic = response_topic
    return properties


@dataclass
class FleetCounters:
    published: int = 0
    dropped: int = 0  # publishes while the broker was away (or timed out)
    received: int = 0
    handler_errors: int = 0
    connects: int = 0


class FleetConnection:
    def __init__(self, settings: BrokerSettings, client_id: str, will: aiomqtt.Will | None = None,
                 on_connect: Callable[[], Awaitable[None]] | None = None) -> None:
        self.settings = settings
        self.client_id = client_id
        self.will = will
        self.on_connect = on_connect
        self.counters = FleetCounters()
        self.connected = asyncio.Event()
        self._client: aiomqtt.Client | None = None
        self._handlers: list[tuple[str, Handler]] = []
        self._task: asyncio.Task | None = None
        self._outage_reported = False

    async def __aenter__(self) -> FleetConnection:
        self._task = asyncio.create_task(self._run(), name=f"mqtt-{self.client_id}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def subscribe(self, topic_filter: str, handler: Handler) -> None:
        """Route messages on `topic_filter` to `handler`, now and after every reconnect."""
        self._handlers.append((topic_filter, handler))
        if self._client is not None and self.connected.is_set():
            asyncio.get_running_loop().create_task(self._subscribe_quietly(topic_filter))

    async def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False,
                      properties: Properties | None = None) -> bool:
        """True when handed to the broker; False when dropped (no connection, or the broker is too slow)."""
        client = self._client
        if client is None or not self.connected.is_set():
            self.counters.dropped += 1
            return False
        try:
            await client.publish(topic, payload, qos=qos, retain=retain, properties=properties,
                                 timeout=self.settings.publish_timeout_s)
        except (aiomqtt.MqttError, asyncio.TimeoutError) as err:
            log.debug("publish to %s dropped: %s", topic, err)
            self.counters.dropped += 1
            return False
        self.counters.published += 1
        return True

    async def _run(self) -> None:
        delay = self.settings.reconnect_min_s
        while True:
            try:
                await self._session()
                delay = self.settings.reconnect_min_s
            except aiomqtt.MqttCodeError as err:
                self._lost(err, refused=True)
                delay = self.settings.reconnect_max_s  # bad credentials will not heal quickly
            except aiomqtt.MqttError as err:
                self._lost(err, refused=False)
            # Jitter: a fleet that lost its broker together must not come back in one burst.
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(self.settings.reconnect_max_s, delay * 2)

    async def _session(self) -> None:
        client = aiomqtt.Client(
            self.settings.host, self.settings.port, identifier=self.client_id,
            protocol=aiomqtt.ProtocolVersion.V5, will=self.will, keepalive=self.settings.keepalive_s,
            username=self.settings.username, password=self.settings.password,
            tls_context=self.settings.tls_context(), timeout=self.settings.publish_timeout_s * 2)
        async with client:
            self._client = client
            self.counters.connects += 1
            self._outage_reported = False
            log.info("fleet plane: connected to %s as %s", self.settings, self.client_id)
            for topic_filter, _ in self._handlers:
                await client.subscribe(topic_filter, qos=1)
            self.connected.set()
            try:
                if self.on_connect is not None:
                    await self.on_connect()
                async for message in client.messages:
                    await self._dispatch(message)
            finally:
                self.connected.clear()
                self._client = None

    async def _dispatch(self, message: aiomqtt.Message) -> None:
        self.counters.received += 1
        for topic_filter, handler in self._handlers:
            if message.topic.matches(topic_filter):
                try:
                    await handler(message)
                except Exception:  # a bad message or a bug in one handler must not end the connection
                    self.counters.handler_errors += 1
                    log.exception("fleet plane: handler for %s failed on %s", topic_filter, message.topic)
                return

    async def _subscribe_quietly(self, topic_filter: str) -> None:
        try:
            await self._client.subscribe(topic_filter, qos=1)
        except (aiomqtt.MqttError, AttributeError):
            pass  # the next connect subscribes again

    def _lost(self, err: Exception, refused: bool) -> None:
        """Say once per outage that the broker is gone (a retry loop must not flood the log)."""
        if self._outage_reported:
            log.debug("fleet plane: still no broker: %s", err)
        elif refused:
            log.error("fleet plane: broker %s refused %s (%s): check the --mqtt credentials; serving without it",
                      self.settings, self.client_id, err)
        else:
            log.warning("fleet plane: broker %s unreachable (%s); serving without it, retrying", self.settings, err)
        self._outage_reported = True
