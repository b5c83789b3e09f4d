"""``/api``: the admin API: cluster status, models, nodes, shard logs, accounts, sessions
and API keys."""

from llmgw.server.admin import accounts, keys, logs, models, nodes, status

ROUTES = [*status.ROUTES, *accounts.ROUTES, *keys.ROUTES, *nodes.ROUTES, *models.ROUTES,
          *logs.ROUTES]
