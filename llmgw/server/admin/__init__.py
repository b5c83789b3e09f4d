"""``/api``: the admin API: cluster status, models, nodes, shard logs, accounts, sessions,
API keys and the nodes' upgrades."""

from llmgw.server.admin import (
    accounts,
    engine_builds,
    keys,
    logs,
    models,
    nodes,
    status,
    upgrade,
)

ROUTES = [*status.ROUTES, *accounts.ROUTES, *keys.ROUTES, *nodes.ROUTES,
          *engine_builds.ROUTES, *models.ROUTES, *logs.ROUTES, *upgrade.ROUTES]
