"""The PD side of a worker: side-channel service, peer handshakes, leases, notifications.

Both PD roles run one :class:`PeerLink`. It answers peers on the side channel:

- ``hello``: this agent's NIXL metadata and where its KV cache lives, so a DE
  can READ a prefilled prompt's blocks straight out of the PE's KV cache;
- ``read`` (served by a DE for a PE): read hit chunks from the store into this
  engine's registered host buffer and lease them until the PE has pulled them.

- ``claim_hold`` (served by a PE for a DE, before the DE READs a hand-off's
  blocks): answered with a claim token and a deadline only while the hold
  lives and no other DE claimed it; the hold then lasts until that READ's
  notification or the claim's deadline, whichever is first. A claim that
  comes before its hold registered (the hold reaches this worker with the
  engine's next step) is answered when it does. NIXL READs are one-sided, so
  this is where a DE that comes after the hold ended (its blocks already
  another request's), or a second DE with the same hand-off, is refused: it
  recomputes the prompt instead of reading reused blocks.
- ``release_hold`` (served by a PE for a router): the DE named in a hand-off
  will not pull it (it refused the request, or the client went away), so the
  hold ends now, not at its lease. A claimed hold is the claimer's to end.

It handles two NIXL notification prefixes, registered with the agent's one
dispatcher (:mod:`nixl_backends.notifications`, shared with the store's):
``pulled:<req>:<claim token>`` from a DE's READ ends a PE's claimed hold
(``pulled:<req>:<hold token>``, from a DE with nothing to copy, ends an
unclaimed one); ``release:<lease>`` from a PE ends a DE's lease on its
buffer. NIXL notifications are not authenticated, so a hold ends only with a
secret (a ``pulled:`` without it, or for no hold here, is counted and ignored,
and kept at most a lease, in case its hold registers next), and a lease id is
itself a random secret. Every hold and lease has an expiry on this process's
monotonic clock, so a peer that vanishes never pins memory for good.

A DE's read answer says how long its lease has left, counted from when the
request came in (``lease_s``): the PE counts it from when it sent the request,
and reads the buffer only before then (:class:`~dualpath_connector.load.loaded_hit.RemoteBuffer`).

A lease taken with a keep token (the DE reads a hit for the PE that will hand
it the same prompt to decode) does not return its slots on release: they are
*kept* under the token until this engine's decode claims them
(:meth:`PeerLink.claim_kept`) or ``lease_s`` passes.

Every side-channel message is signed with the cluster key
(``DUALPATH_CLUSTER_KEY``, :mod:`dualpath_connector.pd.cluster_auth`): without it
a PD engine does not start, and a peer without it is served nothing.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from nixl_backends.buffers import HostBufferPool
from nixl_backends.notifications import dispatcher_for

from dualpath_connector.pd.cluster_auth import ClusterKey
from dualpath_connector.cache.kv_regions import KVRegions
from dualpath_connector.protocol import (
    OP_CLAIM_HOLD,
    OP_HELLO,
    OP_READ,
    OP_RELEASE_HOLD,
    PROTOCOL_VERSION,
    PULLED,
    RELEASE,
    VERSION_KEY,
    ClaimHold,
    HoldClaim,
    ProtocolError,
    ReadRequest,
    ReleaseHold,
    check_version,
    hello_message,
    new_hold_token,
    parse_pulled,
)
from dualpath_connector.pd.side_channel import SideChannelServer, decode_bytes, encode_bytes, rank_address
from dualpath_connector.pd.side_channel import request as side_channel_request

logger = logging.getLogger(__name__)

# Pull notifications and router releases kept (each) for a hold not registered yet: a flood of forged ones
# cannot grow memory past this.
_MAX_EARLY = 4096
# Tokens kept per request id for a pull that came before its hold: a forged one cannot displace the genuine.
_TOKENS_PER_EARLY_PULL = 4


class PeerLink:
    def __init__(
        self,
        agent,
        host: str,
        port: int,
        namespace_digest: str,
        local_kv: KVRegions,
        serve_read: Callable[[ReadRequest, Callable[[dict[str, Any]], None]], None],
        lease_s: float,
        claim_s: float = 30.0,
        cpu_affinity: set[int] | None = None,
        key: ClusterKey | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        # First: a PD engine without the cluster key must not start (ConfigError naming the variable).
        self._key = ClusterKey.from_env() if key is None else key
        self.agent = agent
        self.namespace_digest = namespace_digest
        self._local_kv = local_kv
        self._serve_read = serve_read
        self._lease_s = lease_s
        # How long a DE's claimed READ may take (PE); a claim waits at most half of it for its hold to register.
        self._claim_s = claim_s
        # This rank serves at port + tp_rank and talks to the same rank of every peer (side_channel.rank_address).
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._lock = threading.Lock()
        self._handshake_lock = threading.Lock()
        self._peers: dict[str, KVRegions] = {}
        # PE: requests whose blocks a DE may still pull; pulls reported (maybe before their hold registered).
        self._holds: dict[str, _Hold] = {}
        # Pulls of registered holds whose token matched on arrival: request id -> (token, time.monotonic()).
        self._pulled: dict[str, tuple[str, float]] = {}
        # Pulls naming no registered hold (one may finish before this engine's next step registers it): request
        # id -> (the tokens seen, at most _TOKENS_PER_EARLY_PULL, time.monotonic() of the first).
        self._early_pulled: dict[str, tuple[list[str], float]] = {}
        self._released_holds: set[str] = set()
        # Releases from the router (maybe before their hold registered: the hold reaches this worker with the
        # engine's next step, and a DE can refuse the request sooner) and holds that ended, each with its time
        # (time.monotonic()); both kept a lease, so a release can tell "not yet held" from "ended already".
        self._early_releases: dict[str, tuple[str, float]] = {}  # request id -> (hold token, time)
        # Claims that came before their hold registered, answered when it does (or refused after claim_s / 2),
        # and those answers waiting for the side channel's thread: a reply from another thread would leave a
        # socket of the side channel's context open in that thread.
        self._early_claims: dict[str, tuple[str, Callable[[dict[str, Any]], None], float]] = {}
        self._claim_answers: list[tuple[Callable[[dict[str, Any]], None], dict[str, Any]]] = []
        self.refused_claims = 0  # claims answered with a refusal (hold ended, claimed already, wrong token)
        self._ended_holds: dict[str, float] = {}
        self.forged_notifications = 0  # pulled: notifications that named no hold or carried the wrong token
        # DE: buffer slots lent to a PE, by lease; kept for this engine's decode after the release, by token.
        self._leases: dict[str, _Lease] = {}
        self._kept: dict[str, _Lease] = {}
        self._notifications = dispatcher_for(agent)
        self._notifications.register(PULLED, self._on_pulled)
        self._notifications.register(RELEASE, lambda message: self._released(message[len(RELEASE):].decode()))
        self._server = SideChannelServer(
            host, port + tp_rank, self._key,
            {OP_HELLO: self._hello, OP_READ: self._read, OP_RELEASE_HOLD: self._release_hold,
             OP_CLAIM_HOLD: self._claim_hold}, self._tick,
            cpu_affinity=cpu_affinity,
        )  # fmt: skip

    @property
    def rejected_messages(self) -> int:
        """Side-channel messages dropped unanswered (unauthenticated, stale, replayed or malformed)."""
        return self._server.rejected_messages

    # -- serving peers --------------------------------------------------------

    def _hello(self, message: dict[str, Any], reply: Callable[[dict[str, Any]], None]) -> None:
        check_version(message, "the peer")  # a ProtocolError is answered as an error naming both versions
        reply(
            {
                VERSION_KEY: PROTOCOL_VERSION,
                "agent": self.agent.name,
                "metadata": encode_bytes(self.agent.get_agent_metadata()),
                "namespace": self.namespace_digest,
                "kv": self._local_kv.to_wire(),
                "tp_rank": self.tp_rank,
                "tp_size": self.tp_size,
            }
        )

    def _read(self, message: dict[str, Any], reply: Callable[[dict[str, Any]], None]) -> None:
        check_version(message, "the peer")
        read = ReadRequest.from_message(message)
        if read.namespace != self.namespace_digest:
            # Different model/layout/rank: these bytes would be garbage there.
            reply({"error": f"namespace {read.namespace} is not this engine's ({self.namespace_digest})"})
            return
        self._serve_read(read, reply)

    def _release_hold(self, message: dict[str, Any], reply: Callable[[dict[str, Any]], None]) -> None:
        """``released``: the hold ended here; ``pending``: it has not registered yet and ends the moment it does."""
        release = ReleaseHold.from_message(message)
        req_id = release.remote_request_id
        with self._lock:
            hold = self._holds.get(req_id)
            # A claimed hold ends with its READ (or the claim's deadline): its DE may be reading it now.
            released = (hold is not None and hold.claim_token is None
                        and hmac.compare_digest(hold.token, release.hold_token))  # fmt: skip
            pending = (hold is None and req_id not in self._ended_holds
                       and len(self._early_releases) < _MAX_EARLY)  # fmt: skip
            if released:
                self._end_hold(req_id)
            elif pending:
                self._early_releases[req_id] = (release.hold_token, time.monotonic())
        if released:
            logger.info("request %s: its DE will not pull it; blocks released", req_id)
        reply({"released": released, "pending": pending})

    def _claim_hold(self, message: dict[str, Any], reply: Callable[[dict[str, Any]], None]) -> None:
        claim = ClaimHold.from_message(message)
        req_id = claim.remote_request_id
        with self._lock:
            if (req_id not in self._holds and req_id not in self._ended_holds and req_id not in self._early_claims
                    and len(self._early_claims) < _MAX_EARLY):  # fmt: skip
                self._early_claims[req_id] = (claim.hold_token, reply, time.monotonic())
                return
            answer = self._grant(req_id, claim.hold_token)
        reply(answer)

    def _grant(self, req_id: str, token: str) -> dict[str, Any]:
        """Under the lock: the answer to a claim of ``req_id``'s hold with ``token``; granted at most once."""
        hold = self._holds.get(req_id)
        push = token == ""  # a push hand-off's claim (ClaimHold): signed by a cluster engine, no token to match
        if hold is None:
            refusal = "no hold (it ended, or never registered here)"
        elif not push and not hmac.compare_digest(hold.token, token):
            refusal = "the wrong hold token"
        elif hold.claim_token is not None:
            refusal = "claimed already (the hand-off was pulled once)"
        elif hold.expires_at < time.monotonic():
            refusal = "its lease ended"
        else:
            claim = HoldClaim(new_hold_token(), self._claim_s, list(hold.block_ids) if push else None)
            if push:
                logger.info("request %s: its hold claimed by request id (a push-mode proxy's DE)", req_id)
            # From now on only the claimer's READ (or the claim's end) ends the hold: the blocks are its.
            self._holds[req_id] = dataclasses.replace(hold, expires_at=time.monotonic() + claim.claim_s,
                                                      claim_token=claim.claim_token)  # fmt: skip
            return claim.to_message()
        self.refused_claims += 1
        logger.warning("request %s: a DE's claim of its hold refused: %s", req_id, refusal)
        return {"error": f"hold of request {req_id}: {refusal}"}

    def _end_hold(self, req_id: str) -> None:
        """Under the lock: the hold is over; vLLM frees its blocks after this engine's next step."""
        self._holds.pop(req_id, None)
        self._released_holds.add(req_id)
        self._ended_holds[req_id] = time.monotonic()

    def lease(
        self, pool: HostBufferPool, slots: list[int], since: float, keep_token: str | None = None,
        chunk_hashes: list[str] = (),
    ) -> tuple[str, float]:
        """Lend ``slots`` of ``pool`` to a peer until it sends ``release:<lease>`` or the lease expires.

        Returns the lease id and the seconds from ``since`` (time.monotonic():
        when the peer's request came in) to its end, never more: the peer
        counts them from sending the request, and reads the slots only until then.
        With ``keep_token``, the release keeps the slots (holding
        ``chunk_hashes``, one per slot) for :meth:`claim_kept`.
        """
        lease = uuid.uuid4().hex
        with self._lock:
            expires_at = time.monotonic() + self._lease_s
            self._leases[lease] = _Lease(pool, slots, expires_at, keep_token, list(chunk_hashes))
        return lease, expires_at - since

    @property
    def kept_slots(self) -> int:
        """Buffer slots a PE released that are kept for this engine's decodes."""
        with self._lock:
            return sum(len(kept.slots) for kept in self._kept.values())

    def claim_kept(self, keep_token: str) -> tuple[HostBufferPool, list[int], list[str]] | None:
        """The slots kept under ``keep_token`` and the chunk each holds, now the caller's to release; None if gone.

        Also before the PE's release arrived: the PE handed the prompt on only
        after its prefill, so it reads these slots no more.
        """
        with self._lock:
            kept = self._kept.pop(keep_token, None)
            if kept is None:
                lease = next((k for k, v in self._leases.items() if v.keep_token == keep_token), None)
                kept = self._leases.pop(lease) if lease is not None else None
        if kept is None:
            return None
        return kept.pool, kept.slots, kept.chunk_hashes

    # -- PE holds -------------------------------------------------------------

    def hold(self, req_id: str, expires_at: float, token: str, block_ids: list[int], retained: bool = False) -> None:
        """Keep a finished prefill's blocks for its DE until pulled (with ``token``) or ``expires_at`` (time.time());
        ``retained``: a DE's finished decode, kept the same way for the conversation's next PE.

        ``expires_at`` comes from the scheduler's process on the wall clock; it is kept on the monotonic one.
        """
        with self._lock:
            early = self._early_releases.pop(req_id, None)
            claim = self._early_claims.pop(req_id, None)
            pulled = self._early_pulled.pop(req_id, None)
            if pulled is not None:
                matched = [t for t in pulled[0] if hmac.compare_digest(t, token)]
                self.forged_notifications += len(pulled[0]) - len(matched)
                if matched:
                    self._pulled[req_id] = (token, pulled[1])
            released = early is not None and hmac.compare_digest(early[0], token)
            if released:
                self._end_hold(req_id)
            else:
                if early is not None:
                    self.forged_notifications += 1
                    logger.warning("request %s: a release with the wrong hold token; ignored", req_id)
                self._holds[req_id] = _Hold(time.monotonic() + (expires_at - time.time()), token, tuple(block_ids),
                                            retained=retained)  # fmt: skip
            if claim is not None:
                self._claim_answers.append((claim[1], self._grant(req_id, claim[0])))
        if released:
            logger.info("request %s: released before its hold registered; blocks released", req_id)

    @property
    def held_blocks(self) -> int:
        """KV blocks this PE holds for DEs to pull."""
        with self._lock:
            return sum(len(hold.block_ids) for hold in self._holds.values())

    def take_released_holds(self) -> set[str]:
        """Holds ended since the last call: pulled by the DE, released by the router, or expired."""
        with self._lock:
            done, self._released_holds = self._released_holds, set()
        return done

    # -- notifications and expiry (side-channel thread) -----------------------

    def _tick(self) -> None:
        # Reading notifications also progresses UCX, which a peer's READ of
        # memory lent out here may need (TCP emulates RMA with messages).
        self._notifications.poll()
        now = time.monotonic()
        with self._lock:
            answers, self._claim_answers = self._claim_answers, []
            for req_id, hold in list(self._holds.items()):
                pulled = self._pulled.pop(req_id, None)
                # A claimed hold ends with its claimer's READ; an unclaimed one with the hand-off's token.
                token = hold.claim_token if hold.claim_token is not None else hold.token
                if pulled is not None and not hmac.compare_digest(pulled[0], token):
                    self.forged_notifications += 1
                    logger.warning("request %s: a pulled notification with the wrong token; ignored", req_id)
                    pulled = None
                if pulled is None and hold.expires_at >= now:
                    continue
                if pulled is None and hold.retained:
                    # A conversation that had no next turn in time (or a front door that does not hand it on).
                    logger.info("request %s: no PE pulled its retained decode; blocks released", req_id)
                elif pulled is None:
                    logger.warning("request %s: no DE pulled its KV within the lease; blocks released", req_id)
                self._end_hold(req_id)
            # A pull or a release for no hold registers next step at the latest; one older than a lease names none.
            for early in (self._early_pulled, self._early_releases):
                for req_id in [r for r, (_, at) in early.items() if now - at > self._lease_s]:
                    del early[req_id]
                    self.forged_notifications += 1
            for req_id in [r for r, (_, _, at) in self._early_claims.items() if now - at > self._claim_s / 2]:
                answers.append((self._early_claims.pop(req_id)[1],
                                {"error": f"no hold registered here within {self._claim_s / 2:.1f}s"}))
                self.refused_claims += 1
            while self._ended_holds:  # in the order they ended: the oldest first
                req_id, at = next(iter(self._ended_holds.items()))
                if now - at <= self._lease_s:
                    break
                del self._ended_holds[req_id]
            expired = {k: self._leases.pop(k) for k in [k for k, v in self._leases.items() if v.expires_at < now]}
            expired_kept = {k: self._kept.pop(k) for k in [k for k, v in self._kept.items() if v.expires_at < now]}
        for reply, answer in answers:
            reply(answer)
        for lease, held in expired.items():
            logger.warning("buffer lease %s expired before the PE released it", lease)
            held.pool.release(held.slots)
        for token, kept in expired_kept.items():
            logger.info("kept hit %s (%d chunks) expired before its decode request came", token, len(kept.slots))
            kept.pool.release(kept.slots)

    def _on_pulled(self, message: bytes) -> None:
        """A DE's READ ended. Checked against its hold as it arrives, so that no number of forged notifications
        can crowd out a genuine one: only a matching token is kept for a registered hold."""
        parsed = parse_pulled(message)
        with self._lock:
            if parsed is None:
                self.forged_notifications += 1
                return
            req_id, token = parsed
            hold = self._holds.get(req_id)
            if hold is not None:
                if hmac.compare_digest(token, hold.claim_token if hold.claim_token is not None else hold.token):
                    self._pulled[req_id] = (token, time.monotonic())
                else:
                    self.forged_notifications += 1
                return
            early = self._early_pulled.get(req_id)
            if early is None:
                if len(self._early_pulled) >= _MAX_EARLY:  # the oldest goes: a genuine early one lives one step
                    del self._early_pulled[next(iter(self._early_pulled))]
                    self.forged_notifications += 1
                self._early_pulled[req_id] = ([token], time.monotonic())
            elif len(early[0]) < _TOKENS_PER_EARLY_PULL:
                early[0].append(token)
            else:
                self.forged_notifications += 1

    def _released(self, lease: str) -> None:
        """The PE is done with a lease: keep its slots for the decode if asked to, else free them."""
        with self._lock:
            held = self._leases.pop(lease, None)
            if held is not None and held.keep_token is not None:
                token = held.keep_token
                # A token seen twice (a peer's bug): the older slots are freed, never lost.
                older = self._kept.get(token)
                self._kept[token] = dataclasses.replace(held, expires_at=time.monotonic() + self._lease_s)
                held = older
        if held is not None:
            held.pool.release(held.slots)

    # -- talking to peers -----------------------------------------------------

    def peer(self, address: str, timeout_s: float) -> KVRegions:
        """The peer at ``address`` (side channel ``host:port``), handshaking once."""
        # Several DE-side reads may ask at once: one handshake, one remote agent.
        with self._handshake_lock:
            return self._known_peer(address) or self._handshake(address, timeout_s)

    def _known_peer(self, address: str) -> KVRegions | None:
        with self._lock:
            return self._peers.get(address)

    def _handshake(self, address: str, timeout_s: float) -> KVRegions:
        answer = self.request(address, hello_message(), timeout_s)
        check_version(answer, f"the engine at {address}")
        # An engine that predates tensor-parallel PD is one rank.
        ranks = (answer.get("tp_rank", 0), answer.get("tp_size", 1))
        if ranks != (self.tp_rank, self.tp_size):
            raise ProtocolError(
                f"the engine at {address} answered as TP rank {ranks[0]} of tensor parallel size {ranks[1]}, "
                f"this is rank {self.tp_rank} of {self.tp_size}: PD hand-offs need the same size on both sides"
            )
        # Validated before NIXL sees the peer: a bad answer adds no remote agent.
        regions = KVRegions.from_wire(answer.get("kv"), "")
        name = self.agent.add_remote_agent(decode_bytes(answer["metadata"]))
        peer = dataclasses.replace(regions, agent=name if isinstance(name, str) else name.decode())
        with self._lock:
            self._peers[address] = peer
        return peer

    def request(self, address: str, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """One side-channel request to this rank of the engine at ``address``, signed with this engine's cluster key."""
        return side_channel_request(rank_address(address, self.tp_rank), message, timeout_s, self._key)

    def claim(self, address: str, remote_request_id: str, hold_token: str, timeout_s: float) -> tuple[HoldClaim, float]:
        """Claim the PE's hold on a hand-off before READing it: the claim, and the time.monotonic() by which that
        READ must have ended (counted from sending the claim, before the PE's own deadline). Raises
        :class:`~dualpath_connector.pd.side_channel.SideChannelError` if the PE refuses (the hold is gone or taken)."""
        sent = time.monotonic()
        claim = HoldClaim.from_message(self.request(address, ClaimHold(remote_request_id, hold_token).to_message(),
                                                    timeout_s))  # fmt: skip
        return claim, sent + claim.claim_s

    def forget(self, address: str) -> None:
        """Drop a peer after a failure; the next use handshakes again (it may have restarted)."""
        with self._lock:
            peer = self._peers.pop(address, None)
        if peer is not None:
            try:
                self.agent.remove_remote_agent(peer.agent)
            except Exception as exc:
                logger.debug("removing peer agent %s: %s", peer.agent, exc)

    def notify(self, peer_agent: str, message: bytes) -> None:
        try:
            self.agent.send_notif(peer_agent, message)
        except Exception as exc:  # the peer's own expiry covers a lost message
            logger.warning("could not notify peer %s: %s", peer_agent, exc)

    def close(self) -> None:
        self._server.stop()
        for prefix in (PULLED, RELEASE):
            self._notifications.unregister(prefix)


@dataclasses.dataclass(frozen=True)
class _Hold:
    """A PE's finished prefill held for its DE: until ``expires_at`` (time.monotonic()) or a pull naming ``token``
    (``claim_token`` once a DE claimed it)."""

    expires_at: float
    token: str
    block_ids: tuple[int, ...]  # named in a push hand-off's claim; counted in the held-blocks gauge
    claim_token: str | None = None
    retained: bool = False  # a DE's finished decode for the next turn's PE (RetainedDecode)


@dataclasses.dataclass
class _Lease:
    """Buffer slots lent to a PE (or kept for this engine's decode) until ``expires_at`` (time.monotonic())."""

    pool: HostBufferPool
    slots: list[int]
    expires_at: float
    keep_token: str | None = None
    # The chunk each slot holds (kept leases only).
    chunk_hashes: list[str] = dataclasses.field(default_factory=list)
