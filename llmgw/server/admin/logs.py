"""``/api/replicas/{replica}/logs``: a shard's engine output, streamed from its node.

The output lives on the node that runs the shard. This server asks that node's agent for
it over the node's agent stream (wire.ShardLogRequest) and relays the answer as plain
text; ``server.agents.shard_logs`` bounds what it holds for a slow reader. Only the
leader holds the nodes' streams, so only the leader answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated

from litestar import get
from litestar.di import NamedDependency
from litestar.params import FromPath, Parameter
from litestar.response import Stream

from llmgw import wire
from llmgw.core.names import shard_unit
from llmgw.server.admin.common import ADMIN
from llmgw.server.agents.shard_logs import PendingLog, ShardLogs, TooManyLogStreams
from llmgw.server.controller import Controller
from llmgw.server.errors import ApiError, refusals

TAIL_DEFAULT = 64 * 1024
TAIL_MAX = 1024 * 1024  # what an agent sends at most
# A node that says nothing for this long after being asked is not going to.
FIRST_ANSWER_S = 10.0
_SHOWN_REPLICAS = 20

# Bounds checked by the handler, which says what is wrong; the document states them.
RankParam = Parameter(schema_extra={"minimum": 0}, description="the shard's rank")
TailParam = Parameter(schema_extra={"minimum": 0, "maximum": TAIL_MAX},
                      description="how many of the last bytes of output to send first")


@get("/api/replicas/{replica:str}/logs", **ADMIN, media_type="text/plain; charset=utf-8",
     responses=refusals(400, 401, 403, 404, 503, 504))
async def replica_logs(replica: FromPath[str], controller: NamedDependency[Controller],
                       rank: Annotated[int, RankParam] = 0, follow: bool = False,
                       tail: Annotated[int, TailParam] = TAIL_DEFAULT) -> Stream:
    """The engine output of one shard of a replica, as text: its last ``tail`` bytes
    (default 65536, at most 1048576, from the first whole line in them), then, with
    ``follow=true``, what the engine writes next, until the client goes away or the shard
    stops. ``rank`` picks the shard (default 0). When the output ends for another reason
    than the client's, a last line says why: ``-- llmgw: … --``."""
    pending, first = await open_shard_log(controller, replica, rank, tail, follow)
    return Stream(_relay(controller.shard_logs, pending, first),
                  media_type="text/plain; charset=utf-8",
                  headers={"cache-control": "no-store", "x-content-type-options": "nosniff"})


async def open_shard_log(controller: Controller, replica: str, rank: int, tail: int,
                         follow: bool) -> tuple[PendingLog, str]:
    """Ask the node that runs shard ``rank`` of ``replica`` for its output: the request,
    open in ``controller.shard_logs`` (the caller closes it), and its first piece. Every
    reason it cannot be asked is an ApiError saying what to do."""
    if rank < 0:
        raise ApiError(400, f"rank must be 0 or more, not {rank}", param="rank",
                       code="invalid_value")
    if not 0 <= tail <= TAIL_MAX:
        raise ApiError(400, f"tail must be 0 to {TAIL_MAX} bytes (1 MiB), not {tail}",
                       param="tail", code="invalid_value")
    if not controller.holds_lead:
        raise ApiError(503, f"{controller.not_leading()}: ask the leader, which holds the "
                       "nodes' streams", code="not_leader")
    found = controller.replicas.get(replica)
    if found is None:
        known = sorted(controller.replicas)
        listed = ", ".join(known[:_SHOWN_REPLICAS]) + (
            f" and {len(known) - _SHOWN_REPLICAS} more" if len(known) > _SHOWN_REPLICAS
            else "")
        raise ApiError(404, f"no replica {replica!r}; " + (
            f"the replicas are: {listed} (llmgw ctl status lists them)" if known
            else "there are no replicas"), code="replica_not_found")
    if rank >= found.world_size:
        raise ApiError(400, f"replica {replica} has no rank {rank}: its ranks are 0 to "
                       f"{found.world_size - 1}", param="rank", code="rank_out_of_range")
    shard = found.shard(rank)
    if shard is None:
        raise ApiError(503, f"rank {rank} of replica {replica} is not placed on a node yet "
                       f"(the replica is {found.state.value}): no output to show",
                       code="shard_not_placed")
    node, where = shard.node_id, f"shards/{shard_unit(replica, rank)}.log"
    session = controller.sessions.get(node)
    if session is None or session.outbox is None:
        state = session.state.value if session is not None else "never registered"
        raise ApiError(503, f"rank {rank} of replica {replica} runs on node {node}, which "
                       f"is not connected ({state}); its output is on the node, in the "
                       f"agent's state directory: {where}", code="node_not_connected")
    if wire.FEATURE_SHARD_LOGS not in session.register.features:
        version = session.register.agent_version or "unknown"
        raise ApiError(503, f"node {node}'s agent (version {version}) is too old to send "
                       f"logs: upgrade it, or read {where} in its state directory",
                       code="agent_too_old")
    registry = controller.shard_logs
    try:
        pending = registry.open(node, session.connection)
    except TooManyLogStreams as err:
        raise ApiError(503, str(err), code="too_many_log_streams") from None
    try:
        if not controller.sessions.send(node, wire.ShardLogRequest(
                request=pending.request, replica=replica, rank=rank, tail_bytes=tail,
                follow=follow)):
            raise ApiError(503, f"node {node} disconnected just now; ask again once it is "
                           "back", code="node_not_connected")
        try:
            first = await pending.next(FIRST_ANSWER_S)
        except TimeoutError:
            raise ApiError(504, f"node {node} did not answer for the output of replica "
                           f"{replica} rank {rank} within {FIRST_ANSWER_S:g} s; its agent's "
                           "log may say why", code="node_timeout") from None
        if first is None and pending.ended:
            raise ApiError(404, f"node {node}: {pending.ended}", code="log_not_found")
    except BaseException:
        registry.close(pending)
        raise
    return pending, first or ""


async def shard_log_tail(controller: Controller, replica: str, rank: int, tail: int,
                         timeout_s: float = FIRST_ANSWER_S) -> str:
    """The last ``tail`` bytes of a shard's output, whole (not followed), with the line
    that says why it ended, if not cleanly; the cluster page shows it."""
    pending, first = await open_shard_log(controller, replica, rank, tail, follow=False)
    text, why = first, ""
    try:
        async with asyncio.timeout(timeout_s):
            while (piece := await pending.next()) is not None:
                text += piece
        why = pending.ended or ""
    except TimeoutError:
        why = f"node {pending.node} sent no more within {timeout_s:g} s"
    finally:
        controller.shard_logs.close(pending)
    if why:
        gap = "" if not text or text.endswith("\n") else "\n"
        text += f"{gap}-- llmgw: {why} --\n"
    return text


async def _relay(registry: ShardLogs, pending: PendingLog, first: str
                 ) -> AsyncIterator[bytes]:
    """The output as it comes, then why it ended (when not by the client's leaving)."""
    last = first
    try:
        if first:
            yield first.encode()
        while (piece := await pending.next()) is not None:
            if piece:
                last = piece
                yield piece.encode()
        if pending.ended:
            newline = "" if not last or last.endswith("\n") else "\n"
            yield f"{newline}-- llmgw: {pending.ended} --\n".encode()
    finally:
        registry.close(pending)


ROUTES = [replica_logs]
