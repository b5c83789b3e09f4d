"""The engine build an operator chose per node (``llmgw ctl engine-build``, the admin API,
the cluster page): one row per node and engine, holding auto, a build name or none.

A row per choice rather than one JSON setting: each change is one atomic statement (an
upsert, or a delete to go back to server.yaml's word), so two operators choosing at once
on two servers never lose each other's choice. No foreign key to nodes: the choice is
the operator's, kept whether or not the node's registration has been written yet.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from sqlalchemy import String, delete, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Mapped, mapped_column

from llmgw.store.tables import Base


class EngineBuildRow(Base):
    __tablename__ = "engine_builds"

    node_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    engine: Mapped[str] = mapped_column(String(64), primary_key=True)
    build: Mapped[str] = mapped_column(String(64))


class EngineBuildMixin:
    """The operators' build choices; mixed into `Store`, which provides `_tx` and
    `_insert`."""

    _tx: Callable[..., AbstractAsyncContextManager[AsyncSession]]
    _insert: Callable

    async def engine_builds(self) -> dict[str, dict[str, str]]:
        """Every choice kept: node -> engine -> build."""
        found: dict[str, dict[str, str]] = {}
        async with self._tx() as s:
            for row in await s.scalars(select(EngineBuildRow).order_by(
                    EngineBuildRow.node_id, EngineBuildRow.engine)):
                found.setdefault(row.node_id, {})[row.engine] = row.build
        return found

    async def put_engine_build(self, node_id: str, engine: str, build: str | None) -> None:
        """Keep ``build`` as the node's choice of ``engine``; None forgets the choice."""
        if build is None:
            stmt = delete(EngineBuildRow).where(EngineBuildRow.node_id == node_id,
                                                EngineBuildRow.engine == engine)
        else:
            stmt = self._insert(EngineBuildRow).values(
                node_id=node_id, engine=engine, build=build).on_conflict_do_update(
                index_elements=[EngineBuildRow.node_id, EngineBuildRow.engine],
                set_={"build": build})
        async with self._tx() as s:
            await s.execute(stmt)
