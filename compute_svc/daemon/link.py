"""The connection to one cache daemon: what Attach returned, the shared slot table (read-only)
and this client's own region (its ledger: the pins taken there, and its channel), handed over
the daemon's handoff socket, and the one Demand stream.

Every piece of that state has this one owner; the acquire/release side
(``compute_svc.daemon.client.DaemonClient``) and its transports (``compute_svc.daemon.transport``)
read it, under ``lock``. A dropped stream loses the
ledger too (the daemon reclaims it, with its pins); the next stream re-Attaches for a new one,
which is also where a restarted daemon is detected.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from collections.abc import Callable
from typing import NamedTuple

import grpc
from moe.cache.v1 import cache_pb2, cache_pb2_grpc

from compute_svc.daemon.demand_stream import DemandStream
from compute_svc.daemon.wire import Attachment, attachment_from_pb, error_from_rpc
from compute_svc.errors import DaemonUnavailable, FailedPrecondition
from expertcache import handoff, memfd, native
from expertcache.arena_handle import ArenaKind
from expertcache.errors import ExpertCacheError
from expertcache.protocol import CLIENT_EPOCH_KEY, CLIENT_INDEX_KEY

logger = logging.getLogger(__name__)

StaleClient = native.StaleClient  # RuntimeError: the daemon reclaimed our ledger


class HandedBack(NamedTuple):
    """A layer a native span handed back (``native.SpanDemand.handed_back``): on ``stream``, its
    resident experts ``hits`` pinned in the ledger at ``slots`` (not yet in ``held``) and demand
    ``seq`` posted for ``misses`` (the channel's ``fail_seq`` was ``fail_seen`` then), waited for
    ``elapsed_s`` already. The layer's acquire adopts it (``DaemonClient.acquire_batches``)."""

    stream: DemandStream
    layer: int
    seq: int
    fail_seen: int
    hits: list[int]
    slots: list[int]
    misses: list[int]
    elapsed_s: float


class SpanDemands:
    """What native spans' demands leave on the link: the ``native.SpanDemand`` of the span running
    now (``running``: stopped by ``DaemonLink.wake_channel``, an interrupt or the stream's end) and
    the layer one handed back (``handed_back``) until its acquire adopts it."""

    __slots__ = ("handed_back", "running")

    def __init__(self) -> None:
        self.running: native.SpanDemand | None = None
        self.handed_back: HandedBack | None = None

    def stop(self) -> None:
        running = self.running
        if running is not None:
            running.stop()


class DaemonLink:
    """Attach's answer, the slot table and ledger (fast path), and the current Demand stream."""

    def __init__(
        self, address: str, channel: grpc.Channel, attachment: Attachment, *, fast_path: bool
    ) -> None:
        self.address = address
        self.attachment = attachment
        self.fast_path = fast_path
        self.lock = threading.Lock()  # the client's calls, its signals and the stream's changes
        # The shared slot table (fast path only); bound to the ledger of the current stream.
        self.table: native.SlotTable | None = None
        self.shm_channel: native.ClientChannel | None = None  # the ledger's channel (demands, signals)
        self._ledger: tuple[int, int] | None = None  # (index, epoch) for the next stream
        self.held: dict[tuple[int, int], int] = {}  # (layer, expert) -> pins taken in the ledger
        self._channel = channel
        self._stub = cache_pb2_grpc.ExpertCacheStub(channel)
        self.stream: DemandStream | None = None
        self._streams_opened = 0
        self.spans = SpanDemands()
        # Told when the Demand stream ends on its own (the daemon died or ended it), so the
        # service can stop serving and re-attach without waiting for a request to fail.
        self.on_stream_end: Callable[[str], None] | None = None
        # Called with each new stream (lock held), before anything else travels on it: the
        # signals re-announce the running requests there.
        self.on_open: Callable[[DemandStream], None] | None = None
        self.attachment = self._take_handoff(attachment, attachment.handoff_socket, attachment.handoff_token)
        if fast_path and self.table is None:
            logger.warning(
                "cache daemon at %s offers no shared slot table: every acquire goes through Demand", address
            )

    def _take_handoff(self, attachment: Attachment, socket_path: str, token: bytes) -> Attachment:
        """Trade Attach's token for what the daemon hands over: the arena (a memfd, mapped
        read-only: returned in ``attachment.arena_memory`` unless this daemon's arena is mapped
        already), and with a ledger, the table (read-only) and our region (ours alone)."""
        needs_arena = attachment.arena.kind is ArenaKind.MEMFD and attachment.arena_memory is None
        if not token or not socket_path:
            if needs_arena:
                raise FailedPrecondition(
                    f"the cache daemon at {self.address} has a CPU arena but offered no handoff socket to get it"
                )
            return attachment
        try:
            payload, fds = handoff.receive(socket_path, token)
        except ExpertCacheError as exc:
            raise FailedPrecondition(
                f"cannot get the arena and slot table from the cache daemon's handoff socket {socket_path}: "
                f"{exc} (is its socket directory mounted in this container?)"
            ) from None
        try:
            granted = json.loads(payload)
            names = granted["descriptors"]
            expected = (["arena"] if attachment.arena.kind is ArenaKind.MEMFD else []) + (
                ["table", "region"] if attachment.client_index >= 0 else []
            )
            if names != expected or len(fds) != len(names):
                raise FailedPrecondition(
                    f"the cache daemon's handoff at {socket_path} sent {len(fds)} descriptors named {names}, "
                    f"expected {expected}"
                )
            handed = dict(zip(names, fds, strict=True))
            if needs_arena:
                try:
                    memory = memfd.map_readonly(
                        handed["arena"], attachment.arena.size_bytes, "the cache daemon's arena"
                    )
                except memfd.MemfdError as exc:
                    raise FailedPrecondition(str(exc)) from None
                attachment = dataclasses.replace(attachment, arena_memory=memory)
            if "table" in handed:
                if granted.get("client_index") != attachment.client_index:
                    raise FailedPrecondition(
                        f"the cache daemon's handoff at {socket_path} sent ledger {granted.get('client_index')}, "
                        f"expected {attachment.client_index}"
                    )
                self._bind_region(
                    handed["table"], handed["region"], attachment.client_index, int(granted["client_epoch"])
                )
        except (ValueError, KeyError, TypeError) as exc:
            raise FailedPrecondition(
                f"the cache daemon's handoff at {socket_path} answered badly: {exc}"
            ) from None
        finally:
            for fd in fds:
                os.close(fd)  # the mappings keep what they need
        return attachment

    def _bind_region(self, table_fd: int, region_fd: int, index: int, epoch: int) -> None:
        """Map the table (read-only) and our ledger's region for the fast path."""
        try:
            table = native.SlotTable.attach(table_fd, region_fd, index, epoch)
        except StaleClient as exc:
            raise DaemonUnavailable(f"cache daemon at {self.address}: {exc}") from None
        except (OSError, RuntimeError, ValueError) as exc:
            raise FailedPrecondition(f"cannot map the cache daemon's slot table: {exc}") from None
        manifest = self.attachment.manifest
        if table.num_entries != manifest.num_layers * manifest.num_experts:
            raise FailedPrecondition(
                f"the cache daemon's slot table has {table.num_entries} entries, expected "
                f"{manifest.num_layers} layers x {manifest.num_experts} experts"
            )
        self.table = table
        self.shm_channel = table.channel(index)
        self._ledger = (index, epoch)

    def open_locked(self) -> DemandStream:
        """The open Demand stream; a new one (tied to the ledger) if there is none."""
        if self.stream is not None and self.stream.ended and self.table is not None:
            # Hits never read the stream: notice here that it ended (daemon gone or restarted).
            self.drop_locked(self.stream)
        if self.stream is None:
            if self._streams_opened:
                self._check_same_daemon()
            metadata: tuple[tuple[str, str], ...] = ()
            if self.table is not None:
                index, epoch = self._ledger
                metadata = ((CLIENT_INDEX_KEY, str(index)), (CLIENT_EPOCH_KEY, str(epoch)))
            self.stream = DemandStream(
                self._stub, metadata, on_end=self._stream_ended, wake=self.wake_channel
            )
            self._streams_opened += 1
            if self.on_open is not None:
                self.on_open(self.stream)
            logger.debug("opened a Demand stream to %s", self.address)
        return self.stream

    def _attach(self, shm_fast_path: bool) -> cache_pb2.AttachResponse:
        try:
            return self._stub.Attach(
                cache_pb2.AttachRequest(client_name="compute_svc", shm_fast_path=shm_fast_path), timeout=10
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, self.address) from None

    def _check_same_daemon(self) -> None:
        """After a broken stream: a restarted daemon has a new arena, so our mapping is stale."""
        reply = self._attach(shm_fast_path=self.table is not None)  # a ledger only if we map one
        if reply.daemon_id != self.attachment.daemon_id:
            # Slots of the new daemon index an arena this process has not mapped: reading them
            # would compute with the wrong bytes. The service re-attaches (reattach) and maps it.
            raise DaemonUnavailable(
                f"cache daemon at {self.address} restarted (id {self.attachment.daemon_id} -> {reply.daemon_id}): "
                "re-attaching to its new arena"
            )
        if self.table is not None:
            # The old ledger went with its stream; the new one comes with a region of its own.
            self.table, self.shm_channel, self._ledger = None, None, None
        if reply.client_index >= 0:  # our new region (and the arena again, mapped already: closed)
            answered = dataclasses.replace(self.attachment, client_index=reply.client_index)
            self._take_handoff(answered, reply.handoff_socket, reply.handoff_token)

    def wake_channel(self) -> None:
        self.spans.stop()  # a span's own wait hands its layer back to the checks below
        channel = self.shm_channel
        if channel is not None:
            channel.notify()  # a wait for the daemon's answer sees the stream ended (or an interrupt)

    def _stream_ended(self, reason: str) -> None:
        if self.on_stream_end is not None:
            self.on_stream_end(f"cache daemon at {self.address}: {reason}")

    def drop(self, stream: DemandStream) -> None:
        with self.lock:
            self.drop_locked(stream)

    def drop_locked(self, stream: DemandStream) -> None:
        stream.close()
        if self.spans.handed_back is not None and self.spans.handed_back.stream is stream:
            self.spans.handed_back = None  # its pins and its demand go with the ledger
        if self.stream is stream:
            self.stream = None
            self.held.clear()  # the daemon reclaims the stream's ledger with its shm pins

    def reattach(self) -> Attachment:
        """Attach again: a new arena, slot table and ledger (see ``DaemonClient.reattach``)."""
        with self.lock:
            if self.stream is not None:
                self.drop_locked(self.stream)
            attachment = attachment_from_pb(self._attach(shm_fast_path=self.fast_path), self.address)
            if attachment.manifest.model_id != self.attachment.manifest.model_id:
                raise FailedPrecondition(
                    f"the cache daemon at {self.address} now serves model {attachment.manifest.model_id}, "
                    f"not {self.attachment.manifest.model_id}: restart compute with its store"
                )
            self.attachment = attachment
            self.table, self._ledger, self.shm_channel = None, None, None
            self.held.clear()
            self._streams_opened = 0
            self.attachment = attachment = self._take_handoff(
                attachment, attachment.handoff_socket, attachment.handoff_token
            )
            if self.table is not None:
                self.open_locked()
        logger.info(
            "re-attached to cache daemon %s at %s: %d slots",
            attachment.daemon_id,
            self.address,
            attachment.num_slots,
        )
        return attachment

    def close(self) -> None:
        with self.lock:
            if self.stream is not None:
                self.stream.close()
                self.stream = None
            self.spans.handed_back = None
            self.shm_channel = None  # nothing serves it any more: later signals are dropped
        self._channel.close()
